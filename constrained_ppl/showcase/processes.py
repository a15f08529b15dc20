"""Three simulated processes for surrogate-model benchmarks (NumPy only).

Each simulator returns plant-like data: few inputs ``x``, outputs ``y`` spanning several
orders of magnitude (trace components next to main flows and heat duties in kW), linear
balances ``A y + B x = b`` that hold exactly before the measurements are rounded to 7
significant digits (so the stored data close them only to about 1e-7 relative),
unmeasured disturbances that make the outputs noisy for given inputs without breaking any
balance, and, with ``ordered=True``, rows in the order of a plant campaign (see
:func:`~constrained_ppl.showcase.process_simulator.campaign_order`), so that a sequential
split extrapolates.

- ``"cstr"``: the mixer, CSTR and flash of :mod:`~constrained_ppl.showcase.process_simulator`
  with its two heat duties: 6 inputs, 17 outputs, 8 balances.
- ``"distillation"``: a column of 4 trays with a total condenser and a partial reboiler
  separating a light key, a heavy key and a heavy impurity: 5 inputs, 38 outputs (the
  component flows of every internal stream, the products, and the two duties), 18
  component balances (one per tray, condenser and reboiler, per component).
- ``"reactor_network"``: two CSTRs in series, part of the feed bypassing the first, and a
  flash: 6 inputs, 24 outputs, 9 balances (two reaction invariants per reactor, five
  separator balances).

:func:`simulate_process` dispatches by name.
"""

from __future__ import annotations

import numpy as np

from constrained_ppl.showcase import process_simulator
from constrained_ppl.showcase.process_simulator import _measured, campaign_order

PROCESSES = ("cstr", "distillation", "reactor_network")


# -- distillation ---------------------------------------------------------------------------

DIST_COMPONENTS = ("LK", "HK", "HI")  # light key, heavy key, heavy impurity
DIST_VOLATILITY = np.array([2.4, 1.0, 0.15])
DIST_TRAYS, DIST_FEED_TRAY = 4, 2  # trays 1..4 from the top; the feed enters tray 2
DIST_INPUT_NAMES = ("F_LK", "F_HK", "F_HI", "reflux_ratio", "boilup_ratio")
_DIST_LOW = np.array([20.0, 20.0, 0.5, 1.0, 1.0])
_DIST_HIGH = np.array([60.0, 60.0, 5.0, 4.0, 4.0])
_DIST_LATENT_HEAT = 3.3e4  # kJ/kmol


def _distillation_streams():
    """Names of the per-component streams, in the order of the outputs."""
    trays = range(1, DIST_TRAYS + 1)
    return (
        ["reflux"]
        + [f"V{j}" for j in trays]
        + [f"L{j}" for j in trays]
        + ["boilup", "distillate", "bottoms"]
    )


