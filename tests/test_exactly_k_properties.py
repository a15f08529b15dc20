"""Property-based tests of ExactlyKBernoulli on adversarial logits, both packages.

Logits are drawn from mixtures of ordinary values, masking values (-1e4, -1e9), forced-on
values (+1e4, +1e9), clusters near +-200 and +-1e3, and +-inf; every property is checked
against brute-force enumeration written in ``tests/oracles/exactly_k.py`` (scores taken
relative to the best subset with ``math.fsum``, so it is exact for logits of any size),
computed on the logits as rounded to the dtype under test.

Tolerances: the library promises results exact to the working precision. Its float32
tables carry rounding errors of a few eps per node, so float32 quantities are compared to
``2e-5`` (absolute for marginals and entropy, relative to ``max(1, |x|)`` for log
probabilities) and float64 ones to ``1e-10``; an error caused by lost mass (the failures
these tests were written against) is of order 1.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from numpyro_constrained import ExactlyKBernoulli as JaxExactlyKBernoulli
from pyro_constrained import ExactlyKBernoulli as TorchExactlyKBernoulli
from tests.oracles import exactly_k as oracle

TOLERANCE = {"float32": 2e-5, "float64": 1e-10}
FRAMEWORKS = ["torch", "jax"]
DTYPES = ["float32", "float64"]


@st.composite
def adversarial_logits(draw, max_n: int = 9):
    """A logit vector (float64 numpy array) mixing ordinary and extreme values."""
    n = draw(st.integers(1, max_n))
    spread = draw(st.sampled_from([0.5, 3.0]))
    ordinary = st.floats(-3.0, 3.0).map(lambda x: x * spread)
    extreme = st.sampled_from([-1e9, -1e4, -1e3, -200.0, 200.0, 1e3, 1e4, 1e9])
    jitter = st.sampled_from([0.0, 0.3, -1.7, 25.0])
    clustered = st.tuples(extreme, jitter).map(lambda pair: pair[0] + pair[1])
    infinite = st.sampled_from([-math.inf, math.inf])
    entry = st.one_of(ordinary, ordinary, clustered, clustered, infinite)
    return np.array(draw(st.lists(entry, min_size=n, max_size=n)))


def _rounded(logits: np.ndarray, dtype: str) -> np.ndarray:
    return logits.astype(dtype).astype(np.float64)


def _make(framework: str, dtype: str, logits: np.ndarray, k, validate_args=None):
    if framework == "torch":
        tensor = torch.tensor(logits, dtype=getattr(torch, dtype))
        return TorchExactlyKBernoulli(logits=tensor, k=k, validate_args=validate_args)
    array = jnp.asarray(logits, dtype=getattr(jnp, dtype))
    return JaxExactlyKBernoulli(logits=array, k=k, validate_args=validate_args)


def _value(framework: str, dtype: str, rows: np.ndarray):
    if framework == "torch":
        return torch.tensor(rows, dtype=getattr(torch, dtype))
    return jnp.asarray(rows, dtype=getattr(jnp, dtype))


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def _sample(framework: str, distribution, num: int) -> np.ndarray:
    if framework == "torch":
        return _numpy(distribution.sample((num,)))
    return _numpy(distribution.sample(jax.random.PRNGKey(num), (num,)))


def _close(actual, expected, tolerance: float) -> bool:
    actual, expected = np.asarray(actual), np.asarray(expected)
    same_infinity = (actual == expected) & np.isinf(expected)
    error = np.abs(actual - expected)
    return bool(np.all(same_infinity | (error <= tolerance * np.maximum(1.0, np.abs(expected)))))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
@given(logits=adversarial_logits(), data=st.data())
def test_every_quantity_matches_exact_enumeration(framework, dtype, logits, data):
    k = data.draw(st.integers(0, logits.shape[0]), label="k")
    reference = oracle.exact_enumeration(_rounded(logits, dtype), k)
    if reference is None:  # the infinite logits rule out every k-subset
        with pytest.raises(ValueError, match="impossible"):
            _make(framework, dtype, logits, k)
        d = _make(framework, dtype, logits, k, validate_args=False)
        assert np.all(_numpy(d.log_constraint_prob()) == -np.inf)
        anything = np.zeros((1, logits.shape[0]))
        anything[0, :k] = 1.0
        assert np.all(_numpy(d.log_prob(_value(framework, dtype, anything))) == -np.inf)
        return
    subsets, log_probs, log_normalizer, marginals, entropy = reference
    tolerance = TOLERANCE[dtype]
    d = _make(framework, dtype, logits, k)
    mu = _numpy(d.mean)
    assert np.all(np.abs(mu - marginals) <= tolerance), (mu, marginals)
    assert abs(float(d.entropy()) - entropy) <= tolerance * max(1.0, entropy)
    log_prob = _numpy(d.log_prob(_value(framework, dtype, subsets)))
    assert _close(log_prob, log_probs, tolerance), (log_prob, log_probs)
    expected = oracle.log_constraint_prob_by_enumeration(_rounded(logits, dtype), k)
    assert _close(float(d.log_constraint_prob()), expected, tolerance)
    # Exact draws: k-hot, and only subsets that the reference gives positive probability.
    draws = _sample(framework, d, 64)
    assert np.all((draws == 0) | (draws == 1)) and np.all(draws.sum(-1) == k)
    possible = {tuple(row) for row, lp in zip(subsets, log_probs, strict=True) if lp > -700}
    assert all(tuple(row) in possible for row in draws)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("framework", FRAMEWORKS)
@given(logits=adversarial_logits(max_n=7), data=st.data())
def test_kl_matches_enumeration(framework, dtype, logits, data):
    n = logits.shape[0]
    k = data.draw(st.integers(0, n), label="k")
    # q: the same forced pattern (so the KL is finite) with other finite values, or p itself.
    other = data.draw(adversarial_logits(max_n=n).filter(lambda x: x.shape[0] == n), label="q")
    q_logits = np.where(np.isfinite(logits), np.where(np.isfinite(other), other, 0.0), logits)
    if data.draw(st.booleans(), label="q is p"):
        q_logits = logits
    rounded_p, rounded_q = _rounded(logits, dtype), _rounded(q_logits, dtype)
    if oracle.exact_enumeration(rounded_p, k) is None:
        return
    p_subsets, p_log_probs, *_ = oracle.exact_enumeration(rounded_p, k)
    q_subsets, q_log_probs, *_ = oracle.exact_enumeration(rounded_q, k)
    q_of = {tuple(row): lp for row, lp in zip(q_subsets, q_log_probs, strict=True)}
    expected = math.fsum(
        math.exp(lp) * (lp - q_of[tuple(row)])
        for row, lp in zip(p_subsets, p_log_probs, strict=True)
        if lp > -745
    )
    p, q = _make(framework, dtype, logits, k), _make(framework, dtype, q_logits, k)
    if framework == "torch":
        kl = float(torch.distributions.kl_divergence(p, q))
    else:
        from numpyro.distributions.kl import kl_divergence

        kl = float(kl_divergence(p, q))
    if q_logits is logits:
        assert kl == 0.0
    assert abs(kl - expected) <= TOLERANCE[dtype] * max(1.0, abs(expected)), (kl, expected)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@given(logits=adversarial_logits(), data=st.data())
def test_torch_and_jax_agree_on_identical_inputs(framework, logits, data):
    del framework  # one comparison, run twice to double the examples at no extra code
    k = data.draw(st.integers(0, logits.shape[0]), label="k")
    if oracle.exact_enumeration(logits, k) is None:
        return
    t, j = _make("torch", "float64", logits, k), _make("jax", "float64", logits, k)
    np.testing.assert_allclose(_numpy(t.mean), _numpy(j.mean), atol=1e-12)
    assert _close(float(t.entropy()), float(j.entropy()), 1e-12)
    assert _close(float(t.log_constraint_prob()), float(j.log_constraint_prob()), 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
@given(logits=adversarial_logits(), data=st.data())
def test_log_prob_gradient_is_value_minus_marginals(dtype, logits, data):
    """d log p(z) / d theta = z - mu at every finite logit, however large (torch autograd;
    the straight-through value of the stable formula must keep the formula's gradient)."""
    k = data.draw(st.integers(0, logits.shape[0]), label="k")
    reference = oracle.exact_enumeration(_rounded(logits, dtype), k)
    if reference is None:
        return
    subsets, log_probs, _, marginals, _ = reference
    z = subsets[data.draw(st.integers(0, len(subsets) - 1), label="subset")]
    theta = torch.tensor(logits, dtype=getattr(torch, dtype), requires_grad=True)
    d = TorchExactlyKBernoulli(logits=theta, k=k, validate_args=False)
    d.log_prob(torch.tensor(z, dtype=theta.dtype)).backward()
    finite = np.isfinite(logits)
    grad = theta.grad.numpy().astype(np.float64)
    assert np.all(np.isfinite(grad))
    expected = z - marginals
    assert np.all(np.abs(grad[finite] - expected[finite]) <= 10 * TOLERANCE[dtype])


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", ["zero", "n"])
def test_k_zero_and_k_n_have_zero_gradients(framework, dtype, where):
    logits = np.array([0.3, -1e4, 2.0, 1e9, -0.5])
    k = 0 if where == "zero" else logits.shape[0]
    if framework == "torch":
        theta = torch.tensor(logits, dtype=getattr(torch, dtype), requires_grad=True)
        d = TorchExactlyKBernoulli(logits=theta, k=k)
        # autograd.grad raises if an output does not depend on theta (no gradient at all).
        sample = (d.rsample() * torch.arange(5.0)).sum()
        (sample_grad,) = torch.autograd.grad(sample, theta, retain_graph=True)
        (grad,) = torch.autograd.grad(d.entropy() + d.log_prob(d.mode), theta)
        grad = np.concatenate([sample_grad.numpy(), grad.numpy()])
    else:

        def loss(theta):
            d = JaxExactlyKBernoulli(logits=theta, k=k)
            sample = d.sample(jax.random.PRNGKey(0))
            return (sample * jnp.arange(5.0)).sum() + d.entropy() + d.log_prob(d.mode)

        grad = np.asarray(jax.grad(loss)(jnp.asarray(logits, dtype=getattr(jnp, dtype))))
    assert np.all(grad == 0)


def _log_poisson_binomial(logits: np.ndarray) -> np.ndarray:
    """log P(sum z = j), j = 0..n, by the sequential log-space recursion in float64."""
    table = np.full(logits.shape[0] + 1, -np.inf)
    table[0] = 0.0
    log_on, log_off = -np.logaddexp(0.0, -logits), -np.logaddexp(0.0, logits)
    for i in range(logits.shape[0]):
        shifted = table[:-1] + log_on[i]
        table = table + log_off[i]
        table[1:] = np.logaddexp(table[1:], shifted)
    return table


@pytest.mark.user_config
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("spread", [0.0, 1.0])
def test_float32_log_constraint_prob_has_relative_error_below_1e_5_at_n_10000(framework, spread):
    """Near k = n / 2, log P(sum = k) is only about -5 while log e_k and sum softplus are
    about 7000: the difference of the two lost 1e-4 relative in float32. Equal logits are the
    worst case (rounding errors of identical nodes add up coherently)."""
    n = 10000
    logits = (np.random.default_rng(0).normal(size=n) * spread).astype(np.float32)
    expected = _log_poisson_binomial(logits.astype(np.float64))
    ks = np.array([0, 1, 100, 2500, 4900, 4999, 5000, 5001, 5100, 9000, 9999, 10000])
    if framework == "torch":
        d = TorchExactlyKBernoulli(logits=torch.tensor(logits), k=torch.tensor(ks)[:, None])
    else:
        d = JaxExactlyKBernoulli(logits=jnp.asarray(logits), k=jnp.asarray(ks)[:, None])
    actual = _numpy(d.log_constraint_prob())[:, 0]
    relative = np.abs(actual - expected[ks]) / np.abs(expected[ks])
    assert relative.max() <= 1e-5, dict(zip(ks.tolist(), relative.tolist(), strict=True))
