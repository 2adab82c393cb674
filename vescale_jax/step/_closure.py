"""Closure conversion that hoists every traced value a function closes over, whatever its dtype.

:func:`vj.scan_layers` runs its layer body inside a ``jax.custom_vjp`` whose forward and backward are traced
later, in other scopes (the loops of the forward and of the backward). Every traced value the body closes over
must therefore enter that function as an explicit argument. ``jax.closure_convert`` hoists only the values that
may carry a tangent (floating-point ones): an integer, boolean or PRNG-key array closed over (token or segment
ids, ``vj.positions``, a mask, a key) stayed inside the converted function as a tracer of the trace that made it
and escaped it (``UnexpectedTracerError``). :func:`hoist_closure` hoists them all; the caller differentiates the
floating-point ones only (the others have ``float0`` cotangents: constants of the derivative).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from vescale_jax._compat import is_tracer
from vescale_jax.step._jaxpr import evaluate, read

__all__ = ["hoist_closure"]


def hoist_closure(fn: Callable[..., Any], *example: Any) -> tuple[Callable[..., Any], list[Any]]:
    """``fn`` as a function of its arguments and of every traced value it closes over.

    Args:
      fn: the function, called as ``fn(*example)``.
      *example: example arguments (pytrees); later calls take arguments of the same structure and types.

    Returns:
      ``(converted, consts)``: ``converted(*args, *consts) == fn(*args)``, ``consts`` the traced values (of any
      dtype: floats, integers, booleans, PRNG keys) ``fn`` closes over, in the order of its trace. Concrete
      values it closes over stay inside ``converted``. ``fn`` is traced once, here.
    """
    flat, in_tree = jax.tree.flatten(example)
    closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(in_tree, xs)), return_shape=True)(*flat)
    jaxpr, out_tree = closed.jaxpr, jax.tree.structure(out_shape)
    hoisted = [is_tracer(c) for c in closed.consts]
    kept = {v: c for v, c, h in zip(jaxpr.constvars, closed.consts, hoisted, strict=True) if not h}
    hoisted_vars = [v for v, h in zip(jaxpr.constvars, hoisted, strict=True) if h]
    num_args = len(flat)

    def converted(*args_and_consts: Any) -> Any:
        args, consts = args_and_consts[: len(example)], args_and_consts[len(example) :]
        leaves, tree = jax.tree.flatten(args)
        if tree != in_tree or len(leaves) != num_args:
            raise TypeError(f"hoist_closure: arguments structured as {tree}, traced as {in_tree}")
        env = dict(kept)
        env.update(zip(hoisted_vars, consts, strict=True))
        env.update(zip(jaxpr.invars, leaves, strict=True))
        env = evaluate(jaxpr.eqns, env)
        return jax.tree.unflatten(out_tree, [read(env, v) for v in jaxpr.outvars])

    return converted, [c for c, h in zip(closed.consts, hoisted, strict=True) if h]