def distillation_balances() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(A, B, b)`` of the column: per component, the condenser ``V1 - reflux - D = 0``,
    tray ``j``: ``L_{j-1} + V_{j+1} + F_j - V_j - L_j = 0`` (``L_0`` the reflux,
    ``V_{N+1}`` the boilup), the reboiler ``L_N - boilup - bottoms = 0``. The two duty
    outputs (the last columns) are in no balance."""
    streams = _distillation_streams()
    num_c, num_s = len(DIST_COMPONENTS), len(streams)
    n = num_c * num_s + 2
    rows_a, rows_b = [], []

    def column(stream, c):
        return c * num_s + streams.index(stream)

    def vapour(j):
        return "boilup" if j == DIST_TRAYS + 1 else f"V{j}"

    def liquid(j):
        return "reflux" if j == 0 else f"L{j}"

    for c in range(num_c):
        row = np.zeros(n)
        row[column("V1", c)], row[column("reflux", c)], row[column("distillate", c)] = 1, -1, -1
        rows_a.append(row), rows_b.append(np.zeros(len(DIST_INPUT_NAMES)))
        for j in range(1, DIST_TRAYS + 1):
            row = np.zeros(n)
            row[column(liquid(j - 1), c)] += 1
            row[column(vapour(j + 1), c)] += 1
            row[column(vapour(j), c)] -= 1
            row[column(liquid(j), c)] -= 1
            feed = np.zeros(len(DIST_INPUT_NAMES))
            if j == DIST_FEED_TRAY:
                feed[c] = 1.0
            rows_a.append(row), rows_b.append(feed)
        row = np.zeros(n)
        row[column(liquid(DIST_TRAYS), c)] = 1
        row[column("boilup", c)] = row[column("bottoms", c)] = -1
        rows_a.append(row), rows_b.append(np.zeros(len(DIST_INPUT_NAMES)))
    A, B = np.array(rows_a), np.array(rows_b)
    return A, B, np.zeros(A.shape[0])


def _distillation(x: np.ndarray, efficiency: np.ndarray, pressure: np.ndarray) -> np.ndarray:
    """Split-fraction (Kremser-type) tray model solved exactly per component: stage ``j``
    sends the fraction ``phi = alpha S / (1 + alpha S)`` of what enters it up as vapour
    and the rest down, the stripping factor ``S`` set by the section's vapour-to-liquid
    ratio; the linear stage-to-stage system is solved per example and component."""
    feed, reflux_ratio, boilup_ratio = x[:, :3], x[:, 3], x[:, 4]
    num, stages = len(x), DIST_TRAYS + 1  # trays 1..N and the reboiler
    # Tray efficiency flattens the volatilities; the pressure disturbance shifts them all.
    alpha = DIST_VOLATILITY[None, :] ** efficiency[:, None] * pressure[:, None]
    rectifying = (reflux_ratio + 1.0) / reflux_ratio
    stripping = (boilup_ratio + 1.0) / boilup_ratio
    # Stripping factor per stage (example, stage): rectifying above the feed, else stripping.
    s = np.where(
        np.arange(1, stages + 1)[None, :] < DIST_FEED_TRAY, rectifying[:, None], stripping[:, None]
    )
    s = s * 0.8
    phi = alpha[:, None, :] * s[:, :, None] / (1.0 + alpha[:, None, :] * s[:, :, None])
    phi[:, -1, :] = boilup_ratio[:, None] * alpha / (1.0 + boilup_ratio[:, None] * alpha)
    keep = reflux_ratio / (reflux_ratio + 1.0)  # fraction of V1 returned as reflux
    # Unknowns: what enters each stage, t_j. t_j = l_{j-1} + v_{j+1} + f_j, with
    # l_{j-1} = (1 - phi_{j-1}) t_{j-1} (l_0 = keep * phi_1 t_1), v_{j+1} = phi_{j+1} t_{j+1}.
    matrix = np.zeros((num, 3, stages, stages))
    index = np.arange(stages)
    matrix[:, :, index, index] = 1.0
    phi_t = np.moveaxis(phi, 1, 2)  # (num, component, stage)
    matrix[:, :, 0, 0] -= keep[:, None] * phi_t[:, :, 0]
    for j in range(1, stages):
        matrix[:, :, j, j - 1] -= 1.0 - phi_t[:, :, j - 1]
        matrix[:, :, j - 1, j] -= phi_t[:, :, j]
    rhs = np.zeros((num, 3, stages))
    rhs[:, :, DIST_FEED_TRAY - 1] = feed
    entering = np.linalg.solve(matrix, rhs[..., None])[..., 0]
    vapour = phi_t * entering  # V_1..V_N, boilup
    liquid = (1.0 - phi_t) * entering  # L_1..L_N, bottoms
    reflux = keep[:, None] * vapour[:, :, 0]
    distillate = vapour[:, :, 0] - reflux
    per_component = np.concatenate(
        [
            reflux[..., None],
            vapour[:, :, :DIST_TRAYS],
            liquid[:, :, :DIST_TRAYS],
            vapour[:, :, -1:],
            distillate[..., None],
            liquid[:, :, -1:],
        ],
        axis=-1,
    )
    duties = (
        _DIST_LATENT_HEAT
        / 3600.0
        * np.stack([vapour[:, :, 0].sum(-1), vapour[:, :, -1].sum(-1)], axis=-1)
    )
    return np.concatenate([per_component.reshape(num, -1), duties], axis=-1)


def simulate_distillation(
    rng: np.random.Generator, num_examples: int, *, digits: int | None = 7, ordered=False
) -> dict:
    """Steady states of the column at random operating points (the reflux ratio rises over
    a campaign); disturbances: the tray efficiency and a pressure shift of the volatilities."""
    unit = rng.uniform(size=(num_examples, len(DIST_INPUT_NAMES)))
    if ordered:
        unit = campaign_order(rng, unit, column=3)
    x = _DIST_LOW + (_DIST_HIGH - _DIST_LOW) * unit
    efficiency = np.clip(0.75 + 0.06 * rng.normal(size=num_examples), 0.4, 1.0)
    pressure = np.exp(0.05 * rng.normal(size=num_examples))
    y = _distillation(x, efficiency, pressure)
    A, B, b = distillation_balances()
    names = [f"{s}_{c}" for c in DIST_COMPONENTS for s in _distillation_streams()]
    names += ["Q_condenser", "Q_reboiler"]
    return _measured(x, y, A, B, b, digits, DIST_INPUT_NAMES, names)


# -- reactor network ------------------------------------------------------------------------

NET_COMPONENTS = ("A", "B", "C", "D", "I")
NET_INPUT_NAMES = ("F_A", "F_I", "bypass", "T1", "T2", "tau")
_NET_LOW = np.array([10.0, 0.5, 0.05, 340.0, 340.0, 0.3])
_NET_HIGH = np.array([30.0, 4.0, 0.4, 400.0, 400.0, 2.0])
# Reactions A -> 2 B, B -> C, A -> D (first order); invariants e . nu = 0.
NET_INVARIANTS = np.array([[2.0, 1.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])
_NET_VOLATILITY = np.array([2.0, 4.0, 0.5, 0.2, 8.0])
_NET_HEAT = np.array([-6.0e4, -8.0e4, -1.1e5])  # kJ/kmol of each reaction


def reactor_network_balances() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(A, B, b)``: outputs are the bypass (A, I), reactor 1's and 2's effluents, the
    flash's top and bottom (A..I each) and the two reactor duties. Rows: reactor 1's
    invariants ``e . R1 + e . bypass = e . feed``; reactor 2's ``e . R2 - e . R1 - e .
    bypass = 0``; the flash ``R2_i - top_i - bottom_i = 0``."""
    num_c = len(NET_COMPONENTS)
    n = 2 + 4 * num_c + 2
    bypass_cols = {0: 0, 4: 1}  # component index -> column of the bypass outputs
    r1, r2, top, bottom = (2 + i * num_c for i in range(4))
    rows_a, rows_b = [], []
    for e in NET_INVARIANTS:
        row = np.zeros(n)
        row[r1 : r1 + num_c] = e
        for c, col in bypass_cols.items():
            row[col] = e[c]
        feed = np.zeros(len(NET_INPUT_NAMES))
        feed[0], feed[1] = -e[0], -e[4]  # A y + B x = 0: B x = -e . feed
        rows_a.append(row), rows_b.append(feed)
    for e in NET_INVARIANTS:
        row = np.zeros(n)
        row[r2 : r2 + num_c] = e
        row[r1 : r1 + num_c] -= e
        for c, col in bypass_cols.items():
            row[col] -= e[c]
        rows_a.append(row), rows_b.append(np.zeros(len(NET_INPUT_NAMES)))
    for c in range(num_c):
        row = np.zeros(n)
        row[r2 + c], row[top + c], row[bottom + c] = 1.0, -1.0, -1.0
        rows_a.append(row), rows_b.append(np.zeros(len(NET_INPUT_NAMES)))
    A, B = np.array(rows_a), np.array(rows_b)
    return A, B, np.zeros(A.shape[0])


