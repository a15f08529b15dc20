"""Data parallelism over 2 forced host devices: sharded distributions compute unsharded numbers.

Run by ``tests/test_multi_device.py`` in a fresh interpreter, because the number of host
devices is fixed when JAX initialises (``XLA_FLAGS=--xla_force_host_platform_device_count=2``)
and the test session has imported JAX already. Standalone::

    PYTHONPATH=$PWD python tests/multi_device_jax_check.py [float64|float32 ...]

The pattern is the ordinary data-parallel one: a model's weights are replicated on every
device, a batch of features is sharded along its first axis over a 1-D mesh, and the
distributions' parameters (logits / loc, scale / rate, and k) are computed from them inside
``jax.jit``, so that XLA's sharding propagation splits the batch of distributions over the
devices. One jitted program computes, for ExactlyKBernoulli, LinearConstrainedNormal (both
gradient estimators) and ConditionedPoisson:

* per example: log_prob of given values, mean, the marginals' parameters, entropy, and a
  sample with a fixed key;
* the gradients, with respect to the replicated weights, of a loss through log_prob and of
  a loss through the reparameterised sample (sums over the batch).

It is compiled twice, for single-device inputs and for batch-sharded inputs, and run on
both. Checks, each an entry of the JSON report on stdout (exit status 1 if any failed):

* the sharded results equal the single-device ones to a few ulps (the arithmetic is the
  same; XLA may vectorise a half batch differently from a whole one);
* every per-example output is sharded along the batch as the inputs are (``.sharding``
  equivalent to ``NamedSharding(mesh, P("batch"))``, each device holding half the rows),
  and the weight gradients are replicated;
* the compiled sharded program moves no batch-sized data between devices: its only
  collectives are all-reduces of scalar predicates (a batch-wide stopping rule of a while
  loop or the branch of a cond: one byte, a synchronisation point), of other scalars and
  of arrays of the weights' shapes (the per-device gradient sums that data parallelism
  must add up).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

# Must precede the first import of jax: the device count is fixed when its backend starts.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_enable_x64", True)

from numpyro_constrained import (  # noqa: E402
    ConditionedPoisson,
    ExactlyKBernoulli,
    LinearConstrainedNormal,
)

# Sizes chosen distinct from one another, so that a collective on batch-sized data cannot
# pass for one on a weight (checked by shape).
BATCH, FEATURES, N, ROWS = 8, 3, 6, 2
K_MAX = 6  # static bound on the traced k (sizes the exactly-k tables, the Poisson sampler)
COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter", "all-reduce")


# Each builder maps (weights, features, k) to a batch of BATCH distributions: the weights
# are replicated, the features (BATCH, FEATURES) and k are sharded along the batch.
def exactly_k(weights, x, k):
    return ExactlyKBernoulli(logits=x @ weights["w"] + weights["b"], k=k, k_max=K_MAX)


def _loc_scale(weights, x):
    return x @ weights["w"] + weights["b"], jax.nn.softplus(x @ weights["v"]) + 0.1


def linear_constrained(weights, x, k):
    return LinearConstrainedNormal(*_loc_scale(weights, x), A=weights["A"], k=k)


def linear_constrained_pathwise(weights, x, k):
    loc, scale = _loc_scale(weights, x)
    return LinearConstrainedNormal(loc, scale, A=weights["A"], k=k, grad_estimator="pathwise")


def conditioned_poisson(weights, x, k):
    return ConditionedPoisson(jnp.exp(x @ weights["w"] + weights["b"]), k=k, k_max=K_MAX)


BUILDERS = (exactly_k, linear_constrained, linear_constrained_pathwise, conditioned_poisson)


def problem(builder, dtype, rng):
    """(weights, k, value) for one builder: ``value`` lies in every batch element's support."""
    weights = {"w": rng.normal(size=(FEATURES, N)), "b": rng.normal(size=N)}
    if builder is exactly_k:
        k = np.array([0, 1, 2, 3, 5, 6, 2, 4])
        value = np.zeros((BATCH, N))
        for i, ki in enumerate(k):
            value[i, rng.permutation(N)[:ki]] = 1.0
        return _as(weights, dtype), jnp.asarray(k), jnp.asarray(value, dtype)
    if builder is conditioned_poisson:
        k = np.array([0.0, 1.0, 3.0, 5.0, 2.0, 4.0, 1.0, 5.0])
        value = np.stack([rng.multinomial(int(ki), np.ones(N) / N) for ki in k])
        return _as(weights, dtype), jnp.asarray(k, dtype), jnp.asarray(value, dtype)
    weights["v"] = rng.normal(size=(FEATURES, N))
    A = np.stack([np.ones(N), np.arange(N) - 2.0])  # one A shared by the batch
    weights["A"] = A
    k = rng.normal(size=(BATCH, ROWS))  # one right-hand side per example
    # Points of {z : A z = k}: the minimum-norm solution plus a null-space component.
    null_space = np.linalg.svd(A)[2][ROWS:]
    value = np.linalg.lstsq(A, k.T, rcond=None)[0].T + rng.normal(size=(BATCH, N - ROWS)) @ (
        null_space
    )
    return _as(weights, dtype), jnp.asarray(k, dtype), jnp.asarray(value, dtype)


def _as(weights, dtype):
    return {name: jnp.asarray(w, dtype) for name, w in weights.items()}


def marginal_parameters(d):
    """The parameters of ``d.marginals`` (Bernoulli probs / Normal loc and scale / Binomial
    probs), stacked on a last axis."""
    m = d.marginals
    if isinstance(d, LinearConstrainedNormal):
        return jnp.stack([m.loc, m.scale], -1)
    return m.probs[..., None]


