"""ExactlyKBernoulli: independent Bernoullis conditioned on exactly k ones (MATH.md section 1).

The numerical work (log normaliser, marginals, exact sampling) lives in
:mod:`numpyro_constrained.exactly_k_kernels`; this module handles parameters, infinite
logits, validation, shapes and the framework's protocols (pytree, ``vmap_over``, KL).
"""

from numbers import Integral

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from numpyro.distributions import Bernoulli, constraints
from numpyro.distributions.batch_util import _default_vmap_over, vmap_over
from numpyro.distributions.distribution import Distribution
from numpyro.distributions.kl import kl_divergence
from numpyro.distributions.util import lazy_property
from numpyro.util import not_jax_tracer

from numpyro_constrained import exactly_k_kernels as kernels

__all__ = ["ExactlyKBernoulli", "KHot"]


def _softplus(x: jax.Array) -> jax.Array:
    # Exact (no linear threshold), with a custom JVP that is right at 0; relu(x) +
    # log1p(exp(-|x|)) has a wrong autograd derivative at x = 0. Inputs here are finite.
    return jax.nn.softplus(x)


class _ExtendedReal(constraints.ParameterFreeConstraint):
    """The extended real line [-inf, +inf]: anything but NaN (infinite logits force a
    variable off or on). NumPyro's ``real`` excludes the infinities."""

    def __call__(self, x):
        return x == x

    def feasible_like(self, prototype):
        return jnp.zeros_like(prototype)


class KHot(constraints.Constraint):
    """0/1 vectors (last dimension) with exactly ``k`` ones; ``k`` broadcasts with the batch."""

    is_discrete = True
    event_dim = 1

    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        xp = jnp if isinstance(x, jax.Array) else np
        binary = xp.all((x == 0) | (x == 1), axis=-1)
        return binary & (xp.sum(x, axis=-1) == self.k)

    def feasible_like(self, prototype):
        n = jnp.shape(prototype)[-1]
        first_k = jnp.arange(n) < jnp.expand_dims(jnp.asarray(self.k), -1)
        return jnp.broadcast_to(first_k, jnp.shape(prototype)).astype(jnp.result_type(prototype))

    def tree_flatten(self):
        return (self.k,), (("k",), dict())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k={self.k})"


def _as_k(k) -> jax.Array:
    if isinstance(k, bool) or not (
        isinstance(k, Integral) or (hasattr(k, "dtype") and jnp.issubdtype(k.dtype, jnp.integer))
    ):
        raise ValueError(f"k must be a Python int or an integer array, got {k!r}")
    return jnp.asarray(k)


def _is_concrete(*values) -> bool:
    return all(not_jax_tracer(value) for value in values)