def _cstr(inlet: np.ndarray, temperature, tau, activity):
    """Closed-form CSTR for A -> 2B, B -> C, A -> D (first order): effluent and duty (kW)."""
    inverse_t = 1.0 / temperature - 1.0 / 370.0
    k1 = activity * 1.5 * np.exp(-6000.0 * inverse_t)
    k2 = activity * 0.4 * np.exp(-9000.0 * inverse_t)
    k3 = activity * 0.08 * np.exp(-11000.0 * inverse_t)
    a_out = inlet[:, 0] / (1.0 + (k1 + k3) * tau)
    b_out = (inlet[:, 1] + 2.0 * k1 * tau * a_out) / (1.0 + k2 * tau)
    c_out = inlet[:, 2] + k2 * tau * b_out
    d_out = inlet[:, 3] + k3 * tau * a_out
    extents = np.stack([k1 * tau * a_out, k2 * tau * b_out, k3 * tau * a_out], axis=-1)
    duty = -(extents @ _NET_HEAT) / 3600.0
    return np.stack([a_out, b_out, c_out, d_out, inlet[:, 4]], axis=-1), duty


def _reactor_network(x, activity, vapour_shift):
    f_a, f_i, bypass, t1, t2, tau = x.T
    num = len(x)
    feed = np.zeros((num, 5))
    feed[:, 0], feed[:, 4] = f_a, f_i
    bypassed = feed * bypass[:, None]
    r1, q1 = _cstr(feed - bypassed, t1, tau, activity[:, 0])
    r2, q2 = _cstr(r1 + bypassed, t2, tau, activity[:, 1])
    logit = (t2 - 370.0) / 25.0 + vapour_shift
    psi = 1.0 / (1.0 + np.exp(-logit))
    split = _NET_VOLATILITY * psi[:, None] / (1.0 - psi[:, None] + _NET_VOLATILITY * psi[:, None])
    top = r2 * split
    return np.concatenate(
        [bypassed[:, [0, 4]], r1, r2, top, r2 - top, np.stack([q1, q2], axis=-1)], axis=-1
    )


