"""Pyro's and torch's generic distribution tests, ported to the three Pyro classes.

Sources (read, not copied): Pyro's ``tests/distributions/`` (``test_distributions.py``:
support shape, ``infer_shapes``, batch log_prob / entropy shapes, score errors, expand_by /
expand / subsequent expands / expand errors / expanded ``to_event``; ``test_pickle.py``;
``test_mask.py``; ``test_independent.py``; ``test_shapes.py``) and torch's
``test/distributions/test_distributions.py`` (``test_params_constraints``,
``test_support_constraints``, ``test_support_attributes``, ``test_distribution_expand``,
``test_rsample_requires_grad``, ``test_enumerate_support_type``), parametrised over
``ExactlyKBernoulli`` (EKB), ``LinearConstrainedNormal`` (LCN), ``ConditionedPoisson``
(CP), ``PoissonBinomial`` (PB) and ``CountConstrainedBernoulli`` (CCB) with several
settings each (see ``CASES``), float32 by default plus float64 cases.

Beyond the upstream shape checks, every number is compared with an independent expectation:
values in the support are built by hand (the first k coordinates on; a projection computed
here with a pseudo-inverse; all k counts in one category), batched log-probs with the
distributions of single batch elements, gradients with finite differences
(``torch.autograd.gradcheck``, float64), and mean, variance, entropy and KL with Monte Carlo
estimates from exact samples, within ``SIGMAS`` standard errors estimated from the same
samples (a false alarm has probability below 1e-6 per coordinate; the seeds are fixed, so a
run is reproducible).

Conventions tested are those of issue 15 (``CONVENTIONS.md``): parameter constraints carry
the event_dim of the parameter; a value of the wrong shape is a ``ValueError`` whatever
``validate_args`` says; a value outside the support is a ``ValueError`` with validation on
and gets ``-inf`` with it off; bad parameters are a ``ValueError`` with validation on.
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import pyro
import pyro.distributions as dist
import pyro.poutine as poutine
import pytest
import torch
from pyro.distributions import TorchDistribution
from torch.distributions import constraints, kl_divergence
from torch.distributions.utils import _sum_rightmost

from pyro_constrained import (
    ConditionedPoisson,
    CountConstrainedBernoulli,
    ExactlyKBernoulli,
    LinearConstrainedNormal,
    PoissonBinomial,
)

EKB, LCN, CP = ExactlyKBernoulli, LinearConstrainedNormal, ConditionedPoisson
PB, CCB = PoissonBinomial, CountConstrainedBernoulli

# Monte Carlo checks: an estimate must lie within SIGMAS standard errors (estimated from
# the same samples) of the exact value, plus a tiny absolute slack for exact zeros.
SIGMAS = 6.0
NUM_MC_SAMPLES = 20000

# The event_dim each parameter's constraint must carry (CONVENTIONS.md, decision 1).
PARAM_EVENT_DIMS = {
    EKB: {"logits": 1, "probs": 1, "k": 0},
    LCN: {"loc": 1, "scale": 1, "covariance_matrix": 2, "scale_tril": 2, "A": 2, "k": 1},
    CP: {"rate": 1, "k": 0},
    PB: {"logits": 1, "probs": 1},
    CCB: {"logits": 1, "probs": 1, "low": 0, "high": 0},
}
# Parameters that must appear in ``arg_constraints`` (covariance_matrix may, too).
REQUIRED_CONSTRAINTS = {
    EKB: ("logits", "probs", "k"),
    LCN: ("loc", "scale", "scale_tril", "A", "k"),
    CP: ("rate", "k"),
    PB: ("logits", "probs"),
    CCB: ("logits", "probs", "low", "high"),
}
# Parameters a log-density is smooth in, for the finite-difference gradient check (LCN's A
# and k move the support itself, and the counts are integers).
SMOOTH_PARAMS = {
    EKB: ("logits", "probs"),
    LCN: ("loc", "scale", "covariance_matrix", "scale_tril"),
    CP: ("rate",),
    PB: ("logits", "probs"),
    CCB: ("logits", "probs"),
}


# ------------------------------------------------------------------------------------------
# Cases


@dataclass(frozen=True)
class Case:
    """One parameter setting: ``make(generator, dtype)`` returns the constructor's keyword
    arguments. Integer counts and constraint matrices do not depend on the generator, so
    two seeds give two distributions with the same support (for KL)."""

    id: str
    cls: type
    make: Callable[[torch.Generator, torch.dtype], dict]
    dtype: torch.dtype = torch.float32
    # Every batch element has a single point in its support (EKB k = 0 or n, CP k = 0).
    deterministic: bool = False

    def params(self, seed: int = 0) -> dict:
        generator = torch.Generator().manual_seed(seed)
        return self.make(generator, self.dtype)

    def dist(self, seed: int = 0, validate_args: bool | None = True, **overrides):
        params = self.params(seed)
        params.update(overrides)
        return self.cls(**params, validate_args=validate_args)

    def __repr__(self) -> str:
        return self.id


def _randn(g, *shape, dtype):
    return torch.randn(shape, generator=g, dtype=dtype)


def _positive(g, *shape, dtype):
    return 0.5 + torch.rand(shape, generator=g, dtype=dtype)


def _spd(g, n, dtype):
    m = _randn(g, n, n, dtype=dtype)
    return m @ m.mT / n + torch.eye(n, dtype=dtype)


def _tril(g, n, dtype):
    low = torch.tril(_randn(g, n, n, dtype=dtype), -1) * 0.3
    return low + torch.diag(_positive(g, n, dtype=dtype))


_A_2x5 = [[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.5, 0.0, 2.0]]
_A_2x4 = [[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, -1.0, 0.5]]

_F64 = torch.float64


def _masked(x, on=(), off=()):
    """``x`` with ``+inf`` (forced on) at the indices ``on`` and ``-inf`` (forced off) at
    ``off``: the same masks whatever the seed, so two seeds share a support."""
    x = x.clone()
    for index in on:
        x[index] = math.inf
    for index in off:
        x[index] = -math.inf
    return x


def _edge_probs(g, *shape, dtype, zeros=(), ones=()):
    """Probabilities in [0.1, 0.9] with exact 0 at ``zeros`` and exact 1 at ``ones``."""
    probs = 0.1 + 0.8 * torch.rand(shape, generator=g, dtype=dtype)
    for index in zeros:
        probs[index] = 0.0
    for index in ones:
        probs[index] = 1.0
    return probs


def _masked_rows(g, t):
    # Rows without masks, with one forced on and one forced off, with one forced off.
    return _masked(_randn(g, 3, 5, dtype=t), on=[(1, 0)], off=[(1, 3), (2, 1)])


CASES = [
    # ExactlyKBernoulli
    Case("ekb-unbatched", EKB, lambda g, t: {"logits": _randn(g, 5, dtype=t), "k": 2}),
    Case("ekb-batched", EKB, lambda g, t: {"logits": _randn(g, 3, 5, dtype=t), "k": 2}),
    Case(
        "ekb-per-batch-k",
        EKB,
        lambda g, t: {"logits": _randn(g, 3, 5, dtype=t), "k": torch.tensor([1, 2, 4])},
    ),
    Case(
        "ekb-broadcast-k",  # batch (2, 1) from k alone: a singleton batch dim
        EKB,
        lambda g, t: {"logits": _randn(g, 5, dtype=t), "k": torch.tensor([[1], [3]])},
    ),
    Case(
        "ekb-k0",
        EKB,
        lambda g, t: {"logits": _randn(g, 2, 4, dtype=t), "k": 0},
        deterministic=True,
    ),
    Case("ekb-kn", EKB, lambda g, t: {"logits": _randn(g, 4, dtype=t), "k": 4}, deterministic=True),
    Case(
        "ekb-probs",
        EKB,
        lambda g, t: {"probs": 0.1 + 0.8 * torch.rand(2, 4, generator=g, dtype=t), "k": 1},
    ),
    Case(
        "ekb-f64",
        EKB,
        lambda g, t: {"logits": _randn(g, 2, 5, dtype=t), "k": torch.tensor([3, 1])},
        dtype=_F64,
    ),
    # LinearConstrainedNormal
    Case(
        "lcn-diag",
        LCN,
        lambda g, t: {"loc": _randn(g, 4, dtype=t), "scale": _positive(g, 4, dtype=t)},
    ),
    Case(
        "lcn-batched",
        LCN,
        lambda g, t: {"loc": _randn(g, 3, 4, dtype=t), "scale": _positive(g, 3, 4, dtype=t)},
    ),
    Case(
        "lcn-cov",
        LCN,
        lambda g, t: {"loc": _randn(g, 4, dtype=t), "covariance_matrix": _spd(g, 4, t)},
    ),
    Case(
        "lcn-tril",
        LCN,
        lambda g, t: {"loc": _randn(g, 2, 4, dtype=t), "scale_tril": _tril(g, 4, t)},
    ),
    Case(
        "lcn-A",
        LCN,
        lambda g, t: {
            "loc": _randn(g, 5, dtype=t),
            "scale": _positive(g, 5, dtype=t),
            "A": torch.tensor(_A_2x5, dtype=t),
            "k": torch.tensor([1.0, -0.5], dtype=t),
        },
    ),
    Case(
        "lcn-batched-k",
        LCN,
        lambda g, t: {
            "loc": _randn(g, 4, dtype=t),
            "scale": _positive(g, 4, dtype=t),
            "k": torch.tensor([[-1.0], [0.0], [2.0]], dtype=t),
        },
    ),
    Case(
        "lcn-singleton",  # batch (2, 1)
        LCN,
        lambda g, t: {"loc": _randn(g, 2, 1, 4, dtype=t), "scale": _positive(g, 4, dtype=t)},
    ),
    Case(
        "lcn-f64-A",
        LCN,
        lambda g, t: {
            "loc": _randn(g, 2, 4, dtype=t),
            "scale": _positive(g, 2, 4, dtype=t),
            "A": torch.tensor(_A_2x4, dtype=t),
            "k": torch.tensor([0.5, 1.0], dtype=t),
        },
        dtype=_F64,
    ),
    Case(
        "lcn-f64-cov",
        LCN,
        lambda g, t: {"loc": _randn(g, 3, 4, dtype=t), "covariance_matrix": _spd(g, 4, t)},
        dtype=_F64,
    ),
    # ConditionedPoisson
    Case("cp-unbatched", CP, lambda g, t: {"rate": _positive(g, 4, dtype=t), "k": 3}),
    Case("cp-batched", CP, lambda g, t: {"rate": _positive(g, 3, 4, dtype=t), "k": 5}),
    Case(
        "cp-per-batch-k",
        CP,
        lambda g, t: {"rate": _positive(g, 3, 4, dtype=t), "k": torch.tensor([0, 2, 6])},
    ),
    Case(
        "cp-k0", CP, lambda g, t: {"rate": _positive(g, 2, 4, dtype=t), "k": 0}, deterministic=True
    ),
    Case("cp-kn", CP, lambda g, t: {"rate": _positive(g, 4, dtype=t), "k": 4}),
    Case("cp-singleton", CP, lambda g, t: {"rate": _positive(g, 2, 1, 4, dtype=t), "k": 3}),
    Case(
        "cp-f64",
        CP,
        lambda g, t: {"rate": _positive(g, 2, 4, dtype=t), "k": torch.tensor([1, 3])},
        dtype=_F64,
    ),
    # PoissonBinomial (event shape (): a count)
    Case("pb-unbatched", PB, lambda g, t: {"logits": _randn(g, 5, dtype=t)}),
    Case("pb-batched-masked", PB, lambda g, t: {"logits": _masked_rows(g, t)}),
    Case(
        "pb-probs",  # exact probabilities 0 and 1
        PB,
        lambda g, t: {"probs": _edge_probs(g, 2, 4, dtype=t, zeros=[(0, 0)], ones=[(1, 2)])},
    ),
    Case("pb-f64", PB, lambda g, t: {"logits": _randn(g, 2, 1, 5, dtype=t)}, dtype=_F64),
    # CountConstrainedBernoulli
    Case("ccb-at-most", CCB, lambda g, t: {"logits": _randn(g, 5, dtype=t), "high": 2}),
    Case("ccb-at-least", CCB, lambda g, t: {"logits": _randn(g, 2, 5, dtype=t), "low": 3}),
    Case(
        "ccb-per-batch-masked",
        CCB,
        lambda g, t: {
            "logits": _masked_rows(g, t),
            "low": torch.tensor([0, 1, 2]),
            "high": torch.tensor([2, 3, 5]),
        },
    ),
    Case(
        "ccb-bounds-broadcast",  # batch (2, 3) from the bounds and the logits
        CCB,
        lambda g, t: {
            "logits": _randn(g, 3, 4, dtype=t),
            "low": torch.tensor([[0], [2]]),
            "high": 3,
        },
    ),
    Case(
        "ccb-probs",
        CCB,
        lambda g, t: {
            "probs": _edge_probs(g, 2, 4, dtype=t, zeros=[(0, 0)], ones=[(1, 2)]),
            "low": 1,
            "high": 2,
        },
    ),
    Case(
        "ccb-f64",
        CCB,
        lambda g, t: {
            "logits": _randn(g, 2, 5, dtype=t),
            "low": torch.tensor([1, 0]),
            "high": torch.tensor([4, 2]),
        },
        dtype=_F64,
    ),
]
CASE_IDS = [case.id for case in CASES]
CASES_BY_ID = {case.id: case for case in CASES}


def _is(case: Case, *prefixes: str) -> bool:
    return case.id.startswith(prefixes)


def _params(test: str, cases=CASES, variants=None):
    """``cases`` (times ``variants``, a list of ``(tag, value)``) as pytest params for
    ``test``."""
    out = []
    for case in cases:
        for tag, value in variants or [(None, None)]:
            param_id = case.id if tag is None else f"{case.id}-{tag}"
            values = (case,) if tag is None else (case, value)
            out.append(pytest.param(*values, id=param_id))
    return out


_VALIDATE = [("validate", True), ("novalidate", False)]


# ------------------------------------------------------------------------------------------
# Helpers


def _counts(case: Case, batch_shape) -> torch.Tensor:
    return torch.as_tensor(case.params()["k"]).expand(batch_shape)


def _forced(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """(forced on, forced off) masks of a PB / CCB case, from its parameters."""
    params = case.params()
    if "probs" in params:
        return params["probs"] == 1, params["probs"] == 0
    return params["logits"] == math.inf, params["logits"] == -math.inf


def _bounds(case: Case, batch_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(low, high) of a CCB case broadcast to the batch (defaults 0 and n)."""
    params = case.params()
    n = _forced(case)[0].shape[-1]
    low, high = params.get("low", 0), params.get("high", n)
    return torch.as_tensor(low).expand(batch_shape), torch.as_tensor(high).expand(batch_shape)


