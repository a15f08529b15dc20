"""A regression head that predicts a :class:`LinearConstrainedNormal` per example, as plain
functions of a parameter dict (``jax.numpy`` only: no neural-network framework needed).

The NumPyro counterpart of :class:`pyro_constrained.nn.LinearConstrainedNormalHead`, with
the same parameterisation, the same losses and the same default recipe; see that module's
docstring, summarised here. For outputs obeying linear balances ``A y + B x = b``, every
example shares ``A`` and has its own right-hand side ``k = b - B x``.

Usage::

    params, state = init_head(key, in_features, constraint)        # metric=w: your error
    loss = head_loss(params, state, features, k, target)          # differentiate in params
    state = calibrate_head(params, state, features_val, k_val, y_val)
    dist = head_distribution(params, state, features, k)           # predictions, intervals

``params`` is a dict of arrays (what an optimiser updates); ``state`` holds what is not
trained: the constraint, its copy in the metric coordinates ``A diag(1 / sqrt(metric))``
(factorised once, at init), ``output_loc``, ``output_scale``, ``sqrt(metric)``,
``min_scale`` and the calibration factor. Both are pytrees, so the functions work under
``jax.jit`` / ``jax.grad`` / ``jax.vmap``.

**Metric and prediction.** ``metric=w`` (``init_head``; default 1) is the squared error the
point prediction is judged by, ``sum_i w_i (y_hat_i - y_i)^2``. With
``prediction="projection"`` (the default of every function) the predictive distribution is
``N(P(loc), diag(s^2))`` conditioned on ``A y = k``, ``P`` the orthogonal projection onto
``{A y = k}`` in the metric: its mean ``P(loc)`` is, by Pythagoras, never further from a
target that satisfies the balances than the unconstrained ``loc`` (``||P(loc) - y||_W <=
||loc - y||_W``: ``P(loc) - y`` lies in the set's directions, ``loc - P(loc)`` is
``W``-orthogonal to them), and its covariance and likelihood come from the fitted scales
``s``. ``prediction="conditional"`` centres it at ``loc`` (mean: the
``Sigma^{-1}``-weighted projection, with no such bound).

**Which loss to use when**:

- ``"mse+nll"`` (default, recommended): ``||P(loc) - y||_W^2 - log p(y)`` with the centre
  held fixed in the log-likelihood: the mean branch trains exactly as the orthogonal
  projection layer (KKThPINN) in the metric, the scale by likelihood of that prediction's
  residuals. Then :func:`calibrate_head` on held-out data.
- ``"loc_mse+nll"``: ``||loc - y||_W^2 - log p(y)``: a plain regression of ``loc``,
  projected afterwards.
- ``"nll"``: ``-log p(y)``; weights each output's squared error by ``1 / s_i^2``, trading
  squared error on noisy outputs for likelihood on precise ones. For when the likelihood
  itself is the goal.
- ``"mse"``: the squared error of the mean alone; the scale is not trained.
- ``"expected_l2"`` / ``"expected_l1"``: ``E ||y_hat - y||_W^2`` or ``E ||y_hat - y||_1``
  for a predictive draw ``y_hat``; minimised by ``s -> 0``, so the scale rests on its floor
  and the intervals are not calibrated.

What the benchmark of ``benchmarks/surrogate.py`` shows, and where the head does not win,
is summarised in :mod:`pyro_constrained.nn` (the same recipe).

**Calibration**: :func:`calibrate_head` fits one factor ``t`` for all scales on held-out
data (the mean does not change): by default split conformal prediction on the squared
Mahalanobis distance ``M = ||(y - mean) / s||^2``, ``t^2 = M_(r) / chi2_{n-a}(coverage)``,
``M_(r)`` the ``ceil(coverage (N + 1))``-th smallest held-out distance, which makes the
predictive distribution's ``coverage`` region contain a new example with probability at
least ``coverage`` when the held-out and new examples are exchangeable (not under a
sequential split; the per-output intervals have no such guarantee); or, with
``method="likelihood"``, the maximum-likelihood factor ``t^2 = mean M / (n - a)``.
:mod:`pyro_constrained.nn` states the guarantee and what the benchmark measured.

**Scale**: ``s = min_scale + softplus(raw)`` in units of ``output_scale``, with ``raw`` one
learned vector (``"per_output"``, default: homoscedastic, one factorisation of
``A diag(s)`` for the whole batch) or from a small MLP of its own on the features with
their gradient stopped (``"per_example"``): the floor holds whatever the loss does. The
losses are computed in the metric coordinates ``sqrt(metric) y`` (constraint
``A diag(1 / sqrt(metric))``, same ``k``; scaling without centring keeps the relative
support tolerance invariant). ``output_loc`` / ``output_scale`` change only the
parameterisation of the mean layer and the scale.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from constrained_ppl.arguments import check_head_options
from constrained_ppl.conformal import check_calibration, chi2_quantile, conformal_rank
from numpyro_constrained.linear_constrained_normal import LinearConstrainedNormal
from numpyro_constrained.linear_constraint import LinearConstraint
from numpyro_constrained.losses import expected_l1_loss, expected_l2_loss
from numpyro_constrained.validation import is_concrete

LOSSES = ("mse+nll", "loc_mse+nll", "nll", "mse", "expected_l2", "expected_l1")
SCALES = ("per_example", "per_output")
PREDICTIONS = ("projection", "conditional")


def _inverse_softplus(value: float) -> float:
    return value + math.log(-math.expm1(-value))


def _init_linear(key: jax.Array, in_features: int, out_features: int, dtype) -> dict:
    """torch.nn.Linear's default initialisation: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)),
    weight stored (out, in) as in torch, so weights can be copied between the two."""
    bound = 1.0 / math.sqrt(in_features)
    key_w, key_b = jax.random.split(key)
    return {
        "weight": jax.random.uniform(key_w, (out_features, in_features), dtype, -bound, bound),
        "bias": jax.random.uniform(key_b, (out_features,), dtype, -bound, bound),
    }


def _linear(layer: dict, x: jax.Array) -> jax.Array:
    return x @ layer["weight"].T + layer["bias"]


def _init_params(key, in_features, n, scale, scale_hidden, raw_init, dtype) -> dict:
    """The head's initial parameters (see ``init_head``)."""
    key_mean, key_hidden = jax.random.split(key)
    params = {"mean": _init_linear(key_mean, in_features, n, dtype)}
    if scale == "per_example":
        # The output layer starts at zero weight and the initial scale's bias, so early
        # steps do not depend on the random features (as in the torch module).
        params["scale_hidden"] = _init_linear(key_hidden, in_features, scale_hidden, dtype)
        params["scale_out"] = {
            "weight": jnp.zeros((n, scale_hidden), dtype),
            "bias": jnp.full((n,), raw_init, dtype),
        }
    else:
        params["raw_scale"] = jnp.full((n,), raw_init, dtype)
    return params


