"""The framework-free half of constrained-ppl, shared by ``pyro_constrained`` and
``numpyro_constrained``; it imports neither torch nor JAX, only NumPy.

- ``constrained_ppl.arguments``: the rules for counts, static bounds and value shapes that
  both packages apply to their arguments.
- ``constrained_ppl.binomial_tails``: the stated truncation bound of ``ConditionedPoisson``'s
  exact entropy.
- ``constrained_ppl.enumeration``: the enumerated supports (k-hot table, compositions) and
  the checks on their size.
- ``constrained_ppl.exact_integers``: the ranges in which a float dtype holds integers
  exactly.
- ``constrained_ppl.stirling``: the Stirling-error table and series constants behind
  ``ConditionedPoisson``'s log-factorials and Poisson log-probabilities without cancellation.
- ``constrained_ppl.extras``: the check each framework package makes that its framework (an
  optional extra) is installed.
- ``constrained_ppl.showcase``: the framework-free half of the main job
  (``python -m pyro_constrained`` / ``python -m numpyro_constrained``): the NumPy data
  generators, the process simulator of the surrogate tutorial, the results table and the
  command line.

``__version__`` is the version of the distribution: ``setup.cfg`` reads it from here, and
both framework packages re-export it.
"""

__version__ = "0.1.0"
