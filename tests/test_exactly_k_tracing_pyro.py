"""Pyro ExactlyKBernoulli under torch.jit.trace (Pyro's JitTrace*_ELBO), torch.compile and
torch.func: a program traced with ordinary logits must replay correctly with logits far
outside that range (masked, forced, shifted). References: brute-force enumeration of the
k-hot vectors, written here."""

import itertools
import math
import warnings

import pyro
import pytest
import torch
from pyro.infer import (
    SVI,
    JitTrace_ELBO,
    JitTraceGraph_ELBO,
    JitTraceMeanField_ELBO,
    Trace_ELBO,
    TraceGraph_ELBO,
    TraceMeanField_ELBO,
)
from pyro.optim import SGD

from pyro_constrained import ExactlyKBernoulli

N, K = 8, 3


def _support(n, k):
    rows = [
        [1.0 if i in ones else 0.0 for i in range(n)]
        for ones in itertools.combinations(range(n), k)
    ]
    return torch.tensor(rows, dtype=torch.float64)


SUPPORT = _support(N, K)


def _brute(logits):
    """(log pmf over SUPPORT, marginals, entropy, covariance) by enumeration."""
    scores = SUPPORT @ logits
    log_pmf = scores - torch.logsumexp(scores, 0)
    pmf = log_pmf.exp()
    mean = pmf @ SUPPORT
    centred = SUPPORT - mean
    covariance = (centred * pmf[:, None]).T @ centred
    entropy = -(pmf * log_pmf).sum()
    return log_pmf, mean, entropy, covariance


def _ordinary():
    return torch.linspace(-1.5, 2.0, N, dtype=torch.float64)


def _changed(kind):
    logits = _ordinary().clone()
    if kind == "masked -50":
        logits[4:] = -50.0
    elif kind == "masked -1e4":
        logits[4:] = -1e4
    elif kind == "masked -1e9":
        logits[3:] = -1e9
    elif kind == "forced +1e4":
        logits[:2] = 1e4
    elif kind == "shifted +1e3":
        logits = logits + 1e3
    elif kind == "gap":
        logits[:2] = 40.0
        logits[2:] = -40.0
    return logits


KINDS = ["masked -50", "masked -1e4", "masked -1e9", "forced +1e4", "shifted +1e3", "gap"]


def _no_library_tracer_warnings():
    """A context in which a TracerWarning raised from this library's code is an error."""
    context = warnings.catch_warnings()
    context.__enter__()
    for module in (r"pyro_constrained(\..*)?", r"constrained_ppl(\..*)?"):
        warnings.filterwarnings("error", category=torch.jit.TracerWarning, module=module)
    return context


def _quantities(logits):
    d = ExactlyKBernoulli(logits=logits, k=K, validate_args=False)
    return d.log_prob(SUPPORT), d.entropy(), d.mean


@pytest.fixture(scope="module")
def traced_quantities():
    context = _no_library_tracer_warnings()
    try:
        return torch.jit.trace(_quantities, (_ordinary(),), check_trace=False)
    finally:
        context.__exit__(None, None, None)


@pytest.mark.parametrize("kind", KINDS)
def test_traced_log_prob_entropy_mean_replay_with_changed_logits(traced_quantities, kind):
    logits = _changed(kind)
    log_pmf, mean, entropy, _ = _brute(logits)
    traced = traced_quantities(logits)
    eager = _quantities(logits)
    for got, want in zip(traced, (log_pmf, entropy, mean), strict=True):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), (kind, got, want)
    for got, want in zip(traced, eager, strict=True):
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-13), (kind, got, want)


def _rsample_and_kl(logits, other, weights):
    p = ExactlyKBernoulli(logits=logits, k=K, validate_args=False)
    q = ExactlyKBernoulli(logits=other, k=K, validate_args=False)
    return (p.rsample() * weights).sum(), torch.distributions.kl_divergence(p, q)


def test_traced_rsample_gradient_and_kl_replay_with_changed_logits():
    weights = torch.linspace(-1.0, 1.0, N, dtype=torch.float64)
    other = torch.linspace(1.0, -0.5, N, dtype=torch.float64)
    context = _no_library_tracer_warnings()
    try:
        traced = torch.jit.trace(_rsample_and_kl, (_ordinary(), other, weights), check_trace=False)
    finally:
        context.__exit__(None, None, None)
    for kind in KINDS:
        logits = _changed(kind).requires_grad_()
        surrogate, kl = traced(logits, other, weights)
        (gradient,) = torch.autograd.grad(surrogate, logits)
        log_pmf, _, _, covariance = _brute(logits.detach())
        # d mu / d logits is the covariance of z: the straight-through gradient is Cov w.
        assert torch.allclose(gradient, covariance @ weights, rtol=1e-8, atol=1e-12), kind
        expected_kl = (log_pmf.exp() * (log_pmf - _brute(other)[0])).sum()
        assert torch.allclose(kl, expected_kl, rtol=1e-9, atol=1e-12), kind


