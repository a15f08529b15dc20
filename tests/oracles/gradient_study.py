"""Independent references for the gradient-estimator study (NumPy / SciPy only).

Expected losses ``E_{z ~ p(z | constraint)} l(z, y)`` computed without the library's
closed forms: by enumerating the support (k-subsets; compositions of k) or, for the
Gaussian, by parameterising the subspace ``A z = k`` with a null-space basis (a different
derivation from Matheron's rule) and integrating each coordinate's marginal numerically.
Gradients of these by central finite differences.
"""

import itertools

import numpy as np
from scipy import integrate, linalg, special, stats


def _pointwise(z, target, loss):
    diff = np.asarray(z, dtype=np.float64) - np.asarray(target, dtype=np.float64)
    return np.abs(diff).sum(-1) if loss == "l1" else (diff**2).sum(-1)


def bernoulli_expected_loss(logits, k: int, target, loss: str) -> float:
    """Sum over all k-subsets z of p(z) l(z, y), p(z) ∝ exp(logits . z)."""
    logits = np.asarray(logits, dtype=np.float64)
    n = logits.shape[-1]
    subsets = np.zeros((int(special.comb(n, k, exact=True)), n))
    for row, ones in enumerate(itertools.combinations(range(n), k)):
        subsets[row, list(ones)] = 1.0
    scores = subsets @ logits
    probs = np.exp(scores - special.logsumexp(scores))
    return float(probs @ _pointwise(subsets, target, loss))


def compositions(n: int, k: int) -> np.ndarray:
    """All integer vectors z >= 0 of length n with sum k, shape (C(n + k - 1, k), n)."""
    rows = []
    for bars in itertools.combinations(range(n + k - 1), n - 1):
        edges = (-1, *bars, n + k - 1)
        rows.append([edges[i + 1] - edges[i] - 1 for i in range(n)])
    return np.array(rows, dtype=np.float64)


def poisson_expected_loss(rate, k: int, target, loss: str) -> float:
    """Sum over the support of independent Poissons conditioned on sum = k (SciPy's
    Poisson pmfs, renormalised over the compositions of k)."""
    rate = np.asarray(rate, dtype=np.float64)
    support = compositions(rate.shape[-1], k)
    weights = np.exp(stats.poisson.logpmf(support, rate).sum(-1))
    weights /= weights.sum()
    return float(weights @ _pointwise(support, target, loss))


def gaussian_conditional(loc, scale, A, k):
    """Mean and covariance of N(loc, diag(scale^2)) conditioned on A z = k, via z = z0 + N w
    with N an orthonormal null-space basis of A: w is Gaussian with precision
    N^T Sigma^{-1} N and mean solving the normal equations."""
    loc, scale, A, k = (np.asarray(x, dtype=np.float64) for x in (loc, scale, A, k))
    null = linalg.null_space(A)
    z0 = np.linalg.lstsq(A, k, rcond=None)[0]
    precision = 1.0 / scale**2
    w_precision = null.T @ (precision[:, None] * null)
    w_mean = np.linalg.solve(w_precision, null.T @ (precision * (loc - z0)))
    return z0 + null @ w_mean, null @ np.linalg.solve(w_precision, null.T)


def gaussian_expected_loss(loc, scale, A, k, target, loss: str) -> float:
    """Sum over coordinates of E l(z_i, y_i) under the conditional marginals, by quadrature
    for L1 and mean / variance for L2."""
    mean, cov = gaussian_conditional(loc, scale, A, k)
    target = np.asarray(target, dtype=np.float64)
    sd = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    if loss == "l2":
        return float(((mean - target) ** 2 + sd**2).sum())
    total = 0.0
    for m, s, y in zip(mean, sd, target, strict=True):
        value, _ = integrate.quad(
            lambda x, m=m, s=s, y=y: abs(x - y) * stats.norm.pdf(x, m, s),
            m - 12 * s,
            m + 12 * s,
            points=[y] if abs(y - m) < 12 * s else None,
            epsabs=1e-12,
            epsrel=1e-12,
            limit=200,
        )
        total += value
    return total


def finite_difference_gradient(f, x, step: float = 1e-5) -> np.ndarray:
    """Central differences of a scalar function of a 1-D float64 array."""
    x = np.asarray(x, dtype=np.float64)
    grad = np.empty_like(x)
    for i in range(x.size):
        up, down = x.copy(), x.copy()
        up[i] += step
        down[i] -= step
        grad[i] = (f(up) - f(down)) / (2 * step)
    return grad
