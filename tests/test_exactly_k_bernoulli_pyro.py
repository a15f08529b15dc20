"""pyro_constrained.ExactlyKBernoulli against enumeration, SciPy, finite differences and
goodness-of-fit tests."""

import math

import numpy as np
import pyro
import pyro.distributions as pdist
import pytest
import torch
from pyro.distributions.kl import kl_divergence as pyro_kl_divergence
from pyro.infer import SVI, Trace_ELBO, TraceMeanField_ELBO
from pyro.optim import Adam
from torch.distributions import kl_divergence

from pyro_constrained import ExactlyKBernoulli
from pyro_constrained.losses import expected_l1_loss, expected_l2_loss
from tests.oracles import exactly_k as oracle

INF = math.inf


def _cases():
    """(logits rows, k per row): random logits, per-row k, and rows with forced entries."""
    rng = np.random.default_rng(1)
    cases = []
    for n in (1, 4, 7):
        ks = np.arange(n + 1)
        cases.append((rng.normal(0.0, 2.0, size=(n + 1, n)), ks))
    forced = np.array(
        [
            [INF, 0.3, -INF, 1.0, -0.5, 2.0],
            [-INF, -INF, 0.1, 4.0, -3.0, 0.0],
            [INF, INF, -1.0, 0.5, -INF, 3.0],
            [0.2, -INF, INF, 1.0, -2.0, 0.0],
        ]
    )
    cases.append((forced, np.array([2, 3, 3, 1])))
    return cases


CASES = _cases()


@pytest.mark.parametrize("logits, ks", CASES)
def test_log_prob_marginals_entropy_match_enumeration(logits, ks):
    d = ExactlyKBernoulli(logits=torch.tensor(logits), k=torch.tensor(ks))
    assert d.batch_shape == (len(ks),) and d.event_shape == (logits.shape[1],)
    mean, entropy, variance = d.mean.numpy(), d.entropy().numpy(), d.variance.numpy()
    unvalidated = ExactlyKBernoulli(
        logits=torch.tensor(logits), k=torch.tensor(ks), validate_args=False
    )
    for row, (theta, k) in enumerate(zip(logits, ks, strict=True)):
        subsets, probs = oracle.exactly_k_pmf(theta, k)
        # Score every subset under the whole batch and keep this row's column.
        log_probs = unvalidated.log_prob(torch.tensor(subsets)[:, None, :])[:, row].numpy()
        np.testing.assert_allclose(log_probs, np.log(probs), atol=1e-10, rtol=0)
        expected_mu = oracle.exactly_k_marginals(theta, k)
        np.testing.assert_allclose(mean[row], expected_mu, atol=1e-10, rtol=0)
        np.testing.assert_allclose(variance[row], expected_mu * (1 - expected_mu), atol=1e-10)
        np.testing.assert_allclose(entropy[row], oracle.exactly_k_entropy(theta, k), atol=1e-10)
        assert torch.allclose(d.marginals.probs[row], torch.tensor(expected_mu), atol=1e-10)


def test_simple_reference_vector():
    # SIMPLE (Ahmed et al. 2023), worked example: probs [.3, .6, .5, .2], k = 2.
    d = ExactlyKBernoulli(probs=torch.tensor([0.3, 0.6, 0.5, 0.2], dtype=torch.float64), k=2)
    expected = torch.tensor([0.35676, 0.76216, 0.65946, 0.22162], dtype=torch.float64)
    assert torch.allclose(d.mean, expected, atol=5e-6)
    assert abs(d.log_constraint_prob().exp().item() - 0.37) < 1e-12
    assert abs(d.entropy().item() - 1.49549) < 5e-6


@pytest.mark.parametrize("logits, ks", CASES)
def test_log_constraint_prob_matches_poisson_binomial(logits, ks):
    d = ExactlyKBernoulli(logits=torch.tensor(logits), k=torch.tensor(ks))
    got = d.log_constraint_prob().numpy()
    for row, (theta, k) in enumerate(zip(logits, ks, strict=True)):
        np.testing.assert_allclose(got[row], oracle.log_constraint_prob(theta, k), rtol=1e-9)


