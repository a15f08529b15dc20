"""ConditionedPoisson where precision is hardest, in both packages: NumPyro's default
configuration (x64 off, so float32 accumulation, and XLA's optimisations on), KL between close
distributions, the expected L1 loss at large k and at real-valued targets, a rate sum beyond
the float range, and float32 sampling of tiny categories after a large one.

References are written here: mpmath at 60-100 digits from the float-rounded rates, brute-force
enumeration, and exact binomial tail sums.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
import torch
from numpyro.distributions.kl import kl_divergence as jax_kl
from torch.distributions import kl_divergence as torch_kl

import numpyro_constrained
import pyro_constrained
from numpyro_constrained.losses import expected_l1_loss as jax_l1
from pyro_constrained.losses import expected_l1_loss as torch_l1
from tests.oracles import poisson as oracle

RATE = [1.0, 2.0, 3.5, 0.25]


@pytest.fixture
def xla_optimised():
    """XLA's optimisations on, as users run (the suite turns most of them off)."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)


def _mp_rates(rate):
    return [mpmath.mpf(float(r)) for r in rate]


def _mp_log_prob(rate, k, value):
    rate = _mp_rates(rate)
    total = mpmath.fsum(rate)
    log_pmf = mpmath.loggamma(k + 1) - mpmath.fsum(mpmath.loggamma(z + 1) for z in value)
    return log_pmf + mpmath.fsum(
        z * mpmath.log(r / total) for z, r in zip(value, rate, strict=True)
    )


def _mp_log_constraint_prob(rate, k):
    total = mpmath.fsum(_mp_rates(rate))
    return k * mpmath.log(total) - total - mpmath.loggamma(k + 1)


def _near_mean_value(rate, k):
    """floor(k p), the remainder on the first categories: a composition near the mean."""
    p = np.asarray(rate, np.float64) / np.sum(rate)
    value = np.floor(k * p)
    remainder = int(k - value.sum())
    value[:remainder] += 1
    return [int(v) for v in value]


# NumPyro with x64 off ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [10, 100_000, 1_000_000])
def test_x64_off_values_keep_float32_precision_at_large_k(xla_optimised, k):
    # Regression: with x64 off the sums ran in float32 and log k! (1.3e7 at k = 1e6) kept no
    # digit: log_prob was -19.75 for -19.94, log_constraint_prob -7.0 for -7.83.
    mpmath.mp.dps = 40
    rate32 = np.asarray(RATE, np.float32)
    scaled32 = (rate32 * np.float32(k / 6.75)).astype(np.float32)
    value = _near_mean_value(rate32, k)
    expected_log_prob = float(_mp_log_prob(rate32, k, value))
    expected_constraint = float(_mp_log_constraint_prob(scaled32, k))
    expected_entropy = oracle.binomial_sum_entropy(rate32.astype(np.float64), k)
    with jax.enable_x64(False):
        d = numpyro_constrained.ConditionedPoisson(jnp.asarray(rate32), k=k)
        log_prob = jax.jit(lambda r, z: numpyro_constrained.ConditionedPoisson(r, k=k).log_prob(z))
        actual_log_prob = float(log_prob(jnp.asarray(rate32), jnp.asarray(value, jnp.float32)))
        scaled = numpyro_constrained.ConditionedPoisson(jnp.asarray(scaled32), k=k)
        actual_constraint = float(scaled.log_constraint_prob())
        actual_entropy = float(d.entropy())
        assert d.log_constraint_prob().dtype == jnp.float32
    np.testing.assert_allclose(actual_log_prob, expected_log_prob, rtol=1e-5)
    np.testing.assert_allclose(actual_constraint, expected_constraint, rtol=1e-5)
    np.testing.assert_allclose(actual_entropy, expected_entropy, rtol=1e-5)


@pytest.mark.parametrize("x64", [False, True])
def test_near_certain_log_prob_keeps_its_relative_accuracy(x64):
    # All of k on the category holding all but 1.3e-20 of the mass: log_prob is about
    # -9.1e-20, and the rewritten sum must not add it to and subtract it from log k!'s kin.
    name = "float64" if x64 else "float32"
    rate = np.asarray([1.0, 1e-20, 3e-21], name)
    k = 7
    mpmath.mp.dps = 60
    expected = float(_mp_log_prob(rate, k, [k, 0, 0]))
    with jax.enable_x64(x64):
        d = numpyro_constrained.ConditionedPoisson(jnp.asarray(rate), k=k)
        actual = float(d.log_prob(jnp.asarray([k, 0, 0], name)))
    np.testing.assert_allclose(actual, expected, rtol=1e-5)


