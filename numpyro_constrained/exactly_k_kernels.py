"""Numerical kernels of ExactlyKBernoulli (docs/distributions/exactly_k_bernoulli.md), JAX.

Pure functions of ``logits`` (shape ``batch + (n,)``, entries finite or ``-inf``), ``k``
(integer array of shape ``batch``, ``0 <= k <= number of finite logits``) and ``k_max`` (a
Python int, ``max(k) <= k_max <= n``; tables are truncated at it). The distribution calls
only these functions; ``+inf`` logits and feasibility are handled by the caller. All of them
work under ``jax.jit``, ``jax.vmap`` and ``jax.grad``, and are jitted themselves (``k_max`` and
``sample_shape`` static) so that eager calls compile once per shape.

Method: the same as ``pyro_constrained.exactly_k_kernels`` (whose docstring states it), in
modules of the same names: the tilt (``exactly_k_tilt``), the upward and downward passes
with every table rescaled by a power of two (``exactly_k_tree``), the convolutions, direct
or by FFT (``exactly_k_convolution``), the sampler (``exactly_k_draw``) and the values
computed from the normaliser's parts (``exactly_k_values``); docs/numerics.md, "The
exactly-k kernels", has the accuracy argument and the list of what differs from torch, each
difference forced by JAX (static shapes, compile time).

Compilation (JAX only): the public functions are thin wrappers around jitted ones
(``k_max`` and ``sample_shape`` static). They pad n with ``-inf`` logits to a size bucket
(``_bucket``) and round ``k_max`` up to a power of two, then cut the outputs back to n, so
an eager loop whose n or k varies compiles once per bucket. They do the same inside a
caller's ``jit``/``grad``/``vmap``: the padded tables fix the random numbers a sample
consumes, so a key draws the same sample eagerly and under jit.
"""

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from numpyro_constrained import exactly_k_small as _small
from numpyro_constrained import exactly_k_tangent as _tangent
from numpyro_constrained.exactly_k_draw import _draw
from numpyro_constrained.exactly_k_tilt import count, tilt
from numpyro_constrained.exactly_k_tree import _marginals_from, _prepare, flatten
from numpyro_constrained.exactly_k_values import (
    NormalizerParts,
    _parts_from,
    _zero_parts,
    cross_entropy_value,
    kl_value,
    log_constraint_prob_value,
    log_normalizer_value,
    log_prob_value,
    wide_dtype,
)

__all__ = [
    "CountTable",
    "NormalizerParts",
    "count",
    "count_log_probs",
    "cross_entropy_value",
    "kl_value",
    "log_constraint_prob_value",
    "log_normalizer",
    "log_normalizer_value",
    "log_prob_value",
    "marginals",
    "marginals_and_complements",
    "normalizer_parts",
    "sample",
    "sample_and_marginals",
    "sample_straight_through",
    "tilt",
    "wide_dtype",
]


# Eager calls pad n with -inf logits (never selected, so nothing changes) to a size bucket
# and round k_max up to a power of two, so that a loop whose n or k varies compiles once per
# bucket: sizes up to _SMALLEST_BUCKET share one bucket, powers of two up to
# _FINE_BUCKETS_FROM, then also 1.5 times a power of two (at most a third of padding), and
# above _FINEST_BUCKETS_FROM eight buckets per octave (at most an eighth of padding: there
# the padded leaves' run time outweighs a compilation).
_SMALLEST_BUCKET = 16
_FINE_BUCKETS_FROM = 1024
_FINEST_BUCKETS_FROM = 65536


