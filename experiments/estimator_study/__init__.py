"""Experiments that measure the library's gradient estimators against the papers' baselines.

Not imported by ``pyro_constrained`` itself: the estimators here are baselines for studies,
not defaults. ``python -m experiments.estimator_study.estimators --out DIR`` runs the
synthetic bias / variance study (see ``experiments/README.md`` in the repository).
"""
