"""Every entry of ``pyro_constrained._compat`` checked against the installed torch and Pyro,
and no private torch or Pyro name in ``pyro_constrained`` outside that module.

The one entry (the AutoGuide whose setup asks for a subspace's bijection) is checked by
``test_autoguide_without_reparam_when_k_moves_is_refused_at_setup`` in
``tests/test_reparam_pyro.py``, which runs each AutoGuide kind on a moving subspace and
fails, saying what to update, when Pyro builds its bijections elsewhere. Everything else is
reached through public APIs (``LinearConstrainedNormal``: ``save_for_backward`` /
``setup_context`` for its autograd Function, which ``torch.func`` then runs, ``torch.randn``,
torch's own argument validation, a bijection without tags on its values).
"""

import math
import pathlib

import pytest
import torch
from torch.distributions import Distribution

import pyro_constrained
from tests._private_names import private_framework_names

PACKAGE = pathlib.Path(pyro_constrained.__file__).parent
FRAMEWORKS = ("torch", "pyro", "sys")
# Private names still used outside _compat, each waiting for its issue-34 item in a module
# that another change owns: this set only shrinks (the test fails when an entry disappears
# too, so that it is removed here).
PENDING: set = set()


def test_no_private_framework_name_outside_compat():
    found = set()
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name != "_compat.py":
            found |= private_framework_names(path, FRAMEWORKS)
    assert found <= PENDING, (
        "private framework names outside pyro_constrained/_compat.py (use a public API, or "
        f"move the use into _compat with a test here): {sorted(found - PENDING)}"
    )
    assert PENDING <= found, f"no longer used, remove from PENDING: {sorted(PENDING - found)}"


def test_the_private_name_check_finds_private_names(tmp_path):
    """The check above can fail: it finds each kind of private use it looks for."""
    source = tmp_path / "example.py"
    source.write_text(
        "import torch\n"
        "import pyro.distributions as pd\n"
        "from torch.distributions import constraints\n"
        "from torch.distributions.utils import _standard_normal\n"
        "active = torch._C._functorch.peek_interpreter_stack()\n"
        "class S(constraints._Real): pass\n"
        "x = pd.torch_distribution._Foo\n"
        "y = '' if active else constraints.real  # constraints._Real in a comment\n"
    )
    assert {name for _, name in private_framework_names(source, FRAMEWORKS)} == {
        "torch.distributions.utils._standard_normal",
        "torch._C",
        "torch._C._functorch",
        "torch._C._functorch.peek_interpreter_stack",
        "torch.distributions.constraints._Real",
        "pyro.distributions.torch_distribution._Foo",
    }


# (class, arguments that only a validating constructor rejects, the message it gives)
_CHECKED_IN_CONSTRUCTOR = [
    (pyro_constrained.ExactlyKBernoulli, {"logits": torch.zeros(4), "k": 5}, "k must be in"),
    (
        pyro_constrained.CountConstrainedBernoulli,
        {"logits": torch.zeros(4), "low": 3, "high": 2},
        "0 <= low <= high",
    ),
]


@pytest.mark.parametrize("cls,kwargs,message", _CHECKED_IN_CONSTRUCTOR)
@pytest.mark.parametrize("default", [True, False])
@pytest.mark.parametrize("validate_args", [None, True, False])
def test_constructor_checks_follow_torch_default_validate_args(
    cls, kwargs, message, default, validate_args
):
    """The constructors that check their arguments before ``Distribution.__init__`` resolve
    ``validate_args`` as torch does: an explicit value wins, else the default that torch's
    public ``Distribution.set_default_validate_args`` sets (set here directly, not through
    ``pyro.enable_validation``, whose own flag then disagrees)."""
    Distribution.set_default_validate_args(default)
    try:
        validates = default if validate_args is None else validate_args
        if validates:
            with pytest.raises(ValueError, match=message):
                cls(**kwargs, validate_args=validate_args)
        else:
            d = cls(**kwargs, validate_args=validate_args)
            assert d.log_prob(torch.tensor([1.0, 1.0, 1.0, 0.0])).item() == -math.inf
    finally:
        Distribution.set_default_validate_args(True)


@pytest.mark.parametrize("mask", [False, True, "tensor"])
def test_mask_of_reads_the_mask_that_log_prob_applies(mask):
    """``_compat.mask_of``: the mask a ``MaskedDistribution`` applies in ``log_prob`` (the
    attribute it reads is Pyro's private one; this fails if Pyro moves it)."""
    import pyro.distributions as dist

    from pyro_constrained._compat import mask_of

    mask = torch.tensor([True, False, True]) if isinstance(mask, str) else mask
    base = dist.Normal(torch.zeros(3), 1.0)
    masked = base.mask(mask)
    value = torch.tensor([0.5, -1.0, 2.0])
    expected = torch.where(torch.as_tensor(mask), base.log_prob(value), 0.0)
    assert torch.equal(masked.log_prob(value), expected)
    got = torch.as_tensor(mask_of(masked)).expand(3)
    assert torch.equal(got, torch.as_tensor(mask).expand(3))
