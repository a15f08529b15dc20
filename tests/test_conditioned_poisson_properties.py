"""Property-based tests of ConditionedPoisson in both packages, float32 and float64.

Each property is checked against a reference written independently of the library: 60-digit
mpmath (the multinomial formula from the raw rates, and the definition itself: the product
of the unconstrained Poisson pmfs over every composition, normalised), an O(nk) float64 sum
over every binomial outcome for the entropy at large k, SciPy's multinomial, and the other
framework's implementation on identical inputs. Rates are drawn over 60 decades (log-uniform
1e-30..1e30, tight clusters anywhere in that range, a few huge beside tiny ones), so that
``p`` spans up to 1e-60..1.

Tolerances. float32 results are compared with the reference evaluated at the float32-rounded
rates (the input is what it is): relative ``1e-4``, the documented guarantee. float64:
relative ``1e-9``. Both plus ``ATOL_EPS * eps64 * scale``, ``scale`` the size of the terms
that cancel in the float64 accumulation (``log k!`` and its kin, plus 1 for each log-gamma
evaluation: its internal terms are of order 1 even where it is 0, at 1 and 2), which is also
the accuracy of the float64 references themselves.

Bad inputs: plain tests below, one per case, for both packages.
"""

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numpyro.distributions.kl import kl_divergence as jax_kl_divergence
from scipy import special, stats

import numpyro_constrained
import numpyro_constrained._conditioned_poisson_sampler as jax_sampler
import pyro_constrained
import pyro_constrained._conditioned_poisson_sampler as torch_sampler
from tests.oracles import poisson as oracle

DTYPE_NAMES = ["float32", "float64"]
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}
JAX_DTYPES = {"float32": jnp.float32, "float64": jnp.float64}
RTOL = {"float32": 1e-4, "float64": 1e-9}
EPS64 = float(np.finfo(np.float64).eps)
ATOL_EPS = 64
# Smallest normal numbers: float32 results below them may flush to 0 (XLA on CPU does).
TINY = {"float32": float(np.finfo(np.float32).tiny), "float64": float(np.finfo(np.float64).tiny)}


# Strategies -------------------------------------------------------------------------------

LOG10_RATE = st.floats(-30.0, 30.0, allow_nan=False)


@st.composite
def rate_vectors(draw, min_n: int = 1, max_n: int = 8, sizes=None) -> np.ndarray:
    """Positive rates over 60 decades: spread log-uniformly, clustered, huge beside tiny, or
    tied.
    ``sizes``: the n to draw from instead of ``min_n..max_n`` (JAX compiles once per n)."""
    n = draw(st.sampled_from(sizes) if sizes else st.integers(min_n, max_n))
    kind = draw(st.sampled_from(["spread", "cluster", "huge-beside-tiny", "ties"]))
    if kind == "ties":
        # Equal rates, the largest among them: argmax-based normalisations must keep every
        # rate's gradient.
        levels = draw(st.lists(LOG10_RATE, min_size=1, max_size=2))
        log10 = [levels[i % len(levels)] for i in range(n)]
    elif kind == "spread":
        log10 = draw(st.lists(LOG10_RATE, min_size=n, max_size=n))
    elif kind == "cluster":
        center = draw(LOG10_RATE)
        offsets = draw(st.lists(st.floats(-1.0, 1.0), min_size=n, max_size=n))
        log10 = [center + offset for offset in offsets]
    else:
        n_huge = draw(st.integers(1, n))
        pattern = [30.0 - 0.1 * i for i in range(n_huge)] + [
            -30.0 + 0.1 * i for i in range(n - n_huge)
        ]
        log10 = draw(st.permutations(pattern))
    return 10.0 ** np.asarray(log10, dtype=np.float64)


def totals(max_log10: float) -> st.SearchStrategy[int]:
    """Small totals (0 included) and totals log-uniform up to ``10**max_log10``."""
    return st.one_of(
        st.integers(0, 12), st.floats(0.0, max_log10).map(lambda u: int(round(10.0**u)))
    )


def _rounded(rate: np.ndarray, dtype_name: str) -> np.ndarray:
    """The rates as the distribution of that dtype holds them, as float64."""
    return rate.astype(dtype_name).astype(np.float64)


def _draw_value(rate: np.ndarray, k: int, seed: int) -> np.ndarray:
    log_p, _ = oracle.mp_log_probs_and_complements(rate)
    p = np.exp(log_p)
    return np.random.default_rng(seed).multinomial(k, p / p.sum()).astype(np.float64)


def _assert_close(actual, expected, dtype_name: str, scale, what: str, rtol=None) -> None:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    rtol = RTOL[dtype_name] if rtol is None else rtol
    bound = rtol * np.abs(expected) + ATOL_EPS * EPS64 * np.asarray(scale) + TINY[dtype_name]
    error = np.abs(actual - expected)
    assert np.all(error <= bound), f"{what} ({dtype_name}): {actual} vs {expected}"


def _log_gamma_evaluations(held: np.ndarray) -> int:
    """log k! and one log z_i! per item: terms of order 1 in the float64 sum even where they
    are 0 (XLA's float64 log-gamma of 2 is 8.9e-16 when compiled without LLVM's
    optimisations, 0 with them)."""
    return len(held) + 1


def _torch(rate, k, dtype_name, **kwargs):
    return pyro_constrained.ConditionedPoisson(
        torch.tensor(rate, dtype=TORCH_DTYPES[dtype_name]), k=k, **kwargs
    )


def _jax(rate, k, dtype_name, **kwargs):
    return numpyro_constrained.ConditionedPoisson(
        jnp.asarray(rate, dtype=JAX_DTYPES[dtype_name]), k=k, **kwargs
    )


# log_prob ---------------------------------------------------------------------------------