def _model():
    prior = torch.zeros(N)
    pyro.sample("z", ExactlyKBernoulli(logits=prior, k=K))


def _guide():
    logits = pyro.param("logits", torch.linspace(-1.0, 1.0, N))
    pyro.sample("z", ExactlyKBernoulli(logits=logits, k=K))


@pytest.mark.parametrize(
    "jit_elbo, eager_elbo",
    [
        (JitTrace_ELBO, Trace_ELBO),
        (JitTraceMeanField_ELBO, TraceMeanField_ELBO),
        (JitTraceGraph_ELBO, TraceGraph_ELBO),
    ],
)
def test_jit_elbos_after_the_guide_logits_become_masked(jit_elbo, eager_elbo):
    masked = torch.linspace(-1.0, 1.0, N)
    masked[K + 1 :] = -1e4
    losses = []
    for elbo in (jit_elbo(), eager_elbo()):
        pyro.clear_param_store()
        svi = SVI(_model, _guide, SGD({"lr": 0.0}), elbo)
        context = _no_library_tracer_warnings()
        try:
            pyro.set_rng_seed(0)
            svi.step()
            pyro.get_param_store()["logits"].data.copy_(masked)
            pyro.set_rng_seed(1)
            losses.append([svi.step() for _ in range(3)])
        finally:
            context.__exit__(None, None, None)
    assert all(math.isfinite(loss) for loss in losses[0]), losses
    assert losses[0] == pytest.approx(losses[1], rel=1e-5), losses
    # With analytic KL the loss is KL(q || p) exactly: check it against enumeration.
    if jit_elbo is JitTraceMeanField_ELBO:
        log_q = _brute(masked.double())[0]
        log_p = _brute(torch.zeros(N, dtype=torch.float64))[0]
        expected = float((log_q.exp() * (log_q - log_p)).sum())
        assert losses[0][0] == pytest.approx(expected, rel=1e-5)


def test_torch_compile_of_log_prob_and_of_an_svi_loss():
    """Backend "eager": dynamo's graph capture is what this library's Python affects; an
    inductor compilation of these graphs takes minutes on a two-core CPU."""
    compiled = torch.compile(lambda logits: _quantities(logits)[0], backend="eager")
    compiled(_ordinary())
    for kind in ("masked -1e4", "shifted +1e3"):
        logits = _changed(kind)
        assert torch.allclose(compiled(logits), _brute(logits)[0], rtol=1e-9, atol=1e-12)

    elbo = TraceMeanField_ELBO()
    pyro.clear_param_store()
    _guide()
    loss = torch.compile(lambda: elbo.differentiable_loss(_model, _guide), backend="eager")
    first = float(loss())
    pyro.get_param_store()["logits"].data[K + 1 :] = -1e4
    masked = pyro.get_param_store()["logits"].detach().double()
    log_q, log_p = _brute(masked)[0], _brute(torch.zeros(N, dtype=torch.float64))[0]
    assert float(loss()) == pytest.approx(float((log_q.exp() * (log_q - log_p)).sum()), rel=1e-5)
    assert math.isfinite(first)


def test_torch_func_grad_and_vmap():
    logits = _changed("masked -1e4")
    value = SUPPORT[5]

    def log_prob(theta):
        return ExactlyKBernoulli(logits=theta, k=K, validate_args=False).log_prob(value)

    _, mean, _, _ = _brute(logits)
    # d log p(z) / d theta = z - mu.
    assert torch.allclose(torch.func.grad(log_prob)(logits), value - mean, atol=1e-12)
    d = ExactlyKBernoulli(logits=logits, k=K, validate_args=False)
    assert torch.allclose(torch.func.vmap(d.log_prob)(SUPPORT), _brute(logits)[0], atol=1e-9)
    with pytest.raises(RuntimeError, match="batched natively"):
        torch.func.vmap(log_prob)(torch.stack([logits, _ordinary()]))


def test_a_validated_log_prob_traced_keeps_its_support_mask():
    """An eager validated log_prob skips its support mask (its validation has just raised on
    anything outside the support); a traced one replays no validation, so it must keep the
    mask: a later value with the wrong count, or a 1 under a -inf logit, scores -inf."""
    logits = torch.tensor([0.3, -1.2, 2.0, 0.0, -0.7])
    k_hot = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])

    def log_prob(theta, value):
        return ExactlyKBernoulli(logits=theta, k=2, validate_args=True).log_prob(value)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(log_prob, (logits, k_hot), check_trace=False)
    masked = logits.clone()
    masked[0] = -math.inf
    assert torch.allclose(traced(logits, k_hot), log_prob(logits, k_hot))
    assert traced(logits, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])) == -math.inf
    assert traced(masked, k_hot) == -math.inf
    with pytest.raises(ValueError):  # eager: the validation itself
        log_prob(logits, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]))
