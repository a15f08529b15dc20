"""PoissonBinomial in both packages, against references written here: brute-force
enumeration of the 2^n outcomes, an mpmath dynamic programme at 60 digits (far tails),
SciPy's ``poisson_binom``, the binomial law (equal logits, large n), finite differences for
gradients, chi-square tests of the samplers, and torch-vs-JAX agreement."""

import itertools
import math

import jax
import jax.numpy as jnp
import mpmath
import numpy as np
import pytest
import scipy.stats
import torch

import numpyro_constrained as nc
import pyro_constrained as pc


def _mp_log_pmf(logits) -> np.ndarray:
    """log P(K = j), j = 0..n, by the O(n^2) recursion in 60-digit arithmetic (+-inf logits:
    always / never one)."""
    with mpmath.workdps(60):
        table = [mpmath.mpf(1)]
        for theta in np.asarray(logits, dtype=np.float64):
            if theta == np.inf:
                p, q = mpmath.mpf(1), mpmath.mpf(0)
            elif theta == -np.inf:
                p, q = mpmath.mpf(0), mpmath.mpf(1)
            else:
                p = 1 / (1 + mpmath.exp(-mpmath.mpf(float(theta))))
                q = 1 / (1 + mpmath.exp(mpmath.mpf(float(theta))))
            new = [t * q for t in table] + [mpmath.mpf(0)]
            for j, t in enumerate(table):
                new[j + 1] += t * p
            table = new
        return np.array([float(mpmath.log(t)) if t > 0 else -np.inf for t in table])


def _brute_log_pmf(probs) -> np.ndarray:
    n = len(probs)
    pmf = np.zeros(n + 1)
    for z in itertools.product((0, 1), repeat=n):
        pmf[sum(z)] += np.prod([p if bit else 1 - p for p, bit in zip(probs, z, strict=True)])
    with np.errstate(divide="ignore"):
        return np.log(pmf)


def _close(actual, expected, atol: float, rtol: float) -> None:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.array_equal(np.isneginf(actual), np.isneginf(expected)), (actual, expected)
    finite = np.isfinite(expected)
    error = np.abs(actual[finite] - expected[finite])
    bound = atol + rtol * np.abs(expected[finite])
    assert np.all(error <= bound), (error.max(), (error - bound).max())


def _torch_dist(logits, dtype=torch.float64):
    return pc.PoissonBinomial(logits=torch.as_tensor(np.asarray(logits), dtype=dtype))


def _jax_dist(logits, dtype=jnp.float64):
    return nc.PoissonBinomial(logits=jnp.asarray(np.asarray(logits), dtype=dtype))


# A mixed case: masked logits on both sides and wide logits.
MASKED = np.array([np.inf, -1.5, -np.inf, 0.3, 40.0, -35.0, np.inf, 2.0])


@pytest.mark.parametrize("n", [0, 1, 2, 5])
def test_small_n_against_enumeration(n):
    rng = np.random.default_rng(n)
    probs = rng.uniform(size=n)
    expected = _brute_log_pmf(probs)
    counts = np.arange(n + 1, dtype=np.float64)
    d = pc.PoissonBinomial(probs=torch.tensor(probs))
    _close(d.log_prob(torch.tensor(counts)).numpy(), expected, 1e-14, 1e-13)
    _close(d.log_pmf().numpy(), expected, 1e-14, 1e-13)
    if n in (1, 2):  # JAX: compilations cost more than the cases add
        return
    j = nc.PoissonBinomial(probs=jnp.asarray(probs))
    _close(j.log_prob(jnp.asarray(counts)), expected, 1e-14, 1e-13)
    _close(j.log_pmf(), expected, 1e-14, 1e-13)


def test_masked_logits():
    expected = _mp_log_pmf(MASKED)  # counts below 2 and above 7 have probability 0
    counts = np.arange(9.0)
    d = _torch_dist(MASKED)
    _close(d.log_prob(torch.tensor(counts)).numpy(), expected, 1e-13, 1e-14)
    _close(d.log_pmf().numpy(), expected, 1e-13, 1e-14)
    j = _jax_dist(MASKED)
    _close(j.log_prob(jnp.asarray(counts)), expected, 1e-13, 1e-14)
    _close(j.log_pmf(), expected, 1e-13, 1e-14)
    assert float(d.mean) == pytest.approx(float(np.exp(expected) @ counts), rel=1e-14)


