"""The small-n path of the ExactlyKBernoulli kernels (``exactly_k_small``, both packages).

References: enumeration of every k-subset (``tests/oracles/exactly_k.py``), central finite
differences of the enumerated marginals for the derivatives, a chi-square test for the
sampler, the general kernels (the small path switched off) at the dispatch boundary, and
torch against JAX.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from numpyro_constrained import ExactlyKBernoulli as JaxExactlyKBernoulli
from numpyro_constrained import exactly_k_kernels as jax_kernels
from numpyro_constrained import exactly_k_small as jax_small
from pyro_constrained import ExactlyKBernoulli as TorchExactlyKBernoulli
from pyro_constrained import exactly_k_kernels as torch_kernels
from pyro_constrained import exactly_k_small as torch_small
from tests.oracles import exactly_k as oracle

INF = math.inf
TOLERANCE = {"float32": 2e-5, "float64": 1e-10}
# Rows of logits with what the general kernels needed care for: masked (-inf, -1e9, -1e4),
# forced (+inf, +1e9), wide gaps, clusters and ties.
ROWS = [
    [0.3, -1.2, 2.0, 0.0, -0.7, 1.1],
    [-INF, 0.5, 1e9, -1e4, 2.0, -INF],
    [1e4, 1e4 + 0.3, -1e9, 5.0, 5.0, 5.0],
    [200.0, -200.0, 0.0, INF, 1.0, -3.0],
    [1e3 + 25.0, 1e3, 1e3 - 1.7, -1e3, 0.2, -0.2],
    [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
]


def _numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


def _feasible_ks(row: np.ndarray) -> list[int]:
    on, off = int(np.sum(row == INF)), int(np.sum(row == -INF))
    return list(range(on, len(row) - off + 1))


def _distribution(framework, dtype, logits, k):
    if framework == "torch":
        return TorchExactlyKBernoulli(logits=torch.tensor(logits, dtype=getattr(torch, dtype)), k=k)
    return JaxExactlyKBernoulli(logits=jnp.asarray(logits, dtype=dtype), k=k)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_small_path_is_taken_for_small_sites_only(framework):
    small = torch_small if framework == "torch" else jax_small
    array = torch.zeros if framework == "torch" else jnp.zeros
    assert small.applies(array((16, 50)), 5) and small.applies(array((1, 200)), 100)
    assert not small.applies(array((4, 1000)), 10)  # n above SMALL_N
    assert not small.applies(array((4096, 200)), 100)  # too many table entries
    assert not small.applies(array((1, 10)), 0)  # k_max = 0: the callers' own case
    entries = small.SMALL_ENTRIES  # batch * n * (k_max + 1), each side of the bound
    assert small.applies(array((entries // 200, 50)), 3)
    assert not small.applies(array((entries // 200 + 1, 50)), 3)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_against_enumeration(framework, dtype):
    """log_prob, log normaliser (through the constraint probability), marginals, their
    complements and the entropy, every feasible k of every row (so k = 0 and k = n among
    them), the kernels reached through the distribution with the small path on."""
    tolerance = TOLERANCE[dtype]
    for row in ROWS:
        logits = np.array(row).astype(dtype).astype(np.float64)
        for k in _feasible_ks(logits):
            d = _distribution(framework, dtype, logits, k)
            subsets, log_probs, _, mu, entropy = oracle.exact_enumeration(logits, k)
            assert np.abs(_numpy(d.mean) - mu).max() <= tolerance, (row, k)
            assert np.abs(_numpy(d.variance) - mu * (1 - mu)).max() <= tolerance, (row, k)
            assert abs(float(_numpy(d.entropy())) - entropy) <= tolerance, (row, k)
            values = subsets[:3].astype(dtype)
            if framework == "torch":
                got = _numpy(d.log_prob(torch.tensor(values)))
            else:
                got = _numpy(d.log_prob(jnp.asarray(values)))
            expected = log_probs[:3]
            assert np.all(np.abs(got - expected) <= tolerance * np.maximum(1, np.abs(expected)))


def _flat_small(framework, dtype, logits, k, k_max):
    """(marginals, complements, log e_k) from the small module's own functions (JAX's log
    e_k from the general kernels: its small path has none, see ``normalizer_parts``)."""
    if framework == "torch":
        x, ks = torch.tensor(logits, dtype=getattr(torch, dtype)), torch.tensor(k)
        mu, complement = torch_small.marginals_and_complements(x, ks, k_max)
        parts = torch_kernels.NormalizerParts(*torch_small.normalizer_parts(x, ks, k_max))
        log_z = torch_kernels.log_normalizer_value(x, ks, parts)
    else:
        x, ks = jnp.asarray(logits, dtype=dtype), jnp.asarray(k)
        mu, complement = jax_small.marginals_and_complements(x, ks, k_max)
        parts = jax_kernels.normalizer_parts(x, ks, k_max)
        log_z = jax_kernels.log_normalizer_value(x, ks, parts)
    return _numpy(mu), _numpy(complement), _numpy(log_z)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_kernels_with_a_k_per_batch_element_and_masked_logits(framework, dtype):
    """The small module directly, a batch with k from 0 to the number of finite logits and
    k_max above every k (tables wider than some rows need), against enumeration; a marginal
    as small as exp(-200) keeps its relative precision."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 7)) * 3
    logits[1, 2] = logits[4, 0] = -INF
    # A marginal about exp(-200) (exp(-60) in float32): relative precision.
    logits[2, 3] = -200.0 if dtype == "float64" else -60.0
    logits[3] = [1e9, 1e9, -1e9, 0.5, 0.1, -1e4, 2.0]
    logits = logits.astype(dtype).astype(np.float64)
    ks = np.array([0, 6, 3, 2, 6, 7])
    mu, complement, log_z = _flat_small(framework, dtype, logits, ks, 7)
    for row, k in enumerate(ks):
        _, _, exact, expected, _ = oracle.exact_enumeration(logits[row], k)
        assert np.abs(mu[row] - expected).max() <= TOLERANCE[dtype], row
        assert np.abs(complement[row] - (1 - expected)).max() <= TOLERANCE[dtype], row
        assert abs(log_z[row] - exact) <= TOLERANCE[dtype] * max(1.0, abs(exact)), row
    tiny = oracle.exactly_k_log_marginals(logits[2], 3, [3])[0]
    assert abs(math.log(mu[2, 3]) - tiny) <= (1e-9 if dtype == "float64" else 1e-4)


