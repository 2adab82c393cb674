"""One device's shard of a bucket, read from or written to a Hugging Face checkpoint's files directly.

The device at buffer offset ``start`` of a bucket (``index[-1].start`` of its shard) is in TP/EP group
``g = start // (m*S)`` (0 for a bucket without groups) at position ``start - g*m*S`` of the group's layout. Each
slot's part of that position's ``S`` elements is a range of storage positions of the leaf's TP/EP shard (of one
layer, for a stacked bucket): row-major, or tile-major for a ``vj.tiles`` leaf. A :class:`LeafView` turns storage
positions into the whole leaf's flat indices (tile coordinates from :mod:`vescale_jax.layout._tiles`, then the
group's offsets per dim), which :class:`~vescale_jax.checkpoint._hf_index.Bound` maps to tensor elements. Every
bucket, TP-grouped and tiled included, is thus read and written as the shards a process's devices own: no
process reads or gathers a leaf beyond its own ranges.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from vescale_jax.checkpoint import _hf_index
from vescale_jax.checkpoint._hf_index import Bound, chunks, read_indices, write_indices
from vescale_jax.checkpoint._safetensors_files import Checkpoint, Reader, Writer
from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout import _tp as tp
from vescale_jax.layout._plan import Plan

__all__ = ["LeafView", "fill_shard", "leaf_view", "shard_group", "write_shard"]


@dataclasses.dataclass(frozen=True)
class LeafView:
    """One leaf's TP/EP shard in one group, as its bucket lays it out (per layer).

    Attributes:
      bound: the leaf bound to its tensors.
      local: the shard's per-layer shape (the leaf's own without TP/EP).
      full: the leaf's per-layer shape.
      starts: the shard's first index per dim of ``full`` (``None``: the leaf is not split).
      tiles: the ``vj.tiles`` granularity of a leaf stored tile-major, else ``None``.
    """

    bound: Bound
    local: tuple[int, ...]
    full: tuple[int, ...]
    starts: tuple[int, ...] | None
    tiles: Any

    def _whole(self, layer: int, t: np.ndarray) -> np.ndarray:
        """Flat indices ``t`` of the shard's layer ``layer`` (row-major in ``local``) -> the whole leaf's."""
        n_full = math.prod(self.full)
        if self.starts is None:
            return t + layer * n_full
        coords = np.unravel_index(t, self.local)
        flat = np.ravel_multi_index([c + s for c, s in zip(coords, self.starts, strict=True)], self.full)
        return np.asarray(flat, np.int64) + layer * n_full

    def positions(self, layer: int, lo: int, hi: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Storage positions ``[lo, hi)`` of layer ``layer`` in chunks of at most ``_hf_index.CHUNK``: ``(offsets from
        lo, the whole leaf's flat indices)``, int64 arrays (a transposed row-major leaf in column bands)."""
        if self.tiles is not None:
            *_, h, w = self.local
            step = _hf_index.CHUNK
            for a in range(lo, hi, step):
                p = np.arange(a, min(hi, a + step), dtype=np.int64)
                lead, row, col = tiles.coords(p, self.local, self.tiles)
                yield p - lo, self._whole(layer, (lead * h + row) * w + col)
            return
        cols = self.local[-1] if self.local else 1
        for t in chunks(self.bound, lo, hi, cols=cols):
            yield t - lo, self._whole(layer, t)


def shard_group(plan: Plan, b: int, start: int) -> tuple[int, int]:
    """``(group, position in the group's layout)`` of the shard at buffer offset ``start`` of bucket ``b``."""
    return divmod(start, plan.buckets[b].layout.total_size)