def test_kl_matches_enumeration_and_is_used_by_pyro():
    rng = np.random.default_rng(2)
    for n, k in [(5, 2), (6, 3), (4, 4)]:
        p_logits, q_logits = rng.normal(size=n) * 2, rng.normal(size=n) * 2
        p = ExactlyKBernoulli(logits=torch.tensor(p_logits), k=k)
        q = ExactlyKBernoulli(logits=torch.tensor(q_logits), k=k)
        expected = oracle.exactly_k_kl(p_logits, q_logits, k)
        assert abs(kl_divergence(p, q).item() - expected) < 1e-10
        assert abs(pyro_kl_divergence(p, q).item() - expected) < 1e-10
    # Infinite logits: finite where supp p is inside supp q, +inf otherwise.
    a = np.array([INF, 0.3, -INF, 1.0, -0.5])
    b = np.array([INF, 0.1, 0.0, -1.0, 2.0])
    pa, pb = (ExactlyKBernoulli(logits=torch.tensor(x), k=2) for x in (a, b))
    assert abs(kl_divergence(pa, pb).item() - oracle.exactly_k_kl(a, b, 2)) < 1e-10
    assert kl_divergence(pb, pa).item() == INF == oracle.exactly_k_kl(b, a, 2)


def test_kl_rejects_different_k_or_n():
    p = ExactlyKBernoulli(logits=torch.zeros(5), k=2)
    with pytest.raises(ValueError, match="same k"):
        kl_divergence(p, ExactlyKBernoulli(logits=torch.zeros(5), k=3))
    with pytest.raises(ValueError, match="same n"):
        kl_divergence(p, ExactlyKBernoulli(logits=torch.zeros(6), k=2))


@pytest.mark.parametrize("logits, ks", CASES[2:])
def test_expected_losses_match_enumeration_and_their_gradients(logits, ks):
    rng = np.random.default_rng(3)
    theta = torch.tensor(logits, requires_grad=True)
    targets = np.stack([oracle.k_subsets(logits.shape[1], k)[0] for k in ks])
    rng.shuffle(targets, axis=1)
    d = ExactlyKBernoulli(logits=theta, k=torch.tensor(ks))
    l1 = expected_l1_loss(d, torch.tensor(targets))
    l2 = expected_l2_loss(d, torch.tensor(targets))
    for row, (t, k) in enumerate(zip(logits, ks, strict=True)):
        want_l1, want_l2 = oracle.exactly_k_expected_losses(t, k, targets[row])
        assert abs(l1[row].item() - want_l1) < 1e-10
        assert abs(l2[row].item() - want_l2) < 1e-10
    # Gradient of the L2 loss of row 0 against central differences of the oracle.
    (grad,) = torch.autograd.grad(l2[0], theta)
    t0, k0, h = logits[0], ks[0], 1e-6
    for i in np.flatnonzero(np.isfinite(t0)):
        up, down = t0.copy(), t0.copy()
        up[i] += h
        down[i] -= h
        fd = (
            oracle.exactly_k_expected_losses(up, k0, targets[0])[1]
            - oracle.exactly_k_expected_losses(down, k0, targets[0])[1]
        ) / (2 * h)
        assert abs(grad[0, i].item() - fd) < 1e-7


def test_samples_follow_the_enumerated_pmf():
    logits = torch.tensor(
        [[0.5, -1.0, 2.0, 0.0, -0.3], [INF, -INF, 1.0, -1.5, 0.7], [3.0, -2.0, 0.0, 1.0, -4.0]],
        dtype=torch.float64,
    )
    ks = torch.tensor([2, 2, 3])
    samples = ExactlyKBernoulli(logits=logits, k=ks).sample((4000,))
    assert samples.shape == (4000, 3, 5) and samples.dtype == torch.float64
    for row in range(3):
        # p > 1e-3 fails by chance once in a thousand runs; seeds are fixed (conftest).
        pvalue = oracle.chi_square_pvalue(samples[:, row].numpy(), logits[row].numpy(), ks[row])
        assert pvalue > 1e-3


def test_float32_samples_follow_the_enumerated_pmf():
    theta = np.array([0.5, -1.0, 2.0, 0.0, -0.3, 1.2])
    samples = ExactlyKBernoulli(logits=torch.tensor(theta, dtype=torch.float32), k=3).sample(
        (3000,)
    )
    assert samples.dtype == torch.float32
    assert oracle.chi_square_pvalue(samples.numpy().astype(np.float64), theta, 3) > 1e-3


