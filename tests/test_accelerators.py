"""The three classes on an accelerator give the CPU's numbers (issue 18, item 5).

For every setting of ``tests/conformance_cases.py`` (each class, batched and not, every
covariance form, float32 and float64), a distribution built from arrays on the accelerator
(torch: CUDA; JAX: its GPU backend) is compared with the same distribution on the CPU:
``log_prob`` of a CPU sample, ``mean``, ``entropy`` and the gradients of ``log_prob +
entropy`` with respect to the floating-point parameters agree to a tolerance of the dtype;
every output stays on the accelerator; samples and ``rsample``s drawn there have the right
shape, lie in the support, and (rsample) carry a finite gradient.

Skipped where no accelerator is present (this project's CI machine has none); with one,
``python -m pytest tests/test_accelerators.py`` runs them. A ``slow`` variant runs the same
comparison with the CPU standing in for the accelerator, so that CI checks the harness
itself (every class of the conformance cases goes through it).

Two GPU-only defects have CPU-run checks here, on the programs of every conformance case:
under ``torch.jit.trace`` a size is a CPU tensor, which a CUDA ``clamp`` refuses as its only
bound (``test_traced_clamp_bounds_are_scalars``); and XLA computes float32 products at
``Precision.DEFAULT`` in TensorFloat-32 on NVIDIA GPUs, too coarse for ``A z = k``
(``test_jax_products_ask_for_highest_precision``).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conformance_cases import ALL_CASES, Case
from tests.jaxprs import jaxprs_within

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


# The CPU standing in for the accelerator checks the harness on the first case of each
# class (every case runs on an accelerator where there is one).
_STAND_IN_CASES = list({case.cls: case for case in reversed(ALL_CASES)}.values())


def _accelerator_and_stand_in(accelerator_param):
    """(case, device) parameters: every case on the accelerator (skipped without one), and
    the stand-in cases on the CPU (slow)."""
    (device,) = accelerator_param.values
    on_accelerator = [
        pytest.param(case, device, marks=accelerator_param.marks, id=f"{case}-{device}")
        for case in ALL_CASES
    ]
    standing_in = [
        pytest.param(case, "cpu", marks=pytest.mark.slow, id=f"{case}-cpu-standing-in")
        for case in _STAND_IN_CASES
    ]
    return on_accelerator + standing_in


def _float_tensors(case: Case, device: str) -> tuple[dict, dict]:
    """(the floating-point constructor arguments as leaf tensors, the others as tensors or
    Python values), on ``device``."""
    import torch

    floats, others = {}, {}
    for name, value in case.params().items():
        if _is_float(value):
            floats[name] = torch.tensor(value, device=device, requires_grad=True)
        elif isinstance(value, np.ndarray):
            others[name] = torch.tensor(value, device=device)
        else:
            others[name] = value
    return floats, others


def _torch_outputs(case: Case, device: str, value_on_cpu=None):
    """(outputs as NumPy arrays, a CPU sample for log_prob) of ``case`` built on ``device``."""
    import torch

    import pyro_constrained

    floats, others = _float_tensors(case, device)
    leaves = list(floats.values())
    distribution = getattr(pyro_constrained, case.cls)(**floats, **others)
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


@pytest.mark.parametrize(("case", "device"), _accelerator_and_stand_in(_torch_cuda_param()))
def test_torch_accelerator_matches_cpu(case: Case, device: str):
    on_cpu, value = _torch_outputs(case, "cpu")
    on_device, _ = _torch_outputs(case, device, value)
    _assert_same(on_device, on_cpu, case)


def _torch_quantities(distribution, value) -> dict:
    quantities = {
        "log_prob": lambda: distribution.log_prob(value),
        "entropy": distribution.entropy,
        "mean": lambda: distribution.mean,
        "variance": lambda: distribution.variance,
        "mode": lambda: distribution.mode,
    }
    if distribution.has_rsample:
        quantities["rsample"] = distribution.rsample
    return quantities


def _traced_quantities(case: Case, device: str):
    """(name, traced program, its floating-point inputs, the eager program) for each
    quantity of ``case`` built on ``device``, traced at the case's parameters."""
    import warnings

    import torch

    import pyro_constrained

    cls = getattr(pyro_constrained, case.cls)
    floats, others = _float_tensors(case, device)
    floats = {name: tensor.detach() for name, tensor in floats.items()}
    torch.manual_seed(0)
    value = cls(**floats, **others).sample()

    for name in _torch_quantities(cls(**floats, **others), value):

        def program(*inputs, name=name):
            parameters = dict(zip(floats, inputs, strict=True))
            distribution = cls(**parameters, **others, validate_args=False)
            return _torch_quantities(distribution, value)[name]()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            traced = torch.jit.trace(program, tuple(floats.values()), check_trace=False)
        yield name, traced, tuple(floats.values()), program


