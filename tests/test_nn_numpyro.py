"""numpyro_constrained.nn (init_head / head_loss / head_distribution / calibrate_head)
against independent references: SciPy's singular normal and quadrature (tests/oracles/
linear_gaussian.py), the least-squares projection, a brute-force maximisation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
import scipy.stats

from constrained_ppl.showcase.process_simulator import relative_violation, simulate
from numpyro_constrained import LinearConstraint
from numpyro_constrained.nn import (
    calibrate_head,
    head_distribution,
    head_loss,
    head_parameters,
    init_head,
)
from tests.oracles import linear_gaussian as oracle

IN_FEATURES, N, A_ROWS, BATCH = 4, 5, 2, 3
LOSSES = ("mse+nll", "loc_mse+nll", "nll", "mse", "expected_l2", "expected_l1")
# Also run in NumPyro's default configuration (x64 off, XLA optimised; tests/conftest.py):
# the losses against their float64 references, and rounded data inside the support. The
# shape test's float32 variants stay with x64 on (26 s of compilation under load): the head's
# distribution is a LinearConstrainedNormal, whose float32 draws the conformance battery
# checks inside the support with x64 off.
USER_CONFIG_TESTS = {
    "test_losses_equal_references",
    "test_plant_data_rounded_to_seven_digits_is_in_the_support_with_rtol",
}


def _problem(dtype, seed=0):
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(A_ROWS, N))
    k = rng.normal(size=(BATCH, A_ROWS))
    raw = rng.normal(size=(BATCH, N)) * 3 + 2
    target = raw + np.linalg.lstsq(A, (k - raw @ A.T).T, rcond=None)[0].T
    return {
        "A": A,
        "features": jnp.asarray(rng.normal(size=(BATCH, IN_FEATURES)), dtype),
        "k": jnp.asarray(k, dtype),
        "target": jnp.asarray(target, dtype),
        "output_loc": jnp.asarray(rng.normal(size=N), dtype),
        "output_scale": jnp.asarray(rng.uniform(0.5, 3.0, size=N), dtype),
        "metric": jnp.asarray(rng.uniform(0.2, 5.0, size=N), dtype),
        "constraint": LinearConstraint(jnp.asarray(A, dtype)),
    }


def _head(p, dtype, *, scale="per_example", seed=0, perturb=True):
    params, state = init_head(
        jax.random.PRNGKey(seed),
        IN_FEATURES,
        p["constraint"],
        scale=scale,
        output_loc=p["output_loc"],
        output_scale=p["output_scale"],
        metric=p["metric"],
        dtype=dtype,
    )
    if perturb:
        # Off the initialisation, so that scales differ between outputs and examples.
        # (NumPy noise: jax.random would compile a sampler for every parameter shape.)
        rng = np.random.default_rng(seed + 1)
        params = jax.tree_util.tree_map(
            lambda leaf: leaf + jnp.asarray(0.3 * rng.normal(size=leaf.shape), dtype), params
        )
    return params, state


# Three of the four combinations: each new (dtype, scale) pair costs JAX several seconds of
# compilation, and float64 with a per-example scale is covered by the loss and agreement tests.
@pytest.mark.parametrize(
    "dtype, scale",
    [(jnp.float32, "per_example"), (jnp.float32, "per_output"), (jnp.float64, "per_output")],
)
def test_shapes_and_constraint_per_example(dtype, scale):
    p = _problem(dtype)
    params, state = _head(p, dtype, scale=scale)
    dist = head_distribution(params, state, p["features"], p["k"])
    assert dist.batch_shape == (BATCH,) and dist.event_shape == (N,)
    assert dist.mean.dtype == dtype
    wide = head_distribution(
        params, state, jnp.broadcast_to(p["features"], (2, BATCH, IN_FEATURES)), p["k"]
    )
    assert wide.batch_shape == (2, BATCH)
    eps = jnp.finfo(dtype).eps
    samples = dist.sample(jax.random.PRNGKey(3), (7,))
    for values in (dist.mean, samples):
        values = np.asarray(values, np.float64)
        k = np.asarray(p["k"], np.float64)
        residual = np.abs(values @ p["A"].T - k)
        bound = np.abs(values) @ np.abs(p["A"]).T + np.abs(k)
        assert (residual <= 64 * eps * bound).all()


def _metric_projection(loc, A, k, metric):
    """argmin over {A y = k} of sum_i metric_i (y_i - loc_i)^2 per row (NumPy lstsq in
    z = sqrt(metric) y)."""
    root = np.sqrt(metric)
    A_z, z = A / root, loc * root
    return (z + np.linalg.lstsq(A_z, (k - z @ A_z.T).T, rcond=None)[0].T) / root


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("scale", ["per_example", "per_output"])
def test_losses_equal_references(dtype, scale):
    """The default prediction is the metric-orthogonal projection of loc (NumPy); every loss
    is that of the distribution centred there, in the metric coordinates sqrt(metric) y
    (SciPy's singular normal and quadrature)."""
    p = _problem(dtype, seed=1)
    params, state = _head(p, dtype, scale=scale)
    loc, s = head_parameters(params, state, p["features"])
    output_scale = np.asarray(p["output_scale"], np.float64)
    root = np.sqrt(np.asarray(p["metric"], np.float64))
    loc = np.asarray(loc, np.float64) * output_scale
    s = np.broadcast_to(np.asarray(s, np.float64), loc.shape) * output_scale
    k = np.asarray(p["k"], np.float64)
    projected = _metric_projection(loc, p["A"], k, root**2)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == jnp.float32 else dict(rtol=1e-9, atol=1e-12)
    mean = head_distribution(params, state, p["features"], p["k"]).mean
    np.testing.assert_allclose(np.asarray(mean, np.float64), projected, **tol)
    # In the metric coordinates.
    loc, s, centre, A_z = loc * root, s * root, projected * root, p["A"] / root
    target = np.asarray(p["target"], np.float64) * root
    covs = [np.diag(s[i] ** 2) for i in range(BATCH)]
    nll = np.array([-oracle.logpdf(target[i], centre[i], covs[i], A_z, k[i]) for i in range(3)])
    mse = np.sum((centre - target) ** 2, -1)
    expected = [oracle.expected_losses(centre[i], covs[i], A_z, k[i], target[i]) for i in range(3)]
    references = {
        "nll": nll.mean(),
        "mse+nll": (mse + nll).mean(),
        "loc_mse+nll": (np.sum((loc - target) ** 2, -1) + nll).mean(),
        "mse": mse.mean(),
        "expected_l1": np.mean([e[0] for e in expected]),
        "expected_l2": np.mean([e[1] for e in expected]),
    }
    # float64: the quadrature of the expected L1 loss is good to about 1e-8.
    rtol = 2e-4 if dtype == jnp.float32 else 1e-7
    # Under jit (the state's LinearConstraint is a pytree argument) the default loss agrees.
    jitted = jax.jit(head_loss)(params, state, p["features"], p["k"], p["target"])
    np.testing.assert_allclose(float(jitted), references["mse+nll"], rtol=rtol)
    for name in LOSSES:
        value = head_loss(params, state, p["features"], p["k"], p["target"], loss=name)
        assert value.dtype == dtype
        np.testing.assert_allclose(float(value), references[name], rtol=rtol, err_msg=name)


def test_projected_mean_of_a_constant_scale_is_the_least_squares_projection():
    """prediction="conditional" with one scale in the metric coordinates (metric =
    1 / output_scale^2, a fresh per-output head): the conditional mean is the Euclidean
    projection there, and "mse" its squared error."""
    p = _problem(jnp.float64, seed=3)
    p["metric"] = 1.0 / p["output_scale"] ** 2
    params, state = _head(p, jnp.float64, scale="per_output", perturb=False)
    loc, _ = head_parameters(params, state, p["features"])
    loc = np.asarray(loc)
    output_scale = np.asarray(p["output_scale"])
    A_scaled = p["A"] * output_scale
    k = np.asarray(p["k"])
    projected = loc + np.linalg.lstsq(A_scaled, (k - loc @ A_scaled.T).T, rcond=None)[0].T
    target = np.asarray(p["target"]) / output_scale
    reference = np.mean(np.sum((projected - target) ** 2, -1))
    value = head_loss(
        params, state, p["features"], p["k"], p["target"], loss="mse", prediction="conditional"
    )
    np.testing.assert_allclose(float(value), reference, rtol=1e-10)
    mean = head_distribution(params, state, p["features"], p["k"], prediction="conditional").mean
    np.testing.assert_allclose(np.asarray(mean), projected * output_scale, rtol=1e-10)


@pytest.mark.parametrize("scale", ["per_example", "per_output"])
def test_scale_floor_holds_when_the_loss_collapses_the_scale(scale):
    """loc = the on-subspace target makes the expected L2 loss tr Sigma_bar alone (minimised
    by scale -> 0); gradient steps on the scale's parameters stop at the floor."""
    p = _problem(jnp.float64, seed=4)
    params, state = _head(p, jnp.float64, scale=scale)
    target = (p["target"] - p["output_loc"]) / p["output_scale"]
    design = jnp.concatenate([p["features"], jnp.ones((BATCH, 1))], -1)
    solution = jnp.linalg.lstsq(design, target)[0]
    mean_layer = {"weight": solution[:-1].T, "bias": solution[-1]}
    scale_params = {key: value for key, value in params.items() if key != "mean"}

    def loss(scale_params):
        full = dict(scale_params, mean=mean_layer)
        return head_loss(full, state, p["features"], p["k"], p["target"], loss="expected_l2")

    @jax.jit
    def step(scale_params):
        # Sign-of-gradient steps (Adam's limit): the gradient shrinks with the scale.
        grads = jax.grad(loss)(scale_params)
        return jax.tree_util.tree_map(lambda q, g: q - 0.2 * jnp.sign(g), scale_params, grads)

    for _ in range(300):
        scale_params = step(scale_params)
    full = dict(scale_params, mean=mean_layer)
    dist = head_distribution(full, state, p["features"], p["k"])
    scale_in_units = np.asarray(jnp.broadcast_to(dist.scale, (BATCH, N)) / p["output_scale"])
    min_scale = float(state["min_scale"])
    assert (scale_in_units >= min_scale * (1 - 1e-12)).all()
    assert (scale_in_units <= 1.05 * min_scale).all()


@pytest.mark.parametrize("loss", ["mse+nll", "loc_mse+nll"])
def test_mse_plus_nll_separates_the_gradients(loss):
    """Two-term losses: the features get the gradient of the metric's squared error alone
    (of the projection of loc for "mse+nll", of loc for "loc_mse+nll"), the scale branch
    that of the NLL alone, centred at the (stopped) projection of loc."""
    p = _problem(jnp.float64, seed=5)
    params, state = _head(p, jnp.float64)
    metric, A = p["metric"], jnp.asarray(p["A"])
    gain = (A.T / metric[:, None]) @ jnp.linalg.inv((A / metric) @ A.T)

    def total(params, features):
        return head_loss(params, state, features, p["k"], p["target"], loss=loss)

    def fitted(features):
        loc, _ = head_parameters(params, state, features)
        loc = loc * p["output_scale"]
        return loc + (p["k"] - loc @ A.T) @ gain.T if loss == "mse+nll" else loc

    def squared_error(features):
        return jnp.mean(jnp.sum(metric * jnp.square(fitted(features) - p["target"]), -1))

    loc, _ = head_parameters(params, state, p["features"])
    centre = _metric_projection(
        np.asarray(loc * p["output_scale"]), p["A"], np.asarray(p["k"]), np.asarray(metric)
    )

    def nll(scale_params):
        _, s = head_parameters(dict(params, **scale_params), state, p["features"])
        dist = p["constraint"].normal(centre, s * p["output_scale"], k=p["k"])
        return -jnp.mean(dist.log_prob(p["target"]))

    grad_params, grad_features = jax.grad(total, argnums=(0, 1))(params, p["features"])
    np.testing.assert_allclose(grad_features, jax.grad(squared_error)(p["features"]), rtol=1e-10)
    scale_params = {key: params[key] for key in ("scale_hidden", "scale_out")}
    reference = jax.grad(nll)(scale_params)
    for key in scale_params:
        for leaf in ("weight", "bias"):
            np.testing.assert_allclose(
                grad_params[key][leaf], reference[key][leaf], rtol=1e-9, atol=1e-13
            )


def test_calibrate_maximises_the_held_out_likelihood():
    p = _problem(jnp.float64, seed=6)
    params, state = _head(p, jnp.float64)

    def negative_log_likelihood(factor):
        scaled = dict(state, scale_factor=jnp.asarray(factor))
        dist = head_distribution(params, scaled, p["features"], p["k"])
        return -float(jnp.sum(dist.log_prob(p["target"])))

    best = scipy.optimize.minimize_scalar(
        negative_log_likelihood, bounds=(1e-3, 1e3), method="bounded", options={"xatol": 1e-10}
    ).x
    calibrated = calibrate_head(
        params, state, p["features"], p["k"], p["target"], method="likelihood"
    )
    np.testing.assert_allclose(float(calibrated["scale_factor"]), best, rtol=1e-6)
    before = head_distribution(params, state, p["features"], p["k"]).mean
    after = head_distribution(params, calibrated, p["features"], p["k"]).mean
    np.testing.assert_allclose(after, before, rtol=1e-12)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_plant_data_rounded_to_seven_digits_is_in_the_support_with_rtol(dtype):
    data = simulate(np.random.default_rng(0), 60)
    assert relative_violation(data["A"], data["y"], data["k"]).max() > 1e-7
    constraint = LinearConstraint(jnp.asarray(data["A"], dtype), rtol=1e-6)
    params, state = init_head(
        jax.random.PRNGKey(0),
        6,
        constraint,
        output_loc=data["y"].mean(0),
        output_scale=data["y"].std(0),
        dtype=dtype,
    )
    features = jnp.asarray((data["x"] - data["x"].mean(0)) / data["x"].std(0), dtype)
    k, y = jnp.asarray(data["k"], dtype), jnp.asarray(data["y"], dtype)
    for name in LOSSES:
        assert jnp.isfinite(head_loss(params, state, features, k, y, loss=name))
    assert jnp.isfinite(head_distribution(params, state, features, k).log_prob(y)).all()


def test_bad_arguments_raise_value_error():
    p = _problem(jnp.float64)
    c, key = p["constraint"], jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="scale"):
        init_head(key, IN_FEATURES, c, scale="full")
    with pytest.raises(ValueError, match="min_scale"):
        init_head(key, IN_FEATURES, c, min_scale=-1.0)
    with pytest.raises(ValueError, match="init_scale"):
        init_head(key, IN_FEATURES, c, min_scale=0.5, init_scale=0.4)
    with pytest.raises(ValueError, match="output_scale"):
        init_head(key, IN_FEATURES, c, output_scale=np.zeros(N))
    with pytest.raises(ValueError, match="output_loc"):
        init_head(key, IN_FEATURES, c, output_loc=np.zeros(N + 2))
    with pytest.raises(ValueError, match="LinearConstraint"):
        init_head(key, IN_FEATURES, np.ones((1, N)))
    with pytest.raises(ValueError, match="metric"):
        init_head(key, IN_FEATURES, c, metric=-np.ones(N))
    params, state = init_head(key, IN_FEATURES, c, dtype=jnp.float64)
    with pytest.raises(ValueError, match="loss"):
        head_loss(params, state, p["features"], p["k"], p["target"], loss="mae")
    with pytest.raises(ValueError, match="prediction"):
        head_distribution(params, state, p["features"], p["k"], prediction="mean")