def test_rsample_is_exact_and_its_gradient_is_the_marginals_jvp():
    theta = np.array([0.5, -1.0, 2.0, -INF, 0.0, INF, -0.3])
    weights = np.array([1.0, -2.0, 0.5, 3.0, 1.5, -1.0, 0.25])
    logits = torch.tensor(theta, requires_grad=True)
    z = ExactlyKBernoulli(logits=logits, k=3).rsample((6,))
    assert ((z == 0) | (z == 1)).all() and (z.sum(-1) == 3).all()
    (grad,) = torch.autograd.grad((z * torch.tensor(weights)).sum(), logits)
    # d/dtheta_j sum_i w_i mu_i = sum_i w_i d mu_i / d theta_j, times 6 samples; the
    # Jacobian of mu is symmetric (a Hessian), so this is a directional derivative along w.
    h = 1e-6
    finite = np.isfinite(theta)
    step = np.where(finite, weights, 0.0) * h
    fd = (
        oracle.exactly_k_marginals(theta + step, 3) - oracle.exactly_k_marginals(theta - step, 3)
    ) / (2 * h)
    np.testing.assert_allclose(grad.numpy(), 6 * np.where(finite, fd, 0.0), atol=1e-6)


def test_log_prob_entropy_and_marginals_pass_gradcheck():
    theta = torch.tensor([0.5, -1.0, 2.0, 0.0, -0.3], dtype=torch.float64, requires_grad=True)
    value = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0], dtype=torch.float64)

    def with_forced(x):
        # Infinite logits at fixed places, so finite differences only move the finite ones.
        return torch.cat([x[:2], torch.tensor([-INF], dtype=x.dtype), x[2:], torch.tensor([INF])])

    assert torch.autograd.gradcheck(
        lambda x: ExactlyKBernoulli(logits=x, k=2).log_prob(value), (theta,)
    )
    assert torch.autograd.gradcheck(lambda x: ExactlyKBernoulli(logits=x, k=2).entropy(), (theta,))
    assert torch.autograd.gradgradcheck(
        lambda x: ExactlyKBernoulli(logits=with_forced(x), k=3).mean, (theta,)
    )
    assert torch.autograd.gradgradcheck(
        lambda x: ExactlyKBernoulli(logits=with_forced(x), k=3).log_constraint_prob(), (theta,)
    )


def test_second_derivatives_are_finite_with_minus_inf_logits():
    logits = torch.tensor([0.3, -INF, 1.0, -INF, 2.0], dtype=torch.float64, requires_grad=True)
    mu = ExactlyKBernoulli(logits=logits, k=2).mean
    (grad,) = torch.autograd.grad((mu * torch.arange(5.0)).sum(), logits, create_graph=True)
    (hess_row,) = torch.autograd.grad(grad[0], logits)
    assert torch.isfinite(grad).all() and torch.isfinite(hess_row).all()
    assert grad[1] == 0 and grad[3] == 0


def test_mode_is_the_most_likely_subset_with_deterministic_ties():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(5, 6))
    ks = np.array([0, 1, 2, 3, 6])
    mode = ExactlyKBernoulli(logits=torch.tensor(logits), k=torch.tensor(ks)).mode
    for row in range(5):
        subsets, probs = oracle.exactly_k_pmf(logits[row], ks[row])
        np.testing.assert_array_equal(mode[row].numpy(), subsets[np.argmax(probs)])
    tied = ExactlyKBernoulli(logits=torch.zeros(5), k=2).mode
    assert tied.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("k", [0, 6])
def test_k_zero_and_k_n_are_deterministic(k):
    logits = torch.tensor([0.5, -1.0, 2.0, 0.0, -0.3, 40.0], requires_grad=True)
    d = ExactlyKBernoulli(logits=logits, k=k)
    only = torch.full((6,), float(k > 0))
    assert torch.equal(d.sample((3,)), only.expand(3, 6))
    assert torch.equal(d.rsample(), only) and torch.equal(d.mean, only)
    assert abs(d.entropy().item()) < 1e-5 and abs(d.log_prob(only).item()) < 1e-5
    (grad,) = torch.autograd.grad(d.rsample().sum() + d.entropy(), logits)
    assert torch.isfinite(grad).all()


