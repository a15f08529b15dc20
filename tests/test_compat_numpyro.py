"""Every entry of ``numpyro_constrained._compat`` checked against the installed NumPyro: each
test fails with a message saying what in ``_compat`` to update when the framework behaviour
it relies on changes; and the rule that no private framework name is used outside it."""

import importlib
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer import MCMC, NUTS, DiscreteHMCGibbs

from numpyro_constrained import (
    ConditionedPoisson,
    ExactlyKBernoulli,
    LinearConstrainedNormal,
    _compat,
)
from tests._private_names import private_framework_names

PACKAGE = pathlib.Path(_compat.__file__).parent
UPDATE = (
    "NumPyro {version} changed the behaviour that numpyro_constrained._compat."
    "SCALAR_COORDINATE_CONSUMERS relies on: {what}. Update that table (the module and "
    "function names of NumPyro's callers of enumerate_support that enumerate scalar "
    "coordinates) so that the guard fires again."
)


def _consumers(module_name, function_name):
    """The functions of that name in that module: itself, or methods of its classes (funsor's
    ``process_message``); none when the module or the name is gone."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    if hasattr(module, function_name):
        return [getattr(module, function_name)]
    return [
        vars(cls)[function_name]
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if cls.__module__ == module_name and function_name in vars(cls)
    ]


def test_the_scalar_coordinate_consumers_still_exist_and_enumerate():
    """At least one Gibbs entry and the funsor entry name a function of the installed
    NumPyro that calls ``enumerate_support`` itself (the guard looks for that frame)."""
    found = {}
    for (module_name, function_name), reason in _compat.SCALAR_COORDINATE_CONSUMERS.items():
        functions = _consumers(module_name, function_name)
        if any("enumerate_support" in inspect.getsource(f) for f in functions):
            found.setdefault(reason, []).append(f"{module_name}.{function_name}")
    for reason, label in (
        (_compat._GIBBS, "DiscreteHMCGibbs / MixedHMC"),
        (_compat._FUNSOR, "funsor"),
    ):
        assert reason in found, UPDATE.format(
            version=numpyro.__version__,
            what=f"no listed {label} function exists and calls enumerate_support",
        )


def _gibbs_model(prior):
    def model():
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        z = numpyro.sample("z", prior)
        numpyro.sample("y", dist.Normal(mu + z, 1.0).to_event(1), obs=jnp.ones(prior.event_shape))

    return model


PRIORS = {
    "ekb": lambda: ExactlyKBernoulli(jnp.array([-1.0, 0.5, 0.0]), k=2),
    "cp": lambda: ConditionedPoisson(jnp.array([1.0, 2.0, 1.5]), k=3),
}


@pytest.mark.filterwarnings("ignore:Some algorithms will automatically enumerate")
def test_the_guard_fires_in_discrete_hmc_gibbs():
    """A real (one-step) DiscreteHMCGibbs run; tests/test_enumeration_numpyro.py runs both
    classes under every scalar-coordinate sampler."""
    mcmc = MCMC(
        DiscreteHMCGibbs(NUTS(_gibbs_model(PRIORS["ekb"]()))),
        num_warmup=1,
        num_samples=1,
        progress_bar=False,
    )
    try:
        mcmc.run(jax.random.PRNGKey(0))
    except ValueError as error:
        assert "Categorical" in str(error), error
    else:
        pytest.fail(
            UPDATE.format(
                version=numpyro.__version__,
                what="DiscreteHMCGibbs ran on a k-hot / composition site without the guard's "
                "ValueError",
            )
        )


@pytest.mark.parametrize("name", list(PRIORS))
def test_the_guard_fires_in_funsor_enumeration(name):
    pytest.importorskip("funsor")
    from numpyro.contrib.funsor import config_enumerate, enum

    model = config_enumerate(_gibbs_model(PRIORS[name]()))
    try:
        with numpyro.handlers.seed(rng_seed=0):
            numpyro.handlers.trace(enum(model, first_available_dim=-1)).get_trace()
    except ValueError as error:
        assert "Categorical" in str(error), error
    else:
        pytest.fail(
            UPDATE.format(
                version=numpyro.__version__,
                what="numpyro.contrib.funsor's enum enumerated a k-hot / composition site "
                "without the guard's ValueError",
            )
        )


def test_the_guard_is_silent_for_direct_calls():
    """A user's own ``enumerate_support`` call is not refused."""
    assert PRIORS["ekb"]().enumerate_support().shape == (3, 3)


