"""CountConstrainedBernoulli in both packages against brute-force enumeration of the
2^n binary vectors (log_prob, marginals, entropy, KL, the count law, mode, the support),
finite differences, chi-square tests of the samplers, and torch-vs-JAX agreement."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
from numpyro.distributions.kl import kl_divergence as jax_kl

import numpyro_constrained as nc
import pyro_constrained as pc

LOGITS = np.array(
    [
        [1.0, -0.5, 0.3, 2.0, -1.0, 0.7],
        [0.2, np.inf, -3.0, 4.0, -np.inf, 0.0],  # one forced on, one forced off
        [30.0, -25.0, 1e-3, -1e4, 12.0, -0.2],  # saturated and masking-size logits
    ]
)
LOW = np.array([1, 2, 0])
HIGH = np.array([2, 4, 3])


def _brute(logits, low, high):
    """(support vectors, their probabilities) of one batch element, in float64 log space."""
    n = len(logits)
    vectors, scores = [], []
    for z in itertools.product((0, 1), repeat=n):
        z = np.array(z, dtype=np.float64)
        if not low <= z.sum() <= high:
            continue
        if np.any((z == 1) & (logits == -np.inf)) or np.any((z == 0) & (logits == np.inf)):
            continue
        vectors.append(z)
        scores.append((np.where(np.isfinite(logits), logits, 0.0) * z).sum())
    scores = np.array(scores)
    log_p = scores - scores.max()
    log_p = log_p - np.log(np.exp(log_p).sum())
    return np.array(vectors), log_p


def _frameworks(logits=LOGITS, low=LOW, high=HIGH, dtype="float64"):
    t = pc.CountConstrainedBernoulli(
        logits=torch.tensor(logits, dtype=getattr(torch, dtype)),
        low=torch.tensor(low),
        high=torch.tensor(high),
        validate_args=False,
    )
    j = nc.CountConstrainedBernoulli(
        logits=jnp.asarray(logits, dtype=getattr(jnp, dtype)),
        low=jnp.asarray(low),
        high=jnp.asarray(high),
        validate_args=False,
    )
    return (t, lambda a: a.detach().numpy(), torch.tensor), (j, np.asarray, jnp.asarray)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_against_enumeration(dtype):
    rtol = 1e-12 if dtype == "float64" else 2e-5
    for d, as_np, as_array in _frameworks(dtype=dtype):
        mean, entropy, mode, counts = map(
            as_np, (d.mean, d.entropy(), d.mode, d.count_distribution)
        )
        supports = [_brute(LOGITS[b], LOW[b], HIGH[b]) for b in range(len(LOGITS))]
        # Every batch element's support in one call (one shape, one compilation in JAX):
        # the shorter supports padded with their first vector.
        size = max(len(vectors) for vectors, _ in supports)
        values = np.stack(
            [np.concatenate([v, np.repeat(v[:1], size - len(v), 0)]) for v, _ in supports], 1
        )
        scores = as_np(d.log_prob(as_array(values.astype(dtype))))
        for b, (vectors, log_p) in enumerate(supports):
            p = np.exp(log_p)
            np.testing.assert_allclose(scores[: len(vectors), b], log_p, rtol=rtol, atol=rtol)
            np.testing.assert_allclose(mean[b], p @ vectors, rtol=rtol, atol=rtol * 1e-3)
            np.testing.assert_allclose(entropy[b], -(p * log_p).sum(), rtol=rtol, atol=rtol)
            np.testing.assert_array_equal(mode[b], vectors[np.argmax(log_p)])
            law = np.bincount(vectors.sum(-1).astype(int), weights=p, minlength=7)
            np.testing.assert_allclose(counts[b], law, rtol=rtol, atol=rtol * 1e-3)
        # A vector outside the range has probability 0.
        outside = np.zeros(LOGITS.shape, dtype=dtype)
        assert np.all(as_np(d.log_prob(as_array(outside)))[:2] == -np.inf)


def test_enumerate_support_and_kl():
    logits, other = LOGITS[0], LOGITS[0] * -0.7 + 0.3
    vectors, log_p = _brute(logits, 1, 3)
    _, log_q = _brute(other, 1, 3)
    expected_kl = float((np.exp(log_p) * (log_p - log_q)).sum())
    t = pc.CountConstrainedBernoulli(logits=torch.tensor(logits), low=1, high=3)
    support = t.enumerate_support()
    assert {tuple(v) for v in support.tolist()} == {tuple(v) for v in vectors.tolist()}
    assert float(t.log_prob(support).exp().sum()) == pytest.approx(1.0, rel=1e-13)
    t_other = pc.CountConstrainedBernoulli(logits=torch.tensor(other), low=1, high=3)
    assert float(torch.distributions.kl_divergence(t, t_other)) == pytest.approx(
        expected_kl, rel=1e-12
    )
    j = nc.CountConstrainedBernoulli(logits=jnp.asarray(logits), low=1, high=3)
    j_other = nc.CountConstrainedBernoulli(logits=jnp.asarray(other), low=1, high=3)
    assert np.asarray(j.enumerate_support()).shape == (len(vectors), 6)
    assert float(jax_kl(j, j_other)) == pytest.approx(expected_kl, rel=1e-12)
    with pytest.raises(ValueError, match="same bounds"):
        torch.distributions.kl_divergence(
            t, pc.CountConstrainedBernoulli(logits=torch.tensor(other), low=0, high=3)
        )


def test_kl_needs_the_same_feasible_range_in_every_batch_element():
    """The same bounds and first feasible count, but a -inf logit that takes count 5 away
    from a different element of p and of q: a clear ValueError in both packages (torch
    compared only the first count and the width, and failed inside the stacked
    ExactlyKBernoulli KL with "needs the same k")."""
    inf = np.inf
    p = np.array([[0.1, 0.2, -0.3, 0.4, -inf], [0.1, 0.2, -0.3, 0.4, 0.5]])
    q = np.array([[0.3, -0.2, 0.1, 0.0, 0.2], [0.3, -0.2, 0.1, 0.0, -inf]])
    with pytest.raises(ValueError, match="same bounds"):
        torch.distributions.kl_divergence(
            pc.CountConstrainedBernoulli(logits=torch.tensor(p), low=0, high=5),
            pc.CountConstrainedBernoulli(logits=torch.tensor(q), low=0, high=5),
        )
    with pytest.raises(ValueError, match="same feasible range"):
        jax_kl(
            nc.CountConstrainedBernoulli(logits=jnp.asarray(p), low=0, high=5),
            nc.CountConstrainedBernoulli(logits=jnp.asarray(q), low=0, high=5),
        )


def test_kl_broadcasts_batch_shapes():
    """p with batch (2,), q with batch (): each element's KL against the brute-force one,
    in both packages (NumPyro compared the stacked batch shapes for equality and refused)."""
    logits, other = LOGITS[[0, 2]], LOGITS[0] * -0.7 + 0.3  # finite: one feasible range
    expected = []
    for row in logits:
        vectors, log_p = _brute(row, 1, 3)
        _, log_q = _brute(other, 1, 3)
        expected.append(float((np.exp(log_p) * (log_p - log_q)).sum()))
    t = torch.distributions.kl_divergence(
        pc.CountConstrainedBernoulli(logits=torch.tensor(logits), low=1, high=3),
        pc.CountConstrainedBernoulli(logits=torch.tensor(other), low=1, high=3),
    )
    j = jax_kl(
        nc.CountConstrainedBernoulli(logits=jnp.asarray(logits), low=1, high=3),
        nc.CountConstrainedBernoulli(logits=jnp.asarray(other), low=1, high=3),
    )
    np.testing.assert_allclose(t.numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(np.asarray(j), expected, rtol=1e-12)


def test_empty_sample_shapes_and_boolean_values():
    """A sample shape with a 0 gives an empty draw (torch.multinomial refused to draw
    none); a boolean value is a 0/1 vector (the torch support check cast high = 2 to True)."""
    t = pc.CountConstrainedBernoulli(logits=torch.zeros(3, 4), low=1, high=2, validate_args=True)
    j = nc.CountConstrainedBernoulli(logits=jnp.zeros((3, 4)), low=1, high=2, validate_args=True)
    for shape in [(0,), (2, 0)]:
        assert t.sample(shape).shape == shape + (3, 4)
        assert t.rsample(shape).shape == shape + (3, 4)
        assert j.sample(jax.random.PRNGKey(0), shape).shape == shape + (3, 4)
    value = np.array([True, True, False, False])
    expected = np.log(1 / (4 + 6))  # uniform over the 4 + 6 vectors with 1 or 2 ones
    for got in (
        t.log_prob(torch.tensor(value)).numpy(),
        np.asarray(j.log_prob(jnp.asarray(value))),
    ):
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_gradients_against_finite_differences():
    logits, low, high = LOGITS[0], 2, 4

    def entropy(x):
        _, log_p = _brute(x, low, high)
        return -(np.exp(log_p) * log_p).sum()

    def log_z(x):
        vectors, _ = _brute(x, low, high)
        return np.log(np.exp(vectors @ x).sum())

    step = 1e-6
    eye = np.eye(len(logits)) * step
    fd_entropy = np.array([(entropy(logits + e) - entropy(logits - e)) / (2 * step) for e in eye])
    fd_log_z = np.array([(log_z(logits + e) - log_z(logits - e)) / (2 * step) for e in eye])
    x = torch.tensor(logits, requires_grad=True)
    d = pc.CountConstrainedBernoulli(logits=x, low=low, high=high)
    d.entropy().backward()
    np.testing.assert_allclose(x.grad.numpy(), fd_entropy, atol=1e-8)
    # The marginals are the derivative of the log-normaliser.
    np.testing.assert_allclose(d.mean.detach().numpy(), fd_log_z, atol=1e-8)
    grad = jax.grad(lambda x: nc.CountConstrainedBernoulli(logits=x, low=low, high=high).entropy())(
        jnp.asarray(logits)
    )
    np.testing.assert_allclose(grad, fd_entropy, atol=1e-8)
    # Straight-through: the sample's gradient is the marginals' Jacobian (torch and JAX agree).
    x.grad = None
    pc.CountConstrainedBernoulli(logits=x, low=low, high=high).rsample().sum().backward()
    key = jax.random.PRNGKey(0)
    jax_grad = jax.grad(
        lambda x: nc.CountConstrainedBernoulli(logits=x, low=low, high=high).sample(key).sum()
    )(jnp.asarray(logits))
    np.testing.assert_allclose(x.grad.numpy(), jax_grad, atol=1e-12)


def test_samplers_chi_square():
    logits, low, high = LOGITS[1], LOW[1], HIGH[1]
    vectors, log_p = _brute(logits, low, high)
    index = {tuple(v): i for i, v in enumerate(vectors.tolist())}
    num = 8000
    torch.manual_seed(0)
    t = pc.CountConstrainedBernoulli(logits=torch.tensor(logits), low=low, high=high)
    j = nc.CountConstrainedBernoulli(logits=jnp.asarray(logits), low=low, high=high)
    for draws in (t.sample((num,)).numpy(), np.asarray(j.sample(jax.random.PRNGKey(3), (num,)))):
        observed = np.bincount([index[tuple(v)] for v in draws.tolist()], minlength=len(vectors))
        assert scipy.stats.chisquare(observed, np.exp(log_p) * num).pvalue > 1e-3


def test_validation_and_shapes():
    with pytest.raises(ValueError, match="low <= high"):
        pc.CountConstrainedBernoulli(logits=torch.zeros(4), low=3, high=2, validate_args=True)
    with pytest.raises(ValueError, match="impossible"):
        pc.CountConstrainedBernoulli(
            logits=torch.tensor([np.inf, np.inf, 0.0]), high=1, validate_args=True
        )
    with pytest.raises(ValueError, match="low <= high"):
        nc.CountConstrainedBernoulli(logits=jnp.zeros(4), low=3, high=2, validate_args=True)
    with pytest.raises(ValueError):
        pc.CountConstrainedBernoulli(logits=torch.zeros(4), high=2.5)
    t = pc.CountConstrainedBernoulli(logits=torch.zeros(3, 5), high=torch.tensor([1, 2, 3]))
    assert t.batch_shape == (3,) and t.event_shape == (5,)
    assert t.sample((2,)).shape == (2, 3, 5)
    assert t.expand((4, 3)).log_prob(torch.zeros(4, 3, 5)).shape == (4, 3)


def test_jax_float32_without_x64():
    b = 2  # saturated and masking-size logits
    vectors, log_p = _brute(LOGITS[b], LOW[b], HIGH[b])
    with jax.enable_x64(False):
        d = nc.CountConstrainedBernoulli(
            logits=jnp.asarray(LOGITS[b], jnp.float32), low=LOW[b], high=HIGH[b]
        )
        got = d.log_prob(jnp.asarray(vectors, jnp.float32))
        mean, entropy = d.mean, d.entropy()
        assert got.dtype == jnp.float32 and mean.dtype == jnp.float32
        got, mean, entropy = np.asarray(got), np.asarray(mean), float(entropy)
    p = np.exp(log_p)
    np.testing.assert_allclose(got, log_p, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(mean, p @ vectors, rtol=2e-5, atol=1e-7)
    assert entropy == pytest.approx(-(p * log_p).sum(), rel=2e-5, abs=2e-6)


def test_expected_losses_against_enumeration():
    """The closed-form expected L1 and L2 losses against the average over the enumerated
    support (real targets, inside and outside [0, 1]), torch and JAX alike, and the
    gradient of the L2 loss in the logits against finite differences of the enumeration."""
    from numpyro_constrained.losses import expected_l1_loss as jax_l1
    from numpyro_constrained.losses import expected_l2_loss as jax_l2
    from pyro_constrained.losses import expected_l1_loss, expected_l2_loss

    target = np.random.default_rng(4).uniform(-0.5, 1.5, size=LOGITS.shape)
    expected = np.zeros((2, len(LOGITS)))
    for b in range(len(LOGITS)):
        vectors, log_p = _brute(LOGITS[b], LOW[b], HIGH[b])
        p = np.exp(log_p)
        expected[0, b] = p @ np.abs(vectors - target[b]).sum(-1)
        expected[1, b] = p @ ((vectors - target[b]) ** 2).sum(-1)
    (t, _, _), (j, _, _) = _frameworks()
    got_torch = [f(t, torch.tensor(target)).numpy() for f in (expected_l1_loss, expected_l2_loss)]
    got_jax = [np.asarray(f(j, jnp.asarray(target))) for f in (jax_l1, jax_l2)]
    np.testing.assert_allclose(got_torch, expected, rtol=1e-12)
    np.testing.assert_allclose(got_jax, expected, rtol=1e-12)

    # The bounds of test_gradients_against_finite_differences: JAX reuses its compilations.
    logits, low, high, y = LOGITS[0], 2, 4, target[0]

    def loss(x):
        vectors, log_p = _brute(x, low, high)
        return np.exp(log_p) @ ((vectors - y) ** 2).sum(-1)

    step = 1e-6
    fd = np.array([(loss(logits + e) - loss(logits - e)) / (2 * step) for e in np.eye(6) * step])
    x = torch.tensor(logits, requires_grad=True)
    d = pc.CountConstrainedBernoulli(logits=x, low=low, high=high)
    expected_l2_loss(d, torch.tensor(y)).backward()
    np.testing.assert_allclose(x.grad.numpy(), fd, atol=1e-8)
    grad = jax.grad(
        lambda x: jax_l2(nc.CountConstrainedBernoulli(logits=x, low=low, high=high), y)
    )(jnp.asarray(logits))
    np.testing.assert_allclose(grad, fd, atol=1e-8)


def test_empty_range_without_validation():
    # low > high (the last batch element) with validation off: log_prob -inf, marginals and
    # entropy NaN there, the other elements unaffected (NumPyro's log_prob raised from
    # inside ExactlyKBernoulli: the placeholder count exceeded k_max). The stacked shapes are
    # those of test_against_enumeration, so JAX reuses its compilations.
    low, high = np.array([0, 2, 5]), np.array([3, 4, 2])
    value = np.zeros(LOGITS.shape)
    value[:, :3] = 1.0
    value[1, 4] = 0.0  # (forced off there)
    for d, as_np, as_array in _frameworks(low=low, high=high):
        log_prob = as_np(d.log_prob(as_array(value)))
        assert log_prob[2] == -np.inf and np.all(np.isfinite(log_prob[:2]))
        assert np.all(np.isnan(as_np(d.mean)[2])) and np.all(np.isfinite(as_np(d.mean)[:2]))
        assert np.isnan(as_np(d.entropy())[2])


def test_gradient_in_probs_with_exact_zeros_and_ones():
    # Exact 0 and 1 force a variable off / on; the gradient in the other probabilities is
    # that of the enumerated law, with no NaN from log(0) (it was NaN wherever they were).
    # n = 6 and a range of three counts, as test_gradients_against_finite_differences: JAX
    # reuses its compilations.
    probs = np.array([0.0, 1.0, 0.3, 0.7, 1.0, 0.5])
    value = np.array([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    interior = (probs > 0) & (probs < 1)

    def log_p(p):
        with np.errstate(divide="ignore"):
            logits = np.log(p) - np.log1p(-p)
        vectors, log_probs = _brute(logits, 2, 4)
        return log_probs[np.flatnonzero((vectors == value).all(-1))[0]]

    step = 1e-6
    expected = np.zeros(len(probs))
    for i in np.flatnonzero(interior):
        e = np.eye(len(probs))[i] * step
        expected[i] = (log_p(probs + e) - log_p(probs - e)) / (2 * step)
    x = torch.tensor(probs, requires_grad=True)
    pc.CountConstrainedBernoulli(probs=x, low=2, high=4).log_prob(torch.tensor(value)).backward()
    grad_jax = jax.grad(
        lambda p: nc.CountConstrainedBernoulli(probs=p, low=2, high=4).log_prob(value)
    )(jnp.asarray(probs))
    for grad in (x.grad.numpy(), np.asarray(grad_jax)):
        assert np.all(np.isfinite(grad))
        np.testing.assert_allclose(grad[interior], expected[interior], atol=1e-7)