class ExactlyKBernoulli(Distribution):
    r"""Independent Bernoullis ``z_i ~ Bernoulli(sigmoid(logits_i))`` conditioned on
    ``sum_i z_i = k``.

    The pmf, with respect to counting measure on k-hot vectors ``z`` in ``{0, 1}^n``, is

    .. math:: p(z) = \exp(\theta \cdot z) / e_k(\exp \theta),

    where ``e_k`` is the k-th elementary symmetric polynomial. Adding one constant to every
    logit leaves it unchanged. A logit of ``+inf`` (``probs = 1``) forces its variable on,
    ``-inf`` (``probs = 0``) forces it off; the distribution must remain feasible.

    :param logits: log-odds, shape ``batch + (n,)``; entries may be ``+-inf``.
    :param probs: probabilities in [0, 1] instead of logits (exactly one of the two).
    :param k: the number of ones, a Python int or an integer array broadcasting with
        ``logits.shape[:-1]``; ``0 <= k <= n``.

    ``sample`` returns an exact k-hot sample ``z`` whose gradient is that of the conditional
    marginals ``mu`` (the SIMPLE estimator): ``z + (mu - stop_gradient(mu))``. Checks that
    need concrete values (k in range, feasibility) are skipped under a JAX trace.
    """

    # probs first: given probs, the logits derived from them are NaN where probs are invalid,
    # and the error should name what the caller passed.
    arg_constraints = {"probs": constraints.unit_interval, "logits": _ExtendedReal()}
    reparametrized_params = ["logits", "probs"]
    pytree_data_fields = ("logits", "probs", "k")
    pytree_aux_fields = ("_k_max",)

    def __init__(self, logits=None, probs=None, *, k, validate_args=None):
        if (logits is None) == (probs is None):
            raise ValueError("ExactlyKBernoulli: give exactly one of `logits` or `probs`")
        if probs is not None:
            probs = jnp.asarray(probs)
            if not jnp.issubdtype(probs.dtype, jnp.floating):
                probs = probs.astype(jnp.result_type(float))
            if probs.ndim < 1:
                raise ValueError("probs must have at least one dimension (the n variables)")
            # Exact 0 and 1 map to -inf and +inf.
            logits = jnp.log(probs) - jnp.log1p(-probs)
        else:
            logits = jnp.asarray(logits)
            if not jnp.issubdtype(logits.dtype, jnp.floating):
                logits = logits.astype(jnp.result_type(float))
            if logits.ndim < 1:
                raise ValueError("logits must have at least one dimension (the n variables)")
        k = _as_k(k)
        try:
            batch_shape = jnp.broadcast_shapes(logits.shape[:-1], jnp.shape(k))
        except ValueError as error:
            raise ValueError(
                f"k of shape {jnp.shape(k)} does not broadcast with the batch shape "
                f"{logits.shape[:-1]} of the logits"
            ) from error
        event_shape = logits.shape[-1:]
        self.logits = jnp.broadcast_to(logits, batch_shape + event_shape)
        if probs is not None:
            self.probs = jnp.broadcast_to(probs, batch_shape + event_shape)
        self.k = jnp.broadcast_to(k, batch_shape)
        self._k_max = self._check_k()
        super().__init__(batch_shape, event_shape, validate_args=validate_args)

    def _check_k(self) -> int:
        """Checks k in 0..n and feasibility where the values are concrete (whatever
        validate_args says: nothing is defined without them); returns ``k_max``.

        ``k_max`` is rounded up to a power of two (at most n): it is a static argument of
        the jitted kernels, and every new value would cost a compilation."""
        n = self.logits.shape[-1]
        if not _is_concrete(self.k):
            return n
        k = np.asarray(self.k)
        if k.size and (k.min() < 0 or k.max() > n):
            raise ValueError(f"k must be in 0..n = 0..{n}, got {np.unique(k).tolist()}")
        if _is_concrete(self.logits) and k.size:
            logits = np.asarray(self.logits)
            forced_on = (logits == np.inf).sum(-1)
            forced_off = (logits == -np.inf).sum(-1)
            if np.any((k < forced_on) | (k > n - forced_off)):
                raise ValueError(
                    "logits make the constraint impossible: some batch element has more than "
                    "k logits equal to +inf (probs = 1) or more than n - k equal to -inf "
                    "(probs = 0)"
                )
        largest = int(k.max()) if k.size else 0
        return min(n, 1 << largest.bit_length())

    @constraints.dependent_property(is_discrete=True, event_dim=1)
    def support(self) -> KHot:
        return KHot(self.k)

    @lazy_property
    def probs(self) -> jax.Array:
        return jax.nn.sigmoid(self.logits)

    @property
    def _log_normalizer(self) -> jax.Array:
        """log e_{k_free}(exp logits) over the finite logits."""
        return kernels.log_normalizer(*_free_problem(self.logits, self.k), self._k_max)

    @property
    def _marginal_probs(self) -> jax.Array:
        """mu_i = P(z_i = 1 | sum z = k), differentiable in the logits."""
        kernel_logits, k_free = _free_problem(self.logits, self.k)
        free_mu = kernels.marginals(kernel_logits, k_free, self._k_max)
        return _complete_marginals(free_mu, self.logits, k_free)

    @property
    def mean(self) -> jax.Array:
        return self._marginal_probs

    @property
    def variance(self) -> jax.Array:
        mu = self._marginal_probs
        return mu * (1 - mu)

    @property
    def marginals(self) -> Bernoulli:
        """The conditional marginal of each coordinate, ``Bernoulli(mu)`` with batch shape
        ``batch + (n,)``."""
        return Bernoulli(probs=self._marginal_probs, validate_args=False)

    @property
    def mode(self) -> jax.Array:
        """The most likely k-hot vector: ones at the k largest logits (ties go to the lower
        index)."""
        return _mode(self.logits, self.k)

    def log_prob(self, value) -> jax.Array:
        """``theta . z - log e_k(exp theta)`` for k-hot ``z`` (counting measure). Outside the
        support: ``ValueError`` with validation on and a concrete value, else ``-inf``.
        Differentiable in ``value`` too, so a straight-through sample passes its gradient on."""
        log_prob, in_support = _log_prob(
            self.logits, self.k, jnp.asarray(value), self._log_normalizer
        )
        if self._validate_args and not_jax_tracer(in_support) and not np.all(in_support):
            raise ValueError(
                "ExactlyKBernoulli.log_prob: value is not a k-hot vector with the distribution's "
                f"k (support {self.support})"
            )
        return log_prob

    def sample(self, key, sample_shape=()) -> jax.Array:
        """An exact draw ``z`` (0.0 / 1.0 entries summing to k) carrying the straight-through
        marginal gradient ``z + (mu - stop_gradient(mu))``; its value is exactly ``z``."""
        kernel_logits, k_free = _free_problem(self.logits, self.k)
        z, free_mu = kernels.sample_and_marginals(
            key, kernel_logits, k_free, self._k_max, tuple(sample_shape)
        )
        return _straight_through(z, free_mu, self.logits, k_free)

    def entropy(self) -> jax.Array:
        """``H = log e_k(exp theta) - theta . mu`` (over the finite logits)."""
        return _entropy(self.logits, self._log_normalizer, self._marginal_probs)

    def log_constraint_prob(self) -> jax.Array:
        """``log P(sum z = k)`` under the unconstrained Bernoullis (Poisson-binomial pmf):
        ``log e_k(exp theta) - sum_i softplus(theta_i)``, shape ``batch``."""
        return _log_constraint_prob(self.logits, self._log_normalizer)

    def expand(self, batch_shape) -> "ExactlyKBernoulli":
        batch_shape = tuple(batch_shape)
        if batch_shape == self.batch_shape:
            return self
        new = type(self).__new__(type(self))
        new.logits = jnp.broadcast_to(self.logits, batch_shape + self.event_shape)
        if "probs" in self.__dict__:
            new.probs = jnp.broadcast_to(self.probs, batch_shape + self.event_shape)
        new.k = jnp.broadcast_to(self.k, batch_shape)
        new._k_max = self._k_max
        Distribution.__init__(new, batch_shape, self.event_shape, validate_args=False)
        new._validate_args = self._validate_args
        return new

    @classmethod
    def infer_shapes(cls, logits=None, probs=None, k=()):
        shape = logits if logits is not None else probs
        batch_shape = jnp.broadcast_shapes(tuple(shape[:-1]), tuple(k))
        return batch_shape, tuple(shape[-1:])