@pytest.mark.parametrize("tails", ["gaussian", "student"])
def test_conformal_calibration_covers_on_a_known_conditional_gaussian(tails):
    """A head with the true mean (weights set to W) and every scale 3 times too large,
    calibrated by the default (split conformal, coverage 0.9) on 199 held-out rows and
    tested on 500 more, 20 times over: the calibrated 90% region {M <= chi2_{n-a}(0.9)}
    (SciPy's quantile) covers the test rows 0.9 of the time on average (split conformal's
    expectation is exactly ceil(200 * 0.9) / 200 = 0.9 for any residual distribution; the
    Monte Carlo standard error of the mean of 20 repetitions is about 0.006, the tolerance
    0.02). With Gaussian residuals (the model right up to the factor) the central 90%
    per-output intervals cover 0.9 too; with Student-t residuals, heavier-tailed than the
    model, they cover more, as the docstring says."""
    rng = np.random.default_rng(12)
    repetitions, held_out, tested = 20, 199, 500
    rows = held_out + tested
    x, k, y, (W, s, A) = oracle.known_conditional_gaussian(rng, repetitions * rows, tails=tails)
    constraint = LinearConstraint(jnp.asarray(A))
    _, state = init_head(jax.random.PRNGKey(0), 3, constraint, dtype=jnp.float64)
    raw = np.log(np.expm1(3.0 * s - float(state["min_scale"])))  # scale = 3 s
    params = {
        "mean": {"weight": jnp.asarray(W), "bias": jnp.zeros(6)},
        "raw_scale": jnp.asarray(raw),
    }
    radius = scipy.stats.chi2.ppf(0.9, 6 - 2)
    region, per_output, factors = [], [], []
    for r in range(repetitions):
        rows_r = slice(r * rows, (r + 1) * rows)
        xr, kr, yr = (jnp.asarray(v[rows_r]) for v in (x, k, y))
        calibrated = calibrate_head(params, state, xr[:held_out], kr[:held_out], yr[:held_out])
        dist = head_distribution(params, calibrated, xr[held_out:], kr[held_out:])
        residual = np.asarray(yr[held_out:] - dist.mean)
        mahalanobis = np.sum(np.square(residual / np.asarray(dist.scale)), -1)
        region.append(np.mean(mahalanobis <= radius))
        inside = np.abs(residual) <= 1.6448536269514722 * np.sqrt(np.asarray(dist.variance))
        per_output.append(inside.mean())
        factors.append(float(calibrated["scale_factor"]))
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
    # 199 examples, the shape of the calibration above (JAX compiles nothing new for it).
    x, k, y, (W, s, A) = oracle.known_conditional_gaussian(rng, 199, tails="gaussian")
    constraint = LinearConstraint(jnp.asarray(A))
    params, state = init_head(jax.random.PRNGKey(1), 3, constraint, dtype=jnp.float64)
    x, k, y = jnp.asarray(x), jnp.asarray(k), jnp.asarray(y)
    dist = head_distribution(params, state, x, k)
    mahalanobis = 2.0 * np.asarray(dist.log_prob(dist.mean) - dist.log_prob(y))
    for coverage, rank in ((0.9, 180), (0.5, 100)):  # ceil(200 c)
        want = np.sqrt(np.sort(mahalanobis)[rank - 1] / scipy.stats.chi2.ppf(coverage, 4))
        got = calibrate_head(params, state, x, k, y, coverage=coverage)["scale_factor"]
        np.testing.assert_allclose(float(got), want, rtol=1e-10)


def test_calibrate_rejects_bad_options_and_too_few_examples():
    p = _problem(jnp.float64)  # 3 examples
    params, state = _head(p, jnp.float64)
    args = (params, state, p["features"], p["k"], p["target"])
    with pytest.raises(ValueError, match="too few for a conformal coverage of 0.9"):
        calibrate_head(*args)
    calibrate_head(*args, coverage=0.75)  # ceil(4 * 0.75) = 3 of 3: enough
    with pytest.raises(ValueError, match="method must be one of"):
        calibrate_head(*args, method="ml")
    with pytest.raises(ValueError, match="coverage must lie in"):
        calibrate_head(*args, coverage=1.0)
    # A factor that is not positive and finite (here NaN targets) is an error, as in torch;
    # it was returned, and every later interval was NaN.
    bad = (params, state, p["features"], p["k"], jnp.full_like(p["target"], jnp.nan))
    with pytest.raises(ValueError, match="scale factor of nan"):
        calibrate_head(*bad, method="likelihood")
