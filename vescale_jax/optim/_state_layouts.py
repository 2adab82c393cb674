"""The two layouts of :class:`vescale_jax.PerDevice` optimizer state, to re-place it under another plan.

A ``PerDevice`` array keeps, on device ``k``, rows that only mean something under its plan (block slots of
Shampoo, the compact vector of :func:`vescale_jax.optim._on_leaves.on_leaves`). Its ``layout`` says what the rows
hold and converts both ways (through :class:`vescale_jax.optim._rows_to_logical.Relayout`):

* ``to_logical(value)``: one global array per leaf whose key and shape do not depend on the plan;
* ``logical_shapes(dtype)``: their ``jax.ShapeDtypeStruct`` (with the shardings ``to_logical`` gives them),
  the restore target of a checkpoint;
* ``from_logical(arrays)``: the ``PerDevice`` value under *this* layout's plan from arrays that another plan's
  ``to_logical`` produced (another device count, granularity or mesh).

Two layouts exist:

* :class:`BlockLayout` (Shampoo statistics and roots ``(m*B, b, b)``): per matrix leaf ``"<path>/blocks"``, its
  blocks ``(nb, b, b)`` (``(L, nb, b, b)`` for a stacked leaf) in row-major block order, block ``(i, j)`` of a
  ``(R, C)`` matrix view at index ``i * ceil(C / b) + j``; edge blocks keep their zero-padded ``b x b`` slot
  exactly as the optimizer holds it.
* :class:`CompactLayout` (compact vectors): per chosen leaf ``"<path>"``, its elements at the leaf's logical shape.

How the logical arrays are sharded and how the rows get there is in :mod:`vescale_jax.optim._rows_to_logical`;
the view of a whole state (:func:`logical_view`, :func:`restore_logical`) is in
:mod:`vescale_jax.optim._logical_view`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout._plan import Plan
from vescale_jax.layout._ragged import RaggedShard
from vescale_jax.optim._compact_tables import build_compact, chosen_dtype
from vescale_jax.optim._rows_to_logical import Entry, Relayout, Tables, check_pieces, per_device_axes
from vescale_jax.optim._shampoo._blocks import build_blocks, matrix_view

__all__ = ["BlockLayout", "CompactLayout"]


@dataclasses.dataclass(frozen=True)
class BlockLayout(Relayout):
    """Rows of Shampoo's block statistics and roots: ``(m * B, b, b)``, slot ``s`` of device ``k`` one block
    (see :func:`vescale_jax.optim.shampoo_blocks`).

    Logical form: per matrix leaf, key ``"<path>/blocks"``, shape ``(nb, b, b)`` (``(L, nb, b, b)`` for a stacked
    leaf), ``nb = ceil(R / b) * ceil(C / b)`` blocks of its ``(R, C)`` matrix view in row-major block order.

    Attributes:
      plan: the plan.
      block_size: ``b``.
    """

    plan: Plan
    block_size: int

    @property
    def axes(self) -> Any:
        """The mesh axes the rows are sharded over (:attr:`vescale_jax.PerDevice.axes`): the plan's axis, or with
        leaves split over tensor / expert axes those axes then the plan's axis (every TP/EP group holds the blocks
        of its own shards)."""
        return per_device_axes(self.plan)

    def default_dtype(self) -> Any:
        return jnp.float32

    def _build(self) -> Tables:
        plan, b = self.plan, self.block_size
        if plan.tp_axes:
            raise NotImplementedError(
                f"BlockLayout: the plan splits leaves over {plan.tp_axes}; the logical view of Shampoo's block state "
                "(checkpoints, re-placing it under another plan) is not supported for tensor / expert-split plans "
                "yet. Checkpoint the params and restart Shampoo's statistics, or plan without tp=."
            )
        t = build_blocks(plan, b, what="shampoo")
        m, bb = plan.num_devices, b * b
        bases, cursor = {}, 0
        for bk in t.buckets:
            bases[bk] = cursor
            cursor += math.prod(plan.buckets[bk].local_shape)
        # Per slot: (leaf, layer, logical block index).
        where: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
        for k in range(m):
            for s in range(t.slots):
                if t.rows[k, s] == 0:
                    continue
                i = int(t.leaf[k, s])
                spec = plan.leaves[i]
                bucket = plan.buckets[spec.bucket]
                size, offset = bucket.layout.shard_size, bucket.layout.offsets[spec.slot]
                rel_local = int(t.base[k, s]) - bases[spec.bucket]
                layer, within = divmod(rel_local, size)
                rel = k * size + within - offset
                _, c = matrix_view(plan.layer_shape(spec))
                gran = bucket.storage[spec.slot] if bucket.storage else None
                if gran is None:
                    row, col = divmod(rel, c)
                else:  # stored tile-major: the block's first element is at storage position rel
                    shape = plan.layer_shape(spec)
                    lead, row, col = (int(x) for x in tiles.coords(np.asarray(rel), shape, gran))
                    row += lead * shape[-2]
                nbc = -(-c // b)
                if row % b or col % b:
                    raise AssertionError(f"BlockLayout: slot {s} of device {k} does not start a block of {spec.path}")
                where.setdefault((i, layer), [[] for _ in range(m)])[k].append((s, (row // b) * nbc + col // b))
        entries, perms = [], {}
        for i, spec in enumerate(plan.leaves):
            if not t.matrix_leaves[i]:
                continue
            r, c = matrix_view(plan.layer_shape(spec))
            nb = -(-r // b) * -(-c // b)
            layers = plan.buckets[spec.bucket].layers
            start = np.zeros((m, layers or 1), np.int32)
            global_slot = np.zeros((layers or 1, nb), np.int32)
            units = None
            tiled = bool(plan.buckets[spec.bucket].storage) and plan.buckets[spec.bucket].storage[spec.slot] is not None
            for layer in range(layers or 1):
                per_device = where[(i, layer)]
                for k, x in enumerate(per_device):
                    for slot, j in x:
                        global_slot[layer, j] = k * t.slots + slot
                if tiled:  # the rows hold the blocks in storage order: number them so, perm maps them back
                    order = [j for x in per_device for _, j in x]
                    perm = np.empty(nb, np.int64)
                    perm[order] = np.arange(nb)
                    if perms.setdefault(i, perm) is not perm and not np.array_equal(perms[i], perm):
                        raise AssertionError(f"BlockLayout: {spec.path}: layers are placed differently")
                    per_device = [[(slot, int(perm[j])) for slot, j in x] for x in per_device]
                counts = [len(x) for x in per_device]
                for k, x in enumerate(per_device):
                    slots, idx = [s for s, _ in x], [j for _, j in x]
                    if x and (
                        slots != list(range(slots[0], slots[0] + len(x))) or idx != list(range(idx[0], idx[0] + len(x)))
                    ):
                        raise AssertionError(
                            f"BlockLayout: {spec.path} layer {layer}: device {k}'s blocks are not one run of slots"
                        )
                    start[k, layer] = slots[0] * bb if x else 0
                check_pieces("BlockLayout", spec.path, counts, [x[0][1] if x else 0 for x in per_device])
                if units is None:
                    units = tuple(counts)
                elif units != tuple(counts):
                    raise AssertionError(f"BlockLayout: {spec.path}: layers are placed differently")
            rs = RaggedShard((nb, b, b), bb, units)
            chunk = b % m == 0  # every block's rows split evenly: one balanced all-to-all, never a whole leaf
            entries.append(
                Entry(f"{spec.path}/blocks", layers, rs, start, global_slot if chunk else None, perm=perms.get(i))
            )
        return Tables(tuple(entries), (t.slots, b, b))


@dataclasses.dataclass(frozen=True)
class CompactLayout(Relayout):
    """Rows of a compact vector of :func:`vescale_jax.optim._on_leaves.on_leaves`: ``(m * n,)``, each device's
    elements of the chosen leaves (see :func:`vescale_jax.optim._on_leaves.build_compact`).

    Logical form: per chosen leaf, key ``"<path>"``, its elements at the leaf's shape.

    Attributes:
      plan: the plan.
      chosen: per leaf (flattening order), whether the compact vector holds it.
    """

    plan: Plan
    chosen: tuple[bool, ...]

    @property
    def axes(self) -> Any:
        """The mesh axes the rows are sharded over (see :func:`per_device_axes`)."""
        return per_device_axes(self.plan)

    def default_dtype(self) -> Any:
        return chosen_dtype(self.plan, self.chosen)

    def _build(self) -> Tables:
        plan = self.plan
        if plan.tp_axes:
            raise NotImplementedError(
                f"CompactLayout: the plan splits leaves over {plan.tp_axes}; the logical view of compact optimizer "
                "state (checkpoints, re-placing it under another plan) is not supported for tensor / expert-split "
                "plans yet."
            )
        t = build_compact(plan, self.chosen)
        m = plan.num_devices
        bases, cursor = [], 0
        for bk in plan.buckets:
            bases.append(cursor)
            cursor += math.prod(bk.local_shape)
        runs = [{int(t.start[k, j]): j for j in range(t.start.shape[1]) if t.length[k, j]} for k in range(m)]
        entries = []
        for i, spec in enumerate(plan.leaves):
            if not self.chosen[i]:
                continue
            bucket = plan.buckets[spec.bucket]
            layers = bucket.layers
            rs = plan.shard_of(spec.path) if spec.size else RaggedShard(plan.layer_shape(spec), 1, (0,) * m)
            size = bucket.layout.shard_size
            start = np.zeros((m, layers or 1), np.int32)
            for k in range(m):
                if not rs.local_sizes[k]:
                    continue
                lo = max(bucket.layout.offsets[spec.slot], k * size)
                for layer in range(layers or 1):
                    j = runs[k].get(bases[spec.bucket] + layer * size + lo - k * size)
                    if j is None or int(t.length[k, j]) != rs.local_sizes[k]:
                        raise AssertionError(f"CompactLayout: no run of {spec.path} layer {layer} on device {k}")
                    start[k, layer] = t.position[k, j]
            gran = bucket.storage[spec.slot] if bucket.storage else None
            if gran is None:
                entries.append(Entry(spec.path, layers, rs, start))
            else:  # stored tile-major: the device pieces are runs of the storage order
                flat = RaggedShard((rs.size,), rs.block, rs.units)
                entries.append(Entry(spec.path, layers, flat, start, tiled=(plan.layer_shape(spec), gran)))
        return Tables(tuple(entries), (t.size,))
