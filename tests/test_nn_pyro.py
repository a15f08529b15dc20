"""pyro_constrained.nn.LinearConstrainedNormalHead against independent references.

References: SciPy's singular multivariate normal and quadrature (tests/oracles/
linear_gaussian.py), the least-squares projection (np.linalg.lstsq), a brute-force
one-dimensional maximisation for the calibration factor.
"""

import numpy as np
import pytest
import scipy.optimize
import scipy.stats
import torch

from constrained_ppl.showcase.process_simulator import relative_violation, simulate
from pyro_constrained import LinearConstraint
from pyro_constrained.nn import LinearConstrainedNormalHead
from tests.oracles import linear_gaussian as oracle

IN_FEATURES, N, A_ROWS, BATCH = 4, 5, 2, 3
LOSSES = ("mse+nll", "loc_mse+nll", "nll", "mse", "expected_l2", "expected_l1")
PREDICTIONS = ("projection", "conditional")


def _problem(dtype, seed=0):
    """A random constraint, features, per-example k and targets on {A y = k}."""
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(A_ROWS, N))
    features = rng.normal(size=(BATCH, IN_FEATURES))
    k = rng.normal(size=(BATCH, A_ROWS))
    raw = rng.normal(size=(BATCH, N)) * 3 + 2
    # Targets on the subspace: the minimum-norm correction of raw (float64 lstsq).
    target = raw + np.linalg.lstsq(A, (k - raw @ A.T).T, rcond=None)[0].T
    output_loc = rng.normal(size=N)
    output_scale = rng.uniform(0.5, 3.0, size=N)
    metric = rng.uniform(0.2, 5.0, size=N)
    as_t = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    return {
        "A": A,
        "features": as_t(features),
        "k": as_t(k),
        "target": as_t(target),
        "output_loc": as_t(output_loc),
        "output_scale": as_t(output_scale),
        "metric": as_t(metric),
        "constraint": LinearConstraint(as_t(A)),
    }


def _head(
    p,
    dtype,
    *,
    scale="per_example",
    loss="mse+nll",
    seed=0,
    perturb=True,
    prediction="projection",
    metric=True,
):
    torch.manual_seed(seed)
    head = LinearConstrainedNormalHead(
        IN_FEATURES,
        p["constraint"],
        scale=scale,
        loss=loss,
        output_loc=p["output_loc"],
        output_scale=p["output_scale"],
        metric=p["metric"] if metric else None,
        prediction=prediction,
    ).to(dtype)
    if perturb:
        # Move off the initialisation (zero output weights of the scale MLP, a constant
        # per-output scale) so that the scales differ between outputs and examples.
        with torch.no_grad():
            for parameter in head.parameters():
                parameter.add_(0.3 * torch.randn_like(parameter))
    return head


def _metric_projection(loc, A, k, metric):
    """argmin over {A y = k} of sum_i metric_i (y_i - loc_i)^2, for each row of loc: the
    Euclidean projection in z = sqrt(metric) y by the minimum-norm least-squares correction
    (np.linalg.lstsq), mapped back."""
    root = np.sqrt(metric)
    A_z, z = A / root, loc * root
    correction = np.linalg.lstsq(A_z, (k - z @ A_z.T).T, rcond=None)[0].T
    return (z + correction) / root


