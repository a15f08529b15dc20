"""Reparameterisation of :class:`LinearConstrainedNormal` sites for HMC/NUTS and AutoGuides.

When ``loc``, ``scale``, ``A`` or ``k`` of a latent ``LinearConstrainedNormal`` site depend on
other latent variables, the site's support ``{z : A z = k}`` moves with them. HMC/NUTS fix
the unconstraining transform of every site at the first trace, so such a site must be
rewritten as independent standard-Normal coordinates plus a deterministic map::

    u ~ N(0, I_{n - a})                    (site f"{name}_decentered")
    z = mu_bar + B R^{-1} u

with ``B`` (n x (n - a)) the orthonormal basis of null(A) that the AutoGuide bijection
(:class:`~pyro_constrained.linear_constrained_normal.AffineSubspaceTransform`) uses,
``mu_bar`` the conditional mean, and ``R`` the upper-triangular factor of the QR of
``L^{-1} B`` (``L`` the Cholesky factor of the unconditional covariance Sigma). Then
``R^T R = B^T Sigma^{-1} B`` is the precision of the subspace coordinates ``w = B^T (z -
mu_bar)``, so ``w = R^{-1} u`` has covariance ``(B^T Sigma^{-1} B)^{-1} = B^T Sigma_bar B``
and ``z`` has exactly the law ``N(mu_bar, Sigma_bar)`` restricted to the subspace. Working
from Sigma's factor avoids forming the rank-deficient ``Sigma_bar``.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
from pyro.infer.reparam.reparam import Reparam

from pyro_constrained._compat import mask_of
from pyro_constrained.linear_constrained_normal import (
    AffineSubspaceTransform,
    LinearConstrainedNormal,
)

__all__ = ["LinearConstrainedNormalReparam"]


def _subspace_factor(fn: LinearConstrainedNormal) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B, R)``: the isometric basis of null(A) and the triangular factor with
    ``R^T R = B^T Sigma^{-1} B`` (the precision of ``B^T (z - mu_bar)``)."""
    basis = AffineSubspaceTransform(fn.A, fn.k).basis  # (..., n, n - a)
    scale_tril = fn.scale_tril
    batch = torch.broadcast_shapes(basis.shape[:-2], scale_tril.shape[:-2])
    whitened = torch.linalg.solve_triangular(
        scale_tril.expand(batch + scale_tril.shape[-2:]),
        basis.expand(batch + basis.shape[-2:]),
        upper=False,
    )  # L^{-1} B
    r = torch.linalg.qr(whitened, mode="r").R
    return basis, r


class LinearConstrainedNormalReparam(Reparam):
    """Rewrites a latent :class:`LinearConstrainedNormal` site ``z`` as standard-Normal
    coordinates ``u`` on its (n - a)-dimensional subspace and a deterministic map
    ``z = mu_bar + B R^{-1} u`` (see the module docstring), so that NUTS and AutoGuides
    stay exact when the site's ``loc``, ``scale``, ``A`` or ``k`` depend on latents.

    Use ``pyro.poutine.reparam(model, config={"z": LinearConstrainedNormalReparam()})``.
    Observed sites are left untouched. The new latent site is ``f"{name}_decentered"``
    (batch shape of the original site, event dim 1 plus any ``to_event`` dims), and ``z``
    becomes a deterministic site.

    Examples
    --------
    >>> import pyro
    >>> import pyro.distributions as dist
    >>> import torch
    >>> from pyro import poutine
    >>> from pyro_constrained import LinearConstrainedNormal, LinearConstrainedNormalReparam
    >>> def model():
    ...     total = pyro.sample("total", dist.Normal(3.0, 0.1))  # k depends on a latent
    ...     return pyro.sample("z", LinearConstrainedNormal(torch.zeros(3), torch.ones(3), k=total))
    >>> reparam_model = poutine.reparam(model, config={"z": LinearConstrainedNormalReparam()})
    >>> trace = poutine.trace(reparam_model).get_trace()
    >>> [name for name, site in trace.nodes.items() if site["type"] == "sample"]
    ['total', 'z_decentered', 'z']
    >>> trace.nodes["z_decentered"]["value"].shape  # n - a = 2 standard-Normal coordinates
    torch.Size([2])
    >>> z, total = trace.nodes["z"]["value"], trace.nodes["total"]["value"]
    >>> bool(torch.isclose(z.sum(), total))
    True
    """

    def apply(self, msg):
        if msg["is_observed"]:
            return msg
        name, fn, value = msg["name"], msg["fn"], msg["value"]
        batch_shape = fn.batch_shape
        base, event_dim = self._unwrap(fn)
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
        noise_shape = batch_shape + fn.event_shape[:-1] + (dim,)

        decentered_value = None
        if value is not None:
            # u = R B^T (z - mu_bar): the inverse of the map below.
            w = ((value - mean).unsqueeze(-2) @ basis).squeeze(-2)
            decentered_value = (r @ w.unsqueeze(-1)).squeeze(-1)

        zeros = mean.new_zeros(()).expand(noise_shape)
        noise_fn = dist.Normal(zeros, torch.ones_like(zeros)).to_event(event_dim)
        for mask in masks:  # of the site's batch shape
            noise_fn = noise_fn.mask(mask)
        u = pyro.sample(
            f"{name}_decentered",
            noise_fn,
            obs=decentered_value,
            infer={"is_observed": False},
        )
        w = torch.linalg.solve_triangular(
            r.expand(u.shape[:-1] + r.shape[-2:]), u.unsqueeze(-1), upper=True
        ).squeeze(-1)
        value = mean + (basis @ w.unsqueeze(-1)).squeeze(-1)
        new_fn = dist.Delta(value, event_dim=event_dim).mask(False)
        return {"fn": new_fn, "value": value, "is_observed": True}
