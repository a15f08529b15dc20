"""The three classes on an accelerator give the CPU's numbers (issue 18, item 5).

For every setting of ``tests/conformance_cases.py`` (each class, batched and not, every
covariance form, float32 and float64), a distribution built from arrays on the accelerator
(torch: CUDA; JAX: its GPU backend) is compared with the same distribution on the CPU:
``log_prob`` of a CPU sample, ``mean``, ``entropy`` and the gradients of ``log_prob +
entropy`` with respect to the floating-point parameters agree to a tolerance of the dtype;
every output stays on the accelerator; samples and ``rsample``s drawn there have the right
shape, lie in the support, and (rsample) carry a finite gradient.

Skipped where no accelerator is present (this project's CI machine has none); with one,
``python -m pytest tests/test_accelerators.py`` runs them.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conformance_cases import ALL_CASES, CP, EKB, LCN, Case

# float32: the accelerator's reductions and transcendental functions round differently
# (a different summation order, fused multiply-adds), a few ulps of values of order 10.
TOLERANCES = {"float32": {"rtol": 2e-4, "atol": 2e-4}, "float64": {"rtol": 1e-9, "atol": 1e-9}}


def _is_float(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype.kind == "f"


def _assert_same(on_device: dict, on_cpu: dict, case: Case) -> None:
    assert on_device.keys() == on_cpu.keys()
    for name, expected in on_cpu.items():
        np.testing.assert_allclose(
            on_device[name], expected, err_msg=f"{case.id}: {name}", **TOLERANCES[case.dtype]
        )


# ---------------------------------------------------------------------------------------
# torch


def _torch_cuda_param():
    import torch

    return pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    )


def _torch_outputs(case: Case, device: str, value_on_cpu=None):
    """(outputs as NumPy arrays, a CPU sample for log_prob) of ``case`` built on ``device``."""
    import torch

    from pyro_constrained import ConditionedPoisson, ExactlyKBernoulli, LinearConstrainedNormal

    classes = {EKB: ExactlyKBernoulli, LCN: LinearConstrainedNormal, CP: ConditionedPoisson}
    params, leaves = {}, []
    for name, value in case.params().items():
        if _is_float(value):
            tensor = torch.tensor(value, device=device, requires_grad=True)
            leaves.append(tensor)
        elif isinstance(value, np.ndarray):
            tensor = torch.tensor(value, device=device)
        else:
            tensor = value
        params[name] = tensor
    distribution = classes[case.cls](**params)
    if value_on_cpu is None:
        torch.manual_seed(0)
        value_on_cpu = distribution.sample((2,)).detach()
    value = value_on_cpu.to(device)
    log_prob, entropy, mean = (
        distribution.log_prob(value),
        distribution.entropy(),
        distribution.mean,
    )
    for output in (log_prob, entropy, mean):
        assert output.device.type == torch.device(device).type
    # (retain_graph: the rsample below shares the distribution's cached factorisations)
    grads = torch.autograd.grad(
        log_prob.sum() + entropy.sum(), leaves, retain_graph=True, allow_unused=True
    )
    outputs = {"log_prob": log_prob, "entropy": entropy, "mean": mean}
    # (an unused parameter, such as LCN's k in log_prob + entropy, has no gradient)
    outputs.update({f"grad {i}": grad for i, grad in enumerate(grads) if grad is not None})

    sample = distribution.sample((3,))
    assert sample.device.type == torch.device(device).type
    assert sample.shape == (3,) + case.batch_shape + case.event_shape
    assert bool(distribution.support.check(sample).all())
    if distribution.has_rsample:
        draw = distribution.rsample()
        assert draw.device.type == torch.device(device).type
        assert bool(distribution.support.check(draw.detach()).all())
        weights = torch.linspace(-1.0, 1.0, draw.shape[-1], device=device, dtype=draw.dtype)
        rsample_grads = torch.autograd.grad((draw * weights).sum(), leaves, allow_unused=True)
        for grad in rsample_grads:
            assert grad is None or bool(torch.isfinite(grad).all())
    as_numpy = {name: output.detach().cpu().numpy() for name, output in outputs.items()}
    return as_numpy, value_on_cpu


@pytest.mark.parametrize("device", [_torch_cuda_param()])
@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_torch_accelerator_matches_cpu(case: Case, device: str):
    on_cpu, value = _torch_outputs(case, "cpu")
    on_device, _ = _torch_outputs(case, device, value)
    _assert_same(on_device, on_cpu, case)


# ---------------------------------------------------------------------------------------
# JAX


def _jax_accelerator():
    import jax

    try:
        devices = jax.devices("gpu")
    except RuntimeError:  # a CPU-only jaxlib has no GPU backend
        return None
    return devices[0] if devices else None


def _jax_gpu_param():
    return pytest.param(
        "gpu",
        marks=pytest.mark.skipif(_jax_accelerator() is None, reason="no JAX GPU backend"),
    )


def _jax_outputs(case: Case, device, value_on_cpu=None):
    import jax
    import jax.numpy as jnp

    from numpyro_constrained import (
        ConditionedPoisson,
        ExactlyKBernoulli,
        LinearConstrainedNormal,
    )

    classes = {EKB: ExactlyKBernoulli, LCN: LinearConstrainedNormal, CP: ConditionedPoisson}
    raw = case.params()
    float_names = [name for name, value in raw.items() if _is_float(value)]
    with jax.default_device(device):
        arrays = {
            name: jax.device_put(jnp.asarray(value), device)
            if isinstance(value, np.ndarray)
            else value
            for name, value in raw.items()
        }

        def make(floats):
            return classes[case.cls](**{**arrays, **floats})

        floats = {name: arrays[name] for name in float_names}
        distribution = make(floats)
        if value_on_cpu is None:
            value_on_cpu = np.asarray(distribution.sample(jax.random.PRNGKey(0), (2,)))
        value = jax.device_put(jnp.asarray(value_on_cpu), device)

        def objective(floats):
            d = make(floats)
            return d.log_prob(value).sum() + d.entropy().sum()

        outputs = {
            "log_prob": distribution.log_prob(value),
            "entropy": distribution.entropy(),
            "mean": distribution.mean,
        }
        grads = jax.grad(objective)(floats)
        outputs.update({f"grad {name}": grad for name, grad in grads.items()})
        for output in outputs.values():
            assert output.devices() == {device}

        sample = distribution.sample(jax.random.PRNGKey(1), (3,))
        assert sample.devices() == {device}
        assert sample.shape == (3,) + case.batch_shape + case.event_shape
        assert bool(distribution.support(sample).all())
        if distribution.has_rsample:
            weights = jnp.linspace(-1.0, 1.0, case.n)

            def drawn(floats):
                return (make(floats).rsample(jax.random.PRNGKey(2)) * weights).sum()

            rsample_grads = jax.grad(drawn)(floats)
            assert all(bool(jnp.isfinite(g).all()) for g in rsample_grads.values())
    as_numpy = {name: np.asarray(output) for name, output in outputs.items()}
    return as_numpy, value_on_cpu


@pytest.mark.parametrize("platform", [_jax_gpu_param()])
@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_jax_accelerator_matches_cpu(case: Case, platform: str):
    import jax

    on_cpu, value = _jax_outputs(case, jax.devices("cpu")[0])
    on_device, _ = _jax_outputs(case, _jax_accelerator(), value)
    _assert_same(on_device, on_cpu, case)
