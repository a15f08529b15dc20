"""The supports that ``enumerate_support`` lists, as NumPy tables (both packages use them)."""

import itertools

import numpy as np


def k_hot_table(n: int, k: int, forced_on=(), forced_off=()) -> np.ndarray:
    """All k-hot 0/1 vectors of length ``n`` with ones at ``forced_on`` and zeros at
    ``forced_off``, shape ``(count, n)``, in lexicographic order of the positions of their
    ones."""
    fixed = set(forced_on) | set(forced_off)
    free = [i for i in range(n) if i not in fixed]
    rest = k - len(forced_on)
    rows = []
    if 0 <= rest <= len(free):
        rows = sorted(
            tuple(sorted(list(forced_on) + list(c))) for c in itertools.combinations(free, rest)
        )
    table = np.zeros((len(rows), n))
    for r, ones in enumerate(rows):
        table[r, list(ones)] = 1.0
    return table


def compositions(n: int, k: int) -> np.ndarray:
    """All compositions of ``k`` into ``n`` non-negative parts, shape
    ``(C(k + n - 1, n - 1), n)``, in reverse lexicographic order (stars and bars: the
    positions of the ``n - 1`` bars among ``k + n - 1`` slots, in lexicographic order)."""
    rows = []
    for bars in itertools.combinations(range(k + n - 1), n - 1):
        edges = (-1,) + bars + (k + n - 1,)
        rows.append([edges[i + 1] - edges[i] - 1 for i in range(n)])
    return np.asarray(rows, dtype=np.float64).reshape(-1, n)


def single_count(k, what: str) -> int:
    """The one value of the counts ``k`` (any array-like) over the batch: enumeration
    needs one support, so several values are a ``ValueError``."""
    values = np.unique(np.asarray(k))
    if values.size != 1:
        raise ValueError(
            f"{what}.enumerate_support needs one k for the whole batch (one support), got "
            f"k = {values.tolist()}; split the site or enumerate each k separately"
        )
    return int(values[0])


def check_support_size(count: int, max_support: int, what: str) -> None:
    """A ``ValueError`` when the support has more than ``max_support`` members (checked
    before anything is built)."""
    if count > max_support:
        raise ValueError(
            f"{what}.enumerate_support: the support has {count} members, more than "
            f"max_support = {max_support}; enumerate only small sites (or raise the class "
            "attribute max_support)"
        )