def test_probs_zero_and_one_are_masks():
    probs = np.array([0.0, 1.0, 0.25, 1.0])
    d = pc.PoissonBinomial(probs=torch.tensor(probs))
    expected = [-np.inf, -np.inf, np.log(0.75), np.log(0.25), -np.inf]
    _close(d.log_pmf().numpy(), expected, 1e-15, 1e-15)
    _close(nc.PoissonBinomial(probs=jnp.asarray(probs)).log_pmf(), expected, 1e-15, 1e-15)


@pytest.mark.parametrize("scale", [1.0, 20.0])
def test_far_tails_against_mpmath(scale):
    # n = 150: the wide levels go by FFT; the tails reach 1e-300 and far below.
    rng = np.random.default_rng(7)
    logits = rng.normal(size=150) * scale
    expected = _mp_log_pmf(logits)
    assert expected.min() < (-100 if scale == 1.0 else -700)
    d = _torch_dist(logits)
    _close(d.log_pmf().numpy(), expected, 1e-12, 4e-15)
    some = np.array([0, 1, 2, 40, 75, 120, 148, 149, 150])
    _close(
        d.log_prob(torch.tensor(some, dtype=torch.float64)).numpy(), expected[some], 1e-12, 4e-15
    )
    j = _jax_dist(logits)
    _close(j.log_pmf(), expected, 1e-12, 4e-15)
    _close(j.log_prob(jnp.asarray(some)), expected[some], 1e-12, 4e-15)


def test_scipy_poisson_binom():
    rng = np.random.default_rng(3)
    probs = rng.uniform(0.05, 0.95, size=(2, 40))
    expected = np.stack([scipy.stats.poisson_binom.logpmf(np.arange(41), p) for p in probs])
    d = pc.PoissonBinomial(probs=torch.tensor(probs))
    reliable = expected > -30  # SciPy's characteristic-function method: absolute error
    _close(
        np.where(reliable, d.log_pmf().numpy(), -np.inf),
        np.where(reliable, expected, -np.inf),
        1e-9,
        0,
    )
    cdf = np.stack([scipy.stats.poisson_binom.cdf(np.arange(41), p) for p in probs])
    counts = torch.arange(41.0)[:, None]
    np.testing.assert_allclose(d.cdf(counts).numpy().T, cdf, rtol=1e-10, atol=1e-14)


def test_binomial_at_large_n():
    # Equal logits: the binomial law, whose log pmf SciPy computes accurately at any n.
    n, theta = 100_000, -2.0
    counts = np.array([0, 1, 500, 11_920, 50_000, 99_999, 100_000])
    expected = scipy.stats.binom.logpmf(counts, n, 1 / (1 + math.exp(-theta)))
    d = pc.PoissonBinomial(logits=torch.full((n,), theta, dtype=torch.float64))
    _close(d.log_prob(torch.tensor(counts, dtype=torch.float64)).numpy(), expected, 1e-9, 1e-13)


def test_float32_torch():
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=200) * 3).astype(np.float32)
    expected = _mp_log_pmf(logits.astype(np.float64))
    d = _torch_dist(logits, torch.float32)
    lp = d.log_pmf()
    assert lp.dtype == torch.float32
    # float32 rounding of the log itself: eps32 |log P|.
    _close(lp.numpy(), expected, 1e-5, 2e-7)
    counts = np.array([0, 3, 100, 199, 200])
    _close(
        d.log_prob(torch.tensor(counts, dtype=torch.float32)).numpy(), expected[counts], 1e-5, 2e-7
    )


def test_log_prob_dtype_promotes_as_binomial_and_takes_boolean_counts():
    """float32 logits with a float64 value give float64, as the frameworks' own Binomial
    (PoissonBinomial stayed float32); integer and boolean values give the logits' dtype
    (a boolean value raised in torch). The values are those of the float32 count."""
    import numpyro.distributions as ndist
    import pyro.distributions as pdist

    logits = np.array([0.3, -1.2, 2.0], np.float32)
    t = pc.PoissonBinomial(logits=torch.tensor(logits))
    binomial = pdist.Binomial(3, logits=torch.tensor(0.3))
    float64 = torch.tensor(1.0, dtype=torch.float64)
    assert t.log_prob(float64).dtype == binomial.log_prob(float64).dtype == torch.float64
    for value in (torch.tensor(1), torch.tensor(True)):
        assert t.log_prob(value).dtype == torch.float32
    expected = t.log_prob(torch.tensor(1.0))
    for value in (float64, torch.tensor(1), torch.tensor(True)):
        torch.testing.assert_close(t.log_prob(value).float(), expected)
    with jax.enable_x64(True):
        j = nc.PoissonBinomial(logits=jnp.asarray(logits))
        value = jnp.array(1.0, jnp.float64)
        reference = ndist.Binomial(3, logits=jnp.float32(0.3)).log_prob(value)
        assert j.log_prob(value).dtype == reference.dtype == jnp.float64
        assert j.log_prob(jnp.array(1, jnp.int32)).dtype == jnp.float32


