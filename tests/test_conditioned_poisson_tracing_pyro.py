"""Pyro ConditionedPoisson under torch.jit.trace (Pyro's JitTrace*_ELBO) and torch.compile: a
program traced with one range of rates must replay correctly with rates far outside it (one
rate at 1e-300, one dominant rate, all rates near 1e300, rates 60 decades apart), as the eager
code gives them, and tracing must emit no TracerWarning. References: enumeration of the
compositions, written here. (A zero rate is outside the support of ``rate``; the tiny rate
stands for a masked category.)"""

import itertools
import math
import warnings

import pyro
import pytest
import torch
from pyro.infer import SVI, JitTrace_ELBO, JitTraceMeanField_ELBO, Trace_ELBO, TraceMeanField_ELBO
from pyro.optim import SGD

from pyro_constrained import ConditionedPoisson
from pyro_constrained.losses import expected_l1_loss

N, K = 4, 6
SUPPORT = torch.tensor(
    [c for c in itertools.product(range(K + 1), repeat=N) if sum(c) == K], dtype=torch.float64
)
WEIGHTS = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)

RATES = {
    "ordinary": [1.0, 2.0, 3.0, 4.0],
    "tiny": [1e-300, 2.0, 3.0, 4.0],
    "dominant": [1e-8, 1e-8, 1e-8, 1.0],
    "huge": [1e300, 2e300, 3e300, 4e300],
    "gap": [1e30, 1e-30, 1.0, 1.0],
    "uniform": [5.0, 5.0, 5.0, 5.0],
}


def _rates(kind):
    return torch.tensor(RATES[kind], dtype=torch.float64)


def _reference(rate):
    """log pmf over SUPPORT, mean, entropy and log p, by enumeration in float64 logs."""
    log_p = rate.log() - torch.logsumexp(rate.log(), 0)
    log_pmf = (
        math.lgamma(K + 1)
        - torch.lgamma(SUPPORT + 1).sum(-1)
        + (SUPPORT * log_p).nan_to_num(nan=0.0).sum(-1)
    )
    pmf = log_pmf.exp()
    entropy = -(pmf * log_pmf).nan_to_num(nan=0.0).sum()
    return log_pmf, pmf @ SUPPORT, entropy, log_p


def _quantities(rate, other):
    d = ConditionedPoisson(rate, k=K, validate_args=False)
    e = ConditionedPoisson(other, k=K, validate_args=False)
    return (
        d.log_prob(SUPPORT),
        d.mean,
        d.variance,
        d.entropy(),
        torch.distributions.kl_divergence(d, e),
        d.log_constraint_prob(),
        expected_l1_loss(d, WEIGHTS + 1.0),
    )


