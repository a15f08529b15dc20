"""The discrete Pyro classes under ``torch.func`` (issue 34 item 1): ``grad``, ``jacrev`` and
``jacfwd`` of ``log_prob``, ``entropy`` and the moments against ordinary autograd and
central finite differences, ``vmap`` against the batched eager call where the math allows
it, and a clear error naming the alternative where it does not (docs/numerics.md,
"torch.func"). float64 throughout, so the references resolve the derivatives."""

import pytest
import torch
from torch.func import grad, jacfwd, jacrev, vmap

from pyro_constrained import (
    ConditionedPoisson,
    CountConstrainedBernoulli,
    ExactlyKBernoulli,
    PoissonBinomial,
)

F64 = torch.float64
LOGITS = torch.tensor([0.3, -1.2, 2.0, 0.0, -0.4, 1.1], dtype=F64)
RATE = torch.tensor([0.5, 1.5, 0.2, 3.0, 1.0, 0.7], dtype=F64)
# Two values of each class's support (the second per class varies the first).
K_HOT = torch.tensor([[1.0, 1.0, 0, 0, 0, 0], [0, 1.0, 0, 1.0, 0, 0]], dtype=F64)
COMPOSITIONS = torch.tensor([[1.0, 1.0, 2.0, 0, 0, 0], [0, 0, 0, 3.0, 1.0, 0]], dtype=F64)
COUNTS = torch.tensor([2.0, 5.0], dtype=F64)
RANGE_VALUES = torch.tensor([[1.0, 0, 0, 0, 0, 0], [0, 1.0, 1.0, 1.0, 0, 0]], dtype=F64)

# (id, constructor of the parameter, parameter, values of log_prob)
CASES = [
    ("ekb", lambda x, **kw: ExactlyKBernoulli(logits=x, k=2, **kw), LOGITS, K_HOT),
    # n = 300 > 256: the general kernels rather than the small-n path.
    (
        "ekb-general",
        lambda x, **kw: ExactlyKBernoulli(logits=x, k=40, **kw),
        torch.linspace(-3, 3, 300, dtype=F64),
        torch.cat([torch.ones(2, 40), torch.zeros(2, 260)], -1).to(F64).roll(7, -1),
    ),
    ("cp", lambda x, **kw: ConditionedPoisson(x, k=4, **kw), RATE, COMPOSITIONS),
    ("pb", lambda x, **kw: PoissonBinomial(logits=x, **kw), LOGITS, COUNTS),
    (
        "ccb",
        lambda x, **kw: CountConstrainedBernoulli(logits=x, low=1, high=3, **kw),
        LOGITS,
        RANGE_VALUES,
    ),
]
IDS = [case[0] for case in CASES]


def _quantities(make, values):
    """Scalar functions of the parameter: log_prob, entropy and the moments, each weighted
    so that every coordinate of a vector result counts differently."""

    def weighted(t):
        return (t * torch.linspace(0.5, 1.5, t.numel(), dtype=F64).reshape(t.shape)).sum()

    return {
        "log_prob": lambda x: make(x).log_prob(values).sum(),
        "entropy": lambda x: make(x).entropy(),
        "mean": lambda x: weighted(make(x).mean),
        "variance": lambda x: weighted(make(x).variance),
    }


def _central_differences(f, x, h=1e-6):
    out = torch.empty_like(x)
    for i in range(x.numel()):
        step = torch.zeros_like(x)
        step.view(-1)[i] = h
        out.view(-1)[i] = (f(x + step) - f(x - step)) / (2 * h)
    return out


@pytest.mark.parametrize("name,make,x,values", CASES, ids=IDS)
def test_func_grad_matches_autograd_and_finite_differences(name, make, x, values):
    for quantity, f in _quantities(make, values).items():
        got = grad(f)(x)
        leaf = x.clone().requires_grad_()
        (expected,) = torch.autograd.grad(f(leaf), leaf)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14, msg=quantity)
        if name != "ekb-general":  # 600 evaluations: the autograd agreement suffices there
            differences = _central_differences(f, x)
            torch.testing.assert_close(got, differences, rtol=1e-6, atol=1e-8, msg=quantity)


@pytest.mark.parametrize("name,make,x,values", CASES, ids=IDS)
def test_jacrev_and_jacfwd_match_autograd_rows(name, make, x, values):
    # Vector results: the log-probabilities of two values, and the mean.
    for quantity, f in {
        "log_prob": lambda x: make(x).log_prob(values),
        "mean": lambda x: make(x).mean.reshape(-1)[:8],
        "variance": lambda x: make(x).variance.reshape(-1)[:8],
        "entropy": lambda x: make(x).entropy().reshape(1),
    }.items():
        if name == "pb" and quantity == "entropy":
            continue  # forward mode: test_poisson_binomial_entropy_under_jacfwd
        leaf = x.clone().requires_grad_()
        out = f(leaf)
        rows = [torch.autograd.grad(o, leaf, retain_graph=True)[0] for o in out]
        expected = torch.stack(rows)
        torch.testing.assert_close(jacrev(f)(x), expected, rtol=1e-11, atol=1e-13, msg=quantity)
        torch.testing.assert_close(jacfwd(f)(x), expected, rtol=1e-11, atol=1e-13, msg=quantity)