def test_float32_jax_without_x64():
    rng = np.random.default_rng(11)
    logits = (rng.normal(size=200) * 3).astype(np.float32)
    expected = _mp_log_pmf(logits.astype(np.float64))
    with jax.enable_x64(False):
        d = nc.PoissonBinomial(logits=jnp.asarray(logits))
        lp = d.log_pmf()
        counts = np.array([0, 3, 100, 199, 200])
        some = d.log_prob(jnp.asarray(counts, jnp.float32))
        assert lp.dtype == jnp.float32 and some.dtype == jnp.float32
        lp, some = np.asarray(lp), np.asarray(some)
    # float32 tables and FFTs: about ten float32 roundings relative in P, plus eps32 |log P|
    # from rounding the log itself. (Before the windows' terms of size n were assembled in
    # float64, their float32 roundings gave 4e-6 near the mode and 1e-6 |log P| in the tails.)
    _close(lp, expected, 1.5e-6, 3e-7)
    _close(some, expected[counts], 1e-4, 1e-6)


def _finite_difference(function, x, step=1e-6):
    grad = np.zeros_like(x)
    for i in range(x.size):
        up, down = x.copy(), x.copy()
        up[i] += step
        down[i] -= step
        grad[i] = (function(up) - function(down)) / (2 * step)
    return grad


def test_gradients_against_finite_differences():
    logits = np.array([1.2, -0.4, 0.0, 2.5, -3.0, 0.7])
    count = 2.0

    def log_p(x):
        return float(_mp_log_pmf(x)[int(count)])

    expected = _finite_difference(log_p, logits)
    x = torch.tensor(logits, requires_grad=True)
    pc.PoissonBinomial(logits=x).log_prob(torch.tensor(count)).backward()
    np.testing.assert_allclose(x.grad.numpy(), expected, atol=1e-8)
    grad = jax.grad(lambda x: nc.PoissonBinomial(logits=x).log_prob(count))(jnp.asarray(logits))
    np.testing.assert_allclose(grad, expected, atol=1e-8)

    # Entropy (from log_pmf, one pass per count when the logits need a gradient).
    def entropy(x):
        lp = _mp_log_pmf(x)
        return float(-(np.exp(lp) * lp).sum())

    expected = _finite_difference(entropy, logits)
    x = torch.tensor(logits, requires_grad=True)
    pc.PoissonBinomial(logits=x).entropy().backward()
    np.testing.assert_allclose(x.grad.numpy(), expected, atol=1e-8)
    grad = jax.grad(lambda x: nc.PoissonBinomial(logits=x).entropy())(jnp.asarray(logits))
    np.testing.assert_allclose(grad, expected, atol=1e-8)


def test_summaries_against_references():
    rng = np.random.default_rng(5)
    logits = np.concatenate([rng.normal(size=(2, 30)) * 2, np.full((2, 1), -np.inf)], -1)
    expected = np.stack([_mp_log_pmf(row) for row in logits])
    pmf = np.exp(expected)
    counts = np.arange(32.0)
    for d, as_array in (
        (_torch_dist(logits), lambda t: t.detach().numpy()),
        (_jax_dist(logits), np.asarray),
    ):
        values = counts[:, None]
        np.testing.assert_allclose(as_array(d.mean), pmf @ counts, rtol=1e-13)
        variance = pmf @ counts**2 - (pmf @ counts) ** 2
        np.testing.assert_allclose(as_array(d.variance), variance, rtol=1e-11)
        entropy = -(pmf * np.where(pmf > 0, expected, 0)).sum(-1)
        np.testing.assert_allclose(as_array(d.entropy()), entropy, rtol=1e-13)
        np.testing.assert_array_equal(as_array(d.mode), expected.argmax(-1))
        with np.errstate(divide="ignore"):
            log_cdf = np.log(np.cumsum(pmf, -1))
        lower = np.stack(
            [
                [
                    float(mpmath.log(mpmath.fsum(mpmath.exp(v) for v in row[: k + 1])))
                    for k in range(5)
                ]
                for row in expected
            ]
        )
        _close(as_array(d.log_cdf(_vals(d, values[:5]))).T, lower, 1e-13, 1e-14)
        np.testing.assert_allclose(as_array(d.cdf(_vals(d, values))).T, np.exp(log_cdf), rtol=1e-12)
        upper = np.stack(
            [
                [
                    float(mpmath.log(mpmath.fsum(mpmath.exp(v) for v in row[k + 1 :])))
                    for k in range(25, 30)
                ]
                for row in expected
            ]
        )
        _close(as_array(d.log_survival_function(_vals(d, values[25:30]))).T, upper, 1e-12, 1e-14)
        assert as_array(d.enumerate_support()).shape == (32, 2)
        assert as_array(d.enumerate_support(expand=False)).shape == (32, 1)