def _trace_without_tracer_warnings(function, inputs):
    """The trace of ``function``; fails on any TracerWarning, from anywhere, while tracing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.jit.trace(function, inputs, check_trace=False)
    tracer_warnings = [w for w in caught if issubclass(w.category, torch.jit.TracerWarning)]
    assert not tracer_warnings, [f"{w.filename}:{w.lineno}: {w.message}" for w in tracer_warnings]
    return traced


_TRACES = {}


def _traced_quantities(traced_at):
    if traced_at not in _TRACES:
        inputs = (_rates(traced_at), _rates("uniform"))
        _TRACES[traced_at] = _trace_without_tracer_warnings(_quantities, inputs)
    return _TRACES[traced_at]


@pytest.mark.parametrize("traced_at", ["ordinary", "dominant"])
@pytest.mark.parametrize("kind", ["ordinary", "tiny", "dominant", "huge", "gap", "uniform"])
def test_traced_quantities_replay_with_rates_of_other_ranges(traced_at, kind):
    # Traced at "dominant" (variance 1e-7), the entropy's window must still hold the outcomes
    # of rates that spread the counts ("uniform").
    rate, other = _rates(kind), _rates("ordinary")
    traced = _traced_quantities(traced_at)(rate, other)
    eager = _quantities(rate, other)
    for got, want in zip(traced, eager, strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-300), (kind, got, want)
    log_pmf, mean, entropy, log_p = _reference(rate)
    log_q = _reference(other)[3]
    kl = K * (log_p.exp() * (log_p - log_q)).sum()
    for got, want in [(traced[0], log_pmf), (traced[1], mean), (traced[3], entropy)]:
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), (kind, got, want)
    assert torch.allclose(traced[4], kl, rtol=1e-9, atol=1e-12), (kind, traced[4], kl)


def _rsample_surrogate(rate):
    z = ConditionedPoisson(rate, k=K, validate_args=False).rsample((200,))
    return z, (z @ WEIGHTS).mean()


def test_traced_sampler_and_rsample_gradient_replay_with_rates_of_other_ranges():
    traced = _trace_without_tracer_warnings(_rsample_surrogate, (_rates("ordinary"),))
    torch.manual_seed(0)
    for kind in ["tiny", "dominant", "huge", "gap"]:
        rate = _rates(kind).requires_grad_()
        z, surrogate = traced(rate)
        assert bool((z.sum(-1) == K).all()) and bool((z == z.round()).all()), kind
        (gradient,) = torch.autograd.grad(surrogate, rate)
        # Straight-through: the gradient of w . k p, k (w_j - w . p) / sum(rate).
        p = (_reference(rate.detach())[3]).exp()
        expected = K * (WEIGHTS - WEIGHTS @ p) / rate.detach().sum()
        # Relative to the terms' size: w_j - w . p cancels where p_j is near 1.
        scale = K * (WEIGHTS.abs() + WEIGHTS.abs() @ p) / rate.detach().sum()
        assert bool(((gradient - expected).abs() <= 1e-9 * scale).all()), (kind, gradient)
        if kind == "tiny":  # p_0 = 1e-301: never drawn
            assert bool((z[:, 0] == 0).all())
        if kind == "dominant":  # 1 - p_3 = 3e-8: all 200 draws put K on it (P(else) < 1e-4)
            assert bool((z[:, 3] == K).all())


def test_traced_sequential_sampler_replays_with_a_tiny_rate():
    # k = 100 >= 32 n: the sequential binomial sampler.
    def draw(rate):
        return ConditionedPoisson(rate, k=100, validate_args=False).sample((50,))

    traced = _trace_without_tracer_warnings(draw, (torch.tensor([1.0, 1.0], dtype=torch.float64),))
    z = traced(torch.tensor([1e-300, 1.0], dtype=torch.float64))
    assert z.tolist() == [[0.0, 100.0]] * 50


def test_traced_k_bounded_by_k_max_replays_with_another_k():
    # k an input of the trace, traced at k = k_max: k_max, not the k of the first call, sizes
    # the draws and tables, and the draws past each k stay masked.
    value = torch.tensor([[1.0, 0.0, 2.0, 4.0], [0.0, 0.0, 0.0, 3.0]], dtype=torch.float64)

    def quantities(rate, k):
        d = ConditionedPoisson(rate, k=k, k_max=8, validate_args=False)
        return d.log_prob(value), d.entropy(), d.sample((20,))

    rate = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1e-8, 1e-8, 1e-8, 1.0]], dtype=torch.float64)
    traced = _trace_without_tracer_warnings(quantities, (rate, torch.tensor([8, 8])))
    k = torch.tensor([7, 3])
    log_prob, entropy, z = traced(rate, k)
    d = ConditionedPoisson(rate, k=k)
    assert torch.allclose(log_prob, d.log_prob(value), rtol=1e-12)
    assert torch.allclose(entropy, d.entropy(), rtol=1e-12)
    assert z.sum(-1).tolist() == [[7.0, 3.0]] * 20


def _model():
    pyro.sample("z", ConditionedPoisson(torch.ones(N), k=K))


def _guide():
    log_rate = pyro.param("log_rate", torch.zeros(N))
    pyro.sample("z", ConditionedPoisson(log_rate.exp(), k=K))


@pytest.mark.parametrize(
    "jit_elbo, eager_elbo",
    [(JitTrace_ELBO, Trace_ELBO), (JitTraceMeanField_ELBO, TraceMeanField_ELBO)],
)
def test_jit_elbo_equals_eager_after_the_rates_move_range(jit_elbo, eager_elbo):
    moved = torch.tensor([-60.0, -60.0, 0.0, 40.0])  # rates 1e-26, 1e-26, 1, 2e17
    losses = []
    for elbo in (jit_elbo(), eager_elbo()):
        pyro.clear_param_store()
        svi = SVI(_model, _guide, SGD({"lr": 0.0}), elbo)
        with warnings.catch_warnings():
            for module in (r"pyro_constrained(\..*)?", r"constrained_ppl(\..*)?"):
                warnings.filterwarnings("error", category=torch.jit.TracerWarning, module=module)
            pyro.set_rng_seed(0)
            svi.step()
            pyro.get_param_store()["log_rate"].data.copy_(moved)
            pyro.set_rng_seed(1)
            losses.append([svi.step() for _ in range(3)])
    assert all(math.isfinite(loss) for loss in losses[0]), losses
    assert losses[0] == pytest.approx(losses[1], rel=1e-5), losses
    if jit_elbo is JitTraceMeanField_ELBO:
        # Analytic KL: the loss is KL(q || p) = k sum q log(q / (1/n)), exactly.
        log_q = _reference(moved.double().exp())[3]
        expected = K * float((log_q.exp() * (log_q + math.log(N))).sum())
        assert losses[0][0] == pytest.approx(expected, rel=1e-5)


def test_torch_compile_of_log_prob_replays_with_rates_of_other_ranges():
    """Backend "eager": dynamo's graph capture is what this library's Python affects; an
    inductor compilation takes minutes on a two-core CPU."""

    def log_prob(rate):
        return ConditionedPoisson(rate, k=K, validate_args=False).log_prob(SUPPORT)

    compiled = torch.compile(log_prob, backend="eager")
    compiled(_rates("ordinary"))
    for kind in ["tiny", "huge"]:
        rate = _rates(kind)
        assert torch.allclose(compiled(rate), _reference(rate)[0], rtol=1e-9, atol=1e-12), kind