@given(rate=rate_vectors(sizes=(1, 2, 3, 8)), k=totals(6.0), seed=st.integers(0, 2**32 - 1))
def test_log_prob_matches_mpmath_in_both_packages_and_dtypes(rate, k, seed):
    value = _draw_value(rate, k, seed)
    for dtype_name in DTYPE_NAMES:
        held = _rounded(rate, dtype_name)
        expected = oracle.mp_multinomial_logpmf(held, k, value)
        log_p, _ = oracle.mp_log_probs_and_complements(held)
        scale = (
            _log_gamma_evaluations(held)
            + special.gammaln(k + 1.0)
            + special.gammaln(value + 1.0).sum()
            + np.abs(value * log_p).sum()
        )
        for validate_args in (True, False):
            torch_value = torch.tensor(value, dtype=TORCH_DTYPES[dtype_name])
            actual = _torch(rate, k, dtype_name, validate_args=validate_args).log_prob(torch_value)
            assert actual.dtype == TORCH_DTYPES[dtype_name]
            _assert_close(actual, expected, dtype_name, scale, "torch log_prob")
            jax_value = jnp.asarray(value, JAX_DTYPES[dtype_name])
            actual = _jax(rate, k, dtype_name, validate_args=validate_args).log_prob(jax_value)
            assert actual.dtype == JAX_DTYPES[dtype_name]
            _assert_close(actual, expected, dtype_name, scale, "jax log_prob")