@pytest.mark.parametrize("enabled", [True, False])
def test_default_validate_args_follows_enable_validation(enabled):
    from numpyro.distributions import Distribution

    before = Distribution(validate_args=None)._validate_args
    numpyro.enable_validation(enabled)
    try:
        assert _compat.default_validate_args() is enabled, (
            f"NumPyro {numpyro.__version__} no longer keeps the default of validate_args in "
            "Distribution._validate_args: update numpyro_constrained._compat."
            "default_validate_args to read it where numpyro.enable_validation now puts it"
        )
        # The constructor that relies on it: an invalid k is refused only when validating.
        make = lambda: LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=jnp.nan)  # noqa: E731
        if enabled:
            with pytest.raises(ValueError):
                make()
        else:
            make()
    finally:
        numpyro.enable_validation(bool(before))


FRAMEWORKS = ("jax", "numpyro", "funsor", "sys")
# Private names still used outside _compat, each waiting for its issue-34 item: this set
# only shrinks (the test fails when an entry disappears too, so that it is removed here).
PENDING = set()


def _private_framework_names(path):
    return private_framework_names(path, FRAMEWORKS)


def _moving_support_model():
    """``z ~ LinearConstrainedNormal`` on ``z1 + z2 + z3 = 3 t``, with ``t`` a latent."""

    def model():
        t = numpyro.sample("t", dist.Normal(0.0, 1.0))
        numpyro.sample("z", LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=3.0 * t))

    return model


def test_numpyro_replays_the_model_for_a_dynamic_support():
    """What ``_compat.DynamicSupport`` is for: the public ``initialize_model``'s
    ``postprocess_fn`` (behind ``MCMC.get_samples``) maps a draw of ``t`` and ``z``'s
    unconstrained coordinates onto the subspace of that ``t``, not of the initial trace's."""
    from numpyro.infer.util import initialize_model

    info = initialize_model(jax.random.PRNGKey(0), _moving_support_model())
    draw = dict(info.param_info.z)
    draw["t"] = draw["t"] + 1.5  # t is unconstrained (real): this t is the new value
    constrained = info.postprocess_fn(draw)
    residual = float(jnp.sum(constrained["z"]) - 3.0 * constrained["t"])
    assert abs(residual) < 1e-9, (
        f"NumPyro {numpyro.__version__} no longer replays the model for a support derived "
        "from numpyro_constrained._compat.DynamicSupport (numpyro.infer.util."
        "_transforms_from_trace's dynamic_support flag): MCMC draws of a "
        "LinearConstrainedNormal site whose A or k depends on a latent land on the initial "
        f"subspace (residual {residual}). Update DynamicSupport's base class to what NumPyro "
        "now recognises as a dynamic support."
    )


def test_the_subspace_support_inherits_no_interval_rule():
    """``AffineSubspace`` derives from NumPyro's interval constraint only to be recognised
    as dynamic (above): every method the interval class defines is its own."""
    from numpyro_constrained.linear_constrained_normal import AffineSubspace

    bookkeeping = {"__module__", "__doc__", "__dict__", "__weakref__", "__parameters__"}
    bookkeeping |= {"__orig_bases__", "__annotations__", "__firstlineno__"}
    bookkeeping |= {"__static_attributes__", "__qualname__"}
    interval_rules = set(vars(dist.constraints.interval)) - bookkeeping
    own = set(vars(AffineSubspace)) | set(vars(_compat.DynamicSupport))
    assert interval_rules <= own, (
        f"NumPyro {numpyro.__version__}'s interval constraint defines "
        f"{sorted(interval_rules - own)}, which AffineSubspace would inherit through "
        "numpyro_constrained._compat.DynamicSupport: define them in AffineSubspace "
        "(numpyro_constrained/_lcn_support.py)."
    )
    support = LinearConstrainedNormal(jnp.zeros(3), jnp.ones(3), k=1.0).support
    assert isinstance(support, dist.constraints.interval)
    assert bool(support(jnp.array([1.0, 0.0, 0.0]))) and not bool(support(jnp.ones(3)))


def test_no_private_framework_name_outside_compat():
    found = set()
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name != "_compat.py":
            found |= _private_framework_names(path)
    assert found <= PENDING, (
        "private framework names outside numpyro_constrained/_compat.py (use a public API, or "
        f"move the use into _compat with a test here): {sorted(found - PENDING)}"
    )
    assert PENDING <= found, f"no longer used, remove from PENDING: {sorted(PENDING - found)}"


