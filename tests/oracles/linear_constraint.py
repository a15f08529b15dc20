"""NumPy / SciPy references for ``LinearConstraint``: projection, residual, support tolerance.

Computed by other routes than the library: the Euclidean projection by the KKT system
``[[I, A^T], [A, 0]] [z; lambda] = [y; k]`` and by ``numpy.linalg.lstsq`` (the minimum-norm
correction), the support test by its definition evaluated in float64, and the density by
SciPy's singular normal at the projected point (SciPy reads a point through the range of
the conditional covariance, i.e. at its Euclidean projection onto the subspace) where the
point passes the support test, ``-inf`` elsewhere.
"""

import numpy as np

from tests.oracles import linear_gaussian


def kkt_project(y, A, k):
    """``argmin_{A z = k} ||z - y||`` for each row of ``y`` by the KKT system (float64)."""
    y, A, k = (np.asarray(x, dtype=np.float64) for x in (y, A, k))
    a, n = A.shape
    kkt = np.block([[np.eye(n), A.T], [A, np.zeros((a, a))]])
    batch = np.broadcast_shapes(y.shape[:-1], k.shape[:-1])
    rhs = np.concatenate(
        [
            np.broadcast_to(y, batch + (n,)).reshape(-1, n),
            np.broadcast_to(k, batch + (a,)).reshape(-1, a),
        ],
        -1,
    )
    solution = np.linalg.solve(kkt, rhs.T).T
    return solution[:, :n].reshape(batch + (n,))


def lstsq_project(y, A, k):
    """``y - d`` with ``d`` the minimum-norm solution of ``A d = A y - k`` (float64)."""
    y, A, k = (np.asarray(x, dtype=np.float64) for x in (y, A, k))
    residual = y @ A.T - k
    correction = np.linalg.lstsq(A, residual.reshape(-1, A.shape[0]).T, rcond=None)[0].T
    return y - correction.reshape(residual.shape[:-1] + (A.shape[1],))


def relative_residual(z, A, k):
    """``|A z - k| / (|A| |z| + |k|)`` per row, in float64 (the library's support measure)."""
    z, A, k = (np.asarray(x, dtype=np.float64) for x in (z, A, k))
    return np.abs(z @ A.T - k) / (np.abs(z) @ np.abs(A).T + np.abs(k))


def in_support(z, A, k, rtol):
    """The support test ``|A z - k| <= rtol (|A| |z| + |k|)`` for every row, in float64."""
    return np.all(relative_residual(z, A, k) <= rtol, axis=-1)


def logpdf_with_tolerance(z, loc, cov, A, k, rtol):
    """SciPy's singular-normal log density of the projection of each ``z`` onto
    ``{A z = k}`` where ``z`` passes the support test with ``rtol``, else ``-inf``."""
    z = np.asarray(z, dtype=np.float64)
    projected = kkt_project(z, A, k)
    density = np.atleast_1d(linear_gaussian.logpdf(projected, loc, cov, A, k))
    return np.where(in_support(z, A, k, rtol), density, -np.inf)


def ill_conditioned(n, a, condition, seed):
    """``(A, loc, k)`` with ``cond(A A^T) = condition`` (singular values of A spaced
    logarithmically from 1 to ``condition ** -0.5``), so that with ``Sigma = I`` the
    conditioning of ``A Sigma A^T`` is ``condition``; ``loc`` and ``k`` of size 10."""
    rng = np.random.default_rng(seed)
    left = np.linalg.qr(rng.normal(size=(a, a)))[0]
    right = np.linalg.qr(rng.normal(size=(n, a)))[0]
    A = left @ np.diag(np.logspace(0, -0.5 * np.log10(condition), a)) @ right.T
    return A, 10 * rng.normal(size=n), 10 * rng.normal(size=a)


def perturbed(z, relative, seed):
    """``z`` with each coordinate multiplied by ``1 + relative * u``, u uniform in [-1, 1]:
    data that satisfies its balances only to about ``relative`` (measured values)."""
    rng = np.random.default_rng(seed)
    z = np.asarray(z, dtype=np.float64)
    return z * (1 + relative * rng.uniform(-1, 1, size=z.shape))
