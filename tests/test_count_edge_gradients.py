"""Issue 29 item 2 for the count classes: derivatives in ``probs`` at exact 0s and 1s.

``PoissonBinomial`` and ``CountConstrainedBernoulli`` treated such an entry as a mask
(gradient 0). Every quantity is a rational function of the odds there, so it has a finite
one-sided derivative (or, for the entropy and the KL in p, an infinite one, given as the
dtype's largest finite number with the limit's sign). The reference is brute-force
enumeration of all 2^n vectors in float64, differentiated by one-sided differences
(``p + h`` at 0, ``p - h`` at 1), independent of the kernels and of the odds expansion.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import numpyro_constrained as nc
import pyro_constrained as pc
from tests.oracles import binary_vectors as vectors_oracle
from tests.oracles import exactly_k as exactly_k_oracle
from tests.slow import framework_dtype_params

FRAMEWORKS = ["torch", "jax"]
DTYPES = ["float32", "float64"]
TOLERANCE = {"float32": 2e-4, "float64": 1e-7}

# Two 0s and a 1 among six, so that the counts next to the range's ends are reached.
PROBS = np.array([0.0, 1.0, 0.3, 0.6, 0.2, 0.0])
# q without 0s and 1s: the KL stays finite when p's 0s and 1s move.
Q_PROBS = np.array([0.4, 0.9, 0.5, 0.1, 0.7, 0.3])
WEIGHTS = np.array([0.5, -1.0, 2.0, 0.3, -0.7, 0.4])


def _count_law(probs: np.ndarray) -> np.ndarray:
    vectors = vectors_oracle.all_vectors(len(probs))
    return np.bincount(
        vectors.sum(-1).astype(int), vectors_oracle.masses(probs, vectors), len(probs) + 1
    )


def _check(name, got, expected, dtype, infinite=None):
    """``infinite``: the entries whose one-sided derivative is infinite, with its sign."""
    got = np.asarray(got, dtype=np.float64)
    assert not np.any(np.isnan(got)), (name, got)
    largest = float(np.finfo(dtype).max)
    expected = np.array(expected, dtype=np.float64)
    if infinite is not None:
        moves = infinite != 0
        assert np.all(np.sign(expected[moves]) == infinite[moves]), (name, expected)
        assert np.all(got[moves] == infinite[moves] * largest), (name, got)
        got, expected = got[~moves], expected[~moves]
    scale = max(1.0, np.abs(expected).max())
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[dtype] * scale, err_msg=name)


def _library_gradients(framework, dtype, build, outputs, p, q):
    """{name: gradient in p} of ``outputs(build(p), build(q), q)``'s entries, and the KL
    in q under the key ``"kl_q"`` (q is the last output's second argument)."""
    if framework == "torch":
        t_dtype = getattr(torch, dtype)
        x = torch.tensor(p, dtype=t_dtype, requires_grad=True)
        y = torch.tensor(q, dtype=t_dtype, requires_grad=True)
        values = outputs(build(x), build(y), torch)
        grads = {}
        for name, value in values.items():
            wrt = y if name == "kl_q" else x
            (grad,) = torch.autograd.grad(value, wrt, retain_graph=True)
            grads[name] = grad.numpy()
        return grads
    j_dtype = getattr(jnp, dtype)

    names = []

    def stacked(x, y):
        values = outputs(build(x), build(y), jnp)
        names[:] = list(values)
        return jnp.stack(list(values.values()))

    x, y = jnp.asarray(p, dtype=j_dtype), jnp.asarray(q, dtype=j_dtype)
    # One compilation of the whole Jacobian (eager, every operation compiles on its own).
    by_p, by_q = jax.jit(jax.jacrev(stacked, argnums=(0, 1)))(x, y)
    return {
        name: np.asarray(by_q[i] if name == "kl_q" else by_p[i]) for i, name in enumerate(names)
    }


def _light(framework: str, dtype: str) -> bool:
    """JAX in float32 (run with x64 off only: ``user_config_only``) checks a subset of the
    outputs: each method traces the kernels and their odds terms anew, about 10 s of
    compilation apiece; float64 checks them all."""
    return framework == "jax" and dtype == "float32"


def _rounded(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(dtype).astype(np.float64)


def _kl_fn(module):
    if module is torch:
        return torch.distributions.kl_divergence
    from numpyro.distributions.kl import kl_divergence

    return kl_divergence


def _array(module, x, like):
    return torch.tensor(x, dtype=like.dtype) if module is torch else jnp.asarray(x, like.dtype)


@pytest.mark.user_config_only
@pytest.mark.parametrize("framework, dtype", framework_dtype_params())
def test_poisson_binomial_one_sided_derivatives(framework, dtype):
    """PoissonBinomial: log_prob of each possible count, log_pmf, cdf / log_cdf /
    log_survival_function at every count, mean, variance, entropy, KL in p and in q (q with
    the same 0s and 1s)."""
    lib = pc if framework == "torch" else nc
    light = _light(framework, dtype)
    p, q = _rounded(PROBS, dtype), _rounded(np.where(PROBS % 1 == 0, PROBS, Q_PROBS), dtype)
    q_free = _rounded(Q_PROBS, dtype)
    n = len(p)
    counts = np.arange(1, n - 1)  # the counts possible at p (one 1, two 0s)

    def build(x):
        return lib.PoissonBinomial(probs=x)

    def outputs(d, dq, module):
        kl = _kl_fn(module)
        like = d.probs
        values = {}
        log_probs = d.log_prob(_array(module, counts * 1.0, like))
        for i, k in enumerate(counts):
            values[f"log_prob {k}"] = log_probs[i]
        points = np.arange(-1.0, n + 1)
        cdf = d.cdf(_array(module, points, like))
        for i, x in enumerate(points.astype(int)):
            values[f"cdf {x}"] = cdf[i]
        if not light:
            log_pmf = d.log_pmf()
            values["log_pmf"] = (log_pmf[1 : n - 1] * _array(module, counts * 1.0, like)).sum()
            inner = np.arange(1.0, n - 2)  # finite logs: P(K <= x) and P(K > x) positive
            log_cdf = d.log_cdf(_array(module, inner, like))
            log_sf = d.log_survival_function(_array(module, inner, like))
            for i, x in enumerate(inner.astype(int)):
                values[f"log_cdf {x}"] = log_cdf[i]
                values[f"log_sf {x}"] = log_sf[i]
            values["kl_q"] = kl(build(_array(module, p, like)), dq)
        values["mean"] = d.mean
        values["variance"] = d.variance
        values["entropy"] = d.entropy()
        values["kl"] = kl(d, lib.PoissonBinomial(probs=_array(module, q_free, like)))
        return values

    got = _library_gradients(framework, dtype, build, outputs, p, q)

    def reference(name):
        def at(x):
            law = _count_law(x)
            if name.startswith("log_prob"):
                return np.log(law[int(name.split()[1])])
            if name == "log_pmf":
                return float(np.log(law[1 : n - 1]) @ counts)
            if name.startswith("cdf"):
                return law[: int(name.split()[1]) + 1].sum()
            if name.startswith("log_cdf"):
                return np.log(law[: int(name.split()[1]) + 1].sum())
            if name.startswith("log_sf"):
                return np.log(law[int(name.split()[1]) + 1 :].sum())
            if name == "mean":
                return law @ np.arange(n + 1.0)
            if name == "variance":
                return law @ np.arange(n + 1.0) ** 2 - (law @ np.arange(n + 1.0)) ** 2
            if name == "entropy":
                return vectors_oracle.entropy(law)
            if name == "kl":
                return vectors_oracle.kl(law, _count_law(q_free))
            raise AssertionError(name)

        if name == "kl_q":
            return vectors_oracle.one_sided_derivatives(
                lambda y: vectors_oracle.kl(_count_law(p), _count_law(y)), q
            )
        return vectors_oracle.one_sided_derivatives(at, p)

    edges = np.where(p == 0, 1.0, np.where(p == 1, -1.0, 0.0))
    for name, gradient in got.items():
        # Moving a 0 (1) opens the count above (below) p's range: -w log w in the entropy,
        # +w log w in the KL (q allows that count).
        infinite = {"entropy": edges, "kl": -edges}.get(name)
        _check(name, gradient, reference(name), dtype, infinite)


@pytest.mark.user_config_only
@pytest.mark.parametrize("framework, dtype", framework_dtype_params())
def test_count_constrained_bernoulli_one_sided_derivatives(framework, dtype):
    """CountConstrainedBernoulli(low=2, high=4): log_prob of a value, log_range_prob, the
    marginals, variance and expected L2 loss, count_distribution, entropy, KL in p and in q
    (q with the same 0s and 1s). The 0s can move into count 5 (outside p's feasible
    counts, inside the range), the 1 into count 1 (outside the range)."""
    lib = pc if framework == "torch" else nc
    light = _light(framework, dtype)
    low, high = 2, 4
    p, q = _rounded(PROBS, dtype), _rounded(np.where(PROBS % 1 == 0, PROBS, Q_PROBS), dtype)
    q_free = _rounded(Q_PROBS, dtype)
    n = len(p)
    value = np.array([0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    losses = pc.losses if framework == "torch" else nc.losses
    powers = np.arange(n + 1.0) ** 1.5

    def build(x):
        return lib.CountConstrainedBernoulli(probs=x, low=low, high=high)

    def outputs(d, dq, module):
        kl = _kl_fn(module)
        like = d.probs
        weights = _array(module, WEIGHTS, like)
        free_q = lib.CountConstrainedBernoulli(
            probs=_array(module, q_free, like), low=low, high=high
        )
        values = {
            "log_prob": d.log_prob(_array(module, value, like)),
            "mean": (d.mean * weights).sum(),
            "entropy": d.entropy(),
            "kl_q": kl(build(_array(module, p, like)), dq),
        }
        if not light:
            values["log_range_prob"] = d.log_range_prob()
            values["variance"] = (d.variance * weights).sum()
            values["l2"] = losses.expected_l2_loss(d, weights)
            table = d.count_distribution * _array(module, powers, like)
            values["count_distribution"] = table.sum()
            values["kl"] = kl(d, free_q)
        return values

    got = _library_gradients(framework, dtype, build, outputs, p, q)
    vectors = vectors_oracle.all_vectors(n)
    inside = (vectors.sum(-1) >= low) & (vectors.sum(-1) <= high)
    vectors = vectors[inside]
    totals = vectors.sum(-1).astype(int)

    def law(x):
        masses = vectors_oracle.masses(x, vectors)
        return masses / masses.sum(), masses.sum()

    def quantity(name, x):
        masses, total = law(x)
        mu = masses @ vectors
        if name == "log_prob":
            return np.log(masses[(vectors == value).all(-1)][0])
        if name == "log_range_prob":
            return np.log(total)
        if name == "mean":
            return mu @ WEIGHTS
        if name == "variance":
            return (mu * (1 - mu)) @ WEIGHTS
        if name == "l2":
            return masses @ ((vectors - WEIGHTS) ** 2).sum(-1)
        if name == "count_distribution":
            return np.bincount(totals, masses, n + 1) @ powers
        if name == "entropy":
            return vectors_oracle.entropy(masses)
        if name == "kl":
            return vectors_oracle.kl(masses, law(q_free)[0])
        raise AssertionError(name)

    edges = np.where(p == 0, 1.0, np.where(p == 1, -1.0, 0.0))
    for name, gradient in got.items():
        if name == "kl_q":
            expected = vectors_oracle.one_sided_derivatives(
                lambda y: vectors_oracle.kl(law(p)[0], law(y)[0]), q
            )
        else:
            expected = vectors_oracle.one_sided_derivatives(
                lambda x, name=name: quantity(name, x), p
            )
        infinite = {"entropy": edges, "kl": -edges}.get(name)
        _check(name, gradient, expected, dtype, infinite)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_exactly_k_kl_counts_the_variables_p_forces_and_q_leaves_free(framework):
    """NumPyro's KL value dropped q's cross-entropy terms of the variables that p forces on
    or off (infinite logits) and q leaves free: with every free variable of p on (k = 4
    here) it was 0.2 below the enumerated KL. Against enumeration of the 4-hot vectors."""
    p_logits = np.array([-np.inf, np.inf, -0.8, 0.4, -1.4, -np.inf])
    q_logits = np.array([-0.4, 2.2, 0.0, -2.2, 0.8, -0.8])
    vectors = vectors_oracle.all_vectors(6)
    for k in (2, 4):
        support = vectors[vectors.sum(-1) == k]
        p_weights = vectors_oracle.masses(1 / (1 + np.exp(-p_logits)), support)
        q_weights = vectors_oracle.masses(1 / (1 + np.exp(-q_logits)), support)
        expected = vectors_oracle.kl(p_weights / p_weights.sum(), q_weights / q_weights.sum())
        if framework == "torch":
            kl = torch.distributions.kl_divergence(
                pc.ExactlyKBernoulli(logits=torch.tensor(p_logits), k=k),
                pc.ExactlyKBernoulli(logits=torch.tensor(q_logits), k=k),
            )
        else:
            from numpyro.distributions.kl import kl_divergence

            kl = kl_divergence(
                nc.ExactlyKBernoulli(logits=jnp.asarray(p_logits), k=k),
                nc.ExactlyKBernoulli(logits=jnp.asarray(q_logits), k=k),
            )
        assert abs(float(kl) - expected) <= 1e-12 * max(1.0, expected), (k, float(kl), expected)


@pytest.mark.parametrize("framework", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_exactly_k_hessians_of_mean_and_variance_at_probs_of_exactly_zero_and_one(framework):
    """Issue 29: the marginals' odds terms were first order only, so the Hessians in
    ``probs`` of ``mean`` and ``variance`` were wrong in every entry that involves an exact
    0 or 1 (off by up to 1.9 here). Two 0s and two 1s with two free ones to place, so that
    every second-order coefficient is nonzero; against the enumerated marginals (rational
    functions of the probs) in float64."""
    probs = np.array([0.0, 0.0, 1.0, 1.0, 0.3, 0.6, 0.2, 0.5])
    weights = np.array([0.5, -1.0, 2.0, 0.3, -0.7, 0.4, 1.1, -0.2])
    k = 4
    rows = np.array(
        [np.isin(np.arange(8), ones) for ones in itertools.combinations(range(8), k)], float
    )

    def enumerated(p):
        masses = vectors_oracle.masses(p, rows)
        mu = (masses / masses.sum()) @ rows
        return np.array([mu @ weights, (mu * (1 - mu)) @ weights])

    expected = exactly_k_oracle.hessian_by_differences(enumerated, probs)
    if framework == "torch":

        def scalar(p, index):
            d = pc.ExactlyKBernoulli(probs=p, k=k)
            return ((d.mean if index == 0 else d.variance) * torch.tensor(weights)).sum()

        actual = np.stack(
            [
                torch.autograd.functional.hessian(
                    lambda p, i=i: scalar(p, i), torch.tensor(probs)
                ).numpy()
                for i in range(2)
            ]
        )
    else:

        def both(p):
            d = nc.ExactlyKBernoulli(probs=p, k=k)
            w = jnp.asarray(weights)
            return jnp.stack([(d.mean * w).sum(), (d.variance * w).sum()])

        actual = np.asarray(jax.hessian(both)(jnp.asarray(probs)))
    np.testing.assert_allclose(actual, expected, atol=1e-6 * max(1.0, np.abs(expected).max()))