@vmap_over.register
def _vmap_over_exactly_k_bernoulli(dist: ExactlyKBernoulli, logits=None, probs=None, k=None):
    # logits are derived from probs when probs are given, so they share its axis.
    return _default_vmap_over(
        dist, logits=logits if logits is not None else probs, probs=probs, k=k
    )


@kl_divergence.register(ExactlyKBernoulli, ExactlyKBernoulli)
def _kl_exactly_k_bernoulli(p: ExactlyKBernoulli, q: ExactlyKBernoulli) -> jax.Array:
    """``KL(p || q) = mu_p . (theta_p - theta_q) - log e_k(p) + log e_k(q)`` over finite
    logits; ``+inf`` where p puts mass on a vector that q forbids."""
    if p.event_shape != q.event_shape:
        raise ValueError(f"KL needs the same n, got {p.event_shape[0]} and {q.event_shape[0]}")
    if _is_concrete(p.k, q.k) and not np.array_equal(*np.broadcast_arrays(p.k, q.k)):
        raise ValueError("KL between ExactlyKBernoulli needs the same k")
    return _kl(p.logits, p._marginal_probs, p._log_normalizer, q.logits, q._log_normalizer)


# The distribution's glue around the kernels, as small jitted pure functions: in eager use
# every JAX operation compiles once per shape, and one compilation for a dozen operations
# is about ten times cheaper. The kernels stay separate calls so that their (larger)
# compilations are shared between the methods.