def test_probs_zero_and_one_work_like_infinite_logits():
    probs = torch.tensor([1.0, 0.0, 0.4, 0.7, 0.2], dtype=torch.float64)
    logits = torch.tensor([INF, -INF, math.log(0.4 / 0.6), math.log(0.7 / 0.3), math.log(0.25)])
    # Without validation: vectors that the infinite logits rule out get -inf.
    from_probs = ExactlyKBernoulli(probs=probs, k=2, validate_args=False)
    from_logits = ExactlyKBernoulli(logits=logits.double(), k=2, validate_args=False)
    subsets = torch.tensor(oracle.k_subsets(5, 2))
    log_probs = from_probs.log_prob(subsets)
    assert torch.allclose(log_probs, from_logits.log_prob(subsets), atol=1e-12)
    allowed = (subsets[:, 0] == 1) & (subsets[:, 1] == 0)
    assert (log_probs[~allowed] == -INF).all() and torch.isfinite(log_probs[allowed]).all()
    # With validation: such a vector is outside the support, a ValueError.
    for bad in ([0.0, 1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0, 0.0]):
        with pytest.raises(ValueError, match="outside the support"):
            ExactlyKBernoulli(probs=probs, k=2).log_prob(torch.tensor(bad, dtype=torch.float64))
    assert torch.allclose(from_probs.mean, from_logits.mean, atol=1e-12)
    z = from_probs.sample((200,))
    assert (z[:, 0] == 1).all() and (z[:, 1] == 0).all() and (z.sum(-1) == 2).all()
    assert torch.equal(from_probs.probs, probs)


def test_shapes_batch_expand_sample_shape_and_infer_shapes():
    logits = torch.randn(3, 1, 6)
    k = torch.tensor([1, 2, 3, 4])
    d = ExactlyKBernoulli(logits=logits, k=k)
    assert d.batch_shape == (3, 4) and d.event_shape == (6,)
    assert d.sample().shape == (3, 4, 6) and d.rsample((2, 5)).shape == (2, 5, 3, 4, 6)
    assert (d.sample((7,)).sum(-1) == k.float()).all()
    assert d.log_prob(d.sample((2,))).shape == (2, 3, 4)
    assert d.mean.shape == (3, 4, 6) and d.entropy().shape == (3, 4)
    assert d.log_constraint_prob().shape == (3, 4) and d.mode.shape == (3, 4, 6)
    e = ExactlyKBernoulli(logits=torch.randn(6), k=2).expand((5, 2))
    assert type(e) is ExactlyKBernoulli and e.batch_shape == (5, 2)
    assert e.sample((3,)).shape == (3, 5, 2, 6) and e.entropy().shape == (5, 2)
    assert torch.allclose(e.entropy(), e.entropy()[0, 0].expand(5, 2))
    assert ExactlyKBernoulli.infer_shapes(logits=(3, 1, 6), k=(4,)) == ((3, 4), (6,))
    assert ExactlyKBernoulli.infer_shapes(probs=(6,)) == ((), (6,))


def test_plates_give_the_right_shapes():
    def model():
        with pyro.plate("rows", 4, dim=-1):
            return pyro.sample("z", ExactlyKBernoulli(logits=torch.zeros(6), k=2))

    trace = pyro.poutine.trace(model).get_trace()
    trace.compute_log_prob()
    assert trace.nodes["z"]["value"].shape == (4, 6)
    assert trace.nodes["z"]["log_prob"].shape == (4,)
    expected = -math.log(math.comb(6, 2))
    assert torch.allclose(trace.nodes["z"]["log_prob"], torch.full((4,), expected), atol=1e-6)


BAD_INPUTS = [
    (dict(logits=torch.zeros(4), probs=torch.full((4,), 0.5), k=2), "exactly one"),
    (dict(k=2), "exactly one"),
    (dict(logits=torch.zeros(4), k=5), "k must be in 0..n"),
    (dict(logits=torch.zeros(4), k=-1), "k must be in 0..n"),
    (dict(logits=torch.zeros(4), k=torch.tensor([1, 5])), "k must be in 0..n"),
    (dict(logits=torch.zeros(4), k=1.5), "k must be"),
    (dict(logits=torch.zeros(4), k=torch.tensor([2.0, 2.5])), "k must"),
    (dict(logits=torch.zeros(4), k=2, k_max=1), "k_max"),
    (dict(logits=torch.zeros(4), k=True), "k must be"),
    (dict(logits=torch.zeros(3, 4), k=torch.tensor([1, 2])), "broadcast"),
    (dict(logits=torch.tensor(0.0), k=0), "at least one dimension"),
    (dict(logits=torch.tensor([0.0, math.nan, 1.0]), k=1), "logits"),
    (dict(probs=torch.tensor([0.2, 1.5, 0.1]), k=1), "probs"),
    (dict(logits=torch.tensor([INF, INF, 0.0]), k=1), "impossible"),
    (dict(logits=torch.tensor([-INF, -INF, 0.0]), k=2), "impossible"),
    (dict(probs=torch.tensor([1.0, 0.5, 0.0]), k=0), "impossible"),
]


