"""Block placement for blocked preconditioners (Shampoo): which device holds which ``b x b`` block.

A *matrix leaf* is a leaf whose per-layer shape has rank >= 2; each layer is viewed as the row-major matrix
``(R, C) = (prod(shape[:-1]), shape[-1])`` and cut into ``block_size x block_size`` blocks (edge blocks
smaller). With the planner's ``vj.rows(block_size)`` granularity a device boundary never cuts a block-row,
so every block lies whole on one device and is read straight out of that device's local shard. A leaf stored
tile-major with ``vj.tiles(bh, bw)`` (``bh`` and ``bw`` multiples of ``block_size``) holds each block inside
one tile, strided by the tile's width; its blocks are listed in storage order.

A leaf split over tensor / expert axes is blocked per TP/EP shard, on its local shape: the tables are the same in
every group (one layout serves all groups), and :func:`check_tp_blocks` refuses a block size whose shard blocks
are not blocks of the logical leaf.

Tables are tiny: per device and block *slot*, the local offset of the block's first element, its row
stride and its rows and columns. The device side (:func:`gather_blocks`, :func:`scatter_blocks`) computes
element indices from them, so no per-element index constant is baked into the program.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout._plan import Plan

__all__ = [
    "BlockTables",
    "build_blocks",
    "check_tp_blocks",
    "gather_blocks",
    "logical_layer",
    "matrix_view",
    "scatter_blocks",
]


def matrix_view(layer_shape: Sequence[int]) -> tuple[int, int] | None:
    """``(R, C)`` matrix view of one layer of a leaf, or ``None`` if it is not a matrix (rank < 2 or empty)."""
    shape = tuple(layer_shape)
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    return math.prod(shape[:-1]), shape[-1]


@dataclasses.dataclass(frozen=True, eq=False)
class BlockTables:
    """Static placement of every block, built once per plan.

    Attributes:
      block_size: ``b``.
      buckets: buckets whose local shards are concatenated (in this order) into the local vector ``X``.
      local_size: length of ``X``.
      slots: ``B``, block slots per device (the most blocks any device holds; empty slots are zero).
      counts: real blocks per device.
      base, stride, rows, cols: ``(m, B)`` int32: the block's first element in ``X``, its row stride (``C``)
        and its extent (0 rows for an empty slot). Element ``(i, j)`` of slot ``s`` on device ``k`` is
        ``X[base[k, s] + i * stride[k, s] + j]``.
      leaf: ``(m, B)`` leaf index of each slot (``num_leaves`` for an empty one).
      matrix_leaves: per leaf, whether it is a matrix leaf.
    """

    block_size: int
    buckets: tuple[int, ...]
    local_size: int
    slots: int
    counts: tuple[int, ...]
    base: np.ndarray
    stride: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    leaf: np.ndarray
    matrix_leaves: tuple[bool, ...]

    @property
    def num_blocks(self) -> int:
        return sum(self.counts)

    @property
    def balance(self) -> float:
        """Most blocks on one device over the mean (1.0 is perfect; every slot costs a full block's roots)."""
        m = len(self.counts)
        return self.slots * m / self.num_blocks if self.num_blocks else 1.0

    def summary(self) -> str:
        m = len(self.counts)
        return (
            f"{self.num_blocks} blocks of up to {self.block_size}x{self.block_size} over {m} devices: "
            f"{self.slots} slots per device, max/mean blocks per device = {self.balance:.3f}; "
            f"per device: {' '.join(map(str, self.counts))}"
        )


def build_blocks(
    plan: Plan, block_size: int, matrix: Sequence[bool] | None = None, *, what: str = "shampoo"
) -> BlockTables:
    """Places every block of every matrix leaf on the device holding it.

    Args:
      plan: the plan.
      block_size: ``b``.
      matrix: per leaf, whether to block it (default: every leaf whose per-layer rank is >= 2).
      what: the caller's name for error messages.

    Returns:
      :class:`BlockTables`.

    Raises:
      ValueError: a block is split between two devices; the message names the leaf, the block and the fix.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"vj.optim.{what}: block_size must be a positive integer, got {block_size!r}")
    m = plan.num_devices
    views = [matrix_view(plan.layer_shape(s)) for s in plan.leaves]
    if matrix is None:
        matrix = [v is not None for v in views]
    matrix = [bool(x) and views[i] is not None for i, x in enumerate(matrix)]
    buckets = tuple(sorted({plan.leaves[i].bucket for i, on in enumerate(matrix) if on}))
    bases, cursor = {}, 0
    for b in buckets:
        bases[b] = cursor
        cursor += math.prod(plan.buckets[b].local_shape)

    cols_of = []  # per leaf: (device, local offset, stride, rows, cols, leaf) arrays, one entry per block
    for index, spec in enumerate(plan.leaves):
        if not matrix[index]:
            continue
        if spec.tp:
            check_tp_blocks(plan, index, block_size, what=what)
        bucket = plan.buckets[spec.bucket]
        s, offset = bucket.layout.shard_size, bucket.layout.offsets[spec.slot]
        r_total, c_total = views[index]
        bi, bj = np.meshgrid(
            np.arange(0, r_total, block_size, dtype=np.int64),
            np.arange(0, c_total, block_size, dtype=np.int64),
            indexing="ij",
        )
        bi, bj = bi.reshape(-1), bj.reshape(-1)
        r, c = np.minimum(block_size, r_total - bi), np.minimum(block_size, c_total - bj)
        gran = bucket.storage[spec.slot] if bucket.storage else None
        if gran is None:
            first = offset + bi * c_total + bj
            last = offset + (bi + r - 1) * c_total + bj + c - 1
            stride = np.full(len(first), c_total)
        else:
            first, last, stride, order = _tiled_blocks(plan, index, gran, block_size, bi, bj, r, c, what)
            bi, bj, r, c = bi[order], bj[order], r[order], c[order]
            first, last = offset + first, offset + last
        split = np.flatnonzero(first // s != last // s)
        if len(split):
            x = split[0]
            raise ValueError(
                f"vj.optim.{what}: leaf {spec.path!r} (shape {spec.shape}, matrix view {r_total}x{c_total}): "
                f"block rows {bi[x]}:{bi[x] + r[x]}, cols {bj[x]}:{bj[x] + c[x]} is split between devices "
                f"{first[x] // s} and {last[x] // s} by the plan. Plan with granularity=vj.rows({block_size}) "
                f"for this leaf (block_size rows then never cross a device)."
            )
        nl = bucket.layers or 1
        local = (bases[spec.bucket] + np.arange(nl, dtype=np.int64)[:, None] * s + first % s).reshape(-1)
        n = len(local)
        cols_of.append(
            (np.tile(first // s, nl), local, np.tile(stride, nl), np.tile(r, nl), np.tile(c, nl), np.full(n, index))
        )

    num_leaves = len(plan.leaves)
    if cols_of:
        dev, local, strides, rs, cs, leaves = (np.concatenate(a) for a in zip(*cols_of, strict=True))
    else:
        dev, local, strides, rs, cs, leaves = (np.zeros(0, np.int64),) * 6
    counts = np.bincount(dev, minlength=m).astype(np.int64)
    slots = int(counts.max()) if len(dev) else 0
    order = np.argsort(dev, kind="stable")
    position = np.empty_like(order)
    position[order] = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
    tables = []
    for values, fill in ((local, 0), (strides, 0), (rs, 0), (cs, 0), (leaves, num_leaves)):
        t = np.full((m, slots), fill, np.int32)
        t[dev, position] = values
        tables.append(t)
    base, stride, rows, cols, leaf = tables
    if cursor >= 2**31:
        raise ValueError(f"vj.optim.{what}: {cursor} local elements do not fit int32 block tables")
    return BlockTables(
        block_size,
        buckets,
        cursor,
        slots,
        tuple(int(x) for x in counts),
        base,
        stride,
        rows,
        cols,
        leaf,
        tuple(matrix),
    )


def logical_layer(plan: Plan, index: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[str, ...], ...]]:
    """A leaf's logical per-layer shape, its TP/EP shard's, and the per-dim split axes of one layer."""
    spec = plan.leaves[index]
    lead = 0 if plan.buckets[spec.bucket].layers is None else 1
    return spec.shape[lead:], spec.local_shape[lead:], tuple(spec.tp[lead:])


def check_tp_blocks(plan: Plan, index: int, block_size: int, *, what: str = "shampoo") -> None:
    """Checks that the blocks of a TP/EP-split leaf's shards are blocks of the logical leaf.

    The blocks are cut from each shard's matrix view (its local shape, as the model sees it); they are the
    logical matrix view's ``block_size`` blocks only if every shard's rows and columns fall on whole blocks of
    the leaf (e.g. a column-parallel ``(d, f)`` kernel split into ``(d, f / T)`` needs ``f / T`` a multiple of
    ``block_size``): a block never spans two TP/EP shards.

    Raises:
      ValueError: naming the leaf, its shape, its split and the shard's shape, and what to change.
    """
    spec = plan.leaves[index]
    shape, local, dims = logical_layer(plan, index)
    b = block_size
    view, local_view = matrix_view(shape), matrix_view(local)
    if view is None or local_view is None:
        return
    (r_total, c_total), (r_local, c_local) = view, local_view
    counts = [n // max(n_l, 1) for n, n_l in zip(shape, local, strict=True)]
    ok = counts[-1] == 1 or c_local % b == 0  # the columns: shards start on a block and end on one
    if ok and math.prod(counts[:-1]) > 1:
        # The rows: each shard's local rows map to logical rows; every local block of rows (b consecutive local
        # rows from a multiple of b, or the last, shorter one) must be one logical block of rows.
        index_l = np.unravel_index(np.arange(r_local, dtype=np.int64), local[:-1])
        starts = np.arange(0, r_local, b)
        length = np.minimum(b, r_local - starts)
        for shard in np.ndindex(*counts[:-1]):
            rows = np.ravel_multi_index(
                [c * n + i for c, n, i in zip(shard, local[:-1], index_l, strict=True)], shape[:-1]
            )
            first = rows[starts]
            inside = np.arange(r_local) % b != b - 1
            ok = (
                bool(np.all(first % b == 0))
                and bool(np.all((np.diff(rows) == 1)[inside[:-1]]))
                and bool(np.all(length == np.minimum(b, r_total - first)))
            )
            if not ok:
                break
    if not ok:
        split = {d: axes for d, axes in enumerate(dims) if axes}
        raise ValueError(
            f"vj.optim.{what}: leaf {spec.path!r} has shape {spec.shape} and is split over {split} (dim: mesh "
            f"axes) into shards of shape {spec.local_shape}; the block_size={b} blocks of a shard's "
            f"{r_local}x{c_local} matrix view are not blocks of the leaf's {r_total}x{c_total} view (a block would "
            f"span two tensor / expert shards). Choose a block_size that divides the shard's split extents (the "
            f"shard's columns {c_local} for a last-dim split, its rows per shard for an earlier one), or a mesh with "
            f"fewer {'/'.join(sorted({a for axes in dims for a in axes}))} devices."
        )


def _tiled_blocks(plan: Plan, index: int, gran, b: int, bi, bj, r, c, what: str):
    """Blocks ``[bi, bi + r) x [bj, bj + c)`` of the matrix view of a leaf stored tile-major (``vj.tiles``):
    ``(first, last, stride, order)``, their first and last elements' storage positions in the leaf, row
    strides, and the storage order of the blocks. Every block must lie inside one tile (a sub-rectangle of a
    tile is strided by the tile's width)."""
    spec = plan.leaves[index]
    shape = plan.layer_shape(spec)
    h, w = shape[-2:]
    ends = bi + r - 1, bj + c - 1
    a0, r0, a1, r1 = bi // h, bi % h, ends[0] // h, ends[0] % h
    tile = lambda a, row, col: (a, row // gran.bh, col // gran.bw)
    same = np.all([x == y for x, y in zip(tile(a0, r0, bj), tile(a1, r1, ends[1]), strict=True)], axis=0)
    if not same.all():
        x = int(np.flatnonzero(~same)[0])
        raise ValueError(
            f"vj.optim.{what}: leaf {spec.path!r} (shape {spec.shape}) is stored tile-major with {gran!r}, and its "
            f"block rows {bi[x]}:{bi[x] + r[x]}, cols {bj[x]}:{bj[x] + c[x]} (of the {math.prod(shape[:-1])}x{w} "
            f"matrix view) spans several tiles. Plan this leaf with vj.tiles(bh, bw) whose bh and bw are multiples "
            f"of block_size={b} (and a per-layer row count a multiple of it when the leaf has leading dims), or "
            f"with vj.rows({b}), vj.element() or vj.whole()."
        )
    first = tiles.position(a0, r0, bj, shape, gran)
    last = tiles.position(a1, r1, ends[1], shape, gran)
    wf = w - w % gran.bw
    stride = np.where(bj < wf, gran.bw, w - wf)
    order = np.argsort(first, kind="stable")
    return first[order], last[order], stride[order], order


def _indices(tables: BlockTables, k: jax.Array) -> jax.Array:
    """``(B, b, b)`` indices into ``X`` of device ``k``'s slots; ``local_size`` (out of range) where empty."""
    b = tables.block_size
    take = lambda t: jnp.asarray(t)[k][:, None, None]
    i = jnp.arange(b, dtype=jnp.int32)[None, :, None]
    j = jnp.arange(b, dtype=jnp.int32)[None, None, :]
    idx = take(tables.base) + i * take(tables.stride) + j
    valid = (i < take(tables.rows)) & (j < take(tables.cols))
    return jnp.where(valid, idx, tables.local_size)


def gather_blocks(x: jax.Array, tables: BlockTables, k: jax.Array) -> jax.Array:
    """Device ``k``'s blocks of the local vector ``x`` as ``(B, b, b)``, zero-padded (inside ``shard_map``)."""
    return jnp.take(x, _indices(tables, k), mode="fill", fill_value=0)


def scatter_blocks(blocks: jax.Array, tables: BlockTables, k: jax.Array) -> jax.Array:
    """Inverse of :func:`gather_blocks`: a local vector with each block's real part at its place, zero
    elsewhere (padding of the blocks is dropped)."""
    out = jnp.zeros((tables.local_size,), blocks.dtype)
    return out.at[_indices(tables, k)].set(blocks, mode="drop")
