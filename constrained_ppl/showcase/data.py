"""The showcase's synthetic data: plain NumPy from a seeded generator.

Kept free of torch and JAX so that ``pyro_constrained.showcase`` and
``numpyro_constrained.showcase`` build the very same data from the same seed, each with
only its own framework installed.
"""

from __future__ import annotations

import numpy as np

# Pauling electronegativities (eV-like units) and chemical hardnesses of H, C, N, O: only
# their ordering matters for a plausible synthetic charge model.
ELECTRONEGATIVITY = np.array([2.20, 2.55, 3.04, 3.44])
HARDNESS = np.array([6.4, 5.0, 7.2, 6.1])
ELEMENT_FREQUENCY = np.array([0.45, 0.35, 0.1, 0.1])


def make_sparse_regression(
    rng: np.random.Generator, n_data: int, n_features: int, k: int, noise: float
) -> dict:
    """Linear regression data in which only ``k`` of ``n_features`` inputs matter."""
    X = rng.normal(size=(n_data, n_features))
    support = np.sort(rng.choice(n_features, size=k, replace=False))
    coef = np.zeros(n_features)
    coef[support] = rng.choice([-1.0, 1.0], size=k) * rng.uniform(1.0, 2.0, size=k)
    y = X @ coef + noise * rng.normal(size=n_data)
    return {"X": X, "y": y, "coef": coef, "support": support, "noise": noise}


def make_molecules(
    rng: np.random.Generator, n_molecules: int, n_atoms: int, noise: float = 0.05
) -> dict:
    """Synthetic molecules with per-atom partial charges summing to the total charge.

    Each molecule is a random tree of ``n_atoms`` atoms (H, C, N, O). An atom's
    electronegativity is its element's value shifted by its neighbours' (an inductive
    effect) plus noise; charge equilibration then minimises
    ``sum_i chi_i q_i + eta_i q_i^2 / 2`` subject to ``sum_i q_i = Q``, whose solution is
    ``q_i = (lambda - chi_i) / eta_i``. With noise of variance ``noise^2 eta_i`` on
    ``chi_i`` the charges are exactly ``N(-chi_bar / eta, noise^2 / eta)`` conditioned on
    ``sum q = Q``: a LinearConstrainedNormal whose location is linear in the features
    returned here (element one-hot, and element one-hot times neighbour counts).
    """
    n_elements = len(ELECTRONEGATIVITY)
    elements = rng.choice(n_elements, size=(n_molecules, n_atoms), p=ELEMENT_FREQUENCY)
    neighbour_counts = np.zeros((n_molecules, n_atoms, n_elements))
    rows = np.arange(n_molecules)
    for atom in range(1, n_atoms):
        parent = rng.integers(0, atom, size=n_molecules)
        neighbour_counts[rows, atom, elements[rows, parent]] += 1
        neighbour_counts[rows, parent, elements[rows, atom]] += 1
    one_hot = np.eye(n_elements)[elements]
    features = np.concatenate(
        [
            one_hot,
            (one_hot[..., :, None] * neighbour_counts[..., None, :]).reshape(
                n_molecules, n_atoms, -1
            ),
        ],
        axis=-1,
    )
    chi = ELECTRONEGATIVITY[elements]
    chi_bar = chi + 0.15 * (neighbour_counts @ ELECTRONEGATIVITY - neighbour_counts.sum(-1) * chi)
    eta = HARDNESS[elements]
    total = rng.choice([-1.0, 0.0, 0.0, 0.0, 1.0], size=n_molecules)
    loc = -chi_bar / eta
    scale = noise / np.sqrt(eta)
    weights = scale**2
    # Conditioning N(loc, diag(scale^2)) on the sum: shift along the weights.
    mean = loc + weights * ((total - loc.sum(-1)) / weights.sum(-1))[:, None]
    x = loc + scale * rng.normal(size=loc.shape)
    charges = x + weights * ((total - x.sum(-1)) / weights.sum(-1))[:, None]
    return {
        "features": features,
        "elements": elements,
        "total": total,
        "charges": charges,
        "mean_charges": mean,
    }


def make_bags(rng: np.random.Generator, n_bags: int, rate: np.ndarray) -> dict:
    """Bags holding ``exposure[b, j]`` units of type ``j`` and a known total count.

    The per-type counts ``counts[b, j] ~ Poisson(exposure[b, j] rate[j])`` are hidden;
    only ``total[b] = sum_j counts[b, j]`` and the exposures are observed.
    """
    # Shape 1/2: most bags are dominated by one or two types, which is what lets the
    # per-type rates be told apart from totals alone.
    exposure = rng.gamma(0.5, 2.0, size=(n_bags, len(rate)))
    counts = rng.poisson(exposure * rate)
    return {"exposure": exposure, "counts": counts, "total": counts.sum(-1), "rate": rate}