@pytest.mark.parametrize("kwargs, message", BAD_INPUTS)
def test_bad_input_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ExactlyKBernoulli(**kwargs, validate_args=True)


OUTSIDE = [
    [1.0, 1.0, 1.0, 0.0],  # wrong count
    [1.0, 0.5, 0.5, 0.0],  # not binary
    [0.0, 1.0, 0.0, 1.0],  # a one where the logit is -inf
    [0.0, 0.0, 1.0, 1.0],  # a zero where the logit is +inf
]


@pytest.mark.parametrize("value", OUTSIDE)
def test_log_prob_outside_the_support(value):
    logits = torch.tensor([INF, -INF, 0.3, -0.2])
    value = torch.tensor(value)
    unvalidated = ExactlyKBernoulli(logits=logits, k=2, validate_args=False)
    assert unvalidated.log_prob(value).item() == -INF
    if value.sum() != 2 or not ((value == 0) | (value == 1)).all():
        with pytest.raises(ValueError, match="support"):
            ExactlyKBernoulli(logits=logits, k=2, validate_args=True).log_prob(value)


def test_float32_large_n_is_finite_and_close_to_float64():
    rng = np.random.default_rng(5)
    n = 300
    ks = torch.tensor([0, 1, 2, 37, 150, 263, 298, 299, 300])
    logits = torch.tensor(rng.normal(-1.0, 6.0, size=n)).expand(len(ks), n)
    d64 = ExactlyKBernoulli(logits=logits, k=ks)
    d32 = ExactlyKBernoulli(logits=logits.float(), k=ks)
    mu32 = d32.mean
    assert mu32.dtype == torch.float32
    for value in (mu32, d32.entropy(), d32.log_constraint_prob(), d32.log_prob(d32.mode)):
        assert torch.isfinite(value).all()
    assert (mu32.double() - d64.mean).abs().max() < 1e-4
    assert torch.allclose(mu32.sum(-1).double(), ks.double(), atol=1e-3)
    z = d32.rsample()
    assert z.dtype == torch.float32 and torch.equal(z.sum(-1), ks.float())


def _svi_recovers_the_subset(elbo) -> None:
    n, k = 8, 3
    truth = torch.zeros(n)
    truth[[1, 4, 6]] = 1.0
    data = truth + 0.4 * torch.randn(6, n)
    # The exact posterior is ExactlyKBernoulli with these logits (flat prior, Gaussian noise);
    # check that the problem is well posed, i.e. its mode is the truth.
    posterior_logits = ((2 * data - 1) / (2 * 0.4**2)).sum(0)
    assert torch.equal(ExactlyKBernoulli(logits=posterior_logits, k=k).mode, truth)

    def model():
        z = pyro.sample("z", ExactlyKBernoulli(logits=torch.zeros(n), k=k))
        with pyro.plate("data", data.shape[0], dim=-1):
            pyro.sample("x", pdist.Normal(z, 0.4).to_event(1), obs=data)

    def guide():
        logits = pyro.param("logits", torch.zeros(n))
        pyro.sample("z", ExactlyKBernoulli(logits=logits, k=k))

    svi = SVI(model, guide, Adam({"lr": 0.1}), elbo)
    for _ in range(150):
        svi.step()
    learned = pyro.param("logits").detach()
    assert torch.equal(ExactlyKBernoulli(logits=learned, k=k).mode, truth)
    # The straight-through estimator is biased, so the guide need not reach the (nearly
    # deterministic) exact posterior; over seeds 0-7 the learned inclusion probabilities of
    # the true features stayed above 0.58 and the others below 0.30. Assert that separation.
    mu = ExactlyKBernoulli(logits=learned, k=k).mean
    assert mu[truth == 1].min() > 0.5
    assert mu[truth == 1].min() - mu[truth == 0].max() > 0.25


def test_svi_trace_elbo_recovers_the_subset():
    _svi_recovers_the_subset(Trace_ELBO())