def _bucket(size: int) -> int:
    """The padded size of a bucket of sizes (see ``_SMALLEST_BUCKET``)."""
    if size <= _SMALLEST_BUCKET:
        return _SMALLEST_BUCKET
    power = 1 << (size - 1).bit_length()
    per_octave = 1 if size <= _FINE_BUCKETS_FROM else 2 if size <= _FINEST_BUCKETS_FROM else 8
    step = power // (2 * per_octave)  # sizes in (power / 2, power] round up to a multiple
    return -(-size // step) * step


def _to_bucket(logits, k_max: int):
    """(logits, k_max, n): the logits padded with -inf to the bucket of n (variables that
    are never selected: every quantity of the others is unchanged, and the padded ones get
    marginal 0 and are cut off again), k_max rounded up to a power of two (a wider
    truncation changes nothing), and n to cut the outputs back to. Traced logits (inside a
    caller's jit, grad or vmap) are padded too: the tables, and so the random numbers a
    sample consumes, must not depend on whether the caller jitted, or a key would draw
    different samples eagerly and under jit."""
    logits = jnp.asarray(logits)
    n = logits.shape[-1]
    size = _bucket(n)
    if k_max > 0:
        k_max = min(1 << (k_max - 1).bit_length(), size)
    if size > n:
        logits = _pad_to(logits, size)
    return logits, k_max, n


# Jitted (one dispatch each, compiled once per pair of sizes): an eager jnp.pad is several
# dispatched operations, which cost more than the kernels themselves at n = 1000.
@partial(jax.jit, static_argnums=1)
def _pad_to(logits: jax.Array, size: int) -> jax.Array:
    padding = [(0, 0)] * (logits.ndim - 1) + [(0, size - logits.shape[-1])]
    return jnp.pad(logits, padding, constant_values=-jnp.inf)


@partial(jax.jit, static_argnums=1)
def _cut_to(out: jax.Array, n: int) -> jax.Array:
    return out[..., :n]


def _cut(out: jax.Array, n: int | None) -> jax.Array:
    return out if n is None or out.shape[-1] == n else _cut_to(out, n)


def normalizer_parts(logits: jax.Array, k: jax.Array, k_max: int) -> NormalizerParts:
    """The parts of ``log e_k(exp logits)`` (see ``NormalizerParts``), from one upward pass."""
    logits, k_max, _ = _to_bucket(logits, k_max)
    # Not the small path, whatever the size: under jit its log-space upward pass (an exp
    # and a log per window term) made log_prob plus gradient slower than these kernels at
    # every size measured but batch 1, n = 10 (benchmarks/README.md, "Small sites").
    return _normalizer_parts(logits, k, k_max)


@partial(jax.jit, static_argnames="k_max")
def _normalizer_parts(logits: jax.Array, k: jax.Array, k_max: int) -> NormalizerParts:
    logits = lax.stop_gradient(logits)
    if k_max == 0:
        return _zero_parts(logits)
    flat_k, c, weights, root, levels, exponent, fft = _prepare(logits, jnp.asarray(k), k_max, False)
    parts = _parts_from(logits, flat_k, c, root, exponent)
    if fft is None:  # no FFT level: the marginals' own upward pass would be this one
        parts = parts._replace(marginals=_KeptPass(flat_k, weights, root, levels))
    return parts


@jax.tree_util.register_pytree_node_class
class _KeptPass:
    """An upward pass kept by ``normalizer_parts``; called, the marginals (flattened to
    (batch, n), no gradient) by one downward pass over it. A pytree whose children are the
    tables and whose structure holds the Python values among them (the levels' padding, the
    top loop's node count), decided once here, so that it passes through ``jit`` and
    ``custom_jvp`` as arrays only, whatever JAX puts in the children's places."""

    def __init__(self, flat_k, weights, root, levels):
        leaves, structure = jax.tree_util.tree_flatten((flat_k, weights, root, levels))
        static = tuple(leaf if isinstance(leaf, (bool, int)) else None for leaf in leaves)
        self._structure = (structure, static)
        self._children = [leaf for leaf, value in zip(leaves, static, strict=True) if value is None]

    def __call__(self) -> jax.Array:
        structure, static = self._structure
        children = iter(self._children)
        leaves = [next(children) if value is None else value for value in static]
        flat_k, weights, root, levels = jax.tree_util.tree_unflatten(structure, leaves)
        return lax.stop_gradient(_marginals_from(flat_k, weights, root, levels, None))

    def tree_flatten(self):
        return self._children, self._structure

    @classmethod
    def tree_unflatten(cls, structure, children):
        kept = object.__new__(cls)
        kept._structure, kept._children = structure, list(children)
        return kept


@partial(jax.custom_jvp, nondiff_argnums=(2,))
def _log_normalizer(logits: jax.Array, k: jax.Array, k_max: int, parts) -> jax.Array:
    return log_normalizer_value(logits, k, parts).astype(logits.dtype)


@_log_normalizer.defjvp
def _log_normalizer_jvp(k_max, primals, tangents):
    logits, k, parts = primals
    d_logits = tangents[0]
    value = _log_normalizer(logits, k, k_max, parts)
    if parts.marginals is None:
        mu = _marginals(logits, k, k_max)
    else:  # one downward pass over the parts' upward pass
        mu = _marginals_of_kept_pass(logits, k, k_max, parts.marginals)
    return value, (mu * d_logits).sum(-1)


@partial(jax.custom_jvp, nondiff_argnums=(2,))
def _marginals_of_kept_pass(logits, k, k_max: int, kept: _KeptPass) -> jax.Array:
    """``_marginals(logits, k, k_max)`` from the kept pass of ``logits``' parts, with the
    marginals' own derivative (so that second derivatives of the normaliser are right)."""
    return kept().reshape(logits.shape)


@_marginals_of_kept_pass.defjvp
def _marginals_of_kept_pass_jvp(k_max, primals, tangents):
    logits, k, _ = primals
    return jax.jvp(lambda x: _marginals(x, k, k_max), (logits,), (tangents[0],))


def log_normalizer(
    logits: jax.Array, k: jax.Array, k_max: int, parts: NormalizerParts | None = None
) -> jax.Array:
    """log e_k(exp logits), shape ``batch``; its derivative is ``marginals`` (differentiable
    again, without NaN at ``-inf`` logits). ``parts``: from ``normalizer_parts``, if the
    caller has them already."""
    logits, k_max, _ = _to_bucket(logits, k_max)
    return _log_normalizer_jit(logits, k, k_max, parts)


@partial(jax.jit, static_argnames="k_max")
def _log_normalizer_jit(logits, k, k_max: int, parts):
    k = jnp.broadcast_to(jnp.asarray(k), logits.shape[:-1])
    if parts is None:
        parts = _normalizer_parts(logits, k, k_max)
    return _log_normalizer(logits, k, k_max, parts)


def marginals(logits: jax.Array, k: jax.Array, k_max: int) -> jax.Array:
    """mu_i = P(z_i = 1 | sum z = k) = d log e_k(exp logits) / d logits_i, shape
    ``batch + (n,)``; differentiable again."""
    logits, k_max, n = _to_bucket(logits, k_max)
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _cut(_small.marginals(logits, k, k_max), n)
    return _cut(_marginals(logits, k, k_max), n)


@partial(jax.jit, static_argnames="k_max")
def _marginals(logits: jax.Array, k: jax.Array, k_max: int) -> jax.Array:
    if k_max == 0:
        return jnp.zeros_like(logits)
    # Its derivative is the tangent pass of exactly_k_tangent, which reverse mode transposes
    # at about the cost of a forward derivative.
    return _tangent.marginals(*flatten(logits, k), k_max).reshape(logits.shape)


def marginals_and_complements(
    logits: jax.Array, k: jax.Array, k_max: int
) -> tuple[jax.Array, jax.Array]:
    """(``marginals``, ``1 - marginals`` without rounding: from the leaves' off-weights, no
    gradient), so that a marginal near 1 keeps the relative precision of its complement."""
    logits, k_max, n = _to_bucket(logits, k_max)
    mu, complement = (
        _small.marginals_and_complements(logits, k, k_max)
        if _small.applies(logits, k_max)  # small n: see exactly_k_small
        else _marginals_and_complements(logits, k, k_max)
    )
    return _cut(mu, n), _cut(complement, n)


@partial(jax.jit, static_argnames="k_max")
def _marginals_and_complements(logits, k, k_max: int):
    if k_max == 0:
        return jnp.zeros_like(logits), jnp.ones_like(logits)
    flat_k, _, weights, root, levels, _, fft = _prepare(logits, jnp.asarray(k), k_max, True)
    mu, complement = _marginals_from(flat_k, weights, root, levels, fft, with_complements=True)
    return mu.reshape(logits.shape), complement.reshape(logits.shape)


def _sample_and_maybe_marginals(key, logits, k, k_max, sample_shape, with_marginals):
    sample_shape = tuple(sample_shape)
    out_shape = sample_shape + logits.shape
    if k_max == 0:
        return jnp.zeros(out_shape, logits.dtype), jnp.zeros_like(logits)
    num_samples = 1
    for size in sample_shape:
        num_samples *= size
    flat_k, _, weights, root, levels, _, fft = _prepare(
        logits, jnp.asarray(k), k_max, with_marginals
    )
    detached = [
        level._replace(left=lax.stop_gradient(level.left), right=lax.stop_gradient(level.right))
        for level in levels
    ]
    counts = _draw(key, flat_k, detached, num_samples)
    z = counts.astype(logits.dtype).reshape(out_shape)
    mu = None
    if with_marginals:
        mu = _marginals_from(flat_k, weights, root, levels, fft).reshape(logits.shape)
    return z, mu


def sample(
    key: jax.Array, logits: jax.Array, k: jax.Array, k_max: int, sample_shape: tuple = ()
) -> jax.Array:
    """Exact draws, shape ``sample_shape + batch + (n,)``, entries 0.0 / 1.0 summing to k.
    No gradient."""
    logits, k_max, n = _to_bucket(logits, k_max)
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        return _cut(_small.sample(key, logits, k, k_max, tuple(sample_shape)), n)
    return _cut(_sample(key, logits, k, k_max, tuple(sample_shape)), n)


@partial(jax.jit, static_argnames=("k_max", "sample_shape"))
def _sample(key, logits, k, k_max: int, sample_shape: tuple):
    logits = lax.stop_gradient(logits)
    return _sample_and_maybe_marginals(key, logits, k, k_max, sample_shape, False)[0]


def sample_straight_through(
    key: jax.Array, logits: jax.Array, k: jax.Array, k_max: int, sample_shape: tuple = ()
) -> jax.Array:
    """Exact draws (the values of ``sample``) whose derivative is that of ``marginals``,
    broadcast over ``sample_shape``: the straight-through estimator ``z + mu -
    stop_gradient(mu)`` as a ``custom_jvp``, so that a caller who does not differentiate
    never computes the marginals (``jit`` of a sample compiles and runs the upward pass and
    the draw only), and one who does gets both from one upward pass
    (``sample_and_marginals``)."""
    logits, k_max, n = _to_bucket(logits, k_max)
    if _small.applies(logits, k_max):  # small n: see exactly_k_small
        z = _small.sample_straight_through(key, logits, k, k_max, tuple(sample_shape))
        return _cut(z, n)
    return _cut(_straight_through_sample(key, logits, k, k_max, tuple(sample_shape)), n)


@partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _straight_through_sample(key, logits, k, k_max: int, sample_shape: tuple):
    return _sample(key, logits, k, k_max, sample_shape)


@_straight_through_sample.defjvp
def _straight_through_sample_jvp(k_max, sample_shape, primals, tangents):
    key, logits, k = primals

    if _tangent.serves(k_max):
        # The marginals' own rule (exactly_k_tangent), whose reverse mode is cheap, at the
        # cost of a second upward pass for the draw.
        z = _sample(key, logits, k, k_max, sample_shape)
        _, d_mu = jax.jvp(lambda x: _marginals(x, k, k_max), (logits,), (tangents[1],))
        return z, jnp.broadcast_to(d_mu, z.shape)

    def draw_and_marginals(logits):  # one upward pass for both
        return _sample_and_marginals(key, logits, k, k_max, sample_shape)

    (z, _), (_, d_mu) = jax.jvp(draw_and_marginals, (logits,), (tangents[1],))
    return z, jnp.broadcast_to(d_mu, z.shape)


def sample_and_marginals(
    key: jax.Array, logits: jax.Array, k: jax.Array, k_max: int, sample_shape: tuple = ()
) -> tuple[jax.Array, jax.Array]:
    """(sample(...), marginals(...)) from one upward pass (for the straight-through sample)."""
    logits, k_max, n = _to_bucket(logits, k_max)
    z, mu = (
        _small.sample_and_marginals(key, logits, k, k_max, tuple(sample_shape))
        if _small.applies(logits, k_max)  # small n: see exactly_k_small
        else _sample_and_marginals(key, logits, k, k_max, tuple(sample_shape))
    )
    return _cut(z, n), _cut(mu, n)


@partial(jax.jit, static_argnames=("k_max", "sample_shape"))
def _sample_and_marginals(key, logits, k, k_max: int, sample_shape: tuple):
    return _sample_and_maybe_marginals(key, logits, k, k_max, sample_shape, True)


class CountTable(NamedTuple):
    """The distribution of the count ``K = sum_i z_i`` of independent
    ``z_i ~ Bernoulli(sigmoid(logits_i))`` from one upward pass tilted at k (the root
    table), NumPy float64 arrays, no gradient; ``width`` is at
    least ``k_max + 1`` where n allows (the kernels round ``k_max`` up).

    ``log_probs[..., j] = log P(K = j)`` (``-inf`` where the table's entry was flushed to
    zero); ``relative[..., j]``: the root's entry j over its largest entry, in [0, 1]. Wide
    levels go by FFT (as for the normaliser), where an entry's error is about eps
    ``/ relative`` relative, so a caller that needs every count tilts at several k and keeps
    each entry from a pass where ``relative`` is large (``PoissonBinomial`` does). ``tilt``:
    the pass's tilt c. The same as the torch kernels' ``count_log_probs``."""

    log_probs: np.ndarray
    relative: np.ndarray
    tilt: np.ndarray


def count_log_probs(logits: jax.Array, k: jax.Array, k_max: int) -> CountTable:
    """``log P(sum z = j)`` for ``j = 0 .. k_max`` (see ``CountTable``), tilted at ``k``
    (``0 <= k <= k_max``): the entries near k are the ones the tilt resolves best.

    Concrete arrays only, and the table is NumPy float64 (as the torch kernels'): the
    count-independent terms (the tables' scale, ``c (P - j)``, a sum of n softplus tails)
    are each about n in size and are added on the host in float64, where float32 with x64
    off would lose about 1e-3 of ``log P`` at n = 1e4."""
    n = np.shape(logits)[-1]
    batch_shape = np.shape(logits)[:-1]
    padded, k_max, _ = _to_bucket(logits, max(k_max, 1))
    log_root, relative, c, exponent = _count_root(padded, k, k_max)
    wide = wide_dtype(jnp.asarray(logits).dtype)
    theta = np.asarray(logits, wide).reshape(-1, n)
    c = np.asarray(c)
    x = theta + c[:, None]  # in the wide dtype: the side each logit took in the kernels
    theta = theta.astype(np.float64)
    finite = theta > -np.inf
    x_on, theta_on = (x >= 0) & finite, (theta >= 0) & finite
    shift = np.where(x_on & ~theta_on, theta, 0.0).sum(-1)
    shift = shift - np.where(theta_on & ~x_on, theta, 0.0).sum(-1)
    with np.errstate(over="ignore"):
        tails = np.where(finite, np.log1p(np.exp(-np.abs(theta))), 0.0).sum(-1)
    rest = np.asarray(exponent, np.float64) * np.log(2.0) + shift - tails
    log_root = np.asarray(log_root, np.float64)[:, : n + 1]
    j = np.arange(log_root.shape[-1])
    c = c.astype(np.float64)
    log_p = log_root + rest[:, None] + c[:, None] * (x_on.sum(-1)[:, None] - j)
    relative = np.asarray(relative, np.float64)[:, : n + 1]
    shape = batch_shape + log_p.shape[-1:]
    return CountTable(log_p.reshape(shape), relative.reshape(shape), c.reshape(batch_shape))


@partial(jax.jit, static_argnames="k_max")
def _count_root(logits: jax.Array, k: jax.Array, k_max: int):
    """(log root, root / its largest entry, tilt c, base-2 exponent of the tables' scale)
    of one upward pass, in the wide dtype, rows flattened."""
    logits = lax.stop_gradient(logits)
    _, c, _, root, _, exponent, _ = _prepare(logits, jnp.asarray(k), k_max, False)
    wide = wide_dtype(logits.dtype)
    root = root.astype(wide)
    relative = root / jnp.maximum(root.max(-1, keepdims=True), jnp.finfo(wide).tiny)
    return jnp.log(root), relative, c.astype(wide), exponent
