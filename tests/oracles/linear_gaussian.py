"""NumPy / SciPy references for a Gaussian conditioned on ``A z = k``.

Computed by other routes than the library: the conditional moments by the Schur complement
of the joint Gaussian of ``(z, A z)`` with a pseudo-inverse, densities and entropies by
SciPy's singular multivariate normal (density with respect to the Lebesgue measure on the
support's affine hull, i.e. the Hausdorff measure), the KL by the pseudo-inverse formula
for two degenerate Gaussians with the same support, and expected losses by SciPy's
``norm.expect`` quadrature.
"""

import numpy as np
import scipy.linalg
import scipy.stats


def conditional_moments(loc, cov, A, k):
    """Mean and covariance of ``N(loc, cov)`` given ``A z = k`` (one event, float64)."""
    loc, cov, A, k = (np.asarray(x, dtype=np.float64) for x in (loc, cov, A, k))
    cross = cov @ A.T
    gain = cross @ np.linalg.pinv(A @ cov @ A.T)
    mean = loc + gain @ (k - A @ loc)
    covariance = cov - gain @ cross.T
    return mean, 0.5 * (covariance + covariance.T)


def singular_normal(loc, cov, A, k):
    """SciPy's frozen degenerate normal for the conditional distribution."""
    mean, covariance = conditional_moments(loc, cov, A, k)
    return scipy.stats.multivariate_normal(mean, covariance, allow_singular=True)


def logpdf(value, loc, cov, A, k):
    return singular_normal(loc, cov, A, k).logpdf(np.asarray(value, dtype=np.float64))


def entropy(loc, cov, A, k):
    return float(singular_normal(loc, cov, A, k).entropy())


def kl_same_support(p_moments, q_moments):
    """KL between two degenerate Gaussians on the same affine subspace (pseudo-inverse)."""
    (mean_p, cov_p), (mean_q, cov_q) = p_moments, q_moments
    rank = np.linalg.matrix_rank(cov_p)
    precision_q = np.linalg.pinv(cov_q, hermitian=True)

    def log_pdet(matrix):
        eigenvalues = np.linalg.eigvalsh(matrix)
        return np.sum(np.log(eigenvalues[eigenvalues > 1e-10 * eigenvalues.max()]))

    diff = mean_q - mean_p
    return 0.5 * (
        np.trace(precision_q @ cov_p)
        + diff @ precision_q @ diff
        - rank
        + log_pdet(cov_q)
        - log_pdet(cov_p)
    )


def expected_losses(loc, cov, A, k, target):
    """(E||z - y||_1, E||z - y||_2^2) by quadrature of each conditional marginal."""
    mean, covariance = conditional_moments(loc, cov, A, k)
    l1 = l2 = 0.0
    for mean_i, var_i, y_i in zip(mean, np.diag(covariance), np.asarray(target), strict=True):
        std_i = np.sqrt(max(var_i, 0.0))
        if std_i < 1e-12:
            l1 += abs(mean_i - y_i)
            l2 += (mean_i - y_i) ** 2
            continue
        marginal = scipy.stats.norm(mean_i, std_i)
        l1 += marginal.expect(lambda x, y=y_i: abs(x - y), epsabs=1e-12, epsrel=1e-10)
        l2 += marginal.expect(lambda x, y=y_i: (x - y) ** 2, epsabs=1e-12, epsrel=1e-10)
    return l1, l2


def null_space_whitener(loc, cov, A, k):
    """A map ``z -> w`` in R^(n - a) with ``w ~ N(0, I)`` exactly when z follows the
    conditional distribution: coordinates in an orthonormal basis of null(A), whitened."""
    mean, covariance = conditional_moments(loc, cov, A, k)
    basis = scipy.linalg.null_space(np.asarray(A, dtype=np.float64))
    reduced = basis.T @ covariance @ basis
    whitening = np.linalg.inv(np.linalg.cholesky(reduced))

    def whiten(samples):
        return (np.asarray(samples, dtype=np.float64) - mean) @ basis @ whitening.T

    return whiten


def goodness_of_fit_pvalues(samples, loc, cov, A, k):
    """KS p-values: squared whitened radius against chi2(n - a), and each whitened
    coordinate against N(0, 1) (Bonferroni-combined into one minimum p-value)."""
    whitened = null_space_whitener(loc, cov, A, k)(samples)
    dim = whitened.shape[-1]
    radius_p = scipy.stats.kstest(np.sum(whitened**2, -1), scipy.stats.chi2(dim).cdf).pvalue
    coordinate_p = min(
        scipy.stats.kstest(whitened[:, i], scipy.stats.norm.cdf).pvalue * dim for i in range(dim)
    )
    return radius_p, min(coordinate_p, 1.0)