@pytest.mark.parametrize("name,make,x,values", CASES[:3], ids=IDS[:3])
def test_vmap_over_log_prob_values_matches_the_batched_call(name, make, x, values):
    # Validation off: the value's check against the infinite logits is a Python bool.
    d = make(x, validate_args=False)
    torch.testing.assert_close(vmap(d.log_prob)(values), d.log_prob(values), rtol=0, atol=0)


def test_vmap_over_the_rates_of_conditioned_poisson_matches_the_batched_call():
    rates = torch.stack([RATE, RATE.flip(0), RATE**2])
    batched = ConditionedPoisson(rates, k=4)
    for quantity in ("log_prob", "mean", "variance", "mode"):

        def f(rate, quantity=quantity):
            d = ConditionedPoisson(rate, k=4)
            return d.log_prob(COMPOSITIONS[0]) if quantity == "log_prob" else getattr(d, quantity)

        expected = batched.log_prob(COMPOSITIONS[0]) if quantity == "log_prob" else None
        expected = getattr(batched, quantity) if expected is None else expected
        torch.testing.assert_close(vmap(f)(rates), expected, rtol=1e-14, atol=0, msg=quantity)
    # Per-sample gradients: vmap of grad, against one autograd call per rate vector.
    per_rate = vmap(grad(lambda r: ConditionedPoisson(r, k=4).log_prob(COMPOSITIONS[1])))(rates)
    for row, rate in zip(per_rate, rates, strict=True):
        leaf = rate.clone().requires_grad_()
        (expected,) = torch.autograd.grad(
            ConditionedPoisson(leaf, k=4).log_prob(COMPOSITIONS[1]), leaf
        )
        torch.testing.assert_close(row, expected, rtol=1e-12, atol=1e-14)
    # Sampling under vmap: randomness="different" draws compositions of k; torch's own
    # error names the flags otherwise.
    draws = vmap(lambda r: ConditionedPoisson(r, k=4).sample(), randomness="different")(rates)
    assert draws.shape == (3, 6) and torch.equal(draws.sum(-1), torch.full((3,), 4.0, dtype=F64))
    with pytest.raises(RuntimeError, match="randomness"):
        vmap(lambda r: ConditionedPoisson(r, k=4).sample())(rates)


@pytest.mark.parametrize("validate_args", [True, False])
def test_vmap_over_parameters_where_sizes_are_read_from_them_is_a_clear_error(validate_args):
    batch = torch.stack([LOGITS, LOGITS.flip(0)])
    value = K_HOT[0]
    cases = [
        (lambda x: ExactlyKBernoulli(logits=x, k=2, validate_args=validate_args), batch),
        (
            lambda x: CountConstrainedBernoulli(
                logits=x, low=1, high=3, validate_args=validate_args
            ),
            batch,
        ),
    ]
    for make, params in cases:
        with pytest.raises(RuntimeError, match="give the distribution the batch of logits"):
            vmap(lambda x, make=make: make(x).log_prob(value))(params)
    with pytest.raises(RuntimeError, match="give the distribution the batch of k"):
        vmap(lambda k: ConditionedPoisson(RATE, k=k, validate_args=validate_args).mean)(
            torch.tensor([3, 4])
        )
    rates = torch.stack([RATE, RATE.flip(0)])
    with pytest.raises(RuntimeError, match="give the distribution the batch of rates"):
        vmap(lambda r: ConditionedPoisson(r, k=4, validate_args=validate_args).entropy())(rates)


def test_vmap_over_values_with_validation_on_is_a_clear_error():
    d = ExactlyKBernoulli(logits=LOGITS, k=2)
    with pytest.raises(RuntimeError, match="validate_args=False"):
        vmap(d.log_prob)(K_HOT)


def test_conditioned_poisson_log_prob_derivative_in_the_value_under_torch_func():
    """The log-factorial lookup's derivative ``digamma(z + 1)`` (the straight-through
    sample's path) under ``grad``, ``jacfwd`` and a second derivative ``trigamma``: with
    more values than k + 1 the lookup table is used."""
    d = ConditionedPoisson(RATE, k=4)
    log_p = (RATE / RATE.sum()).log()
    expected = log_p - torch.special.digamma(COMPOSITIONS + 1)
    torch.testing.assert_close(
        grad(lambda z: d.log_prob(z).sum())(COMPOSITIONS), expected, rtol=1e-12, atol=0
    )
    forward = jacfwd(lambda z: d.log_prob(z[None])[0])(COMPOSITIONS[0])
    torch.testing.assert_close(forward, expected[0], rtol=1e-12, atol=0)
    # Many values (the table path) for the second derivative, -trigamma(z + 1).
    values = COMPOSITIONS.repeat(3, 1)
    second = grad(lambda z: grad(lambda v: d.log_prob(v).sum())(z).sum())(values)
    torch.testing.assert_close(second, -torch.special.polygamma(1, values + 1), rtol=1e-12, atol=0)


