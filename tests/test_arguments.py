"""The shared argument rules (constrained_ppl.arguments), checked on plain values
and on each framework's arrays."""

import inspect

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from constrained_ppl.arguments import check_count, check_static_bound, check_value_shape


@pytest.mark.parametrize(
    "k",
    [
        3,
        np.int64(3),
        3.0,
        np.array([0, 2]),
        np.array([1.0, 4.0]),
        torch.tensor([2.0, 0.0]),
        torch.tensor(3),
        jnp.array([1, 2]),
        jnp.array(2.0),
        [2, 3],
        (1.0, 0.0),
    ],
)
def test_counts_accepted(k):
    check_count(k, concrete=True)


@pytest.mark.parametrize(
    "k",
    [
        True,
        np.bool_(False),
        3.5,
        float("nan"),
        np.array([1.0, 2.5]),
        torch.tensor([1.5]),
        jnp.array([jnp.inf]),
        jnp.array([True]),
        np.array([1 + 1j]),
        "3",
        [1.5, 2],
    ],
)
def test_non_counts_rejected(k):
    with pytest.raises(ValueError, match="k"):
        check_count(k, concrete=True)


def test_traced_float_count_checked_for_dtype_only():
    check_count(jnp.array([1.5]), concrete=False)
    with pytest.raises(ValueError):
        check_count(jnp.array([True]), concrete=False)


def test_static_bound():
    assert check_static_bound(None) is None
    assert check_static_bound(np.int32(4)) == 4
    assert check_static_bound(4.0) == 4
    for bad in (True, -1, 2.5, np.array(3), jnp.array(3)):
        with pytest.raises(ValueError, match="k_max"):
            check_static_bound(bad)


def test_value_shape():
    check_value_shape((5, 2, 3), (2,), (3,), "D")
    check_value_shape((3,), (2,), (3,), "D")
    check_value_shape((1, 3), (2,), (3,), "D")
    with pytest.raises(ValueError, match=r"event shape \(3,\)"):
        check_value_shape((2, 4), (2,), (3,), "D")
    with pytest.raises(ValueError, match=r"batch shape \(2,\)"):
        check_value_shape((4, 3), (2,), (3,), "D")
    with pytest.raises(ValueError, match="event shape"):
        check_value_shape((), (), (3,), "D")


def _constructors(package):
    """Each class with its count (and for the Gaussian, its A) given by position, and the
    same call written as the message says, with ``k=`` (and ``A=``)."""
    mod = pytest.importorskip(package)
    array = torch.tensor if package == "pyro_constrained" else jnp.asarray
    logits, rate = array([0.5, -1.0, 2.0, 0.0]), array([1.0, 2.0, 3.0, 4.0])
    loc, scale, A, k = array([0.0, 1.0, 2.0]), array([1.0, 1.0, 2.0]), array([[1.0] * 3]), 3.0
    return [
        (lambda: mod.ExactlyKBernoulli(logits, 2), lambda: mod.ExactlyKBernoulli(logits, k=2)),
        (lambda: mod.ExactlyKBernoulli(logits), lambda: mod.ExactlyKBernoulli(logits, k=2)),
        (lambda: mod.ConditionedPoisson(rate, 5), lambda: mod.ConditionedPoisson(rate, k=5)),
        (
            lambda: mod.LinearConstrainedNormal(loc, scale, A, array([k])),
            lambda: mod.LinearConstrainedNormal(loc, scale, A=A, k=array([k])),
        ),
    ]


@pytest.mark.parametrize("package", ["pyro_constrained", "numpyro_constrained"])
def test_positional_count_is_a_type_error_that_says_k_equals(package):
    # k (and A) are keyword-only in both packages; a call that gives them by position (or
    # ExactlyKBernoulli(logits, 2), where 2 lands in probs) gets a TypeError saying k=.
    for positional, keyword in _constructors(package):
        with pytest.raises(TypeError, match=r"only by keyword: write \w+\(.*k=k\)"):
            positional()
        keyword()  # the spelling the message gives works


@pytest.mark.parametrize("package", ["pyro_constrained", "numpyro_constrained"])
def test_keyword_only_keeps_the_documented_signature(package):
    # The check wraps __init__; the signature that help(), Sphinx and the frameworks'
    # metaclasses read is still the class's own, with k keyword-only.
    mod = pytest.importorskip(package)
    for name in ["ExactlyKBernoulli", "ConditionedPoisson", "LinearConstrainedNormal"]:
        parameters = inspect.signature(getattr(mod, name)).parameters
        assert parameters["k"].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert "args" not in parameters and "kwargs" not in parameters, name