def _vals(d, values):
    return torch.tensor(values) if isinstance(d, pc.PoissonBinomial) else jnp.asarray(values)


def test_kl_against_reference():
    rng = np.random.default_rng(9)
    a, b = rng.normal(size=(2, 25))
    lp, lq = _mp_log_pmf(a), _mp_log_pmf(b)
    expected = float((np.exp(lp) * (lp - lq)).sum())
    kl = torch.distributions.kl_divergence(_torch_dist(a), _torch_dist(b))
    assert float(kl) == pytest.approx(expected, rel=1e-12)
    from numpyro.distributions.kl import kl_divergence

    assert float(kl_divergence(_jax_dist(a), _jax_dist(b))) == pytest.approx(expected, rel=1e-12)


def test_samplers_chi_square():
    logits = np.array([1.0, -0.5, 0.2, 2.0, -1.5, 0.0])
    pmf = np.exp(_brute_log_pmf(1 / (1 + np.exp(-logits))))
    num = 20_000
    torch.manual_seed(0)
    torch_draws = _torch_dist(logits).sample((num,)).numpy()
    jax_draws = np.asarray(_jax_dist(logits).sample(jax.random.PRNGKey(0), (num,)))
    for draws in (torch_draws, jax_draws):
        observed = np.bincount(draws.astype(int), minlength=7)
        assert scipy.stats.chisquare(observed, pmf * num).pvalue > 1e-3


def test_torch_and_jax_agree_in_batches():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 2, 64)) * np.array([0.5, 4.0])[:, None]
    t, j = _torch_dist(logits), _jax_dist(logits)
    assert t.batch_shape == (3, 2) and j.batch_shape == (3, 2) and t.event_shape == ()
    np.testing.assert_allclose(t.log_pmf().numpy(), np.asarray(j.log_pmf()), rtol=1e-13, atol=1e-12)
    values = rng.integers(0, 65, size=(4, 3, 2)).astype(np.float64)
    np.testing.assert_allclose(
        t.log_prob(torch.tensor(values)).numpy(),
        np.asarray(j.log_prob(jnp.asarray(values))),
        rtol=1e-13,
    )


def test_validation():
    logits = np.array([0.5, -1.0, 2.0])
    d = pc.PoissonBinomial(logits=torch.tensor(logits), validate_args=True)
    for bad in (2.5, -1.0, 4.0):
        with pytest.raises(ValueError):
            d.log_prob(torch.tensor(bad))
    off = pc.PoissonBinomial(logits=torch.tensor(logits), validate_args=False)
    assert off.log_prob(torch.tensor([2.5, -1.0, 4.0])).eq(-math.inf).all()
    with pytest.raises(ValueError, match="broadcast"):
        pc.PoissonBinomial(logits=torch.zeros(3, 4)).log_prob(torch.zeros(2))
    with pytest.raises(ValueError, match="exactly one"):
        pc.PoissonBinomial()
    with pytest.raises(ValueError):
        pc.PoissonBinomial(probs=torch.tensor([0.5, 1.5]), validate_args=True)
    j = nc.PoissonBinomial(logits=jnp.asarray(logits), validate_args=True)
    with pytest.warns(UserWarning, match="Out-of-support"):
        value = j.log_prob(2.5)
    assert float(value) == -math.inf
    with pytest.raises(ValueError):
        nc.PoissonBinomial(probs=jnp.asarray([0.5, 1.5]), validate_args=True)


