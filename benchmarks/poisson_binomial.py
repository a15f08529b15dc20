"""PoissonBinomial.log_pmf (every count) against scipy.stats.poisson_binom, same inputs,
same run, with the accuracy of both against a 40-digit mpmath recursion.

Run from the repository root: ``python -m benchmarks.poisson_binomial [--max-n N]``.

For each n, logits ~ N(0, 2^2) (float64, one batch row, one thread): the time of
``PoissonBinomial(logits).log_pmf()`` (torch, tilted windows) and of
``scipy.stats.poisson_binom.logpmf(arange(n + 1), p)``, and, where the O(n^2) mpmath
reference is affordable (n <= ``--max-reference-n``), the largest error of each in
``log P`` over the counts whose probability is a normal float (above 2.2e-308), and the
smallest such probability. Beyond that n, the time of ``log_prob`` of one count (the
likelihood of one observed count), which is all a model needs per observation.
``fast-poibin`` is not compared (not installed here).
"""

import argparse
import time

import mpmath
import numpy as np
import scipy.stats
import torch

from pyro_constrained import PoissonBinomial

NORMAL = np.log(np.finfo(np.float64).tiny)


def reference(logits: np.ndarray) -> np.ndarray:
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


def timed(function, *args):
    start = time.perf_counter()
    out = function(*args)
    return out, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-n", type=int, default=1_000_000)
    parser.add_argument("--max-pmf-n", type=int, default=100_000)
    parser.add_argument("--max-scipy-n", type=int, default=100_000)
    parser.add_argument("--max-reference-n", type=int, default=2_000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    print(
        "| n | log_pmf (ours) | scipy poisson_binom | max abs err log P (ours) | (scipy) "
        "| smallest normal P |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (10, 100, 1_000, 10_000, 100_000, 1_000_000):
        if n > args.max_n:
            break
        logits = rng.normal(size=n) * 2.0
        d = PoissonBinomial(logits=torch.tensor(logits))
        if n <= args.max_pmf_n:
            d.log_pmf()  # warm-up
            ours, t_ours = timed(d.log_pmf)
            ours, ours_cell = ours.numpy(), f"{t_ours:.3g} s"
        else:
            count = torch.tensor(float(n // 3))
            _, t_one = timed(d.log_prob, count)
            ours, ours_cell = None, f"one count: {t_one:.3g} s"
        if n <= args.max_scipy_n:
            p = 1 / (1 + np.exp(-logits))
            with np.errstate(divide="ignore"):
                theirs, t_scipy = timed(scipy.stats.poisson_binom.logpmf, np.arange(n + 1), p)
            scipy_cell = f"{t_scipy:.3g} s"
        else:
            theirs, scipy_cell = None, "-"
        errors = ["-", "-", "-"]
        if n <= args.max_reference_n and ours is not None:
            exact = reference(logits)
            normal = exact > NORMAL
            errors[0] = f"{np.abs(ours - exact)[normal].max():.2g}"
            if theirs is not None:
                bad = ~np.isfinite(theirs[normal])
                error = np.abs(theirs[normal] - exact[normal])
                worst = f"{error[~bad].max():.2g}"
                errors[1] = f"{worst}; {bad.sum()} zeros" if bad.any() else worst
            errors[2] = f"{np.exp(exact[normal].min()):.2g}"
        print(f"| {n} | {ours_cell} | {scipy_cell} | {errors[0]} | {errors[1]} | {errors[2]} |")


if __name__ == "__main__":
    main()
