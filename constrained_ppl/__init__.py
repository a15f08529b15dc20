"""Framework-free helpers shared by ``pyro_constrained`` and ``numpyro_constrained``."""