_FACTORIES = {"arange", "empty", "eye", "full", "linspace", "ones", "rand", "randint", "randn"}
_FACTORIES |= {"randperm", "tensor", "zeros"}


def test_torch_factories_name_their_device():
    # A factory call without device= allocates on torch's default device, not on the
    # parameters': on a GPU, PoissonBinomial's log_pmf (so its entropy, mode and tail
    # functions) mixed CPU and CUDA tensors and raised (seen on an H100). The showcase
    # module is example code run on the CPU; torch.as_tensor converts a user's input.
    import ast
    from pathlib import Path

    import pyro_constrained

    missing = []
    for path in sorted(Path(pyro_constrained.__file__).parent.glob("*.py")):
        if path.name == "showcase.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and node.func.attr in _FACTORIES
                and not any(keyword.arg == "device" for keyword in node.keywords)
            ):
                missing.append(f"{path.name}:{node.lineno} torch.{node.func.attr}")
    assert not missing, missing


def _tensor_bound_clamps(block) -> list[str]:
    """The ``clamp`` nodes of a traced graph (and its sub-blocks) with a 0-dim tensor
    bound: a traced size, a CPU tensor that a CUDA ``clamp`` refuses."""
    found = []
    for node in block.nodes():
        for sub_block in node.blocks():
            found += _tensor_bound_clamps(sub_block)
        if node.kind() in ("aten::clamp", "aten::clamp_min", "aten::clamp_max", "aten::clip"):
            for bound in list(node.inputs())[1:]:
                kind = bound.type()
                if kind.kind() == "TensorType" and kind.dim() == 0:
                    found.append(str(node).strip())
    return found


@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_traced_clamp_bounds_are_scalars(case: Case):
    # Before the fix: ConditionedPoisson's mode traced on CUDA raised "Expected all tensors to
    # be on the same device, but got max is on cpu" (seen on an H100).
    for name, traced, _, _ in _traced_quantities(case, "cpu"):
        assert not _tensor_bound_clamps(traced.graph), (name, _tensor_bound_clamps(traced.graph))


@pytest.mark.parametrize("device", [_torch_cuda_param(), "cpu"])
@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_torch_traced_programs_replay_their_eager_values(case: Case, device: str):
    # Before the fix, LinearConstrainedNormal's float64 log_prob and entropy replayed 3e-8
    # off: its size-dependent constants had become float32 tensors in the trace.
    import torch

    for name, traced, inputs, program in _traced_quantities(case, device):
        replayed, eager = traced(*inputs), program(*inputs)
        assert replayed.device.type == torch.device(device).type, name
        if name != "rsample":  # a fresh draw each call
            torch.testing.assert_close(replayed, eager, msg=name, **TOLERANCES[case.dtype])


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

    import numpyro_constrained

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
            return getattr(numpyro_constrained, case.cls)(**{**arrays, **floats})

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


@pytest.mark.parametrize(("case", "platform"), _accelerator_and_stand_in(_jax_gpu_param()))
def test_jax_accelerator_matches_cpu(case: Case, platform: str):
    import jax

    on_cpu, value = _jax_outputs(case, jax.devices("cpu")[0])
    on_device, _ = _jax_outputs(case, jax.devices(platform)[0], value)
    _assert_same(on_device, on_cpu, case)


@pytest.mark.parametrize("case", ALL_CASES, ids=str)
def test_jax_products_ask_for_highest_precision(case: Case):
    # On an H100, float32 LinearConstrainedNormal samples missed A z = k by 5e-4 relative
    # (TensorFloat-32 products) and failed their own support check.
    import jax
    import jax.numpy as jnp
    from jax import lax

    import numpyro_constrained

    cls = getattr(numpyro_constrained, case.cls)
    raw = case.params()
    floats = {name: jnp.asarray(value) for name, value in raw.items() if _is_float(value)}
    others = {name: value for name, value in raw.items() if name not in floats}

    def quantities(floats):  # traced only: nothing is compiled or run
        distribution = cls(**floats, **others)
        value = distribution.sample(jax.random.PRNGKey(1))
        out = [value, distribution.log_prob(value), distribution.entropy(), distribution.mean]
        out.append(distribution.variance)
        if distribution.has_rsample:
            out.append(distribution.rsample(jax.random.PRNGKey(2)))
        return out

    # The library's own products only: the derivative rules of JAX's QR multiply at JAX's
    # default precision (docs/numerics.md says how to raise it).
    highest = (lax.Precision.HIGHEST, lax.Precision.HIGHEST)
    for jaxpr in jaxprs_within(jax.make_jaxpr(quantities)(floats).jaxpr):
        for equation in jaxpr.eqns:
            if equation.primitive.name == "dot_general":
                assert equation.params["precision"] == highest, str(equation)[:300]