def test_poisson_binomial_entropy_under_jacfwd():
    # log_pmf's no-gradient windows path was chosen by logits.requires_grad, False for a
    # forward-mode input: jacfwd was a silent 0.
    f = lambda x: PoissonBinomial(logits=x).entropy()  # noqa: E731
    torch.testing.assert_close(jacfwd(f)(LOGITS), jacrev(f)(LOGITS), rtol=1e-11, atol=1e-13)


EDGE_PROBS = torch.tensor([0.0, 0.3, 0.6, 1.0, 0.5, 0.2], dtype=F64)
EDGE_CASES = [
    (
        "ekb",
        lambda p: ExactlyKBernoulli(probs=p, k=2, validate_args=False),
        K_HOT[1:] * 0 + torch.tensor([0.0, 1, 0, 1, 0, 0], dtype=F64),
    ),
    ("pb", lambda p: PoissonBinomial(probs=p, validate_args=False), COUNTS),
    (
        "ccb",
        lambda p: CountConstrainedBernoulli(probs=p, low=1, high=3, validate_args=False),
        torch.tensor([[0.0, 1, 0, 1, 0, 0], [0.0, 0, 1, 1, 0, 0]], dtype=F64),
    ),
]


@pytest.mark.parametrize("name,make,values", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_forward_mode_gets_the_one_sided_derivatives_at_probs_zero_and_one(name, make, values):
    """The one-sided terms at probs of exactly 0 and 1 are built only for differentiated
    probs; asked as ``probs.requires_grad``, forward mode (never requiring grad) skipped
    them and ``jacfwd`` gave 0 where ``jacrev`` gave the one-sided derivative."""
    weights = torch.linspace(0.5, 1.5, 6, dtype=F64)  # the mean of ExactlyKBernoulli sums to k
    for quantity in (lambda d: d.log_prob(values).sum(), lambda d: (d.mean * weights).sum()):
        f = lambda p, quantity=quantity: quantity(make(p))  # noqa: E731
        reverse = jacrev(f)(EDGE_PROBS)
        assert reverse[[0, 3]].abs().max() > 1e-3  # a one-sided derivative to miss
        torch.testing.assert_close(jacfwd(f)(EDGE_PROBS), reverse, rtol=1e-9, atol=1e-12)


LCN_PARAMETERS = {
    "loc": torch.tensor([0.2, -0.1, 0.3], dtype=F64),
    "scale": torch.tensor([1.0, 2.0, 0.5], dtype=F64),
    "A": torch.tensor([[1.0, 1.0, 0.5]], dtype=F64),
    "k": torch.tensor([1.0], dtype=F64),
}


# The conditional variance and entropy do not depend on loc or k; log_prob at a fixed value
# has no derivative in k (moving k moves the support off the value).
NO_DEPENDENCE = {("variance", "loc"), ("variance", "k"), ("entropy", "loc"), ("entropy", "k")}
NO_DEPENDENCE |= {("log_prob", "k")}


@pytest.mark.parametrize("parameter", list(LCN_PARAMETERS))
@pytest.mark.parametrize("quantity", ["log_prob", "mean", "variance", "entropy"])
def test_linear_constrained_normal_jacfwd_matches_jacrev_in_every_parameter(parameter, quantity):
    """Forward mode sees every parameter: a path chosen because ``A`` does not require grad
    (which a forward-mode input never does) used factors detached from ``A``, and
    ``jacfwd`` in ``A`` was a silent 0 where ``jacrev`` was right."""
    from pyro_constrained import LinearConstrainedNormal

    value = torch.tensor([0.4, 0.1, 1.0], dtype=F64)  # on A z = k

    def f(x):
        d = LinearConstrainedNormal(**{**LCN_PARAMETERS, parameter: x}, validate_args=False)
        if quantity == "log_prob":
            return d.log_prob(value)
        if quantity == "entropy":
            return d.entropy()
        return getattr(d, quantity)

    x = LCN_PARAMETERS[parameter]
    reverse = jacrev(f)(x)
    assert reverse.abs().max() > 1e-3 or (quantity, parameter) in NO_DEPENDENCE
    torch.testing.assert_close(jacfwd(f)(x), reverse, rtol=1e-9, atol=1e-12)
