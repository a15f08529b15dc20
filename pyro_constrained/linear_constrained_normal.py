"""A Gaussian conditioned on linear equalities ``A z = k`` (MATH.md section 2).

Holds :class:`LinearConstrainedNormal`, its support constraint (the affine subspace
``{z : A z = k}``), the isometric bijection from ``R^(n - a)`` onto that subspace (registered
with ``biject_to`` and ``transform_to`` so that AutoGuides and HMC/NUTS can use the
distribution as a latent site) and its KL rule (registered with ``register_kl``).
"""

from __future__ import annotations

import math

import torch
from pyro.distributions import Normal, TorchDistribution
from torch.distributions import biject_to, constraints, transform_to
from torch.distributions.kl import register_kl
from torch.distributions.transforms import Transform
from torch.distributions.utils import _standard_normal, lazy_property

GRAD_ESTIMATORS = ("marginal_expectation", "pathwise")


def _rows_times(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """``matrix @ vector`` over the last dimensions: (..., a, n) x (..., n) -> (..., a).

    Written as a row vector times the transposed matrix so that an unbatched ``matrix`` and
    a batched ``vector`` fold into one matrix-matrix product instead of a batch of
    matrix-vector products.
    """
    return (vector.unsqueeze(-2) @ matrix.mT).squeeze(-2)


def _combine_rows(coefficients: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``coefficients^T @ rows``: (..., a) x (..., a, n) -> (..., n)."""
    return (coefficients.unsqueeze(-2) @ rows).squeeze(-2)


def _subspace_tolerance(dtype: torch.dtype) -> float:
    # A dot product of length n in floating point is off by about sqrt(n) eps relative to
    # ||A_j|| ||z||; sqrt(eps) leaves room for sums of 10^5 terms and for the QR basis of the
    # bijection, and still rejects any value that is visibly off the subspace.
    return math.sqrt(torch.finfo(dtype).eps)


def _on_subspace(value: torch.Tensor, A: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Whether each event of ``value`` satisfies ``A value = k`` to rounding error.

    The tolerance for row j is ``sqrt(eps) (||A_j|| ||value|| + |k_j|)``, which bounds the
    rounding error of the dot product ``A_j . value`` (Cauchy-Schwarz) without a second
    matrix product.
    """
    residual = _rows_times(A, value) - k
    bound = (
        torch.linalg.vector_norm(A, dim=-1) * torch.linalg.vector_norm(value, dim=-1, keepdim=True)
        + k.abs()
    )
    return (residual.abs() <= _subspace_tolerance(value.dtype) * bound).all(-1)


class AffineSubspace(constraints.Constraint):
    """The affine subspace ``{z in R^n : A z = k}`` with ``A`` of shape (..., a, n), rank a.

    ``check`` accepts a value whose residual ``A z - k`` is within rounding error (relative
    tolerance ``sqrt(eps)`` of the value's dtype, see :func:`_on_subspace`).
    """

    is_discrete = False
    event_dim = 1

    def __init__(self, A: torch.Tensor, k: torch.Tensor):
        self.A = A
        self.k = k
        super().__init__()

    def check(self, value: torch.Tensor) -> torch.Tensor:
        return _on_subspace(value, self.A, self.k)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(a={self.A.shape[-2]}, n={self.A.shape[-1]})"


class AffineSubspaceTransform(Transform):
    """The isometry ``u -> z0 + B u`` from ``R^(n - a)`` onto ``{z : A z = k}``.

    ``B`` (n x (n - a)) is an orthonormal basis of the null space of ``A`` (the last n - a
    columns of the complete QR factor of ``A^T``) and ``z0 = A^T (A A^T)^{-1} k`` is the point
    of the subspace nearest the origin. Because ``B`` has orthonormal columns the map
    preserves lengths, so its log-determinant with respect to the (n - a)-dimensional
    Lebesgue (Hausdorff) measure on the subspace, the base measure of
    :class:`LinearConstrainedNormal`, is 0. The inverse ``z -> B^T (z - z0)`` is the
    orthogonal projection, so it also maps a point near the subspace to the nearest one.

    Cost: the basis has n (n - a) entries and its QR costs O(n^2 a) once per transform; this
    is the one place an n-by-n-sized object is formed (the distribution's own calls stay
    O(n a)), which is fine at the sizes where AutoGuides and NUTS are used.
    """

    domain = constraints.real_vector
    bijective = True

    def __init__(self, A: torch.Tensor, k: torch.Tensor, cache_size: int = 0):
        super().__init__(cache_size=cache_size)
        self.A = A
        self.k = k
        num_rows = A.shape[-2]
        q, r = torch.linalg.qr(A.mT, mode="complete")
        self.basis = q[..., :, num_rows:]
        # A^T = Q1 R1, so z0 = A^T (A A^T)^{-1} k = Q1 R1^{-T} k.
        coefficients = torch.linalg.solve_triangular(
            r[..., :num_rows, :].mT, k.unsqueeze(-1), upper=False
        )
        self.offset = (q[..., :, :num_rows] @ coefficients).squeeze(-1)

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def codomain(self) -> constraints.Constraint:
        return AffineSubspace(self.A, self.k)

    def with_cache(self, cache_size: int = 1) -> AffineSubspaceTransform:
        if self._cache_size == cache_size:
            return self
        return AffineSubspaceTransform(self.A, self.k, cache_size=cache_size)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, AffineSubspaceTransform)
            and self.A.shape == other.A.shape
            and self.k.shape == other.k.shape
            and bool((self.A == other.A).all())
            and bool((self.k == other.k).all())
        )

    def _call(self, u: torch.Tensor) -> torch.Tensor:
        return self.offset + _rows_times(self.basis, u)

    def _inverse(self, z: torch.Tensor) -> torch.Tensor:
        return _combine_rows(z - self.offset, self.basis)

    def log_abs_det_jacobian(self, u: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        shape = torch.broadcast_shapes(u.shape[:-1], z.shape[:-1])
        return torch.zeros(shape, dtype=z.dtype, device=z.device)

    def forward_shape(self, shape: torch.Size) -> torch.Size:
        if len(shape) < 1 or shape[-1] != self.basis.shape[-1]:
            raise ValueError(f"expected an input of size {self.basis.shape[-1]}, got {shape}")
        return torch.broadcast_shapes(shape[:-1], self.offset.shape[:-1]) + self.basis.shape[-2:-1]

    def inverse_shape(self, shape: torch.Size) -> torch.Size:
        if len(shape) < 1 or shape[-1] != self.basis.shape[-2]:
            raise ValueError(f"expected an input of size {self.basis.shape[-2]}, got {shape}")
        return torch.broadcast_shapes(shape[:-1], self.offset.shape[:-1]) + self.basis.shape[-1:]


@biject_to.register(AffineSubspace)
@transform_to.register(AffineSubspace)
def _transform_to_affine_subspace(constraint: AffineSubspace) -> AffineSubspaceTransform:
    return AffineSubspaceTransform(constraint.A, constraint.k)


def _as_float_tensor(value, name: str, dtype: torch.dtype, device) -> torch.Tensor:
    tensor = torch.as_tensor(value, device=device)
    if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64, torch.bool)):
        raise ValueError(f"{name} must be a real array, got dtype {tensor.dtype}")
    return tensor.to(dtype)


