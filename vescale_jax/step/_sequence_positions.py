"""Positions along the sequence that mean the unsharded positions under a context axis.

Under a context axis each device holds ``T = L / cp`` tokens of every sequence, in the balanced order
(:func:`vescale_jax.step._context.sequence_order`). A model written for one device makes its positions from the
sequence length: ``jnp.arange(T)`` (an ``iota``) for rotary angles or a table lookup, ``pos_table[:T]`` (a
``slice`` from 0) for a learned table. Run per device as written they would give every device the positions
``0 .. T - 1``: wrong from the first token of the second chunk on, and silently so.

:func:`position_rules` reads which of them run along the sequence from two traces of the model, one at the local
shapes and one with the sequences global (the batch local), matched equation by equation in order:

* an ``iota`` along a dim of the local sequence length ``T`` that is ``cp * T`` long in the global trace makes
  positions: :func:`rewrite` gives each device its tokens' global positions there (``local_positions``, the same
  values ``vj.positions`` gives, broadcast over the iota's other dims, in its dtype);
* a ``slice`` from 0 of a value whose dim does not grow with the sequence (a table), cut to ``T`` rows here and
  ``cp * T`` in the global trace, is ``pos_table[:T]``: each device takes the table's rows at its tokens' global
  positions;
* an ``iota`` or ``slice`` that grows with the sequence in any other way (``jnp.arange(2 * T)``, a cut from an
  offset, a length ``T // 2``), or that the traces do not pair, cannot be told, and a cumulative operation along
  a dim that grows with the sequence (``jnp.cumsum(jnp.ones_like(tokens), axis=1)``: positions counted over this
  device's tokens) would count this device's tokens only: each is refused, naming the operation, its line and
  ``vj.positions``.

Iotas and slices of ``vescale_jax``'s own code (``vj.positions``, ``vj.attention``, the split random draws) are
its own and left alone. A cumulative operation over values computed from the tokens (``cumsum`` over segment
starts) is refused by :mod:`vescale_jax.step._context_check` too.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._compat import equation_source, nested_jaxprs, primitive_name
from vescale_jax.step._context import Context, local_positions

__all__ = ["PositionRules", "position_rules", "rewrite"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
_KINDS = ("iota", "slice", *_CUMULATIVE)
_ACCUMULATES = (
    "it accumulates along the sequence, over this device's tokens only (a cumulative sum of ones or of segment starts)"
)
_UNTRACED = "the model could not be traced at the global sequence length to tell what it means"


class _Rule(NamedTuple):
    """``kind``: ``"positions"`` (an iota: the tokens' global positions along ``dim``), ``"take"`` (a slice: the
    table's rows at those positions along ``dim``) or ``"refuse"`` (``why`` says what cannot be told, ``where``
    the user's line)."""

    kind: str
    dim: int
    why: str
    where: str | None


@dataclasses.dataclass(frozen=True)
class PositionRules:
    """What to do with each position-making equation of a model under a context axis.

    Attributes:
      context: the context axis.
      length: the local sequence length ``T`` (dim 1 of the batch's sequence leaves on each device).
      rules: per equation signature (:func:`_signature`), its rule.
    """

    context: Context
    length: int
    rules: dict[tuple[Any, ...], _Rule]


def position_rules(local: Any, mid: Any | None, context: Context, length: int) -> PositionRules | None:
    """The rules for the position-making equations of ``local`` (the model's jaxpr at the local shapes), read
    against ``mid`` (the same model traced with the sequences global and the batch local; None: that trace failed).

    Args:
      local: the model's jaxpr at the local shapes (inside the step's ``shard_map``).
      mid: its jaxpr with every sequence leaf ``cp`` times longer along dim 1, or None.
      context: the context axis (``cp = context.size``).
      length: the local sequence length ``T``.

    Returns:
      The rules, or None when the model makes no iota or slice that grows with the sequence (nothing to do).
    """
    here = list(_candidates(local))
    pairs: dict[int, Any] = {}
    if mid is not None:  # aligned in order (a cut to the whole length, a no-op there, is not in the global trace)
        there = [e for e, _ in _candidates(mid)]
        matcher = difflib.SequenceMatcher(None, [_kind(e) for e, _ in here], [_kind(e) for e in there], autojunk=False)
        for block in matcher.get_matching_blocks():
            pairs.update((block.a + k, there[block.b + k]) for k in range(block.size))
    rules: dict[tuple[Any, ...], _Rule] = {}
    for i, (eqn, where) in enumerate(here):
        if i in pairs:
            found = _rule(eqn, pairs[i], context.size, length)
        else:
            found = _unpaired(eqn, context.size, length, traced=mid is not None)
        if found is None:
            continue
        rule = _Rule(*found, where)
        sig = _signature(eqn)
        if rules.get(sig, rule)[:3] != rule[:3]:  # one local form, two meanings: nothing to tell them apart by
            rule = _Rule("refuse", rule.dim, "it appears twice with the same local shape and two meanings", where)
        rules[sig] = rule
    return PositionRules(context, length, rules) if rules else None


def rewrite(eqn: Any, vals: list[Any], positions: PositionRules, *, fn: str = "vj.fsdp") -> list[Any] | None:
    """``eqn``'s outputs with the tokens' global positions in place of the local ones, or None to bind it as it is.

    Raises:
      ValueError: for a position-making equation that cannot be told (naming it, its line and ``vj.positions``).
    """
    if primitive_name(eqn) not in _KINDS or _own(eqn):
        return None
    rule = positions.rules.get(_signature(eqn))
    if rule is None:
        return None
    kind, dim, why, where = rule
    shape = tuple(eqn.outvars[0].aval.shape)
    if kind == "refuse":
        raise ValueError(
            f"{fn}: the model's {primitive_name(eqn)}{f' at {where}' if where else ''} makes a value of shape {shape} "
            f"on each device whose dim {dim} grows with the sequence, which is split over the context axis "
            f"{positions.context.axis!r} ({positions.length} of each sequence's tokens on each device, in the "
            f"balanced order), but {why}: positions made from the local length would be wrong on every device "
            "but the first. Take the tokens' positions from vj.positions(tokens) (their global positions, the "
            "unsharded model's jnp.arange(T)), or vj.positions(tokens, segment_ids=ids) within packed documents; "
            "index a learned table with them (table[vj.positions(tokens)])."
        )
    where = local_positions(shape[dim], positions.context)
    if kind == "positions":
        along = [1] * len(shape)
        along[dim] = shape[dim]
        return [jnp.broadcast_to(jnp.reshape(where.astype(eqn.params["dtype"]), along), shape)]
    operand = vals[0]
    p = eqn.params
    start, limit = list(p["start_indices"]), list(p["limit_indices"])
    start[dim], limit[dim] = 0, np.shape(operand)[dim]
    part = jax.lax.slice(operand, start, limit, p["strides"])
    return [jnp.take(part, where, axis=dim)]


def _candidates(jaxpr: Any, where: str | None = None) -> Iterator[tuple[Any, str | None]]:
    """The user's iotas, slices and cumulative operations of ``jaxpr`` and its nested jaxprs, in order, each with
    its source line (that of the call it sits in where JAX keeps none for it: ``jnp.cumsum`` is a jitted
    function)."""
    for eqn in jaxpr.eqns:
        line = equation_source(eqn) or where
        if primitive_name(eqn) in _KINDS and not _own(eqn):
            yield eqn, line
        for sub in nested_jaxprs(eqn):
            yield from _candidates(sub.jaxpr, line)


def _own(eqn: Any) -> bool:
    """Whether ``eqn`` comes from vescale_jax's own code (``vj.positions``, ``vj.attention``, split draws)."""
    where = equation_source(eqn) or ""
    return where.startswith(_PACKAGE)


def _signature(eqn: Any) -> tuple[Any, ...]:
    p = eqn.params
    if primitive_name(eqn) == "iota":
        return ("iota", str(p["dtype"]), tuple(p["shape"]), p["dimension"])
    if primitive_name(eqn) in _CUMULATIVE:
        return (primitive_name(eqn), tuple(eqn.invars[0].aval.shape), p["axis"], p.get("reverse"))
    operand = tuple(eqn.invars[0].aval.shape)
    strides = tuple(p["strides"]) if p["strides"] else None
    return ("slice", operand, tuple(p["start_indices"]), tuple(p["limit_indices"]), strides)


def _kind(eqn: Any) -> tuple[Any, ...]:
    """What pairs an equation with its counterpart in the other trace: everything but the sizes (which grow)."""
    p = eqn.params
    name = primitive_name(eqn)
    rank = len(eqn.outvars[0].aval.shape)
    if name == "iota":
        return (name, str(p["dtype"]), rank, p["dimension"])
    if name in _CUMULATIVE:
        return (name, str(eqn.outvars[0].aval.dtype), rank, p["axis"], p.get("reverse"))
    return (name, str(eqn.outvars[0].aval.dtype), rank, tuple(p["strides"] or ()))


def _shapes(eqn: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(operand shape, output shape); an iota has no operand: its output's shape for both."""
    out = tuple(eqn.outvars[0].aval.shape)
    return (tuple(eqn.invars[0].aval.shape) if eqn.invars else out), out


def _rule(eqn: Any, there: Any, cp: int, length: int) -> tuple[str, int, str] | None:
    """The rule for ``eqn`` from its counterpart ``there`` in the trace with the sequences global."""
    (op_here, out_here), (op_there, out_there) = _shapes(eqn), _shapes(there)
    if len(out_here) != len(out_there):
        return ("refuse", 0, "its rank changes with the sequence length")
    grown = [j for j in range(len(out_here)) if out_here[j] != out_there[j]]
    if primitive_name(eqn) in _CUMULATIVE:
        dim = eqn.params["axis"]
        return ("refuse", dim, _ACCUMULATES) if dim in grown else None
    if primitive_name(eqn) == "iota":
        dim = eqn.params["dimension"]
        if dim not in grown:
            return None
        if out_here[dim] == length and out_there[dim] == cp * length:
            return ("positions", dim, "")
        return ("refuse", dim, f"its length {out_here[dim]} here is not the local sequence length")
    cut = [j for j in grown if op_here[j] == op_there[j]]  # grown in the output only: a table cut to the length
    if not cut:
        return None
    dim = cut[0]
    p = eqn.params
    stride = p["strides"][dim] if p["strides"] else 1
    whole_table = len(cut) == 1 and p["start_indices"][dim] == 0 and stride == 1
    if whole_table and out_here[dim] == length and out_there[dim] == cp * length:
        return ("take", dim, "")
    return ("refuse", dim, "it cuts a table to a length that grows with the sequence other than [:T]")


def _unpaired(eqn: Any, cp: int, length: int, *, traced: bool) -> tuple[str, int, str] | None:
    """An equation without a counterpart in the global trace. A cut from 0 to ``T`` of a dim ``cp * T`` long is
    ``table[:T]`` of a table of the whole sequence's length: a no-op at the global length, so not traced there.
    An iota along, or another slice to, a dim of the local sequence length cannot be told."""
    why = _UNTRACED if not traced else "the trace at the global sequence length has nothing to pair it with"
    op, out = _shapes(eqn)
    if primitive_name(eqn) in _CUMULATIVE:
        dim = eqn.params["axis"]
        return ("refuse", dim, _ACCUMULATES) if out[dim] == length else None
    if primitive_name(eqn) == "iota":
        dim = eqn.params["dimension"]
        return ("refuse", dim, why) if out[dim] == length else None
    p = eqn.params
    for j, (a, b) in enumerate(zip(op, out, strict=True)):
        if b == length and a > b:
            stride = p["strides"][j] if p["strides"] else 1
            if traced and a == cp * length and p["start_indices"][j] == 0 and stride == 1:
                return ("take", j, "")
            return ("refuse", j, why)
    return None