def _enumerated_marginals(logits, k):
    return oracle.exact_enumeration(logits, k)[3]


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_derivatives_against_finite_differences(framework):
    """The marginals' vector-Jacobian product (the tangent pass: what rsample's gradient
    uses), the log normaliser's gradient (the marginals) and second derivatives
    (differentiating the vector-Jacobian product again), float64."""
    logits = np.array([0.3, -1.2, 2.0, -INF, -0.7, 1.1, 0.0])
    k, weights, step = 3, np.array([0.5, -1.0, 2.0, 0.7, 0.3, -0.4, 1.5]), 1e-5
    finite = np.isfinite(logits)

    def weighted(theta):
        return float(_enumerated_marginals(theta, k) @ weights)

    expected = np.zeros(len(logits))
    for i in np.flatnonzero(finite):
        up, down = logits.copy(), logits.copy()
        up[i] += step
        down[i] -= step
        expected[i] = (weighted(up) - weighted(down)) / (2 * step)
    if framework == "torch":
        theta = torch.tensor(logits, requires_grad=True)
        mu = torch_small.marginals(theta[None], torch.tensor([k]), k)[0]
        (got,) = torch.autograd.grad(mu @ torch.tensor(weights), theta, create_graph=True)
        (again,) = torch.autograd.grad(got[0], theta)
        log_norm_grad = torch.autograd.grad(
            TorchExactlyKBernoulli(logits=theta, k=k).log_prob(
                torch.tensor([1.0, 0, 1, 0, 0, 1, 0])
            ),
            theta,
        )[0]
    else:

        def f(t):
            return jax_small.marginals(t[None], jnp.array([k]), k)[0] @ jnp.asarray(weights)

        got = jax.grad(f)(jnp.asarray(logits))
        again = jax.grad(lambda t: jax.grad(f)(t)[0])(jnp.asarray(logits))
        log_norm_grad = jax.grad(
            lambda t: JaxExactlyKBernoulli(logits=t, k=k).log_prob(
                jnp.array([1.0, 0, 1, 0, 0, 1, 0])
            )
        )(jnp.asarray(logits))
    got, again, log_norm_grad = _numpy(got), _numpy(again), _numpy(log_norm_grad)
    assert np.abs(got - expected).max() <= 1e-8
    assert got[3] == 0.0 and np.all(np.isfinite(again)) and again[3] == 0.0
    # d/d theta_j of (d/d theta_0 of sum_i w_i mu_i), by differences of the same.
    second = np.zeros(len(logits))
    for j in np.flatnonzero(finite):
        values = []
        for sign in (1, -1):
            shifted = logits.copy()
            shifted[j] += sign * 1e-4
            up, down = shifted.copy(), shifted.copy()
            up[0] += 1e-4
            down[0] -= 1e-4
            values.append((weighted(up) - weighted(down)) / 2e-4)
        second[j] = (values[0] - values[1]) / 2e-4
    assert np.abs(again - second).max() <= 1e-5
    value = np.array([1.0, 0, 1, 0, 0, 1, 0])
    assert np.abs(log_norm_grad - (value - _enumerated_marginals(logits, k))).max() <= 1e-12


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_samples_chi_square(framework):
    """Draws of two rows at once (different k, a masked and a forced logit) against the
    enumerated pmf."""
    logits = np.array([[0.3, -1.2, 2.0, 0.0, -0.7, 1.1], [1.0, -INF, 0.5, 2.5, -0.3, 0.0]])
    ks, num = np.array([2, 3]), 20000
    if framework == "torch":
        torch.manual_seed(0)
        draws = torch_small.sample(torch.tensor(logits), torch.tensor(ks), 3, (num,))
    else:
        draws = jax_small.sample(
            jax.random.PRNGKey(0), jnp.asarray(logits), jnp.asarray(ks), 3, (num,)
        )
    draws = _numpy(draws)
    for row in range(2):
        assert oracle.chi_square_pvalue(draws[:, row], logits[row], ks[row]) > 1e-4


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_agrees_with_the_general_kernels_at_the_boundary(framework, monkeypatch):
    """At n = SMALL_N (the largest n on the small path), with ordinary, clustered and masked
    logits and k from 1 to k_max = 100, one site at a time: marginals and log normaliser as
    the general kernels give them (the small path switched off), float64."""
    rng = np.random.default_rng(11)
    n, k_max = torch_small.SMALL_N, 100
    logits = rng.normal(size=(3, n)) * 2
    logits[1, ::3] = -INF
    logits[2, :40] = 1e4 + rng.normal(size=40)
    ks = np.array([1, k_max, 40])
    small = torch_small if framework == "torch" else jax_small
    kernels = torch_kernels if framework == "torch" else jax_kernels

    def both():
        mus, log_zs = [], []
        for row, k in zip(logits, ks, strict=True):
            if framework == "torch":
                x, k = torch.tensor(row[None]), torch.tensor([k])
            else:
                x, k = jnp.asarray(row[None]), jnp.asarray([k])
            parts = kernels.normalizer_parts(x, k, k_max)
            mus.append(_numpy(kernels.marginals(x, k, k_max)))
            log_zs.append(_numpy(kernels.log_normalizer_value(x, k, parts)))
        return np.concatenate(mus), np.concatenate(log_zs)

    assert small.applies(torch.zeros(1, n) if framework == "torch" else jnp.zeros((1, n)), k_max)
    mu_small, log_z_small = both()
    monkeypatch.setattr(small, "applies", lambda logits, k_max: False)
    mu_general, log_z_general = both()
    assert np.abs(mu_small - mu_general).max() <= 1e-12
    assert np.all(np.abs(log_z_small - log_z_general) <= 1e-12 * np.abs(log_z_general))


