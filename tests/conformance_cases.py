"""Parameter settings of the three classes for the ported generic distribution batteries.

Framework-free on purpose: every setting is a dict of NumPy arrays (and Python ints), so that
the NumPyro battery (``tests/test_conformance_numpyro.py``) and a Pyro / torch battery can
share them and convert them to their own arrays. Classes are named by string
(``"ExactlyKBernoulli"``, ``"LinearConstrainedNormal"``, ``"ConditionedPoisson"``) and each
battery maps the name to its package's class.

Each :class:`Case` states its expected ``batch_shape`` and ``event_shape`` by hand (from the
documented shape rules, not from the library), so that shape tests have an independent
expectation. Parameters are built from a fixed seed at import time; ``Case.params()`` returns
fresh copies, so a test cannot change what another test sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "ALL_CASES",
    "BAD_PARAMETERS",
    "CP_CASES",
    "EKB_CASES",
    "LCN_CASES",
    "BadParameters",
    "Case",
    "CCB_CASES",
    "EXPECTED_ARG_EVENT_DIM",
    "PB_CASES",
]

EKB = "ExactlyKBernoulli"
LCN = "LinearConstrainedNormal"
CP = "ConditionedPoisson"
PB = "PoissonBinomial"
CCB = "CountConstrainedBernoulli"

# Decision 1 of issue 15: the event_dim of every parameter constraint.
EXPECTED_ARG_EVENT_DIM = {
    EKB: {"logits": 1, "probs": 1, "k": 0},
    CP: {"rate": 1, "k": 0},
    PB: {"logits": 1, "probs": 1},
    CCB: {"logits": 1, "probs": 1, "low": 0, "high": 0},
    LCN: {
        "loc": 1,
        "scale": 1,
        "covariance_matrix": 2,
        "scale_tril": 2,
        "A": 2,
        "k": 1,
    },
}


@dataclass(frozen=True)
class Case:
    """One parameter setting: ``cls`` (class name), ``id`` (test id), the constructor
    arguments, and the shapes the documented rules give for them."""

    cls: str
    id: str
    kwargs: dict = field(repr=False)
    batch_shape: tuple[int, ...]
    event_shape: tuple[int, ...]
    dtype: str = "float32"

    def params(self) -> dict:
        """Fresh copies of the constructor arguments (NumPy arrays and Python ints)."""
        return {
            name: value.copy() if isinstance(value, np.ndarray) else value
            for name, value in self.kwargs.items()
        }

    @property
    def n(self) -> int:
        """The event size, or for ``PoissonBinomial`` (event shape ``()``) the number of
        Bernoullis whose ones it counts."""
        if self.event_shape:
            return self.event_shape[-1]
        return np.shape(self.kwargs.get("logits", self.kwargs.get("probs")))[-1]

    @property
    def is_discrete(self) -> bool:
        return self.cls != LCN

    def array_names(self) -> list[str]:
        """Names of the arguments that are arrays or numbers (all of them here)."""
        return list(self.kwargs)

    def __str__(self) -> str:
        return self.id


_rng = np.random.default_rng(20261125)


def _f(shape, dtype="float32", low=None, high=None):
    if low is None:
        return _rng.normal(size=shape).astype(dtype)
    return _rng.uniform(low, high, size=shape).astype(dtype)


def _spd(n, dtype="float32"):
    m = _rng.normal(size=(n, n))
    return (m @ m.T / n + 0.5 * np.eye(n)).astype(dtype)


def _tril(n, dtype="float32"):
    return np.linalg.cholesky(_spd(n, "float64")).astype(dtype)


EKB_CASES = [
    # k = 1 < n / 2: a concrete k's power-of-two table bound (2) differs from n (4).
    Case(EKB, "ekb-unbatched", {"logits": _f((4,)), "k": 1}, (), (4,)),
    # k = 0 and k = n inside one batch, beside an interior k.
    Case(
        EKB,
        "ekb-per-batch-k",
        {"logits": _f((3, 4)), "k": np.array([0, 2, 4])},
        (3,),
        (4,),
    ),
    Case(
        EKB,
        "ekb-k-broadcast",
        {"logits": _f((3, 4)), "k": np.array([[1], [3]])},
        (2, 3),
        (4,),
    ),
    Case(EKB, "ekb-k0", {"logits": _f((4,)), "k": 0}, (), (4,)),
    Case(EKB, "ekb-kn", {"logits": _f((4,)), "k": 4}, (), (4,)),
    Case(EKB, "ekb-probs", {"probs": _f((3, 4), low=0.1, high=0.9), "k": 1}, (3,), (4,)),
    Case(
        EKB,
        "ekb-float64",
        {"logits": _f((3, 4), "float64"), "k": np.array([1, 2, 3])},
        (3,),
        (4,),
        "float64",
    ),
]

CP_CASES = [
    Case(CP, "cp-unbatched", {"rate": _f((4,), low=0.5, high=2.0), "k": 3}, (), (4,)),
    Case(
        CP,
        "cp-per-batch-k",
        {"rate": _f((3, 4), low=0.5, high=2.0), "k": np.array([0, 2, 6])},
        (3,),
        (4,),
    ),
    Case(
        CP,
        "cp-k-broadcast",
        {"rate": _f((3, 4), low=0.5, high=2.0), "k": np.array([[1], [4]])},
        (2, 3),
        (4,),
    ),
    Case(CP, "cp-k0", {"rate": _f((4,), low=0.5, high=2.0), "k": 0}, (), (4,)),
    # (k = n is no boundary for CP: k may exceed n.)
    Case(
        CP,
        "cp-float64",
        {"rate": _f((2, 4), "float64", low=0.5, high=2.0), "k": np.array([3, 4])},
        (2,),
        (4,),
        "float64",
    ),
]

_A2 = np.array([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 0.5, 0.0, 2.0]], dtype="float32")
_A2_4 = np.array([[1.0, 1.0, 1.0, 1.0], [0.5, -1.0, 0.0, 2.0]], dtype="float32")

LCN_CASES = [
    Case(
        LCN,
        "lcn-diag",
        {"loc": _f((4,)), "scale": _f((4,), low=0.5, high=1.5)},
        (),
        (4,),
    ),
    Case(LCN, "lcn-cov", {"loc": _f((4,)), "covariance_matrix": _spd(4)}, (), (4,)),
    Case(LCN, "lcn-tril", {"loc": _f((2, 4)), "scale_tril": _tril(4)}, (2,), (4,)),
    Case(
        LCN,
        "lcn-A",
        {
            "loc": _f((5,)),
            "scale": _f((5,), low=0.5, high=1.5),
            "A": _A2.copy(),
            "k": np.array([1.0, -0.5], dtype="float32"),
        },
        (),
        (5,),
    ),
    Case(
        LCN,
        "lcn-batched-k",
        {
            "loc": _f((4,)),
            "scale": _f((4,), low=0.5, high=1.5),
            "A": _A2_4.copy(),
            "k": _f((3, 2)),
        },
        (3,),
        (4,),
    ),
    Case(
        LCN,
        "lcn-batched-A-cov",
        {
            "loc": _f((4,)),
            "covariance_matrix": _spd(4),
            "A": np.stack([_A2_4[:1], _A2_4[1:]]),
            "k": np.array([[0.5], [-1.0]], dtype="float32"),
        },
        (2,),
        (4,),
    ),
    Case(
        LCN,
        "lcn-float64",
        {
            "loc": _f((2, 4), "float64"),
            "scale_tril": _tril(4, "float64"),
            "A": _A2_4.astype("float64"),
            "k": np.array([0.5, 1.0]),
        },
        (2,),
        (4,),
        "float64",
    ),
]


def _masked(logits, on=(), off=()):
    """``logits`` with ``+inf`` (forced on) at the (row, column) pairs ``on`` and ``-inf``
    (forced off) at ``off``."""
    for index in on:
        logits[index] = np.inf
    for index in off:
        logits[index] = -np.inf
    return logits


def _edge_probs(shape, zeros, ones, dtype="float32"):
    """Probabilities in [0.1, 0.9] with exact 0 at the pairs ``zeros``, exact 1 at ``ones``."""
    probs = _f(shape, dtype, low=0.1, high=0.9)
    for index in zeros:
        probs[index] = 0.0
    for index in ones:
        probs[index] = 1.0
    return probs


# PoissonBinomial: event shape () (a count), batch shape logits.shape[:-1].
PB_CASES = [
    Case(PB, "pb-unbatched", {"logits": _f((5,))}, (), ()),
    # Rows without masks, with one forced on and one forced off, with one forced off.
    Case(
        PB,
        "pb-batched-masked",
        {"logits": _masked(_f((3, 5)), on=[(1, 0)], off=[(1, 3), (2, 1)])},
        (3,),
        (),
    ),
    # Exact probabilities 0 and 1 (masks given as probs).
    Case(PB, "pb-probs", {"probs": _edge_probs((2, 4), [(0, 0)], [(1, 2)])}, (2,), ()),
    Case(PB, "pb-float64", {"logits": _f((2, 1, 5), "float64")}, (2, 1), (), "float64"),
]

# CountConstrainedBernoulli: at most (high), at least (low), per-batch and broadcast bounds,
# masks narrowing the range, probs with exact 0 and 1, float64.
CCB_CASES = [
    Case(CCB, "ccb-at-most", {"logits": _f((5,)), "high": 2}, (), (5,)),
    Case(CCB, "ccb-at-least", {"logits": _f((2, 5)), "low": 3}, (2,), (5,)),
    Case(
        CCB,
        "ccb-per-batch-masked",
        {
            "logits": _masked(_f((3, 5)), on=[(1, 0)], off=[(1, 3), (2, 1)]),
            "low": np.array([0, 1, 2]),
            "high": np.array([2, 3, 5]),
        },
        (3,),
        (5,),
    ),
    Case(
        CCB,
        "ccb-bounds-broadcast",
        {"logits": _f((3, 4)), "low": np.array([[0], [2]]), "high": 3},
        (2, 3),
        (4,),
    ),
    Case(
        CCB,
        "ccb-probs",
        {"probs": _edge_probs((2, 4), [(0, 0)], [(1, 2)]), "low": 1, "high": 2},
        (2,),
        (4,),
    ),
    Case(
        CCB,
        "ccb-float64",
        {"logits": _f((2, 5), "float64"), "low": np.array([1, 0]), "high": np.array([4, 2])},
        (2,),
        (5,),
        "float64",
    ),
]

ALL_CASES = EKB_CASES + LCN_CASES + CP_CASES + PB_CASES + CCB_CASES


@dataclass(frozen=True)
class BadParameters:
    """Arguments that must be rejected with ``ValueError``: ``always`` whatever
    ``validate_args`` is (types, shapes), else only with validation on."""

    cls: str
    id: str
    kwargs: dict = field(repr=False)
    always: bool = False

    def params(self) -> dict:
        return {
            name: value.copy() if isinstance(value, np.ndarray) else value
            for name, value in self.kwargs.items()
        }

    def __str__(self) -> str:
        return self.id


_L4 = np.array([0.3, -0.2, 1.0, 0.1], dtype="float32")
_R4 = np.array([0.5, 1.0, 2.0, 1.5], dtype="float32")
_S4 = np.array([1.0, 0.5, 2.0, 1.0], dtype="float32")
_NOT_PD = np.array(
    [[1.0, 2.0, 0, 0], [2.0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]], dtype="float32"
)

BAD_PARAMETERS = [
    BadParameters(EKB, "ekb-k-negative", {"logits": _L4, "k": -1}),
    BadParameters(EKB, "ekb-k-above-n", {"logits": _L4, "k": 5}),
    BadParameters(
        EKB, "ekb-k-array-above-n", {"logits": np.stack([_L4, _L4]), "k": np.array([1, 5])}
    ),
    BadParameters(
        EKB, "ekb-probs-above-1", {"probs": np.array([0.2, 1.5, 0.3, 0.4], "float32"), "k": 2}
    ),
    BadParameters(
        EKB, "ekb-logits-nan", {"logits": np.array([0.2, np.nan, 0.3, 0.4], "float32"), "k": 2}
    ),
    BadParameters(EKB, "ekb-k-not-whole", {"logits": _L4, "k": 2.5}, always=True),
    BadParameters(EKB, "ekb-k-bool", {"logits": _L4, "k": True}, always=True),
    BadParameters(
        EKB, "ekb-k-shape", {"logits": np.stack([_L4] * 3), "k": np.array([1, 2])}, always=True
    ),
    BadParameters(CP, "cp-rate-negative", {"rate": -_R4, "k": 2}),
    BadParameters(CP, "cp-rate-zero", {"rate": np.array([0.0, 1.0, 1.0, 1.0], "float32"), "k": 2}),
    BadParameters(
        CP, "cp-rate-inf", {"rate": np.array([np.inf, 1.0, 1.0, 1.0], "float32"), "k": 2}
    ),
    BadParameters(CP, "cp-k-negative", {"rate": _R4, "k": -1}),
    BadParameters(CP, "cp-k-not-whole", {"rate": _R4, "k": 2.5}, always=True),
    BadParameters(CP, "cp-k-bool", {"rate": _R4, "k": True}, always=True),
    BadParameters(
        CP, "cp-k-shape", {"rate": np.stack([_R4] * 3), "k": np.array([1, 2])}, always=True
    ),
    BadParameters(PB, "pb-probs-above-1", {"probs": np.array([0.2, 1.5, 0.3], "float32")}),
    BadParameters(PB, "pb-logits-nan", {"logits": np.array([0.2, np.nan, 0.3], "float32")}),
    BadParameters(PB, "pb-logits-scalar", {"logits": np.float32(0.3)}, always=True),
    BadParameters(CCB, "ccb-low-above-high", {"logits": _L4, "low": 3, "high": 2}),
    BadParameters(CCB, "ccb-high-above-n", {"logits": _L4, "high": 5}),
    BadParameters(CCB, "ccb-low-negative", {"logits": _L4, "low": -1}),
    BadParameters(
        CCB,
        "ccb-per-batch-low-above-high",
        {"logits": np.stack([_L4, _L4]), "low": np.array([1, 3]), "high": np.array([2, 2])},
    ),
    # Two variables forced on leave no count in 0..1.
    BadParameters(
        CCB,
        "ccb-masks-infeasible",
        {"logits": np.array([np.inf, np.inf, 0.0, 0.0], "float32"), "high": 1},
    ),
    BadParameters(
        CCB, "ccb-probs-nan", {"probs": np.array([0.2, np.nan, 0.3, 0.4], "float32"), "high": 2}
    ),
    BadParameters(CCB, "ccb-low-not-whole", {"logits": _L4, "low": 1.5}, always=True),
    BadParameters(CCB, "ccb-high-bool", {"logits": _L4, "high": True}, always=True),
    BadParameters(
        CCB,
        "ccb-bounds-shape",
        {"logits": np.stack([_L4] * 3), "low": np.array([1, 2])},
        always=True,
    ),
    BadParameters(LCN, "lcn-scale-negative", {"loc": _L4, "scale": -_S4}),
    BadParameters(
        LCN, "lcn-scale-zero", {"loc": _L4, "scale": np.array([1.0, 0.0, 1.0, 1.0], "float32")}
    ),
    BadParameters(
        LCN, "lcn-loc-nan", {"loc": np.array([0.0, np.nan, 0.0, 0.0], "float32"), "scale": _S4}
    ),
    BadParameters(LCN, "lcn-cov-not-pd", {"loc": _L4, "covariance_matrix": _NOT_PD}),
    BadParameters(
        LCN,
        "lcn-A-rank-deficient",
        {"loc": _L4, "scale": _S4, "A": np.stack([np.ones(4), 2 * np.ones(4)]).astype("float32")},
    ),
    BadParameters(
        LCN,
        "lcn-A-too-many-rows",
        {"loc": _L4, "scale": _S4, "A": np.eye(4, dtype="float32")},
        always=True,
    ),
    BadParameters(
        LCN, "lcn-k-shape", {"loc": _L4, "scale": _S4, "k": np.zeros(3, "float32")}, always=True
    ),
]
