"""Multi-device data parallelism on the frameworks' own engines (docs/multi_device.md).

* JAX: a batch of each distribution sharded over 2 forced host devices with ``jax.sharding``
  (``Mesh``, ``NamedSharding``) inside ``jax.jit`` gives the single-device numbers (log_prob,
  mean, marginals, entropy, a sample with a fixed key, gradients through log_prob and through
  the reparameterised sample), its outputs stay sharded, and no batch-sized data crosses
  devices (``tests/multi_device_jax_check.py``).
* PyTorch: ``DistributedDataParallel`` with the gloo backend, 2 processes on localhost:
  the averaged gradients through log_prob and rsample equal the single-process gradient of
  the full batch (``tests/multi_device_torch_ddp.py``).

Each runs as a script in a fresh interpreter: the JAX device count is fixed when JAX
starts (and this session has started it), and the DDP ranks are processes of their own. The
script runs in a new process group, killed whole on a timeout or an error, so that no rank
outlives the test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 300


def _run_script(name: str, *args: str) -> list[dict]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["XLA_FLAGS"] = " ".join(
        filter(None, [env.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=2"])
    )
    # One thread per process (2 ranks, or JAX beside the test's own process on 2 cores).
    env["OMP_NUM_THREADS"] = "1"
    # Compiled as the rest of the suite is (tests/conftest.py): with or without LLVM's
    # optimisations, both the sharded and the single-device program.
    if jax.config.read("jax_disable_most_optimizations"):
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / name), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the ranks die with it
    )
    try:
        stdout, stderr = process.communicate(timeout=TIMEOUT_S)
    finally:
        # Whatever happened (a timeout, an interrupt, or a clean exit that left a rank
        # behind), nothing of the group survives the test.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError:
        pytest.fail(f"{name} exited {process.returncode} without a report:\n{stderr[-4000:]}")
    failed = [entry for entry in report if not entry["ok"]]
    assert not failed, json.dumps(failed, indent=1)
    assert process.returncode == 0, stderr[-4000:]
    return report


def test_jax_sharded_batch_matches_single_device():
    report = _run_script("multi_device_jax_check.py", "float64")
    # Every distribution and output was compared (a report cannot pass by being empty).
    cases = {entry["case"] for entry in report}
    for name in (
        "exactly_k",
        "linear_constrained",
        "linear_constrained_pathwise",
        "conditioned_poisson",
    ):
        for output in ("log_prob", "mean", "marginals", "entropy", "sample"):
            assert f"float64['{name}']['per_example']['{output}']" in cases
        for loss in ("of_log_prob_loss", "of_sample_loss"):
            assert f"float64['{name}']['weight_gradient']['{loss}']['w']" in cases
    assert "float64 collectives" in cases


def test_torch_ddp_gloo_gradients_match_full_batch():
    report = _run_script("multi_device_torch_ddp.py")
    heads = {entry["case"].split(".")[0] for entry in report if "." in entry["case"]}
    assert heads == {"logits", "loc", "scale", "loc_pathwise", "log_rate"}
