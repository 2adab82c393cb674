"""A segment of the model with its buckets gathered at the point of use, and the jaxpr helpers it needs.

:func:`gather_segment` runs a segment of the model (the operations from the first to the last read of some
buckets' leaves) with those buckets gathered right before it by :func:`vescale_jax.step._wire.gather_leaves` and
reduce-scattered inside its backward by :func:`vescale_jax.step._wire.scatter_leaves`; an affine segment
reduce-scatters its leaves' gradient before gathering them again. :func:`reads` tells whether a traced function
reads an argument; :func:`anchored` ties a function's constant-only operations to an anchor (:func:`tie`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from vescale_jax._compat import bind_equation, is_literal, is_pvary, pvary_axes
from vescale_jax.layout._plan import Bucket, Plan
from vescale_jax.step._jaxpr import read
from vescale_jax.step._wire import (
    Gather,
    gather_leaves,
    layer_shapes,
    scatter_leaves,
    tie,
    varying_axes,
    varying_like,
)

__all__ = ["anchored", "gather_segment", "reads"]


def gather_segment(
    fn: Callable[[list[list[jax.Array]], list[Any]], list[Any]],
    locals_: Sequence[jax.Array],
    buckets: Sequence[Bucket],
    plan: Plan,
    how: Gather,
    others: Sequence[Any],
    *,
    keep: bool,
    affine: bool,
) -> list[Any]:
    """``fn(leaves, others)`` with ``buckets`` gathered right before it and reduce-scattered inside its backward.

    ``fn`` is a segment of the model: the operations from the first to the last read of these buckets' leaves
    (``leaves[k]``: bucket ``k``'s leaves in slot order). Forward: the local shards are tied to ``others`` (the
    segment's other inputs, :func:`tie`), so XLA cannot gather before the values arriving at the segment exist,
    and the gathered leaves die with the segment. Backward:

    * an *affine* segment (its Jacobian in the leaves does not read the leaves: matmuls, embedding lookups,
      scales and biases) computes the leaves' cotangents first, without the leaves, and reduce-scatters them;
      only then are the leaves gathered again (tied to the reduce-scatter), for the other inputs' cotangents,
      and only if those read them (a bias or a lookup needs no gather at all). A gathered leaf and its
      full-size gradient are never alive together;
    * any other segment gathers again (tied to the cotangent) and takes the VJP as usual.

    With ``keep`` the forward's gathered leaves are saved instead of gathered again (no reshard).
    Constant-initialised arrays of the leaves' backward (e.g. the zeros an embedding's gradient is scattered
    into) are tied to the cotangent too, so XLA cannot allocate them before the backward reaches them.

    Returns:
      ``fn``'s outputs.

    Sharding:
      Inside ``shard_map``; ``locals_`` vary over ``plan.axis``. One all-gather per bucket forward (and at most
      one again backward); one reduce-scatter per bucket backward (plus the replica sum under HSDP).
    """
    buckets = list(buckets)
    like = [varying_axes(x) for x in locals_]
    shapes = [layer_shapes(b, plan) for b in buckets]

    def gathered(locs, anchor):
        return [gather_leaves(x, b, plan, how) for x, b in zip(tie(locs, anchor), buckets, strict=True)]

    def zeros():  # typed like the gathered leaves: varying over the shard's axes and the replica axes
        return [
            [
                varying_like(jnp.zeros(s, how.leaf_dtype(b.dtype)), ax | frozenset(how.replica_axes) if ax else ax)
                for s in ss
            ]
            for ss, b, ax in zip(shapes, buckets, like, strict=True)
        ]

    def scatter(dws):
        return tuple(
            scatter_leaves(dw, b, plan, how, like_axes=ax) for dw, b, ax in zip(dws, buckets, like, strict=True)
        )

    @jax.custom_vjp
    def run(locs, others_):
        return fn(gathered(locs, others_), others_)

    def run_fwd(locs, others_):
        ws = gathered(locs, others_)
        return fn(ws, others_), (locs, others_, ws if keep else None)

    def run_bwd(res, ct):
        locs, others_, ws = res
        if not affine:
            ws = ws if ws is not None else gathered(locs, ct)
            dws, d_others = jax.vjp(fn, ws, others_)[1](ct)
            return scatter(dws), d_others
        z = zeros()
        dws = anchored(lambda c: jax.vjp(lambda w: fn(w, others_), z)[1](c)[0], ct)(ct)
        d_locs = scatter(dws)
        d_of_others = lambda w, c: jax.vjp(lambda o: fn(w, o), others_)[1](c)[0]
        if reads(d_of_others, (z, ct), 0):
            ws = ws if ws is not None else gathered(locs, d_locs)  # after the reduce-scatter
        else:
            ws = z  # the other inputs' cotangents do not read the leaves: no gather (z is dead code)
        return d_locs, d_of_others(ws, ct)

    run.defvjp(run_fwd, run_bwd)
    return run(tuple(locals_), list(others))


def reads(f: Callable[..., Any], args: Sequence[Any], argnum: int) -> bool:
    """Whether ``f(*args)`` reads any leaf of ``args[argnum]`` (traced; dead operations do not count)."""
    flat, tree = jax.tree.flatten(tuple(args))
    counts = [len(jax.tree.leaves(a)) for a in args]
    lo = sum(counts[:argnum])
    closed = jax.make_jaxpr(lambda *xs: f(*jax.tree.unflatten(tree, xs)))(*flat)
    jaxpr = closed.jaxpr
    live = {v for v in jaxpr.outvars if not is_literal(v)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars) or eqn.effects:
            live.update(v for v in eqn.invars if not is_literal(v))
    return any(v in live for v in jaxpr.invars[lo : lo + counts[argnum]])


def anchored(f: Callable[..., Any], anchor: Any) -> Callable[..., Any]:
    """``f`` whose operations with only constant inputs (``zeros``, ``full``, ``iota`` buffers) are tied to
    ``anchor`` (:func:`tie`): XLA schedules a constant's allocation wherever it likes, and may place a large
    one at the very start of the step; tied, it cannot come before ``anchor`` exists."""

    def run(*args):
        flat, tree = jax.tree.flatten(args)
        closed, shape = jax.make_jaxpr(lambda *xs: f(*jax.tree.unflatten(tree, xs)), return_shape=True)(*flat)
        jaxpr = closed.jaxpr
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars, flat, strict=True))
        for eqn in jaxpr.eqns:
            invals = [read(env, v) for v in eqn.invars]
            if is_pvary(eqn) and all(
                set(pvary_axes(eqn)) <= varying_axes(x) for x in invals
            ):  # a tied constant varies already
                env.update(zip(eqn.outvars, invals, strict=True))
                continue
            outs = bind_equation(eqn, invals)
            if all(is_literal(v) for v in eqn.invars) and not eqn.effects:
                outs = [tie([o], anchor)[0] if isinstance(o, jax.Array) and o.ndim else o for o in outs]
            env.update(zip(eqn.outvars, outs, strict=True))
        return jax.tree.unflatten(jax.tree.structure(shape), [read(env, v) for v in jaxpr.outvars])

    return run