def leaf_view(plan: Plan, i: int, group: int, bound: Bound) -> LeafView:
    """The :class:`LeafView` of leaf ``i`` in TP/EP group ``group`` of its bucket."""
    spec = plan.leaves[i]
    bucket = plan.buckets[spec.bucket]
    stacked = bucket.layers is not None
    local = tuple(plan.layer_shape(spec))
    full = tuple(spec.shape[1:] if stacked else spec.shape)
    gran = bucket.storage[spec.slot] if bucket.storage else None
    starts = None
    if spec.tp and local != full:
        sizes = dict(plan.mesh.shape)
        coords = tp.group_coords(group, bucket.groups, sizes)
        lead = len(spec.shape) - len(spec.tp)
        whole = [0] * lead
        for n, axes in zip(spec.shape[lead:], spec.tp, strict=True):
            k = 0
            for a in axes:
                k = k * sizes[a] + coords[a]
            whole.append(k * (n // math.prod(sizes[a] for a in axes)))
        starts = tuple(whole[1:] if stacked else whole)
    return LeafView(bound, local, full, starts, gran)


def _slots(plan: Plan, b: int, start: int, bounds: Sequence[Bound]):
    """Per slot of bucket ``b`` that the shard at ``start`` holds a part of: ``(leaf, view, lo, hi, at)``, the
    leaf's storage positions ``[lo, hi)`` per layer at offset ``at`` of the shard."""
    bucket = plan.buckets[b]
    layout, S = bucket.layout, bucket.layout.shard_size
    group, s0 = shard_group(plan, b, start)
    for slot, i in enumerate(bucket.leaves):
        o, n = layout.offsets[slot], layout.sizes[slot]
        lo, hi = max(o, s0), min(o + n, s0 + S)
        if hi > lo:
            yield i, leaf_view(plan, i, group, bounds[i]), lo - o, hi - o, lo - s0


def fill_shard(
    plan: Plan,
    b: int,
    start: int,
    bounds: Sequence[Bound],
    ckpt: Checkpoint,
    reader: Reader,
    cast: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """The shard at buffer offset ``start`` of bucket ``b`` (its ``local_shape``, padding 0), read from the files.

    Args:
      plan: the plan.
      b: the bucket's index.
      start: the shard's offset in the bucket's (per-layer) global buffer.
      bounds: every leaf bound to its tensors.
      ckpt: the checkpoint.
      reader: reads (and counts) the byte runs.
      cast: file dtype -> the bucket's dtype, per chunk.

    Returns:
      The host shard; host memory beyond it: index arrays and read buffers of one ``_hf_index.CHUNK``.

    Sharding:
      Reads only the tensor elements of this one shard.
    """
    bucket = plan.buckets[b]
    out = np.zeros(bucket.local_shape, np.dtype(bucket.dtype))
    rows = out.reshape(-1, bucket.layout.shard_size)
    for i, view, lo, hi, at in _slots(plan, b, start, bounds):
        for layer in range(rows.shape[0]):
            dest = rows[layer, at : at + hi - lo]
            for off, t in view.positions(layer, lo, hi):
                dest[off] = read_indices(bounds[i], t, ckpt, reader, cast)
    return out


def write_shard(
    plan: Plan,
    b: int,
    start: int,
    data: np.ndarray,
    bounds: Sequence[Bound],
    writes: Mapping[int, set[str]],
    where: Mapping[str, tuple[str, int]],
    dtypes: Mapping[str, np.dtype],
    writer: Writer,
) -> None:
    """Writes the shard at buffer offset ``start`` of bucket ``b`` (``data``, its ``local_shape``) into the files.

    Args:
      plan: the plan.
      b: the bucket's index.
      start: the shard's offset in the bucket's (per-layer) global buffer.
      data: the shard's values on the host.
      bounds: every leaf bound to its tensors.
      writes: per leaf, the tensors it writes (a tied tensor by one leaf only).
      where: per tensor, ``(file, absolute offset)``.
      dtypes: per tensor, its file dtype.
      writer: writes (and counts) the byte runs.

    Sharding:
      Writes only the tensor elements of this one shard.
    """
    rows = np.asarray(data).reshape(-1, plan.buckets[b].layout.shard_size)
    for i, view, lo, hi, at in _slots(plan, b, start, bounds):
        files = {n: where[n] for n in writes[i]}
        if not files:
            continue
        for layer in range(rows.shape[0]):
            src = rows[layer, at : at + hi - lo]
            for off, t in view.positions(layer, lo, hi):
                write_indices(bounds[i], t, src[off], files, dtypes, writer)