@jax.jit
def _free_problem(logits: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The kernels' problem: forced-on variables set to -inf and subtracted from k."""
    forced_on = logits == jnp.inf
    return jnp.where(forced_on, -jnp.inf, logits), k - forced_on.sum(-1).astype(k.dtype)


def _finite_part(logits: jax.Array) -> jax.Array:
    return jnp.where(jnp.isfinite(logits), logits, 0.0)


@jax.jit
def _complete_marginals(free_mu: jax.Array, logits: jax.Array, k_free: jax.Array) -> jax.Array:
    # Deterministic entries get exact 0 / 1 (and zero gradient, which is their derivative).
    free = jnp.isfinite(logits)
    mu = jnp.where((k_free == free.sum(-1))[..., None], 1.0, free_mu)
    mu = jnp.where((k_free == 0)[..., None], 0.0, mu)
    return jnp.where(free, mu, jnp.where(logits == jnp.inf, 1.0, 0.0)).astype(logits.dtype)


@jax.jit
def _straight_through(z, free_mu, logits, k_free) -> jax.Array:
    z = jnp.where(logits == jnp.inf, 1.0, lax.stop_gradient(z)).astype(logits.dtype)
    mu = _complete_marginals(free_mu, logits, k_free)
    return z + (mu - lax.stop_gradient(mu))


@jax.jit
def _mode(logits: jax.Array, k: jax.Array) -> jax.Array:
    order = jnp.argsort(-logits, axis=-1, stable=True)
    ranks = jnp.argsort(order, axis=-1, stable=True)
    return (ranks < k[..., None]).astype(logits.dtype)


@jax.jit
def _log_prob(logits, k, value, log_normalizer) -> tuple[jax.Array, jax.Array]:
    """(log_prob, value is k-hot)."""
    in_support = KHot(k)(value)
    on = value == 1
    possible = in_support & ~jnp.any(on & (logits == -jnp.inf), axis=-1)
    possible = possible & ~jnp.any(~on & (logits == jnp.inf), axis=-1)
    score = (_finite_part(logits) * value).sum(-1) - log_normalizer
    return jnp.where(possible, score, -jnp.inf), in_support


@jax.jit
def _entropy(logits, log_normalizer, mu) -> jax.Array:
    return log_normalizer - (_finite_part(logits) * mu).sum(-1)


@jax.jit
def _log_constraint_prob(logits, log_normalizer) -> jax.Array:
    softplus = jnp.where(jnp.isfinite(logits), _softplus(_finite_part(logits)), 0.0)
    return log_normalizer - softplus.sum(-1)


@jax.jit
def _kl(p_logits, p_mu, p_log_normalizer, q_logits, q_log_normalizer) -> jax.Array:
    cross = (p_mu * _finite_part(q_logits)).sum(-1)
    own = (p_mu * _finite_part(p_logits)).sum(-1)
    kl = own - cross - p_log_normalizer + q_log_normalizer
    forbidden = q_logits == -jnp.inf
    required = q_logits == jnp.inf
    escapes = jnp.any((p_mu > 0) & forbidden, axis=-1) | jnp.any((p_mu < 1) & required, axis=-1)
    return jnp.where(escapes, jnp.inf, kl)