def test_torch_and_jax_agree_in_float32():
    """A batch of 16 sites of n = 50 with per-site k, float32 (the benchmark's case)."""
    rng = np.random.default_rng(5)
    logits = (2 * rng.normal(size=(16, 50))).astype(np.float32)
    ks = rng.integers(0, 26, size=16)
    mu_t = torch_small.marginals(torch.tensor(logits), torch.tensor(ks), 25)
    mu_j = jax_small.marginals(jnp.asarray(logits), jnp.asarray(ks), 25)
    assert np.abs(_numpy(mu_t) - _numpy(mu_j)).max() <= 2e-6
    g = rng.normal(size=(16, 50)).astype(np.float32)
    theta = torch.tensor(logits, requires_grad=True)
    (grad_t,) = torch.autograd.grad(
        (torch_small.marginals(theta, torch.tensor(ks), 25) * torch.tensor(g)).sum(), theta
    )
    grad_j = jax.grad(
        lambda t: (jax_small.marginals(t, jnp.asarray(ks), 25) * jnp.asarray(g)).sum()
    )(jnp.asarray(logits))
    assert np.abs(_numpy(grad_t) - _numpy(grad_j)).max() <= 1e-5


def test_jax_with_x64_off():
    """NumPyro's default configuration: no float64 anywhere. log_prob, marginals and
    entropy of masked and clustered float32 sites against enumeration, and the normaliser's
    parts stay float32."""
    logits = np.array(ROWS[1:3]).astype(np.float32).astype(np.float64)
    with jax.enable_x64(False):
        for k in (1, 2):
            d = JaxExactlyKBernoulli(logits=jnp.asarray(logits, jnp.float32), k=k)
            parts = jax_kernels.normalizer_parts(
                jnp.asarray(logits, jnp.float32), jnp.array([k, k]), k
            )
            # The kept tables (parts.marginals) included: every floating array is float32.
            leaves = jax.tree_util.tree_leaves(parts)
            floats = [leaf for leaf in leaves if jnp.issubdtype(leaf.dtype, jnp.floating)]
            assert len(floats) > 4 and all(leaf.dtype == jnp.float32 for leaf in floats)
            mean, entropy = _numpy(d.mean), _numpy(d.entropy())
            for row in range(2):
                subsets, log_probs, _, mu, exact_entropy = oracle.exact_enumeration(logits[row], k)
                assert np.abs(mean[row] - mu).max() <= TOLERANCE["float32"]
                assert abs(entropy[row] - exact_entropy) <= TOLERANCE["float32"]
                value = np.broadcast_to(subsets[0], logits.shape).astype(np.float32)
                got = _numpy(d.log_prob(jnp.asarray(value)))[row]
                assert abs(got - log_probs[0]) <= TOLERANCE["float32"] * max(1, abs(log_probs[0]))


