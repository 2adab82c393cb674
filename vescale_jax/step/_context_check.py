"""Under a context axis, refuse a model that mixes tokens by hand: it would only see this device's tokens.

With the sequence split over the context axis, each device holds ``L / cp`` tokens of every sequence. Per-token
operations (embeddings, projections, MLPs, norms over features) mean what they mean unsharded; an operation that
mixes tokens (attention written as ``softmax(q @ k.T) @ v``, a mean or cumulative sum over the sequence, a shift
``x[:, 1:]``) would silently mix only this device's tokens. :func:`check_sequence_mixing` follows, equation by
equation through the model's jaxpr (into ``scan``, ``cond``, ``while``, ``jit``, ``checkpoint`` and ``custom_vjp``
bodies), which dims of which values index the device's tokens (the sequence dims: dim 1 of the batch leaves, and
whatever a projection, reshape or broadcast carries them to), and refuses, naming the line, an operation that:

* contracts a sequence dim (``p @ v`` over keys) or pairs two of them (``q @ k.T``: scores token by token);
* reduces, sorts or accumulates over one (``jnp.mean(x, axis=1)``, ``jnp.cumsum``);
* cuts, shifts, pads, reverses, concatenates or gathers along one (``x[:, 1:]``, ``jnp.roll``, ``x[:, perm]``).

The operations of ``vj.attention`` and ``vj.batch_mean`` / ``vj.batch_sum`` (recognised by their source, the
modules that define them) are exact over the whole sequence and are not judged. An operation this module has no
rule for keeps the sequence dims where its output has an input's shape, and drops them otherwise (never refused).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from vescale_jax._compat import (
    cond_parts,
    equation_source,
    is_literal,
    nested_jaxprs,
    primitive_name,
    scan_parts,
    while_parts,
)

__all__ = ["check_sequence_mixing"]

_EXACT_MODULES = tuple(
    os.path.join("vescale_jax", "step", name) for name in ("_attention", "_statistics.py", "_positions.py")
)
"""Source files (``_attention*``: the module and its companions) of the functions that are exact over the whole
sequence: their operations are not judged."""

_Dims = frozenset[int]
_NONE: _Dims = frozenset()

_REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor"}
_ARG_REDUCTIONS = {"argmax", "argmin"}
_CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
_NESTED = {"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call"}


class _Mix(Exception):
    def __init__(self, eqn: Any, what: str, dim: int, shape: tuple[int, ...]):
        super().__init__(what)
        self.eqn, self.what, self.dim, self.shape = eqn, what, dim, shape


def check_sequence_mixing(jaxpr: Any, inputs: Sequence[bool], axis: str, *, fn: str = "vj.fsdp") -> None:
    """Raises when the model mixes tokens outside ``vj.attention`` / ``vj.batch_mean``.

    Args:
      jaxpr: the model's open jaxpr, traced inside the step's ``shard_map`` (local shapes).
      inputs: per input variable, whether it is a sequence leaf (dim 1 the device's tokens).
      axis: the context axis (named in the message).
      fn: the API named in the message.

    Raises:
      ValueError: naming the operation, its source line, the dim and the fix (``vj.attention``).
    """
    try:
        _walk(jaxpr, [frozenset({1}) if s else _NONE for s in inputs], False)
    except _Mix as e:
        where = equation_source(e.eqn)
        at = f" at {where}" if where else ""
        raise ValueError(
            f"{fn}: the model's {primitive_name(e.eqn)}{at} {e.what} (dim {e.dim} of a value of shape {e.shape} "
            f"on each device), but the sequence is split over the context axis {axis!r}: each device holds only "
            "its own tokens, so this would mix those alone, not the whole sequence. Attend with "
            "vj.attention(q, k, v, causal=...) (exact over the whole sequence: attention written by hand, "
            "softmax(q @ k.T) @ v, is not), reduce over tokens with vj.batch_mean / vj.batch_sum, and take positions "
            "from vj.positions(tokens); shift targets (x[:, 1:]) outside the model, in the step. Per-token operations "
            "(projections, MLPs, norms over features) need nothing."
        ) from None


def _exact(eqn: Any) -> bool:
    where = equation_source(eqn) or ""
    return any(m in where for m in _EXACT_MODULES)


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(getattr(getattr(v, "aval", None), "shape", ()))


def _walk(jaxpr: Any, inputs: list[_Dims], exact: bool) -> list[_Dims]:
    env = dict(zip(jaxpr.invars, inputs, strict=True))

    def dims(a: Any) -> _Dims:
        return _NONE if is_literal(a) else env.get(a, _NONE)

    for eqn in jaxpr.eqns:
        ins = [dims(v) for v in eqn.invars]
        if not any(ins):
            continue
        outs = _equation(eqn, ins, exact or _exact(eqn))
        env.update(zip(eqn.outvars, outs, strict=True))
    return [dims(v) for v in jaxpr.outvars]


def _refuse(eqn: Any, exact: bool, what: str, dim: int, shape: tuple[int, ...]) -> None:
    if not exact:
        raise _Mix(eqn, what, dim, shape)


def _equation(eqn: Any, ins: list[_Dims], exact: bool) -> list[_Dims]:
    name = primitive_name(eqn)
    p = eqn.params
    shapes = [_shape(v) for v in eqn.invars]
    outs = [_shape(v) for v in eqn.outvars]
    d0 = ins[0]

    if name == "dot_general":
        (lc, rc), (lb, rb) = p["dimension_numbers"]
        (ld, rd), (ls, rs) = ins, shapes
        for d, c, s in ((ld, lc, ls), (rd, rc, rs)):
            for k in sorted(d & set(c)):
                _refuse(eqn, exact, "contracts the sequence dim (a token-by-token product such as p @ v)", k, s)
        lfree = [i for i in range(len(ls)) if i not in lc and i not in lb]
        rfree = [i for i in range(len(rs)) if i not in rc and i not in rb]
        if ld & set(lfree) and rd & set(rfree):
            k = min(ld & set(lfree))
            _refuse(eqn, exact, "pairs every token with every token (scores such as q @ k.T)", k, ls)
        out = {j for j, (a, b) in enumerate(zip(lb, rb, strict=True)) if a in ld or b in rd}
        out |= {len(lb) + j for j, i in enumerate(lfree) if i in ld}
        out |= {len(lb) + len(lfree) + j for j, i in enumerate(rfree) if i in rd}
        return [frozenset(out)]
    if name in _REDUCTIONS or name in _ARG_REDUCTIONS:
        axes = tuple(p["axes"])
        for k in sorted(d0 & set(axes)):
            _refuse(eqn, exact, "reduces over the sequence dim (a mean, sum or max over tokens)", k, shapes[0])
        keep = [i for i in range(len(shapes[0])) if i not in axes]
        return [frozenset(j for j, i in enumerate(keep) if i in d0)] * len(outs)
    if name in _CUMULATIVE or name == "sort":
        dim = p.get("axis", p.get("dimension"))
        if dim in d0:
            _refuse(eqn, exact, "accumulates or sorts along the sequence dim", dim, shapes[0])
        return [d0 if i < len(ins) and shapes[i] == o else _same(ins, shapes, o) for i, o in enumerate(outs)]
    if name == "slice":
        for k in sorted(d0):
            stride = p["strides"][k] if p["strides"] else 1
            if (p["start_indices"][k], p["limit_indices"][k], stride) != (0, shapes[0][k], 1):
                _refuse(eqn, exact, "cuts or shifts the sequence dim (such as x[:, 1:])", k, shapes[0])
        return [d0]
    if name == "pad":
        for k in sorted(d0):
            if tuple(p["padding_config"][k]) != (0, 0, 0):
                _refuse(eqn, exact, "pads the sequence dim (a shift such as jnp.roll or jnp.pad)", k, shapes[0])
        return [d0]
    if name == "rev":
        for k in sorted(d0 & set(p["dimensions"])):
            _refuse(eqn, exact, "reverses the sequence dim", k, shapes[0])
        return [d0]
    if name == "concatenate":
        union = frozenset().union(*ins)
        if p["dimension"] in union:
            _refuse(eqn, exact, "concatenates along the sequence dim", p["dimension"], outs[0])
        return [union]
    if name in ("dynamic_slice", "dynamic_update_slice"):
        union = frozenset().union(*ins[:2]) if name == "dynamic_update_slice" else d0
        sizes = p.get("slice_sizes") or shapes[1]
        for k in sorted(union):
            if sizes[k] != shapes[0][k]:
                _refuse(eqn, exact, "cuts or updates part of the sequence dim", k, shapes[0])
        return [union]
    if name == "broadcast_in_dim":
        return [frozenset(p["broadcast_dimensions"][k] for k in d0)]
    if name == "transpose":
        perm = list(p["permutation"])
        return [frozenset(perm.index(k) for k in d0)]
    if name == "squeeze":
        drop = set(p["dimensions"])
        keep = [i for i in range(len(shapes[0])) if i not in drop]
        return [frozenset(j for j, i in enumerate(keep) if i in d0)]
    if name == "reshape":
        return [_reshape(d0, shapes[0], outs[0])]
    if name == "gather":
        return [_gather(eqn, ins, shapes, outs[0], exact)]
    if name == "all_gather":
        gathered = p.get("all_gather_dimension")
        return [frozenset(k for k in d0 if k != gathered) if p.get("tiled") else _NONE]
    if name in _NESTED:
        subs = nested_jaxprs(eqn)
        if len(subs) >= 1 and len(subs[0].jaxpr.invars) == len(ins) and len(subs[0].jaxpr.outvars) == len(outs):
            return _walk(subs[0].jaxpr, ins, exact)
    cond = cond_parts(eqn)
    if cond is not None:
        _, branches, _ = cond
        results = [_walk(b, ins[1:], exact) for b in branches]
        return [frozenset().union(*col) for col in zip(*results, strict=True)]
    scan = scan_parts(eqn)
    if scan is not None:
        return _scan(eqn, scan, ins, shapes, exact)
    loop = while_parts(eqn)
    if loop is not None:
        _, body, cc, bc, _ = loop
        n = len(cc) + len(bc)
        carry = ins[n:]
        while True:
            new = [a | b for a, b in zip(carry, _walk(body, ins[len(cc) : n] + carry, exact), strict=True)]
            if new == carry:
                return carry
            carry = new
    return [_same(ins, shapes, o) for o in outs]


def _same(ins: list[_Dims], shapes: list[tuple[int, ...]], out: tuple[int, ...]) -> _Dims:
    """Element-wise (and unknown) operations: the union of the inputs' sequence dims of the output's shape."""
    return frozenset().union(*(d for d, s in zip(ins, shapes, strict=True) if len(s) == len(out)))


def _reshape(d0: _Dims, shape: tuple[int, ...], out: tuple[int, ...]) -> _Dims:
    """A sequence dim goes to the output dim holding its first element (merged with its neighbours or split)."""
    result = set()
    for k in d0:
        start = math.prod(shape[:k])
        acc = 1
        for j, n in enumerate(out):
            if acc <= start < acc * n or (n == 1 and acc == start and shape[k] == 1):
                result.add(j)
                break
            acc *= n
        else:
            result.add(len(out) - 1)
    return frozenset(result) if out else _NONE


def _gather(eqn: Any, ins: list[_Dims], shapes: list[tuple[int, ...]], out: tuple[int, ...], exact: bool) -> _Dims:
    """``x[idx]``: the indices' sequence dims go to the output's batch dims; an operand's sequence dim indexed
    (``x[:, perm]``) or cut is refused; one sliced whole goes to its offset dim."""
    dn = eqn.params["dimension_numbers"]
    offset = tuple(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims)
    batching = set(getattr(dn, "operand_batching_dims", ()))
    indexed = set(dn.start_index_map)
    sizes = eqn.params["slice_sizes"]
    batch_pos = [i for i in range(len(out)) if i not in offset]
    result = {batch_pos[k] for k in ins[1] if k < len(shapes[1]) - 1 and k < len(batch_pos)}
    kept = [i for i in range(len(shapes[0])) if i not in collapsed and i not in batching]
    for k in sorted(ins[0]):
        if k in batching:
            continue  # paired with the indices' own batch dim (jnp.take_along_axis over another dim)
        if k in indexed or sizes[k] != shapes[0][k]:
            _refuse(eqn, exact, "gathers along the sequence dim (such as x[:, perm] or jnp.roll)", k, shapes[0])
            continue
        if k in kept:
            result.add(offset[kept.index(k)])
    return frozenset(result)


def _scan(eqn: Any, scan: Any, ins: list[_Dims], shapes: list[tuple[int, ...]], exact: bool) -> list[_Dims]:
    body, n_consts, n_carry = scan
    xs = ins[n_consts + n_carry :]
    for d, s in zip(xs, shapes[n_consts + n_carry :], strict=True):
        if 0 in d:
            _refuse(eqn, exact, "scans along the sequence dim (a recurrence over tokens)", 0, s)
    xs = [frozenset(k - 1 for k in d if k > 0) for d in xs]
    carry = ins[n_consts : n_consts + n_carry]
    while True:
        outs = _walk(body, ins[:n_consts] + carry + xs, exact)
        new = [a | b for a, b in zip(carry, outs[:n_carry], strict=True)]
        if new == carry:
            return carry + [frozenset(k + 1 for k in d) for d in outs[n_carry:]]
        carry = new
