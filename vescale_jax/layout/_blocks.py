"""The block index of a bucket: which 2-D block each element of a device's local shard is in.

Block-wise quantization over the flat buckets (FP8 weight gathers, 8-bit optimizer state) needs, on every
device, the block of each of its local elements and one scale slot per block it holds. This module computes
that from the plan alone (NumPy), once per plan, bucket and block shape.

**Blocks.** A *quantized* leaf (floating, at least two dims per layer, at least ``min_size`` elements per
layer) is cut into logical ``bh × bw`` tiles of its last two dims, per leading index, edge tiles partial;
its blocks are numbered ``lead * nbh * nbw + (row // bh) * nbw + col // bw`` (the *logical* order). Every other
leaf (vectors, small or integer leaves) is *exact*: each element is its own block. A stacked bucket's index is
one layer's (every layer is laid out alike); a grouped bucket's (``vj.plan(..., tp=...)``) is one TP/EP group's,
on the leaves' TP-local shapes (every group is laid out alike).

**Slots.** Device ``k`` numbers the blocks of its own elements ``0 .. n_k - 1``: its leaves in slot order,
each leaf's blocks in the order of its *numbering*, and keeps ``nb = max(1, max_k n_k)`` slots per layer;
padding gets the slot ``nb``. A leaf's numbering follows its storage (:mod:`vescale_jax.layout._tiles`):

* ``"exact"``: one-element blocks, the storage position itself;
* ``"logical"``: the logical block index of ``_tiles.coords(o)``. Used for a row-major leaf (``vj.element()``,
  ``vj.rows(k)``, ``vj.whole()``), and for a tile-major leaf on one device: a device's blocks are then one
  contiguous range of it;
* ``"storage"``: a tile-major leaf (``vj.tiles(th, tw)`` with ``bh | th`` and ``bw | tw``) spread over devices:
  the blocks tile by tile in storage order, row-major inside each tile, so that the whole tiles a device owns
  are one contiguous range of blocks.

The slot of an element comes from a per-device table of its leaf *runs* (a handful of integers per leaf) and
integer arithmetic on its storage position ``o`` inside the leaf: ``slot = base + number(o) - first``.
:func:`local_slots` evaluates it with NumPy, or with ``jax.numpy`` inside a traced step.

**Refusals.** :func:`block_index` raises :class:`BlockCut` (a ``ValueError``) for a layout that puts a device
boundary inside a block (a row-major leaf cut mid-tile; a tile-major leaf spread over devices in tiles its
blocks do not divide) and for a TP/EP split whose shard's split dim (one of the last two) is not a multiple of
the block's (its shards' edge blocks would not be blocks of the logical leaf). The error carries what its
caller needs to name the leaf, the shape, the block and the fix in its own words.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np

from vescale_jax._cache import plan_cache
from vescale_jax.layout import _tiles
from vescale_jax.layout._granularity import element
from vescale_jax.layout._plan import LeafSpec, Plan
from vescale_jax.layout._tp import misaligned_split

__all__ = [
    "EXACT",
    "LOGICAL",
    "STORAGE",
    "BlockCut",
    "BucketBlocks",
    "LeafBlocks",
    "block_index",
    "local_slots",
    "tile_regions",
]

EXACT, LOGICAL, STORAGE = "exact", "logical", "storage"


class BlockCut(ValueError):
    """A layout that cuts a block across devices, or a TP/EP shard whose blocks are not the leaf's.

    Attributes:
      spec: the leaf's :class:`~vescale_jax.layout._plan.LeafSpec`.
      shape: its per-layer (TP-local) shape.
      block: ``(bh, bw)``.
      reason: ``"rows"`` (a row-major leaf: a device starts mid-block), ``"tiles"`` (a tile-major leaf spread
        over devices in tiles the block does not divide) or ``"split"`` (a TP/EP split dim not a multiple of the
        block's extent).
      device: for ``"rows"`` / ``"tiles"``: the first device that starts inside the leaf at a bad place.
      element: for ``"rows"`` / ``"tiles"``: that device's first element of the leaf (storage position).
      storage: the leaf's tile-major granularity (``"tiles"``), else ``None``.
      split: for ``"split"``: ``(dim, extent, axes)`` of :func:`vescale_jax.layout._tp.misaligned_split`.
    """

    def __init__(
        self,
        spec: LeafSpec,
        shape: tuple[int, ...],
        block: tuple[int, int],
        reason: str,
        *,
        device: int | None = None,
        element: int | None = None,
        storage: Any = None,
        split: tuple[int, int, tuple[str, ...]] | None = None,
    ):
        self.spec, self.shape, self.block, self.reason = spec, shape, block, reason
        self.device, self.element, self.storage, self.split = device, element, storage, split
        where = f"dim {split[0]} of the shard" if split else f"device {device} starts at its element {element}"
        super().__init__(
            f"leaf {spec.path!r} of shape {spec.shape} (per layer {shape}) cuts a {block[0]}x{block[1]} block "
            f"({reason}: {where})"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class LeafBlocks:
    """How one leaf is blocked (per layer).

    Attributes:
      leaf: index into ``plan.leaves``.
      shape: per-layer (TP-local) shape.
      storage: the tile-major ``vj.tiles`` granularity it is stored with, or ``None`` (row-major).
      numbering: :data:`EXACT`, :data:`LOGICAL` or :data:`STORAGE` (see the module docstring).
      block: ``(bh, bw)`` (quantized) or ``None`` (exact).
      num_blocks: blocks per layer.
    """

    leaf: int
    shape: tuple[int, ...]
    storage: Any
    numbering: str
    block: tuple[int, int] | None
    num_blocks: int

    @property
    def exact(self) -> bool:
        """Whether each element is its own block."""
        return self.numbering == EXACT

    @property
    def grid(self) -> tuple[int, ...]:
        """Shape of its (per-layer) blocks in logical order: ``(*lead, nbh, nbw)``, or the shape (exact)."""
        if self.block is None:
            return self.shape
        *lead, h, w = self.shape
        return (*lead, -(-h // self.block[0]), -(-w // self.block[1]))

    def number(self, o: Any, xp: Any = np) -> Any:
        """Block number (in this leaf's numbering) of the elements at storage positions ``o``."""
        if self.numbering == EXACT:
            return o
        bh, bw = self.block
        h, w = self.shape[-2:]
        nbw = -(-w // bw)
        if self.numbering == LOGICAL:
            lead_i, row, col = _tiles.coords(o, self.shape, self.storage or element(), xp)
            return lead_i * (-(-h // bh) * nbw) + row // bh * nbw + col // bw
        num, start, before = o * 0, 0, 0
        for count, th, tw in _segments(self.shape, self.storage):
            q = o - start
            sr, sc = -(-th // bh), -(-tw // bw)
            e = q % (th * tw)
            value = before + q // (th * tw) * (sr * sc) + e // tw // bh * sc + e % tw // bw
            num = xp.where(o >= start, value, num)
            start, before = start + count * th * tw, before + count * sr * sc
        return num

    def logical_of_numbers(self) -> np.ndarray:
        """``(num_blocks,)`` int64: the logical block index of each block number (the storage index of each
        element's logical position for an exact leaf)."""
        if self.numbering == EXACT:
            n = math.prod(self.shape)
            return _tiles.storage_index(self.shape, self.storage or element()) if n else np.zeros(0, np.int64)
        if self.numbering == LOGICAL:
            return np.arange(self.num_blocks, dtype=np.int64)
        bh, bw = self.block
        *lead, h, w = self.shape
        p, nbw = math.prod(lead), -(-w // bw)
        out = []
        for r_lo, c_lo, ntr, ntc, th, tw in tile_regions(self.shape, self.storage):
            sr, sc = -(-th // bh), -(-tw // bw)
            ld, tr, tc, br, bc = np.indices((p, ntr, ntc, sr, sc)).reshape(5, -1)
            row, col = r_lo + tr * th + br * bh, c_lo + tc * tw + bc * bw
            out.append(ld * (-(-h // bh) * nbw) + row // bh * nbw + col // bw)
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def tile_regions(shape: tuple[int, ...], gran: Any) -> list[tuple[int, int, int, int, int, int]]:
    """Non-empty storage segments of a tile-major leaf: ``(row0, col0, tile rows, tile cols, th, tw)``."""
    *_, h, w = shape
    gh, gw = gran.bh, gran.bw
    hf, wf = h - h % gh, w - w % gw
    parts = (
        (0, 0, hf // gh, wf // gw, gh, gw),
        (0, wf, hf // gh, 1, gh, w - wf),
        (hf, 0, 1, wf // gw, h - hf, gw),
        (hf, wf, 1, 1, h - hf, w - wf),
    )
    return [r for r in parts if r[2] * r[3] * r[4] * r[5]]


def _segments(shape: tuple[int, ...], gran: Any) -> list[tuple[int, int, int]]:
    """``(tiles, th, tw)`` of each non-empty segment, in storage order (tiles over all leading indices)."""
    p = math.prod(shape[:-2])
    return [(p * ntr * ntc, th, tw) for _, _, ntr, ntc, th, tw in tile_regions(shape, gran)]


@dataclasses.dataclass(frozen=True, eq=False)
class BucketBlocks:
    """The block index of one bucket: per-device tables of its leaf runs.

    Attributes:
      bucket: the bucket's index in ``plan.buckets``.
      nb: slots per device and layer (the most blocks any device holds in one layer, at least 1); slot ``nb``
        is padding's.
      layers: ``L`` (1 for a flat bucket).
      leaves: the :class:`LeafBlocks` of the bucket's non-empty leaves (slot order).
      starts, ends, kind, origin, base: ``(m, R)`` int32: on device ``k``, local elements ``[starts, ends)``
        belong to ``leaves[kind]``, starting at its storage position ``origin``; its first block there is in
        slot ``base``. Unused entries ``(S, S, 0, 0, nb)``; used ones sorted by ``starts``.
      first: ``(m, R)`` int32: the block number of the run's first block.
      counts: ``(m, R)`` int32: how many blocks the run holds.

    Sharding:
      Device ``k`` on the plan's axis holds ``[k*S, (k+1)*S)`` of each layer (of each TP/EP group); its slots
      ``[0, nb)`` hold the blocks of those elements.
    """

    bucket: int
    nb: int
    layers: int
    leaves: tuple[LeafBlocks, ...]
    starts: np.ndarray
    ends: np.ndarray
    kind: np.ndarray
    origin: np.ndarray
    base: np.ndarray
    first: np.ndarray
    counts: np.ndarray

    @functools.cached_property
    def exact_slots(self) -> np.ndarray:
        """``(m, nb + 1)`` bool: the slots that hold a one-element block of an exact leaf (padding's: False)."""
        m = self.starts.shape[0]
        out = np.zeros((m, self.nb + 1), bool)
        for k in range(m):
            for r in range(self.starts.shape[1]):
                if self.starts[k, r] < self.ends[k, r] and self.leaves[self.kind[k, r]].exact:
                    out[k, self.base[k, r] : self.base[k, r] + self.counts[k, r]] = True
        return out

    def placement(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        """``(device, slot)``, each ``(num_blocks,)`` int64, of every block of ``leaves[j]`` in logical order."""
        lb = self.leaves[j]
        device = np.full(lb.num_blocks, -1, np.int64)
        slot = np.full(lb.num_blocks, -1, np.int64)
        for k in range(self.starts.shape[0]):
            for r in np.flatnonzero((self.kind[k] == j) & (self.starts[k] < self.ends[k])):
                f, c = int(self.first[k, r]), int(self.counts[k, r])
                device[f : f + c] = k
                slot[f : f + c] = int(self.base[k, r]) + np.arange(c)
        by_logical = lb.logical_of_numbers()
        out_device, out_slot = np.empty_like(device), np.empty_like(slot)
        out_device[by_logical], out_slot[by_logical] = device, slot
        assert np.all(out_device >= 0), "block index: a block without a slot"
        return out_device, out_slot


def _is_quantized(spec: LeafSpec, shape: tuple[int, ...], min_size: int) -> bool:
    return len(shape) >= 2 and math.prod(shape) >= min_size and jax.dtypes.issubdtype(np.dtype(spec.dtype), np.floating)


def _row_major_cut(o: int, shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Whether a device boundary before row-major storage position ``o`` splits a ``block`` tile."""
    h = shape[-2]
    bh, bw = block
    _, row, col = (int(v) for v in _tiles.coords(np.int64(o), shape, element()))
    rr, tile_h = row % bh, min(bh, h - row // bh * bh)
    return not ((rr == 0 and col == 0) or (tile_h == 1 and col % bw == 0))


def _leaf_blocks(plan: Plan, bucket: int, slot: int, block: tuple[int, int], min_size: int) -> LeafBlocks:
    b = plan.buckets[bucket]
    i = b.leaves[slot]
    spec = plan.leaves[i]
    shape = plan.layer_shape(spec)
    storage = b.storage[slot] if b.storage else None
    if not _is_quantized(spec, shape, min_size):
        return LeafBlocks(i, shape, storage, EXACT, None, math.prod(shape))
    split = misaligned_split(spec.tp, shape, block, stacked=b.layers is not None)
    if split is not None:
        raise BlockCut(spec, shape, block, "split", split=split)
    *lead, h, w = shape
    nb = math.prod(lead) * -(-h // block[0]) * -(-w // block[1])
    s, o, size = b.layout.shard_size, b.layout.offsets[slot], math.prod(shape)
    boundaries = [k * s - o for k in range(o // s + 1, (o + size - 1) // s + 1)]
    if storage is None:
        for at in boundaries:
            if _row_major_cut(at, shape, block):
                raise BlockCut(spec, shape, block, "rows", device=(o + at) // s, element=at)
        return LeafBlocks(i, shape, None, LOGICAL, block, nb)
    if not boundaries:
        return LeafBlocks(i, shape, storage, LOGICAL, block, nb)
    if storage.bh % block[0] or storage.bw % block[1]:
        at = boundaries[0]
        raise BlockCut(spec, shape, block, "tiles", device=(o + at) // s, element=at, storage=storage)
    return LeafBlocks(i, shape, storage, STORAGE, block, nb)


@plan_cache
def block_index(plan: Plan, bucket: int, block: tuple[int, int], min_size: int = 0) -> BucketBlocks:
    """The block index of one bucket (NumPy, from the plan only; cached per plan).

    Args:
      plan: the plan.
      bucket: the bucket's index in ``plan.buckets``.
      block: ``(bh, bw)``: the tile of the last two dims of each quantized leaf.
      min_size: leaves with fewer elements per layer are exact (one-element blocks).

    Returns:
      The bucket's :class:`BucketBlocks`.

    Raises:
      BlockCut: a device boundary inside a block, or a TP/EP split whose shards' blocks are not the leaf's.
      ValueError: a bucket whose per-device size or slot count does not fit in int32.
    """
    m, b = plan.num_devices, plan.buckets[bucket]
    s = b.layout.shard_size
    leaves: list[LeafBlocks] = []
    runs: list[list[tuple[int, ...]]] = [[] for _ in range(m)]
    used = [0] * m
    for slot in range(len(b.leaves)):
        o, n = b.layout.offsets[slot], b.layout.sizes[slot]
        if not n:
            continue
        lb = _leaf_blocks(plan, bucket, slot, block, min_size)
        kind = len(leaves)
        leaves.append(lb)
        for k in range(o // s, (o + n - 1) // s + 1):
            lo, hi = max(o, k * s), min(o + n, (k + 1) * s)
            first = int(lb.number(np.int64(lo - o)))
            count = int(lb.number(np.int64(hi - 1 - o))) - first + 1
            runs[k].append((lo - k * s, hi - k * s, kind, lo - o, used[k], first, count))
            used[k] += count
    width = max(1, max(len(r) for r in runs))
    nb = max(1, max(used))
    if s >= 2**31 or nb >= 2**31:
        raise ValueError(
            f"block index of bucket {b.name!r}: {s} elements per device, past int32; plan it over more devices "
            "or in smaller units."
        )
    tab = np.zeros((7, m, width), np.int64)
    tab[0], tab[1], tab[4] = s, s, nb
    for k, rs in enumerate(runs):
        for r, run in enumerate(sorted(rs)):  # by local start, for the lookup
            tab[:, k, r] = run
    t = tab.astype(np.int32)
    return BucketBlocks(bucket, nb, b.layers or 1, tuple(leaves), *t)


def local_slots(index: BucketBlocks, k: Any, size: int, *, xp: Any = np) -> Any:
    """The slot of each local element of device ``k`` (``index.nb`` at padding).

    Args:
      index: the bucket's :class:`BucketBlocks`.
      k: the device's position on the plan's axis (an int, or ``jax.lax.axis_index`` inside ``shard_map``).
      size: ``S``, the bucket's per-device size.
      xp: ``numpy``, or ``jax.numpy`` inside a traced step.

    Returns:
      ``(S,)`` int32.
    """
    st, en = xp.asarray(index.starts)[k], xp.asarray(index.ends)[k]
    i = xp.arange(size, dtype=xp.int32)
    if xp is np:
        r = np.searchsorted(st, i, side="right") - 1
    else:
        method = "compare_all" if st.shape[0] <= 16 else "scan"
        r = xp.searchsorted(st, i, side="right", method=method) - 1
    rc = xp.clip(r, 0, st.shape[0] - 1)
    inside = (r >= 0) & (i < en[rc])
    row = lambda t: xp.asarray(t)[k][rc]
    kind, o = row(index.kind), i - st[rc] + row(index.origin)
    num = o
    done: dict[tuple[Any, ...], Any] = {}
    for j, lb in enumerate(index.leaves):
        if lb.exact:
            continue
        key = (lb.shape, lb.storage, lb.numbering, lb.block)
        if key not in done:  # leaves of one shape and storage share the arithmetic
            done[key] = lb.number(o, xp)
        num = xp.where(kind == j, done[key], num)
    slot = row(index.base) + num - row(index.first)
    return xp.where(inside, slot, index.nb).astype(xp.int32)