@given(
    rate=rate_vectors(sizes=(1, 2, 3, 8)),
    k=totals(4.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_gradients_in_rate_of_log_prob_and_mean_are_exact(rate, k, seed):
    # d log_prob / d rate_j = z_j / rate_j - k / sum(rate); the straight-through gradient of
    # a sample is that of the mean, d (w . k p) / d rate_j = k (w_j - w . p) / sum(rate).
    value = _draw_value(rate, k, seed)
    weights = np.random.default_rng(seed).normal(size=len(rate))
    total = rate.sum()
    p = rate / total
    expected_log_prob = value / rate - k / total
    expected_mean = k * (weights - weights @ p) / total
    log_prob_scale = value / rate + k / total
    mean_scale = k * (np.abs(weights) + np.abs(weights) @ p) / total

    rate_t = torch.tensor(rate, requires_grad=True)
    d = pyro_constrained.ConditionedPoisson(rate_t, k=k)
    (grad,) = torch.autograd.grad(d.log_prob(torch.tensor(value)), rate_t)
    _assert_close(grad, expected_log_prob, "float64", log_prob_scale, "torch d log_prob")
    (grad,) = torch.autograd.grad(d.mean @ torch.tensor(weights), rate_t)
    _assert_close(grad, expected_mean, "float64", mean_scale, "torch d mean")

    def log_prob(r):
        return numpyro_constrained.ConditionedPoisson(r, k=k).log_prob(jnp.asarray(value))

    def weighted_mean(r):
        return numpyro_constrained.ConditionedPoisson(r, k=k).mean @ jnp.asarray(weights)

    grad = jax.grad(log_prob)(jnp.asarray(rate))
    _assert_close(grad, expected_log_prob, "float64", log_prob_scale, "jax d log_prob")
    grad = jax.grad(weighted_mean)(jnp.asarray(rate))
    _assert_close(grad, expected_mean, "float64", mean_scale, "jax d mean")


# Compositions are padded to this many rows so that JAX compiles log_prob once per n.
_ENUMERATION_ROWS = 84  # compositions of 6 into 4 parts


# 12 examples: the values are also checked against mpmath at every n up to 8 and k up to 1e6
# (test_log_prob_matches_mpmath_in_both_packages_and_dtypes); this one adds the sum to 1.
@settings(max_examples=12)
@given(rate=rate_vectors(max_n=4), k=st.integers(0, 6))
def test_log_prob_is_the_normalised_definition_by_enumeration(rate, k):
    for dtype_name in DTYPE_NAMES:
        held = _rounded(rate, dtype_name)
        support, expected = oracle.mp_enumerated_log_pmf(held, k)
        expected = np.array([float(x) for x in expected])
        padded = np.concatenate([support, np.repeat(support[:1], _ENUMERATION_ROWS, 0)])
        padded = padded[:_ENUMERATION_ROWS].astype(np.float64)
        scale = (
            _log_gamma_evaluations(held)
            + special.gammaln(k + 1.0)
            + k * np.abs(np.log(held / held.sum())).max()
        )
        torch_log_prob = _torch(rate, k, dtype_name).log_prob(
            torch.tensor(padded, dtype=TORCH_DTYPES[dtype_name])
        )
        jax_log_prob = _jax(rate, k, dtype_name).log_prob(
            jnp.asarray(padded, JAX_DTYPES[dtype_name])
        )
        for name, log_prob in [("torch", torch_log_prob), ("jax", jax_log_prob)]:
            log_prob = np.asarray(log_prob, dtype=np.float64)[: len(support)]
            _assert_close(log_prob, expected, dtype_name, scale, f"{name} log_prob")
            # Sums to 1 over the support.
            total = special.logsumexp(log_prob)
            assert abs(total) <= 10 * RTOL[dtype_name], f"{name} ({dtype_name}): {total}"


# Entropy ----------------------------------------------------------------------------------


def _entropy_scale(held: np.ndarray, k: int) -> float:
    log_p, _ = oracle.mp_log_probs_and_complements(held)
    return len(held) * (1.0 + special.gammaln(k + 1.0)) + k * np.abs(np.exp(log_p) * log_p).sum()


@given(rate=rate_vectors(max_n=6), k=totals(6.0))
def test_entropy_matches_the_sum_over_every_binomial_outcome_torch(rate, k):
    for dtype_name in DTYPE_NAMES:
        held = _rounded(rate, dtype_name)
        expected = oracle.binomial_sum_entropy(held, k)
        entropy = _torch(rate, k, dtype_name).entropy()
        assert entropy.dtype == TORCH_DTYPES[dtype_name]
        _assert_close(entropy, expected, dtype_name, _entropy_scale(held, k), "torch entropy")


# Each new (k, rates) compiles the JAX entropy anew (about 0.5 s): fewer examples here; the
# torch test above covers the strategy fully and the agreement test ties the two together.
# Large totals only: small ones are covered by enumeration below.
@settings(max_examples=4)
@given(rate=rate_vectors(max_n=6), k=st.floats(2.0, 6.0).map(lambda u: int(round(10.0**u))))
def test_entropy_matches_the_sum_over_every_binomial_outcome_jax(rate, k):
    for dtype_name in DTYPE_NAMES:
        held = _rounded(rate, dtype_name)
        expected = oracle.binomial_sum_entropy(held, k)
        entropy = _jax(rate, k, dtype_name).entropy()
        assert entropy.dtype == JAX_DTYPES[dtype_name]
        _assert_close(entropy, expected, dtype_name, _entropy_scale(held, k), "jax entropy")


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_float32_and_float64_entropy_at_large_k(dtype_name):
    # The regression of issue 14: float32 was 1e-2 off here (log k! = 1e6 rounded away).
    rate = np.random.default_rng(14).random(10) + 0.01
    k = 100_000
    held = _rounded(rate, dtype_name)
    expected = oracle.binomial_sum_entropy(held, k)
    scale = _entropy_scale(held, k)
    _assert_close(_torch(rate, k, dtype_name).entropy(), expected, dtype_name, scale, "torch")
    _assert_close(_jax(rate, k, dtype_name).entropy(), expected, dtype_name, scale, "jax")


def _kl_scale(rate, other, k) -> float:
    """``k sum_i p_i |d_i|`` with ``d_i = log(p_i / q_i)`` at high precision: the KL is
    computed from ``d_i`` known to a few ulps relative (from the rates' differences where
    the two are close, from the logarithms where ``|d_i| >= 1/2``), so its error is a few
    ulps of this; two proportional rate vectors whose float rounding leaves a KL of 1e-34 have
    a scale of about 1e-17."""
    import mpmath

    with mpmath.workdps(oracle._digits_for(rate, other) + 40):
        p, q = oracle._mp_probs(rate), oracle._mp_probs(other)
        return float(k * mpmath.fsum(a * abs(mpmath.log(a / b)) for a, b in zip(p, q, strict=True)))


# A few totals: JAX compiles its entropy per (n, k).
@settings(max_examples=12)
@given(
    rate=rate_vectors(sizes=(2, 4)),
    other=rate_vectors(min_n=4, max_n=4),
    k=st.sampled_from([0, 1, 3, 6]),
)
def test_entropy_and_kl_match_enumeration_at_60_digits(rate, other, k):
    other = other[: len(rate)]
    for dtype_name in DTYPE_NAMES:
        held, held_other = _rounded(rate, dtype_name), _rounded(other, dtype_name)
        expected_entropy = oracle.mp_enumerated_entropy(held, k)
        expected_kl = oracle.mp_enumerated_kl(held, held_other, k)
        scale = _entropy_scale(held, k)
        kl_scale = _kl_scale(held, held_other, k)
        p, q = _torch(rate, k, dtype_name), _torch(other, k, dtype_name)
        _assert_close(p.entropy(), expected_entropy, dtype_name, scale, "torch entropy")
        kl = torch.distributions.kl_divergence(p, q)
        _assert_close(kl, expected_kl, dtype_name, kl_scale, "torch KL")
        p, q = _jax(rate, k, dtype_name), _jax(other, k, dtype_name)
        _assert_close(p.entropy(), expected_entropy, dtype_name, scale, "jax entropy")
        _assert_close(jax_kl_divergence(p, q), expected_kl, dtype_name, kl_scale, "jax KL")


@given(rate=rate_vectors(max_n=5), k=st.integers(0, 40))
def test_entropy_matches_scipy_where_scipy_is_accurate(rate, k):
    # SciPy's multinomial entropy sums log j! against binomial pmfs too, but in plain float64
    # from p = rate / sum(rate): a second, independent implementation.
    held = _rounded(rate, "float64")
    p = held / held.sum()
    expected = stats.multinomial(k, p).entropy()
    entropy = _torch(rate, k, "float64").entropy()
    # SciPy's own error: float64 rounding of terms of size log k! (n of them).
    _assert_close(entropy, expected, "float64", 4 * _entropy_scale(held, k), "torch vs scipy")


# Moments ----------------------------------------------------------------------------------


@given(rate=rate_vectors(sizes=(1, 2, 5, 8)), k=totals(6.0))
def test_mean_and_variance_match_mpmath(rate, k):
    for dtype_name in DTYPE_NAMES:
        held = _rounded(rate, dtype_name)
        log_p, log1m_p = oracle.mp_log_probs_and_complements(held)
        expected_mean = k * np.exp(log_p)
        expected_variance = k * np.exp(log_p + log1m_p)
        scale = k * TINY[dtype_name] / EPS64
        for name, d in [("torch", _torch(rate, k, dtype_name)), ("jax", _jax(rate, k, dtype_name))]:
            rtol = 1e-6 if dtype_name == "float32" else 1e-12
            _assert_close(d.mean, expected_mean, dtype_name, scale, f"{name} mean", rtol)
            _assert_close(d.variance, expected_variance, dtype_name, scale, f"{name} var", rtol)
            _assert_close(d.probs, np.exp(log_p), dtype_name, TINY[dtype_name], name, rtol)


# Agreement --------------------------------------------------------------------------------


@settings(max_examples=4)
@given(rate=rate_vectors(max_n=6), other=rate_vectors(min_n=6, max_n=6), k=totals(4.0))
def test_torch_and_jax_agree_on_identical_inputs(rate, other, k):
    other = other[: len(rate)]
    value = _draw_value(rate, k, seed=k)
    for dtype_name in DTYPE_NAMES:
        held = _rounded(rate, dtype_name)
        tp, tq = _torch(rate, k, dtype_name), _torch(other, k, dtype_name)
        jp, jq = _jax(rate, k, dtype_name), _jax(other, k, dtype_name)
        pairs = {
            "log_prob": (
                tp.log_prob(torch.tensor(value, dtype=TORCH_DTYPES[dtype_name])),
                jp.log_prob(jnp.asarray(value, JAX_DTYPES[dtype_name])),
            ),
            "entropy": (tp.entropy(), jp.entropy()),
            "kl": (torch.distributions.kl_divergence(tp, tq), jax_kl_divergence(jp, jq)),
            "mean": (tp.mean, jp.mean),
            "variance": (tp.variance, jp.variance),
            "log_constraint_prob": (tp.log_constraint_prob(), jp.log_constraint_prob()),
        }
        scale = _entropy_scale(held, k) + np.abs(np.log(held)).sum() * k
        for name, (torch_result, jax_result) in pairs.items():
            torch_result = torch_result.detach().numpy()
            assert str(torch_result.dtype) == str(jax_result.dtype) == dtype_name, name
            rtol = 1e-5 if dtype_name == "float32" else 1e-11
            _assert_close(jax_result, torch_result, dtype_name, scale, name, rtol)


# Sampling ---------------------------------------------------------------------------------


def _assert_exact_compositions(samples, rate, k, dtype_name, what):
    samples = np.asarray(samples)
    assert str(samples.dtype) == dtype_name, what
    assert np.all(samples == np.round(samples)) and np.all(samples >= 0), what
    # Exactly k in the dtype itself, not up to rounding.
    assert np.all(samples.sum(-1, dtype=samples.dtype) == np.asarray(k, dtype=dtype_name)), what
    log_p, _ = oracle.mp_log_probs_and_complements(_rounded(rate, dtype_name))
    # Categories of probability below 1e-20 are never drawn (chance below 1e-16 here).
    assert np.all(samples[..., log_p < math.log(1e-20)] == 0), what


@given(rate=rate_vectors(max_n=6), k=st.one_of(st.integers(0, 40), st.integers(0, 100_000)))
def test_torch_samples_are_exact_compositions(rate, k):
    for dtype_name in DTYPE_NAMES:
        d = _torch(torch.tensor(rate).numpy(), k, dtype_name)
        _assert_exact_compositions(d.sample((20,)), rate, k, dtype_name, "torch sample")
        z = pyro_constrained.ConditionedPoisson(
            torch.tensor(rate, dtype=TORCH_DTYPES[dtype_name], requires_grad=True), k=k
        ).rsample((3,))
        _assert_exact_compositions(z.detach(), rate, k, dtype_name, "torch rsample")


# JAX compiles its samplers per n and k_max (seconds each): fixed n and two totals here. The
# sequential-binomial sampler (k >= 32 n) is checked for exact sums at 2**24 and 2**53 and
# by chi-square below.
@settings(max_examples=8)
@given(rate=rate_vectors(min_n=4, max_n=4), k=st.sampled_from([0, 7]))
def test_jax_samples_are_exact_compositions(rate, k):
    for dtype_name in DTYPE_NAMES:
        samples = _jax(rate, k, dtype_name).sample(jax.random.PRNGKey(k), (20,))
        _assert_exact_compositions(samples, rate, k, dtype_name, "jax sample")


EXTREME_RATES = [
    np.array([1e-30, 5e29, 1e30, 2e30]),
    np.array([3.0, 1e-25, 1.0, 2.0]),
]


def _chi_square_pvalue(samples, rate, k):
    support, log_pmf = oracle.mp_enumerated_log_pmf(rate, k)
    index = {tuple(row): i for i, row in enumerate(support.tolist())}
    observed = np.zeros(len(support) + 1)
    for row in np.asarray(samples).reshape(-1, support.shape[1]).astype(np.int64).tolist():
        observed[index.get(tuple(row), len(support))] += 1
    probs = np.append([math.exp(float(x)) for x in log_pmf], 0.0)
    return oracle.binned_chi_square_pvalue(observed, probs)


@pytest.mark.parametrize(
    "rate, dtype_name",
    [(EXTREME_RATES[0], "float32"), (EXTREME_RATES[1], "float64")],
    ids=["huge-float32", "tiny-among-ordinary-float64"],
)
@pytest.mark.parametrize("sequential", [False, True], ids=["categorical", "sequential"])
def test_samples_pass_chi_square_against_enumeration(monkeypatch, rate, sequential, dtype_name):
    if sequential:
        monkeypatch.setattr(torch_sampler, "SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY", 0)
        monkeypatch.setattr(jax_sampler, "SEQUENTIAL_BINOMIAL_MIN_K_PER_CATEGORY", 0)
    k = 4
    held = _rounded(rate, dtype_name)
    torch_samples = _torch(rate, k, dtype_name).sample((3000,))
    jax_samples = _jax(rate, k, dtype_name).sample(jax.random.PRNGKey(3), (3000,))
    for samples in (torch_samples, jax_samples):
        _assert_exact_compositions(samples, rate, k, dtype_name, "chi-square samples")
        assert _chi_square_pvalue(samples, held, k) > 1e-3


# k = 0 and degenerate cases ----------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", DTYPE_NAMES)
def test_k_zero_is_degenerate_with_zero_not_missing_gradients(dtype_name):
    rate = torch.tensor([1e-30, 2.0, 1e30], dtype=TORCH_DTYPES[dtype_name], requires_grad=True)
    d = pyro_constrained.ConditionedPoisson(rate, k=0)
    z = d.rsample((2,))
    assert torch.equal(z.detach(), torch.zeros_like(z))
    assert d.entropy().item() == 0.0 and d.log_prob(torch.zeros(3)).item() == 0.0
    (grad,) = torch.autograd.grad(z.sum() + d.entropy(), rate)
    assert torch.equal(grad, torch.zeros_like(grad))

    def sample_sum(r):
        dist = numpyro_constrained.ConditionedPoisson(r, k=0)
        return jnp.sum(dist.sample(jax.random.PRNGKey(0), (2,)))

    jax_rate = jnp.asarray([1e-30, 2.0, 1e30], JAX_DTYPES[dtype_name])
    assert float(numpyro_constrained.ConditionedPoisson(jax_rate, k=0).entropy()) == 0.0
    np.testing.assert_array_equal(jax.grad(sample_sum)(jax_rate), 0.0)


# Bad input: clear ValueErrors naming the argument ------------------------------------------

BAD_RATES = {
    "zero": [1.0, 0.0, 2.0],
    "negative": [1.0, -1.0, 2.0],
    "nan": [1.0, math.nan, 2.0],
    "inf": [1.0, math.inf, 2.0],
    "minus-inf": [1.0, -math.inf, 2.0],
}


@pytest.mark.parametrize("rate", BAD_RATES.values(), ids=BAD_RATES.keys())
def test_bad_rate_is_a_value_error_naming_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        pyro_constrained.ConditionedPoisson(torch.tensor(rate), k=2)
    with pytest.raises(ValueError, match="rate"):
        numpyro_constrained.ConditionedPoisson(jnp.asarray(rate), k=2)


# One rule for counts in both packages (constrained_ppl.arguments.check_count): a
# whole-number float is the count (see test_whole_number_float_k_is_the_count_in_both_packages).
BAD_K = {
    "negative": -1,
    "non-integer-float": 2.5,
    "python-nan": math.nan,
    "complex": 2 + 0j,
    "bool": True,
    "numpy-bool": np.bool_(True),
    "negative-in-batch": np.array([1, -2]),
    "non-integer-array": np.array([1.0, 2.5]),
    "nan-array": np.array([1.0, math.nan]),
    "complex-array": np.array([1 + 0j, 2 + 0j]),
}


@pytest.mark.parametrize("k", BAD_K.values(), ids=BAD_K.keys())
def test_bad_k_is_a_value_error_naming_k(k):
    torch_k = torch.as_tensor(k) if isinstance(k, np.ndarray) else k
    with pytest.raises(ValueError, match=r"\bk\b"):
        pyro_constrained.ConditionedPoisson(torch.ones(2, 3), k=torch_k)
    with pytest.raises(ValueError, match=r"\bk\b"):
        numpyro_constrained.ConditionedPoisson(jnp.ones((2, 3)), k=k)


WHOLE_NUMBER_K = {
    "python-float": 3.0,
    "numpy-float": np.float64(3.0),
    "float-array": np.array([3.0, 0.0]),
    "float32-array": np.array([3.0, 2.0], dtype=np.float32),
}


@pytest.mark.x64_only("float32 is the dtype of k here; the rates are float64")
@pytest.mark.parametrize("k", WHOLE_NUMBER_K.values(), ids=WHOLE_NUMBER_K.keys())
def test_whole_number_float_k_is_the_count_in_both_packages(k):
    # Accepted as Binomial.total_count accepts it, and the same distribution as the int k:
    # log_prob against SciPy's multinomial, samples summing to k.
    rate = np.array([[0.5, 1.0, 2.5], [1.0, 2.0, 3.0]])
    k_int = np.broadcast_to(np.asarray(k).astype(np.int64), (2,))
    value = np.array([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    value[1, 2] = k_int[1]
    expected = [
        stats.multinomial(k_int[b], rate[b] / rate[b].sum()).logpmf(value[b]) for b in (0, 1)
    ]
    torch_k = torch.as_tensor(k) if isinstance(k, np.ndarray) else k
    d_torch = pyro_constrained.ConditionedPoisson(torch.tensor(rate), k=torch_k)
    d_jax = numpyro_constrained.ConditionedPoisson(jnp.asarray(rate), k=k)
    np.testing.assert_allclose(d_torch.log_prob(torch.tensor(value)), expected, rtol=1e-12)
    np.testing.assert_allclose(d_jax.log_prob(jnp.asarray(value)), expected, rtol=1e-12)
    np.testing.assert_array_equal(d_torch.sample((5,)).sum(-1), np.broadcast_to(k_int, (5, 2)))
    z = d_jax.sample(jax.random.PRNGKey(0), (5,))
    np.testing.assert_array_equal(z.sum(-1), np.broadcast_to(k_int, (5, 2)))


@pytest.mark.parametrize(
    "dtype_name, k", [("float32", 2**24 + 1), ("float64", 2**53 + 1)], ids=["f32", "f64"]
)
def test_k_beyond_the_exact_integers_of_the_dtype_is_a_value_error(dtype_name, k):
    with pytest.raises(ValueError, match=r"k = \d+ exceeds 2\*\*"):
        _torch(np.ones(3), k, dtype_name)
    with pytest.raises(ValueError, match=r"k = \d+ exceeds 2\*\*"):
        _jax(np.ones(3), k, dtype_name)
    # The largest exact total itself is fine and its samples sum to it exactly.
    largest = k - 1
    _assert_exact_compositions(
        _torch(np.ones(3), largest, dtype_name).sample(), np.ones(3), largest, dtype_name, "torch"
    )
    z = _jax(np.ones(3), largest, dtype_name).sample(jax.random.PRNGKey(0))
    _assert_exact_compositions(z, np.ones(3), largest, dtype_name, "jax")


def test_a_float32_k_tensor_beyond_2_to_the_24_is_a_value_error():
    # Already rounded when it reaches the distribution, whatever the rates' dtype.
    with pytest.raises(ValueError, match="k = .* exceeds"):
        pyro_constrained.ConditionedPoisson(
            torch.ones(3, dtype=torch.float64), k=torch.tensor(2.0**25, dtype=torch.float32)
        )


def test_k_max_below_k_is_a_value_error_naming_k_max():
    with pytest.raises(ValueError, match="k_max"):
        numpyro_constrained.ConditionedPoisson(jnp.ones(3), k=5, k_max=3)
    with pytest.raises(ValueError, match="k_max"):
        numpyro_constrained.ConditionedPoisson(jnp.ones((2, 3)), k=np.array([1, 4]), k_max=3)
    with pytest.raises(ValueError, match="k_max"):
        numpyro_constrained.ConditionedPoisson(jnp.ones(3), k=2, k_max=2.5)
    with pytest.raises(ValueError, match="k_max"):
        numpyro_constrained.ConditionedPoisson(jnp.ones(3, jnp.float32), k=2, k_max=2**24 + 1)


def test_traced_k_above_k_max_gives_nan_not_a_wrong_answer():
    # Under jit the values of k are unknown at construction: detected where used.
    rate = jnp.ones(3)

    @jax.jit
    def sample_and_entropy(k, key):
        d = numpyro_constrained.ConditionedPoisson(rate, k=k, k_max=3)
        return (
            d.sample(key, (4,)),
            d.entropy(),
            numpyro_constrained.losses.expected_l1_loss(d, jnp.zeros(3)),
        )

    samples, entropy, l1 = sample_and_entropy(5, jax.random.PRNGKey(0))
    assert bool(jnp.isnan(samples).all()) and bool(jnp.isnan(entropy)) and bool(jnp.isnan(l1))
    samples, entropy, l1 = sample_and_entropy(3, jax.random.PRNGKey(0))
    np.testing.assert_array_equal(samples.sum(-1), 3.0)
    assert bool(jnp.isfinite(entropy)) and bool(jnp.isfinite(l1))


def test_shape_mismatch_and_missing_categories_are_value_errors():
    with pytest.raises(ValueError, match="k of shape"):
        pyro_constrained.ConditionedPoisson(torch.ones(2, 3), k=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="k of shape"):
        numpyro_constrained.ConditionedPoisson(jnp.ones((2, 3)), k=np.array([1, 2, 3]))
    for rate in (1.0, np.ones((2, 0))):
        with pytest.raises(ValueError, match="rate"):
            pyro_constrained.ConditionedPoisson(torch.tensor(rate), k=0)
        with pytest.raises(ValueError, match="rate"):
            numpyro_constrained.ConditionedPoisson(jnp.asarray(rate), k=0)
    with pytest.raises(ValueError, match="value of shape"):
        pyro_constrained.ConditionedPoisson(torch.ones(3), k=2).log_prob(torch.ones(2))
    with pytest.raises(ValueError, match="value of shape"):
        numpyro_constrained.ConditionedPoisson(jnp.ones(3), k=2).log_prob(jnp.ones(2))


OFF_SUPPORT = {
    "negative": [-1.0, 3.0, 2.0],
    "non-integer": [0.5, 2.5, 1.0],
    "sum-below-k": [1.0, 1.0, 1.0],
    "sum-above-k": [2.0, 2.0, 2.0],
    "nan": [math.nan, 2.0, 2.0],
    "inf": [math.inf, 2.0, 2.0],
}


@pytest.mark.parametrize("value", OFF_SUPPORT.values(), ids=OFF_SUPPORT.keys())
def test_values_off_the_support(value):
    rate = [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="support|sum to exactly k"):
        _torch(rate, 4, "float64").log_prob(torch.tensor(value, dtype=torch.float64))
    with pytest.warns(UserWarning, match="Out-of-support values"):
        assert float(_jax(rate, 4, "float64").log_prob(jnp.asarray(value))) == -math.inf
    for log_prob in (
        _torch(rate, 4, "float64", validate_args=False).log_prob(torch.tensor(value)),
        _jax(rate, 4, "float64", validate_args=False).log_prob(jnp.asarray(value)),
    ):
        assert float(log_prob) == -math.inf


def test_counts_beyond_the_exact_integers_are_not_rounded_into_the_support():
    k = 2**24
    # As int64, rounded to float32 this would be (2**24, 0): in the support.
    too_large = np.array([2**24 + 1, 0])
    # Exact in float32, but a float32 sum gives 2**24.
    rounding_sum = np.array([2**24 - 1, 1, 1, 1])
    cases = [(too_large, None), (rounding_sum, None), (rounding_sum, "float32")]
    for value, value_dtype in cases:
        rate = np.ones(len(value))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            torch_dist = _torch(rate, k, "float32", validate_args=False)
            results = [
                torch_dist.log_prob(
                    torch.tensor(value, dtype=getattr(torch, value_dtype or "int64"))
                ),
                _jax(rate, k, "float32").log_prob(jnp.asarray(value, dtype=value_dtype)),
            ]
        assert [float(r) for r in results] == [-math.inf] * 2, (value, value_dtype)


def test_mixed_float32_and_float64_inputs_promote_as_the_framework_does():
    torch32 = _torch([1.0, 2.0], 3, "float32")
    assert torch32.log_prob(torch.tensor([1.0, 2.0], dtype=torch.float64)).dtype == torch.float64
    assert torch32.log_prob(torch.tensor([1, 2])).dtype == torch.float32
    torch64 = _torch([3.0, 1.0], 3, "float64")
    assert torch.distributions.kl_divergence(torch32, torch64).dtype == torch.float64
    jax32 = _jax([1.0, 2.0], 3, "float32")
    assert jax32.log_prob(jnp.asarray([1.0, 2.0], jnp.float64)).dtype == jnp.float64
    assert jax32.log_prob(jnp.asarray([1, 2])).dtype == jnp.float32
    assert jax_kl_divergence(jax32, _jax([3.0, 1.0], 3, "float64")).dtype == jnp.float64


# Gradients (issue 29) ---------------------------------------------------------------------

GRADIENT_LOG10_RATE = st.floats(-8.0, 8.0, allow_nan=False)


@st.composite
def gradient_cases(draw):
    """Three rates spread over 16 decades or tied to 1e-7, a second rate vector (for KL), a
    small k (enumeration) and a real-valued target, integers and halves included."""
    kind = draw(st.sampled_from(["spread", "near-ties"]))
    log10 = draw(st.lists(GRADIENT_LOG10_RATE, min_size=3, max_size=3))
    if kind == "near-ties":
        jitter = draw(st.lists(st.floats(-1e-7, 1e-7), min_size=3, max_size=3))
        log10 = [log10[0] + j for j in jitter]
    rate = 10.0 ** np.asarray(log10)
    other = rate * 10.0 ** np.asarray(draw(st.lists(st.floats(-1.0, 1.0), min_size=3, max_size=3)))
    k = draw(st.sampled_from([0, 1, 5]))
    target = np.asarray(
        draw(st.lists(st.floats(-2.0, 8.0, allow_nan=False), min_size=3, max_size=3))
    )
    return rate, other, k, target


def _composition_near_the_mean(rate, k):
    """floor(k p) with the remainder on the first categories."""
    value = np.floor(k * rate / rate.sum())
    value[: int(k - value.sum())] += 1
    return value


def _references(rate, other, k, target):
    """The quantities as float64 functions of the rates, from enumeration and closed forms
    written here (not the library)."""
    p = rate / rate.sum()
    q = other / other.sum()
    value = _composition_near_the_mean(rate, k)
    return {
        "log_prob": float(stats.multinomial.logpmf(value, k, p)) if k else 0.0,
        "mean": float(np.sum(k * p * np.arange(1, 4))),
        "log_constraint_prob": stats.poisson.logpmf(k, rate.sum()),
        # At 60 digits: a float64 enumeration of a near-certain outcome's entropy (2.6e-4 at
        # rates 1, 3.2, 1e6 and k = 5) has too few digits left for the differences.
        "entropy": oracle.mp_enumerated_entropy(rate, k),
        "kl": k * float(np.sum(p * (np.log(p) - np.log(q)))),
        "variance": float(np.sum(k * p * (1 - p) * np.arange(1, 4))),
        "l1": oracle.enumerated_expected_l1(rate, k, target),
        "l2": oracle.enumerated_expected_l2(rate, k, target),
    }


def _library_scalars(module, losses, rate, other, k, target, kl, value):
    d = module.ConditionedPoisson(rate, k=k)
    e = module.ConditionedPoisson(other, k=k)
    weights = [1.0, 2.0, 3.0]
    if isinstance(rate, torch.Tensor):
        value, weighted = rate.new_tensor(value), rate.new_tensor(weights)
    else:
        value, weighted = jnp.asarray(value, rate.dtype), jnp.asarray(weights, rate.dtype)
    return {
        "log_prob": d.log_prob(value),
        "mean": (d.mean * weighted).sum(),
        "log_constraint_prob": d.log_constraint_prob(),
        "entropy": d.entropy(),
        "kl": kl(d, e),
        "variance": (d.variance * weighted).sum(),
        "l1": losses.expected_l1_loss(d, target),
        "l2": losses.expected_l2_loss(d, target),
    }


# 5 drawn examples and the one kept below: each new (k, dtype) compiles NumPyro's Jacobian.
@pytest.mark.slow
@settings(max_examples=5)
@given(case=gradient_cases())
@example(case=(np.array([1.0, 10**0.5, 1e6]), np.array([1.0, 14.1473865, 1e6]), 5, np.zeros(3)))
def test_gradients_in_log_rate_match_finite_differences_of_references(case):
    # d f / d log rate_j against central differences (step 1e-5 in log rate) of float64
    # references, for log_prob (at a fixed composition near the mean), a weighted mean,
    # log_constraint_prob, entropy, KL, a weighted variance and both expected
    # losses (at a real-valued target), in both packages and dtypes; NumPyro's float32 with
    # x64 off. Tolerance: float64 1e-6, float32 2e-3, relative to the largest
    # log-rate derivative of that quantity plus 1e-8.
    from pyro_constrained import losses as torch_losses

    rate, other, k, target = case
    value = _composition_near_the_mean(rate, k)
    step = 1e-5
    names = list(_references(rate, other, k, target))
    expected = {name: np.zeros(3) for name in names}
    for j in range(3):
        up, down = rate.copy(), rate.copy()
        up[j] *= math.exp(step)
        down[j] *= math.exp(-step)
        f_up, f_down = _references(up, other, k, target), _references(down, other, k, target)
        for name in names:
            expected[name][j] = (f_up[name] - f_down[name]) / (2 * step)

    values = _references(rate, other, k, target)

    def check(actual, dtype_name, what):
        for name in names:
            # A derivative that is 0 through cancellation (the L1 loss at y = 0 is k; the KL
            # at q = p) is known to the rounding of the value's terms, and the reference's
            # differences to about 1e-11 (1 + k) (float64 rounding over the step).
            scale = np.max(np.abs(expected[name])) + abs(values[name]) + 1e-4 * (1 + k)
            tolerance = (2e-3 if dtype_name == "float32" else 1e-6) * scale
            got = np.asarray(actual[name], np.float64)
            assert np.all(np.isfinite(got)), f"{what} {name} {dtype_name}: {got}"
            assert np.all(np.abs(got - expected[name]) <= tolerance), (
                f"{what} d {name} / d log rate ({dtype_name}): {got} vs {expected[name]}"
            )

    for dtype_name in DTYPE_NAMES:
        dtype = TORCH_DTYPES[dtype_name]
        log_rate = torch.tensor(np.log(rate), dtype=dtype, requires_grad=True)
        # One evaluation of every quantity, one backward pass per quantity.
        scalars = _library_scalars(
            pyro_constrained,
            torch_losses,
            log_rate.exp(),
            torch.tensor(other, dtype=dtype),
            k,
            torch.tensor(target, dtype=dtype),
            torch.distributions.kl_divergence,
            value,
        )
        grads = {
            name: torch.autograd.grad(scalars[name], log_rate, retain_graph=True)[0]
            for name in names
        }
        check(grads, dtype_name, "torch")

        # float32 with x64 on accumulates in float64 as float64 does: x64 off is the case.
        with jax.enable_x64(dtype_name == "float64"):
            arrays = [jnp.asarray(a, dtype_name) for a in (np.log(rate), other, target, value)]
            jacobian = _jax_log_rate_jacobian(*arrays, k=k)
        grads = dict(zip(names, np.asarray(jacobian), strict=True))
        check(grads, dtype_name, f"jax x64={dtype_name == 'float64'}")


def _jax_quantities(log_rate, other, target, value, k):
    from numpyro_constrained import losses as jax_losses

    scalars = _library_scalars(
        numpyro_constrained,
        jax_losses,
        jnp.exp(log_rate),
        other,
        k,
        target,
        jax_kl_divergence,
        value,
    )
    return jnp.stack(list(scalars.values()))


@functools.partial(jax.jit, static_argnames=("k",))
def _jax_log_rate_jacobian(log_rate, other, target, value, *, k):
    """One compiled Jacobian of every quantity (eager gradients compile each primitive
    apart), compiled once per k and dtype: the rates, target and value are arguments."""
    return jax.jacrev(_jax_quantities)(log_rate, other, target, value, k)


# Expected losses at real-valued targets (issue 29) ------------------------------------------

REAL_TARGET = st.floats(-3.0, 9.0, allow_nan=False, allow_infinity=False)


def _mp_expected_losses(rate, k, target) -> tuple[float, float]:
    """E ||z - y||_1 and E ||z - y||_2^2 averaged over every composition with the 60-digit
    pmf (a float64 pmf of 1 - 2e-17 rounds to 1 and loses the rest)."""
    import mpmath

    support, log_pmf = oracle.mp_enumerated_log_pmf(rate, k)
    with mpmath.workdps(oracle._digits_for(rate) + 20):
        y = [mpmath.mpf(float(v)) for v in target]
        pmf = [mpmath.exp(w) for w in log_pmf]
        l1 = mpmath.fsum(
            w * mpmath.fsum(abs(z - v) for z, v in zip(row, y, strict=True))
            for w, row in zip(pmf, support.tolist(), strict=True)
        )
        l2 = mpmath.fsum(
            w * mpmath.fsum((z - v) ** 2 for z, v in zip(row, y, strict=True))
            for w, row in zip(pmf, support.tolist(), strict=True)
        )
        return float(l1), float(l2)


@settings(max_examples=15)
@given(
    rate=rate_vectors(sizes=(3,)),
    k=st.sampled_from([0, 1, 4, 6]),
    target=st.lists(
        st.one_of(REAL_TARGET, st.integers(-2, 8).map(float), REAL_TARGET.map(math.floor)),
        min_size=3,
        max_size=3,
    ),
)
def test_expected_losses_at_real_targets_match_enumeration(rate, k, target):
    # Rates over 60 decades, targets integer, whole-number and not, inside [0, k] or not,
    # against the enumerated average over every composition, both packages and dtypes and
    # NumPyro's float32 with x64 off too.
    target = np.asarray(target, np.float64)
    for dtype_name in DTYPE_NAMES:
        held = _rounded(rate, dtype_name)
        expected_l1, expected_l2 = _mp_expected_losses(held, k, target)
        scale = np.abs(target).sum() + k
        d = _torch(rate, k, dtype_name)
        y = torch.tensor(target, dtype=TORCH_DTYPES[dtype_name])
        actual = [
            pyro_constrained.losses.expected_l1_loss(d, y),
            pyro_constrained.losses.expected_l2_loss(d, y),
        ]
        _assert_close(actual[0], expected_l1, dtype_name, scale, "torch l1")
        _assert_close(actual[1], expected_l2, dtype_name, scale**2, "torch l2")
        for x64 in [True, False] if dtype_name == "float32" else [True]:
            with jax.enable_x64(x64):
                d = _jax(rate, k, dtype_name)
                y = jnp.asarray(target, JAX_DTYPES[dtype_name])
                actual = [
                    float(numpyro_constrained.losses.expected_l1_loss(d, y)),
                    float(numpyro_constrained.losses.expected_l2_loss(d, y)),
                ]
            if x64:
                _assert_close(actual[0], expected_l1, dtype_name, scale, "jax l1")
                _assert_close(actual[1], expected_l2, dtype_name, scale**2, "jax l2")
            else:
                # float32 accumulation: (k p - y)(1 - 2 F) and its kin cancel to a few
                # float32 ulps of the targets' and k's size.
                eps32 = float(np.finfo(np.float32).eps)
                for got, want, size in [
                    (actual[0], expected_l1, scale),
                    (actual[1], expected_l2, scale**2),
                ]:
                    assert abs(got - want) <= 1e-4 * abs(want) + 8 * eps32 * size, (got, want)
