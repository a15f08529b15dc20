"""The one-sided derivatives at ``probs`` of exactly 0 and 1 under ``torch.jit.trace``
(Pyro's JIT ELBOs): ``PoissonBinomial``, ``CountConstrainedBernoulli`` and
``ExactlyKBernoulli`` built from differentiated probs add zero-valued terms that carry them.
Whether the probs hold a 0 or a 1 must not be read at the trace: a program traced with
interior probs, called with 0s and 1s, must give the eager values and derivatives. The
reference is brute-force enumeration of the 2^n vectors, written here, differentiated by
one-sided differences (``p + h`` at a 0, ``p - h`` at a 1)."""

import os
import warnings

import numpy as np
import pytest
import torch

import pyro_constrained as pc
from tests.oracles import binary_vectors as oracle

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated:DeprecationWarning")

N = 5
# Interior probs at the trace; a 1 and two 0s at the calls (counts 1..3 possible there).
TRACE_PROBS = [0.35, 0.7, 0.4, 0.2, 0.55]
EDGE_PROBS = [0.0, 1.0, 0.3, 0.6, 0.0]
# Free probs for the second argument of a KL (finite whatever p's 0s and 1s do).
Q_FREE = [0.4, 0.9, 0.5, 0.1, 0.7]
# The edge probs' 0s and 1s with other interior entries: a KL's first argument for the
# derivative in its second (finite when the second has the same 0s and 1s).
P_SAME_EDGES = [0.0, 1.0, 0.45, 0.25, 0.0]
WEIGHTS = [0.5, -1.0, 2.0, 0.3, -0.7]
# CountConstrainedBernoulli's range: a 0 that moves opens count 4 (inside the range), the
# 1 count 0 (outside). Its KL needs the same feasible range in both arguments: HIGH_KL = 3.
LOW, HIGH, HIGH_KL = 1, 4, 3
K = 2
LARGEST = float(np.finfo(np.float64).max)


def _trace(function):
    """(``function`` traced at the interior probs, the TracerWarnings raised from
    ``_count_edges``, where the count classes decide whether to build the terms)."""
    probs = torch.tensor(TRACE_PROBS, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        traced = torch.jit.trace(function, (probs,), check_trace=False)
    edges = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, torch.jit.TracerWarning)
        and w.filename.endswith(os.path.join("pyro_constrained", "_count_edges.py"))
    ]
    return traced, edges


def _check_against_eager_and_reference(function, names, reference, infinite):
    """The traced ``function`` (a stack of scalars) at the edge probs against the eager one
    (values and gradients) and against ``reference(name, x)`` (values and one-sided
    differences); ``infinite``: {name: the sign of each entry's infinite slope, 0 where
    finite}."""
    traced, edge_warnings = _trace(function)
    x = torch.tensor(EDGE_PROBS, dtype=torch.float64, requires_grad=True)
    got, eager = traced(x), function(x)
    assert got.shape == (len(names),)
    torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
    point = np.array(EDGE_PROBS)
    for i, name in enumerate(names):
        (gradient,) = torch.autograd.grad(got[i], x, retain_graph=True)
        (eager_gradient,) = torch.autograd.grad(eager[i], x, retain_graph=True)
        torch.testing.assert_close(
            gradient, eager_gradient, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}"
        )
        assert float(got[i].detach()) == pytest.approx(
            reference(name, point), rel=1e-9, abs=1e-12
        ), name
        expected = oracle.one_sided_derivatives(lambda y, name=name: reference(name, y), point)
        gradient = gradient.numpy()
        moves = infinite.get(name, np.zeros(N)) != 0
        if moves.any():
            signs = infinite[name][moves]
            assert np.all(np.sign(expected[moves]) == signs), (name, expected)
            assert np.all(gradient[moves] == signs * LARGEST), (name, gradient)
        scale = max(1.0, np.abs(expected[~moves]).max())
        np.testing.assert_allclose(
            gradient[~moves], expected[~moves], atol=1e-6 * scale, err_msg=name
        )
    # A Python branch on the probs there would freeze the trace's answer.
    assert not edge_warnings, edge_warnings


