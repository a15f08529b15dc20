"""Framework-free checks on integer totals carried in floating-point arrays.

ConditionedPoisson stores ``k`` and its samples in the rates' floating dtype (as
``Binomial.total_count`` is). A float with ``m`` mantissa bits holds every integer up to
``2**m`` exactly and rounds some of those above; a total beyond that is refused rather than
silently rounded (``2**24 + 1`` becomes ``2**24`` in float32).
"""

from __future__ import annotations

# Significand bits, the implicit leading bit included, by dtype name.
_SIGNIFICAND_BITS = {"float16": 11, "bfloat16": 8, "float32": 24, "float64": 53}


def largest_exact_integer(dtype_name: str) -> int:
    """``2**m`` for a float dtype with ``m`` significand bits: every integer in
    ``[0, 2**m]`` is representable, ``2**m + 1`` is not."""
    name = dtype_name.rsplit(".", 1)[-1]
    if name not in _SIGNIFICAND_BITS:
        raise ValueError(f"no exact-integer range known for dtype {dtype_name}")
    return 2 ** _SIGNIFICAND_BITS[name]


def check_total_in_exact_range(k_max: int, dtype_name: str, *, argument: str = "k") -> None:
    """``ValueError`` naming ``argument`` when the largest total ``k_max`` exceeds the exact
    integer range of ``dtype_name`` (the dtype its counts and samples are computed in)."""
    limit = largest_exact_integer(dtype_name)
    if k_max > limit:
        name = dtype_name.rsplit(".", 1)[-1]
        raise ValueError(
            f"{argument} = {k_max} exceeds 2**{limit.bit_length() - 1} = {limit}, the largest "
            f"integer up to which {name} represents every integer exactly; counts summing to "
            f"{argument} would be rounded. Use float64 rates (up to 2**53)."
        )


def check_k_max_bounds_k(k_max: int, largest_k: int) -> None:
    """``ValueError`` when a static bound ``k_max`` is below the largest concrete ``k``."""
    if k_max < largest_k:
        raise ValueError(
            f"k_max = {k_max} is below the largest k = {largest_k}: k_max must bound every k "
            "(samples would otherwise sum to k_max, not k)"
        )
