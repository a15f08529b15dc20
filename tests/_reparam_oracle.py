"""Closed-form posterior of (t, z) for the reparam tests, in NumPy only.

Model: t ~ N(0, 1); z | t ~ LCN(loc = mu0 + t v, diag scale s, A, k = k0 + t w);
y | z ~ N(z, sigma^2 I). z | t = c + g t + e with e ~ N(0, Sigma_bar), so (t, z, y) is jointly
Gaussian and the posterior follows by Gaussian conditioning.
"""

import numpy as np


def exact_posterior(mu0, v, s, A, k0, w, sigma, y):
    sigma_z = np.diag(s**2)
    gain = sigma_z @ A.T @ np.linalg.inv(A @ sigma_z @ A.T)  # G = Sigma A^T (A Sigma A^T)^-1
    proj = np.eye(len(mu0)) - gain @ A
    c = proj @ mu0 + gain @ k0
    g = proj @ v + gain @ w
    cov_bar = sigma_z - gain @ A @ sigma_z
    n = len(mu0)
    mean = np.concatenate([[0.0], c])
    cov = np.zeros((n + 1, n + 1))
    cov[0, 0] = 1.0
    cov[0, 1:] = cov[1:, 0] = g
    cov[1:, 1:] = np.outer(g, g) + cov_bar
    H = np.hstack([np.zeros((n, 1)), np.eye(n)])
    S = H @ cov @ H.T + sigma**2 * np.eye(n)
    K = cov @ H.T @ np.linalg.inv(S)
    post_mean = mean + K @ (y - H @ mean)
    post_cov = cov - K @ H @ cov
    return post_mean, post_cov


MU0 = np.array([0.5, -1.0, 0.3])
S = np.array([1.0, 0.7, 1.3])
A = np.array([[1.0, 1.0, 1.0]])
SIGMA = 0.5
Y = np.array([1.2, 0.4, 2.1])
# (v, k0, w): loc depends on t, or k depends on t
LOC_CASE = (np.array([1.0, -0.5, 2.0]), np.array([1.0]), np.array([0.0]))
K_CASE = (np.zeros(3), np.array([0.0]), np.array([3.0]))