EDGE_SIGNS = np.where(
    np.array(EDGE_PROBS) == 0, 1.0, np.where(np.array(EDGE_PROBS) == 1, -1.0, 0.0)
)


def test_poisson_binomial_traced_with_interior_probs_keeps_the_one_sided_derivatives():
    """log_prob, log_pmf, cdf, log_survival_function, mean, variance, entropy and the KL
    (log_cdf takes cdf's tangents, the KL in q log_pmf's terms)."""
    counts = [1, 2, 3]  # possible at the edge probs
    points = list(range(-1, N + 1))
    inner = [1, 2]  # P(K > x) positive at the edge probs
    names = (
        [f"log_prob {k}" for k in counts]
        + [f"log_pmf {k}" for k in counts]
        + [f"cdf {x}" for x in points]
        + [f"log_sf {x}" for x in inner]
        + ["mean", "variance", "entropy", "kl"]
    )

    def quantities(probs):
        d = pc.PoissonBinomial(probs=probs, validate_args=False)
        like = dict(dtype=probs.dtype)
        free = pc.PoissonBinomial(probs=torch.tensor(Q_FREE, **like), validate_args=False)
        kl = torch.distributions.kl_divergence
        return torch.cat(
            [
                d.log_prob(torch.tensor(counts, **like)),
                d.log_pmf()[counts],
                d.cdf(torch.tensor(points, **like)),
                d.log_survival_function(torch.tensor(inner, **like)),
                torch.stack([d.mean, d.variance, d.entropy(), kl(d, free)]),
            ]
        )

    vectors = oracle.all_vectors(N)
    totals = vectors.sum(-1).astype(int)

    def law(x):
        return np.bincount(totals, oracle.masses(x, vectors), N + 1)

    def reference(name, x):
        kind, _, number = name.partition(" ")
        masses, j = law(x), np.arange(N + 1.0)
        if kind in ("log_prob", "log_pmf"):
            return np.log(masses[int(number)])
        if kind == "cdf":
            return masses[: int(number) + 1].sum()
        if kind == "log_sf":
            return np.log(masses[int(number) + 1 :].sum())
        if kind == "mean":
            return masses @ j
        if kind == "variance":
            return masses @ j**2 - (masses @ j) ** 2
        if kind == "entropy":
            return oracle.entropy(masses)
        if kind == "kl":
            return oracle.kl(masses, law(np.array(Q_FREE)))
        raise AssertionError(name)

    # Moving a 0 (1) opens the count above (below) the range of K: -w log w in the entropy,
    # +w log w in the KL in p.
    infinite = {"entropy": EDGE_SIGNS, "kl": -EDGE_SIGNS}
    _check_against_eager_and_reference(quantities, names, reference, infinite)


def test_count_constrained_bernoulli_traced_with_interior_probs_keeps_the_one_sided_derivatives():
    """log_prob, log_range_prob, the marginals, variance, count_distribution, entropy and
    the KL in either argument."""
    value = [0.0, 1.0, 1.0, 0.0, 0.0]
    powers = np.arange(N + 1.0) ** 1.5
    names = ["log_prob", "log_range_prob", "mean", "variance", "count_distribution"]
    names += ["entropy", "kl", "kl_q"]

    def build(probs, high=HIGH):
        return pc.CountConstrainedBernoulli(probs=probs, low=LOW, high=high, validate_args=False)

    def quantities(probs):
        d = build(probs)
        like = dict(dtype=probs.dtype)
        weights = torch.tensor(WEIGHTS, **like)
        kl = torch.distributions.kl_divergence
        values = [
            d.log_prob(torch.tensor(value, **like)),
            d.log_range_prob(),
            (d.mean * weights).sum(),
            (d.variance * weights).sum(),
            (d.count_distribution * torch.tensor(powers, **like)).sum(),
            d.entropy(),
            kl(build(probs, HIGH_KL), build(torch.tensor(Q_FREE, **like), HIGH_KL)),
            kl(build(torch.tensor(P_SAME_EDGES, **like), HIGH_KL), build(probs, HIGH_KL)),
        ]
        return torch.stack(values)

    every = oracle.all_vectors(N)

    def law(x, high=HIGH):
        totals = every.sum(-1)
        vectors = every[(totals >= LOW) & (totals <= high)]
        masses = oracle.masses(x, vectors)
        return masses / masses.sum(), masses.sum(), vectors

    def reference(name, x):
        masses, total, vectors = law(x)
        totals = vectors.sum(-1).astype(int)
        mu = masses @ vectors
        if name == "log_prob":
            return np.log(masses[(vectors == value).all(-1)][0])
        if name == "log_range_prob":
            return np.log(total)
        if name == "mean":
            return mu @ WEIGHTS
        if name == "variance":
            return (mu * (1 - mu)) @ WEIGHTS
        if name == "count_distribution":
            return np.bincount(totals, masses, N + 1) @ powers
        if name == "entropy":
            return oracle.entropy(masses)
        if name == "kl":
            return oracle.kl(law(x, HIGH_KL)[0], law(np.array(Q_FREE), HIGH_KL)[0])
        if name == "kl_q":
            return oracle.kl(law(np.array(P_SAME_EDGES), HIGH_KL)[0], law(x, HIGH_KL)[0])
        raise AssertionError(name)

    infinite = {"entropy": EDGE_SIGNS, "kl": -EDGE_SIGNS}
    _check_against_eager_and_reference(quantities, names, reference, infinite)