def test_x64_off_near_certain_entropy_keeps_its_relative_accuracy():
    # One category holds all but 1e-30 of the mass: the entropy, about 1e-28, is what is
    # left after the log-factorials cancel, which they must do exactly.
    rate = np.asarray([1.0, 1e-30], np.float32)
    k = 1000
    q = float(rate[1]) / (1.0 + float(rate[1]))
    mpmath.mp.dps = 60
    qm = mpmath.mpf(float(rate[1])) / (1 + mpmath.mpf(float(rate[1])))
    # Binomial(k, q) entropy to leading orders: k q (1 - log(k q)) + O((k q)^2).
    expected = float(k * qm * (1 - mpmath.log(k * qm)))
    with jax.enable_x64(False):
        actual = float(numpyro_constrained.ConditionedPoisson(jnp.asarray(rate), k=k).entropy())
    assert q > 0
    np.testing.assert_allclose(actual, expected, rtol=1e-4)


# KL ----------------------------------------------------------------------------------------

CLOSE_PAIRS = [
    ([1.0, 2.0, 3.0], [1.0, 2.0, 3.000001]),
    ([1.000001, 2.000002, 3.000003], [0.999999, 2.000002, 2.999997]),
    ([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]),
    ([1e-20, 1.0, 1e20], [1.1e-20, 1.0, 1e20]),
]