def conjugate_posterior_mean(prior_loc, prior_cov, A, k, noise_std, observations):
    """Posterior mean of z ~ N(prior_loc, prior_cov) | A z = k, with y_j ~ N(z, noise_std^2 I)
    observed independently: a Gaussian update on the unconstrained prior, then conditioning
    on A z = k (conditioning commutes with the Gaussian likelihood)."""
    observations = np.atleast_2d(np.asarray(observations, dtype=np.float64))
    prior_precision = np.linalg.inv(np.asarray(prior_cov, dtype=np.float64))
    count = observations.shape[0]
    post_cov = np.linalg.inv(prior_precision + count / noise_std**2 * np.eye(len(prior_loc)))
    post_loc = post_cov @ (
        prior_precision @ np.asarray(prior_loc) + observations.sum(0) / noise_std**2
    )
    mean, _ = conditional_moments(post_loc, post_cov, A, k)
    return mean


CASES = ("diag_default", "diag", "full_cov", "scale_tril")


def random_parameters(case, n=5, a=2, seed=0):
    """Float64 NumPy parameters for one test case: a dict of constructor keyword arguments
    (``loc`` plus one of ``scale`` / ``covariance_matrix`` / ``scale_tril``, and ``A`` / ``k``
    unless the case uses the defaults) and ``cov``, ``A_full``, ``k_full``: the covariance
    and the constraint the oracle should use."""
    rng = np.random.default_rng(seed)
    params = {"loc": rng.normal(size=n)}
    if case.startswith("diag"):
        scale = rng.uniform(0.5, 2.0, size=n)
        params["scale"] = scale
        cov = np.diag(scale**2)
    else:
        factor = rng.normal(size=(n, n))
        cov = factor @ factor.T / n + 0.5 * np.eye(n)
        if case == "full_cov":
            params["covariance_matrix"] = cov
        else:
            params["scale_tril"] = np.linalg.cholesky(cov)
    if case == "diag_default":
        A, k = np.ones((1, n)), np.zeros(1)
    else:
        A, k = rng.normal(size=(a, n)), rng.normal(size=a)
        params["A"], params["k"] = A, k
    return params, cov, A, k


def project(values, A, k):
    """Orthogonal projection of float64 copies of ``values`` onto ``{z : A z = k}`` (SciPy's
    singular density is -inf a float32 rounding away from the subspace)."""
    values = np.asarray(values, dtype=np.float64)
    A = np.asarray(A, dtype=np.float64)
    residual = values @ A.T - np.asarray(k, dtype=np.float64)
    return values - np.linalg.solve(A @ A.T, residual[..., None])[..., 0] @ A


def known_conditional_gaussian(rng, rows, *, tails):
    """Rows of a known model: ``y = c + e`` with ``c`` the orthogonal projection of ``x W``
    onto ``{A y = k}`` and ``e`` the noise ``s * z`` (``z`` standard normal, or for
    ``tails="student"`` multivariate Student t with 3 degrees of freedom: ``z`` times one
    ``sqrt(3 / chi2_3)`` per row) conditioned on ``A e = 0``, i.e. ``e - S A^T (A S
    A^T)^-1 A e`` with ``S = diag(s^2)``. Returns the arrays and ``(W, s, A)``."""
    n, a, d = 6, 2, 3
    A = np.random.default_rng(5).normal(size=(a, n))
    W = np.random.default_rng(6).normal(size=(n, d))
    s = np.array([0.05, 0.1, 0.2, 0.3, 0.5, 0.8])
    x = rng.normal(size=(rows, d))
    k = rng.normal(size=(rows, a))
    loc = x @ W.T
    centre = loc + np.linalg.solve(A @ A.T, (k - loc @ A.T).T).T @ A
    noise = s * rng.normal(size=(rows, n))
    if tails == "student":
        noise *= np.sqrt(3.0 / rng.chisquare(3.0, size=(rows, 1)))
    S = np.diag(s**2)
    noise -= noise @ A.T @ np.linalg.solve(A @ S @ A.T, A @ S)
    return x, k, centre + noise, (W, s, A)
