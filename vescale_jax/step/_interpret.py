"""Evaluating a jaxpr on *wide* values, through the higher-order equations nested in it.

A wide value (:class:`Wide`) stands for a low-precision array (bf16, fp16, fp8) by an exact fp32 copy of it.
:func:`evaluate` runs a closed jaxpr on inputs some of which are wide, as :func:`vescale_jax.step._fp32_grads.widened`
needs: ``convert_element_type`` of a wide value to the copy's dtype is the copy itself (no round trip, so a
gradient reaches the copy unrounded), and every other use reads the value in its own dtype (the copy cast back,
exact). Wideness follows the value:

- through element selections (:func:`vescale_jax._compat.is_selection`: slices, ``x[i]``, reshapes,
  transposes, concatenation): a slice of a wide value is wide. Broadcasts and gathers are not followed (their
  transposes sum, in the model's dtype as unsharded);
- into a nested ``jit`` / ``closed_call``: inlined;
- into ``scan`` (``jax.lax.scan``, ``nnx.scan``, ``fori_loop`` with static bounds): re-expressed as
  ``jax.lax.scan`` over an evaluation of the body; wide constants stay wide in every iteration, a wide ``xs``
  gives a wide slice per iteration, and a ``ys`` the body returns wide comes out wide. A wide initial carry is
  passed in its own dtype (the carry's type must be the same on every iteration);
- into ``jax.checkpoint`` / ``nnx.remat``: re-expressed with the equation's own ``policy`` and ``prevent_cse``;
- into ``cond`` / ``switch``: re-expressed as ``jax.lax.switch``; the branches' outputs leave in their own dtype.

Not widened (the value enters in its own dtype, exactly as the model wrote it): ``while`` loops (no reverse-mode
gradient flows through them), ``custom_jvp`` / ``custom_vjp`` functions (their rules decide the gradient and its
dtype: widening would mean dropping them), ``shard_map`` and any other primitive. An equation none of whose inputs
is wide is bound as it is, with its structure unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax._compat import (
    bind_equation,
    checkpoint_params,
    cond_branches,
    convert_dtype,
    is_convert,
    is_literal,
    is_nested_call,
    is_selection,
    nested_call_jaxpr,
    scan_params,
)

__all__ = ["Wide", "evaluate"]


@dataclasses.dataclass(frozen=True)
class Wide:
    """A value of dtype ``dtype`` held as ``copy``, its exact fp32 (wider) copy."""

    copy: Any
    dtype: np.dtype

    def narrow(self) -> Any:
        """The value in its own dtype (exact: the copy holds a value of that dtype)."""
        return self.copy.astype(self.dtype)


def evaluate(closed: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates closed jaxpr ``closed`` on ``args``, each an array or a :class:`Wide`.

    Args:
      closed: a closed jaxpr (``.jaxpr``, ``.consts``).
      args: one per input of the jaxpr: the value, or a :class:`Wide` standing for a value of its ``dtype``.

    Returns:
      One per output: the value, or a :class:`Wide` where the output is a wide value passed through.
    """
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    narrowed: dict[Any, Any] = {}

    def get(v):
        return v.val if is_literal(v) else env[v]

    def value(v):  # in the jaxpr's own dtype
        x = get(v)
        if not isinstance(x, Wide):
            return x
        if v not in narrowed:
            narrowed[v] = x.narrow()
        return narrowed[v]

    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        outs = None
        if any(isinstance(x, Wide) for x in ins):
            outs = _wide_equation(eqn, ins)
        if outs is None:
            outs = bind_equation(eqn, [value(v) for v in eqn.invars])
        env.update(zip(eqn.outvars, outs, strict=True))
    return [get(v) for v in jaxpr.outvars]


def _narrow(x: Any) -> Any:
    return x.narrow() if isinstance(x, Wide) else x


def _copy(x: Any) -> Any:
    return x.copy if isinstance(x, Wide) else x


def _kind(x: Any) -> np.dtype | None:
    return x.dtype if isinstance(x, Wide) else None


def _wrap(x: Any, kind: np.dtype | None) -> Any:
    return x if kind is None else Wide(x, kind)


