"""The exactly-k kernels of both packages against independent references.

Enumeration of all k-subsets (n <= 10), SciPy's Poisson-binomial pmf for larger n, finite
differences for first and second derivatives, chi-square goodness of fit for the sampler,
float32 against float64, torch against JAX on identical inputs. Every JAX function is called
with few distinct shapes: each new shape costs a compilation.
"""

import functools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import special, stats

from numpyro_constrained import exactly_k_draw as jax_draw
from numpyro_constrained import exactly_k_kernels as jax_kernels
from numpyro_constrained import exactly_k_tree as jax_tree
from pyro_constrained import exactly_k_kernels as torch_kernels
from pyro_constrained import exactly_k_tree as torch_tree
from tests.jaxprs import count_primitive
from tests.oracles import exactly_k as oracle


def _enumeration_cases():
    """(logits (rows, 10) float64, k (rows,)): n in {1, 2, 5, 10} with every feasible k, the
    smaller n padded with -inf logits (forced off, which leaves the distribution unchanged) so
    that JAX compiles one shape; the n >= 5 rows also have one -inf among their own logits."""
    rng = np.random.default_rng(0)
    rows, ks = [], []
    for n in (1, 2, 5, 10):
        for k in range(n + 1 if n < 5 else n):
            logits = np.r_[rng.normal(0.0, 3.0, size=n), np.full(10 - n, -np.inf)]
            if n >= 5:
                logits[1] = -np.inf
            rows.append(logits)
            ks.append(k)
    return np.array(rows), np.array(ks)


@partial(jax.jit, static_argnums=2)
def _jax_both(logits, ks, k_max):
    # One compilation for both (XLA shares their upward pass): compiling dominates test time.
    return (
        jax_kernels.log_normalizer(logits, ks, k_max),
        jax_kernels.marginals(logits, ks, k_max),
    )


def _run(framework, logits, ks, k_max):
    """(log_normalizer, marginals) as NumPy arrays."""
    if framework == "torch":
        args = (torch.tensor(logits), torch.tensor(ks), k_max)
        return torch_kernels.log_normalizer(*args).numpy(), torch_kernels.marginals(*args).numpy()
    log_norm, mu = _jax_both(jnp.asarray(logits), jnp.asarray(ks), k_max)
    return np.asarray(log_norm), np.asarray(mu)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_log_normalizer_and_marginals_match_enumeration(framework):
    logits, ks = _enumeration_cases()
    log_norm, mu = _run(framework, logits, ks, 10)
    for row, k in enumerate(ks):
        expected = oracle.exactly_k_log_normalizer(logits[row], k)
        assert abs(log_norm[row] - expected) < 1e-10
        assert np.abs(mu[row] - oracle.exactly_k_marginals(logits[row], k)).max() < 1e-10


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_large_n_matches_scipy_poisson_binomial(framework):
    """log e_k = log P(sum = k) + sum softplus, and mu_i = p_i P_{-i}(k - 1) / P(k)."""
    rng = np.random.default_rng(1)
    n = 150
    logits = rng.normal(-1.0, 2.0, size=(4, n))
    probs = special.expit(logits)
    ks = np.array([1, 20, 40, 149])
    log_norm, mu = _run(framework, logits, ks, n)
    for row, k in enumerate(ks):
        log_pk = stats.poisson_binom(probs[row]).logpmf(k)
        expected = log_pk + np.logaddexp(0.0, logits[row]).sum()
        assert abs(log_norm[row] - expected) < 1e-9 * max(1.0, abs(expected))
        for i in (0, 7, 99):
            rest = stats.poisson_binom(np.delete(probs[row], i)).pmf(k - 1)
            assert abs(mu[row, i] - probs[row, i] * rest / np.exp(log_pk)) < 1e-9


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_tiny_marginals_keep_their_relative_precision_in_wide_float64_tables(framework):
    """Logits ~ N(-1, 20^2) give marginals down to 1e-60 (below 1e-20 in every row); with
    k_max = n = 200 the tree's upper nodes are wide (torch computes their outside tables by
    FFT, whose rounding error is relative to each table's largest entry). Every marginal, the
    smallest included, must still match the log-space recursion to 1e-12 relative."""
    rng = np.random.default_rng(7)
    n = 200
    logits = rng.normal(-1.0, 20.0, size=(3, n))
    ks = np.array([1, 40, 120])
    _, mu = _run(framework, logits, ks, n)
    for row, k in enumerate(ks):
        indices = np.r_[np.argsort(mu[row])[:5], 0, 1, 2]
        expected = oracle.exactly_k_log_marginals(logits[row], k, indices)
        assert mu[row, indices].min() < 1e-20  # the case this test is about
        np.testing.assert_allclose(np.log(mu[row, indices]), expected, rtol=0, atol=1e-12)


