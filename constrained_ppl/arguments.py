"""Framework-free checks of the arguments every class shares: integer counts ``k`` and the
shapes of values given to ``log_prob``.

One rule for counts in both packages (``ExactlyKBernoulli.k``, ``ConditionedPoisson.k``,
and their ``k_max``), the rule of ``torch.distributions.Binomial.total_count`` and
NumPyro's ``Binomial``: a Python int, an integer array, or a floating value (Python float
or array) whose entries are whole numbers. ``3.0`` is the count 3; ``3.5``, a bool, a
complex number or NaN is a ``ValueError`` whatever ``validate_args`` says, because no
count is meant. The range ``0 <= k <= bound`` is the distributions' own validation.
"""

from __future__ import annotations

import functools
import inspect
import math
from numbers import Integral, Real

import numpy as np

__all__ = [
    "DISCRETE_GRAD_ESTIMATORS",
    "LCN_GRAD_ESTIMATORS",
    "check_count",
    "check_grad_estimator",
    "check_head_options",
    "check_static_bound",
    "check_value_shape",
    "keyword_only",
]


def _dtype_kind(k) -> str | None:
    dtype = getattr(k, "dtype", None)
    if dtype is None:
        return None
    # torch dtypes print as "torch.float32"; bfloat16 is not a NumPy dtype.
    dtype_name = str(dtype).rsplit(".", 1)[-1]
    return "f" if dtype_name == "bfloat16" else np.dtype(dtype_name).kind


def check_count(k, *, concrete: bool, name: str = "k") -> None:
    """``ValueError`` unless ``k`` is a count: an int, an integer array, or a floating value
    with whole-number entries (checked only where ``concrete``; a traced ``k`` is checked
    for its dtype alone)."""
    if isinstance(k, bool | np.bool_):
        raise ValueError(f"{name} must be a non-negative integer, got the boolean {k!r}")
    if isinstance(k, Integral):
        return
    if isinstance(k, list | tuple):
        k = np.asarray(k)
    if isinstance(k, Real) and not hasattr(k, "dtype"):
        if not float(k).is_integer():
            raise ValueError(f"{name} must be a whole number, got {k!r}")
        return
    kind = _dtype_kind(k)
    if kind is None:
        raise ValueError(f"{name} must be an int or an integer array, got {type(k).__name__}")
    if kind == "b":
        raise ValueError(f"{name} must be an integer array, got a boolean array")
    if kind not in "iuf":
        raise ValueError(f"{name} must be an integer array, got dtype {k.dtype}")
    if kind == "f" and concrete:
        if hasattr(k, "detach"):  # a torch tensor, possibly on a GPU or requiring grad
            k = k.detach().cpu()
        values = np.asarray(k, dtype=np.float64)
        whole = np.isfinite(values) & (values == np.floor(values))
        if not np.all(whole):
            bad = np.unique(values[~whole])[:5].tolist()
            raise ValueError(f"{name} must hold whole numbers, got {bad}")


#: The gradient estimators of the discrete distributions (``ExactlyKBernoulli``,
#: ``ConditionedPoisson``) in both packages: ``"marginal_expectation"`` (the default), the
#: straight-through estimator through the conditional mean (biased, low variance), and
#: ``"score_function"``, no reparameterised sampler, so that the frameworks' ELBOs apply
#: the score-function (REINFORCE) estimator (unbiased). See
#: docs/distributions/choosing_gradient_estimator.md.
DISCRETE_GRAD_ESTIMATORS = ("marginal_expectation", "score_function")

#: The gradient estimators of ``LinearConstrainedNormal.rsample`` in both packages:
#: ``"marginal_expectation"`` (the default), straight-through through the conditional mean
#: (biased in the scales, low variance), and ``"pathwise"``, Matheron's rule differentiated
#: (exact reparameterisation, unbiased). See docs/distributions/linear_constrained_normal.md.
LCN_GRAD_ESTIMATORS = ("marginal_expectation", "pathwise")


def check_grad_estimator(grad_estimator, options: tuple[str, ...]) -> str:
    """``grad_estimator`` itself if it is one of ``options``, else a ``ValueError`` naming
    them."""
    if not isinstance(grad_estimator, str) or grad_estimator not in options:
        raise ValueError(f"grad_estimator must be one of {options}, got {grad_estimator!r}")
    return grad_estimator


