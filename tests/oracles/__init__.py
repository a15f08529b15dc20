"""Independent NumPy / SciPy references shared by the Pyro and NumPyro tests.

These oracles never call the library: brute-force enumeration of the support for small n,
and SciPy's distributions. Both packages' tests compare against the same oracle.
"""