def init_head(
    key: jax.Array,
    in_features: int,
    constraint: LinearConstraint,
    *,
    scale: str = "per_output",
    scale_hidden: int = 32,
    min_scale: float = 1e-2,
    init_scale: float = 1.0,
    output_loc: jax.Array | None = None,
    output_scale: jax.Array | None = None,
    metric: jax.Array | None = None,
    dtype=jnp.float32,
) -> tuple[dict, dict]:
    """Initial ``(params, state)`` of a head over ``constraint.n`` outputs.

    :param key: PRNG key.
    :param in_features: size of the features (the backbone's last layer).
    :param constraint: the :class:`~numpyro_constrained.LinearConstraint` ``A`` (a x n) shared by
        all examples; its ``rtol`` is the support tolerance for targets.
    :param scale: ``"per_output"`` (default: one learned vector) or ``"per_example"`` (a
        small MLP on the stopped-gradient features).
    :param scale_hidden: width of the scale MLP's hidden layer.
    :param min_scale: the floor of the scale, in units of ``output_scale``.
    :param init_scale: the scale at initialisation, in units of ``output_scale``.
    :param output_loc: (n,) offset of the outputs (default 0).
    :param output_scale: (n,) positive scale of the outputs (default 1): the mean layer
        predicts ``(loc - output_loc) / output_scale`` and the scale is in these units.
    :param metric: (n,) positive weights ``w`` of the squared error the point prediction
        is judged by, ``sum_i w_i (y_i - y_hat_i)^2`` in the outputs' own units (default 1:
        the plain squared error of the values passed in). The mean is trained and projected
        in this metric.
    :param dtype: dtype of the parameters.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import LinearConstraint
    >>> from numpyro_constrained.nn import init_head
    >>> constraint = LinearConstraint(jnp.array([[1.0, 1.0, 1.0]]))  # y1 + y2 + y3 = k
    >>> params, state = init_head(jax.random.PRNGKey(0), 4, constraint)
    >>> features = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    >>> k = jax.random.normal(jax.random.PRNGKey(2), (5, 1))
    >>> sorted(params), params["mean"]["weight"].shape  # weights stored (out, in) as in torch
    (['mean', 'raw_scale'], (3, 4))
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if not isinstance(constraint, LinearConstraint):
        raise ValueError(f"constraint must be a LinearConstraint, got {type(constraint).__name__}")
    n = constraint.n
    output_loc = jnp.zeros(n, dtype) if output_loc is None else jnp.asarray(output_loc, dtype)
    output_scale = jnp.ones(n, dtype) if output_scale is None else jnp.asarray(output_scale, dtype)
    metric = jnp.ones(n, dtype) if metric is None else jnp.asarray(metric, dtype)
    check_head_options(
        n,
        min_scale=min_scale,
        init_scale=init_scale,
        output_loc=np.asarray(output_loc),
        output_scale=np.asarray(output_scale),
        metric=np.asarray(metric),
    )

    raw_init = _inverse_softplus(init_scale - min_scale)
    params = _init_params(key, in_features, n, scale, scale_hidden, raw_init, dtype)
    # The losses and the projection live in the metric coordinates z = sqrt(w) y, where the
    # user's squared error is the Euclidean one; their constraint is A diag(1 / sqrt(w)).
    metric_root = jnp.sqrt(metric)
    metric_constraint = (
        constraint
        if bool((metric == 1).all())
        else LinearConstraint(constraint.A / metric_root, rtol=constraint._rtol)
    )
    state = {
        "constraint": constraint,
        "metric_constraint": metric_constraint,
        "output_loc": output_loc,
        "output_scale": output_scale,
        "metric_root": metric_root,
        "min_scale": jnp.asarray(min_scale, dtype),
        "scale_factor": jnp.ones((), dtype),
    }
    return params, state


def head_parameters(params: dict, state: dict, features: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(loc, scale)`` in the scaled coordinates ``y / output_scale``:
    ``loc = output_loc / output_scale + W f + c``, ``scale = min_scale + softplus(raw)``
    (``raw`` is (n,) for a per-output scale: one factorisation serves the whole batch).

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import LinearConstraint
    >>> from numpyro_constrained.nn import head_parameters, init_head
    >>> constraint = LinearConstraint(jnp.array([[1.0, 1.0, 1.0]]))  # y1 + y2 + y3 = k
    >>> params, state = init_head(jax.random.PRNGKey(0), 4, constraint)
    >>> features = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    >>> k = jax.random.normal(jax.random.PRNGKey(2), (5, 1))
    >>> loc, scale = head_parameters(params, state, features)
    >>> loc.shape, scale.shape  # a per-output scale: one vector for the batch
    ((5, 3), (3,))
    >>> bool((scale > state["min_scale"]).all())
    True
    """
    loc = _linear(params["mean"], features) + state["output_loc"] / state["output_scale"]
    if "raw_scale" in params:
        raw = params["raw_scale"]
    else:
        hidden = jnp.tanh(_linear(params["scale_hidden"], jax.lax.stop_gradient(features)))
        raw = _linear(params["scale_out"], hidden)
    return loc, state["min_scale"] + jax.nn.softplus(raw)