def test_exactly_k_bernoulli_traced_with_interior_probs_keeps_the_one_sided_derivatives():
    """log_prob, log_constraint_prob, the marginals, variance, entropy and the KL in either
    argument (the terms were built in every trace before the count classes' were)."""
    value = [0.0, 1.0, 1.0, 0.0, 0.0]
    names = ["log_prob", "log_constraint_prob", "mean", "variance", "entropy", "kl", "kl_q"]

    def build(probs):
        return pc.ExactlyKBernoulli(probs=probs, k=K, validate_args=False)

    def quantities(probs):
        d = build(probs)
        like = dict(dtype=probs.dtype)
        weights = torch.tensor(WEIGHTS, **like)
        kl = torch.distributions.kl_divergence
        values = [
            d.log_prob(torch.tensor(value, **like)),
            d.log_constraint_prob(),
            (d.mean * weights).sum(),
            (d.variance * weights).sum(),
            d.entropy(),
            kl(d, build(torch.tensor(Q_FREE, **like))),
            kl(build(torch.tensor(P_SAME_EDGES, **like)), d),
        ]
        return torch.stack(values)

    vectors = oracle.all_vectors(N)
    vectors = vectors[vectors.sum(-1) == K]

    def law(x):
        masses = oracle.masses(x, vectors)
        return masses / masses.sum(), masses.sum()

    def reference(name, x):
        masses, total = law(x)
        mu = masses @ vectors
        if name == "log_prob":
            return np.log(masses[(vectors == value).all(-1)][0])
        if name == "log_constraint_prob":
            return np.log(total)
        if name == "mean":
            return mu @ WEIGHTS
        if name == "variance":
            return (mu * (1 - mu)) @ WEIGHTS
        if name == "entropy":
            return oracle.entropy(masses)
        if name == "kl":
            return oracle.kl(masses, law(np.array(Q_FREE))[0])
        if name == "kl_q":
            return oracle.kl(law(np.array(P_SAME_EDGES))[0], masses)
        raise AssertionError(name)

    infinite = {"entropy": EDGE_SIGNS, "kl": -EDGE_SIGNS}
    _check_against_eager_and_reference(quantities, names, reference, infinite)