def _valid_value(case: Case, d, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A point of the support built without the library: EKB the first k coordinates on,
    CP all k counts in the first category, PB the count of the forced ones, CCB the forced
    ones and then the first free ones up to ``low``, LCN a random point projected onto
    ``A z = k`` with a float64 pseudo-inverse; in ``dtype`` (default the case's)."""
    n = d.event_shape[0] if d.event_shape else _forced(case)[0].shape[-1]
    params = case.params()
    if case.cls is EKB:
        k = _counts(case, d.batch_shape)
        return (torch.arange(n) < k.unsqueeze(-1)).to(case.dtype)
    if case.cls is CP:
        k = _counts(case, d.batch_shape)
        value = torch.zeros(d.batch_shape + (n,), dtype=case.dtype)
        value[..., 0] = k.to(case.dtype)
        return value
    if case.cls is PB:  # every free Bernoulli off: the count of the forced ones
        on, _ = _forced(case)
        return on.sum(-1).to(case.dtype).expand(d.batch_shape)
    if case.cls is CCB:  # the forced ones, then the first free ones up to max(low, forced)
        on, off = _forced(case)
        on, off = on.expand(d.shape()), off.expand(d.shape())
        low, _ = _bounds(case, d.batch_shape)
        free = ~on & ~off
        wanted = torch.clamp(low - on.sum(-1), min=0)
        return (on | (free & (free.cumsum(-1) <= wanted[..., None]))).to(case.dtype)
    A = torch.as_tensor(params.get("A", torch.ones(1, n))).double()
    k = torch.as_tensor(params.get("k", torch.zeros(A.shape[-2]))).double()
    if k.dim() == 0:
        k = k.unsqueeze(-1)
    x = torch.randn(d.batch_shape + (n,), generator=torch.Generator().manual_seed(7)).double()
    residual = k - (A @ x.unsqueeze(-1)).squeeze(-1)
    z = x + (torch.linalg.pinv(A) @ residual.unsqueeze(-1)).squeeze(-1)
    return z.to(case.dtype if dtype is None else dtype)


def _invalid_values(case: Case, d) -> list[torch.Tensor]:
    """Values of the right shape outside the support (every batch element is outside)."""
    valid = _valid_value(case, d)
    if case.cls is EKB:
        wrong_count = valid.clone()
        wrong_count[..., -1] = 1 - wrong_count[..., -1]
        fractional = valid.clone()
        fractional[..., 0] = 0.5
        return [wrong_count, fractional]
    if case.cls is PB:
        n = _forced(case)[0].shape[-1]
        return [valid + 0.5, torch.full_like(valid, n + 1.0), torch.full_like(valid, -1.0)]
    if case.cls is CCB:
        # A count outside the range: all ones where high < n, else all zeros (low > 0 in
        # every such batch element of the cases).
        low, high = _bounds(case, d.batch_shape)
        n = d.event_shape[0]
        all_ones = (high < n)[..., None].expand(d.shape())
        wrong_count = all_ones.to(case.dtype)
        fractional = valid.clone()
        fractional[..., 0] = 0.5
        two = valid.clone()
        two[..., 0] = 2.0
        return [wrong_count, fractional, two]
    if case.cls is CP:
        wrong_sum = valid.clone()
        wrong_sum[..., 0] += 1
        fractional = valid.clone()
        fractional[..., 0] -= 0.5
        fractional[..., 1] += 0.5
        negative = valid.clone()
        negative[..., 0] += 1
        negative[..., 1] = -1
        return [wrong_sum, fractional, negative]
    params = case.params()
    n = d.event_shape[0]
    A = torch.as_tensor(params.get("A", torch.ones(1, n, dtype=case.dtype)))
    return [valid + A[..., 0, :]]


def _float_params(case: Case, params: dict) -> list[str]:
    return [
        name
        for name, value in params.items()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
    ]


def _element_params(case: Case, params: dict, batch_shape, index) -> dict:
    """The parameters of the batch element ``index``, each broadcast to the batch first."""
    out = {}
    for name, value in params.items():
        event_dim = PARAM_EVENT_DIMS[case.cls][name]
        if not isinstance(value, torch.Tensor):
            out[name] = value
            continue
        if case.cls is LCN and name == "k" and value.dim() == 0:
            value = value.unsqueeze(-1)
        event_shape = value.shape[value.dim() - event_dim :]
        out[name] = value.expand(batch_shape + event_shape)[index]
    return out


def _assert_mc_close(estimate_samples: torch.Tensor, exact: torch.Tensor, what: str):
    """``mean(estimate_samples, 0)`` within SIGMAS standard errors of ``exact``."""
    samples = estimate_samples.double()
    num = samples.shape[0]
    mean = samples.mean(0)
    standard_error = samples.std(0) / math.sqrt(num)
    exact = exact.double().expand_as(mean)
    tolerance = SIGMAS * standard_error + 1e-6 * (1 + exact.abs())
    ok = (mean - exact).abs() <= tolerance
    assert ok.all(), (
        f"{what}: Monte Carlo {mean[~ok].tolist()} vs exact {exact[~ok].tolist()}, "
        f"tolerance {tolerance[~ok].tolist()}"
    )


def _check_sample_shapes(small, large):
    """Pyro's ``check_sample_shapes``: a small distribution and its expansion agree."""
    x = small.sample()
    torch.testing.assert_close(small.log_prob(x).expand(large.batch_shape), large.log_prob(x))
    x = large.sample()
    torch.testing.assert_close(small.log_prob(x), large.log_prob(x))


def _shape_types():
    return (torch.Size, tuple, list)


# ------------------------------------------------------------------------------------------
# Constraints: torch's test_params_constraints / test_support_constraints / attributes


@pytest.mark.parametrize("case", _params("test_arg_constraints_event_dims"))
def test_arg_constraints_event_dims(case):
    d = case.dist()
    expected = PARAM_EVENT_DIMS[case.cls]
    for name in REQUIRED_CONSTRAINTS[case.cls]:
        assert name in d.arg_constraints, f"{name} missing from arg_constraints"
    for name, constraint in d.arg_constraints.items():
        assert name in expected, f"unexpected constrained parameter {name}"
        assert constraint.event_dim == expected[name], (name, constraint)
    if "k" in d.arg_constraints and case.cls in (EKB, CP):
        assert d.arg_constraints["k"].is_discrete


@pytest.mark.parametrize("case", _params("test_params_constraints"))
def test_params_constraints(case):
    """torch's ``test_params_constraints``: every given parameter satisfies its constraint,
    and its batch shape (its shape less the constraint's event dims) broadcasts with the
    distribution's."""
    params = case.params()
    d = case.cls(**params)
    for name, value in params.items():
        if isinstance(value, (int, float)):
            value = torch.tensor([value])
        try:
            constraint = d.arg_constraints[name]
        except KeyError:
            continue  # an optional parameter without a constraint
        assert value.dim() >= constraint.event_dim, name
        value_batch_shape = value.shape[: value.dim() - constraint.event_dim]
        torch.broadcast_shapes(d.batch_shape, value_batch_shape)
        if constraints.is_dependent(constraint):
            continue
        assert constraint.check(value).all(), f"{case.id} parameter {name} = {value}"


@pytest.mark.parametrize("case", _params("test_support_constraints"))
def test_support_constraints(case):
    """torch's ``test_support_constraints`` and ``test_support_attributes``."""
    d = case.dist()
    value = d.sample()
    support = d.support
    assert support.event_dim == len(d.event_shape) == (0 if case.cls is PB else 1)
    assert case.cls.support.event_dim == len(d.event_shape)
    assert support.is_discrete == (case.cls is not LCN)
    assert case.cls.support.is_discrete == support.is_discrete
    ok = support.check(value)
    assert ok.shape == d.batch_shape
    assert ok.all()


@pytest.mark.parametrize("case", _params("test_support_shape"))
def test_support_shape(case):
    """Pyro's ``test_support_shape`` on hand-built points of the support, batched by a
    leading sample dimension too."""
    d = case.dist()
    for x in (_valid_value(case, d), _valid_value(case, d).expand((2,) + d.shape())):
        ok = d.support.check(x)
        sample_and_batch = x.shape[: x.dim() - len(d.event_shape)]
        assert ok.shape == torch.broadcast_shapes(d.batch_shape, sample_and_batch)
        assert ok.all()
    for bad in _invalid_values(case, d):
        assert not d.support.check(bad).any()


# ------------------------------------------------------------------------------------------
# Shapes: Pyro's test_distributions / test_shapes


@pytest.mark.parametrize("case", _params("test_infer_shapes"))
def test_infer_shapes(case):
    params = case.params()
    arg_shapes = {
        name: value.shape if isinstance(value, torch.Tensor) else ()
        for name, value in params.items()
    }
    batch_shape, event_shape = case.cls.infer_shapes(**arg_shapes)
    d = case.cls(**params)
    assert d.batch_shape == batch_shape
    assert d.event_shape == event_shape


@pytest.mark.parametrize("case", _params("test_shapes_and_dtypes"))
def test_shapes_and_dtypes(case):
    """Pyro's ``test_shapes.py``: ``shape()``, sample shapes and dtypes of every output."""
    d = case.dist()
    assert d.shape() == d.batch_shape + d.event_shape
    for sample_shape in [(), (2,), (2, 3)]:
        x = d.sample(sample_shape)
        assert x.shape == torch.Size(sample_shape) + d.shape()
        assert x.dtype == case.dtype
        assert not x.requires_grad
    assert d.mean.shape == d.shape() and d.mean.dtype == case.dtype
    assert d.variance.shape == d.shape() and d.variance.dtype == case.dtype
    assert d.entropy().dtype == case.dtype
    assert d.log_prob(_valid_value(case, d)).dtype == case.dtype


@pytest.mark.parametrize("case", _params("test_batch_log_prob_shape"))
def test_batch_log_prob_shape(case):
    d = case.dist()
    x = _valid_value(case, d)
    assert d.log_prob(x).shape == d.batch_shape
    x2 = x.expand((2,) + x.shape)
    assert d.log_prob(x2).shape == (2,) + d.batch_shape
    assert torch.isfinite(d.log_prob(x2)).all()


@pytest.mark.parametrize("case", _params("test_batch_entropy_shape"))
def test_batch_entropy_shape(case):
    d = case.dist()
    entropy = d.entropy()
    assert entropy.shape == d.batch_shape
    assert torch.isfinite(entropy).all()


@pytest.mark.parametrize("case", _params("test_batch_log_prob_matches_elements"))
def test_batch_log_prob_matches_elements(case):
    """The batched log_prob, mean, variance and entropy of each element equal those of the
    distribution built from that element's parameters alone (a reference that shares no
    batching code)."""
    params = case.params()
    d = case.cls(**params)
    x = _valid_value(case, d)
    log_prob = d.log_prob(x)
    entropy = d.entropy()
    for index in _indices(d.batch_shape):
        single = case.cls(**_element_params(case, params, d.batch_shape, index))
        assert single.batch_shape == ()
        torch.testing.assert_close(log_prob[index], single.log_prob(x[index]))
        torch.testing.assert_close(entropy[index], single.entropy())
        torch.testing.assert_close(d.mean[index], single.mean)
        torch.testing.assert_close(d.variance[index], single.variance)


def _indices(shape):
    if not shape:
        return [()]
    return [
        tuple(int(i) for i in index)
        for index in torch.cartesian_prod(*[torch.arange(s) for s in shape]).reshape(-1, len(shape))
    ]


# With validation on, torch's _validate_sample catches what EKB misses.


@pytest.mark.parametrize(
    "case,validate", _params("test_score_errors_event_dim_mismatch", variants=_VALIDATE)
)
def test_score_errors_event_dim_mismatch(case, validate):
    if case.cls is PB:
        pytest.skip("event shape (): an extra trailing dim of a count is a batch dim")
    d = case.dist(validate_args=validate)
    wrong = torch.ones(d.shape() + (1,), dtype=case.dtype)
    with pytest.raises(ValueError):
        d.log_prob(wrong)
    wrong_size = torch.ones(d.batch_shape + (d.event_shape[0] + 1,), dtype=case.dtype)
    with pytest.raises(ValueError):
        d.log_prob(wrong_size)


@pytest.mark.parametrize(
    "case,validate", _params("test_score_errors_non_broadcastable_data_shape", variants=_VALIDATE)
)
def test_score_errors_non_broadcastable_data_shape(case, validate):
    d = case.dist(validate_args=validate)
    shape = d.shape()
    if not shape:
        pytest.skip("shape (): every value shape broadcasts")
    non_broadcastable = (shape[0] + 1,) + shape[1:]
    with pytest.raises(ValueError):
        d.log_prob(torch.ones(non_broadcastable, dtype=case.dtype))


# ------------------------------------------------------------------------------------------
# expand: Pyro's test_expand_* and torch's test_distribution_expand


@pytest.mark.parametrize("case", _params("test_expand_by"))
def test_expand_by(case):
    small = case.dist()
    for sample_shape in [(), (2,), (2, 3)]:
        for shape_type in _shape_types():
            large = small.expand_by(shape_type(sample_shape))
            assert large.batch_shape == sample_shape + small.batch_shape
            _check_sample_shapes(small, large)


@pytest.mark.parametrize("default", [False, True], ids=["own", "default"])
@pytest.mark.parametrize("case", _params("test_expand_new_dim"))
def test_expand_new_dim(case, default):
    small = case.dist()
    for sample_shape in [(), (2,), (2, 3)]:
        for shape_type in _shape_types():
            shape = shape_type(sample_shape + tuple(small.batch_shape))
            if default:
                large = TorchDistribution.expand(small, shape)
            else:
                large = small.expand(shape)
                assert type(large) is case.cls
            assert large.batch_shape == sample_shape + small.batch_shape
            _check_sample_shapes(small, large)


@pytest.mark.parametrize("default", [False, True], ids=["own", "default"])
@pytest.mark.parametrize("case", _params("test_expand_existing_dim"))
def test_expand_existing_dim(case, default):
    small = case.dist()
    expanded_any = False
    for dim, size in enumerate(small.batch_shape):
        if size != 1:
            continue
        batch_shape = list(small.batch_shape)
        batch_shape[dim] = 5
        for shape_type in _shape_types():
            if default:
                large = TorchDistribution.expand(small, shape_type(batch_shape))
            else:
                large = small.expand(shape_type(batch_shape))
            assert large.batch_shape == torch.Size(batch_shape)
            _check_sample_shapes(small, large)
        expanded_any = True
    if not expanded_any:
        pytest.skip("no batch dimension of size 1 in this case")


@pytest.mark.parametrize("default", [False, True], ids=["own", "default"])
@pytest.mark.parametrize(
    "sample_shapes", [[(2, 1), (2, 3)], [(2, 1, 1), (2, 1, 3), (2, 5, 3)]], ids=["2d", "3d"]
)
@pytest.mark.parametrize("case", _params("test_subsequent_expands_ok"))
def test_subsequent_expands_ok(case, sample_shapes, default):
    d = case.dist()
    original_batch_shape = d.batch_shape
    for shape in sample_shapes:
        proposed = torch.Size(shape) + original_batch_shape
        n = TorchDistribution.expand(d, proposed) if default else d.expand(proposed)
        assert n.batch_shape == proposed
        _check_sample_shapes(d, n)
        d = n


@pytest.mark.parametrize("default", [False, True], ids=["own", "default"])
@pytest.mark.parametrize("case", _params("test_expand_error"))
def test_expand_error(case, default):
    small = case.dist()
    for initial_shape, proposed_shape in [
        [(2, 1), (4, 3)],
        [(2, 4), (2, 2, 1)],
        [(1, 2, 1), (2, 1)],
    ]:
        shape = torch.Size(initial_shape) + small.batch_shape
        large = TorchDistribution.expand(small, shape) if default else small.expand(shape)
        with pytest.raises((RuntimeError, ValueError)):
            large.expand(torch.Size(proposed_shape) + small.batch_shape)


@pytest.mark.parametrize("extra_event_dims", [0, 1, 2])
@pytest.mark.parametrize("case", _params("test_expand_reshaped_distribution"))
def test_expand_reshaped_distribution(case, extra_event_dims):
    """Pyro's ``test_expand_reshaped_distribution`` with one of ours as the base."""
    d = case.dist()
    full_shape = torch.Size([4, 1, 1]) + d.batch_shape + d.event_shape
    reshaped = d.expand_by([4, 1, 1]).to_event(extra_event_dims)
    cut = len(full_shape) - len(d.event_shape) - extra_event_dims
    batch_shape, event_shape = full_shape[:cut], full_shape[cut:]
    assert reshaped.batch_shape == batch_shape
    assert reshaped.event_shape == event_shape
    # A new leading dim, and every singleton batch dim grows (as upstream's [5, 4, 3]).
    expand_shape = [5] + [3 if size == 1 else size for size in batch_shape]
    large = reshaped.expand(expand_shape)
    assert large.batch_shape == torch.Size(expand_shape)
    assert large.event_shape == event_shape
    x = large.sample()
    assert x.shape == torch.Size(expand_shape) + event_shape
    assert large.log_prob(x).shape == torch.Size(expand_shape)
    with pytest.raises((RuntimeError, ValueError)):
        reshaped.expand(expand_shape + [3])
    with pytest.raises((RuntimeError, ValueError)):
        large.expand(expand_shape[1:])


@pytest.mark.parametrize("case", _params("test_distribution_expand"))
def test_distribution_expand(case):
    """torch's ``test_distribution_expand`` and ``test_distribution_subclass_expand``."""

    class SubClass(case.cls):
        pass

    for cls in (case.cls, SubClass):
        for shape in [torch.Size(), torch.Size((2,)), torch.Size((2, 1))]:
            d = cls(**case.params())
            expanded_shape = shape + d.batch_shape
            original_shape = d.batch_shape + d.event_shape
            expanded = d.expand(batch_shape=list(expanded_shape))
            sample = expanded.sample()
            assert expanded.__class__ is d.__class__
            assert d.sample().shape == original_shape
            torch.testing.assert_close(expanded.log_prob(sample), d.log_prob(sample))
            assert expanded.sample().shape == shape + original_shape
            assert expanded.batch_shape == expanded_shape
            torch.testing.assert_close(expanded.mean, d.mean.expand(expanded_shape + d.event_shape))
            torch.testing.assert_close(
                expanded.variance, d.variance.expand(expanded_shape + d.event_shape)
            )
            torch.testing.assert_close(expanded.entropy(), d.entropy().expand(expanded_shape))


# ------------------------------------------------------------------------------------------
# Pickle (Pyro's test_pickle), mask (test_mask), Independent (test_independent)


@pytest.mark.parametrize("after_use", [False, True], ids=["fresh", "used"])
@pytest.mark.parametrize("case", _params("test_pickle"))
def test_pickle(case, after_use):
    d = case.dist()
    x = _valid_value(case, d)
    if after_use:  # with whatever caches the methods leave behind
        d.log_prob(x), d.entropy(), d.mean, d.variance, d.sample()
    buffer = io.BytesIO()
    torch.save(d, buffer, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    buffer.seek(0)
    for copy in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(d))):
        assert type(copy) is case.cls
        assert copy.batch_shape == d.batch_shape and copy.event_shape == d.event_shape
        torch.testing.assert_close(copy.log_prob(x), d.log_prob(x), rtol=0, atol=0)
        torch.testing.assert_close(copy.entropy(), d.entropy(), rtol=0, atol=0)
        torch.testing.assert_close(copy.mean, d.mean, rtol=0, atol=0)
        pyro.set_rng_seed(3)
        expected = d.sample((4,))
        pyro.set_rng_seed(3)
        torch.testing.assert_close(copy.sample((4,)), expected, rtol=0, atol=0)


def _checker_mask(shape) -> torch.Tensor:
    mask = torch.tensor(0.0)
    for size in shape:
        mask = mask.unsqueeze(-1) + torch.arange(float(size))
    return mask.fmod(2).bool()


@pytest.mark.parametrize("case", _params("test_mask"))
def test_mask(case):
    """Pyro's ``test_mask`` / ``test_mask_type``: masked log_prob is zero where masked and
    the base's elsewhere; shapes, mean and variance are the base's; KL of masked is masked."""
    base = case.dist()
    masks = [torch.tensor(True), torch.tensor(False), True, False]
    if base.batch_shape:
        masks.append(_checker_mask(base.batch_shape))
        masks.append(_checker_mask(base.batch_shape[-1:]))
    x = base.sample()
    base_log_prob = base.log_prob(x)
    other = case.dist(seed=1)
    kl = kl_divergence(base, other)
    for mask in masks:
        d = base.mask(mask)
        assert d.batch_shape == base.batch_shape
        assert d.event_shape == base.event_shape
        mask_tensor = torch.as_tensor(mask)
        expected = torch.where(mask_tensor, base_log_prob, torch.zeros(()))
        # Pyro itself returns default-dtype zeros for the Python constant False.
        check_dtype = mask is not False
        torch.testing.assert_close(d.log_prob(x), expected, check_dtype=check_dtype)
        torch.testing.assert_close(d.mean, base.mean)
        torch.testing.assert_close(d.variance, base.variance)
        masked_kl = kl_divergence(d, other.mask(mask))
        torch.testing.assert_close(
            torch.as_tensor(masked_kl, dtype=kl.dtype).expand(kl.shape),
            torch.where(mask_tensor, kl, torch.zeros(())),
        )


@pytest.mark.parametrize("case", _params("test_mask_broadcast"))
def test_mask_broadcast(case):
    """Pyro's ``test_broadcast``: a mask with an extra leading dim expands the batch."""
    base = case.dist()
    mask = torch.tensor([True, False]).reshape((2,) + (1,) * len(base.batch_shape))
    d = base.mask(mask)
    assert d.batch_shape == (2,) + base.batch_shape
    assert d.event_shape == base.event_shape
    x = d.sample()
    assert x.shape == (2,) + base.shape()
    log_prob = d.log_prob(x)
    assert log_prob.shape == (2,) + base.batch_shape
    torch.testing.assert_close(log_prob[0], base.log_prob(x[0]))
    assert (log_prob[1] == 0).all()


@pytest.mark.parametrize("case", _params("test_independent"))
def test_independent(case):
    """Pyro's ``test_independent`` / ``test_to_event`` / ``test_expand``."""
    base = case.dist().expand_by((2,))
    batch_shape = base.batch_shape
    other = case.dist(seed=1).expand_by((2,))
    kl = kl_divergence(base, other)
    for sample_shape in [(), (3,)]:
        for reinterpreted in range(len(batch_shape) + 2):
            if reinterpreted > len(batch_shape):
                with pytest.raises(ValueError):
                    dist.Independent(base, reinterpreted)
                continue
            d = dist.Independent(base, reinterpreted)
            cut = len(batch_shape) - reinterpreted
            assert d.batch_shape == batch_shape[:cut]
            assert d.event_shape == batch_shape[cut:] + base.event_shape
            assert d.sample().shape == batch_shape + base.event_shape
            assert d.mean.shape == batch_shape + base.event_shape
            assert d.variance.shape == batch_shape + base.event_shape
            x = d.sample(sample_shape)
            assert x.shape == torch.Size(sample_shape) + d.batch_shape + d.event_shape
            log_prob = d.log_prob(x)
            assert log_prob.shape == torch.Size(sample_shape) + batch_shape[:cut]
            assert not torch.isnan(log_prob).any()
            torch.testing.assert_close(log_prob, _sum_rightmost(base.log_prob(x), reinterpreted))
            torch.testing.assert_close(
                kl_divergence(d, dist.Independent(other, reinterpreted)),
                _sum_rightmost(kl, reinterpreted),
            )
            torch.testing.assert_close(d.entropy(), _sum_rightmost(base.entropy(), reinterpreted))
    # to_event round trips (Pyro's test_to_event)
    assert base.to_event(0) is base
    one = base.to_event(1)
    assert one.event_dim == base.event_dim + 1 and one.base_dist is base
    assert one.to_event(-1) is base


# ------------------------------------------------------------------------------------------
# rsample, plates, enumerate_support


@pytest.mark.parametrize("case", _params("test_rsample"))
def test_rsample(case):
    """``has_rsample``; rsample shapes, support and dtype; gradient to every float
    parameter (torch's ``test_rsample_requires_grad``); ``sample`` carries no gradient."""
    if case.cls is PB:
        pytest.skip(
            "PoissonBinomial has no rsample: its value is an integer count (a likelihood of "
            "observed counts, whose gradients come through log_prob)"
        )
    assert case.cls.has_rsample
    params = case.params()
    leaves = {}
    for name in _float_params(case, params):
        if case.cls is LCN and name in ("A", "k"):
            continue
        leaves[name] = params[name].clone().requires_grad_()
    d = case.cls(**{**params, **leaves})
    assert d.has_rsample
    assert not d.sample().requires_grad
    for sample_shape in [(), (2,), (2, 3)]:
        z = d.rsample(sample_shape)
        assert z.shape == torch.Size(sample_shape) + d.shape()
        assert z.dtype == case.dtype
        assert z.requires_grad
        assert d.support.check(z).all()
    z = d.rsample((5,))
    weights = torch.randn(z.shape, generator=torch.Generator().manual_seed(1), dtype=z.dtype)
    (z * weights).sum().backward()
    nonzero = False
    for name, leaf in leaves.items():
        assert leaf.grad is not None, name
        assert torch.isfinite(leaf.grad).all(), name
        nonzero |= bool((leaf.grad != 0).any())
    assert nonzero or case.deterministic


@pytest.mark.parametrize("case", _params("test_sample_under_plate"))
def test_sample_under_plate(case):
    d = case.dist()
    batch = d.batch_shape
    dim = -len(batch) - 1

    def model(obs=None):
        with pyro.plate("outer", 2, dim=dim):
            if batch:
                with pyro.plate("inner", batch[-1], dim=-1):
                    return pyro.sample("x", d, obs=obs)
            return pyro.sample("x", d, obs=obs)

    trace = poutine.trace(model).get_trace()
    trace.compute_log_prob()
    x = trace.nodes["x"]["value"]
    assert x.shape == (2,) + d.shape()
    log_prob = trace.nodes["x"]["log_prob"]
    assert log_prob.shape == (2,) + batch
    torch.testing.assert_close(log_prob, d.log_prob(x))
    assert d.support.check(x).all()
    obs = _valid_value(case, d).expand((2,) + d.shape())
    trace = poutine.trace(model).get_trace(obs)
    torch.testing.assert_close(trace.log_prob_sum(), d.log_prob(obs).sum())


@pytest.mark.parametrize("case", _params("test_enumerate_support"))
def test_enumerate_support(case):
    """Pyro's ``test_enumerate_support_shape`` where the class enumerates (API.md: EKB and
    CP with a scalar k), else ``enumerate_support`` must say it is absent."""
    d = case.dist()
    if not d.has_enumerate_support:
        assert case.cls is not LCN or not case.cls.has_enumerate_support
        with pytest.raises(NotImplementedError):
            d.enumerate_support()
        return
    assert case.cls is not LCN
    expected_size = _support_size(case, d)
    if expected_size is None:
        with pytest.raises((ValueError, NotImplementedError)):
            d.enumerate_support()
        return
    support = d.enumerate_support()
    size = support.shape[0]
    assert size == expected_size
    assert support.shape == (size,) + d.batch_shape + d.event_shape
    assert type(support) is type(d.sample())
    torch.testing.assert_close(d.enumerate_support(expand=True), support)
    unexpanded = d.enumerate_support(expand=False)
    assert unexpanded.shape == (size,) + (1,) * len(d.batch_shape) + d.event_shape
    assert (support == unexpanded).all()
    assert d.support.check(support).all()
    total = torch.logsumexp(d.log_prob(support).double(), 0)
    torch.testing.assert_close(total, torch.zeros_like(total), atol=1e-5, rtol=0)


def _support_size(case: Case, d) -> int | None:
    """The number of points of the one support shared by the batch (PB: the counts 0..n,
    in every case), or None where the batch elements' supports differ (EKB / CP: k, CCB:
    the bounds or the masks vary), which ``enumerate_support`` refuses."""
    if case.cls is PB:
        return _forced(case)[0].shape[-1] + 1
    if case.cls is CCB:
        on, off = (mask.expand(d.shape()).reshape(-1, d.event_shape[0]) for mask in _forced(case))
        low, high = (bound.reshape(-1) for bound in _bounds(case, d.batch_shape))
        same = (on == on[:1]).all() and (off == off[:1]).all()
        if not (same and (low == low[0]).all() and (high == high[0]).all()):
            return None
        forced, free = int(on[0].sum()), int((~on[0] & ~off[0]).sum())
        return sum(math.comb(free, k - forced) for k in range(int(low[0]), int(high[0]) + 1))
    k = _counts(case, d.batch_shape)
    if k.numel() and not (k == k.reshape(-1)[0]).all():
        return None
    n = d.event_shape[0]
    kk = int(k.reshape(-1)[0]) if k.numel() else 0
    return math.comb(n, kk) if case.cls is EKB else math.comb(n + kk - 1, kk)


# ------------------------------------------------------------------------------------------
# Validation: bad parameters and values outside the support


def _bad_parameters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, generator=g)
    loc, scale = torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5
    rate = torch.rand(4, generator=g) + 0.5
    nan_logits = logits.clone()
    nan_logits[1] = math.nan
    not_pd = torch.tensor([[1.0, 2.0, 0, 0], [2.0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    nan_loc = loc.clone()
    nan_loc[0] = math.nan
    # (id, class, kwargs, range_only): range_only errors are validation's business; with
    # validation off the constructor accepts them (as torch's and Pyro's own do).
    return [
        ("ekb-k-negative", EKB, {"logits": logits, "k": -1}, True),
        ("ekb-k-above-n", EKB, {"logits": logits, "k": 5}, True),
        ("ekb-per-batch-k-above-n", EKB, {"logits": logits, "k": torch.tensor([1, 7])}, True),
        ("ekb-logits-nan", EKB, {"logits": nan_logits, "k": 2}, True),
        ("ekb-probs-above-one", EKB, {"probs": torch.tensor([0.2, 1.5, 0.3, 0.4]), "k": 2}, True),
        ("lcn-scale-negative", LCN, {"loc": loc, "scale": -scale}, True),
        ("lcn-scale-zero", LCN, {"loc": loc, "scale": torch.zeros(4)}, True),
        ("lcn-loc-nan", LCN, {"loc": nan_loc, "scale": scale}, True),
        ("lcn-cov-not-pd", LCN, {"loc": loc, "covariance_matrix": not_pd}, True),
        (
            "lcn-A-rank-deficient",
            LCN,
            {"loc": loc, "scale": scale, "A": torch.ones(2, 4), "k": torch.zeros(2)},
            True,
        ),
        ("lcn-A-too-many-rows", LCN, {"loc": loc, "scale": scale, "A": torch.eye(4)}, False),
        ("cp-rate-negative", CP, {"rate": -rate, "k": 2}, True),
        ("cp-rate-zero", CP, {"rate": torch.zeros(4), "k": 2}, True),
        ("cp-rate-nan", CP, {"rate": torch.full((4,), math.nan), "k": 2}, True),
        ("cp-rate-inf", CP, {"rate": torch.tensor([1.0, math.inf, 1.0, 1.0]), "k": 2}, True),
        ("cp-k-negative", CP, {"rate": rate, "k": -1}, True),
        ("cp-per-batch-k-negative", CP, {"rate": rate, "k": torch.tensor([2, -1])}, True),
        ("pb-logits-nan", PB, {"logits": nan_logits}, True),
        ("pb-probs-above-one", PB, {"probs": torch.tensor([0.2, 1.5, 0.3, 0.4])}, True),
        ("pb-probs-negative", PB, {"probs": torch.tensor([0.2, -0.5, 0.3, 0.4])}, True),
        ("pb-logits-scalar", PB, {"logits": torch.tensor(0.3)}, False),
        ("ccb-low-above-high", CCB, {"logits": logits, "low": 3, "high": 2}, True),
        ("ccb-high-above-n", CCB, {"logits": logits, "high": 5}, True),
        ("ccb-low-negative", CCB, {"logits": logits, "low": -1}, True),
        (
            "ccb-per-batch-low-above-high",
            CCB,
            {"logits": logits, "low": torch.tensor([1, 3]), "high": torch.tensor([2, 2])},
            True,
        ),
        # Two variables forced on leave no count in 0..1.
        (
            "ccb-masks-infeasible",
            CCB,
            {"logits": torch.tensor([math.inf, math.inf, 0.0, 0.0]), "high": 1},
            True,
        ),
        ("ccb-logits-nan", CCB, {"logits": nan_logits, "high": 2}, True),
        ("ccb-probs-above-one", CCB, {"probs": torch.tensor([0.2, 1.5, 0.3, 0.4])}, True),
        ("ccb-low-not-whole", CCB, {"logits": logits, "low": 1.5}, False),
        ("ccb-high-bool", CCB, {"logits": logits, "high": True}, False),
        (
            "ccb-bounds-shape",
            CCB,
            {"logits": logits.expand(3, 4), "low": torch.tensor([1, 2])},
            False,
        ),
    ]


_BAD = _bad_parameters()


@pytest.mark.parametrize("cls,kwargs,range_only", [b[1:] for b in _BAD], ids=[b[0] for b in _BAD])
def test_validate_args_bad_parameters(cls, kwargs, range_only):
    """Pyro's ``test_distribution_validate_args``: with validation on a bad parameter is a
    ValueError; with it off, a range error passes construction, and an EKB whose k is out
    of range gives -inf log-probabilities and NaN moments (CONVENTIONS.md decision 2)."""
    with pyro.validation_enabled(True):
        with pytest.raises(ValueError):
            cls(**kwargs)
    with pytest.raises(ValueError):
        cls(**kwargs, validate_args=True)
    if range_only:
        with pyro.validation_enabled(False):
            d = cls(**kwargs)
            assert not d._validate_args
    if range_only and cls is EKB and kwargs.get("logits") is not None:
        k = torch.as_tensor(kwargs["k"])
        n = kwargs["logits"].shape[-1]
        if ((k < 0) | (k > n)).any():
            d = cls(**kwargs, validate_args=False)
            out_of_range = (k < 0) | (k > n)
            value = torch.zeros(d.shape())
            assert (d.log_prob(value)[out_of_range.expand(d.batch_shape)] == -math.inf).all()
            assert torch.isnan(d.mean[out_of_range.expand(d.batch_shape)]).all()


_COUNT_CASES = [case for case in CASES if case.id in ("ekb-unbatched", "cp-unbatched")]

_COUNTS = [
    # (tag, k given for the case's k = K, whether it is a count)
    ("long-tensor", lambda k: torch.tensor(k), True),
    ("whole-float", lambda k: float(k), True),
    ("float-tensor", lambda k: torch.tensor(float(k)), True),
    ("fraction-validate", lambda k: k + 0.5, False),
    ("fraction-novalidate", lambda k: k + 0.5, False),
    ("bool", lambda k: True, False),
    ("nan-validate", lambda k: math.nan, False),
    ("nan-novalidate", lambda k: math.nan, False),
]


@pytest.mark.parametrize(
    "case,count",
    _params("test_count_rule", _COUNT_CASES, [(tag, (f, ok)) for tag, f, ok in _COUNTS]),
)
def test_count_rule(case, count, request):
    """CONVENTIONS.md decision 2, for EKB's and CP's k: an int, an integer tensor or a
    whole-number float (as ``Binomial.total_count``) is the count; a fraction, a bool or NaN
    is a ValueError whatever validate_args says."""
    make_k, is_count = count
    validate = not request.node.callspec.id.endswith("-novalidate")
    params = case.params()
    k = params.pop("k")
    if is_count:
        d = case.cls(**params, k=make_k(k), validate_args=validate)
        reference = case.cls(**params, k=k)
        x = _valid_value(case, reference)
        torch.testing.assert_close(d.log_prob(x), reference.log_prob(x))
        torch.testing.assert_close(d.mean, reference.mean)
    else:
        with pytest.raises(ValueError):
            case.cls(**params, k=make_k(k), validate_args=validate)


@pytest.mark.parametrize("case", _params("test_k_max", _COUNT_CASES))
def test_k_max(case):
    """CONVENTIONS.md decision 3: Pyro accepts ``k_max`` (API parity with NumPyro) and
    checks it against a concrete k."""
    params = case.params()
    k = params["k"]
    d = case.cls(**params, k_max=k + 1)
    x = _valid_value(case, d)
    torch.testing.assert_close(d.log_prob(x), case.cls(**params).log_prob(x))
    with pytest.raises(ValueError):
        case.cls(**params, k_max=k - 1)


@pytest.mark.parametrize("case", _params("test_out_of_support_validation_on"))
def test_out_of_support_validation_on(case):
    d = case.dist(validate_args=True)
    for bad in _invalid_values(case, d):
        with pytest.raises(ValueError):
            d.log_prob(bad)
    # A value inside the support passes, also batched by a sample dim.
    valid = _valid_value(case, d)
    assert torch.isfinite(d.log_prob(valid.expand((2,) + valid.shape))).all()


@pytest.mark.parametrize("case", _params("test_out_of_support_validation_off"))
def test_out_of_support_validation_off(case):
    d = case.dist(validate_args=False)
    valid = _valid_value(case, d)
    valid_log_prob = d.log_prob(valid)
    for bad in _invalid_values(case, d):
        log_prob = d.log_prob(bad)
        assert log_prob.shape == d.batch_shape
        assert (log_prob == -math.inf).all(), log_prob
        # Mixed: only the first of two sample rows is outside.
        mixed = torch.stack([bad, valid])
        log_prob = d.log_prob(mixed)
        assert (log_prob[0] == -math.inf).all()
        torch.testing.assert_close(log_prob[1], valid_log_prob)


# ------------------------------------------------------------------------------------------
# Numbers: gradients, moments, entropy, KL


@pytest.mark.parametrize("case", _params("test_log_prob_gradcheck"))
def test_log_prob_gradcheck(case):
    """log_prob's gradient in each smooth parameter against central finite differences,
    in float64 (torch's ``_gradcheck_log_prob``)."""
    params = {
        name: value.double()
        if isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for name, value in case.params().items()
    }
    d = case.cls(**params)
    # Built in float64: a float32 point is on the float64 subspace only to float32
    # precision, outside the support tolerance (a multiple of float64's eps).
    value = _valid_value(case, d, torch.float64).double()
    names = [name for name in SMOOTH_PARAMS[case.cls] if name in params]
    assert names

    def log_prob(*tensors):
        kwargs = dict(params)
        for name, tensor in zip(names, tensors, strict=True):
            if name == "covariance_matrix":
                tensor = 0.5 * (tensor + tensor.mT)
            elif name == "scale_tril":
                tensor = torch.tril(tensor)
            elif name == "probs":
                # Exact 0 and 1 are boundaries (a finite difference would step outside
                # [0, 1]): held there, while the interior probabilities are checked.
                edge = (params[name] == 0) | (params[name] == 1)
                tensor = torch.where(edge, params[name], tensor)
            kwargs[name] = tensor
        return case.cls(**kwargs, validate_args=False).log_prob(value)

    inputs = tuple(params[name].clone().requires_grad_() for name in names)
    assert torch.autograd.gradcheck(log_prob, inputs, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("case", _params("test_mean_variance_vs_samples"))
def test_mean_variance_vs_samples(case):
    """mean and variance against the sample mean and variance of exact samples, within
    SIGMAS standard errors (of the sample mean: std / sqrt(N); of the sample variance:
    std((x - mean)^2) / sqrt(N))."""
    d = case.dist()
    x = d.sample((NUM_MC_SAMPLES,)).double()
    _assert_mc_close(x, d.mean, "mean")
    centered_squares = (x - x.mean(0)).square()
    _assert_mc_close(centered_squares * NUM_MC_SAMPLES / (NUM_MC_SAMPLES - 1), d.variance, "var")


@pytest.mark.parametrize("case", _params("test_entropy_vs_samples"))
def test_entropy_vs_samples(case):
    d = case.dist()
    x = d.sample((NUM_MC_SAMPLES,))
    _assert_mc_close(-d.log_prob(x), d.entropy(), "entropy")


@pytest.mark.parametrize("case", _params("test_kl_vs_samples"))
def test_kl_vs_samples(case):
    """``torch.distributions.kl_divergence`` between two instances with the same support
    against ``E_p[log p(x) - log q(x)]``; and KL(p, p) = 0."""
    p, q = case.dist(seed=0), case.dist(seed=1)
    kl = kl_divergence(p, q)
    assert kl.shape == p.batch_shape
    assert (kl >= -1e-6).all()
    x = p.sample((NUM_MC_SAMPLES,))
    _assert_mc_close(p.log_prob(x) - q.log_prob(x), kl, "KL")
    torch.testing.assert_close(kl_divergence(p, p), torch.zeros_like(kl), atol=1e-5, rtol=0)
