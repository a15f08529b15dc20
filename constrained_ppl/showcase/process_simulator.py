"""A small steady-state mixer-reactor-separator with exact component balances (NumPy only).

Used by the process-surrogate tutorial (``notebooks/06_process_surrogate.ipynb``) and the
regression-head tests as a stand-in for plant data: inputs ``x``, outputs ``y`` with
``A y + B x = b`` holding exactly before the measurements are rounded.

**Flowsheet.** Two feeds are mixed: feed 1 carries A and the inert I, feed 2 carries B and
some C. In a CSTR the series-parallel reactions ``R1: A + B -> C`` and ``R2: A + C -> D``
run with Arrhenius rate constants (R2 has the higher activation energy, so a hotter reactor
converts more but is less selective). A flash separates the effluent into a top and a
bottom stream, each component's split to the top set by its relative volatility and the
vapour fraction, which rises with the reactor temperature.

Inputs ``x`` (6): ``F_A1, F_I1, F_B2, F_C2`` (feed flows, kmol/h), ``T`` (K), ``tau`` (h).
Outputs ``y`` (15): the component flows (A, B, C, D, I) of the reactor effluent, the top
stream and the bottom stream.

**Balances** (``a = 8`` rows, ``n - a = 7`` degrees of freedom):

- separator, one per component: ``effluent_i - top_i - bottom_i = 0``;
- reactor, one per reaction invariant ``e`` (``e^T nu_r = 0`` for both reactions, so the
  unknown extents drop out): ``e^T effluent - e^T (feed 1 + feed 2) = 0``. The invariants
  count A groups (A: 1, C: 1, D: 2), B groups (B, C, D: 1) and the inert.

So ``A y + B x = 0`` (``b = 0``) and a model's right-hand side for one example is
``k = -B x``.

**What makes the data noisy.** Two unmeasured disturbances per example, as a real plant
has: the catalyst activity (log-normal, multiplies both rate constants) and the flash's
vapour fraction (logit-normal around its set point). They move the outputs around their
mean for given inputs but, being physical, never break a balance. As plant historians
store them, inputs and outputs are then rounded to 7 significant digits, so the data
satisfy the balances only to about 1e-7 relative.
"""

from __future__ import annotations

import numpy as np

COMPONENTS = ("A", "B", "C", "D", "I")
STREAMS = ("effluent", "top", "bottom")
INPUT_NAMES = ("F_A1", "F_I1", "F_B2", "F_C2", "T", "tau")
OUTPUT_NAMES = tuple(f"{stream}_{c}" for stream in STREAMS for c in COMPONENTS)

# Stoichiometric coefficients (rows: reactions, columns: A, B, C, D, I).
STOICHIOMETRY = np.array([[-1.0, -1.0, 1.0, 0.0, 0.0], [-1.0, 0.0, -1.0, 1.0, 0.0]])
# Reaction invariants: rows e with e . nu_r = 0 for both reactions.
INVARIANTS = np.array(
    [[1.0, 0.0, 1.0, 2.0, 0.0], [0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]]
)
# Relative volatilities of A, B, C, D, I (the inert is the lightest, D the heaviest).
VOLATILITY = np.array([2.5, 1.8, 0.6, 0.25, 6.0])

_INPUT_LOW = np.array([5.0, 1.0, 5.0, 0.0, 330.0, 0.2])
_INPUT_HIGH = np.array([15.0, 6.0, 15.0, 3.0, 390.0, 2.0])


def round_significant(values: np.ndarray, digits: int = 7) -> np.ndarray:
    """Round each entry to ``digits`` significant decimal digits (zero stays zero)."""
    values = np.asarray(values, dtype=np.float64)
    magnitude = np.floor(np.log10(np.abs(np.where(values == 0, 1.0, values))))
    factor = 10.0 ** (digits - 1 - magnitude)
    return np.round(values * factor) / factor


