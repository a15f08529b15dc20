"""The shared argument rules (constrained_ppl.arguments), checked on plain values
and on each framework's arrays."""

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
