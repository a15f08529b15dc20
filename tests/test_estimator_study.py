"""The gradient-estimator study (issue 7): metrics, ground truths, unbiasedness, the CLI.

References: hand-computed cosine distances; enumeration / null-space oracles with finite
differences for the ground-truth gradients (tests/oracles/gradient_study.py); Monte-Carlo
means with stated tolerances for the estimators theory calls unbiased.
"""

import csv
import math

import numpy as np
import pytest
import torch

from experiments.estimator_study import estimators, gradient_estimators, metrics, synthetic
from tests.oracles import gradient_study as oracle

# A Monte-Carlo mean is accepted as unbiased when every coordinate is within this many
# standard errors of the truth: with <= 16 coordinates the chance that an unbiased estimator
# fails is below 16 * 7e-6 ~ 1e-4.
Z_TOLERANCE = 4.5


def _generator(seed):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- metrics


def test_metrics_of_exact_estimates_are_zero():
    truth = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    estimates = torch.stack([truth, 2 * truth, 0.5 * truth])  # same direction, any length
    result = metrics.gradient_metrics(estimates, truth)
    assert result == pytest.approx({"bias": 0.0, "variance": 0.0, "error": 0.0}, abs=1e-12)


@pytest.mark.parametrize(("estimate", "distance"), [([0.0, 3.0], 1.0), ([-2.0, 0.0], 2.0)])
def test_metrics_of_orthogonal_and_opposite_estimates(estimate, distance):
    truth = torch.tensor([1.0, 0.0], dtype=torch.float64)
    estimates = torch.tensor([estimate] * 4, dtype=torch.float64)
    result = metrics.gradient_metrics(estimates, truth)
    assert result == pytest.approx({"bias": distance, "variance": 0.0, "error": distance})


def test_metrics_against_hand_computed_values():
    # h = e1, e2, e1 + e2; mean (2/3, 2/3) points along (1, 1). With a = 1 - 1/sqrt(2):
    # distances to the mean are (a, a, 0): variance = 2 a^2 / 9 (population variance);
    # to the truth e1: bias a, error (0 + 1 + a) / 3.
    a = 1 - 1 / math.sqrt(2)
    estimates = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    truth = torch.tensor([5.0, 0.0], dtype=torch.float64)
    result = metrics.gradient_metrics(estimates, truth)
    assert result == pytest.approx({"bias": a, "variance": 2 * a**2 / 9, "error": (1 + a) / 3})


def test_a_zero_estimate_has_cosine_distance_one():
    zero, truth = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
    assert float(metrics.cosine_distance(zero, truth)) == 1.0


def test_metrics_reject_bad_shapes():
    with pytest.raises(ValueError, match="estimates"):
        metrics.gradient_metrics(torch.ones(3), torch.ones(3))
    with pytest.raises(ValueError, match="true_gradient"):
        metrics.gradient_metrics(torch.ones(5, 3), torch.ones(4))


def test_bias_floor_predicts_the_bias_of_an_unbiased_estimator():
    # h_j = h_true + N(0, s^2 I_p): E[bias] ~ (p - 1) s^2 / (2 S |h_true|^2) to second order.
    rng = torch.Generator().manual_seed(1)
    p, num_samples, s = 6, 500, 0.5
    truth = torch.ones(p, dtype=torch.float64)
    expected = (p - 1) * s**2 / (2 * num_samples * p)
    biases, floors = [], []
    for _ in range(400):
        noise = torch.randn(num_samples, p, generator=rng, dtype=torch.float64)
        estimates = truth + s * noise
        biases.append(metrics.gradient_metrics(estimates, truth)["bias"])
        floors.append(metrics.unbiased_bias_floor(estimates, truth))
    # 400 draws of a scaled chi-square(5): the mean has a relative sd of ~3%.
    assert np.mean(biases) == pytest.approx(expected, rel=0.15)
    assert np.mean(floors) == pytest.approx(expected, rel=0.02)


# ------------------------------------------------------------------ ground-truth gradients


