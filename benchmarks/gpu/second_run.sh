#!/bin/bash
# Run from the repository root on the device machine, with the wheels of pyro-ppl 1.9.2,
# pyro-api 0.1.2 and numpyro 0.22.0 in .whl/ (benchmarks/README.md, "On a GPU").
# Second device run: the fixed accelerator tests (all five classes, traced replays on CUDA),
# the NumPyro LCN test file on the GPU, and the batch-256 tables the first run lost.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false HYPOTHESIS_PROFILE=ci
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=short"
el tests
(JAX_PLATFORMS=cuda,cpu timeout -s INT -k 10 140 $PT tests/test_linear_constrained_normal_numpyro.py -n 4 > $OUT/jax_lcn_gpu.log 2>&1; echo "rc=$?" >> $OUT/jax_lcn_gpu.log) &
timeout -s INT -k 10 140 $PT tests/test_accelerators.py -n 10 -rs > $OUT/accel.log 2>&1; echo "rc=$?" >> $OUT/accel.log
wait
for f in accel jax_lcn_gpu; do echo "== $f"; tail -4 $OUT/$f.log; done
B=$OUT/bench.txt; b() { local t=$1; shift; el "$*" | tee -a $B; timeout $t python3 -m benchmarks.$* --device cuda >> $B 2>&1; echo "rc=$?" >> $B; }
b 95 exactly_k --packages jax --sizes 1000,10000,100000 --ks 10,n/2 --no-accuracy
b 40 exactly_k --packages torch --dtypes float64 --sizes 1000,10000,100000 --ks 10,n/2 --no-accuracy
b 50 exactly_k --scaling --packages jax --no-compile --previous-limit 0 --stop-after 2 --max-n 1e6
el done | tee -a $B