def check_static_bound(k_max, *, name: str = "k_max") -> int | None:
    """``k_max`` as a Python int (or None): a static bound, so a Python or NumPy integer
    (or a whole-number float), never an array that could be traced."""
    if k_max is None:
        return None
    if isinstance(k_max, bool | np.bool_) or not isinstance(k_max, Integral | float):
        raise ValueError(f"{name} must be a Python int, got {k_max!r}")
    if isinstance(k_max, float) and not k_max.is_integer():
        raise ValueError(f"{name} must be a whole number, got {k_max!r}")
    if k_max < 0:
        raise ValueError(f"{name} must be non-negative, got {k_max!r}")
    return int(k_max)


def check_value_shape(
    value_shape: tuple[int, ...],
    batch_shape: tuple[int, ...],
    event_shape: tuple[int, ...],
    distribution: str,
) -> None:
    """``ValueError`` naming the expected shape unless ``value_shape`` ends in
    ``event_shape`` and its leading dimensions broadcast with ``batch_shape`` (what
    ``log_prob`` of ``sample_shape + batch_shape + event_shape`` values accepts)."""
    value_shape, batch_shape, event_shape = map(tuple, (value_shape, batch_shape, event_shape))
    expected = f"(..., {', '.join(map(str, batch_shape + event_shape))})"
    n_event = len(event_shape)
    if len(value_shape) < n_event or value_shape[len(value_shape) - n_event :] != event_shape:
        raise ValueError(
            f"{distribution}: a value of shape {value_shape} does not end in the event shape "
            f"{event_shape}; expected a shape broadcasting with {expected}"
        )
    try:
        np.broadcast_shapes(value_shape[: len(value_shape) - n_event], batch_shape)
    except ValueError:
        raise ValueError(
            f"{distribution}: a value of shape {value_shape} does not broadcast with the batch "
            f"shape {batch_shape}; expected a shape broadcasting with {expected}"
        ) from None


def check_head_options(
    n: int, *, min_scale: float, init_scale: float, output_loc, output_scale, metric=None
) -> None:
    """The regression head's scale floor, output standardisation and metric, the same in
    both packages (``pyro_constrained.nn``, ``numpyro_constrained.nn``): ``min_scale``
    positive and finite, ``init_scale`` above it, ``output_loc``, ``output_scale`` and
    ``metric`` finite of shape ``(n,)`` (NumPy arrays, concrete), ``output_scale`` and
    ``metric`` positive."""
    if not (min_scale > 0 and math.isfinite(min_scale)):
        raise ValueError(f"min_scale must be positive and finite, got {min_scale}")
    if not init_scale > min_scale:
        raise ValueError(f"init_scale ({init_scale}) must exceed min_scale ({min_scale})")
    arrays = [("output_loc", output_loc), ("output_scale", output_scale)]
    if metric is not None:
        arrays.append(("metric", metric))
    for name, value in arrays:
        if value.shape != (n,):
            raise ValueError(f"{name} must have shape ({n},), got {tuple(value.shape)}")
        if not np.isfinite(value).all():
            raise ValueError(f"{name} must be finite")
    if not (output_scale > 0).all():
        raise ValueError("output_scale must be positive")
    if metric is not None and not (metric > 0).all():
        raise ValueError("metric must be positive (one weight per output)")


def keyword_only(*names: str, usage: str):
    """Decorate a class's ``__init__`` whose ``names`` (``k``, ``A``) are keyword-only, so
    that a call giving them by position gets a ``TypeError`` that says to write ``k=``.

    Without it Python's own message names no keyword: ``ConditionedPoisson(rate, 5)``
    "takes 2 positional arguments but 3 were given", and ``ExactlyKBernoulli(logits, 3)``,
    which puts 3 in ``probs``, is "missing 1 required keyword-only argument". The check
    runs before ``__init__`` and costs a length test; calls that Python accepts are passed
    on unchanged, and ``inspect.signature`` (hence the documentation) still shows the
    original signature.
    """

    def decorate(init):
        parameters = list(inspect.signature(init).parameters.values())[1:]  # after self
        positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
        required = [p.name for p in parameters if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
        keywords = " and ".join(f"{name}=" for name in names)

        @functools.wraps(init)
        def checked_init(self, *args, **kwargs):
            missing = [name for name in required if name not in kwargs]
            if len(args) > len(positional) or missing:
                given = f"{len(args)} positional argument{'s' if len(args) != 1 else ''}"
                if missing:
                    given += " and no " + " or ".join(f"{name}=" for name in missing)
                raise TypeError(
                    f"{type(self).__name__}() takes {keywords} only by keyword: write {usage} "
                    f"(its positional arguments are {', '.join(positional)}; got {given})"
                )
            return init(self, *args, **kwargs)

        return checked_init

    return decorate