@pytest.mark.parametrize("path", ["small", "general"])
def test_log_prob_backward_reuses_the_forward_upward_pass(path, monkeypatch):
    """torch: ``log_prob(value).backward()`` does one upward pass (the backward pass takes
    the marginals from the forward pass's tables by a downward pass), on the small path and
    on the general kernels, and the gradient is ``value - marginals`` (enumeration)."""
    logits = np.array([[0.3, -1.2, 2.0, -INF, -0.7, 1.1, 0.0], [1e4, 0.5, -1e4, 2.0, 1.0, 0, 3]])
    k, value = 3, np.array([[1.0, 0, 1, 0, 0, 1, 0], [1, 0, 0, 1, 0, 0, 1]])
    counted = {"small": (torch_small, "_upward"), "general": (torch_kernels, "_prepare")}
    module, name = counted[path]
    original, calls = getattr(module, name), []
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or original(*a, **kw))
    if path == "general":
        monkeypatch.setattr(torch_small, "applies", lambda logits, k_max: False)
    theta = torch.tensor(logits, requires_grad=True)
    TorchExactlyKBernoulli(logits=theta, k=k).log_prob(torch.tensor(value)).sum().backward()
    assert len(calls) == 1
    for row in range(2):
        expected = value[row] - _enumerated_marginals(logits[row], k)
        assert np.abs(_numpy(theta.grad[row]) - expected).max() <= 1e-12
