"""Experiments that measure the library's gradient estimators against the papers' baselines.

Not imported by ``pyro_constrained`` itself: the estimators here are baselines for studies,
not defaults. ``python -m pyro_constrained.experiments.estimators --out DIR`` runs the
synthetic bias / variance study (see ``experiments/README.md`` in the repository).
"""