@functools.cache
def _wide_problem():
    """Logits ~ N(-1, 6^2) for n = 300 and n = 1000 with k across 0..n, in one (rows, 1000)
    array: the n = 300 rows are padded with -inf logits (variables forced off), which leaves
    their distribution unchanged and saves a JAX compilation per shape."""
    rng = np.random.default_rng(300)
    rows, ks = [], []
    for n in (300, 1000):
        for k in np.unique(
            np.r_[0, 1, 2, 3, rng.integers(0, n + 1, size=4), n // 2, n - 2, n - 1, n]
        ):
            rows.append(np.r_[rng.normal(-1.0, 6.0, size=n), np.full(1000 - n, -np.inf)])
            ks.append(k)
    return np.array(rows), np.array(ks)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_float32_marginals_are_within_1e_5_of_float64_for_n_300_and_1000(framework):
    logits, ks = _wide_problem()
    log_norm64, mu64 = _run(framework, logits, ks, 1000)
    log_norm32, mu32 = _run(framework, logits.astype(np.float32), ks, 1000)
    assert mu32.dtype == np.float32 and np.isfinite(mu32).all()
    assert np.abs(mu32 - mu64).max() < 1e-5
    assert np.abs(mu64.sum(-1) - ks).max() < 1e-9
    assert not mu64[:, 300:][np.isinf(logits[:, 300:])].any()
    assert np.all(np.abs(log_norm32 - log_norm64) < 1e-5 * np.maximum(1.0, np.abs(log_norm64)))


def test_torch_second_derivatives_match_finite_differences():
    rng = np.random.default_rng(2)
    logits = torch.tensor(rng.normal(0.0, 2.0, size=(3, 7)), requires_grad=True)
    with torch.no_grad():
        logits[0, 2] = -torch.inf  # derivatives must stay finite (and zero) there
    ks = torch.tensor([2, 3, 6])
    assert torch.autograd.gradcheck(lambda x: torch_kernels.log_normalizer(x, ks, 6), (logits,))
    assert torch.autograd.gradgradcheck(lambda x: torch_kernels.log_normalizer(x, ks, 6), (logits,))
    assert torch.autograd.gradcheck(lambda x: torch_kernels.marginals(x, ks, 6), (logits,))
    # The straight-through path of rsample: the gradient through sample_and_marginals' mu.
    _, mu = torch_kernels.sample_and_marginals(logits, ks, 6, (2,))
    (grad,) = torch.autograd.grad((mu * mu).sum(), logits)
    assert torch.isfinite(grad).all() and grad[0, 2] == 0


def test_jax_second_derivatives_match_finite_differences():
    """Reverse over reverse through log_normalizer (its custom JVP, then the marginals'
    own derivative), against central differences of the marginals."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(0.0, 2.0, size=(3, 7))).at[0, 2].set(-jnp.inf)
    ks = jnp.asarray([2, 3, 6])
    weights, u, v = (jnp.asarray(rng.normal(size=shape)) for shape in [(3,), (3, 7), (3, 7)])
    v = v.at[0, 2].set(0.0)

    def gradient(x):
        return jax.grad(lambda y: (jax_kernels.log_normalizer(y, ks, 6) * weights).sum())(x)

    hvp = jax.jit(jax.grad(lambda x: (gradient(x) * u).sum()))(logits)
    assert np.isfinite(np.asarray(hvp)).all() and hvp[0, 2] == 0

    def projected_marginals(x):
        return float((jax_kernels.marginals(x, ks, 6) * weights[:, None] * u).sum())

    step = 1e-5
    finite_difference = (
        projected_marginals(logits + step * v) - projected_marginals(logits - step * v)
    ) / (2 * step)
    assert abs(float((hvp * v).sum()) - finite_difference) < 1e-7
    # And the first derivative is the marginals.
    expected = jax_kernels.marginals(logits, ks, 6) * weights[:, None]
    assert np.abs(np.asarray(gradient(logits) - expected)).max() < 1e-14


@pytest.mark.parametrize("k_max", [4, 64])
def test_jax_log_normalizer_gradient_reuses_the_upward_pass_of_its_value(k_max):
    """log_prob plus gradient is one tilt and one upward pass, then one downward pass (issue
    30): the gradient takes the marginals from the tables of the value's upward pass, where
    no level is wide enough for the FFT. The tilt's Newton iterations are ``while`` loops
    and the upward and downward passes rescale every level through ``bitcast_convert_type``;
    the gradient's program repeated the tilt and the upward pass before."""
    logits = jnp.asarray(np.random.default_rng(5).normal(size=(2, 100)))
    ks = jnp.asarray([3, k_max])

    def value(x):
        return jax_kernels.log_normalizer(x, ks, k_max).sum()

    forward = jax.make_jaxpr(value)(logits).jaxpr
    with_gradient = jax.make_jaxpr(jax.value_and_grad(value))(logits).jaxpr
    marginals = jax.make_jaxpr(lambda x: jax_kernels._marginals(x, ks, k_max))(logits).jaxpr
    assert count_primitive(with_gradient, "while") == count_primitive(forward, "while") > 0
    upward = count_primitive(forward, "bitcast_convert_type")
    both_passes = count_primitive(marginals, "bitcast_convert_type")
    assert both_passes > upward > 0
    assert count_primitive(with_gradient, "bitcast_convert_type") == both_passes
    # The gradient is still the marginals.
    gradient = jax.grad(value)(logits)
    np.testing.assert_allclose(gradient, jax_kernels._marginals(logits, ks, k_max), rtol=1e-12)


def _draw(framework, logits, ks, num_samples, dtype=np.float64):
    n = logits.shape[-1]
    if framework == "torch":
        torch.manual_seed(0)
        args = (torch.tensor(logits.astype(dtype)), torch.tensor(ks), n, (num_samples,))
        return torch_kernels.sample(*args).numpy()
    args = (jnp.asarray(logits.astype(dtype)), jnp.asarray(ks), n, (num_samples,))
    return np.asarray(jax_kernels.sample(jax.random.PRNGKey(0), *args))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_samples_follow_the_enumerated_pmf_with_per_batch_k(framework):
    rng = np.random.default_rng(3)
    n = 6
    logits = rng.normal(0.0, 1.5, size=(4, n))
    logits[3, 0] = -np.inf
    ks = np.array([1, 3, 5, 2])
    samples = _draw(framework, logits, ks, 6000)
    assert samples.shape == (6000, 4, n)
    for row, k in enumerate(ks):
        assert oracle.chi_square_pvalue(samples[:, row], logits[row], k) > 1e-3


@pytest.mark.parametrize(
    "framework, dtype",  # JAX float64 sampling is covered by the chi-square test
    [("torch", np.float32), ("torch", np.float64), ("jax", np.float32)],
)
def test_samples_are_exact_k_hot_at_the_edges(framework, dtype):
    rng = np.random.default_rng(4)
    n = 37  # odd sizes exercise the padding of the tree
    logits = rng.normal(-1.0, 6.0, size=(5, n))
    logits[:, :3] = -np.inf
    ks = np.array([0, 1, 17, 33, 34])  # 34 = number of finite logits
    samples = _draw(framework, logits, ks, 50, dtype)
    assert samples.dtype == dtype
    assert set(np.unique(samples)) <= {0.0, 1.0}
    assert np.array_equal(samples.sum(-1), np.broadcast_to(ks, (50, 5)).astype(dtype))
    assert not samples[..., :3].any()
    assert samples[:, 4, 3:].all()


@pytest.mark.parametrize(
    "framework, dtype", [("torch", np.float32), ("torch", np.float64), ("jax", np.float64)]
)
def test_sampled_pair_frequencies_match_scipy_at_n_64(framework, dtype):
    """n = 64, k = 24: too many subsets to enumerate, and wide enough that the tree's upper
    levels hold tables of 25 counts (torch stores them node-major, the lower ones width-major).
    P(z_i = 1) and P(z_i = z_j = 1) from SciPy's Poisson-binomial pmf,
    p_i p_j P_{-ij}(sum = k - 2) / P(sum = k), against the frequencies in 20000 draws; the
    tolerance is 5 binomial standard errors."""
    rng = np.random.default_rng(11)
    n, k, num_samples = 64, 24, 20000
    logits = rng.normal(0.0, 1.5, size=(1, n))
    probs = special.expit(logits[0])
    samples = _draw(framework, logits, np.array([k]), num_samples, dtype)[:, 0]
    assert np.array_equal(samples.sum(-1), np.full(num_samples, k))
    p_k = stats.poisson_binom(probs).pmf(k)
    pairs = [(i, i) for i in range(n)] + [(0, 1), (5, 40), (62, 63), (17, 33)]
    for i, j in pairs:
        rest = stats.poisson_binom(np.delete(probs, sorted({i, j}))).pmf(k - len({i, j}))
        expected = np.prod(probs[list({i, j})]) * rest / p_k
        observed = np.mean(samples[:, i] * samples[:, j])
        standard_error = np.sqrt(expected * (1.0 - expected) / num_samples)
        assert abs(observed - expected) < 5.0 * standard_error, (i, j, observed, expected)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_sample_and_marginals_share_tables_and_agree(framework):
    rng = np.random.default_rng(5)
    logits = rng.normal(0.0, 2.0, size=(2, 9))
    ks = np.array([4, 7])
    if framework == "torch":
        z, mu = torch_kernels.sample_and_marginals(torch.tensor(logits), torch.tensor(ks), 9, (3,))
        z, mu = z.numpy(), mu.numpy()
    else:
        key = jax.random.PRNGKey(1)
        z, mu = jax_kernels.sample_and_marginals(key, jnp.asarray(logits), jnp.asarray(ks), 9, (3,))
        z, mu = np.asarray(z), np.asarray(mu)
    assert z.shape == (3, 2, 9) and np.array_equal(z.sum(-1), np.broadcast_to(ks, (3, 2)))
    for row, k in enumerate(ks):
        assert np.abs(mu[row] - oracle.exactly_k_marginals(logits[row], k)).max() < 1e-10


def test_torch_and_jax_agree_on_identical_inputs():
    logits, ks = _wide_problem()  # the shapes JAX compiled for the float32 test
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        x = logits.astype(dtype)
        for via_torch, via_jax in zip(
            _run("torch", x, ks, 1000), _run("jax", x, ks, 1000), strict=True
        ):
            assert via_torch.dtype == via_jax.dtype == dtype
            assert np.all(np.abs(via_torch - via_jax) <= tol * np.maximum(1.0, np.abs(via_torch)))


def test_jax_kernels_work_under_jit_with_traced_k():
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.normal(size=(2, 9)))

    @jax.jit
    def marginals_and_draw(ks, key):
        mu = jax_kernels.marginals(logits, ks, 9)  # k traced: k_max = n
        return mu, jax_kernels.sample(key, logits, ks, 9)

    ks = np.array([0, 9])
    mu, z = marginals_and_draw(jnp.asarray(ks), jax.random.PRNGKey(2))
    assert np.array_equal(np.asarray(mu), np.array([[0.0] * 9, [1.0] * 9]))
    assert np.array_equal(np.asarray(z), np.asarray(mu))


