"""Matrix products at the full precision of their dtype on every backend.

XLA computes a float32 ``dot`` at ``Precision.DEFAULT`` in TensorFloat-32 on GPUs that have
it (NVIDIA Ampere and later): 10-bit mantissas, a relative error of about 5e-4. That is a
hundred times the float32 tolerance of the constraint ``A z = k``, so a sample, a projection
or the support check computed that way is wrong by more than the guarantee allows. Every
product of this package goes through ``matmul``, which asks for ``Precision.HIGHEST``
(full float32; float64 and the CPU are unaffected). The user's own products, in their model
or network, keep JAX's default (``jax.default_matmul_precision``).
"""

from functools import partial

import jax.numpy as jnp
from jax import lax

matmul = partial(jnp.matmul, precision=lax.Precision.HIGHEST)