def _wide_equation(eqn: Any, ins: list[Any]) -> list[Any] | None:
    """The outputs of ``eqn`` on ``ins`` (some wide), or None to bind it on the values in their own dtype."""
    if is_convert(eqn):
        (src,) = ins
        target = convert_dtype(eqn)
        if target == np.dtype(src.copy.dtype):
            return [src.copy]  # astype(f32) of the value: its exact fp32 copy
        return [src] if target == src.dtype else None
    if is_selection(eqn):
        return _selection(eqn, ins)
    if is_nested_call(eqn):
        return evaluate(nested_call_jaxpr(eqn), ins)
    scan = scan_params(eqn)
    if scan is not None:
        return _scan(scan, ins)
    remat = checkpoint_params(eqn)
    if remat is not None:
        return _checkpoint(remat, ins)
    branches = cond_branches(eqn)
    if branches is not None:
        return _switch(branches, ins)
    return None


def _selection(eqn: Any, ins: list[Any]) -> list[Any] | None:
    """A selection on fp32 copies: wide when every wide operand has the output's dtype (operands of that dtype
    that are not wide are upcast, exactly)."""
    out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
    if len(eqn.outvars) != 1 or {x.dtype for x in ins if isinstance(x, Wide)} != {out_dtype}:
        return None
    copy_dtype = next(x.copy.dtype for x in ins if isinstance(x, Wide))

    def operand(x):
        if isinstance(x, Wide):
            return x.copy
        return x.astype(copy_dtype) if np.result_type(x) == out_dtype else x

    (out,) = bind_equation(eqn, [operand(x) for x in ins])
    return [Wide(out, out_dtype)]


def _traced(fn: Callable[..., list[Any]], kinds_out: list[np.dtype | None]) -> Callable[..., list[Any]]:
    """``fn`` returning fp32 copies for its wide outputs, their dtypes recorded in ``kinds_out`` when traced."""

    def run(*a):
        outs = fn(*a)
        kinds_out[:] = [_kind(o) for o in outs]
        return [_copy(o) for o in outs]

    return run


def _scan(p: Any, ins: list[Any]) -> list[Any]:
    """A scan equation as ``jax.lax.scan`` over an evaluation of its body (see the module docstring)."""
    consts, carry, xs = (
        ins[: p.num_consts],
        ins[p.num_consts : p.num_consts + p.num_carry],
        ins[p.num_consts + p.num_carry :],
    )
    const_kinds, xs_kinds = [_kind(c) for c in consts], [_kind(x) for x in xs]
    const_vals = [_copy(c) for c in consts]
    ys_kinds: list[np.dtype | None] = []

    def body(c, x):
        args = [*map(_wrap, const_vals, const_kinds), *c, *map(_wrap, x, xs_kinds)]
        outs = evaluate(p.jaxpr, args)
        ys = outs[p.num_carry :]
        ys_kinds[:] = [_kind(y) for y in ys]
        return [_narrow(o) for o in outs[: p.num_carry]], [_copy(y) for y in ys]

    out_carry, ys = jax.lax.scan(
        body,
        [_narrow(c) for c in carry],
        [_copy(x) for x in xs],
        length=p.length,
        reverse=p.reverse,
        unroll=p.unroll,
    )
    return [*out_carry, *map(_wrap, ys, ys_kinds)]


def _checkpoint(p: Any, ins: list[Any]) -> list[Any]:
    """A checkpoint equation as ``jax.checkpoint`` of an evaluation of its jaxpr, with its policy."""
    kinds = [_kind(x) for x in ins]
    out_kinds: list[np.dtype | None] = []
    inner = _traced(lambda *a: evaluate(p.jaxpr, list(map(_wrap, a, kinds))), out_kinds)
    outs = jax.checkpoint(inner, prevent_cse=p.prevent_cse, policy=p.policy)(*[_copy(x) for x in ins])
    return list(map(_wrap, outs, out_kinds))


def _switch(branches: Sequence[Any], ins: list[Any]) -> list[Any]:
    """A cond equation as ``jax.lax.switch`` over evaluations of its branches (outputs in their own dtype)."""
    index, ops = _narrow(ins[0]), ins[1:]
    kinds = [_kind(x) for x in ops]

    def branch(closed):
        return lambda *a: [_narrow(o) for o in evaluate(closed, list(map(_wrap, a, kinds)))]

    return list(jax.lax.switch(index, [branch(b) for b in branches], *[_copy(x) for x in ops]))
