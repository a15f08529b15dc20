"""The structure of a JAX program, for tests that read it (which primitives it runs, with
what parameters). No JAX import here: the test modules that use it import JAX themselves."""


def jaxprs_within(jaxpr):
    """``jaxpr`` and every jaxpr nested in its equations (jit, custom rules, control flow)."""
    yield jaxpr
    for equation in jaxpr.eqns:
        for parameter in equation.params.values():
            for item in parameter if isinstance(parameter, (tuple, list)) else (parameter,):
                inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr holds a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from jaxprs_within(inner)


def count_primitive(jaxpr, name: str) -> int:
    """How many equations of primitive ``name`` ``jaxpr`` holds, nested jaxprs included."""
    return sum(eq.primitive.name == name for inner in jaxprs_within(jaxpr) for eq in inner.eqns)