class LinearConstrainedNormal(TorchDistribution):
    r"""A multivariate normal ``N(loc, Sigma)`` conditioned on the linear equalities ``A z = k``.

    With ``S = A Sigma A^T`` and ``K = Sigma A^T S^{-1}`` the conditional distribution is the
    degenerate Gaussian with mean ``mu_bar = loc + K (k - A loc)`` and covariance
    ``Sigma_bar = Sigma - K A Sigma`` (rank n - a), supported on the affine subspace
    ``{z : A z = k}``.

    **Base measure.** :meth:`log_prob` is the density with respect to the (n - a)-dimensional
    Lebesgue (Hausdorff) measure on the subspace:
    ``log p(z) = log N(z; loc, Sigma) - log N(k; A loc, S) - 1/2 log det(A A^T)`` for
    ``A z = k``. This equals
    ``scipy.stats.multivariate_normal(mu_bar, Sigma_bar, allow_singular=True).logpdf(z)``, and
    for ``loc = 0``, ``Sigma = s^2 I`` and the default zero-sum constraint it equals NumPyro's
    ``ZeroSumNormal(s, event_shape=(n,))``. It does not depend on a choice of coordinates.
    A value off the subspace raises ``ValueError`` with validation on and gets ``-inf``
    with it off.

    **Sampling** is exact, by Matheron's rule: ``x = loc + L eps``, ``z = x + K (k - A x)``.
    :meth:`rsample` returns this sample with the gradient chosen by ``grad_estimator``:
    ``"marginal_expectation"`` (default): straight-through through the conditional mean,
    ``z + (mu_bar - mu_bar.detach())`` with ``z`` detached (biased, low variance);
    ``"pathwise"``: the gradient of the Matheron sample itself (exact reparameterisation,
    unbiased).

    **Cost.** With a diagonal covariance (``scale``) construction is O(n a^2 + a^3) and every
    call O(n a); no n x n matrix is formed except by :attr:`covariance_matrix`. With a full
    covariance the Cholesky factor costs O(n^3) once and each sample or log_prob O(n^2).

    :param loc: the unconditional mean, shape (..., n).
    :param scale: unconditional standard deviations (diagonal covariance), shape (..., n).
    :param covariance_matrix: unconditional covariance, shape (..., n, n).
    :param scale_tril: lower Cholesky factor of the unconditional covariance, (..., n, n).
        Exactly one of ``scale`` / ``covariance_matrix`` / ``scale_tril`` is given.
    :param A: constraint matrix of shape (..., a, n) with rank a < n; default one row of ones.
    :param k: right-hand side of shape (..., a); default zeros (with the default ``A``: the
        zero-sum constraint).
    :param grad_estimator: ``"marginal_expectation"`` or ``"pathwise"``.
    """

    arg_constraints = {
        "loc": constraints.real_vector,
        "scale": constraints.independent(constraints.positive, 1),
        "scale_tril": constraints.lower_cholesky,
        "A": constraints.independent(constraints.real, 2),
        "k": constraints.real_vector,
    }
    has_rsample = True

    def __init__(
        self,
        loc: torch.Tensor,
        scale: torch.Tensor | None = None,
        *,
        covariance_matrix: torch.Tensor | None = None,
        scale_tril: torch.Tensor | None = None,
        A: torch.Tensor | None = None,
        k: torch.Tensor | float | None = None,
        grad_estimator: str = "marginal_expectation",
        validate_args: bool | None = None,
    ):
        validate = (
            torch.distributions.Distribution._validate_args
            if validate_args is None
            else validate_args
        )
        if grad_estimator not in GRAD_ESTIMATORS:
            raise ValueError(
                f"grad_estimator must be one of {GRAD_ESTIMATORS}, got {grad_estimator!r}"
            )
        if sum(p is not None for p in (scale, covariance_matrix, scale_tril)) != 1:
            raise ValueError("exactly one of scale, covariance_matrix or scale_tril must be given")
        loc = torch.as_tensor(loc)
        if not loc.is_floating_point():
            loc = loc.to(torch.get_default_dtype())
        dtype, device = loc.dtype, loc.device
        if loc.dim() < 1:
            raise ValueError(f"loc must have at least one dimension (the event), got {loc.shape}")
        n = loc.shape[-1]

        if scale is not None:
            scale = _as_float_tensor(scale, "scale", dtype, device)
            if scale.dim() == 0:
                scale = scale.expand(n)
            if scale.shape[-1] not in (1, n):
                raise ValueError(f"scale must have last dimension {n} (or 1), got {scale.shape}")
            scale = scale.expand(scale.shape[:-1] + (n,))
            cov_batch_shape = scale.shape[:-1]
        else:
            name = "covariance_matrix" if covariance_matrix is not None else "scale_tril"
            matrix = covariance_matrix if covariance_matrix is not None else scale_tril
            matrix = _as_float_tensor(matrix, name, dtype, device)
            if matrix.dim() < 2 or matrix.shape[-2:] != (n, n):
                raise ValueError(f"{name} must have shape (..., {n}, {n}), got {matrix.shape}")
            if covariance_matrix is not None:
                if validate and not constraints.positive_definite.check(matrix).all():
                    raise ValueError(
                        "covariance_matrix must be symmetric positive definite (and free of NaN)"
                    )
                scale_tril = torch.linalg.cholesky_ex(matrix).L
            else:
                scale_tril = matrix
            cov_batch_shape = scale_tril.shape[:-2]

        if A is None:
            A = torch.ones(1, n, dtype=dtype, device=device)
        else:
            A = _as_float_tensor(A, "A", dtype, device)
            if A.dim() < 2:
                raise ValueError(f"A must have shape (..., a, n), got {A.shape}")
            if A.shape[-1] != n:
                raise ValueError(
                    f"A must have n = {n} columns (the size of loc), got shape {A.shape}"
                )
        num_rows = A.shape[-2]
        if not 1 <= num_rows < n:
            raise ValueError(
                f"A must have between 1 and n - 1 = {n - 1} rows (rank a < n), got {num_rows}"
            )
        if k is None:
            k = torch.zeros(num_rows, dtype=dtype, device=device)
        else:
            k = _as_float_tensor(k, "k", dtype, device)
            if k.dim() == 0 and num_rows == 1:
                k = k.unsqueeze(-1)
            if k.dim() < 1 or k.shape[-1] != num_rows:
                raise ValueError(
                    f"k must have shape (..., a) with a = {num_rows} (the rows of A), "
                    f"got {tuple(k.shape)}"
                )

        try:
            batch_shape = torch.broadcast_shapes(
                loc.shape[:-1], cov_batch_shape, A.shape[:-2], k.shape[:-1]
            )
        except RuntimeError as error:
            raise ValueError(
                f"the batch shapes of the parameters do not broadcast: {error}"
            ) from None

        self.loc = loc.expand(batch_shape + (n,))
        if scale is not None:
            self.scale = scale
        else:
            self.scale_tril = scale_tril
        self._diagonal = scale is not None
        self.A = A
        self.k = k
        self.grad_estimator = grad_estimator
        super().__init__(batch_shape, torch.Size((n,)), validate_args=validate_args)

        singular_values = torch.linalg.svdvals(A)
        if validate:
            largest = singular_values[..., :1]
            tolerance = largest * max(A.shape[-2:]) * torch.finfo(dtype).eps
            if not (singular_values[..., -1:] > tolerance).all():
                raise ValueError(f"A must have full row rank {num_rows}; it is rank-deficient")
        self._precompute(singular_values)

    def _precompute(self, singular_values: torch.Tensor) -> None:
        """Everything that depends only on the parameters: O(n a^2 + a^3) (diagonal)."""
        A = self.A
        if self._diagonal:
            variance = self.scale.square()
            a_sigma = A * variance.unsqueeze(-2)  # A Sigma, (..., a, n)
            s_matrix = a_sigma @ A.mT
            log_det_sigma_half = self.scale.log().sum(-1)
            prior_variance = variance
        else:
            a_l = A @ self.scale_tril
            a_sigma = a_l @ self.scale_tril.mT
            s_matrix = a_l @ a_l.mT
            log_det_sigma_half = self.scale_tril.diagonal(dim1=-2, dim2=-1).log().sum(-1)
            prior_variance = self.scale_tril.square().sum(-1)
        chol_s = torch.linalg.cholesky_ex(s_matrix).L
        # K^T = S^{-1} A Sigma, (..., a, n): the only O(n a) object the calls need.
        gain_t = torch.cholesky_solve(a_sigma, chol_s)
        self._a_sigma = a_sigma
        self._gain_t = gain_t
        self._chol_s = chol_s
        self._prior_variance = prior_variance
        self._mean = self.loc + _combine_rows(self.k - _rows_times(A, self.loc), gain_t)
        # log p(z) = -1/2 (z - mu_bar)^T Sigma^{-1} (z - mu_bar) + _log_normalizer on the
        # subspace: for A z = k the cross term with mu_bar - loc = K (k - A loc) vanishes, so
        # the squared distance splits into this one plus the one of log N(k; A loc, S).
        self._log_normalizer = (
            -log_det_sigma_half
            + chol_s.diagonal(dim1=-2, dim2=-1).log().sum(-1)
            - singular_values.log().sum(-1)
            - 0.5 * (self.event_shape[0] - A.shape[-2]) * math.log(2 * math.pi)
        )

    @lazy_property
    def scale_tril(self) -> torch.Tensor:
        """Lower Cholesky factor of the unconditional covariance Sigma (n x n)."""
        return torch.diag_embed(self.scale)

    @lazy_property
    def scale(self) -> torch.Tensor:
        """Unconditional standard deviations, sqrt(diag Sigma)."""
        return self._prior_variance.sqrt()

    @classmethod
    def infer_shapes(
        cls, loc, scale=None, covariance_matrix=None, scale_tril=None, A=None, k=None, **kwargs
    ):
        batch_shapes = [loc[:-1]]
        if scale is not None:
            batch_shapes.append(scale[:-1])
        for matrix in (covariance_matrix, scale_tril, A):
            if matrix is not None:
                batch_shapes.append(matrix[:-2])
        if k is not None:
            batch_shapes.append(k[:-1])
        return torch.broadcast_shapes(*batch_shapes), torch.Size(loc[-1:])

    def expand(self, batch_shape, _instance=None) -> LinearConstrainedNormal:
        new = self._get_checked_instance(LinearConstrainedNormal, _instance)
        batch_shape = torch.Size(batch_shape)
        new.__dict__.update(self.__dict__)
        event = self.event_shape
        new.loc = self.loc.expand(batch_shape + event)
        new._mean = self._mean.expand(batch_shape + event)
        new._log_normalizer = self._log_normalizer.expand(batch_shape)
        super(LinearConstrainedNormal, new).__init__(batch_shape, event, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @constraints.dependent_property(is_discrete=False, event_dim=1)
    def support(self) -> AffineSubspace:
        return AffineSubspace(self.A, self.k)

    @property
    def mean(self) -> torch.Tensor:
        """The conditional mean ``mu_bar``."""
        return self._mean

    @property
    def mode(self) -> torch.Tensor:
        return self._mean

    @property
    def variance(self) -> torch.Tensor:
        """``diag Sigma_bar = diag Sigma - sum_j K_ij (A Sigma)_ji``, O(n a), clamped at 0."""
        variance = self._prior_variance - (self._gain_t * self._a_sigma).sum(-2)
        return variance.clamp(min=0).expand(self.batch_shape + self.event_shape)

    @property
    def covariance_matrix(self) -> torch.Tensor:
        """The conditional covariance ``Sigma_bar`` (n x n, rank n - a): forms an n x n matrix."""
        sigma = self.scale_tril @ self.scale_tril.mT
        bar = sigma - self._a_sigma.mT @ self._gain_t
        bar = 0.5 * (bar + bar.mT)
        return bar.expand(self.batch_shape + self.event_shape + self.event_shape)

    @property
    def marginals(self) -> Normal:
        """The conditional marginal ``N(mu_bar_i, Sigma_bar_ii)`` of each coordinate.

        A coordinate that the constraint fixes has standard deviation 0, which ``Normal``
        rejects, so the result is built without argument validation.
        """
        return Normal(self.mean, self.stddev, validate_args=False)

    def entropy(self) -> torch.Tensor:
        """``H = (n - a)/2 (1 + log 2 pi) + 1/2 log det Sigma - 1/2 log det S
        + 1/2 log det(A A^T)``, with respect to the Hausdorff measure on the subspace."""
        dim = self.event_shape[0] - self.A.shape[-2]
        return (0.5 * dim - self._log_normalizer).expand(self.batch_shape)

    def _mahalanobis_from_mean(self, value: torch.Tensor) -> torch.Tensor:
        diff = value - self._mean
        if self._diagonal:
            return (diff / self.scale).square().sum(-1)
        scale_tril = self.scale_tril
        batch = torch.broadcast_shapes(diff.shape[:-1], scale_tril.shape[:-2])
        solved = torch.linalg.solve_triangular(
            scale_tril.expand(batch + scale_tril.shape[-2:]),
            diff.expand(batch + diff.shape[-1:]).unsqueeze(-1),
            upper=False,
        )
        return solved.squeeze(-1).square().sum(-1)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log density with respect to the Hausdorff measure on ``{z : A z = k}``."""
        if self._validate_args:
            self._validate_sample(value)
        log_prob = -0.5 * self._mahalanobis_from_mean(value) + self._log_normalizer
        if self._validate_args:
            # Validation raised unless every value is on the subspace: no mask needed.
            return log_prob
        on_subspace = _on_subspace(value, self.A, self.k)
        return torch.where(on_subspace, log_prob, torch.full_like(log_prob, -math.inf))

    def _matheron_sample(self, sample_shape: torch.Size) -> torch.Tensor:
        shape = self._extended_shape(sample_shape)
        noise = _standard_normal(shape, dtype=self.loc.dtype, device=self.loc.device)
        return self._matheron_from_noise(noise, overwrite_noise=True)

    def _matheron_from_noise(
        self, noise: torch.Tensor, overwrite_noise: bool = False
    ) -> torch.Tensor:
        """Matheron's rule applied to standard normal ``noise`` of shape (..., n).

        Without autograd the diagonal case writes into its temporaries (and into ``noise``
        when ``overwrite_noise``), with the same kernels, hence bit for bit the same result:
        sampling is memory-bound, and the fewer (batch, n) buffers it allocates the closer
        it stays to the cost of an unconstrained sample.
        """
        if not self._diagonal:
            x = self.loc + _rows_times(self.scale_tril, noise)
            return x + _combine_rows(self.k - _rows_times(self.A, x), self._gain_t)
        in_place = not torch.is_grad_enabled() or not any(
            t.requires_grad for t in (self.loc, self.scale, self.A, self.k)
        )
        if (
            in_place
            and overwrite_noise
            and noise.shape == torch.broadcast_shapes(noise.shape, self.loc.shape)
        ):
            x = torch.addcmul(self.loc, self.scale, noise, out=noise)
        else:
            x = torch.addcmul(self.loc, self.scale, noise)
        residual = self.k - _rows_times(self.A, x)
        # K r = Sigma A^T (S^{-1} r): an a x a solve per event and a product with A, which
        # reads far less memory than the batched (..., a, n) gain K^T when A is shared.
        coefficients = torch.cholesky_solve(residual.unsqueeze(-1), self._chol_s).squeeze(-1)
        correction = _combine_rows(coefficients, self.A)
        if in_place and correction.shape == x.shape:
            return torch.addcmul(x, self._prior_variance, correction, out=correction)
        return torch.addcmul(x, self._prior_variance, correction)

    def rsample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        """An exact sample; its gradient is the one chosen by ``grad_estimator``."""
        sample_shape = torch.Size(sample_shape)
        if self.grad_estimator == "pathwise":
            return self._matheron_sample(sample_shape)
        with torch.no_grad():
            z = self._matheron_sample(sample_shape)
        proxy = self._mean.expand(z.shape)
        return z + (proxy - proxy.detach())

    def sample(self, sample_shape: tuple[int, ...] = ()) -> torch.Tensor:
        with torch.no_grad():
            return self._matheron_sample(torch.Size(sample_shape))


def _same_constraint(p: LinearConstrainedNormal, q: LinearConstrainedNormal) -> None:
    if p.event_shape != q.event_shape:
        raise ValueError(f"KL needs the same n, got {p.event_shape} and {q.event_shape}")
    try:
        same = bool((p.A == q.A).all()) and bool((p.k == q.k).all())
    except RuntimeError:
        same = False
    if not same:
        raise ValueError(
            "KL between LinearConstrainedNormals needs the same A and k (different affine "
            "subspaces make the KL infinite or undefined)"
        )


@register_kl(LinearConstrainedNormal, LinearConstrainedNormal)
def _kl_linear_constrained_normal(
    p: LinearConstrainedNormal, q: LinearConstrainedNormal
) -> torch.Tensor:
    """``KL(p || q) = -H_p - E_p[log q(z)]`` for two with the same A and k.

    ``E_p[(z - mu_bar_q)^T Sigma_q^{-1} (z - mu_bar_q)] = tr(Sigma_q^{-1} Sigma_bar_p)
    + (mu_bar_p - mu_bar_q)^T Sigma_q^{-1} (mu_bar_p - mu_bar_q)``, where
    ``tr(Sigma_q^{-1} Sigma_bar_p) = tr(Sigma_q^{-1} Sigma_p) - tr(Sigma_q^{-1} K_p A Sigma_p)``:
    O(n a) when both covariances are diagonal, O(n^3) otherwise.
    """
    _same_constraint(p, q)
    mean_diff = p.mean - q.mean
    if p._diagonal and q._diagonal:
        q_variance = q.scale.square()
        trace = (p._prior_variance / q_variance).sum(-1) - (
            p._gain_t * p._a_sigma / q_variance.unsqueeze(-2)
        ).sum((-2, -1))
        maha = (mean_diff.square() / q_variance).sum(-1)
    else:
        q_tril = q.scale_tril

        def whiten(matrix: torch.Tensor) -> torch.Tensor:
            batch = torch.broadcast_shapes(q_tril.shape[:-2], matrix.shape[:-2])
            return torch.linalg.solve_triangular(
                q_tril.expand(batch + q_tril.shape[-2:]),
                matrix.expand(batch + matrix.shape[-2:]),
                upper=False,
            )

        trace = whiten(p.scale_tril).square().sum((-2, -1)) - (
            whiten(p._gain_t.mT) * whiten(p._a_sigma.mT)
        ).sum((-2, -1))
        maha = whiten(mean_diff.unsqueeze(-1)).squeeze(-1).square().sum(-1)
    cross_entropy = 0.5 * (trace + maha) - q._log_normalizer
    return cross_entropy - p.entropy()
