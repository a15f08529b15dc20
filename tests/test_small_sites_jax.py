"""The JAX small path (``numpyro_constrained.exactly_k_small``) in float32 where its tables
span the widest ranges: a row's own entries next to a batch's far larger counts, and
second derivatives at n = 200 (docs/numerics.md, "the small-problem path"). Written for a
linear-space variant (tables rescaled per node), which lost both before its fixes; they
hold for any variant."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_constrained import exactly_k_kernels
from numpyro_constrained import exactly_k_small as small


def _log_e(x: np.ndarray, k: int) -> float:
    """log e_k(exp x) by the O(nk) recursion in float64 log space (the reference)."""
    log_e = np.full(k + 1, -np.inf)
    log_e[0] = 0.0
    for value in x:
        log_e[1:] = np.logaddexp(log_e[1:], log_e[:-1] + value)
    return float(log_e[k])


def test_float32_tables_keep_a_small_k_next_to_a_large_one():
    """At zero logits, n = 200, a batch of k = 1 and k = 64: e_1 = 200 sits next to
    e_64 ~ 1e53 in the same tables, beyond float32's range of ratios (tiny ~ 1e-38), so
    a linear-space table rescaled by its largest entry alone lost it (log e_1 was -inf).
    Also ordinary logits; against float64 log-space recursions."""
    n, ks = 200, np.array([1, 64])
    rng = np.random.default_rng(0)
    for logits in (np.zeros((2, n), np.float32), rng.normal(size=(2, n)).astype(np.float32)):
        x = jnp.asarray(logits)
        assert small.applies(jnp.zeros((2, 256)), 64)  # n = 200's bucket: the small path
        # The parts from the dispatch (the general kernels), as the distribution's log_prob;
        # the marginals below from the small path.
        parts = exactly_k_kernels.normalizer_parts(x, jnp.asarray(ks), 64)
        log_z = exactly_k_kernels.log_normalizer(x, jnp.asarray(ks), 64, parts)
        expected = [_log_e(logits[row].astype(np.float64), int(ks[row])) for row in (0, 1)]
        np.testing.assert_allclose(np.asarray(log_z, np.float64), expected, rtol=2e-6)
        mu = np.asarray(exactly_k_kernels.marginals(x, jnp.asarray(ks), 64), np.float64)
        # mu_i = exp(x_i) e_{k-1}(x without i) / e_k(x), for a few i.
        for row, k in enumerate(ks):
            theta = logits[row].astype(np.float64)
            for i in (0, 7, 199):
                log_rest = _log_e(np.delete(theta, i), int(k) - 1)
                want = math.exp(theta[i] + log_rest - expected[row])
                np.testing.assert_allclose(mu[row, i], want, rtol=1e-5, atol=1e-7)


def test_float32_second_derivatives_at_n_200_are_finite_and_match_float64():
    """Hessian-vector products of the marginals at n = 200, k = 100: in float32 the
    quotients' derivatives once squared small table sums, which underflowed to NaN. Against
    the float64 product, itself checked by central differences of the float64 gradient."""
    n, ks = 200, jnp.array([100, 51])
    rng = np.random.default_rng(1)
    theta, g, v = (rng.normal(size=(2, n)) for _ in range(3))

    def hvp(dtype):
        def loss(t):
            return (small.marginals(t, ks, 100) * jnp.asarray(g, dtype)).sum()

        tangent = jnp.asarray(v, dtype)
        return jax.grad(loss), jax.jvp(jax.grad(loss), (jnp.asarray(theta, dtype),), (tangent,))[1]

    grad64, h64 = hvp(jnp.float64)
    step = 1e-5
    plus, minus = (grad64(jnp.asarray(theta + s * v)) for s in (step, -step))
    np.testing.assert_allclose(h64, (plus - minus) / (2 * step), atol=1e-7)
    h32 = np.asarray(hvp(jnp.float32)[1], np.float64)
    np.testing.assert_allclose(h32, h64, atol=2e-5 * float(np.abs(h64).max()))