def test_svi_trace_mean_field_elbo_recovers_the_subset():
    _svi_recovers_the_subset(TraceMeanField_ELBO())


# ----------------------------------------------------------------------------------------
# Framework conformance (issue 15): parameter constraints, the count rule, k_max, value
# shapes, and Pyro's JIT ELBOs.


def test_arg_constraints_have_the_event_dims_of_their_parameters():
    # torch's test_params_constraints: every parameter satisfies its constraint, checked
    # with the constraint's event_dim (one verdict per batch element).
    constraints_ = ExactlyKBernoulli.arg_constraints
    assert constraints_["logits"].event_dim == 1 and constraints_["probs"].event_dim == 1
    assert constraints_["k"].event_dim == 0
    logits = torch.tensor([[INF, -INF, 0.3], [1e9, 0.0, -2.0]])
    for d in (
        ExactlyKBernoulli(logits=logits, k=1),
        ExactlyKBernoulli(probs=torch.sigmoid(logits), k=torch.tensor([1, 2])),
    ):
        for name, constraint in constraints_.items():
            verdict = constraint.check(getattr(d, name))
            assert verdict.shape == d.batch_shape and bool(verdict.all()), name
    assert not constraints_["logits"].check(torch.tensor([0.0, math.nan]))
    assert not constraints_["probs"].check(torch.tensor([0.5, 1.5]))


@pytest.mark.parametrize("k", [3.0, torch.tensor([3.0, 1.0]), np.array([3.0, 1.0])])
def test_whole_number_float_k_is_the_count(k):
    logits = torch.tensor(np.random.default_rng(12).normal(size=(2, 6)))
    d = ExactlyKBernoulli(logits=logits, k=k)
    assert d.k.dtype == torch.long
    ks = np.broadcast_to(np.asarray(k, dtype=float), (2,)).astype(int)
    assert d.k.tolist() == ks.tolist()
    for row in range(2):
        expected = oracle.exactly_k_entropy(logits[row].numpy(), ks[row])
        assert abs(d.entropy()[row].item() - expected) < 1e-10
    assert (d.sample((3,)).sum(-1) == torch.tensor(ks, dtype=torch.float64)).all()


@pytest.mark.parametrize("k", [3.5, torch.tensor([2.0, 2.5]), math.nan, torch.tensor(True)])
def test_non_whole_k_is_a_value_error_whatever_validate_args(k):
    for validate_args in (True, False):
        with pytest.raises(ValueError, match="k must"):
            ExactlyKBernoulli(logits=torch.zeros(6), k=k, validate_args=validate_args)


def test_k_max_is_accepted_kept_and_checked_against_k():
    d = ExactlyKBernoulli(
        logits=torch.zeros(6, dtype=torch.float64), k=torch.tensor([1, 3]), k_max=3
    )
    assert d.k_max == 3 and d.expand((4, 2)).k_max == 3
    assert abs(d.entropy()[1].item() - math.log(math.comb(6, 3))) < 1e-12
    assert ExactlyKBernoulli(logits=torch.zeros(6), k=2).k_max is None
    for validate_args in (True, False):
        with pytest.raises(ValueError, match="k_max"):
            ExactlyKBernoulli(
                logits=torch.zeros(6), k=torch.tensor([1, 4]), k_max=3, validate_args=validate_args
            )
    with pytest.raises(ValueError, match="k_max"):
        ExactlyKBernoulli(logits=torch.zeros(6), k=1, k_max=-1)


@pytest.mark.parametrize("shape", [(5,), (3,), (2, 4), (4, 1)])
def test_log_prob_of_a_wrong_shape_is_a_value_error_naming_the_expected_shape(shape):
    for validate_args in (True, False):
        d = ExactlyKBernoulli(logits=torch.zeros(3, 4), k=2, validate_args=validate_args)
        with pytest.raises(ValueError, match=r"\(\.\.\., 3, 4\)"):
            d.log_prob(torch.zeros(shape))
    assert d.log_prob(torch.tensor([1.0, 1.0, 0.0, 0.0])).shape == (3,)


def _jit_model_and_guide(n: int, k: int = 2):
    prior = torch.linspace(-1.0, 1.0, n, dtype=torch.float64)
    start = torch.tensor(np.random.default_rng(17).normal(0.0, 1.0, size=n))

    def model():
        pyro.sample("z", ExactlyKBernoulli(logits=prior, k=k))

    def guide():
        logits = pyro.param("logits", start.clone())
        pyro.sample("z", ExactlyKBernoulli(logits=logits, k=k))

    return model, guide, prior, start