@jax.jit
def run(weights, x, k, value, key):
    out = {}
    for builder in BUILDERS:
        name = builder.__name__

        def log_prob_loss(w, builder=builder, name=name):
            return -builder(w, x, k[name]).log_prob(value[name]).sum()

        def sample_loss(w, builder=builder, name=name):
            # Through the reparameterised sample (straight-through or pathwise).
            z = builder(w, x, k[name]).sample(key)
            return jnp.sum((z - value[name]) ** 2 * jnp.arange(1, N + 1, dtype=z.dtype))

        d = builder(weights[name], x, k[name])
        out[name] = {
            "per_example": {
                "log_prob": d.log_prob(value[name]),
                "mean": d.mean,
                "marginals": marginal_parameters(d),
                "entropy": d.entropy(),
                "sample": d.sample(key),
            },
            "weight_gradient": {
                "of_log_prob_loss": jax.grad(log_prob_loss)(weights[name]),
                "of_sample_loss": jax.grad(sample_loss)(weights[name]),
            },
        }
    return out


_COLLECTIVE = re.compile(
    r"= (?P<type>\(.*?\)|\S+) (?P<op>" + "|".join(COLLECTIVES) + r")(-start)?\("
)


def collectives(hlo_text: str) -> list[tuple[str, list[str]]]:
    """(op, the element types of its result, layouts dropped) for every collective of an
    optimised HLO module; XLA combines small all-reduces into one with a tuple result."""
    return [
        (m["op"], re.findall(r"[a-z]+[0-9]*\[[0-9,]*\]", m["type"]))
        for m in _COLLECTIVE.finditer(hlo_text)
    ]


def _hlo_types(array) -> set[str]:
    """``f64[3,6]`` and ``f64[6,3]``: XLA may reduce a weight's gradient transposed."""
    return {
        f"f{array.dtype.itemsize * 8}[{','.join(map(str, shape))}]"
        for shape in (array.shape, array.shape[::-1])
    }


def _at(tree, path):
    for entry in path:
        tree = tree[entry.key]
    return tree


def check(dtype, mesh) -> list[dict]:
    rng = np.random.default_rng(0)
    batch_sharded = NamedSharding(mesh, P("batch"))
    replicated = NamedSharding(mesh, P())
    weights, k, value = {}, {}, {}
    for builder in BUILDERS:
        name = builder.__name__
        weights[name], k[name], value[name] = problem(builder, dtype, rng)
    x = jnp.asarray(rng.normal(size=(BATCH, FEATURES)), dtype)
    key = jax.random.key(7)
    start = time.perf_counter()
    expected = run(
        *jax.device_put((weights, x, k, value, key), SingleDeviceSharding(jax.devices()[0]))
    )
    sharded = (
        jax.device_put(weights, replicated),
        *jax.device_put((x, k, value), batch_sharded),
        jax.device_put(key, replicated),
    )
    compiled = run.lower(*sharded).compile()
    got = jax.block_until_ready(compiled(*sharded))
    seconds = time.perf_counter() - start
    label = np.dtype(dtype).name
    eps = float(np.finfo(dtype).eps)
    report = []
    for path, want in jax.tree_util.tree_leaves_with_path(expected):
        have = _at(got, path)
        failures = []
        if have.dtype != want.dtype or have.shape != want.shape:
            failures.append(f"{have.dtype}{have.shape}, unsharded {want.dtype}{want.shape}")
        else:
            scale = max(1.0, float(np.max(np.abs(want))))
            error = float(np.max(np.abs(np.asarray(have) - np.asarray(want))))
            if not np.all(np.isfinite(want)) or error > 16 * eps * scale:
                failures.append(f"max |sharded - unsharded| = {error:.3g} (scale {scale:.3g})")
        if path[1].key == "per_example":
            if not have.sharding.is_equivalent_to(batch_sharded, have.ndim):
                failures.append(f"sharding {have.sharding}, wanted {batch_sharded}")
            rows = sorted({shard.data.shape[0] for shard in have.addressable_shards})
            if rows != [BATCH // 2]:
                failures.append(f"shards of {rows} rows, wanted {BATCH // 2}")
        elif not have.sharding.is_fully_replicated:
            failures.append(f"sharding {have.sharding}, wanted replicated")
        case = f"{label}{jax.tree_util.keystr(path)}"
        report.append({"case": case, "ok": not failures, "failures": failures})
    # Scalars: predicates, and sums over the batch of the cotangent of a replicated
    # intermediate (LinearConstrainedNormal's log det(A A^T) term, a function of A alone).
    allowed = {"pred[]", f"f{np.dtype(dtype).itemsize * 8}[]"}
    allowed |= {t for ws in weights.values() for w in ws.values() for t in _hlo_types(w)}
    found = collectives(compiled.as_text())
    unexpected = [
        f"{op} of {types}" for op, types in found if op != "all-reduce" or set(types) - allowed
    ]
    report.append(
        {
            "case": f"{label} collectives",
            "ok": not unexpected,
            "failures": unexpected,
            "collectives": sorted({f"{op} of {', '.join(types)}" for op, types in found}),
            "seconds": round(seconds, 2),
        }
    )
    return report


def main(dtypes: list[str]) -> int:
    if jax.device_count() != 2:
        print(json.dumps([{"case": "devices", "ok": False, "failures": [str(jax.devices())]}]))
        return 1
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    report = [entry for dtype in dtypes for entry in check(np.dtype(dtype), mesh)]
    print(json.dumps(report, indent=1))
    return 0 if all(entry["ok"] for entry in report) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["float64"]))
