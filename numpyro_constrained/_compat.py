"""The one home of what ``numpyro_constrained`` relies on in NumPyro or JAX without a public
API to rely on.

Each entry names the framework behaviour it relies on; ``tests/test_compat_numpyro.py``
checks each against the installed versions and fails with a message saying what to update
here when that behaviour changes. Everything outside this module uses public APIs only.
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp
from numpyro.distributions import constraints

# ---------------------------------------------------------------------------------------
# The guard against NumPyro's scalar-coordinate consumers of ``enumerate_support``.
#
# Relies on: NumPyro has no hook telling a distribution who enumerates it, so the caller is
# recognised by the module and function names of the frames above ``enumerate_support``.
# numpyro 0.22: ``numpyro.infer.gibbs.discrete_support_sizes`` (DiscreteHMCGibbs and
# MixedHMC size their one-coordinate-at-a-time proposals with it; older releases had it in
# ``numpyro.infer.hmc_gibbs``) and ``numpyro.contrib.funsor.enum_messenger``'s
# ``enum.process_message`` (replaces the value by the index ``arange(size)``), each calling
# ``fn.enumerate_support(False)`` directly. If NumPyro renames or moves them, the guard stops
# firing silently; the compat test checks that each name still exists and still calls
# ``enumerate_support``, and that real DiscreteHMCGibbs / funsor calls still get the error.
#
# Neither machine can represent a k-hot vector or a composition: Gibbs proposals leave the
# support and are all rejected (the chain silently never moves), and funsor passes indices
# of the wrong shape to log_prob.
# ---------------------------------------------------------------------------------------

_GIBBS = (
    "DiscreteHMCGibbs / MixedHMC propose one scalar coordinate at a time (values 0 .. "
    "size - 1), which cannot keep it in its support: every proposal would be rejected "
    "and the chain would silently never move"
)
_FUNSOR = (
    "numpyro.contrib.funsor's enumeration (config_enumerate with TraceEnum_ELBO, "
    "infer_discrete, or NUTS/HMC on a model with discrete latents) replaces a site's value "
    "by the index 0 .. size - 1, which only works for scalar-valued sites"
)
SCALAR_COORDINATE_CONSUMERS = {
    ("numpyro.infer.gibbs", "discrete_support_sizes"): _GIBBS,
    ("numpyro.infer.hmc_gibbs", "discrete_support_sizes"): _GIBBS,
    ("numpyro.contrib.funsor.enum_messenger", "process_message"): _FUNSOR,
}


def refuse_scalar_coordinate_consumers(name: str, depth: int = 8, gibbs: bool = True) -> None:
    """A ``ValueError`` when ``enumerate_support`` is called by one of NumPyro's machines
    that enumerate each scalar coordinate separately (`SCALAR_COORDINATE_CONSUMERS`),
    saying what to do instead. ``depth``: how many frames above the caller are looked at;
    ``gibbs``: whether the Gibbs samplers are refused too (not where one-coordinate moves
    can stay in the support, as between the counts of a range)."""
    frame = inspect.currentframe()
    # Skip this function's frame and its caller's (the enumerate_support method).
    frame = frame.f_back if frame is not None else None
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return
        key = (frame.f_globals.get("__name__"), frame.f_code.co_name)
        reason = SCALAR_COORDINATE_CONSUMERS.get(key)
        if reason is not None and (gibbs or reason != _GIBBS):
            raise ValueError(
                f"{name} is an event-shaped discrete site (a k-hot vector or a "
                f"composition): {reason}. Enumerate it instead "
                "through an index: `support = d.enumerate_support()`, "
                "`i = numpyro.sample(name, dist.Categorical(logits=d.log_prob(support)))`, "
                "`z = support[i]` (then TraceEnum_ELBO, infer_discrete, DiscreteHMCGibbs and "
                "NUTS with enumeration all work on `i`; see the README)."
            )


# ---------------------------------------------------------------------------------------
# The default of ``validate_args``.
#
# Relies on: ``numpyro.enable_validation`` / ``Distribution.set_default_validate_args``
# storing the default in the class attribute ``Distribution._validate_args`` (numpyro
# 0.22; older releases not checked here), which NumPyro offers no getter for. A
# constructor that validates its arguments itself, before ``Distribution.__init__``, needs
# it. The compat test checks that it follows ``numpyro.enable_validation``.
# ---------------------------------------------------------------------------------------


def default_validate_args() -> bool:
    """Whether a distribution built with ``validate_args=None`` validates (the default that
    ``numpyro.enable_validation`` sets)."""
    from numpyro.distributions import Distribution

    return bool(Distribution._validate_args)


# ---------------------------------------------------------------------------------------
# JAX's scoped x64 switch.
#
# Relies on: a context manager that switches ``jax_enable_x64`` for a block only. JAX
# spells it ``jax.enable_x64`` in the newest releases (0.10) and only
# ``jax.experimental.enable_x64`` in older ones (0.7.0, this package's floor), which the
# newest no longer have. The compat test checks that one of the two exists and switches
# the mode for its block only.
# ---------------------------------------------------------------------------------------


def enable_x64(new_val: bool = True):
    """A context manager in which JAX's x64 mode is ``new_val`` (restored on exit)."""
    import jax

    switch = getattr(jax, "enable_x64", None)
    if switch is None:
        import jax.experimental

        switch = jax.experimental.enable_x64
    return switch(new_val)