@pytest.mark.filterwarnings("ignore")  # TracerWarnings of torch.jit.trace, SVI's discrete site
@pytest.mark.parametrize(
    "elbo, jit_elbo",
    [
        (pyro.infer.Trace_ELBO, pyro.infer.JitTrace_ELBO),
        (pyro.infer.TraceMeanField_ELBO, pyro.infer.JitTraceMeanField_ELBO),
        (pyro.infer.TraceGraph_ELBO, pyro.infer.JitTraceGraph_ELBO),
    ],
)
@pytest.mark.parametrize("n, k", [(6, 2), (40, 38)])
def test_jit_elbos_give_the_losses_and_steps_of_their_non_jit_versions(elbo, jit_elbo, n, k):
    """A model with an ExactlyKBernoulli prior of constant logits and a guide with learnable
    logits. (1) With a fixed guide, every JIT loss is log q(z) - log p(z) of some k-hot z
    (enumerated) or, for the mean-field ELBO, the exact KL: the traced graph must not change
    between calls (with some of the kernels' in-place operations left under tracing,
    TorchScript folded the prior's leaf shifts into a constant that an in-place exp_ then
    changed at every call, and the losses drifted to NaN). (2) SVI steps with the same seed
    per step give the same losses and parameters as the non-JIT ELBO (each compiled once
    first: compiling draws random numbers). k = 38 in float64 takes the FFT correlations,
    whose traced transform sizes were replayed wrongly (a RuntimeError) before they were
    made Python ints."""
    model, guide, prior, start = _jit_model_and_guide(n, k)
    pyro.clear_param_store()
    q = ExactlyKBernoulli(logits=start, k=k)
    p = ExactlyKBernoulli(logits=prior, k=k)
    subsets = torch.tensor(oracle.k_subsets(n, k), dtype=torch.float64)
    exact = (q.log_prob(subsets) - p.log_prob(subsets)).numpy()
    kl = oracle.exactly_k_kl(q.logits.numpy(), prior.numpy(), k)
    jit = jit_elbo()
    pyro.set_rng_seed(0)
    for _ in range(12):
        loss = jit.loss(model, guide)
        if jit_elbo is pyro.infer.JitTraceMeanField_ELBO:
            assert abs(loss - kl) < 1e-12
        else:
            assert np.min(np.abs(exact - loss)) < 1e-12, loss
    runs = []
    for make in (elbo, jit_elbo):
        pyro.clear_param_store()
        objective = make()
        objective.loss_and_grads(model, guide)  # compiles the JIT version
        pyro.param("logits").grad = None
        svi = SVI(model, guide, Adam({"lr": 0.1}), objective)
        losses = []
        for step in range(8):
            pyro.set_rng_seed(step)
            losses.append(svi.step())
        runs.append((np.array(losses), pyro.param("logits").detach().clone()))
    np.testing.assert_allclose(runs[1][0], runs[0][0], atol=1e-12)
    torch.testing.assert_close(runs[1][1], runs[0][1], atol=1e-12, rtol=0)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_traced_kernels_equal_eager_ones_at_sizes_that_use_every_path():
    # float64 and float32, n large enough for blocked and transposed (node-major) tables.
    rng = np.random.default_rng(16)
    for dtype in (torch.float64, torch.float32):
        logits = torch.tensor(rng.normal(0.0, 2.0, size=(3, 70)), dtype=dtype)
        tolerance = 1e-5 if dtype == torch.float32 else 1e-12

        def quantities(x):
            d = ExactlyKBernoulli(logits=x, k=torch.tensor([1, 35, 69]))
            z = d.sample((4,))
            return d.mean, d.entropy(), d.log_prob(z), d.log_constraint_prob(), z

        traced = torch.jit.trace(quantities, (logits,), check_trace=False)
        for shift in (0.0, 0.5):
            torch.manual_seed(3)
            want = quantities(logits + shift)
            torch.manual_seed(3)
            got = traced(logits + shift)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, atol=tolerance, rtol=0)