def balance_matrices() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(A, B, b)`` with ``A y + B x = b`` for every simulated example (exact arithmetic).

    ``A`` is (8, 15), ``B`` (8, 6), ``b`` zeros (8,). Rows 0-4: separator balances; rows
    5-7: reactor invariant balances.
    """
    num_c = len(COMPONENTS)
    eye = np.eye(num_c)
    separator = np.hstack([eye, -eye, -eye])
    reactor = np.hstack([INVARIANTS, np.zeros((3, num_c)), np.zeros((3, num_c))])
    A = np.vstack([separator, reactor])
    # Reactor inlet (A, B, C, D, I) as a linear map of the inputs (feed flows only).
    inlet = np.zeros((num_c, len(INPUT_NAMES)))
    inlet[0, 0] = inlet[4, 1] = inlet[1, 2] = inlet[2, 3] = 1.0
    B = np.vstack([np.zeros((num_c, len(INPUT_NAMES))), -INVARIANTS @ inlet])
    return A, B, np.zeros(A.shape[0])


# Heats of reaction (kJ/kmol, exothermic) and the latent heat of the flash (kJ/kmol).
_HEAT_OF_REACTION = np.array([-9.0e4, -1.4e5])
_LATENT_HEAT = 3.2e4


def _reactor_and_flash(
    x: np.ndarray, activity: np.ndarray, vapour_shift: np.ndarray, duties: bool = False
):
    f_a1, f_i1, f_b2, f_c2, temperature, tau = x.T
    n_a, n_b, n_c, n_i = f_a1, f_b2, f_c2, f_i1
    inverse_t = 1.0 / temperature - 1.0 / 360.0
    k1 = activity * 1.2 * np.exp(-7000.0 * inverse_t)
    k2 = activity * 0.35 * np.exp(-12000.0 * inverse_t)
    # Extents in closed form: each reaction converts a saturating fraction of its limiting
    # pair (x y / (x + y) <= min(x, y)), so no flow can become negative.
    xi1 = n_a * n_b / (n_a + n_b) * -np.expm1(-k1 * tau)
    a_left, c_now = n_a - xi1, n_c + xi1
    xi2 = a_left * c_now / (a_left + c_now) * -np.expm1(-k2 * tau)
    effluent = np.stack([a_left - xi2, n_b - xi1, c_now - xi2, xi2, n_i], axis=-1)
    # Vapour fraction rises with temperature; its logit is disturbed.
    logit = (temperature - 360.0) / 20.0 + vapour_shift
    psi = 1.0 / (1.0 + np.exp(-logit))
    split = VOLATILITY * psi[:, None] / (1.0 - psi[:, None] + VOLATILITY * psi[:, None])
    top = effluent * split
    bottom = effluent - top
    flows = [effluent, top, bottom]
    if duties:
        # Heat removed from the reactor and added in the flash (kW): outside the balances.
        reactor = -(_HEAT_OF_REACTION[0] * xi1 + _HEAT_OF_REACTION[1] * xi2) / 3600.0
        flash = _LATENT_HEAT * top.sum(-1) / 3600.0
        flows.append(np.stack([reactor, flash], axis=-1))
    return np.concatenate(flows, axis=-1)


def simulate(
    rng: np.random.Generator,
    num_examples: int,
    *,
    activity_sd: float = 0.15,
    vapour_sd: float = 0.25,
    digits: int | None = 7,
    duties: bool = False,
    ordered: bool = False,
) -> dict:
    """Simulate ``num_examples`` steady states at random operating points.

    :param rng: NumPy random generator (the only source of randomness).
    :param activity_sd: standard deviation of the log catalyst activity.
    :param vapour_sd: standard deviation of the disturbance of the vapour-fraction logit.
    :param digits: significant digits the measurements are rounded to (None: no rounding).
    :param duties: append the reactor's and the flash's heat duties (kW, outside the
        balances: ``A`` and ``B`` get zero columns / rows for them) to the outputs.
    :param ordered: rows in the order of a plant campaign (see :func:`campaign_order`),
        so that a sequential split extrapolates; otherwise independent operating points.
    :returns: dict with ``x`` (num_examples, 6), ``y`` (num_examples, 15, or 17 with
        ``duties``), ``k = -B x``
        (num_examples, 8) computed from the rounded inputs, ``A``, ``B``, ``b``, and the
        input and output names.
    """
    unit = rng.uniform(size=(num_examples, 6))
    if ordered:
        unit = campaign_order(rng, unit, column=4)
    x = _INPUT_LOW + (_INPUT_HIGH - _INPUT_LOW) * unit
    activity = np.exp(activity_sd * rng.normal(size=num_examples))
    vapour_shift = vapour_sd * rng.normal(size=num_examples)
    y = _reactor_and_flash(x, activity, vapour_shift, duties)
    A, B, b = balance_matrices()
    names = OUTPUT_NAMES
    if duties:
        A = np.hstack([A, np.zeros((A.shape[0], 2))])
        names = names + ("Q_reactor", "Q_flash")
    return _measured(x, y, A, B, b, digits, INPUT_NAMES, names)


def _measured(x, y, A, B, b, digits, input_names, output_names) -> dict:
    """The data set as a plant historian stores it: rounded to ``digits`` significant
    digits, ``k = b - B x`` from the rounded inputs."""
    if digits is not None:
        x = round_significant(x, digits)
        y = round_significant(y, digits)
    return {
        "x": x,
        "y": y,
        "k": b - x @ B.T,
        "A": A,
        "B": B,
        "b": b,
        "input_names": tuple(input_names),
        "output_names": tuple(output_names),
    }


def campaign_order(rng: np.random.Generator, unit: np.ndarray, column: int) -> np.ndarray:
    """Reorder operating points (rows of ``unit``, inputs scaled to [0, 1]) as a campaign
    would visit them: ``column`` (a temperature or a throughput) is raised over time, with
    scatter, so the last rows lie mostly beyond the range of the first ones and a
    sequential split tests extrapolation."""
    key = unit[:, column] + 0.3 * rng.uniform(size=len(unit))
    return unit[np.argsort(key, kind="stable")]


def relative_violation(A: np.ndarray, y: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per-example max over rows of ``|A y - k| / (|A| |y| + |k|)`` (the support's measure)."""
    residual = np.abs(y @ A.T - k)
    bound = np.abs(y) @ np.abs(A).T + np.abs(k)
    return (residual / bound).max(-1)
