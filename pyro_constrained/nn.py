"""A regression head that predicts a :class:`LinearConstrainedNormal` per example.

For surrogate models whose outputs obey known linear balances ``A y + B x = b`` (mass,
atom or charge balances): every example shares ``A`` and has its own right-hand side
``k = b - B x``. :class:`LinearConstrainedNormalHead` maps a backbone's features and ``k``
to a ``LinearConstrainedNormal`` over ``{A y = k}``, whose mean and samples satisfy
``A y = k`` exactly, and whose marginals give predictive intervals.

**The metric.** A point prediction is judged by a squared error, ``||y_hat - y||_W^2 =
sum_i w_i (y_hat_i - y_i)^2``; ``metric=w`` (n positive weights) says which. The default,
``metric=None``, is ``w = 1``: the plain squared error of the values you pass in (so if you
evaluate on scaled outputs, pass scaled outputs, or give the scaling as ``metric``). The
head trains its mean and projects in this metric.

**The prediction** (``prediction="projection"``, the default). The mean branch predicts an
unconstrained ``loc``; the point prediction is its orthogonal projection in the metric,
``P(loc) = argmin_{A y = k} ||y - loc||_W = loc + W^-1 A^T (A W^-1 A^T)^-1 (k - A loc)``,
and the predictive distribution is ``N(P(loc), diag(s^2))`` conditioned on ``A y = k``
(its mean is ``P(loc)``; its covariance, intervals and likelihood come from the fitted
scales ``s``). ``prediction="conditional"`` centres it at ``loc`` instead, so that its mean
is the ``Sigma^{-1}``-weighted projection ``loc + K (k - A loc)``.

*Guarantee.* For every target ``y`` that satisfies the balances, ``||P(loc) - y||_W <=
||loc - y||_W``, whatever ``loc``: ``P`` is the orthogonal projection, in the inner product
of ``W``, onto the affine set ``{A z = k}``, which contains ``y``; ``loc - P(loc)`` is
``W``-orthogonal to that set (it lies in the range of ``W^-1 A^T``) and ``P(loc) - y`` lies
in it (``A (P(loc) - y) = 0``), so by Pythagoras ``||loc - y||_W^2 = ||loc - P(loc)||_W^2
+ ||P(loc) - y||_W^2``. For data that satisfy the balances, the prediction is never worse
than the unconstrained network it projects, in the user's metric, example by example. The
``Sigma^{-1}``-weighted projection has no such bound in the metric (it is orthogonal in the
metric of ``Sigma^{-1}``, not ``W``). Trained with the default loss, the mean branch is
trained exactly as the orthogonal projection layer (KKThPINN) in the metric ``W`` is, so for
the same initialisation it is that layer's prediction (to rounding), with a likelihood and
calibrated intervals added.

**Which loss to use when** (the ``loss`` argument; the closed forms are in
``docs/distributions/linear_constrained_normal.md``). ``s`` are the scales.

- ``"mse+nll"`` (default, the recommended recipe): ``||P(loc) - y||_W^2 - log p(y)``, the
  log-likelihood taken with the centre ``P(loc)`` held fixed. The mean branch sees only
  the squared error of the prediction (the projection layer's loss), the scale only the
  likelihood of that prediction's residuals. Train with this, then :meth:`calibrate` the
  scale on held-out data.
- ``"loc_mse+nll"``: ``||loc - y||_W^2 - log p(y)``: the mean branch is a plain regression
  of every output, the balance-determined directions included, projected afterwards (the
  guarantee makes it never worse than the same unconstrained network). On the simulated
  processes of ``benchmarks/surrogate.py`` it is worse than ``"mse+nll"``: fitting the
  directions that the balances fix anyway costs the network accuracy in the free ones.
- ``"nll"``: ``-log p(y)``, the proper likelihood. It weights each output's squared error
  by ``1 / s_i^2``, so it gives up squared error on noisy outputs for likelihood on precise
  ones: use it when the likelihood itself is the goal (model comparison, downstream
  Bayesian use) or when the noise levels are known, not when test MSE matters.
- ``"mse"``: ``||mean - y||_W^2`` alone (the projection layer; the scale is not trained).
- ``"expected_l2"``: ``E ||y_hat - y||_W^2 = ||mean - y||_W^2 + tr Sigma_bar`` for
  ``y_hat`` drawn from the prediction. The trace term is minimised by ``s -> 0``, so the
  scale rests on the floor ``min_scale``: the mean is that of ``"mse"``, the intervals are
  not calibrated.
- ``"expected_l1"``: the same with ``E ||y_hat - y||_1`` (robust to outliers; the scale
  also goes to the floor).

**What the benchmark shows** (``benchmarks/surrogate.py``, numbers in
``benchmarks/README.md``: three simulated processes, the surrogate protocol of MaxAbs
scaling, an MLP of 2 x 32 ReLU, Adam at lr 1e-4, batch 16). The default recipe's test MSE
equals the projection layer's (to float32 rounding), and beats the plain MLP where the
projection layer does (there: on all three processes); it does not beat the projection
layer, and where training through the projection loses to the plain MLP (the small plant
of ``notebooks/06_process_surrogate.ipynb``, trained full-batch), so does the recipe.
Standardising the mean layer's output (``output_loc`` / ``output_scale``) made the test MSE
worse on two of the three processes (slightly better on the distillation column); the
recipe recommended before (``"loc_mse+nll"`` with ``prediction="conditional"`` and
``metric = 1 / std^2``) lost to the plain MLP on two and to the projection layer on all.
Calibrated by the default (split conformal on the validation rows), the central 90%
intervals cover between 85% and 95% of the test rows on every process and split: more than
90% of random test rows (the per-output intervals are conservative, see below) and less
than 90% of sequential ones, where the test rows extrapolate beyond the validation rows
and the errors grow; the maximum-likelihood factor covers about 90% of random rows and
under 85% of sequential ones.

**Calibration.** A scale fitted to training residuals is too small by the amount the mean
overfits, so the intervals undercover. :meth:`calibrate` multiplies all scales by one
factor ``t`` fitted on held-out examples (a common factor leaves the mean, and so the point
predictions, unchanged). By default (``method="conformal"``) it is split conformal
prediction with the squared Mahalanobis distance on the subspace, ``M = ||(y - mean) /
s||^2``, as the score: ``t^2 = M_(r) / chi2_{n-a}(0.9)``, ``M_(r)`` the ``ceil(0.9 (N +
1))``-th smallest of the ``N`` held-out distances. *Guarantee*: if the held-out and new
examples are exchangeable (a random split), the predictive distribution's 90% region (the
ellipsoid ``{M <= t^2 chi2_{n-a}(0.9)}`` on ``{A y = k}``) contains a new example with
probability at least 0.9, whatever the distribution of the residuals (the rank of the new
example's score among the ``N + 1`` is uniform). The central per-output intervals have no
such guarantee; they cover 90% when the residuals are Gaussian with the fitted shape, and
more when the residuals are heavier-tailed than that (errors that vary from example to
example: the ellipsoid then needs a larger factor than the mean square, so the per-output
intervals are wider than 90% needs). A sequential split, where new rows extrapolate, is
not exchangeable: no factor fitted on earlier rows guarantees anything there, and the
intervals can undercover as errors grow. ``method="likelihood"`` is the maximum-likelihood
factor, ``t^2 = mean M / (n - a)``, which calibrates the second moment: the same factor
for Gaussian residuals, a smaller one for heavy-tailed residuals, so its per-output
intervals cover about 90% of exchangeable rows and less of extrapolating ones.

**Scale parameterisation.** ``s = output_scale * (min_scale + softplus(raw))``: the
softplus floor keeps ``s >= min_scale * output_scale`` whatever the loss does (the NLL of an
overfitted training set, or an expected loss, would otherwise drive it to 0), and the
scale is a branch of its own, so its gradient never reshapes the mean's features. With
``scale="per_output"`` (default) ``raw`` is one learned vector: homoscedastic, robust on
small data sets, and cheap, since the whitened factorisation of ``A diag(s)`` is then shared
by the whole batch. With ``scale="per_example"`` it comes from a small MLP of its own on
the *detached* features (heteroscedastic): each example then needs its own factorisation
(a batched QR, several times the cost of the MLP step), and on small data sets the pattern
it learns from training residuals overfits, so calibrate it.

**Standardisation** (optional). With ``output_loc`` / ``output_scale`` the linear layer
predicts ``(loc - output_loc) / output_scale`` and the scale is in units of
``output_scale``. This changes the parameterisation, not the metric: the losses are
computed in the metric coordinates ``sqrt(w) y`` (constraint ``A diag(1 / sqrt(w))``, same
``k``; scaling without centring keeps the support tolerance ``|A y - k| <= rtol (|A| |y| +
|k|)`` invariant, so data measured to a relative precision stays in the support). With
Adam it changes the optimisation (the mean layer's steps are in units of
``output_scale``); on the benchmark's MaxAbs-scaled outputs it hurt more often than it
helped.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from constrained_ppl.arguments import check_head_options
from constrained_ppl.conformal import check_calibration, chi2_quantile, conformal_rank
from pyro_constrained.linear_constrained_normal import LinearConstrainedNormal
from pyro_constrained.linear_constraint import LinearConstraint
from pyro_constrained.losses import expected_l1_loss, expected_l2_loss

LOSSES = ("mse+nll", "loc_mse+nll", "nll", "mse", "expected_l2", "expected_l1")
SCALES = ("per_example", "per_output")
PREDICTIONS = ("projection", "conditional")


def _inverse_softplus(value: float) -> float:
    return value + math.log(-math.expm1(-value))


class LinearConstrainedNormalHead(nn.Module):
    """Maps features (..., in_features) and right-hand sides k (..., a) to a
    :class:`LinearConstrainedNormal` over the n outputs, constrained to ``A y = k``.

    :param in_features: size of the features (the backbone's last layer).
    :param constraint: the :class:`~pyro_constrained.LinearConstraint` ``A`` (a x n), shared by
        all examples; its ``rtol`` is the support tolerance for targets.
    :param loss: one of ``"mse+nll"`` (default), ``"loc_mse+nll"``, ``"nll"``, ``"mse"``,
        ``"expected_l2"``, ``"expected_l1"``: see the module docstring for which to use when.
    :param scale: ``"per_output"`` (default: one learned vector) or ``"per_example"`` (a
        small MLP on the detached features).
    :param scale_hidden: width of the scale MLP's hidden layer.
    :param min_scale: the floor of the scale, in units of ``output_scale``.
    :param init_scale: the scale at initialisation, in units of ``output_scale``.
    :param output_loc: (n,) offset of the outputs (default 0).
    :param output_scale: (n,) positive scale of the outputs (default 1): the mean layer
        predicts ``(loc - output_loc) / output_scale`` and the scale is in these units.
    :param metric: (n,) positive weights ``w`` of the squared error the point prediction is
        judged by, ``sum_i w_i (y_i - y_hat_i)^2`` in the outputs' own units (default 1).
        The mean is trained and projected in this metric.
    :param prediction: ``"projection"`` (default: the distribution is centred at the
        metric-orthogonal projection of ``loc``, never further from a balanced target than
        ``loc``) or ``"conditional"`` (centred at ``loc``: its mean is the
        ``Sigma^{-1}``-weighted projection).
    :param validate_args: passed to the distributions the head builds.

    Examples
    --------
    >>> import torch
    >>> from pyro_constrained import LinearConstrainedNormalHead, LinearConstraint
    >>> _ = torch.manual_seed(0)
    >>> constraint = LinearConstraint(torch.tensor([[1.0, 1.0, 1.0]]))  # y1 + y2 + y3 = k
    >>> head = LinearConstrainedNormalHead(4, constraint)
    >>> features, k = torch.randn(5, 4), torch.randn(5, 1)
    >>> prediction = head(features, k)  # one LinearConstrainedNormal per example
    >>> prediction.batch_shape, prediction.event_shape
    (torch.Size([5]), torch.Size([3]))
    >>> torch.allclose(prediction.mean.sum(-1), k[:, 0], atol=1e-5)
    True
    >>> target = constraint.project(torch.randn(5, 3), k)
    >>> loss = head.loss(features, k, target)  # the default recipe, "mse+nll"
    >>> # The prediction is the orthogonal projection of the unconstrained loc:
    >>> loc, _ = head.scaled_parameters(features)
    >>> torch.allclose(prediction.mean, constraint.project(loc, k), atol=1e-5)
    True
    >>> loss.shape, loss.requires_grad
    (torch.Size([]), True)
    """

    def __init__(
        self,
        in_features: int,
        constraint: LinearConstraint,
        *,
        loss: str = "mse+nll",
        scale: str = "per_output",
        scale_hidden: int = 32,
        min_scale: float = 1e-2,
        init_scale: float = 1.0,
        output_loc: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        metric: torch.Tensor | None = None,
        prediction: str = "projection",
        validate_args: bool | None = None,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if prediction not in PREDICTIONS:
            raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
        if not isinstance(constraint, LinearConstraint):
            raise ValueError(
                f"constraint must be a LinearConstraint, got {type(constraint).__name__}"
            )
        n = constraint.n
        dtype = constraint.A.dtype
        device = constraint.A.device
        if output_loc is None:
            output_loc = torch.zeros(n, device=device)
        if output_scale is None:
            output_scale = torch.ones(n, device=device)
        if metric is None:
            metric = torch.ones(n, device=device)
        output_loc, output_scale, metric = map(torch.as_tensor, (output_loc, output_scale, metric))
        check_head_options(
            n,
            min_scale=min_scale,
            init_scale=init_scale,
            output_loc=output_loc.detach().cpu().numpy(),
            output_scale=output_scale.detach().cpu().numpy(),
            metric=metric.detach().cpu().numpy(),
        )
        self.constraint = constraint
        self.loss_name = loss
        self.prediction = prediction
        self.scale_kind = scale
        self.min_scale = float(min_scale)
        self.validate_args = validate_args
        self.register_buffer("output_loc", output_loc.to(dtype=dtype, device=device))
        self.register_buffer("output_scale", output_scale.to(dtype=dtype, device=device))
        self.register_buffer("metric_root", metric.to(dtype=dtype, device=device).sqrt())
        # The calibration factor t of :meth:`calibrate` (1 until calibrated).
        self.register_buffer("scale_factor", torch.ones((), dtype=dtype, device=device))
        # The losses and the projection live in the metric coordinates z = sqrt(w) y, where
        # the user's squared error is the Euclidean one; their constraint is
        # A diag(1 / sqrt(w)), factorised once here, not per step.
        self.metric_constraint = (
            constraint
            if bool((self.metric_root == 1).all())
            else LinearConstraint(constraint.A / self.metric_root, rtol=constraint._rtol)
        )
        self.mean_layer = nn.Linear(in_features, n)
        raw_init = _inverse_softplus(init_scale - min_scale)
        if scale == "per_example":
            self.scale_net = nn.Sequential(
                nn.Linear(in_features, scale_hidden), nn.Tanh(), nn.Linear(scale_hidden, n)
            )
            # Start from a constant scale: the scale MLP's output layer begins at zero
            # weight, so early steps do not depend on the random features.
            nn.init.zeros_(self.scale_net[-1].weight)
            nn.init.constant_(self.scale_net[-1].bias, raw_init)
        else:
            # On the default device, as nn.Linear's parameters (the module moves with .to()).
            self.raw_scale = nn.Parameter(
                torch.full((n,), raw_init, device=torch.get_default_device())
            )

    def _apply(self, fn, *args, **kwargs):
        # .to(dtype / device), .double(), .cuda() convert the parameters and buffers; the two
        # constraints are not tensors, so convert their cached factorisations alongside
        # (O(n a), no refactorisation).
        super()._apply(fn, *args, **kwargs)
        for name in ("constraint", "metric_constraint"):
            constraint = getattr(self, name)
            probe = fn(constraint.A)
            if probe.dtype != constraint.A.dtype or probe.device != constraint.A.device:
                setattr(self, name, constraint._replace(dtype=probe.dtype, device=probe.device))
        return self

    # -- the scaled coordinates --------------------------------------------------------------

    def _standardisation(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(output_loc / output_scale, output_scale * sqrt(metric))`` (the offset of the
        mean layer's output and the map from its units to the metric coordinates), each
        None where it is the identity (the defaults), so that a training step skips those
        ops. Recomputed only when a buffer is replaced or changed in place (``.to``,
        ``load_state_dict``; ``calibrate`` leaves them so): the key is the buffers
        themselves and their version counters."""
        buffers = (self.output_loc, self.output_scale, self.metric_root)
        versions = tuple(buffer._version for buffer in buffers)
        cached = self.__dict__.get("_standardisation_cache")
        if cached is not None:
            (cached_buffers, cached_versions), values = cached
            if cached_versions == versions and all(
                a is b for a, b in zip(cached_buffers, buffers, strict=True)
            ):
                return values
        with torch.no_grad():
            offset = self.output_loc / self.output_scale
            to_metric = self.output_scale * self.metric_root
            values = (
                None if bool((offset == 0).all()) else offset,
                None if bool((to_metric == 1).all()) else to_metric,
            )
        self.__dict__["_standardisation_cache"] = ((buffers, versions), values)
        return values

    def scaled_parameters(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loc, scale)`` in the scaled coordinates ``y / output_scale``:
        ``loc = output_loc / output_scale + W f + c`` and
        ``scale = min_scale + softplus(raw)``."""
        offset, _ = self._standardisation()
        loc = self.mean_layer(features)
        if offset is not None:
            loc = loc + offset
        if self.scale_kind == "per_example":
            # Detached: the scale branch reads the features but does not train them.
            raw = self.scale_net(features.detach())
        else:
            # Unbatched (n,): the distribution then factorises (A diag(scale))^T once for
            # the whole batch instead of once per example.
            raw = self.raw_scale
        return loc, self.min_scale + F.softplus(raw)

    def _metric_parameters(self, features: torch.Tensor, k: torch.Tensor):
        """``(centre, loc, scale)`` in the metric coordinates ``z = sqrt(metric) y``: the
        unprojected ``loc``, the centre of the predictive distribution (``loc`` projected
        orthogonally onto ``{A y = k}`` for ``prediction="projection"``, ``loc`` itself for
        ``"conditional"``) and the scale."""
        loc, scale = self.scaled_parameters(features)
        _, to_metric = self._standardisation()
        if to_metric is not None:
            loc, scale = loc * to_metric, scale * to_metric
        if self.prediction == "projection":
            return self.metric_constraint.project(loc, k), loc, scale
        return loc, loc, scale

    def _metric_normal(self, loc, scale, k) -> LinearConstrainedNormal:
        return self.metric_constraint.normal(loc, scale, k=k, validate_args=self.validate_args)

    # -- prediction ---------------------------------------------------------------------------

    def forward(self, features: torch.Tensor, k: torch.Tensor) -> LinearConstrainedNormal:
        """The predictive distribution of the outputs in their own units: batch shape
        ``features.shape[:-1]`` broadcast with ``k.shape[:-1]``, event shape (n,); its
        scale includes the calibration factor. With ``prediction="projection"`` its mean is
        the metric-orthogonal projection of the unconstrained ``loc`` onto ``{A y = k}``;
        with ``"conditional"`` the ``Sigma^{-1}``-weighted one."""
        centre, _, scale = self._metric_parameters(features, k)
        return self.constraint.normal(
            centre / self.metric_root,
            scale * (self.scale_factor / self.metric_root),
            k=k,
            validate_args=self.validate_args,
        )

    def project(self, features: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """The point prediction (the predictive mean) in the outputs' units."""
        return self(features, k).mean

    @torch.no_grad()
    def calibrate(
        self,
        features: torch.Tensor,
        k: torch.Tensor,
        target: torch.Tensor,
        *,
        method: str = "conformal",
        coverage: float = 0.9,
    ) -> float:
        """Fit the scale factor ``t`` on held-out examples and store it (the mean does not
        change), from their squared Mahalanobis distances on the ``(n - a)``-dimensional
        subspace, ``M = ||(y - mean) / s||^2``. Returns ``t``.

        - ``method="conformal"`` (default): split conformal prediction on ``M``,
          ``t^2 = M_(r) / chi2_{n-a}(coverage)`` with ``M_(r)`` the ``r = ceil((N + 1)
          coverage)``-th smallest of the ``N`` distances. The predictive distribution's
          ``coverage`` highest-density region (an ellipsoid on the subspace) then contains
          a new example with probability at least ``coverage`` when the held-out and new
          examples are exchangeable (a random split), whatever the residuals'
          distribution. The central per-output intervals get no such guarantee (they are
          wider than needed where the residuals are heavier-tailed than Gaussian), and a
          sequential split, where the new examples extrapolate, breaks exchangeability:
          nothing calibrated on earlier rows guarantees coverage there. ``ValueError`` for
          fewer than ``coverage / (1 - coverage)`` examples.
        - ``"likelihood"``: the maximum-likelihood factor: for ``Sigma -> t^2 Sigma`` the
          log-density changes as ``-(n - a) log t - M / (2 t^2)``, so
          ``t^2 = sum M / (N (n - a))`` (``coverage`` unused).

        Where the held-out rows are in time order and new rows extrapolate in time,
        calibrating on the most recent of them only is an option (``benchmarks/README.md``,
        surrogate benchmark).
        """
        check_calibration(method, coverage)
        self.scale_factor.fill_(1.0)
        dist = self(features, k)
        mahalanobis = ((target - dist.mean) / dist.scale).square().sum(-1)
        mahalanobis = mahalanobis.expand(dist.batch_shape).reshape(-1)
        free = self.constraint.n - self.constraint.a
        if method == "conformal":
            rank = conformal_rank(mahalanobis.shape[0], coverage)
            squared = mahalanobis.sort().values[rank - 1] / chi2_quantile(coverage, free)
        else:
            squared = mahalanobis.mean() / free
        factor = squared.sqrt()
        if not bool(torch.isfinite(factor)) or not factor > 0:
            raise ValueError(f"calibrate: the held-out data give a scale factor of {factor}")
        self.scale_factor.fill_(factor)
        return float(factor)

    # -- training -----------------------------------------------------------------------------

    def loss(
        self, features: torch.Tensor, k: torch.Tensor, target: torch.Tensor, *, loss=None
    ) -> torch.Tensor:
        """The training loss, averaged over the batch (summed over the n outputs), in the
        metric coordinates ``sqrt(metric) y`` (see the module docstring for the choice), for
        the predictive distribution that :meth:`forward` returns.

        ``"nll"`` is ``-log p(sqrt(metric) y)``, which differs from the NLL in the outputs'
        own units by a constant (the log-determinant of the scaling on the subspace).
        """
        loss = self.loss_name if loss is None else loss
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if self.metric_constraint is not self.constraint:
            target = target * self.metric_root
        centre, loc, scale = self._metric_parameters(features, k)
        if loss in ("mse+nll", "loc_mse+nll"):
            # The mean branch sees only squared error, the scale only likelihood (given the
            # centre): the scale is fitted to the residuals of the prediction it serves.
            nll = -self._metric_normal(centre.detach(), scale, k).log_prob(target)
            if loss == "loc_mse+nll":
                fitted = loc
            elif self.prediction == "projection":
                fitted = centre
            else:
                fitted = self._metric_normal(centre, scale.detach(), k).mean
            per_example = (fitted - target).square().sum(-1) + nll
        else:
            dist = self._metric_normal(centre, scale, k)
            if loss == "nll":
                per_example = -dist.log_prob(target)
            elif loss == "expected_l2":
                per_example = expected_l2_loss(dist, target)
            elif loss == "expected_l1":
                per_example = expected_l1_loss(dist, target)
            else:
                per_example = (dist.mean - target).square().sum(-1)
        return per_example.mean()
