"""The one home of what ``pyro_constrained`` relies on in Pyro or PyTorch without a public
API to rely on.

Each entry names the framework behaviour it relies on; ``tests/test_compat_pyro.py`` checks
each against the installed versions and fails with a message saying what to update here
when that behaviour changes. Everything outside this module uses public APIs only.
"""

from __future__ import annotations

import inspect

# ---------------------------------------------------------------------------------------
# The AutoGuide that is building a subspace bijection.
#
# Relies on: Pyro's AutoGuides (pyro-ppl 1.9) build the bijection of every latent site's
# support (``biject_to``, or ``transform_to`` through AutoDelta's ``PyroParam``) inside
# ``AutoGuide._setup_prototype(self, *args, **kwargs)``, once, from the prototype trace, and
# keep it. Pyro does not tell a support who asks for its bijection, so the rule below
# recognises that frame on the call stack: a method of that name whose ``self`` is an
# ``AutoGuide``. If Pyro renames it or builds the bijections elsewhere, the check stops
# firing (JitTrace_ELBO with AutoDelta is then silently ``inf`` after its first step);
# tests/test_reparam_pyro.py runs each AutoGuide kind on a moving subspace and fails,
# saying to update this, when the error is gone.
# ---------------------------------------------------------------------------------------

AUTOGUIDE_SETUP = "_setup_prototype"


def autoguide_being_set_up(depth: int = 64):
    """``(guide, args, kwargs)`` of the Pyro ``AutoGuide`` whose setup (see above) is on the
    call stack within ``depth`` frames, or ``None``: ``args`` and ``kwargs`` are the model's
    arguments it was called with."""
    from pyro.infer.autoguide import AutoGuide

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
# Relies on: pyro-ppl 1.9's ``MaskedDistribution`` keeping its mask in the attribute ``_mask``
# (a bool or an array broadcastable to the batch shape), for which Pyro has no
# getter. ``LinearConstrainedNormalReparam`` replaces a site by a new one, which must carry
# the site's mask (else the rewritten model's density counts what the mask removed). The
# compat test checks the attribute against ``log_prob`` of masked distributions.
# ---------------------------------------------------------------------------------------


def mask_of(masked):
    """The mask of a ``MaskedDistribution``: a bool or an array of batch shape."""
    return masked._mask