@pytest.mark.parametrize("method", ["cdf", "log_cdf", "log_survival_function"])
def test_cumulative_functions_of_nan_are_nan(method):
    """Torch with validation off and NumPyro return NaN for a NaN value (torch cast the
    NaN to an index and crashed, NumPyro read count 0: P(K <= nan) was P(K <= 0)); torch
    with validation on raises, as torch's own distributions do."""
    logits = np.array([0.5, -1.0, 2.0])
    values = np.array([1.0, np.nan])
    for validate in (False, True):
        d = pc.PoissonBinomial(logits=torch.tensor(logits), validate_args=validate)
        if validate:
            with pytest.raises(ValueError, match="NaN"):
                getattr(d, method)(torch.tensor(values))
            continue
        got = getattr(d, method)(torch.tensor(values)).numpy()
        assert np.isnan(got[1]) and np.isfinite(got[0])
        expected = {
            "cdf": scipy.stats.poisson_binom.cdf,
            "log_cdf": scipy.stats.poisson_binom.logcdf,
            "log_survival_function": scipy.stats.poisson_binom.logsf,
        }[method]
        reference = expected(1, 1 / (1 + np.exp(-logits)))
        assert got[0] == pytest.approx(reference, rel=1e-12)
    for x64 in (True, False):
        with jax.enable_x64(x64):
            j = nc.PoissonBinomial(logits=jnp.asarray(logits), validate_args=True)
            got = np.asarray(jax.jit(getattr(j, method))(jnp.asarray(values)))
            eager = np.asarray(getattr(j, method)(jnp.asarray(values)))
        for result in (got, eager):
            assert np.isnan(result[1]) and np.isfinite(result[0])


def test_jit_and_vmap():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, 12)))
    direct = nc.PoissonBinomial(logits=logits).log_pmf()
    jitted = jax.jit(lambda x: nc.PoissonBinomial(logits=x).log_pmf())(logits)
    np.testing.assert_allclose(jitted, direct, rtol=1e-13, atol=1e-13)
    per_row = jax.vmap(lambda x: nc.PoissonBinomial(logits=x).log_prob(3.0))(logits)
    np.testing.assert_allclose(per_row, direct[:, 3], rtol=1e-13)


def test_huge_logits():
    # Masking-size logits: the whole pmf's passes tilt by up to 1e9, whose rounding must
    # not leak into entries far from a pass's target (it did: 2.5e-8 at log P = -1e4).
    logits = np.array([1e4, -1e4, 1e9, -1e9, 0.5, -0.5, 30.0, -30.0, 3.0])
    expected = _mp_log_pmf(logits)
    _close(_torch_dist(logits).log_pmf().numpy(), expected, 1e-13, 1e-15)
    _close(_jax_dist(logits).log_pmf(), expected, 1e-13, 1e-15)


def test_gradient_in_probs_with_exact_zeros_and_ones():
    # Exact 0 and 1 are masks; the gradient in the other probabilities is that of the
    # enumerated law, with no NaN from log(0) (it was NaN everywhere the probs were 0 or 1).
    probs = np.array([0.0, 1.0, 0.3, 0.7, 1.0, 0.0, 0.5])
    count = 3
    interior = (probs > 0) & (probs < 1)

    def log_p(p):
        return _brute_log_pmf(p)[count]

    expected = _finite_difference(log_p, probs)
    x = torch.tensor(probs, requires_grad=True)
    pc.PoissonBinomial(probs=x).log_prob(torch.tensor(float(count))).backward()
    grad_jax = jax.grad(lambda p: nc.PoissonBinomial(probs=p).log_prob(count))(jnp.asarray(probs))
    for grad in (x.grad.numpy(), np.asarray(grad_jax)):
        assert np.all(np.isfinite(grad))
        np.testing.assert_allclose(grad[interior], expected[interior], atol=1e-8)


@pytest.mark.parametrize("config", ["numpyro x64 off", "numpyro x64 on", "pyro"])
def test_log_pmf_of_float32_tied_logits_near_the_mode(config):
    # Tied float32 logits: the tables' leaf weights exp(theta + c) were all rounded alike in
    # float32, an error of about j eps in log P(K = j) (at n = 512, 1e-5 beyond float32's
    # rounding of log P with x64 off, 6e-6 with x64 on). The whole pmf must be exact to that
    # rounding, against the binomial law in 30-digit arithmetic.
    n, logit = 512, np.float32(0.3)
    with mpmath.workdps(30):
        p = 1 / (1 + mpmath.exp(-mpmath.mpf(float(logit))))
        expected = np.array(
            [
                float(mpmath.log(mpmath.binomial(n, k) * p**k * (1 - p) ** (n - k)))
                for k in range(n + 1)
            ]
        )
    logits = np.full(n, logit)
    if config == "pyro":
        actual = _torch_dist(logits, torch.float32).log_pmf().numpy()
    else:
        with jax.enable_x64(config == "numpyro x64 on"):
            actual = np.asarray(_jax_dist(logits, jnp.float32).log_pmf())
    assert actual.dtype == np.float32
    _close(actual, expected, 1e-6, 2.0**-23)