def test_bernoulli_true_gradient_matches_enumeration():
    problem = synthetic.bernoulli_problem(6, 3, "l2", _generator(0))
    target = problem.target.numpy()
    reference = oracle.finite_difference_gradient(
        lambda logits: oracle.bernoulli_expected_loss(logits, 3, target, "l2"),
        problem.params["logits"].numpy(),
    )
    np.testing.assert_allclose(problem.true_gradient().numpy(), reference, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("loss", ["l1", "l2"])
def test_poisson_true_gradient_matches_enumeration(loss):
    problem = synthetic.poisson_problem(4, 4, loss, _generator(1))
    target = problem.target.numpy()
    reference = oracle.finite_difference_gradient(
        lambda rate: oracle.poisson_expected_loss(rate, 4, target, loss),
        problem.params["rate"].numpy(),
    )
    np.testing.assert_allclose(problem.true_gradient().numpy(), reference, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(("loss", "constraint"), [("l1", "sum"), ("l2", "general")])
def test_gaussian_true_gradient_matches_null_space_oracle(loss, constraint):
    problem = synthetic.gaussian_problem(5, loss, constraint, _generator(2))
    A, k, target = problem.A.numpy(), problem.k.numpy(), problem.target.numpy()

    def expected_loss(theta):
        return oracle.gaussian_expected_loss(theta[:5], theta[5:], A, k, target, loss)

    theta = torch.cat([problem.params["loc"], problem.params["scale"]]).numpy()
    reference = oracle.finite_difference_gradient(expected_loss, theta)
    np.testing.assert_allclose(problem.true_gradient().numpy(), reference, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------ unbiasedness


def _z_scores(estimates, truth):
    mean = estimates.mean(0)
    standard_error = estimates.std(0) / math.sqrt(estimates.shape[0])
    return (mean - truth) / standard_error


UNBIASED_CASES = [
    ("score_function", lambda g: synthetic.bernoulli_problem(6, 3, "l2", g), 20_000),
    ("score_function", lambda g: synthetic.poisson_problem(4, 4, "l1", g), 20_000),
    ("score_function", lambda g: synthetic.gaussian_problem(5, "l1", "general", g), 20_000),
    ("pathwise", lambda g: synthetic.gaussian_problem(5, "l1", "general", g), 20_000),
    ("pathwise", lambda g: synthetic.gaussian_problem(8, "l2", "sum", g), 20_000),
]


@pytest.mark.parametrize(("name", "make_problem", "num_samples"), UNBIASED_CASES)
def test_unbiased_estimators_average_to_the_true_gradient(name, make_problem, num_samples):
    problem = make_problem(_generator(3))
    estimates = gradient_estimators.ESTIMATORS[name](problem, num_samples)
    truth = problem.true_gradient()
    assert estimates.shape == (num_samples, problem.num_params)
    z_scores = _z_scores(estimates, truth)
    assert z_scores.abs().max() < Z_TOLERANCE, z_scores
    # The check has power: the standard errors are small next to the gradient itself.
    assert float((estimates.std(0) / math.sqrt(num_samples)).norm() / truth.norm()) < 0.1


def test_the_unbiasedness_check_detects_the_marginal_expectation_bias():
    # Bernoulli, L2: grad_z l = 2 (z - b), so the estimator's mean is J_mu^T 2 (mu - b),
    # while the truth is J_mu^T (1 - 2 b) (because z_i^2 = z_i). Check the first against
    # enumeration, and that the same test as above rejects it as an unbiased estimator.
    problem = synthetic.bernoulli_problem(6, 3, "l2", _generator(3))
    logits, target = problem.params["logits"].numpy(), problem.target.numpy()
    marginals = [
        oracle.finite_difference_gradient(
            lambda x, e=e: oracle.bernoulli_expected_loss(x, 3, e, "l2"), logits
        )
        for e in np.eye(6)
    ]  # d E||z - e_i||^2 = d (sum_j mu_j - 2 mu_i + 1): rows give J_mu by differencing
    mu_total = oracle.finite_difference_gradient(
        lambda x: oracle.bernoulli_expected_loss(x, 3, np.zeros(6), "l2"), logits
    )
    jacobian = (mu_total[None, :] - np.array(marginals)) / 2  # row i: d mu_i / d logits
    mu = np.array(
        [
            (3 - oracle.bernoulli_expected_loss(logits, 3, np.eye(6)[i], "l2") + 1) / 2
            for i in range(6)
        ]
    )
    predicted_mean = jacobian.T @ (2 * (mu - target))

    estimates = gradient_estimators.marginal_expectation(problem, 20_000)
    assert _z_scores(estimates, torch.from_numpy(predicted_mean)).abs().max() < Z_TOLERANCE
    assert _z_scores(estimates, problem.true_gradient()).abs().max() > 10 * Z_TOLERANCE


def test_marginal_expectation_is_unbiased_in_loc_and_biased_in_scale():
    # mu_bar = loc + K (k - A loc) is affine in loc with the same Jacobian I - K A as the
    # Matheron sample, so for loc the two estimators coincide (unbiased); mu_bar ignores
    # how the spread depends on scale, so the scale part is biased.
    problem = synthetic.gaussian_problem(6, "l2", "sum", _generator(5))
    estimates = gradient_estimators.marginal_expectation(problem, 20_000)
    z_scores = _z_scores(estimates, problem.true_gradient())
    assert z_scores[:6].abs().max() < Z_TOLERANCE
    assert z_scores[6:].abs().max() > 10 * Z_TOLERANCE


def test_constrained_layer_with_equal_scales_is_unbiased_for_loc_only():
    # With Sigma = s^2 I the Euclidean projection is Matheron's rule, so the samples are
    # exact and the gradient in loc is unbiased. The gradient in each scale is not: moving
    # one scale makes Sigma unequal, where projection and conditioning part ways.
    problem = synthetic.gaussian_problem(6, "l2", "general", _generator(4))
    equal = dict(problem.params, scale=torch.full((6,), 0.7, dtype=torch.float64))
    problem = synthetic.SyntheticProblem(**{**problem.__dict__, "params": equal})
    estimates = gradient_estimators.constrained_layer(problem, 20_000)
    z_scores = _z_scores(estimates, problem.true_gradient())
    assert z_scores[:6].abs().max() < Z_TOLERANCE
    assert z_scores[6:].abs().max() > 10 * Z_TOLERANCE


def test_estimators_that_need_a_gaussian_refuse_other_families():
    problem = synthetic.poisson_problem(3, 3, "l2", _generator(0))
    for name in gradient_estimators.GAUSSIAN_ONLY:
        with pytest.raises(ValueError, match="Gaussian"):
            gradient_estimators.ESTIMATORS[name](problem, 10)
    assert set(gradient_estimators.estimators_for("poisson")).isdisjoint(
        gradient_estimators.GAUSSIAN_ONLY
    )


# ------------------------------------------------------------------------- the study


def test_tiny_study_writes_the_csv_and_figures(tmp_path):
    config = estimators.StudyConfig(
        num_samples=2_000,
        repeats=2,
        bernoulli_sizes=((6, 3),),
        gaussian_sizes=(4, 6),
        poisson_sizes=(3,),
    )
    rows = estimators.run_study(config, log=lambda line: None)
    estimators.write_outputs(rows, tmp_path)

    with (tmp_path / "estimators.csv").open() as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames) == estimators.COLUMNS
        summary = list(reader)
    cells = 1 + 2 * 2 * 2 + 2  # bernoulli; gaussian constraints x losses x sizes; poisson
    gaussian_cells = 2 * 2 * 2
    assert len(summary) == 6 * (cells - gaussian_cells) + 8 * gaussian_cells
    for row in summary:
        bias, variance, error = (float(row[m]) for m in ("bias", "variance", "error"))
        assert 0 <= bias <= 2 and 0 <= error <= 2 and 0 <= variance <= 1
    # A random direction is as likely to point towards the truth as away: error ~ 1.
    for row in summary:
        if row["estimator"] == "random":
            assert float(row["error"]) == pytest.approx(1.0, abs=0.05)

    with (tmp_path / "estimators_repeats.csv").open() as handle:
        repeats = list(csv.DictReader(handle))
    assert len(repeats) == config.repeats * len(summary)
    # Unbiased estimators show only Monte-Carlo bias: within 15 times the noise floor
    # (a chi-square(1) exceeds 15 with probability 1e-4).
    for row in repeats:
        if row["estimator"] == "pathwise":
            assert float(row["bias"]) < 15 * float(row["bias_floor"]), row
    for name in ("estimators.png", "estimators_vs_n.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_quick_run_writes_the_outputs(tmp_path, monkeypatch):
    tiny = estimators.StudyConfig(
        num_samples=200, repeats=1, gaussian_sizes=(4,), poisson_sizes=(3,), losses=("l2",)
    )
    monkeypatch.setattr(estimators, "QUICK", tiny)
    estimators.main(["--out", str(tmp_path), "--quick"])
    with (tmp_path / "estimators.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 6 + 8 * 2 + 6