def _metric_reference(p, head):
    """The head's loc and scale in the metric coordinates z = sqrt(metric) y, that
    constraint, k, the target, and the centre of the predictive distribution, all float64
    NumPy, computed here from the head's scaled parameters."""
    loc, s = head.scaled_parameters(p["features"])
    loc, s = loc.detach().double().numpy(), s.detach().double().numpy()
    s = np.broadcast_to(s, loc.shape)
    root = np.sqrt(p["metric"].double().numpy())
    to_metric = p["output_scale"].double().numpy() * root
    loc_z, s_z = loc * to_metric, s * to_metric
    A_z = p["A"] / root
    k = p["k"].double().numpy()
    centre = loc_z
    if head.prediction == "projection":
        centre = _metric_projection(loc_z, A_z, k, np.ones(N))
    return loc_z, s_z, A_z, k, p["target"].double().numpy() * root, centre


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", ["per_example", "per_output"])
def test_shapes_and_constraint_per_example(dtype, scale):
    p = _problem(dtype)
    head = _head(p, dtype, scale=scale)
    dist = head(p["features"], p["k"])
    assert dist.batch_shape == (BATCH,) and dist.event_shape == (N,)
    assert dist.mean.dtype == dtype
    # Extra leading batch dimensions broadcast.
    wide = head(p["features"].expand(2, BATCH, IN_FEATURES), p["k"])
    assert wide.batch_shape == (2, BATCH)
    eps = torch.finfo(dtype).eps
    A = torch.tensor(p["A"], dtype=torch.float64)
    for values in (dist.mean, dist.sample((7,))):
        values = values.double()
        residual = (values @ A.T - p["k"].double()).abs()
        bound = values.abs() @ A.abs().T + p["k"].double().abs()
        assert (residual <= 64 * eps * bound).all()
    assert head.project(p["features"], p["k"]).shape == (BATCH, N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale", ["per_example", "per_output"])
@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_losses_equal_references(dtype, scale, prediction):
    """Every loss in the metric coordinates sqrt(metric) y, for the distribution centred at
    the prediction's centre: SciPy's singular normal and quadrature, NumPy projections."""
    p = _problem(dtype, seed=1)
    head = _head(p, dtype, scale=scale, prediction=prediction)
    loc, s, A_z, k, target, centre = _metric_reference(p, head)
    cov = [np.diag(s[i] ** 2) for i in range(BATCH)]
    nll = np.array([-oracle.logpdf(target[i], centre[i], cov[i], A_z, k[i]) for i in range(BATCH)])
    means = np.array(
        [oracle.conditional_moments(centre[i], cov[i], A_z, k[i])[0] for i in range(BATCH)]
    )
    mse = np.sum((means - target) ** 2, -1)
    expected = [
        oracle.expected_losses(centre[i], cov[i], A_z, k[i], target[i]) for i in range(BATCH)
    ]
    references = {
        "nll": nll.mean(),
        "mse+nll": (mse + nll).mean(),
        "loc_mse+nll": (np.sum((loc - target) ** 2, -1) + nll).mean(),
        "mse": mse.mean(),
        "expected_l1": np.mean([e[0] for e in expected]),
        "expected_l2": np.mean([e[1] for e in expected]),
    }
    # float64: the quadrature of the expected L1 loss is good to about 1e-8.
    rtol = 2e-4 if dtype == torch.float32 else 1e-7
    for name in LOSSES:
        value = head.loss(p["features"], p["k"], p["target"], loss=name)
        assert value.dtype == dtype
        np.testing.assert_allclose(value.item(), references[name], rtol=rtol, err_msg=name)
    # The loss chosen at construction is the default of loss().
    nll_head = _head(p, dtype, scale=scale, loss="nll", prediction=prediction)
    np.testing.assert_allclose(
        nll_head.loss(p["features"], p["k"], p["target"]).item(), references["nll"], rtol=rtol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_conditional_prediction_in_output_units_is_the_scaled_conditional(dtype):
    """prediction="conditional": forward() is N(loc * output_scale, diag(s output_scale)^2)
    given A y = k (SciPy), whatever the metric."""
    p = _problem(dtype, seed=2)
    head = _head(p, dtype, prediction="conditional")
    dist = head(p["features"], p["k"])
    loc, s = head.scaled_parameters(p["features"])
    output_scale = p["output_scale"].double().numpy()
    loc = loc.detach().double().numpy() * output_scale
    s = s.detach().double().numpy() * output_scale
    target = p["target"].double().numpy()
    log_prob = dist.log_prob(p["target"]).detach().double().numpy()
    for i in range(BATCH):
        cov = np.diag(s[i] ** 2)
        k_i = p["k"][i].double().numpy()
        mean, covariance = oracle.conditional_moments(loc[i], cov, p["A"], k_i)
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9)
        np.testing.assert_allclose(dist.mean[i].detach().double().numpy(), mean, **tol)
        np.testing.assert_allclose(
            dist.variance[i].detach().double().numpy(), np.diag(covariance), **tol
        )
        reference = oracle.logpdf(target[i], loc[i], cov, p["A"], k_i)
        np.testing.assert_allclose(log_prob[i], reference, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_default_prediction_is_the_metric_orthogonal_projection(dtype):
    """The default forward(): its mean is argmin_{A y = k} sum_i metric_i (y_i - loc_i)^2
    (NumPy least squares, checked against the KKT system), its covariance and density those
    of the fitted scales' Gaussian centred there and conditioned on A y = k (SciPy)."""
    p = _problem(dtype, seed=8)
    head = _head(p, dtype)
    assert head.prediction == "projection"
    dist = head(p["features"], p["k"])
    loc, s = head.scaled_parameters(p["features"])
    output_scale = p["output_scale"].double().numpy()
    loc = loc.detach().double().numpy() * output_scale
    s = s.detach().double().numpy() * output_scale
    k = p["k"].double().numpy()
    metric = p["metric"].double().numpy()
    projected = _metric_projection(loc, p["A"], k, metric)
    kkt = np.block([[np.diag(metric), p["A"].T], [p["A"], np.zeros((A_ROWS, A_ROWS))]])
    for i in range(BATCH):
        solution = np.linalg.solve(kkt, np.concatenate([metric * loc[i], k[i]]))
        np.testing.assert_allclose(solution[:N], projected[i], rtol=1e-10, atol=1e-10)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(dist.mean.detach().double().numpy(), projected, **tol)
    point = head.project(p["features"], p["k"]).detach().double().numpy()
    np.testing.assert_allclose(point, projected, **tol)
    target = p["target"].double().numpy()
    log_prob = dist.log_prob(p["target"]).detach().double().numpy()
    for i in range(BATCH):
        cov = np.diag(s[i] ** 2)
        _, covariance = oracle.conditional_moments(projected[i], cov, p["A"], k[i])
        np.testing.assert_allclose(
            dist.variance[i].detach().double().numpy(), np.diag(covariance), **tol
        )
        reference = oracle.logpdf(target[i], projected[i], cov, p["A"], k[i])
        np.testing.assert_allclose(log_prob[i], reference, **tol)


def test_projection_is_never_further_from_a_balanced_target_than_loc():
    """The guarantee: for any target with A y = k, the default prediction's error in the
    metric is at most that of the unprojected loc (Pythagoras), over many random heads,
    metrics and targets; the conditional mean, weighted by the scales, has no such bound
    (cases where it is worse are found among the same draws)."""
    worse_conditional = 0
    for seed in range(40):
        p = _problem(torch.float64, seed=100 + seed)
        head = _head(p, torch.float64, seed=seed)
        conditional = _head(p, torch.float64, seed=seed, prediction="conditional")
        loc, _ = head.scaled_parameters(p["features"])
        loc = loc.detach().numpy() * p["output_scale"].numpy()
        metric, target = p["metric"].numpy(), p["target"].numpy()
        loc_error = np.sum(metric * (loc - target) ** 2, -1)
        projected = head(p["features"], p["k"]).mean.detach().numpy()
        assert (np.sum(metric * (projected - target) ** 2, -1) <= loc_error * (1 + 1e-12)).all()
        weighted = conditional(p["features"], p["k"]).mean.detach().numpy()
        worse_conditional += int((np.sum(metric * (weighted - target) ** 2, -1) > loc_error).sum())
    assert worse_conditional > 0


def test_projected_mean_of_a_constant_scale_is_the_least_squares_projection():
    """With one scale for every output in the metric coordinates (a fresh per-output head,
    metric = 1 / output_scale^2) the conditional mean is the Euclidean projection there:
    loc + the minimum-norm solution of A_s d = k - A_s loc, A_s = A diag(output_scale);
    "mse" is its squared error."""
    p = _problem(torch.float64, seed=3)
    p["metric"] = 1.0 / p["output_scale"] ** 2
    head = _head(p, torch.float64, scale="per_output", perturb=False, prediction="conditional")
    loc, _ = head.scaled_parameters(p["features"])
    loc = loc.detach().numpy()
    output_scale = p["output_scale"].numpy()
    A_scaled = p["A"] * output_scale
    k = p["k"].numpy()
    projected = loc + np.linalg.lstsq(A_scaled, (k - loc @ A_scaled.T).T, rcond=None)[0].T
    target = p["target"].numpy() / output_scale
    reference = np.mean(np.sum((projected - target) ** 2, -1))
    value = head.loss(p["features"], p["k"], p["target"], loss="mse").item()
    np.testing.assert_allclose(value, reference, rtol=1e-10)
    np.testing.assert_allclose(
        head.project(p["features"], p["k"]).detach().numpy(), projected * output_scale, rtol=1e-10
    )


def test_calibrated_intervals_cover_on_a_simulated_problem():
    """Outputs y = W x + noise conditioned on A y = k, the noise's scale differing by
    output: a head trained by the default recipe on 600 examples and calibrated on 300
    held-out ones gives 90% intervals that cover 85% to 95% of 3000 test outputs."""
    rng = np.random.default_rng(11)
    n, a, d = 6, 2, 3
    A = rng.normal(size=(a, n))
    weights = rng.normal(size=(d, n))
    noise_scale = np.array([0.05, 0.1, 0.2, 0.3, 0.5, 0.8])
    x = rng.normal(size=(3900, d))
    k = rng.normal(size=(3900, a))
    raw = x @ weights + noise_scale * rng.normal(size=(3900, n))
    # The Gaussian N(x W, diag(noise^2)) conditioned on A y = k: its exact sample.
    cov = np.diag(noise_scale**2)
    gain = cov @ A.T @ np.linalg.inv(A @ cov @ A.T)
    y = raw + (k - raw @ A.T) @ gain.T
    as_t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    X, K, Y = as_t(x), as_t(k), as_t(y)
    torch.manual_seed(0)
    head = LinearConstrainedNormalHead(d, LinearConstraint(as_t(A))).double()
    optimiser = torch.optim.Adam(head.parameters(), lr=0.1)
    for _ in range(100):
        optimiser.zero_grad()
        head.loss(X[:600], K[:600], Y[:600]).backward()
        optimiser.step()
    with torch.no_grad():
        head.calibrate(X[600:900], K[600:900], Y[600:900])
        dist = head(X[900:], K[900:])
        inside = (Y[900:] - dist.mean).abs() <= 1.6448536269514722 * dist.variance.sqrt()
    coverage = inside.double().mean().item()
    assert 0.85 <= coverage <= 0.95, coverage


@pytest.mark.parametrize("scale", ["per_example", "per_output"])
def test_scale_floor_holds_when_the_loss_collapses_the_scale(scale):
    """With loc equal to the (on-subspace) target, mu_bar = target whatever the scale, and
    the expected L2 loss is tr Sigma_bar alone, minimised by scale -> 0: trained on it, the
    scale goes down to the floor min_scale * output_scale and stays there."""
    p = _problem(torch.float64, seed=4)
    head = _head(p, torch.float64, scale=scale, loss="expected_l2")
    # The mean layer interpolates the three scaled targets exactly (4 features > 3 examples).
    target = p["target"] / p["output_scale"] - p["output_loc"] / p["output_scale"]
    ones = torch.ones(BATCH, 1, dtype=torch.float64)
    solution = torch.linalg.lstsq(torch.cat([p["features"], ones], -1), target).solution
    with torch.no_grad():
        head.mean_layer.weight.copy_(solution[:-1].T)
        head.mean_layer.bias.copy_(solution[-1])
    head.mean_layer.requires_grad_(False)
    # A short second-moment memory: the gradient shrinks like the scale itself, and Adam's
    # default memory of the early, large gradients would slow the descent to a crawl.
    trainable = [q for q in head.parameters() if q.requires_grad]
    optimiser = torch.optim.Adam(trainable, lr=0.2, betas=(0.9, 0.9))
    for _ in range(300):
        optimiser.zero_grad()
        head.loss(p["features"], p["k"], p["target"]).backward()
        optimiser.step()
    scale_in_units = head(p["features"], p["k"]).scale / p["output_scale"]
    assert (scale_in_units >= head.min_scale * (1 - 1e-12)).all()
    # It did collapse onto the floor (so the floor is what held it).
    assert (scale_in_units <= 1.05 * head.min_scale).all()


@pytest.mark.parametrize("loss", ["mse+nll", "loc_mse+nll"])
def test_mse_plus_nll_trains_the_mean_by_squared_error_and_the_scale_by_likelihood(loss):
    """In the two-term losses the features (the mean branch's input) get the gradient of the
    squared error in the metric alone, of the projection of loc ("mse+nll", the default)
    or of loc itself ("loc_mse+nll"), and the scale branch the gradient of the NLL alone,
    of the distribution centred at the (detached) projection of loc."""
    p = _problem(torch.float64, seed=5)
    head = _head(p, torch.float64, loss=loss)
    features = p["features"].clone().requires_grad_(True)
    total = head.loss(features, p["k"], p["target"])
    grad_features, *grad_scale = torch.autograd.grad(
        total, [features, *head.scale_net.parameters()]
    )
    loc, s = head.scaled_parameters(features)
    loc = loc * p["output_scale"]
    # The metric projection P(loc) = loc + W^-1 A^T (A W^-1 A^T)^-1 (k - A loc), W = diag(metric).
    A, inverse_metric = p["constraint"].A, 1.0 / p["metric"]
    gain = (inverse_metric[:, None] * A.T) @ torch.linalg.inv((A * inverse_metric) @ A.T)
    projected = loc + (p["k"] - loc @ A.T) @ gain.T
    fitted = projected if loss == "mse+nll" else loc
    squared_error = (p["metric"] * (fitted - p["target"]).square()).sum(-1).mean()
    (reference_features,) = torch.autograd.grad(squared_error, [features])
    np.testing.assert_allclose(grad_features.numpy(), reference_features.numpy(), rtol=1e-10)
    # The NLL in the outputs' own units differs from the head's by a constant.
    nll = (
        -p["constraint"]
        .normal(projected.detach(), s * p["output_scale"], k=p["k"])
        .log_prob(p["target"])
    )
    reference_scale = torch.autograd.grad(nll.mean(), list(head.scale_net.parameters()))
    for got, want in zip(grad_scale, reference_scale, strict=True):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-9, atol=1e-13)


def test_calibrate_maximises_the_held_out_likelihood():
    p = _problem(torch.float64, seed=6)
    head = _head(p, torch.float64)
    mean_before = head(p["features"], p["k"]).mean.detach().clone()

    def negative_log_likelihood(factor):
        head.scale_factor.fill_(factor)
        return -head(p["features"], p["k"]).log_prob(p["target"]).sum().item()

    best = scipy.optimize.minimize_scalar(
        negative_log_likelihood, bounds=(1e-3, 1e3), method="bounded", options={"xatol": 1e-10}
    ).x
    factor = head.calibrate(p["features"], p["k"], p["target"], method="likelihood")
    np.testing.assert_allclose(factor, best, rtol=1e-6)
    assert head.scale_factor.item() == pytest.approx(factor)
    # The point prediction does not move; the scale is multiplied by the factor.
    dist = head(p["features"], p["k"])
    np.testing.assert_allclose(dist.mean.detach().numpy(), mean_before.numpy(), rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plant_data_rounded_to_seven_digits_is_in_the_support_with_rtol(dtype):
    """Simulated plant data (balances exact, then rounded to 7 significant digits) is off
    its balances by up to ~4e-7 relative: in the support with rtol=1e-6, for a head whose
    losses work in scaled coordinates (scaling keeps the relative residual)."""
    data = simulate(np.random.default_rng(0), 60)
    assert relative_violation(data["A"], data["y"], data["k"]).max() > 1e-7
    as_t = lambda x: torch.tensor(x, dtype=dtype)  # noqa: E731
    constraint = LinearConstraint(as_t(data["A"]), rtol=1e-6)
    head = LinearConstrainedNormalHead(
        6,
        constraint,
        output_loc=as_t(data["y"].mean(0)),
        output_scale=as_t(data["y"].std(0)),
    ).to(dtype)
    features = as_t((data["x"] - data["x"].mean(0)) / data["x"].std(0))
    k, y = as_t(data["k"]), as_t(data["y"])
    for name in LOSSES:
        assert torch.isfinite(head.loss(features, k, y, loss=name))
    assert torch.isfinite(head(features, k).log_prob(y)).all()
    if dtype == torch.float64:
        # A tolerance below the data's precision rejects the same data in float64.
        strict = LinearConstrainedNormalHead(6, LinearConstraint(as_t(data["A"]), rtol=1e-8))
        strict = strict.to(dtype)
        with pytest.raises(ValueError, match="rtol"):
            strict(features, k).log_prob(y)


def test_bad_arguments_raise_value_error():
    p = _problem(torch.float64)
    c = p["constraint"]
    with pytest.raises(ValueError, match="loss"):
        LinearConstrainedNormalHead(IN_FEATURES, c, loss="l2")
    with pytest.raises(ValueError, match="scale"):
        LinearConstrainedNormalHead(IN_FEATURES, c, scale="full")
    with pytest.raises(ValueError, match="min_scale"):
        LinearConstrainedNormalHead(IN_FEATURES, c, min_scale=0.0)
    with pytest.raises(ValueError, match="init_scale"):
        LinearConstrainedNormalHead(IN_FEATURES, c, min_scale=0.5, init_scale=0.5)
    with pytest.raises(ValueError, match="output_scale"):
        LinearConstrainedNormalHead(IN_FEATURES, c, output_scale=-torch.ones(N))
    with pytest.raises(ValueError, match="output_loc"):
        LinearConstrainedNormalHead(IN_FEATURES, c, output_loc=torch.zeros(N + 1))
    with pytest.raises(ValueError, match="LinearConstraint"):
        LinearConstrainedNormalHead(IN_FEATURES, torch.ones(1, N))
    with pytest.raises(ValueError, match="prediction"):
        LinearConstrainedNormalHead(IN_FEATURES, c, prediction="mean")
    with pytest.raises(ValueError, match="metric"):
        LinearConstrainedNormalHead(IN_FEATURES, c, metric=torch.zeros(N))
    with pytest.raises(ValueError, match="metric"):
        LinearConstrainedNormalHead(IN_FEATURES, c, metric=torch.ones(N + 1))
    head = LinearConstrainedNormalHead(IN_FEATURES, c).double()
    with pytest.raises(ValueError, match="loss"):
        head.loss(p["features"], p["k"], p["target"], loss="mae")


def test_dtype_conversion_converts_the_constraints():
    """head.double() / .float() move the cached constraints with the parameters."""
    p = _problem(torch.float32, seed=7)
    head = _head(p, torch.float32).double()
    assert head.constraint.A.dtype == torch.float64
    assert head.metric_constraint.A.dtype == torch.float64
    features, k = p["features"].double(), p["k"].double()
    assert head(features, k).mean.dtype == torch.float64
    head = head.float()
    assert head.metric_constraint.A.dtype == torch.float32
    assert head(p["features"], p["k"]).mean.dtype == torch.float32


def _true_mean_head(W, s, A, factor):
    """A head whose mean is ``x W`` projected and whose scale is ``factor * s``."""
    head = LinearConstrainedNormalHead(3, LinearConstraint(torch.tensor(A))).double()
    with torch.no_grad():
        head.mean_layer.weight.copy_(torch.tensor(W))
        head.mean_layer.bias.zero_()
        head.raw_scale.copy_(torch.tensor(np.log(np.expm1(factor * s - head.min_scale))))
    return head


@pytest.mark.parametrize("tails", ["gaussian", "student"])
def test_conformal_calibration_covers_on_a_known_conditional_gaussian(tails):
    """A head with the true mean and every scale 3 times too large, calibrated by the
    default (split conformal, coverage 0.9) on 199 held-out rows and tested on 500 more,
    20 times over: the calibrated 90% region {M <= chi2_{n-a}(0.9)} (SciPy's quantile)
    covers the test rows 0.9 of the time on average (split conformal's expectation is
    exactly ceil(200 * 0.9) / 200 = 0.9 for any residual distribution; the Monte Carlo
    standard error of the mean of 20 repetitions is about 0.006, the tolerance 0.02).
    With Gaussian residuals (the model right up to the factor) the central 90% per-output
    intervals cover 0.9 too; with Student-t residuals, heavier-tailed than the model, they
    cover more, as the docstring says."""
    rng = np.random.default_rng(12)
    repetitions, held_out, tested = 20, 199, 500
    rows = held_out + tested
    x, k, y, (W, s, A) = oracle.known_conditional_gaussian(rng, repetitions * rows, tails=tails)
    head = _true_mean_head(W, s, A, 3.0)
    radius = scipy.stats.chi2.ppf(0.9, 6 - 2)
    region, per_output, factors = [], [], []
    for r in range(repetitions):
        rows_r = slice(r * rows, (r + 1) * rows)
        xr, kr, yr = (torch.tensor(v[rows_r]) for v in (x, k, y))
        factors.append(head.calibrate(xr[:held_out], kr[:held_out], yr[:held_out]))
        with torch.no_grad():
            dist = head(xr[held_out:], kr[held_out:])
            residual = (yr[held_out:] - dist.mean).numpy()
            mahalanobis = np.sum(np.square(residual / dist.scale.numpy()), -1)
            sd = dist.variance.sqrt().numpy()
        region.append(np.mean(mahalanobis <= radius))
        per_output.append(np.mean(np.abs(residual) <= 1.6448536269514722 * sd))
    assert abs(np.mean(region) - 0.9) <= 0.02, np.mean(region)
    if tails == "gaussian":
        assert abs(np.mean(per_output) - 0.9) <= 0.02, np.mean(per_output)
        assert abs(np.mean(factors) - 1.0 / 3.0) <= 0.02, np.mean(factors)
    else:
        assert np.mean(per_output) > 0.9, np.mean(per_output)


def test_conformal_factor_is_the_ranked_distance_over_the_chi2_quantile():
    """The factor against a reference built from the distribution's own log-density: on
    the subspace, ``M = 2 (log p(mean) - log p(y))``; the factor squared is the
    ``ceil((N + 1) c)``-th smallest M over SciPy's chi-square quantile, for two coverages."""
    rng = np.random.default_rng(3)
    x, k, y, (W, s, A) = oracle.known_conditional_gaussian(rng, 40, tails="gaussian")
    head = _true_mean_head(W, s, A, 1.7)
    x, k, y = torch.tensor(x), torch.tensor(k), torch.tensor(y)
    with torch.no_grad():
        dist = head(x, k)
        mahalanobis = 2.0 * (dist.log_prob(dist.mean) - dist.log_prob(y)).numpy()
    for coverage, rank in ((0.9, 37), (0.5, 21)):  # ceil(41 c)
        want = np.sqrt(np.sort(mahalanobis)[rank - 1] / scipy.stats.chi2.ppf(coverage, 4))
        np.testing.assert_allclose(head.calibrate(x, k, y, coverage=coverage), want, rtol=1e-10)


def test_calibrate_rejects_bad_options_and_too_few_examples():
    p = _problem(torch.float64)  # 3 examples
    head = _head(p, torch.float64)
    args = (p["features"], p["k"], p["target"])
    with pytest.raises(ValueError, match="too few for a conformal coverage of 0.9"):
        head.calibrate(*args)
    head.calibrate(*args, coverage=0.75)  # ceil(4 * 0.75) = 3 of 3: enough
    with pytest.raises(ValueError, match="method must be one of"):
        head.calibrate(*args, method="ml")
    with pytest.raises(ValueError, match="coverage must lie in"):
        head.calibrate(*args, coverage=1.0)
    with pytest.raises(ValueError, match="scale factor of nan"):
        head.calibrate(
            p["features"], p["k"], torch.full_like(p["target"], float("nan")), method="likelihood"
        )
