"""ConditionedPoisson against torch.distributions.Multinomial, same inputs, same run.

Run from the repository root: ``python -m benchmarks.conditioned_poisson`` (``--device
cuda`` runs both packages on the accelerator: ``benchmarks/devices.py``).

Times ``entropy``, ``log_prob`` and ``sample`` for batch 256, n = 1000, k = 100 (best of
several repeats, one thread), prints each ratio Multinomial / ConditionedPoisson (above 1:
ConditionedPoisson is faster), then compares the entropies' accuracy against
``scipy.stats.multinomial(k, p).entropy()`` on the first rows of the batch, and times the
jitted NumPyro version as well.
"""

import argparse

import numpy as np
import torch
from scipy import stats

from benchmarks import devices
from pyro_constrained import ConditionedPoisson

BATCH, N, K = 256, 1000, 100
REPEATS = 7
ACCURACY_ROWS = 8


def best_time(function, repeats=REPEATS):
    return devices.best_time(function, repeats)


def torch_comparison(dtype):
    torch.manual_seed(0)
    rate = torch.rand(BATCH, N, dtype=dtype) + 0.01
    ours = ConditionedPoisson(rate, k=K)
    reference = torch.distributions.Multinomial(K, probs=rate / rate.sum(-1, keepdim=True))
    value = reference.sample()
    rows = []
    for name, mine, theirs in [
        ("entropy", ours.entropy, reference.entropy),
        ("log_prob", lambda: ours.log_prob(value), lambda: reference.log_prob(value)),
        ("sample", ours.sample, reference.sample),
    ]:
        time_ours, time_reference = best_time(mine), best_time(theirs)
        rows.append((name, time_ours, time_reference))
        print(
            f"  {name:9s} ConditionedPoisson {time_ours * 1e3:8.2f} ms   "
            f"Multinomial {time_reference * 1e3:8.2f} ms   ratio {time_reference / time_ours:6.2f}x"
        )
    return ours, reference


def accuracy(ours, reference):
    rate = ours.rate.double()
    probs = (rate / rate.sum(-1, keepdim=True)).cpu().numpy()
    exact = np.array([stats.multinomial(K, p).entropy() for p in probs[:ACCURACY_ROWS]])
    for name, values in [
        ("ConditionedPoisson", ours.entropy()),
        ("Multinomial", reference.entropy()),
    ]:
        error = np.abs(values[:ACCURACY_ROWS].double().cpu().numpy() - exact) / np.abs(exact)
        print(f"  {name:18s} max relative error vs scipy: {error.max():.2e}")


def jax_timing():
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    from numpyro_constrained import ConditionedPoisson as JaxConditionedPoisson

    rate = jnp.asarray(np.random.default_rng(0).random((BATCH, N)) + 0.01)
    distribution = JaxConditionedPoisson(rate, k=K)
    value = distribution.sample(jax.random.PRNGKey(0))
    log_prob = jax.jit(lambda d, v: d.log_prob(v))
    sample = jax.jit(lambda d, key: d.sample(key))
    key = jax.random.PRNGKey(1)
    for name, function in [
        ("entropy (eager window)", lambda: distribution.entropy().block_until_ready()),
        ("log_prob (jit)", lambda: log_prob(distribution, value).block_until_ready()),
        ("sample (jit)", lambda: sample(distribution, key).block_until_ready()),
    ]:
        print(f"  {name:24s} {best_time(function) * 1e3:8.2f} ms")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    devices.add_device_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    packages = devices.use_device(args.device, ["torch", "jax"])
    print(
        f"batch {BATCH}, n = {N}, k = {K}; best of {REPEATS}; ratio = Multinomial / ours; "
        f"{devices.describe(args.device)}"
    )
    for dtype in (torch.float64, torch.float32) if "torch" in packages else ():
        print(f"torch {dtype}:")
        ours, reference = torch_comparison(dtype)
        print(f"  entropy accuracy ({dtype}, first {ACCURACY_ROWS} rows):")
        accuracy(ours, reference)
    if "jax" in packages:
        print("NumPyro ConditionedPoisson, float64 (no NumPyro Multinomial entropy to compare):")
        jax_timing()


if __name__ == "__main__":
    main()