def _mp_kl(rate_p, rate_q, k):
    mpmath.mp.dps = 100
    a, b = _mp_rates(rate_p), _mp_rates(rate_q)
    total_a, total_b = mpmath.fsum(a), mpmath.fsum(b)
    return k * mpmath.fsum(
        (x / total_a) * mpmath.log((x / total_a) / (y / total_b)) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("rate_p, rate_q", CLOSE_PAIRS)
def test_kl_of_close_distributions_is_accurate_and_not_negative(xla_optimised, rate_p, rate_q):
    # Regressions: the KL was k sum p (log p - log q), whose difference of logarithms loses
    # |log p| ulps: 1e-4 relative in float64 at (1 +- 1e-6) perturbations, and negative
    # (-4.1e-9 for +4.0e-8) in float32 with x64 off.
    k = 10
    for dtype, rtol in [(np.float32, 1e-5), (np.float64, 1e-12)]:
        a, b = np.asarray(rate_p, dtype), np.asarray(rate_q, dtype)
        expected = float(_mp_kl(a, b, k))
        tiny = float(np.finfo(dtype).tiny)
        actual_torch = float(
            torch_kl(
                pyro_constrained.ConditionedPoisson(torch.tensor(a), k=k),
                pyro_constrained.ConditionedPoisson(torch.tensor(b), k=k),
            )
        )
        configurations = [True, False] if dtype == np.float32 else [True]
        for x64 in configurations:
            with jax.enable_x64(x64):
                actual_jax = float(
                    jax_kl(
                        numpyro_constrained.ConditionedPoisson(jnp.asarray(a), k=k),
                        numpyro_constrained.ConditionedPoisson(jnp.asarray(b), k=k),
                    )
                )
            for actual in (actual_torch, actual_jax):
                assert actual >= 0.0
                np.testing.assert_allclose(actual, expected, rtol=rtol, atol=tiny)


# Expected L1 -------------------------------------------------------------------------------


def _enumerated_l1(rate, k, target):
    p = np.asarray(rate, np.float64) / np.sum(rate)
    total = 0.0
    for z in itertools.product(range(k + 1), repeat=len(rate)):
        if sum(z) != k:
            continue
        pmf = math.factorial(k) / math.prod(math.factorial(v) for v in z) * np.prod(p**z)
        total += pmf * np.abs(np.asarray(z) - target).sum()
    return total


@pytest.mark.parametrize(
    "target",
    [[1.5, 2.5, 1.5], [0.25, -1.75, 7.5], [1.0, 2.0, 2.0], [5.999, 0.001, 3.5]],
)
def test_expected_l1_is_exact_for_real_valued_targets(target):
    # Regression: 1.514 where enumeration gives 3.333 at [1.5, 2.5, 1.5]; the integer
    # formula silently read j == y and j <= y at a y that no outcome equals.
    rate, k = [1.0, 2.0, 3.0], 5
    expected = _enumerated_l1(rate, k, np.asarray(target))
    for name in ("float32", "float64"):
        rtol = 1e-6 if name == "float32" else 1e-12
        t = torch_l1(
            pyro_constrained.ConditionedPoisson(
                torch.tensor(rate, dtype=getattr(torch, name)), k=k
            ),
            torch.tensor(target, dtype=getattr(torch, name)),
        )
        j = jax_l1(
            numpyro_constrained.ConditionedPoisson(jnp.asarray(rate, name), k=k),
            jnp.asarray(target, name),
        )
        assert t.dtype == getattr(torch, name) and j.dtype == jnp.dtype(name)
        np.testing.assert_allclose(float(t), expected, rtol=rtol)
        np.testing.assert_allclose(float(j), expected, rtol=rtol)


def _exact_l1(rate, k, target):
    """sum_i sum_j |j - y_i| Binomial(j; k, p_i), the pmf in 30-digit mpmath."""
    mpmath.mp.dps = 30
    rate = _mp_rates(rate)
    total = mpmath.fsum(rate)
    result = mpmath.mpf(0)
    for r, y in zip(rate, target, strict=True):
        p = r / total
        mean = float(k * p)
        spread = 12 * math.sqrt(mean) + 20
        lo, hi = max(0, int(mean - spread)), min(k, int(mean + spread))
        log_norm = mpmath.loggamma(k + 1)
        for j in range(lo, hi + 1):
            log_pmf = log_norm - mpmath.loggamma(j + 1) - mpmath.loggamma(k - j + 1)
            log_pmf += j * mpmath.log(p) + (k - j) * mpmath.log1p(-p)
            result += abs(j - mpmath.mpf(float(y))) * mpmath.exp(log_pmf)
    return float(result)


def test_float32_expected_l1_at_large_k(xla_optimised):
    # Regression: 0.7% off in float32 at k = 1e5 (log-gamma differences in float32).
    rate = np.asarray(RATE, np.float32)
    k = 100_000
    target = np.asarray([14000.5, 29630.0, 52000.0, 3700.25], np.float32)
    expected = _exact_l1(rate, k, target)
    t = torch_l1(pyro_constrained.ConditionedPoisson(torch.tensor(rate), k=k), torch.tensor(target))
    np.testing.assert_allclose(float(t), expected, rtol=1e-5)
    for x64 in (True, False):
        with jax.enable_x64(x64):
            j = jax_l1(numpyro_constrained.ConditionedPoisson(jnp.asarray(rate), k=k), target)
        np.testing.assert_allclose(float(j), expected, rtol=1e-5)


# A rate sum beyond the float range ---------------------------------------------------------


@pytest.mark.parametrize("name, rate", [("float64", [1e308] * 3), ("float32", [3e38] * 3)])
def test_log_constraint_prob_of_an_overflowing_rate_sum_is_minus_inf(name, rate):
    # log P(sum = k) = k log S - S - log k! with S beyond the float range is below -S, so
    # -inf in the dtype. Regression: NaN in Pyro (inf - inf).
    t = pyro_constrained.ConditionedPoisson(
        torch.tensor(rate, dtype=getattr(torch, name)), k=3
    ).log_constraint_prob()
    j = numpyro_constrained.ConditionedPoisson(jnp.asarray(rate, name), k=3).log_constraint_prob()
    assert float(t) == -math.inf and float(j) == -math.inf


# float32 sampling of tiny categories after a large one --------------------------------------


def _parity_counts(samples):
    small = np.asarray(samples, np.float64)[..., 1:]
    return small[..., 0::2].sum(), small[..., 1::2].sum()


def test_float32_categorical_draws_of_tiny_categories_are_unbiased():
    # Regression: Pyro's float32 torch.multinomial rounded each weight 3 * 2**-24 after a
    # weight 1 to two ulps of its running sum, drawing the small group 4/3 as often; the
    # float32 uniforms of NumPyro gave alternate small categories one and two grid points
    # (2/3 and 4/3 of their probability). Checked: the group total, and the even-indexed
    # against the odd-indexed small categories, both within 5 standard deviations.
    n_small = 4096
    rate = np.asarray([1.0] + [3 * 2.0**-24] * n_small, np.float32)
    k = 32 * (n_small + 1) - 1  # the categorical sampler
    p_small = n_small * 3 * 2.0**-24 / (1 + n_small * 3 * 2.0**-24)
    draws = 64
    mean = draws * k * p_small
    std = math.sqrt(mean * (1 - p_small))
    torch.manual_seed(0)
    torch_samples = pyro_constrained.ConditionedPoisson(torch.tensor(rate), k=k).sample((draws,))
    jax_samples = numpyro_constrained.ConditionedPoisson(jnp.asarray(rate), k=k).sample(
        jax.random.PRNGKey(0), (draws,)
    )
    for samples in (torch_samples.numpy(), np.asarray(jax_samples)):
        even, odd = _parity_counts(samples)
        assert abs(even + odd - mean) < 5 * std, (even + odd, mean, std)
        assert abs(even - odd) < 5 * math.sqrt(even + odd), (even, odd)


@pytest.mark.parametrize("rate", [[1.0, 2.0, 3.5, 0.25], [1e-3, 1.0, 30.0, 0.1]])
def test_x64_off_categorical_samples_pass_chi_square_against_enumeration(rate):
    # The x64-off categorical sampler (increasing order, two-word uniforms) against the
    # enumerated pmf of the float32-rounded rates.
    rate32 = np.asarray(rate, np.float32)
    k = 5
    with jax.enable_x64(False):
        d = numpyro_constrained.ConditionedPoisson(jnp.asarray(rate32), k=k)
        samples = np.asarray(d.sample(jax.random.PRNGKey(7), (20_000,)))
    assert (samples.sum(-1) == k).all()
    assert oracle.composition_chi_square_pvalue(samples, rate32.astype(np.float64), k) > 1e-3


def _torch_tiny_rate_gradients(rate, other, target):
    """Pyro's float64 gradients in the rates of the expected L1 loss and of KL(p || q)."""
    r = torch.tensor(rate, requires_grad=True)
    q = pyro_constrained.ConditionedPoisson(torch.tensor(other), k=5)
    l1 = torch.autograd.grad(
        torch_l1(pyro_constrained.ConditionedPoisson(r, k=5), torch.tensor(target)), r
    )[0]
    kl = torch.autograd.grad(torch_kl(pyro_constrained.ConditionedPoisson(r, k=5), q), r)[0]
    return l1.numpy(), kl.numpy()


def _jax_tiny_rate_gradients(rate, other, target, dtype):
    """NumPyro's gradients of the same, in ``dtype``."""
    q = numpyro_constrained.ConditionedPoisson(jnp.asarray(other, dtype), k=5)
    y = jnp.asarray(target, dtype)

    def l1(r):
        return jax_l1(numpyro_constrained.ConditionedPoisson(r, k=5), y)

    def kl(r):
        return jax_kl(numpyro_constrained.ConditionedPoisson(r, k=5), q)

    r = jnp.asarray(rate, dtype)
    return np.asarray(jax.grad(l1)(r), np.float64), np.asarray(jax.grad(kl)(r), np.float64)


@pytest.mark.parametrize("x64", [False, True], ids=["x64-off", "x64-on"])
def test_gradients_at_a_rate_that_underflows_beside_others_are_finite(x64):
    """A rate whose probability's square underflows (1e-20 .. 1e-28 in float32, 1e-160 ..
    1e-290 in float64) beside O(1) rates: NumPyro's gradients of the expected L1 loss were
    NaN and those of the KL -inf (a ratio's derivative divided by an underflowed square).
    Against Pyro in float64 at the same rates, whose gradients are finite there."""
    tinies = [1e-160, 1e-200, 1e-290] if x64 else [1e-20, 1e-25, 1e-28]
    target = np.array([0.7, 2.0, 3.3])
    tolerance = 1e-12 if x64 else 2e-5
    for tiny in tinies:
        rate, other = np.array([tiny, 1.0, 3.0]), np.array([tiny, 1.3, 4.8])
        with jax.enable_x64(x64):
            dtype = jnp.float64 if x64 else jnp.float32
            got = _jax_tiny_rate_gradients(rate, other, target, dtype)
        expected = _torch_tiny_rate_gradients(rate, other, target)
        for name, g, want in zip(("l1", "kl"), got, expected, strict=True):
            assert np.all(np.isfinite(g)), (name, tiny, g)
            np.testing.assert_allclose(g, want, atol=tolerance * np.abs(want).max(), err_msg=name)