def test_count_constrained_bernoulli_entropy_and_kl_gradients_in_a_batch_of_ranges():
    """A batch element with a narrower range than the widest has repeated stacked rows
    (log weight -inf); their masked ``0 * inf`` made the entropy's and the KL's gradients
    NaN for that element (a trace whose frozen width exceeds the range's hits the same).
    Reference: central differences of enumeration."""
    probs = np.array([[0.35, 0.7, 0.4, 0.2, 0.55]] * 2)
    lows, highs = [1, 1], [4, 2]
    x = torch.tensor(probs, requires_grad=True)
    q = torch.tensor([Q_FREE] * 2, dtype=torch.float64)

    def build(p):
        return pc.CountConstrainedBernoulli(
            probs=p, low=torch.tensor(lows), high=torch.tensor(highs)
        )

    entropy = build(x).entropy()
    kl = torch.distributions.kl_divergence(build(x), build(q))
    every = oracle.all_vectors(N)
    for row in range(2):
        inside = (every.sum(-1) >= lows[row]) & (every.sum(-1) <= highs[row])

        def law(y, inside=inside):
            masses = oracle.masses(y, every[inside])
            return masses / masses.sum()

        references = {
            "entropy": (entropy, lambda y: oracle.entropy(law(y))),
            "kl": (kl, lambda y, law=law: oracle.kl(law(y), law(np.array(Q_FREE)))),
        }
        for name, (value, reference) in references.items():
            (gradient,) = torch.autograd.grad(value[row], x, retain_graph=True)
            expected = oracle.one_sided_derivatives(reference, probs[row])
            np.testing.assert_allclose(gradient[row].numpy(), expected, atol=1e-6, err_msg=name)
            assert float(value[row].detach()) == pytest.approx(reference(probs[row]), rel=1e-9)


# Traced at the edge probs and a count of 1, replayed at other 0s and 1s, at none, and with
# larger counts: the sizes the first call's 0s, 1s and counts would set (stacked counts,
# kernel tables) must not be frozen either.
REPLAYS = [TRACE_PROBS, [1.0, 0.2, 0.0, 0.6, 1.0], EDGE_PROBS]


def _replay(function, first_value, values, reference):
    """``function(probs, value)`` (a vector) traced at the edge probs and ``first_value``,
    called at each of ``REPLAYS`` and ``values``: the eager values and gradients, and
    ``reference(probs, value)``'s values (``nan`` entries unchecked)."""
    x = torch.tensor(EDGE_PROBS, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        traced = torch.jit.trace(function, (x, first_value), check_trace=False)
    for probs in REPLAYS:
        for value in values:
            x = torch.tensor(probs, dtype=torch.float64, requires_grad=True)
            got, eager = traced(x, value), function(x, value)
            torch.testing.assert_close(got, eager, rtol=1e-12, atol=1e-12)
            expected = torch.as_tensor(reference(np.array(probs), value.numpy()))
            known = ~torch.isnan(expected)
            torch.testing.assert_close(got.detach()[known], expected[known], rtol=1e-9, atol=1e-12)
            finite = torch.isfinite(got)
            (gradient,) = torch.autograd.grad(got[finite].sum(), x)
            (eager_gradient,) = torch.autograd.grad(eager[finite].sum(), x)
            torch.testing.assert_close(gradient, eager_gradient, rtol=1e-9, atol=1e-12)


def test_poisson_binomial_traced_at_zeros_and_ones_replays_other_probs_and_counts():
    def quantities(probs, value):
        d = pc.PoissonBinomial(probs=probs, validate_args=False)
        return torch.cat([d.log_prob(value), d.log_pmf()])

    vectors = oracle.all_vectors(N)
    totals = vectors.sum(-1).astype(int)

    def reference(x, value):
        law = np.bincount(totals, oracle.masses(x, vectors), N + 1)
        with np.errstate(divide="ignore"):
            return np.log(np.concatenate([law[value.astype(int)], law]))

    values = [torch.tensor([float(k)], dtype=torch.float64) for k in (1, 3, 4)]
    _replay(quantities, values[0], values, reference)


def test_count_constrained_bernoulli_traced_at_zeros_and_ones_replays_other_probs_and_values():
    def quantities(probs, value):
        d = pc.CountConstrainedBernoulli(probs=probs, low=LOW, high=HIGH, validate_args=False)
        return torch.cat([d.log_prob(value)[None], d.log_range_prob()[None], d.mean])

    every = oracle.all_vectors(N)
    totals = every.sum(-1)
    vectors = every[(totals >= LOW) & (totals <= HIGH)]

    def reference(x, value):
        masses = oracle.masses(x, vectors)
        total = masses.sum()
        masses = masses / total
        with np.errstate(divide="ignore"):
            log_prob = np.log(masses[(vectors == value).all(-1)].sum())
        return np.concatenate([[log_prob, np.log(total)], masses @ vectors])

    values = [
        torch.tensor(v, dtype=torch.float64)
        for v in ([0.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 1.0])
    ]
    _replay(quantities, values[0], values, reference)
