"""A scanned layer's keys and values, gathered over the context axis in forward, kept for its backward.

:func:`vescale_jax.scan_layers` saves only each layer's input carry and recomputes the layer in backward. Under
context parallelism the layer's ``vj.attention`` all-gathers K and V over the context axis; recomputed, it would
gather them a second time: one all-gather in forward, one in the recomputation and one reduce-scatter of their
gradients, 1.5x the traffic of gathering once. :func:`keep_context_gathers` instead records, in forward, the
result of every tiled all-gather over the context axis in the layer (K, V, and the keys' segment ids of packed
documents) as a residual of that layer; the backward's recomputation takes the kept values in their place, and the
gradient of each flows back to the layer's local keys and values through the gather's own transpose (a
reduce-scatter over the context axis). The cost is memory: per layer, the gathered K and V of this device's
sequences (``2 x batch x seq x kv_heads x head_dim`` elements per device), held from the layer's forward to its
backward. ``vj.fsdp(context_kv="regather")`` gathers them again instead.

The layer is read as a jaxpr (traced once on example arguments, nested ``jit`` calls entered); gathers inside
other nested bodies (a ``jax.checkpoint`` inside the layer, a loop) are left as they are, gathered again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._compat import is_nested_call, nested_call_jaxpr, rerun_nested, tiled_gather_over
from vescale_jax.step._jaxpr import read
from vescale_jax.step._random import bind_tolerant, run_tolerant
from vescale_jax.step._wire import varying_axes, varying_like

__all__ = ["KV_CHOICES", "KeptGathers", "keep_context_gathers"]

KV_CHOICES = ("keep", "regather")
"""``vj.fsdp(context_kv=)``: ``"keep"`` (the default) keeps each layer's gathered K and V for its backward;
``"regather"`` gathers them again when the backward recomputes the layer."""


@dataclasses.dataclass(frozen=True)
class KeptGathers:
    """A layer ``out = fn(*args)`` whose context-axis gathers are recorded in forward and replayed in backward.

    Attributes:
      record: ``(*args) -> (out, kept)``: the layer, and the result of each of its context-axis gathers.
      replay: ``(kept, *args) -> out``: the layer with each gather's result taken from ``kept``; its derivative
        with respect to the gathered operand is the gather's transpose.
      count: the number of gathers kept per layer.
      nbytes: their bytes per layer and device.
    """

    record: Callable[..., tuple[Any, tuple[jax.Array, ...]]]
    replay: Callable[..., Any]
    count: int
    nbytes: int


def keep_context_gathers(fn: Callable[..., Any], args: Sequence[Any], axis: str) -> KeptGathers | None:
    """``fn``'s tiled all-gathers over mesh axis ``axis`` made recordable and replayable, or None without any.

    Args:
      fn: the layer, ``fn(*args) -> out`` (pytrees).
      args: example arguments (with the varying-axes types of the forward).
      axis: the context axis.

    Returns:
      A :class:`KeptGathers`, or None when ``fn`` gathers nothing over ``axis`` where it can be kept.
    """
    flat, tree = jax.tree.flatten(tuple(args))
    closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*flat)
    found = list(_gathers(closed.jaxpr, axis))
    if not found:
        return None
    out_tree = jax.tree.structure(out_shape)

    def record(*a):
        kept: list[jax.Array] = []

        def take(eqn, vals, dim):
            out = bind_tolerant(eqn, vals)
            kept.append(out[0])
            return out

        outs = _run(closed, jax.tree.leaves(a), axis, take)
        return jax.tree.unflatten(out_tree, outs), tuple(kept)

    def replay(kept, *a):
        it = iter(kept)

        def take(eqn, vals, dim):
            return [_replayed(vals[0], next(it), axis, dim)]

        return jax.tree.unflatten(out_tree, _run(closed, jax.tree.leaves(a), axis, take))

    nbytes = sum(math.prod(v.aval.shape) * np.dtype(v.aval.dtype).itemsize for v in found)
    return KeptGathers(record, replay, len(found), int(nbytes))


def _gathers(jaxpr: Any, axis: str):
    """The result variables of ``jaxpr``'s context-axis gathers, in evaluation order (nested calls entered)."""
    for eqn in jaxpr.eqns:
        if tiled_gather_over(eqn, axis) is not None:
            yield eqn.outvars[0]
        elif is_nested_call(eqn):
            yield from _gathers(nested_call_jaxpr(eqn).jaxpr, axis)


def _run(closed: Any, invals: Sequence[Any], axis: str, take: Callable[[Any, list[Any], int], list[Any]]) -> list[Any]:
    """Evaluates ``closed`` as :func:`vescale_jax.step._random.run_tolerant` does, each context-axis gather (in
    the order of :func:`_gathers`) by ``take(eqn, operands, gathered dim)``."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, invals, strict=True))
    for eqn in jaxpr.eqns:
        vals = [read(env, v) for v in eqn.invars]
        dim = tiled_gather_over(eqn, axis)
        if dim is not None:
            outs = take(eqn, vals, dim)
        elif is_nested_call(eqn):
            outs = _run(nested_call_jaxpr(eqn), vals, axis, take)
        else:
            outs = rerun_nested(eqn, vals, run_tolerant)
            if outs is None:
                outs = bind_tolerant(eqn, vals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(env, v) for v in jaxpr.outvars]


def _replayed(x: jax.Array, kept: jax.Array, axis: str, dim: int) -> jax.Array:
    """``kept`` (the all-gather of ``x`` over ``axis`` along ``dim``, from the forward) standing for that gather:
    the cotangent reaches ``x`` reduce-scattered over ``axis``, as the gather's own transpose sends it."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return kept

    @jax.custom_vjp
    def gathered(x_, kept_):
        return kept_

    def fwd(x_, kept_):
        return kept_, x_  # x_ only for its type

    def bwd(x_, ct):
        dx = jax.lax.psum_scatter(ct, axis, scatter_dimension=dim, tiled=True)
        extra = tuple(sorted(varying_axes(dx) - varying_axes(x_)))
        if extra:  # an operand invariant over an axis the cotangent varies over receives its sum
            dx = jax.lax.psum(dx, extra)
        return varying_like(dx.astype(x_.dtype), varying_axes(x_)), None

    gathered.defvjp(fwd, bwd)
    return gathered(x, kept)