# ---------------------------------------------------------------------------------------
# Replaying the model when a support moves.
#
# Relies on: ``numpyro.infer.util._transforms_from_trace`` (numpyro 0.22), which flags a
# model's supports as dynamic only when a latent site's support is an instance of NumPyro's
# interval (``constraints.interval``) or lower-bounded (``constraints.greater_than``)
# constraint whose bounds are not Python numbers. The flag makes the ``postprocess_fn`` of
# ``initialize_model`` (``MCMC.get_samples``, ``AutoContinuous.sample_posterior``) replay
# the model for every draw; without it, the draws are mapped back with the transforms of
# the initial trace. NumPyro has no public way for a support to say it may move, so a
# support whose parameters may depend on other latent variables (``LinearConstrainedNormal``'s
# affine subspace when ``A`` or ``k`` does) lists `DynamicSupport` as its base class and
# overrides every method of the interval class (the compat test checks both: that the
# replay still happens, and that no interval method is inherited).
# ---------------------------------------------------------------------------------------


class DynamicSupport(constraints.interval):
    """The base class of a support constraint whose parameters may depend on other latent
    variables: NumPyro then replays the model to map draws back to it (see above). Its only
    content is the two unbounded bounds NumPyro looks at, as arrays (which no Python number
    is); a subclass defines every method itself, so no rule of an interval applies."""

    @property
    def lower_bound(self):
        return jnp.asarray(-jnp.inf)

    @property
    def upper_bound(self):
        return jnp.asarray(jnp.inf)


# ---------------------------------------------------------------------------------------
# The AutoGuide that is building a subspace bijection.
#
# Relies on: NumPyro's AutoGuides (numpyro 0.22) build the bijection of every latent site's
# support inside ``AutoGuide._setup_prototype(self, *args, **kwargs)`` (through
# ``initialize_model``, which calls ``biject_to`` on each support), once, from a trace at
# the initial values, and keep that bijection for the whole fit (``AutoGuideList`` sets
# itself up the same way, on the whole model). NumPyro does not tell a support who asks
# for its bijection, so ``biject_to``'s rule for the subspace recognises that frame on the
# call stack: a method of that name whose ``self`` is an ``AutoGuide``. If NumPyro renames
# it or builds the bijections elsewhere, the check of a moving subspace stops firing (an
# AutoGuide's ELBO is then silently ``inf`` again); the compat test runs each AutoGuide
# kind on a moving subspace and fails, saying to update this, when the error is gone.
# ---------------------------------------------------------------------------------------

AUTOGUIDE_SETUP = "_setup_prototype"


def autoguide_being_set_up(depth: int = 64):
    """``(guide, args, kwargs)`` of the NumPyro ``AutoGuide`` whose setup (see above) is on
    the call stack within ``depth`` frames, or ``None``: ``args`` and ``kwargs`` are the
    model's arguments it was called with."""
    from numpyro.infer.autoguide import AutoGuide

    frame = inspect.currentframe()
    for _ in range(depth):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        if frame.f_code.co_name == AUTOGUIDE_SETUP:
            local = frame.f_locals
            if isinstance(local.get("self"), AutoGuide):
                return local["self"], tuple(local.get("args", ())), dict(local.get("kwargs", {}))
    return None


# ---------------------------------------------------------------------------------------
# The mask of a ``MaskedDistribution`` (``.mask()``).
#
# Relies on: numpyro 0.22's ``MaskedDistribution`` keeping its mask in the attribute ``_mask``
# (a bool or an array broadcastable to the batch shape), for which NumPyro has no
# getter. ``LinearConstrainedNormalReparam`` replaces a site by a new one, which must carry
# the site's mask (else the rewritten model's density counts what the mask removed). The
# compat test checks the attribute against ``log_prob`` of masked distributions.
# ---------------------------------------------------------------------------------------


def mask_of(masked):
    """The mask of a ``MaskedDistribution``: a bool or an array of batch shape."""
    return masked._mask
