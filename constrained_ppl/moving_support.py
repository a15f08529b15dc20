"""The refusal both packages give an AutoGuide set up on a ``LinearConstrainedNormal`` whose
subspace ``A z = k`` moves (``A`` or ``k`` depend on a latent site or a parameter),
framework-free.

An AutoGuide builds each site's bijection once, from its first trace, and keeps it, so its
values would stay on that first subspace, off the model's. Each package finds the guide
being set up and the sites that move (its ``_compat`` and ``moving_subspaces``); the check
runs once per guide and raises the error built here.
"""

from __future__ import annotations

from collections.abc import Callable, MutableSet

__all__ = ["refuse_once_per_guide"]

_FRAMEWORKS = {
    "NumPyro": (
        "the initial trace",
        " and the ELBO would be inf",
        "numpyro.handlers.reparam",
        "numpyro_constrained",
        " (NUTS needs no reparam)",
    ),
    "Pyro": ("the prototype trace", "", "pyro.poutine.reparam", "pyro_constrained", ""),
}


def refuse_once_per_guide(
    guide, checked: MutableSet, find_moving: Callable[[], dict], framework: str
) -> None:
    """Run ``find_moving()`` (site name -> names of what moves it) once per ``guide`` and
    raise a ``ValueError`` naming the reparam if any site moves. ``guide`` is marked in
    ``checked`` before the analysis runs, since the analysis runs the model, whose own
    requests for the bijection must not start another; it is unmarked on an error, so that
    a later setup checks again."""
    if guide in checked:
        return
    checked.add(guide)
    try:
        moving = find_moving()
    except BaseException:
        checked.discard(guide)
        raise
    if moving:
        checked.discard(guide)
        raise _moving_subspace_error(type(guide).__name__, moving, framework)


def _moving_subspace_error(guide_name: str, moving: dict, framework: str) -> ValueError:
    trace, consequence, handler, package, aside = _FRAMEWORKS[framework]
    sites = ", ".join(f"{name!r} (with {', '.join(map(repr, by))})" for name, by in moving.items())
    config = ", ".join(f"{name!r}: LinearConstrainedNormalReparam()" for name in moving)
    return ValueError(
        f"{guide_name}: the support of the LinearConstrainedNormal site(s) {sites}, the "
        "subspace A z = k, moves: A or k depend on those latent sites or parameters. "
        f"{framework}'s AutoGuides build each site's bijection once, from {trace}, so the "
        f"guide's values would stay on that first subspace, off the model's{consequence}. "
        f"Reparameterise the site(s), which is exact: {handler}(model, config={{{config}}}) "
        f"with {package}.LinearConstrainedNormalReparam{aside}."
    )