def test_repr_names_each_parameter_by_value_or_shape():
    # torch.distributions' convention: a one-element parameter by its value, else its shape.
    logits = torch.randn(3, 5)
    k = torch.tensor([1, 2, 4])
    assert repr(ExactlyKBernoulli(logits, k=k)) == (
        "ExactlyKBernoulli(logits: torch.Size([3, 5]), k: torch.Size([3]))"
    )
    assert repr(ExactlyKBernoulli(logits[0], k=2)) == (
        "ExactlyKBernoulli(logits: torch.Size([5]), k: 2)"
    )
    assert repr(ExactlyKBernoulli(torch.tensor([0.25]), k=1)) == (
        "ExactlyKBernoulli(logits: 0.25, k: 1)"
    )


# ----------------------------------------------------------------------------------------
# Issue 34: every float output keeps the logits' dtype, whatever torch's default dtype.


def _float_outputs(d, q):
    """Every floating-point output of ``d`` (``q``: a second distribution for the KL)."""
    z = d.sample()
    return {
        "log_prob": d.log_prob(z),
        "sample": z,
        "rsample": d.rsample(),
        "mean": d.mean,
        "variance": d.variance,
        "mode": d.mode,
        "entropy": d.entropy(),
        "kl": kl_divergence(d, q),
        "marginals": d.marginals.probs,
        "log_constraint_prob": d.log_constraint_prob(),
        "expected_l1_loss": expected_l1_loss(d, z),
        "expected_l2_loss": expected_l2_loss(d, z),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [2, "per-batch"])
@pytest.mark.parametrize("given", ["logits", "probs"])
def test_float_outputs_keep_the_dtype_of_the_parameters(dtype, k, given):
    # The other dtype as torch's default: a where between two Python numbers is a tensor of
    # the default dtype, which promoted the marginals (and all built on them) to float64.
    logits = torch.tensor([[INF, 0.3, -INF, 1.0, -0.5], [0.2, -1.0, 2.0, INF, 0.0]], dtype=dtype)
    k = torch.tensor([2, 3]) if k == "per-batch" else k
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if dtype == torch.float32 else torch.float32)
    try:
        parameter = logits if given == "logits" else torch.sigmoid(logits)
        d = ExactlyKBernoulli(**{given: parameter.requires_grad_()}, k=k)
        q = ExactlyKBernoulli(logits=logits.detach() + 0.5, k=k)
        outputs = _float_outputs(d, q)
    finally:
        torch.set_default_dtype(default)
    wrong = {name: value.dtype for name, value in outputs.items() if value.dtype != dtype}
    assert not wrong


@pytest.mark.parametrize("k_max", [None, 2])
def test_declared_k_constraint_is_the_checked_range(k_max):
    # Issue 34: k was declared a nonnegative_integer while the constructor accepts 0..n
    # (0..min(n, k_max)) only; every k the instance's declared constraint holds must be
    # accepted with validation on, and every k outside it rejected by both.
    logits = torch.tensor([0.3, -1.0, 2.0, 0.5])
    declared = ExactlyKBernoulli(logits=logits, k=1, k_max=k_max).arg_constraints["k"]
    assert declared.is_discrete and declared.event_dim == 0
    for k in range(-2, 8):
        holds = bool(declared.check(torch.tensor(k)))
        if holds:
            d = ExactlyKBernoulli(logits=logits, k=torch.tensor(k), k_max=k_max, validate_args=True)
            assert d.arg_constraints["k"].check(d.k).all()
        else:
            with pytest.raises(ValueError, match="k must be"):
                ExactlyKBernoulli(logits=logits, k=torch.tensor(k), k_max=k_max, validate_args=True)
    assert [k for k in range(-2, 8) if bool(declared.check(torch.tensor(k)))] == list(
        range(0, 1 + (4 if k_max is None else k_max))
    )
    # Read from the class (no n), the declaration is the looser nonnegative_integer.
    assert (
        ExactlyKBernoulli.arg_constraints["k"]
        is torch.distributions.constraints.nonnegative_integer
    )


def test_impossible_expand_is_a_value_error():
    d = ExactlyKBernoulli(logits=torch.zeros(2, 3), k=1)
    for shape in ((3,), (2, 3), ()):
        with pytest.raises(ValueError, match="Cannot broadcast distribution of shape"):
            d.expand(shape)
    assert d.expand((4, 2)).batch_shape == (4, 2)
    assert "ExpandedDistribution" not in ExactlyKBernoulli.expand.__doc__.replace(
        "not an ``ExpandedDistribution``", ""
    )
