"""A ``vj.fsdp`` step whose optimizer state lives in host memory: the state streamed through the update.

The step is traced once with the state in its device form (full ``ShardedParams`` / ``PerDevice`` values), and
its jaxpr is evaluated again in another order:

1. every operation that does not read the offloaded state (forward, backward, reduce-scatters, counts) first;
2. then, bucket by bucket, the operations that read the bucket's state (Adam's moments, the update, the new
   parameters): its state comes to the device, the operations run, the new state goes back to host memory.

A bucket of a stacked layer group whose update is element-wise (Adam, AdamW, SGD with momentum, masks; the
check is :func:`vescale_jax._compat.is_elementwise` on every operation) is streamed one layer at a time: the
operations run on row ``l`` of every operand, which gives row ``l`` of every result bit for bit. Any other
update (a reduction over the bucket, Muon's matrices, 8-bit blocks) runs on the whole bucket, which then is the
piece. The pieces move in order: piece ``k + 2`` comes to the device only after piece ``k`` went back (an
``optimization_barrier`` on its host input), so on a GPU piece ``k + 1``'s transfer overlaps piece ``k``'s update
and the device holds at most two pieces of state; the first two wait for the gradients, so no state is on the
device during the forward and backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax._compat import (
    bind_equation,
    constraint_spec,
    is_broadcast,
    is_elementwise,
    is_literal,
    is_row_constraint,
    with_shape,
)
from vescale_jax.state._containers import PerDevice, ShardedParams
from vescale_jax.state._offloaded import Offloaded, Split, device_node, full_shape, is_offloaded
from vescale_jax.state._padding import zero_piece
from vescale_jax.step._jaxpr import read
from vescale_jax.step._point_of_use import _inline

__all__ = ["Piece", "stream_offloaded"]


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece of optimizer state a step streams.

    Attributes:
      group: the bucket index (``len(plan.buckets) + i`` for the ``i``-th ``PerDevice``).
      row: the piece of the buffer's split (a layer row, or a column piece of a flat buffer), or ``None`` for a
        whole buffer.
      bytes_in: bytes per device brought to the device.
      bytes_out: bytes per device sent back to host memory.
    """

    group: int
    row: int | None
    bytes_in: int
    bytes_out: int


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One offloaded child in the device form of the state: where its pieces are and what it stands for."""

    node: Offloaded
    child: int
    split: Split | None
    aval: jax.ShapeDtypeStruct
    group: int

    def sharding(self) -> jax.sharding.NamedSharding:
        return self.aval.sharding


def _device_form(host_state: Any) -> Any:
    """The state with each :class:`Offloaded` node as its device node whose offloaded children are ``_Slot``s."""
    per_device = 0

    def one(off):
        nonlocal per_device
        if not is_offloaded(off):
            return off
        form = off.form
        group0 = 0 if form.kind == "sharded" else len(form.plan.buckets) + per_device
        per_device += form.kind == "per_device"

        def slot(i, parts, split, sharding):
            aval = jax.ShapeDtypeStruct(full_shape(parts, split), parts[0].dtype, sharding=sharding)
            return _Slot(off, i, split, aval, group0 + i)

        return device_node(off, slot)

    return jax.tree.map(one, host_state, is_leaf=is_offloaded)


def _bytes(aval_shape: Sequence[int], dtype: Any, sharding: Any) -> int:
    """Bytes per device of an array of this global shape and sharding."""
    return int(np.prod(sharding.shard_shape(tuple(aval_shape)), dtype=np.int64)) * np.dtype(dtype).itemsize


def _gated(x: Any, gate: Sequence[Any]) -> Any:
    """``x`` available only once every value of ``gate`` is computed (an ``optimization_barrier``)."""
    return jax.lax.optimization_barrier((x, *gate))[0] if gate else x


def _constrains_alike(eqn: Any, split: Split) -> bool:
    """Whether ``eqn`` is a sharding constraint that holds for a piece as for the whole value: ``P(None, ...)`` on
    rows; on column pieces of a flat buffer, a 1-D spec (each piece is sharded on dim 0 like the buffer)."""
    spec = constraint_spec(eqn)
    if spec is None:
        return False
    return is_row_constraint(eqn) if split.kind == "rows" else len(spec) <= 1


def _pieceable(eqns: Sequence[Any], split: Split) -> bool:
    """Whether every equation is element-wise over operands and results that ``split`` cuts alike (scalars
    aside), so that running them on piece ``i`` of every operand gives piece ``i`` of every result."""
    for eqn in eqns:
        if not (is_elementwise(eqn) or is_broadcast(eqn) or _constrains_alike(eqn, split)):
            return False
        ins = [v.aval for v in eqn.invars if not is_literal(v)]
        if is_broadcast(eqn) and any(a.shape for a in ins):
            return False  # only scalars are broadcast (a broadcast of an array may move its elements)
        if any(a.shape and not split.fits(a.shape) for a in ins):
            return False
        if any(not split.fits(v.aval.shape) for v in eqn.outvars):
            return False
    return True


def stream_offloaded(
    inner: Callable[..., Any],
    args: Sequence[Any],
    *,
    ordered: bool = True,
    record: list[Piece] | None = None,
) -> Any:
    """Runs ``inner(params, opt_state, batch, *rest)`` with the offloaded nodes of ``opt_state`` streamed.

    Args:
      inner: the step on the device form of the state; returns ``(params, opt_state, *rest)``.
      args: ``(params, opt_state, batch, *rest)``, the state holding :class:`Offloaded` nodes (host memory). The
        padding of every offloaded ``ShardedParams`` child is zeroed piece by piece as it goes back.
      ordered: order the transfers (piece ``k + 2`` loaded after piece ``k`` is stored; the first two after the
        gradients) with ``optimization_barrier`` calls. Off for CPU devices, where host and device memory are the
        same memory and nothing moves: the barriers would only change how XLA:CPU fuses the update.
      record: if given, the streamed :class:`Piece` records are appended to it, in order.

    Returns:
      ``inner``'s outputs with the new state's nodes offloaded like the input's.
    """
    params, host_state, *others = args
    dev_state = _device_form(host_state)
    flat, in_tree = jax.tree.flatten((params, dev_state, *others))
    slot_at = {k: x for k, x in enumerate(flat) if isinstance(x, _Slot)}
    avals = [x.aval if isinstance(x, _Slot) else x for x in flat]
    out_trees: list[Any] = []

    def flat_inner(*xs):
        out = inner(*jax.tree.unflatten(in_tree, xs))
        leaves, tree = jax.tree.flatten(out)
        out_trees.append(tree)
        return leaves

    closed = _inline(jax.make_jaxpr(flat_inner)(*avals), avals)
    out_tree = out_trees[0]
    jaxpr = closed.jaxpr

    # Which output leaves are the new state's offloaded children (the step returns (params, opt_state, ...)).
    positions = jax.tree.unflatten(out_tree, list(range(out_tree.num_leaves)))
    state_positions = positions[1] if isinstance(positions, tuple | list) and len(positions) >= 2 else None
    if state_positions is None or jax.tree.structure(state_positions) != jax.tree.structure(
        jax.tree.map(lambda _: 0, dev_state)
    ):
        raise ValueError(
            "vj.fsdp(offload=...): the step must return (params, opt_state, *rest) with the new optimizer state "
            "structured like the one passed in; its offloaded buckets are written back to host memory."
        )
    pairs = zip(jax.tree.leaves(state_positions), jax.tree.leaves(dev_state), strict=True)
    out_slot = {j: s for j, s in pairs if isinstance(s, _Slot)}  # output index -> the input child it replaces

    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    var_slot: dict[Any, _Slot] = {}
    for k, v in enumerate(jaxpr.invars):
        if k in slot_at:
            var_slot[v] = slot_at[k]
        else:
            env[v] = flat[k]

    group_of: dict[Any, int] = {v: s.group for v, s in var_slot.items()}
    groups: list[int | None] = []
    for eqn in jaxpr.eqns:
        keys = [group_of[v] for v in eqn.invars if not is_literal(v) and v in group_of]
        g = max(keys) if keys else None
        groups.append(g)
        if g is not None:
            group_of.update((o, g) for o in eqn.outvars)

    # 1. everything that does not read the offloaded state
    for eqn, g in zip(jaxpr.eqns, groups, strict=True):
        if g is None:
            env.update(zip(eqn.outvars, bind_equation(eqn, [read(env, v) for v in eqn.invars]), strict=True))
    ready = []
    seen = set()
    for eqn, g in zip(jaxpr.eqns, groups, strict=True):
        for v in eqn.invars if g is not None else ():
            if not is_literal(v) and v in env and v not in seen and v not in jaxpr.invars:
                seen.add(v)
                ready.append(env[v])

    pieces_of: dict[Any, tuple[Split, list[Any]]] = {}  # values computed piece by piece
    stored: dict[int, list[Any]] = {}  # output index -> host pieces written
    out_of_var: dict[Any, list[int]] = {}
    for j, v in enumerate(jaxpr.outvars):
        if j in out_slot and not is_literal(v):
            out_of_var.setdefault(v, []).append(j)
    after: list[list[Any]] = []  # per piece streamed: the values piece k + 2 waits for

    def gate() -> list[Any]:
        if not ordered:
            return []
        return ready if len(after) < 2 else after[-2]

    def host_sharding(slot: _Slot) -> Any:
        return slot.sharding().with_memory_kind(slot.node.form.memory_kind)

    def load(slot: _Slot, i: int | None, g: list[Any]) -> Any:
        parts = slot.node.pieces[slot.child]
        if i is not None:
            return jax.device_put(_gated(parts[i], g), slot.sharding())
        moved = [jax.device_put(_gated(p, g), slot.sharding()) for p in parts]
        return moved[0] if slot.split is None else slot.split.join(moved)

    def full(v: Any) -> Any:
        if is_literal(v):
            return v.val
        if v in env:
            return env[v]
        if v in pieces_of:
            split, parts = pieces_of.pop(v)
            env[v] = split.join(parts)
            return env[v]
        slot = var_slot[v]  # the state of another bucket, read again
        env[v] = load(slot, None, gate())
        return env[v]

    def store(j: int, value: Any, i: int | None = None) -> Any:
        slot = out_slot[j]
        if slot.node.form.kind == "sharded":
            cols = i is not None and slot.split is not None and slot.split.kind == "cols"
            local = slot.split.bounds[i : i + 2] if cols else None
            value = zero_piece(slot.node.plan, slot.child, value, full_shape=slot.aval.shape, local=local)
        host = jax.device_put(value, host_sharding(slot))
        stored.setdefault(j, []).append(host)
        return host

    def store_whole(j: int, value: Any) -> list[Any]:
        split = out_slot[j].split
        if split is None:
            return [store(j, value)]
        return [store(j, split.take(value, i), i) for i in range(split.count)]

    def piece_bytes(these: Sequence[_Slot], outs: Sequence[int], i: int | None) -> Piece:
        def size(s):
            shape = s.aval.shape if i is None else s.split.piece_shape(i)
            return _bytes(shape, s.aval.dtype, s.sharding())

        return Piece(these[0].group if these else -1, i, sum(map(size, these)), sum(size(out_slot[j]) for j in outs))

    # 2. bucket by bucket, the operations that read its state
    for key in sorted({g for g in groups if g is not None}):
        eqns = [e for e, g in zip(jaxpr.eqns, groups, strict=True) if g == key]
        mine = [v for v, s in var_slot.items() if s.group == key]
        read_vars = {v for e in eqns for v in e.invars if not is_literal(v)}
        foreign = [v for v in read_vars if v in var_slot and var_slot[v].group != key]
        splits = {var_slot[v].split for v in mine}
        produced = {o for e in eqns for o in e.outvars}
        outs = [j for v in produced if v in out_of_var for j in out_of_var[v]]
        used = [v for v in mine if v in read_vars]
        split = next(iter(splits)) if len(splits) == 1 else None
        if split is not None and not foreign and _pieceable(eqns, split):
            for i in range(split.count):
                g = gate()
                local = {v: load(var_slot[v], i, g) for v in used}
                for eqn in eqns:
                    invals = []
                    for v in eqn.invars:
                        if is_literal(v):
                            invals.append(v.val)
                        elif v in local:
                            invals.append(local[v])
                        elif v in pieces_of and pieces_of[v][0] == split and len(pieces_of[v][1]) > i:
                            invals.append(pieces_of[v][1][i])
                        else:
                            x = full(v)
                            invals.append(x if not np.shape(x) else split.take(x, i))
                    e = with_shape(eqn, split.piece_shape(i)) if is_broadcast(eqn) else eqn
                    for o, val in zip(eqn.outvars, bind_equation(e, invals), strict=True):
                        local[o] = val
                for v in produced:
                    pieces_of.setdefault(v, (split, []))[1].append(local[v])
                written = [store(j, local[jaxpr.outvars[j]], i) for j in outs]
                after.append(written or [local[v] for v in produced])
                if record is not None:
                    record.append(piece_bytes([var_slot[v] for v in used], outs, i))
        else:
            g = gate()
            for v in used:
                env[v] = load(var_slot[v], None, g)
            for eqn in eqns:
                env.update(zip(eqn.outvars, bind_equation(eqn, [full(v) for v in eqn.invars]), strict=True))
            written = [h for j in outs for h in store_whole(j, env[jaxpr.outvars[j]])]
            after.append(written or [env[v] for v in produced])
            if record is not None:
                record.append(piece_bytes([var_slot[v] for v in used], outs, None))
            for v in used:
                env.pop(v)

    # 3. the outputs: the new state's offloaded children as host pieces, everything else whole
    leaves = []
    for j, v in enumerate(jaxpr.outvars):
        if j not in out_slot:
            leaves.append(full(v))
            continue
        slot = out_slot[j]
        if j in stored:
            leaves.append(tuple(stored[j]))
        elif not is_literal(v) and var_slot.get(v) is slot:  # passed through unchanged
            leaves.append(slot.node.pieces[slot.child])
        else:
            store_whole(j, full(v))
            leaves.append(tuple(stored[j]))
    return _rebuild(out_tree, leaves, host_state, out_slot)


def _rebuild(out_tree: Any, leaves: list[Any], host_state: Any, out_slot: dict[int, _Slot]) -> Any:
    """The step's outputs with the state's offloaded children put back into :class:`Offloaded` nodes."""
    marked = [("__pieces__", x) if j in out_slot else x for j, x in enumerate(leaves)]
    out = jax.tree.unflatten(out_tree, marked)
    params, dev_state, *rest = out

    def one(off, new):
        children = new.buffers if isinstance(new, ShardedParams) else (new.value,)
        return Offloaded(
            [(c,) if split == -1 else c[1] for c, split in zip(children, off.form.splits, strict=True)], off.form
        )

    kinds = (ShardedParams, PerDevice)
    new_state = jax.tree.map(
        lambda off, new: one(off, new) if is_offloaded(off) else new,
        host_state,
        jax.tree.unflatten(jax.tree.structure(host_state, is_leaf=is_offloaded), _top_nodes(dev_state, kinds)),
        is_leaf=is_offloaded,
    )
    return (params, new_state, *rest)


def _top_nodes(tree: Any, kinds: tuple[type, ...]) -> list[Any]:
    """The leaves of ``tree`` with its plan state nodes (and the marked piece tuples) kept whole."""
    return jax.tree.leaves(
        tree, is_leaf=lambda x: isinstance(x, kinds) or (isinstance(x, tuple) and x[:1] == ("__pieces__",))
    )
