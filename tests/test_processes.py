"""The simulated processes of the surrogate benchmark (constrained_ppl.showcase.processes):
balances exact before rounding, closed to the rounding's precision after it, positive flows,
several orders of magnitude, and a campaign order whose last rows extrapolate."""

import numpy as np
import pytest

from constrained_ppl.showcase import process_simulator
from constrained_ppl.showcase.processes import (
    PROCESSES,
    simulate_distillation,
    simulate_process,
    simulate_reactor_network,
)

UNROUNDED = {
    "cstr": lambda rng, n: process_simulator.simulate(rng, n, duties=True, digits=None),
    "distillation": lambda rng, n: simulate_distillation(rng, n, digits=None),
    "reactor_network": lambda rng, n: simulate_reactor_network(rng, n, digits=None),
}


@pytest.mark.parametrize("name", PROCESSES)
def test_balances_hold_and_data_look_like_a_plant(name):
    exact = UNROUNDED[name](np.random.default_rng(3), 400)
    A, B, b, x, y = exact["A"], exact["B"], exact["b"], exact["x"], exact["y"]
    assert np.linalg.matrix_rank(A) == A.shape[0]
    # The balances, checked from A, B, b directly (not through k), before rounding.
    residual = np.abs(y @ A.T + x @ B.T - b)
    assert (residual <= 1e-12 * (np.abs(y) @ np.abs(A).T + np.abs(x) @ np.abs(B).T)).all()
    assert (y > 0).all()
    assert np.abs(y).max() / np.abs(y).min() > 1e4  # outputs over several orders of magnitude
    assert len(exact["output_names"]) == y.shape[1] and len(exact["input_names"]) == x.shape[1]
    # Stored to 7 significant digits: the balances close to about 1e-7, not better.
    stored = simulate_process(name, np.random.default_rng(3), 400)
    violation = process_simulator.relative_violation(stored["A"], stored["y"], stored["k"])
    assert 1e-8 < violation.max() < 1e-6


@pytest.mark.parametrize("name", PROCESSES)
def test_campaign_order_makes_the_last_rows_extrapolate(name):
    ordered = simulate_process(name, np.random.default_rng(4), 1000, ordered=True)
    x = ordered["x"]
    # The drifting input of the last 20% lies mostly beyond the first 60%'s 90th percentile.
    spread = x.std(0)
    column = int(np.argmax(np.abs(x[800:].mean(0) - x[:600].mean(0)) / spread))
    assert np.mean(x[800:, column] > np.quantile(x[:600, column], 0.9)) > 0.5


def test_cstr_outputs_without_duties_are_unchanged_by_the_new_options():
    plain = process_simulator.simulate(np.random.default_rng(5), 50)
    with_duties = process_simulator.simulate(np.random.default_rng(5), 50, duties=True)
    np.testing.assert_array_equal(with_duties["y"][:, :15], plain["y"])
    assert with_duties["y"].shape == (50, 17) and with_duties["A"].shape == (8, 17)
