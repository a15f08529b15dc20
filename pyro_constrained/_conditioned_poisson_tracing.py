"""What ``ConditionedPoisson`` may read in Python under ``torch.jit.trace``.

Pyro's ``JitTrace*_ELBO`` trace the model and guide once and replay the recorded tensor
program: a Python branch on a tensor's value is frozen at the value of the first call.
``ConditionedPoisson`` branches in Python only on static information: shapes, dtypes, and
the counts ``k``, which are a constant of the trace (a Python number or a tensor closed over,
not an input of the traced function) or, where ``k_max`` is given, bounded by it. Everything
that depends on the rates takes branch-free forms (``torch.where``, masks) or a size that
holds for every rate (the entropy's window under trace).
"""

from __future__ import annotations

from pyro_constrained.exactly_k_tracing import static_under_trace

# Re-exported: the ConditionedPoisson modules import it from here.
__all__ = ["static_under_trace"]