def test_the_private_name_check_finds_private_names(tmp_path):
    """The check above can fail: it finds each kind of private use it looks for."""
    source = tmp_path / "example.py"
    source.write_text(
        "import sys\n"
        "import numpyro.distributions as nd\n"
        "from numpyro.distributions import constraints\n"
        "from numpyro.distributions.batch_util import _default_vmap_over\n"
        "frame = sys._getframe(1)\n"
        "class S(constraints._Interval): pass\n"
        "x = nd.constraints._IndependentConstraint\n"
        "y = '' if frame else constraints.real  # constraints._Real in a comment\n"
    )
    assert {name for _, name in _private_framework_names(source)} == {
        "numpyro.distributions.batch_util._default_vmap_over",
        "sys._getframe",
        "numpyro.distributions.constraints._Interval",
        "numpyro.distributions.constraints._IndependentConstraint",
    }


@pytest.mark.parametrize(
    "guide_name", ["AutoNormal", "AutoDelta", "AutoDiagonalNormal", "AutoMultivariateNormal"]
)
def test_an_autoguide_on_a_moving_subspace_is_refused_at_setup(guide_name):
    """What ``_compat.autoguide_being_set_up`` is for: an AutoGuide set up on a model whose
    subspace moves (k = 3 t, t latent) raises the ValueError naming the reparam at
    ``SVI.init``. Without it (before the check, or when NumPyro builds the bijections
    elsewhere) ``SVI.init`` passes and every loss is inf."""
    from numpyro.infer import SVI, Trace_ELBO, autoguide

    model = _moving_support_model()
    guide = getattr(autoguide, guide_name)(model)
    svi = SVI(model, guide, numpyro.optim.Adam(0.01), Trace_ELBO())
    try:
        svi.init(jax.random.PRNGKey(0))
    except ValueError as error:
        message = str(error)
        assert "numpyro_constrained.LinearConstrainedNormalReparam" in message, message
        assert f"{guide_name}: the support of the LinearConstrainedNormal site(s) 'z' " in message
        assert "(with 't')" in message, message
    else:
        pytest.fail(
            f"NumPyro {numpyro.__version__}'s {guide_name} set itself up on a moving "
            "subspace without the ValueError naming the reparam: its AutoGuides no longer "
            f"build their bijections inside a method named {_compat.AUTOGUIDE_SETUP!r} (see "
            "numpyro_constrained._compat.autoguide_being_set_up): update that name, or the "
            "frame test, to where NumPyro's AutoGuides now call biject_to."
        )


def test_the_scoped_x64_switch_exists_and_is_scoped():
    """``_compat.enable_x64`` finds JAX's scoped switch under either of its names; if JAX
    drops both, update ``numpyro_constrained/_compat.py`` (the every-count
    ``PoissonBinomial.log_pmf`` builds its tables in float64 with it)."""
    import jax

    outside = jax.config.jax_enable_x64
    for wanted in (True, False):
        with _compat.enable_x64(wanted):
            assert jax.config.jax_enable_x64 is wanted, (
                "numpyro_constrained/_compat.enable_x64 no longer switches JAX's x64 mode: "
                "update it to this JAX's scoped switch"
            )
            assert jnp.asarray(1.0).dtype == (jnp.float64 if wanted else jnp.float32)
        assert jax.config.jax_enable_x64 is outside


@pytest.mark.parametrize("mask", [False, "array"])
def test_mask_of_reads_the_mask_that_log_prob_applies(mask):
    """``_compat.mask_of``: the mask a ``MaskedDistribution`` applies in ``log_prob`` (the
    attribute it reads is NumPyro's private one; this fails if NumPyro moves it). A mask of
    True returns the distribution itself, unwrapped."""
    from numpyro_constrained._compat import mask_of

    mask = jnp.array([True, False, True]) if isinstance(mask, str) else mask
    base = dist.Normal(jnp.zeros(3), 1.0)
    assert base.mask(True) is base
    masked = base.mask(mask)
    value = jnp.array([0.5, -1.0, 2.0])
    expected = jnp.where(mask, base.log_prob(value), 0.0)
    assert jnp.array_equal(masked.log_prob(value), expected)
    assert jnp.array_equal(jnp.broadcast_to(mask_of(masked), (3,)), jnp.broadcast_to(mask, (3,)))