def simulate_reactor_network(
    rng: np.random.Generator, num_examples: int, *, digits: int | None = 7, ordered=False
) -> dict:
    """Steady states of the network at random operating points (reactor 1's temperature
    rises over a campaign); disturbances: each reactor's catalyst activity and the flash's
    vapour fraction."""
    unit = rng.uniform(size=(num_examples, len(NET_INPUT_NAMES)))
    if ordered:
        unit = campaign_order(rng, unit, column=3)
    x = _NET_LOW + (_NET_HIGH - _NET_LOW) * unit
    activity = np.exp(0.15 * rng.normal(size=(num_examples, 2)))
    vapour_shift = 0.25 * rng.normal(size=num_examples)
    y = _reactor_network(x, activity, vapour_shift)
    A, B, b = reactor_network_balances()
    names = [f"bypass_{c}" for c in ("A", "I")]
    names += [f"{s}_{c}" for s in ("R1", "R2", "top", "bottom") for c in NET_COMPONENTS]
    names += ["Q_R1", "Q_R2"]
    return _measured(x, y, A, B, b, digits, NET_INPUT_NAMES, names)


def simulate_process(
    name: str, rng: np.random.Generator, num_examples: int, *, ordered: bool = False
) -> dict:
    """Data of the named process (one of :data:`PROCESSES`), 7 significant digits."""
    if name == "cstr":
        return process_simulator.simulate(rng, num_examples, duties=True, ordered=ordered)
    if name == "distillation":
        return simulate_distillation(rng, num_examples, ordered=ordered)
    if name == "reactor_network":
        return simulate_reactor_network(rng, num_examples, ordered=ordered)
    raise ValueError(f"process must be one of {PROCESSES}, got {name!r}")
