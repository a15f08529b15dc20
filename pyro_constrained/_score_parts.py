"""Pyro's ELBO parts of a straight-through site (ExactlyKBernoulli, CountConstrainedBernoulli,
ConditionedPoisson), whose classes are both reparameterised (``has_rsample``) and
enumerable (``has_enumerate_support``)."""

from pyro.distributions import TorchDistribution


def score_parts(self, value, *args, **kwargs):
    """Pyro's ``ScoreParts`` of ``value``: pathwise (no score-function term) for a value that
    carries the straight-through gradient, as ``rsample`` returns it; scored (the score
    function ``log q(value)``) for any other value of a reparameterised site.

    Pyro decides from ``has_rsample`` alone, which is right for its reparameterised
    distributions, none of which enumerates. Here an enumerated guide site
    (``TraceEnum_ELBO`` with ``config_enumerate``) takes its values from
    ``enumerate_support``, not from ``rsample``, and Pyro weights each enumerated value by
    ``exp(score_function)``: a zero score function would weight every value of the support
    equally. A value without gradient has no pathwise term to give, so the score function is
    also the unbiased estimator for it wherever else it occurs (a draw whose parameters are
    constants contributes no gradient either way)."""
    parts = TorchDistribution.score_parts(self, value, *args, **kwargs)
    if self.has_rsample and not value.requires_grad:
        return parts._replace(score_function=parts.log_prob, entropy_term=0)
    return parts