def test_torch_kernels_never_produce_denormals():
    """Flushing denormals to zero changes nothing: no table entry is ever denormal (such
    arithmetic is many times slower on CPUs)."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    rng = np.random.default_rng(8)
    logits = torch.tensor(rng.normal(-1.0, 30.0, size=(4, 200)), dtype=torch.float32)
    ks = torch.tensor([0, 3, 100, 190])
    try:
        plain = (
            torch_kernels.marginals(logits, ks, 200),
            torch_kernels.log_normalizer(logits, ks, 200),
        )
        torch.set_flush_denormal(True)
        flushed = (
            torch_kernels.marginals(logits, ks, 200),
            torch_kernels.log_normalizer(logits, ks, 200),
        )
    finally:
        torch.set_flush_denormal(False)
    # Only the leaves' final products exp(x_i) * outside may be denormal (marginals below
    # 1e-38): compare the rest exactly.
    normal = plain[0].abs() >= torch.finfo(torch.float32).tiny
    assert torch.equal(plain[0][normal], flushed[0][normal])
    assert torch.equal(plain[1], flushed[1])


# ----------------------------------------------------------------------------------------
# The FFT path (levels at least _FFT_WIDTH wide, rows with tilted count variance >= 4).


# n = 1100 with k_max = 1024: the upper levels are 129 to 1025 wide, so some take the FFT
# path in both packages and dtypes (from width 129 in torch float64, 513 in JAX, 1025 in torch
# float32).
_FFT_K_MAX = 1024


@functools.cache
def _fft_problem():
    """n = 1100, k_max = ``_FFT_K_MAX``. Logits ~ N(-1, 20^2) (marginals far below 1e-20),
    with entries that are never (-inf, -1e4 below the others) or always (+1e4) selected, which
    FFT rounding must not disturb: their marginals are exactly 0 and 1, and a sample never or always
    holds them."""
    return _masked_and_forced(np.random.default_rng(500), 1100), np.array([130, 550, 950])


def _masked_and_forced(rng, n):
    """(3, n) logits ~ N(-1, 20^2) whose entries 0-4 are -inf and 5-9 are -1e4 (never
    selected), and 10-14 are +1e4 (always selected)."""
    logits = rng.normal(-1.0, 20.0, size=(3, n))
    logits[:, :5] = -np.inf
    logits[:, 5:10] = -1e4
    logits[:, 10:15] = 1e4
    return logits


def _torch_direct(monkeypatch, logits, ks, k_max):
    """The torch kernels with the FFT path switched off (the exact direct sums)."""
    with monkeypatch.context() as patch:
        patch.setattr(torch_tree, "_FFT_WIDTH", 10**9)
        patch.setattr(torch_tree, "_FFT_WIDTH_FLOAT32", 10**9)
        return _run("torch", logits, ks, k_max)


@pytest.mark.parametrize("framework", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_fft_path_matches_log_space_recursion_and_direct_path(framework, monkeypatch):
    logits, ks = _fft_problem()
    module = torch_kernels if framework == "torch" else jax_kernels
    tree = torch_tree if framework == "torch" else jax_tree
    for dtype in (np.float64, np.float32):
        x = logits.astype(dtype)
        tilted = x + np.asarray(module.tilt(_tensor(framework, x), _tensor(framework, ks)))
        # the case under test (the JAX kernels also ask whether marginals are wanted)
        assert bool(
            tree._use_fft(_tensor(framework, tilted), _FFT_K_MAX, *_for_marginals(framework))
        )
    log_norm, mu = _run(framework, logits, ks, _FFT_K_MAX)
    log_norm32, mu32 = _run(framework, logits.astype(np.float32), ks, _FFT_K_MAX)
    direct_log_norm, direct_mu = _torch_direct(monkeypatch, logits, ks, _FFT_K_MAX)
    for row, k in enumerate(ks):
        finite = logits[row] > -np.inf
        expected = oracle.log_elementary_symmetric(logits[row][finite], k)[k]
        assert abs(log_norm[row] - expected) < 1e-12 * abs(expected)
        indices = np.r_[np.argsort(mu[row])[15:20], 10, 100, 200, 300]
        reference = oracle.exactly_k_log_marginals(logits[row], k, indices)
        if row == 0:  # tiny marginals keep their relative precision
            assert mu[row, indices[:5]].max() < 1e-20
        # The recursion's own rounding over 500 terms of up to e^60 is about 5e-11.
        np.testing.assert_allclose(np.log(mu[row, indices]), reference, rtol=0, atol=2e-10)
    np.testing.assert_allclose(mu, direct_mu, rtol=1e-12, atol=0)
    np.testing.assert_allclose(log_norm, direct_log_norm, rtol=1e-14, atol=0)
    assert not mu[:, :10].any() and (mu[:, 10:15] == 1.0).all()
    assert not mu32[:, :10].any() and (mu32[:, 10:15] == 1.0).all()
    assert np.abs(mu32 - mu).max() < 1e-5
    assert np.all(np.abs(log_norm32 - log_norm) < 1e-6 * np.abs(log_norm))


def _tensor(framework, array):
    return torch.tensor(array) if framework == "torch" else jnp.asarray(array)


def _for_marginals(framework):
    return () if framework == "torch" else (True,)


def test_jax_normalizer_and_draws_of_nearly_deterministic_rows_take_the_fft_path_exactly():
    """Rows whose tilted count variance is far below 4 (logits +-30, and logits of size 20
    to 50 of random sign, with k the number of positive ones): the JAX marginals keep the
    direct sums there (the variance rule), but the normaliser and the draws go by FFT (no
    ``lax.cond``, one branch to compile).
    The normaliser still matches the log-space recursion to 1e-13 relative and the direct
    path (torch, FFT off), and every draw is the row's only likely k-subset, as the
    marginals of the direct path say (each off-mode marginal below 1e-10)."""
    rng = np.random.default_rng(31)
    n, k_max = 500, 512
    alternating = np.where(np.arange(n) % 2 == 0, 30.0, -30.0)
    spread = rng.normal(0.0, 1.0, size=n)
    logits = np.stack([alternating, np.sign(spread) * (20.0 + 10.0 * np.abs(spread))])
    ks = np.array([250, int((spread > 0).sum())])
    x = jnp.asarray(logits)
    tilted = x + jax_kernels.tilt(x, jnp.asarray(ks))
    assert not bool(jax_tree._use_fft(tilted, k_max, True))  # marginals: direct sums
    assert jax_tree._use_fft(tilted, k_max, False) is True  # normaliser, draws: FFT
    parts = jax_kernels.normalizer_parts(x, jnp.asarray(ks), k_max)
    log_norm = np.asarray(jax_kernels.log_normalizer_value(x, jnp.asarray(ks), parts))
    for row, k in enumerate(ks):
        expected = oracle.log_elementary_symmetric(logits[row], k)[k]
        assert abs(log_norm[row] - expected) < 1e-13 * abs(expected)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_tree, "_FFT_WIDTH", 10**9)
        patch.setattr(torch_tree, "_FFT_WIDTH_FLOAT32", 10**9)
        direct_log_norm, direct_mu = _run("torch", logits, ks, k_max)
    np.testing.assert_allclose(log_norm, direct_log_norm, rtol=1e-14, atol=0)
    mode = direct_mu > 0.5
    assert np.all(np.where(mode, 1.0 - direct_mu, direct_mu) < 1e-10)
    samples = np.asarray(
        jax_kernels.sample(jax.random.PRNGKey(3), x, jnp.asarray(ks), k_max, (200,))
    )
    assert np.array_equal(samples, np.broadcast_to(mode, samples.shape).astype(float))


@pytest.mark.parametrize("framework", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_fft_path_samples_are_exact_and_match_the_marginals(framework):
    """4000 draws on the FFT path: exactly k ones, never a -inf or -1e4 logit, always the
    +1e4 ones, and every coordinate's frequency within 5 binomial standard errors of its
    marginal (the kernels' own, which the test above checks against the recursion)."""
    logits, ks = _fft_problem()
    num_samples = 4000
    samples = _draw(framework, logits, ks, num_samples)
    _, mu = _run(framework, logits, ks, _FFT_K_MAX)  # the tables of the test above
    assert np.array_equal(samples.sum(-1), np.broadcast_to(ks, (num_samples, 3)).astype(float))
    assert not samples[..., :10].any() and samples[..., 10:15].all()
    frequency = samples.mean(0)
    standard_error = np.sqrt(mu * (1.0 - mu) / num_samples)
    # Two draws of slack: the normal approximation fails for marginals near 0 or 1 (a
    # marginal of 6e-6 is drawn once in 4000 about once in 40 such coordinates).
    assert np.all(np.abs(frequency - mu) <= 5.0 * standard_error + 2.0 / num_samples)


def _jax_draws_by_both_split_rules(logits, ks, k_max, num_samples, seed):
    """``num_samples`` JAX draws from one call (many table entries per level: the inverse
    CDF) and from a vmap over keys (one draw per call: the exponential race on small levels),
    each (num_samples, batch, n)."""
    x, ks = jnp.asarray(logits), jnp.asarray(ks)
    keys = jax.random.split(jax.random.PRNGKey(seed), num_samples)
    by_prefix = jax_kernels.sample(keys[0], x, ks, k_max, (num_samples,))
    by_race = jax.vmap(lambda key: jax_kernels.sample(key, x, ks, k_max))(keys)
    return np.asarray(by_prefix), np.asarray(by_race)


def _jax_tree(logits, ks, k_max, for_marginals):
    """The JAX tree's levels (shapes only) for these inputs, padded to their size bucket."""
    x, k_max, _ = jax_kernels._to_bucket(jnp.asarray(logits), k_max)
    return jax.eval_shape(
        lambda x: jax_tree._prepare(x, jnp.asarray(ks), k_max, for_marginals)[4], x
    )


@pytest.mark.parametrize(
    "k_max, ks",
    [
        # With the slow tests too: the default run checks the loop's draws against
        # enumeration (test_jax_top_levels_loop_samples_follow_the_enumerated_pmf), and
        # every test at n above a few hundred runs it.
        pytest.param(64, [20, 40, 64], marks=pytest.mark.slow),
        pytest.param(256, [130, 200, 256], marks=pytest.mark.slow),
        pytest.param(512, [300, 400, 500], marks=pytest.mark.slow),
    ],
)
def test_jax_top_levels_loop_matches_the_recursion_and_the_direct_path(monkeypatch, k_max, ks):
    """n = 2600 (bucket 3072) with k_max 64, 256 and 512: the top levels, all k_max + 1 wide,
    run in one ``lax.scan`` (``_Loop``, 48, 12 and 6 nodes entering it, padded with empty
    tables to a power of two), by the direct sums (64), by FFT for the normaliser and draws
    only (256) or everywhere (512, a ``lax.cond`` inside the loop for the marginals). Logits
    ~ N(-1, 20^2) with never (-inf, -1e4) and always (+1e4) selected entries, against the
    log-space recursion, the torch kernels' direct path, float32, and 500 draws per row
    through each of the loop's two split rules (inverse CDF and exponential race), whose
    frequencies must match the marginals (pooled over hundreds of coordinates, that detects
    a bias of about 2%; the split rules' exact law is tested by chi-square at n = 20 below).
    Drawing, not compiling, is most of this test's time: 2000 draws took three times as
    long."""
    logits = _masked_and_forced(np.random.default_rng(600 + k_max), 2600)
    ks = np.array(ks)
    for for_marginals in (True, False):
        top = _jax_tree(logits, ks, k_max, for_marginals)[-1]
        assert isinstance(top, jax_tree._Loop) and top.left.shape[-1] == k_max + 1
        wide = k_max + 1 >= jax_tree._fft_width(not for_marginals)
        assert (top.bounds is not None) == wide
    log_norm, mu = _run("jax", logits, ks, k_max)
    _, mu32 = _run("jax", logits.astype(np.float32), ks, k_max)
    direct_log_norm, direct_mu = _torch_direct(monkeypatch, logits, ks, k_max)
    for row, k in enumerate(ks):
        expected = oracle.log_elementary_symmetric(logits[row][logits[row] > -np.inf], k)[k]
        assert abs(log_norm[row] - expected) < 1e-12 * abs(expected)
        indices = np.r_[np.argsort(mu[row])[15:19], 10, 100, 1000, 2599]
        reference = oracle.exactly_k_log_marginals(logits[row], k, indices)
        np.testing.assert_allclose(np.log(mu[row, indices]), reference, rtol=0, atol=2e-10)
    np.testing.assert_allclose(mu, direct_mu, rtol=1e-11, atol=1e-300)
    np.testing.assert_allclose(log_norm, direct_log_norm, rtol=1e-14, atol=0)
    for marginals in (mu, mu32):
        assert not marginals[:, :10].any() and (marginals[:, 10:15] == 1.0).all()
    assert np.abs(mu32 - mu).max() < 1e-5
    num_samples = 500
    # Frequencies against the marginals, pooled over the coordinates whose marginal is
    # between 0.05 and 0.95 (where the binomial is near normal): the mean squared z-score is
    # 1 within 5 of its standard errors, and no z-score passes 6.
    moderate = (mu > 0.05) & (mu < 0.95)
    standard_error = np.sqrt(mu * (1.0 - mu) / num_samples)[moderate]
    for samples in _jax_draws_by_both_split_rules(logits, ks, k_max, num_samples, 5):
        assert np.array_equal(samples.sum(-1), np.broadcast_to(ks, (num_samples, 3)).astype(float))
        assert not samples[..., :10].any() and samples[..., 10:15].all()
        z = (samples.mean(0) - mu)[moderate] / standard_error
        assert abs(np.mean(z**2) - 1.0) < 5.0 * np.sqrt(2.0 / z.size) and np.abs(z).max() < 6.0


def test_jax_top_levels_loop_samples_follow_the_enumerated_pmf():
    """n = 20 (bucket 32), k = 2, 3, 4 (k_max 4): eight nodes of 5-wide tables enter the
    loop of the top levels. 20000 draws per row, through the loop's inverse CDF (one call)
    and its exponential race (a vmap over keys: one draw per call), against the enumerated
    pmf by chi-square; one row has a -inf logit."""
    rng = np.random.default_rng(13)
    logits = rng.normal(0.0, 1.5, size=(3, 20))
    logits[2, 7] = -np.inf
    ks = np.array([2, 3, 4])
    assert isinstance(_jax_tree(logits, ks, 4, False)[-1], jax_tree._Loop)
    for samples in _jax_draws_by_both_split_rules(logits, ks, 4, 20000, 6):
        for row, k in enumerate(ks):
            assert oracle.chi_square_pvalue(samples[:, row], logits[row], k) > 1e-3


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_jax_half_precision_logits_draw_exactly_k_and_match_float32_marginals(dtype):
    """The tables' power-of-two rescaling reads the float's exponent bits for any width."""
    logits = jnp.linspace(-2.0, 2.0, 12)[None]
    ks = jnp.array([3])
    draws = jax_kernels.sample(jax.random.PRNGKey(0), logits.astype(dtype), ks, 3, (20,))
    assert draws.dtype == dtype and bool((draws.astype(jnp.float32).sum(-1) == 3).all())
    mu = jax_kernels.marginals(logits.astype(dtype), ks, 3).astype(jnp.float32)
    assert np.abs(np.asarray(mu - jax_kernels.marginals(logits, ks, 3))).max() < 0.05


def test_torch_fft_path_cost_does_not_grow_with_k(monkeypatch):
    """Marginals at n = 20000, k = 10000 (k_max 16384) and k = 1000 (k_max 1024), counted
    rather than timed: every level whose tables are at least ``_FFT_WIDTH`` wide goes by FFT
    in both passes, the direct sums see only the narrower levels (the same ones, hence the
    same work, at both k), and every FFT level holds at most about 2n table entries in as
    many levels as the tree is deep: O(n log^2 n) work whatever k."""
    logits = torch.tensor(np.random.default_rng(9).normal(0.0, 1.0, size=(1, 20000)))
    n = logits.shape[-1]

    def counted(k):
        levels = []  # (pass, nodes, width of the output tables, by FFT)
        merge, split = torch_tree._merge, torch_tree._outside_of_children

        def counted_merge(left, right, width, node_major, bounds=None):
            nodes = left.shape[1] if node_major else left.shape[2]
            levels.append(("up", nodes, width, bounds is not None))
            return merge(left, right, width, node_major, bounds)

        def counted_split(outside, left, right, node_major, bounds=None):
            nodes, width = left.shape[1:] if node_major else left.shape[:0:-1]
            levels.append(("down", 2 * nodes, width, bounds is not None))
            return split(outside, left, right, node_major, bounds)

        with monkeypatch.context() as patch:
            patch.setattr(torch_tree, "_merge", counted_merge)
            patch.setattr(torch_tree, "_outside_of_children", counted_split)
            k_max = 1 << (k - 1).bit_length()
            mu = torch_kernels.marginals(logits, torch.tensor([k]), k_max)
        assert abs(float(mu.sum()) - k) < 1e-8 * k  # the counted run computed the marginals
        return levels

    depth = (n - 1).bit_length()
    direct = []
    for k in (1000, 10000):
        levels = counted(k)
        up, down = levels[:depth], levels[depth:]
        assert len(down) == depth and {level[0] for level in up} == {"up"}
        for _, nodes, width, by_fft in up:
            assert by_fft == (width >= torch_tree._FFT_WIDTH)
            if by_fft:
                assert nodes * width <= 2 * (n + nodes)
        assert any(by_fft for *_, by_fft in up)
        # The downward pass splits the same levels from the root down, by FFT where the
        # upward pass merged by FFT.
        assert [level[-1] for level in down] == [level[-1] for level in reversed(up)]
        direct.append(sorted(level for level in levels if not level[-1]))
    assert direct[0] == direct[1]


def test_jax_eager_calls_compile_once_per_size_bucket():
    """n = 20, 25, 31 and 32 share the bucket 32, and k_max = 5 and 8 the table size 8: new
    logits, new n and new k within the bucket reuse the compiled kernels."""
    rng = np.random.default_rng(10)

    def call(n, k, k_max):
        logits = jnp.asarray(rng.normal(size=(2, n)))
        mu = jax_kernels.marginals(logits, jnp.asarray([k, k]), k_max)
        z = jax_kernels.sample(jax.random.PRNGKey(n), logits, jnp.asarray([k, k]), k_max)
        assert mu.shape == z.shape == (2, n)
        assert np.allclose(np.asarray(mu.sum(-1)), k) and np.all(np.asarray(z.sum(-1)) == k)

    call(20, 5, 8)
    sizes = jax_kernels._marginals._cache_size(), jax_kernels._sample._cache_size()
    for n, k, k_max in ((25, 5, 8), (31, 3, 5), (32, 8, 8), (20, 4, 8)):
        call(n, k, k_max)
    assert (jax_kernels._marginals._cache_size(), jax_kernels._sample._cache_size()) == sizes


def test_jax_size_buckets_pad_little_and_are_few():
    """Every size pads up to its bucket, by at most a half, a third and a ninth of the bucket
    up to 1024, up to 65536 and above (where the padded leaves' run time matters more than a
    compilation: at n = 1e7 the buckets of 1.5 times a power of two padded 26%), and an octave
    holds at most 1, 2 and 8 buckets in those ranges."""
    for low, high, most_padding, most_buckets in (
        (16, 1024, 1 / 2, 1),
        (1024, 65536, 1 / 3, 2),
        (65536, 2**24, 1 / 9, 8),
    ):
        octave = low  # sizes in (octave, 2 octave]
        while octave < high:
            sizes = np.unique(np.linspace(octave + 1, 2 * octave, 200).astype(int))
            buckets = {jax_kernels._bucket(int(size)) for size in sizes}
            assert len(buckets) <= most_buckets
            for size in sizes:
                bucket = jax_kernels._bucket(int(size))
                assert size <= bucket and bucket - size <= most_padding * bucket
            octave *= 2
    assert jax_kernels._bucket(10_000_000) == 10 * 2**20


def _x64_off():
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(False)
    from jax.experimental import disable_x64  # older JAX, without jax.enable_x64

    return disable_x64()


def test_jax_count_is_exact_on_both_sides_of_the_floating_sum_limit():
    """``count`` (the number of True entries: the kernels' and the distribution's integer
    counts) sums in floating point only where every partial sum is exact: random masks, a
    batch of them, against NumPy's integer count (x64 on: float64 sums), and with x64 off a
    mask of 2^24 + 3 ones, a number float32 cannot hold, so that only the integer sum
    ``count`` falls back to there can give it."""
    rng = np.random.default_rng(7)
    mask = rng.random((4, 1000)) < np.array([[0.0], [0.3], [0.9], [1.0]])
    counted = np.asarray(jax_kernels.count(jnp.asarray(mask)))
    assert counted.dtype == np.int32
    np.testing.assert_array_equal(counted, mask.sum(-1))
    with _x64_off():
        ones = jnp.ones(2**24 + 3, bool)
        assert int(ones.astype(jnp.float32).sum()) != 2**24 + 3
        assert int(jax_kernels.count(ones)) == 2**24 + 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_jax_prefix_sums_match_cumsum(dtype):
    """The sampler's prefix sums (unrolled up to ``_UNROLLED_PREFIX_WIDTH``, then triangular
    matrix products in blocks) against NumPy's sequential cumsum in float64, for every width
    up to 1024 that changes the method or the blocking, with runs of exact zeros: each sum
    adds at most 2 B terms (B = 32 in its block, and B block totals), so rounding stays within
    2 B eps of the total, and a zero weight adds exactly nothing within a block."""
    rng = np.random.default_rng(12)
    eps = np.finfo(dtype).eps
    block = jax_draw._PREFIX_BLOCK
    unrolled = jax_draw._UNROLLED_PREFIX_WIDTH
    for width in (1, 2, unrolled, unrolled + 1, 31, 32, 33, 64, 100, 513, 1000, 1024):
        weight = rng.exponential(size=(3, width)) * (rng.random((3, width)) < 0.7)
        weight = weight.astype(dtype)
        sums = np.asarray(jax_draw._prefix_sums(jnp.asarray(weight)))
        assert sums.dtype == dtype and sums.shape == weight.shape
        expected = np.cumsum(weight.astype(np.float64), axis=-1)
        assert np.all(np.abs(sums - expected) <= 2 * block * eps * expected[:, -1:])
        zero = weight[:, 1:] == 0
        same_block = (np.arange(1, width) % block != 0)[None, :]
        assert np.array_equal(sums[:, 1:][zero & same_block], sums[:, :-1][zero & same_block])


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_float32_draws_with_interleaved_masked_and_forced_entries_are_exact(framework):
    """float32, n = 300: every third logit -inf and every seventh 1e4, the rest N(0, 3^2):
    3000 draws never select a -inf logit, always select the 1e4 ones, and hold k ones. The
    split weights then have exact zeros inside the tables, where an inverse CDF whose prefix
    sums round differently per entry could otherwise pick a split of weight zero."""
    rng = np.random.default_rng(13)
    logits = rng.normal(0.0, 3.0, size=(2, 300))
    index = np.arange(300)
    logits[:, index % 3 == 0] = -np.inf
    forced = (index % 7 == 0) & (index % 3 != 0)
    logits[:, forced] = 1e4
    ks = np.array([forced.sum() + 1, 150])
    samples = _draw(framework, logits, ks, 3000, np.float32)
    assert np.array_equal(samples.sum(-1), np.broadcast_to(ks, (3000, 2)).astype(np.float32))
    assert not samples[..., index % 3 == 0].any() and samples[..., forced].all()


def _count_pmf(logits: np.ndarray) -> np.ndarray:
    """P(sum z = j), j = 0..n, for independent z_i ~ Bernoulli(sigmoid(logits_i)), by the
    plain recursion over the variables in float64 (an independent reference)."""
    pmf = np.zeros(logits.shape[-1] + 1)
    pmf[0] = 1.0
    for p in special.expit(logits):
        pmf[1:] = pmf[1:] * (1.0 - p) + pmf[:-1] * p
        pmf[0] *= 1.0 - p
    return pmf


def test_count_log_probs_match_the_recursion_in_both_packages():
    """The public root table (what PoissonBinomial uses): every count's log-probability,
    from passes tilted at several k, against the recursion, and torch against JAX."""
    rng = np.random.default_rng(5)
    logits = rng.normal(0.0, 2.0, size=(3, 10))
    logits[1, 2], logits[2, 0] = -np.inf, 30.0
    ks = np.array([2, 5, 8])
    expected = np.stack([_count_pmf(row) for row in logits])
    torch_table = torch_kernels.count_log_probs(torch.tensor(logits), torch.tensor(ks), 10)
    jax_table = jax_kernels.count_log_probs(jnp.asarray(logits), jnp.asarray(ks), 10)
    for table in (torch_table, jax_table):
        log_p, relative = (np.asarray(t, np.float64) for t in table[:2])
        assert log_p.shape == relative.shape == (3, 11)
        np.testing.assert_allclose(np.exp(log_p), expected, rtol=0, atol=1e-15)
        kept = relative > 1e-6  # entries the tilt resolves (all of them on the direct path)
        np.testing.assert_allclose(log_p[kept], np.log(expected[kept]), rtol=1e-12, atol=0)
        assert np.all(np.isneginf(log_p[1, 10]))  # the -inf logit is never on
    np.testing.assert_allclose(
        torch_table.log_probs.numpy(), np.asarray(jax_table.log_probs), rtol=1e-13, atol=0
    )


def test_fft_length_rule_is_pyros_next_fast_len():
    """One FFT length rule: constrained_ppl's (JAX kernels) is Pyro's (torch kernels)."""
    from pyro.ops.tensor_utils import next_fast_len

    from constrained_ppl.exactly_k_design import fft_length

    assert [fft_length(size) for size in range(1, 2000)] == [
        next_fast_len(size) for size in range(1, 2000)
    ]
    with pytest.raises(ValueError, match="positive"):
        fft_length(0)


def test_both_packages_rescale_tables_by_the_same_powers_of_two():
    """The same rescaling rule: division by the power of two at or below each node's
    largest entry (exact), and entries below sqrt(tiny) after it flushed to zero, bitwise
    equal in torch and JAX, with the exponents the normaliser adds back."""
    rng = np.random.default_rng(2)
    for dtype in (np.float32, np.float64):
        tiny = np.finfo(dtype).tiny
        table = np.exp(rng.uniform(-300.0, 80.0, size=(4, 7, 9))).astype(dtype)
        table[0, 0] = 0.0
        table[1, 1, :3] = np.sqrt(tiny) * table[1, 1].max() * np.array([0.5, 1.0, 4.0])
        scaled_torch, power = torch_tree._rescale(torch.tensor(table))
        scaled_jax, exponent = jax.jit(jax_tree._rescale)(jnp.asarray(table))
        np.testing.assert_array_equal(scaled_torch.numpy(), np.asarray(scaled_jax))
        np.testing.assert_array_equal(
            torch_tree._exponent(power).numpy(), np.asarray(exponent, np.float64)
        )
        nonzero = table.max(-1) > tiny
        largest = scaled_torch.numpy().max(-1)[nonzero]
        assert np.all((largest >= 1.0) & (largest < 2.0))
        np.testing.assert_array_equal(np.log2(power.numpy()), np.asarray(exponent, np.float64))


def test_marginals_of_a_saturated_variable_have_exactly_zero_derivative():
    """A forced variable (logit 1e9, off-weight exactly 0) has marginal 1 in every
    configuration, so the derivatives of its marginal are exactly 0; a caller that weights
    the marginals by the logits (the entropy's gradient) must not see 1e9 times the
    ratio's rounding noise (found by tests/test_exactly_k_properties.py: 3e-8 and 1.5e-7
    where the entropy's gradient is 0)."""
    logits = np.array([0.0, 0.0, 0.0, 0.0, 0.0, 1e9])
    theta = torch.tensor(logits, requires_grad=True)
    # weighted by the tilted logits, as the entropy's gradient is
    x = logits - np.log(4.0)
    (torch_kernels.marginals(theta, torch.tensor(2), 2) * torch.tensor(x)).sum().backward()
    # the free variables' own rounding (1e-17) remains, not 1e9 times it
    np.testing.assert_allclose(theta.grad.numpy(), np.zeros(6), rtol=0, atol=1e-12)
    weighted = jax.grad(lambda theta: (jax_kernels.marginals(theta, jnp.asarray(2), 2) * x).sum())
    np.testing.assert_allclose(np.asarray(weighted(jnp.asarray(logits))), 0.0, rtol=0, atol=1e-12)


def _enumerated_moments(logits, k: int):
    """(mean, covariance, third central moment) of the exactly-k law by enumeration: the
    marginals, their Jacobian, and the derivatives of the Jacobian (cumulants of an
    exponential family)."""
    subsets, probs = oracle.exactly_k_pmf(logits, k)
    centred = subsets - probs @ subsets
    return (
        probs @ subsets,
        np.einsum("s,si,sj->ij", probs, centred, centred),
        np.einsum("s,si,sj,sl->ijl", probs, centred, centred, centred),
    )


# float64 with the slow tests: float32 with x64 off, the users' configuration, checks every
# mode in the default run.
@pytest.mark.user_config_only
@pytest.mark.parametrize("dtype", [np.float32, pytest.param(np.float64, marks=pytest.mark.slow)])
def test_jax_marginals_tangent_pass_matches_enumerated_cumulants_in_every_mode(dtype):
    """The marginals' derivative rule of the general kernels (exactly_k_tangent, a tangent
    pass whose transpose is reverse mode) in forward, reverse, forward-over-reverse and
    reverse-over-reverse mode, under jit and vmap, against the enumerated covariance and
    third central moment, at k = 0, k = the number of finite logits, -inf logits, and
    logits far apart (marginals within 1e-13 of 0 and 1)."""
    from numpyro_constrained import exactly_k_tangent as tangent

    rng = np.random.default_rng(7)
    logits = rng.normal(0.0, 2.0, size=(4, 9))
    logits[0, 3] = -np.inf  # k = 8: every finite variable on
    logits[2, [1, 5]] = [30.0, -30.0]
    logits[3, 0] = -np.inf
    ks = np.array([8, 0, 4, 3])
    w, v = rng.normal(size=(2, 4, 9))
    x, k32 = jnp.asarray(logits, dtype), jnp.asarray(ks, jnp.int32)
    w32, v32 = jnp.asarray(w, dtype), jnp.asarray(v, dtype)
    moments = [_enumerated_moments(logits[row], int(ks[row])) for row in range(4)]
    mean = np.stack([m[0] for m in moments])
    cov = np.stack([m[1] for m in moments])
    third = np.stack([m[2] for m in moments])
    tol = dict(rtol=0, atol=2e-5 if dtype == np.float32 else 1e-11)

    def marginals(x):
        return tangent.marginals(x, k32, 8)

    def loss(x):
        return (marginals(x) * w32).sum()

    @jax.jit  # one compilation for every mode: compiling dominates the test's time
    def every_mode(x):
        return (
            marginals(x),
            jax.jvp(marginals, (x,), (v32,))[1],
            jax.grad(loss)(x),
            jax.vmap(jax.grad(loss))(jnp.stack([x, 0.5 * x])),
            jax.jacfwd(marginals)(x),
            jax.hessian(loss)(x),  # forward over reverse
            jax.jacrev(jax.jacrev(loss))(x),
            jax.jvp(lambda y: jax.jvp(marginals, (y,), (v32,))[1], (x,), (v32,))[1],
        )

    mu, along_v, gradient, gradients, jacobian, hessian, reverse_hessian, twice = every_mode(x)
    np.testing.assert_allclose(mu, mean, **tol)
    np.testing.assert_allclose(along_v, np.einsum("bij,bj->bi", cov, v), **tol)
    np.testing.assert_allclose(gradient, np.einsum("bij,bi->bj", cov, w), **tol)
    np.testing.assert_allclose(gradients[0], gradient, **tol)
    halved = [_enumerated_moments(0.5 * logits[row], int(ks[row]))[1] for row in range(4)]
    np.testing.assert_allclose(gradients[1], np.einsum("bij,bi->bj", halved, w), **tol)
    # Jacobians and Hessians are block diagonal in the rows: (rows, n, rows, n).
    blocks = np.arange(4)
    np.testing.assert_allclose(np.asarray(jacobian)[blocks, :, blocks], cov, **tol)
    expected = np.einsum("bi,bijl->bjl", w, third)
    for second in (hessian, reverse_hessian):
        np.testing.assert_allclose(np.asarray(second)[blocks, :, blocks], expected, **tol)
    np.testing.assert_allclose(twice, np.einsum("bijl,bj,bl->bi", third, v, v), **tol)


# slow: the enumeration test above checks the rule in every mode at small n; this one the
# dispatch at n = 300 (about 20 s of compilation).
@pytest.mark.slow
@pytest.mark.user_config_only
@pytest.mark.parametrize("dtype", [np.float32])
def test_jax_general_marginals_reverse_mode_matches_the_kernels_own_derivative(dtype):
    """Through the dispatch at a size the general kernels serve (n = 300, k_max 32; float32,
    where the tables span the widest range): the gradient of a loss of the marginals against
    JAX's own derivative of the kernels (the rule before the tangent pass), and its symmetry
    with the forward derivative (the Jacobian is a covariance)."""
    from numpyro_constrained import exactly_k_tangent as tangent

    rng = np.random.default_rng(8)
    logits = rng.normal(0.0, 2.0, size=(2, 300))
    logits[0, :7] = -np.inf
    logits[1, 3] = 40.0
    x = jnp.asarray(logits, dtype)
    ks = jnp.asarray([5, 20])
    w = jnp.asarray(rng.normal(size=(2, 300)), dtype)
    padded, k_max, _ = jax_kernels._to_bucket(x, 20)

    def reference(y):  # the kernels differentiated by JAX itself, on the padded logits
        pad = jnp.full((2, padded.shape[-1] - 300), -jnp.inf, dtype)
        mu = tangent._kernel_marginals(jnp.concatenate([y, pad], -1), ks.astype(jnp.int32), k_max)
        return (mu[:, :300] * w).sum()

    def loss(y):
        return (jax_kernels.marginals(y, ks, 20) * w).sum()

    @jax.jit
    def both(y):
        forward = jax.jvp(lambda y: jax_kernels.marginals(y, ks, 20), (y,), (w,))[1]
        return jax.grad(loss)(y), jax.grad(reference)(y), forward

    gradient, expected, forward = both(x)
    np.testing.assert_allclose(gradient, expected, rtol=0, atol=3e-6)
    np.testing.assert_allclose(gradient, forward, rtol=0, atol=3e-6)
