"""PoissonBinomial.log_pmf (every count) against scipy.stats.poisson_binom and the
``fast-poibin`` package (if installed), same inputs, same run, with the accuracy of each
against a 40-digit mpmath recursion (or, beyond it, an 80-bit long-double recursion).

Run from the repository root: ``python -m benchmarks.poisson_binomial [--max-n N]``.

For each n, logits ~ N(0, 2^2) (float64, one batch row, one thread): the time of
``PoissonBinomial(logits).log_pmf()`` (torch, tilted windows), of
``scipy.stats.poisson_binom.logpmf(arange(n + 1), p)`` and of ``fast_poibin.PoiBin(p)``
(probabilities, not logs: divide-and-conquer FFT convolutions in float64, negative
rounding noise clamped to 0), and the largest error of each in ``log P`` over the counts
whose true probability is a normal float (above 2.2e-308). For fast-poibin, the error is
taken where its own P is a normal float too, and the counts where it returns 0 (or a
subnormal) although the truth is a normal float are counted, as are the counts it gets
wrong by more than 1% (error in log P above 0.01). The reference is the O(n^2) recursion
``P_i(j) = P_{i-1}(j) q_i + P_{i-1}(j - 1) p_i`` in mpmath (40 digits, n <=
``--max-reference-n``) or in NumPy's long double (80-bit x87 on x86-64, eps 1.1e-19; every
term positive, so the relative error is below about 5 n eps: 5e-14 at n = 1e5; exponents
down to 1e-4951; n <= ``--max-longdouble-n``). Beyond ``--max-pmf-n``, the time of
``log_prob`` of one count (the likelihood of one observed count), which is all a model needs
per observation.
"""

import argparse
import time

import mpmath
import numpy as np
import scipy.stats
import torch

from pyro_constrained import PoissonBinomial

try:
    from fast_poibin import PoiBin
except ImportError:  # optional: pip install fast-poibin
    PoiBin = None

TINY = np.finfo(np.float64).tiny
NORMAL = np.log(TINY)


def reference(logits: np.ndarray) -> np.ndarray:
    """log P(K = j), j = 0..n, by the recursion in 40-digit mpmath."""
    with mpmath.workdps(40):
        table = [mpmath.mpf(1)]
        for theta in logits:
            p = 1 / (1 + mpmath.exp(-mpmath.mpf(float(theta))))
            q = 1 - p
            new = [t * q for t in table] + [mpmath.mpf(0)]
            for j, t in enumerate(table):
                new[j + 1] += t * p
            table = new
        return np.array([float(mpmath.log(t)) for t in table])


def longdouble_reference(logits: np.ndarray) -> np.ndarray:
    """log P(K = j), j = 0..n, by the same recursion in NumPy's long double (sums of
    positive products: relative error below about 5 n eps_longdouble)."""
    if np.finfo(np.longdouble).eps > 1e-18:
        raise RuntimeError("no extended-precision long double on this platform")
    theta = logits.astype(np.longdouble)
    p, q = 1 / (1 + np.exp(-theta)), 1 / (1 + np.exp(theta))
    table = np.zeros(len(logits) + 1, np.longdouble)
    table[0] = 1
    for i in range(len(logits)):
        table[1 : i + 2] = table[1 : i + 2] * q[i] + table[: i + 1] * p[i]
        table[0] *= q[i]
    with np.errstate(divide="ignore"):
        return np.log(table).astype(np.float64)


def timed(function, *args):
    start = time.perf_counter()
    out = function(*args)
    return out, time.perf_counter() - start


def log_error(values: np.ndarray, exact: np.ndarray, normal: np.ndarray) -> str:
    """The largest error in log P over the true-normal counts (and how many are -inf)."""
    bad = ~np.isfinite(values[normal])
    error = np.abs(values[normal] - exact[normal])
    worst = f"{error[~bad].max():.2g}"
    return f"{worst}; {bad.sum()} zeros" if bad.any() else worst


def fast_poibin_errors(pmf: np.ndarray, exact: np.ndarray, normal: np.ndarray) -> list:
    """[error in log P where both are normal, counts lost (0 or subnormal where the truth is
    normal), counts off by more than 1%]."""
    ours_normal = pmf >= TINY
    both = normal & ours_normal
    with np.errstate(divide="ignore"):
        error = np.abs(np.log(pmf[both]) - exact[both])
    lost = int((normal & ~ours_normal).sum())
    return [f"{error.max():.2g}", str(lost), str(int((error > 0.01).sum()) + lost)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-n", type=int, default=1_000_000)
    parser.add_argument("--max-pmf-n", type=int, default=100_000)
    parser.add_argument("--max-scipy-n", type=int, default=10_000)
    parser.add_argument("--max-reference-n", type=int, default=2_000)
    parser.add_argument("--max-longdouble-n", type=int, default=100_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    if PoiBin is None:
        print("fast-poibin is not installed (pip install fast-poibin): its columns are '-'.")
    else:
        PoiBin(np.full(2000, 0.5))  # compiles (numba) before any timing
    print(
        "| n | log_pmf (ours) | scipy poisson_binom | fast-poibin | max abs err log P (ours) "
        "| (scipy) | (fast-poibin, where its P is normal) | fast-poibin: 0 where P is normal "
        "| fast-poibin: off by > 1% | smallest normal P |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (10, 100, 1_000, 10_000, 100_000, 1_000_000):
        if n > args.max_n:
            break
        logits = rng.normal(size=n) * 2.0
        p = 1 / (1 + np.exp(-logits))
        d = PoissonBinomial(logits=torch.tensor(logits))
        if n <= args.max_pmf_n:
            d.log_pmf()  # warm-up
            ours, t_ours = timed(d.log_pmf)
            ours, ours_cell = ours.numpy(), f"{t_ours:.3g} s"
        else:
            count = torch.tensor(float(n // 3))
            _, t_one = timed(d.log_prob, count)
            ours, ours_cell = None, f"one count: {t_one:.3g} s"
        theirs, scipy_cell = None, "-"
        if n <= args.max_scipy_n:
            with np.errstate(divide="ignore"):
                theirs, t_scipy = timed(scipy.stats.poisson_binom.logpmf, np.arange(n + 1), p)
            scipy_cell = f"{t_scipy:.3g} s"
        fast, fast_cell = None, "-"
        if PoiBin is not None:
            fast, t_fast = timed(PoiBin, p)
            fast, fast_cell = fast.pmf, f"{t_fast:.3g} s"
        errors = ["-"] * 7
        exact = None
        if n <= args.max_reference_n:
            exact = reference(logits)
        elif n <= args.max_longdouble_n:
            exact = longdouble_reference(logits)
        if exact is not None:
            mark = "" if n <= args.max_reference_n else " (ld)"
            normal = exact > NORMAL
            if ours is not None:
                errors[0] = log_error(ours, exact, normal) + mark
            if theirs is not None:
                errors[1] = log_error(theirs, exact, normal) + mark
            if fast is not None:
                errors[2:5] = fast_poibin_errors(fast, exact, normal)
                errors[2] += mark
            errors[5] = f"{np.exp(exact[normal].min()):.2g}"
        cells = [str(n), ours_cell, scipy_cell, fast_cell, *errors[:3], *errors[3:5], errors[5]]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
