"""Brute-force references over all 2^n binary vectors of independent Bernoullis given by
their ``probs`` (exact 0s and 1s included), and one-sided finite differences for the
derivatives at those edges. NumPy only (never the library)."""

import itertools

import numpy as np


def all_vectors(n: int) -> np.ndarray:
    """Every vector in {0, 1}^n, shape (2^n, n), float64."""
    return np.array(list(itertools.product([0.0, 1.0], repeat=n)))


def masses(probs: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """The unconstrained probability of each vector (rows of ``vectors``)."""
    return np.prod(np.where(vectors == 1, probs, 1 - probs), axis=-1)


def entropy(masses: np.ndarray) -> float:
    masses = masses[masses > 0]
    return float(-(masses * np.log(masses)).sum())


def kl(p_masses: np.ndarray, q_masses: np.ndarray) -> float:
    keep = p_masses > 0
    return float((p_masses[keep] * np.log(p_masses[keep] / q_masses[keep])).sum())


def one_sided_derivatives(function, x: np.ndarray, step: float = 1e-6) -> np.ndarray:
    """Derivatives of a scalar function: central differences inside (0, 1), one-sided
    second-order ones at exact 0 (forward) and 1 (backward)."""
    out = np.zeros(len(x))
    for i in range(len(x)):
        e = np.eye(len(x))[i] * step
        if 0 < x[i] < 1:
            out[i] = (function(x + e) - function(x - e)) / (2 * step)
        else:
            h = e if x[i] == 0 else -e
            out[i] = (-3 * function(x) + 4 * function(x + h) - function(x + 2 * h)) / (
                2 * step * np.sign(h.sum())
            )
    return out