def _metric_parameters(params: dict, state: dict, features: jax.Array, k, prediction: str):
    """``(centre, loc, scale)`` in the metric coordinates ``z = sqrt(w) y``: the unprojected
    ``loc``, the centre of the predictive distribution (``loc`` projected orthogonally onto
    ``{A y = k}`` in the metric for ``prediction="projection"``, ``loc`` itself for
    ``"conditional"``) and the scale."""
    if prediction not in PREDICTIONS:
        raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
    loc, scale = head_parameters(params, state, features)
    to_metric = state["output_scale"] * state["metric_root"]
    loc, scale = loc * to_metric, scale * to_metric
    centre = state["metric_constraint"].project(loc, k) if prediction == "projection" else loc
    return centre, loc, scale


def head_distribution(
    params: dict,
    state: dict,
    features: jax.Array,
    k: jax.Array,
    *,
    prediction: str = "projection",
    validate_args: bool | None = None,
) -> LinearConstrainedNormal:
    """The predictive distribution of the outputs in their own units: batch shape
    ``features.shape[:-1]`` broadcast with ``k.shape[:-1]``, event shape (n,); its scale
    includes the calibration factor ``state["scale_factor"]``. With
    ``prediction="projection"`` (default) its mean is the metric-orthogonal projection of
    the unconstrained ``loc`` onto ``{A y = k}`` (never further from a target that
    satisfies the balances than ``loc``, in the metric); ``"conditional"``: the
    ``Sigma^{-1}``-weighted projection (the conditional mean of ``N(loc, diag(s^2))``).

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import LinearConstraint
    >>> from numpyro_constrained.nn import head_distribution, init_head
    >>> constraint = LinearConstraint(jnp.array([[1.0, 1.0, 1.0]]))  # y1 + y2 + y3 = k
    >>> params, state = init_head(jax.random.PRNGKey(0), 4, constraint)
    >>> features = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    >>> k = jax.random.normal(jax.random.PRNGKey(2), (5, 1))
    >>> prediction = head_distribution(params, state, features, k)
    >>> prediction.batch_shape, prediction.event_shape
    ((5,), (3,))
    >>> bool(jnp.allclose(prediction.mean.sum(-1), k[:, 0], atol=1e-5))
    True
    """
    centre, _, scale = _metric_parameters(params, state, features, k, prediction)
    metric_root = state["metric_root"]
    return state["constraint"].normal(
        centre / metric_root,
        scale * (state["scale_factor"] / metric_root),
        k=k,
        validate_args=validate_args,
    )


