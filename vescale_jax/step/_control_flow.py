"""Which of the model's values depend on the device's slice of the batch, and no branch on one of them.

Unsharded, ``lax.cond(jnp.mean(h) > 0, ...)`` takes one branch for the whole batch. Inside ``vj.apply`` the mean
is over the device's slice, and devices can take different branches: the model then computes something the
unsharded model never does. :func:`checked_model` traces the model once to a jaxpr and follows, equation by
equation (into ``scan``, ``while``, ``cond``, ``checkpoint``, ``jit`` and ``custom_vjp`` bodies; not into Pallas
kernels), which values depend on the batch slice: the batch arguments do, and so does whatever is computed from
them, until a sum over the data axes (``vj.batch_mean`` / ``vj.batch_sum``, ``lax.psum``) makes a value the same
on every device (with ``shard_map``'s varying-axes check on, any value typed as not varying over the data axes
counts as such). A ``cond`` / ``switch`` index or ``while`` condition that depends on the batch slice is refused,
naming the operation, its source line and the fix.

The parameters do not depend on the batch: they reach the model gathered, the same on every device (although
typed as varying over the plan's axis, which is why the batch is followed rather than the types alone). So only
the model's own use of its batch is judged, never the gathers ``vj.scan_layers`` adds, nor a draw from a key that
is not in the batch. The same dependence tells ``vj.apply`` which outputs are per-example
(:mod:`vescale_jax.step._outputs`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from vescale_jax._compat import (
    aval_varying_axes,
    body_name,
    cond_parts,
    equation_source,
    indexed_axes,
    is_literal,
    nested_jaxprs,
    scan_parts,
    summed_axes,
    while_parts,
)
from vescale_jax.step._context import over_context
from vescale_jax.step._context_check import check_sequence_mixing
from vescale_jax.step._jaxpr import evaluate, read
from vescale_jax.step._statistics import WHOLE_BATCH_VALUE, over_batch
from vescale_jax.step._wire import varying_axes

__all__ = ["batch_dependence", "checked_model"]


@dataclasses.dataclass(frozen=True)
class _Context:
    axes: tuple[str, ...]
    typed: bool
    fn: str
    positional: tuple[str, ...] = ()  # axes whose index is a position in the sequence, not a batch slice


def batch_dependence(
    jaxpr: Any,
    inputs: Sequence[bool],
    axes: tuple[str, ...],
    *,
    typed: bool,
    fn: str = "vj.apply",
    positional: tuple[str, ...] = (),
) -> list[bool]:
    """Per output of ``jaxpr``, whether it depends on the device's slice of the batch; raises on a ``cond`` /
    ``switch`` / ``while`` whose predicate does.

    Args:
      jaxpr: the model's open jaxpr, traced inside ``shard_map``.
      inputs: per input variable, whether it depends on the batch slice (the batch arguments).
      axes: the data axes.
      typed: whether ``shard_map`` checks varying axes (then a value not varying over ``axes`` is batch-free).
      fn: the API named in the message.
      positional: data axes whose ``axis_index`` is not batch-dependent (the context axis: a device's place in
        the sequence, on which ``vj.attention`` branches to skip masked blocks).

    Returns:
      Per output, whether it depends on the batch slice.

    Raises:
      ValueError: naming the operation, where it is (source line, enclosing bodies) and the fix.
    """
    return _dependence(jaxpr, list(inputs), _Context(tuple(axes), typed, fn, tuple(positional)), ())


def _dependence(jaxpr: Any, inputs: list[bool], ctx: _Context, within: tuple[str, ...]) -> list[bool]:
    env = dict(zip(jaxpr.invars, inputs, strict=True))

    def dep(a: Any) -> bool:
        return False if is_literal(a) else env.get(a, False)

    for eqn in jaxpr.eqns:
        outs = _equation(eqn, [dep(v) for v in eqn.invars], ctx, within)
        same = set(ctx.axes) <= set(summed_axes(eqn))  # a sum over every data axis: the same on every device
        for v, d in zip(eqn.outvars, outs, strict=True):
            env[v] = d and not same and (not ctx.typed or bool(aval_varying_axes(v.aval) & set(ctx.axes)))
    return [dep(v) for v in jaxpr.outvars]


def _equation(eqn: Any, ins: list[bool], ctx: _Context, within: tuple[str, ...]) -> list[bool]:
    """Per output of ``eqn``, whether it depends on the batch slice (before the equation's own sum or type)."""
    inner = (*within, body_name(eqn))
    if set(indexed_axes(eqn)) & (set(ctx.axes) - set(ctx.positional)):
        return [True]  # the device's index over a data axis: differs between devices as the batch slice does
    cond = cond_parts(eqn)
    if cond is not None:
        _, branches, _ = cond
        if ins[0]:
            raise _refusal("cond", eqn, ctx, within)
        outs = [_dependence(b, ins[1:], ctx, inner) for b in branches]
        return [any(col) for col in zip(*outs, strict=True)]
    loop = while_parts(eqn)
    if loop is not None:
        cond_j, body, cc, bc, _ = loop
        n_cc, n_bc = len(cc), len(bc)
        c_dep = ins[n_cc + n_bc :]
        while True:  # the carry's dependence grows to a fixed point
            outs = _dependence(body, ins[n_cc : n_cc + n_bc] + c_dep, ctx, inner)
            new = [a or b for a, b in zip(c_dep, outs, strict=True)]
            if new == c_dep:
                break
            c_dep = new
        if _dependence(cond_j, ins[:n_cc] + c_dep, ctx, inner)[0]:
            raise _refusal("while", eqn, ctx, within)
        return c_dep
    scan = scan_parts(eqn)
    if scan is not None:
        body, n_consts, n_carry = scan
        c_dep = ins[n_consts : n_consts + n_carry]
        while True:
            outs = _dependence(body, ins[:n_consts] + c_dep + ins[n_consts + n_carry :], ctx, inner)
            new = [a or b for a, b in zip(c_dep, outs[:n_carry], strict=True)]
            if new == c_dep:
                return c_dep + outs[n_carry:]
            c_dep = new
    subs = [sub.jaxpr for sub in nested_jaxprs(eqn)]
    if len(subs) == 1 and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == len(eqn.outvars):
        return _dependence(subs[0], ins, ctx, inner)  # jit, checkpoint, custom_jvp / custom_vjp, shard_map
    for sub in subs:  # another structure: its predicates judged as if every input depended on the batch
        _dependence(sub, [any(ins)] * len(sub.invars), ctx, inner)
    return [any(ins)] * len(eqn.outvars)


_WHAT = {
    "cond": ("lax.cond / lax.switch", "branches on", "devices can take different branches where"),
    "while": ("lax.while_loop", "loops while", "devices can run different numbers of iterations where"),
}


def _refusal(kind: str, eqn: Any, ctx: _Context, within: tuple[str, ...]) -> ValueError:
    what, verb, effect = _WHAT[kind]
    where = equation_source(eqn)
    at = f" at {where}" if where else ""
    inside = f" (inside {' > '.join(within)})" if within else ""
    return ValueError(
        f"{ctx.fn}: the model's {what}{at}{inside} {verb} a value computed from this device's slice of the batch "
        f"(a batch statistic such as jnp.mean(h) > 0, or one example's value; the data axes are {ctx.axes}): it "
        f"differs between devices, so {effect} the unsharded model decides once for the whole batch. Compute the "
        "statistic over the global batch with vj.batch_mean(h) / vj.batch_sum(h) (the same value on every device, "
        f"and the unsharded value), or decide per example with jnp.where(...). {WHOLE_BATCH_VALUE}"
    )


def checked_model(
    fn: Callable[..., Any],
    axes: tuple[str, ...],
    *,
    typed: bool,
    dependence: list[bool] | None = None,
    whole: Sequence[bool] | None = None,
    sequence: Any = None,
) -> Callable[..., Any]:
    """``fn(tree, *args)`` traced with :func:`vescale_jax.batch_mean` reducing over ``axes``, its control flow
    checked (:func:`batch_dependence`: ``args`` are the batch, ``tree`` the parameters), then evaluated.

    Args:
      fn: the model ``(tree, *args) -> outputs``, called inside ``vj.apply``'s ``shard_map``.
      axes: the data axes.
      typed: whether values carry their varying axes (``shard_map``'s ``check_vma``).
      dependence: a list filled, each time the model is traced, with one flag per output leaf (flattening
        order): whether it depends on the batch slice.
      whole: per argument after ``tree``, whether it is passed whole (the same on every device: not batch); by
        default every argument is batch unless its type says it does not vary over ``axes``.
      sequence: under a context axis, the call's :class:`vescale_jax.step._context_batch.ContextBatch`: the model
        is traced with the context announced (:func:`vescale_jax.step._context.over_context`) and an operation
        that mixes tokens outside ``vj.attention`` / ``vj.batch_mean`` is refused
        (:func:`vescale_jax.step._context_check.check_sequence_mixing`).

    Returns:
      The wrapped model (same signature and outputs).
    """

    @functools.wraps(fn)
    def run(tree: Any, *args: Any) -> Any:
        flat, structure = jax.tree.flatten((tree, *args))
        n_params = len(jax.tree.leaves(tree))
        passed_whole = [False] * len(args) if whole is None else list(whole)
        per_leaf = [w for arg, w in zip(args, passed_whole, strict=True) for _ in jax.tree.leaves(arg)]
        # an argument leaf is free of the batch when passed whole or typed as not varying over the data axes
        free = [
            w or (typed and not (varying_axes(x) & set(axes))) for x, w in zip(flat[n_params:], per_leaf, strict=True)
        ]
        with over_batch(axes, typed=typed), over_context(None if sequence is None else sequence.ctx):
            closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(structure, xs)), return_shape=True)(
                *flat
            )
        inputs = [False] * n_params + [not f for f in free]
        if sequence is not None:  # the sequence leaves: not passed whole, two or more dims (dim 1 the tokens)
            tokens = [not w and x.ndim >= 2 for x, w in zip(flat[n_params:], per_leaf, strict=True)]
            check_sequence_mixing(closed.jaxpr, [False] * n_params + tokens, sequence.ctx.axis)
        positional = () if sequence is None else (sequence.ctx.axis,)
        outs = batch_dependence(closed.jaxpr, inputs, axes, typed=typed, positional=positional)
        if dependence is not None:
            dependence[:] = outs
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(closed.jaxpr.invars, flat, strict=True))
        evaluate(closed.jaxpr.eqns, env)
        return jax.tree.unflatten(jax.tree.structure(out_shape), [read(env, v) for v in closed.jaxpr.outvars])

    return run
