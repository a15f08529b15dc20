#!/bin/bash
# Run from the repository root on the device machine, with the wheels of pyro-ppl 1.9.2,
# pyro-api 0.1.2 and numpyro 0.22.0 in .whl/ (benchmarks/README.md, "On a GPU").
# Issue 33 device run. Phase 1: accelerator tests and the class test files on the GPU, in
# parallel. Phase 2: the benchmark tables, one at a time on an otherwise idle GPU.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false HYPOTHESIS_PROFILE=ci
DEV=${DEV:-cuda}; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if [ -z "$SKIP_PIP" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3; fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks/gpu
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
  python3 -c "import sys,torch,jax,jaxlib,numpyro,pyro,numpy,scipy;print(sys.version);print('torch',torch.__version__,torch.version.cuda,torch.cuda.is_available() and torch.cuda.get_device_name());print('jax',jax.__version__,jaxlib.__version__,jax.devices());print('numpyro',numpyro.__version__,'pyro',pyro.__version__,'numpy',numpy.__version__,'scipy',scipy.__version__)"; } > $OUT/env.txt 2>&1
cat $OUT/env.txt
JF="tests/test_exactly_k_bernoulli_numpyro.py tests/test_linear_constrained_normal_numpyro.py tests/test_conditioned_poisson_numpyro.py"
TF="tests/test_exactly_k_bernoulli_pyro.py tests/test_linear_constrained_normal_pyro.py tests/test_conditioned_poisson_pyro.py"
TO="timeout -s INT -k 15 ${TTEST:-170}"; PT="python3 -m pytest -q -p no:cacheprovider -rfE --tb=line"
[ "$DEV" = cuda ] && JP="cuda,cpu" || JP=cpu; [ "$DEV" = cuda ] && TP="-p torch_cuda_default" || TP=""
el tests
(JAX_PLATFORMS=$JP $TO $PT $JF -n 5 > $OUT/jax_class_gpu.log 2>&1; echo "rc=$?" >> $OUT/jax_class_gpu.log) &
($TO $PT $TF -n 3 $TP > $OUT/torch_class_cuda.log 2>&1; echo "rc=$?" >> $OUT/torch_class_cuda.log) &
$TO $PT tests/test_accelerators.py -n 6 -rs --tb=short > $OUT/accel.log 2>&1; echo "rc=$?" >> $OUT/accel.log
wait
for f in accel jax_class_gpu torch_class_cuda; do echo "== $f"; tail -3 $OUT/$f.log; done
B=$OUT/bench.txt; b() { local t=$1; shift; el "$*" | tee -a $B; timeout $t python3 -m benchmarks.$* --device $DEV >> $B 2>&1; echo "rc=$?" >> $B; }
b 30 linear_constrained_normal
b 30 conditioned_poisson
b 25 regression_head
b ${TEK:-90} exactly_k --sizes 1000,10000,100000 --ks 10,n/2 --max-reference-n 10000 --no-accuracy
b 35 exactly_k --scaling --only-compile --previous-limit 0
b ${TSC:-70} exactly_k --scaling --no-compile --previous-limit 0 --stop-after 3
el done | tee -a $B