def calibrate_head(
    params: dict,
    state: dict,
    features: jax.Array,
    k: jax.Array,
    target: jax.Array,
    *,
    prediction: str = "projection",
    method: str = "conformal",
    coverage: float = 0.9,
) -> dict:
    """A copy of ``state`` whose ``scale_factor`` ``t`` is fitted on held-out examples
    (the mean does not change), from their squared Mahalanobis distances on the
    ``(n - a)``-dimensional subspace, ``M = ||(y - mean) / s||^2``:

    - ``method="conformal"`` (default): split conformal prediction on ``M``,
      ``t^2 = M_(r) / chi2_{n-a}(coverage)`` with ``M_(r)`` the ``r = ceil((N + 1)
      coverage)``-th smallest of the ``N`` distances. The predictive distribution's
      ``coverage`` highest-density region (an ellipsoid on the subspace) then contains a
      new example with probability at least ``coverage`` when the held-out and new
      examples are exchangeable (a random split), whatever the residuals' distribution.
      The central per-output intervals get no such guarantee (they are wider than needed
      where the residuals are heavier-tailed than Gaussian), and a sequential split, where
      the new examples extrapolate, breaks exchangeability: nothing calibrated on earlier
      rows guarantees coverage there. ``ValueError`` for fewer than
      ``coverage / (1 - coverage)`` examples.
    - ``"likelihood"``: the maximum-likelihood factor: for ``Sigma -> t^2 Sigma`` the
      log-density changes as ``-(n - a) log t - M / (2 t^2)``, so
      ``t^2 = sum M / (N (n - a))`` (``coverage`` unused).

    Pass the ``prediction`` that :func:`head_distribution` will be called with. Where the
    held-out rows are in time order and new rows extrapolate in time, calibrating on the
    most recent of them only is an option (``benchmarks/README.md``, surrogate benchmark).

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import LinearConstraint
    >>> from numpyro_constrained.nn import calibrate_head, head_distribution, init_head
    >>> constraint = LinearConstraint(jnp.array([[1.0, 1.0, 1.0]]))  # y1 + y2 + y3 = k
    >>> params, state = init_head(jax.random.PRNGKey(0), 4, constraint)
    >>> features = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    >>> k = jax.random.normal(jax.random.PRNGKey(2), (5, 1))
    >>> target = constraint.project(jax.random.normal(jax.random.PRNGKey(3), (5, 3)), k)
    >>> calibrated = calibrate_head(params, state, features, k, target, method="likelihood")
    >>> d = head_distribution(params, calibrated, features, k)
    >>> m = (((target - d.mean) / d.scale) ** 2).sum(-1).mean()  # n - a = 2 on average now
    >>> round(float(m), 3)
    2.0
    """
    check_calibration(method, coverage)
    state = dict(state, scale_factor=jnp.ones_like(state["scale_factor"]))
    dist = head_distribution(params, state, features, k, prediction=prediction)
    mahalanobis = jnp.sum(jnp.square((target - dist.mean) / dist.scale), -1)
    mahalanobis = jnp.broadcast_to(mahalanobis, dist.batch_shape).reshape(-1)
    constraint = state["constraint"]
    free = constraint.n - constraint.a
    if method == "conformal":
        rank = conformal_rank(mahalanobis.shape[0], coverage)
        squared = jnp.sort(mahalanobis)[rank - 1] / chi2_quantile(coverage, free)
    else:
        squared = jnp.mean(mahalanobis) / free
    factor = jnp.sqrt(squared)
    # As the torch head's calibrate, where the factor is concrete (under jit it is a tracer).
    if is_concrete(factor) and not (np.isfinite(factor) and factor > 0):
        raise ValueError(f"calibrate_head: the held-out data give a scale factor of {factor}")
    return dict(state, scale_factor=factor.astype(state["scale_factor"].dtype))


