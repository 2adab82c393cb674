"""Small pieces for evaluating and reading jaxprs, shared by the modules that re-run a traced model.

``vj.apply`` cuts the model into segments by parameter reads, ``scan_layers`` cuts a layer in two, the
backward ties constant buffers to its cotangent, and low-precision leaves are widened: each re-evaluates a
jaxpr equation by equation and reads which equations touch which variables. These are the common steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vescale_jax._compat import bind_equation, is_literal, is_view

__all__ = ["bucket_reads", "evaluate", "last_reads", "read"]


def read(env: dict[Any, Any], v: Any) -> Any:
    """The value of jaxpr variable or literal ``v`` in ``env``."""
    return v.val if is_literal(v) else env[v]


def evaluate(eqns: Iterable[Any], env: dict[Any, Any]) -> dict[Any, Any]:
    """Binds ``eqns`` in order, reading and extending ``env`` (returned)."""
    for eqn in eqns:
        env.update(zip(eqn.outvars, bind_equation(eqn, [read(env, v) for v in eqn.invars]), strict=True))
    return env


def last_reads(jaxpr: Any) -> dict[Any, int]:
    """Per variable, the index of the last equation reading it (``len(eqns)`` for an output)."""
    out: dict[Any, int] = {}
    for k, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not is_literal(v):
                out[v] = k
    for v in jaxpr.outvars:
        if not is_literal(v):
            out[v] = len(jaxpr.eqns)
    return out


def bucket_reads(jaxpr: Any, leaf_bucket: dict[Any, int]) -> tuple[list[set[int]], dict[Any, int]]:
    """Per equation, the buckets whose leaves it reads (``leaf_bucket``: leaf variable -> bucket), where a copy or
    view of a leaf (:func:`vescale_jax._compat.is_view`: a cast, reshape, transpose, broadcast, slice) stands for
    the leaf; and the map of every such variable to its bucket."""
    like = dict(leaf_bucket)
    reads = []
    for eqn in jaxpr.eqns:
        reads.append({like[v] for v in eqn.invars if not is_literal(v) and v in like})
        src = eqn.invars[0] if eqn.invars else None
        if is_view(eqn) and not is_literal(src) and src in like:
            like.update((v, like[src]) for v in eqn.outvars)
    return reads, like
