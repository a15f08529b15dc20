"""Reparameterisation of :class:`LinearConstrainedNormal` sites for HMC/NUTS and AutoGuides.

When ``loc``, ``scale``, ``A`` or ``k`` of a latent ``LinearConstrainedNormal`` site depend on
other latent variables, the site's support ``{z : A z = k}`` moves with them. The site is
rewritten as independent standard-Normal coordinates plus a deterministic map::

    u ~ N(0, I_{n - a})                    (site f"{name}_decentered")
    z = mu_bar + B R^{-1} u

with ``B`` (n x (n - a)) the orthonormal basis of null(A) that the AutoGuide bijection
(:class:`~numpyro_constrained.linear_constrained_normal.AffineSubspaceTransform`) uses,
``mu_bar`` the conditional mean, and ``R`` the upper-triangular factor of the QR of
``L^{-1} B`` (``L`` the Cholesky factor of the unconditional covariance Sigma). Then
``R^T R = B^T Sigma^{-1} B`` is the precision of the subspace coordinates ``w = B^T (z -
mu_bar)``, so ``w = R^{-1} u`` has covariance ``(B^T Sigma^{-1} B)^{-1} = B^T Sigma_bar B``
and ``z`` has exactly the law ``N(mu_bar, Sigma_bar)`` on the subspace. Working from Sigma's
factor avoids forming the rank-deficient ``Sigma_bar``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from jax.scipy.linalg import solve_triangular
from numpyro.infer.reparam import Reparam

from numpyro_constrained._compat import mask_of
from numpyro_constrained._products import matmul
from numpyro_constrained.linear_constrained_normal import (
    LinearConstrainedNormal,
    _min_norm_point_and_basis,
)

__all__ = ["LinearConstrainedNormalReparam"]


def _subspace_factor(fn: LinearConstrainedNormal):
    """``(B, R)``: the isometric basis of null(A) and the triangular factor with
    ``R^T R = B^T Sigma^{-1} B`` (the precision of ``B^T (z - mu_bar)``)."""
    _, basis = _min_norm_point_and_basis(fn.A, fn.k)  # (..., n, n - a)
    scale_tril = fn.scale_tril
    batch = jnp.broadcast_shapes(basis.shape[:-2], scale_tril.shape[:-2])
    whitened = solve_triangular(
        jnp.broadcast_to(scale_tril, batch + scale_tril.shape[-2:]),
        jnp.broadcast_to(basis, batch + basis.shape[-2:]),
        lower=True,
    )  # L^{-1} B
    r = jnp.linalg.qr(whitened, mode="r")
    return basis, r


class LinearConstrainedNormalReparam(Reparam):
    """Rewrites a latent :class:`LinearConstrainedNormal` site ``z`` as standard-Normal
    coordinates ``u`` on its (n - a)-dimensional subspace and a deterministic map
    ``z = mu_bar + B R^{-1} u`` (see the module docstring), so that NUTS and AutoGuides
    stay exact when the site's ``loc``, ``scale``, ``A`` or ``k`` depend on latents.

    Use ``numpyro.handlers.reparam(model, config={"z": LinearConstrainedNormalReparam()})``.
    Observed sites are left untouched. The new latent site is ``f"{name}_decentered"``
    (batch shape of the original site, event dim 1 plus any ``to_event`` dims), and ``z``
    becomes a deterministic site.

    Examples
    --------
    >>> import jax
    >>> import jax.numpy as jnp
    >>> import numpyro
    >>> import numpyro.distributions as dist
    >>> from numpyro import handlers
    >>> from numpyro_constrained import LinearConstrainedNormal, LinearConstrainedNormalReparam
    >>> def model():
    ...     total = numpyro.sample("total", dist.Normal(3.0, 0.1))  # k depends on a latent
    ...     return numpyro.sample("z", LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=total))
    >>> reparam_model = handlers.reparam(model, config={"z": LinearConstrainedNormalReparam()})
    >>> trace = handlers.trace(handlers.seed(reparam_model, rng_seed=0)).get_trace()
    >>> [name for name, site in trace.items() if site["type"] == "sample"]
    ['total', 'z_decentered']
    >>> trace["z_decentered"]["value"].shape  # n - a = 2 standard-Normal coordinates
    (2,)
    >>> z, total = trace["z"]["value"], trace["total"]["value"]
    >>> bool(jnp.isclose(z.sum(), total, atol=1e-5))
    True
    """

    def __call__(self, name, fn, obs):
        if obs is not None:
            return fn, obs
        batch_shape = fn.batch_shape
        event_shape = fn.event_shape
        base, _, event_dim = self._unwrap(fn)
        masks = []  # the new site carries them: a .mask() or an obs_mask
        while isinstance(base, (dist.MaskedDistribution, dist.ExpandedDistribution)):
            if isinstance(base, dist.MaskedDistribution):
                masks.append(mask_of(base))
            base = base.base_dist
        if not isinstance(base, LinearConstrainedNormal):
            raise TypeError(
                f"LinearConstrainedNormalReparam at site {name!r} expects a "
                f"LinearConstrainedNormal, got {type(base).__name__}"
            )
        basis, r = _subspace_factor(base)
        mean = base.mean
        dim = basis.shape[-1]
        noise_shape = tuple(batch_shape) + tuple(event_shape[:-1]) + (dim,)
        noise_fn = dist.Normal(jnp.zeros(noise_shape, mean.dtype), 1.0).to_event(event_dim)
        for mask in masks:  # of the site's batch shape
            noise_fn = noise_fn.mask(mask)
        u = numpyro.sample(f"{name}_decentered", noise_fn)
        w = solve_triangular(
            jnp.broadcast_to(r, u.shape[:-1] + r.shape[-2:]), u[..., None], lower=False
        )
        value = mean + matmul(basis, w)[..., 0]
        return None, value