def head_loss(
    params: dict,
    state: dict,
    features: jax.Array,
    k: jax.Array,
    target: jax.Array,
    *,
    loss: str = "mse+nll",
    prediction: str = "projection",
    validate_args: bool | None = None,
) -> jax.Array:
    """The training loss, averaged over the batch (summed over the n outputs), in the
    metric coordinates ``sqrt(metric) y`` (module docstring: which loss when), for the
    predictive distribution that :func:`head_distribution` gives with the same
    ``prediction``.

    ``"nll"`` is ``-log p(sqrt(metric) y)``: it differs from the NLL in the outputs' own
    units by a constant (the log-determinant of the scaling on the subspace).

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> from numpyro_constrained import LinearConstraint
    >>> from numpyro_constrained.nn import head_loss, init_head
    >>> constraint = LinearConstraint(jnp.array([[1.0, 1.0, 1.0]]))  # y1 + y2 + y3 = k
    >>> params, state = init_head(jax.random.PRNGKey(0), 4, constraint)
    >>> features = jax.random.normal(jax.random.PRNGKey(1), (5, 4))
    >>> k = jax.random.normal(jax.random.PRNGKey(2), (5, 1))
    >>> target = constraint.project(jax.random.normal(jax.random.PRNGKey(3), (5, 3)), k)
    >>> loss, grads = jax.value_and_grad(head_loss)(params, state, features, k, target)
    >>> loss.shape, grads["mean"]["weight"].shape
    ((), (3, 4))
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    target = target * state["metric_root"]
    centre, loc, scale = _metric_parameters(params, state, features, k, prediction)
    constraint = state["metric_constraint"]

    def normal(loc, scale):
        return constraint.normal(loc, scale, k=k, validate_args=validate_args)

    if loss in ("mse+nll", "loc_mse+nll"):
        # The mean branch sees only squared error, the scale only likelihood (given the
        # centre): the scale is fitted to the residuals of the prediction it will serve.
        nll = -normal(jax.lax.stop_gradient(centre), scale).log_prob(target)
        if loss == "loc_mse+nll":
            fitted = loc
        elif prediction == "projection":
            fitted = centre
        else:
            fitted = normal(centre, jax.lax.stop_gradient(scale)).mean
        per_example = jnp.sum(jnp.square(fitted - target), -1) + nll
    else:
        dist = normal(centre, scale)
        if loss == "nll":
            per_example = -dist.log_prob(target)
        elif loss == "expected_l2":
            per_example = expected_l2_loss(dist, target)
        elif loss == "expected_l1":
            per_example = expected_l1_loss(dist, target)
        else:
            per_example = jnp.sum(jnp.square(dist.mean - target), -1)
    return jnp.mean(per_example)
