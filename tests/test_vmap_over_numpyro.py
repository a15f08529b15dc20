"""``vmap_over`` of each NumPyro class maps a batched parameter so that a function of the
distribution, vmapped with those axes, gives one result per batch element, equal to that of
the element's distribution built on its own (issue 34: a batched ``scale`` of
``LinearConstrainedNormal`` gave a (3, 3) array, each row one element's value repeated)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpyro.distributions.batch_util import vmap_over

from numpyro_constrained import (
    ConditionedPoisson,
    CountConstrainedBernoulli,
    ExactlyKBernoulli,
    LinearConstrainedNormal,
    PoissonBinomial,
)

LOGITS = jnp.array([[0.1, 0.5, -1.0, 2.0], [1.0, 0.0, 0.3, -0.2], [0.0, 0.0, 0.0, 1.0]])
SCALE = jnp.array([[1.0, 2.0, 3.0], [2.0, 1.0, 1.0], [0.5, 1.0, 2.0]])

# (build from the batched parameters, vmap_over axes, build element i on its own)
CASES = {
    "lcn-scale-and-k": (
        lambda: LinearConstrainedNormal(jnp.zeros(3), SCALE, k=jnp.array([[1.0], [2.0], [0.5]])),
        {"scale": 0, "k": 0},
        lambda i: LinearConstrainedNormal(jnp.zeros(3), SCALE[i], k=[1.0, 2.0, 0.5][i]),
    ),
    "lcn-scale": (
        lambda: LinearConstrainedNormal(jnp.zeros(3), SCALE, k=1.0),
        {"scale": 0},
        lambda i: LinearConstrainedNormal(jnp.zeros(3), SCALE[i], k=1.0),
    ),
    "ekb-logits": (
        lambda: ExactlyKBernoulli(LOGITS, k=2),
        {"logits": 0},
        lambda i: ExactlyKBernoulli(LOGITS[i], k=2),
    ),
    "cp-rate": (
        lambda: ConditionedPoisson(jnp.exp(LOGITS), k=3),
        {"rate": 0},
        lambda i: ConditionedPoisson(jnp.exp(LOGITS[i]), k=3),
    ),
    # These two shaped their results by batch_shape, which vmap leaves as it was: each row
    # was one element's value repeated (PoissonBinomial), or a reshape failed (CCB).
    "pb-logits": (
        lambda: PoissonBinomial(LOGITS),
        {"logits": 0},
        lambda i: PoissonBinomial(LOGITS[i]),
    ),
    "ccb-logits": (
        lambda: CountConstrainedBernoulli(LOGITS, low=1, high=3),
        {"logits": 0},
        lambda i: CountConstrainedBernoulli(LOGITS[i], low=1, high=3),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_vmapped_log_prob_is_one_value_per_element(name):
    build, axes, element = CASES[name]
    d = build()
    value = d.sample(jax.random.PRNGKey(0))
    mapped = jax.vmap(lambda d, v: d.log_prob(v), in_axes=(vmap_over(d, **axes), 0))(d, value)
    expected = [float(element(i).log_prob(value[i])) for i in range(3)]
    assert mapped.shape == (3,)
    np.testing.assert_allclose(np.asarray(mapped), expected, rtol=1e-10)


def test_mapping_two_parameters_over_different_batch_axes_is_an_error():
    d = ExactlyKBernoulli(jnp.zeros((2, 3, 4)), k=jnp.ones((2, 3), dtype=jnp.int32))
    with pytest.raises(ValueError, match="different axes"):
        vmap_over(d, logits=0, k=1)
    with pytest.raises(ValueError, match="non-negative"):
        vmap_over(d, logits=-2)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ExactlyKBernoulli(jnp.zeros((2, 4)), k=1),
        lambda: ConditionedPoisson(jnp.ones((2, 4)), k=3),
        lambda: LinearConstrainedNormal(jnp.zeros((2, 3)), jnp.ones(3)),
        lambda: PoissonBinomial(jnp.zeros((2, 4))),
        lambda: CountConstrainedBernoulli(jnp.zeros((2, 4)), low=1, high=2),
    ],
    ids=["ekb", "cp", "lcn", "pb", "ccb"],
)
@pytest.mark.parametrize("shape", [(3,), (1,), ()])
def test_an_impossible_expand_raises_numpyros_message(make, shape):
    """NumPyro's own message, as ``Normal(zeros(2), 1).expand(shape)`` raises it."""
    import numpyro.distributions as dist

    with pytest.raises(ValueError) as reference:
        dist.Normal(jnp.zeros(2), 1.0).expand(shape)
    with pytest.raises(ValueError) as error:
        make().expand(shape)
    assert str(error.value) == str(reference.value)


def test_a_possible_expand_still_works():
    d = ExactlyKBernoulli(jnp.zeros((1, 4)), k=1).expand((5, 3))
    assert d.batch_shape == (5, 3) and d.logits.shape == (5, 3, 4)
