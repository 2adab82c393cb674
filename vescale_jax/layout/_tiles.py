"""Storage order of a leaf in its bucket: row-major, or tile-major for ``vj.tiles(bh, bw)``.

A leaf of shape ``(*lead, H, W)`` planned with ``vj.tiles(bh, bw)`` is stored tile by tile, each ``bh × bw``
tile contiguous and row-major inside, so the atomic block is one tile rather than ``bh`` whole rows. Edge
tiles (when ``bh ∤ H`` or ``bw ∤ W``) are partial. The storage is the concatenation of up to four
*segments*, each a run of equally sized tiles, every one over all leading indices (lead-major)::

    full    tiles bh × bw    (the top-left  Hf × Wf, Hf = H - H % bh, Wf = W - W % bw; row of tiles major)
    right   tiles bh × w'    (the right strip, w' = W - Wf)
    bottom  tiles h' × bw    (the bottom strip, h' = H - Hf)
    corner  one   h' × w'    tile per leading index

Inside one segment every block has the same size, so a device boundary never cuts a tile when it falls on
that segment's block grid (see ``plan_bucket(..., segments=)``). Every other granularity (and a tiles leaf of
fewer than two dims) is stored row-major. The functions here take the array module (``numpy`` or
``jax.numpy``) so the same index math builds static tables and runs inside a traced step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["coords", "from_storage", "is_tiled", "position", "segments", "storage_index", "to_storage"]


def is_tiled(shape: Sequence[int], gran: Any) -> bool:
    """True when a leaf of ``shape`` with granularity ``gran`` is stored tile-major."""
    return getattr(gran, "kind", None) == "tiles" and len(shape) >= 2


def _dims(shape: Sequence[int], gran: Any):
    *lead, h, w = (int(d) for d in shape)
    bh, bw = gran.bh, gran.bw
    hf, wf = h - h % bh, w - w % bw
    return math.prod(lead), h, w, bh, bw, hf, wf


def segments(shape: Sequence[int], gran: Any) -> tuple[tuple[int, int], ...] | None:
    """``((elements, block), ...)`` of a tile-major leaf's non-empty segments in storage order; None when the
    leaf is row-major (one uniform block, ``gran.block(shape)``)."""
    if not is_tiled(shape, gran):
        return None
    return _segments(tuple(int(d) for d in shape), gran.bh, gran.bw)


@functools.lru_cache(maxsize=4096)
def _segments(shape: tuple[int, ...], bh: int, bw: int) -> tuple[tuple[int, int], ...]:
    *lead, h, w = shape
    p, hf, wf = math.prod(lead), h - h % bh, w - w % bw
    hp, wp = h - hf, w - wf
    parts = ((p * hf * wf, bh * bw), (p * hf * wp, bh * wp), (p * hp * wf, hp * bw), (p * hp * wp, hp * wp))
    return tuple((n, b) for n, b in parts if n)


def to_storage(x: Any, shape: Sequence[int], gran: Any, xp: Any = np) -> Any:
    """``x`` of shape ``(*batch, *shape)`` -> ``(*batch, size)`` in storage order."""
    shape = tuple(int(d) for d in shape)
    batch = tuple(x.shape[: x.ndim - len(shape)])
    if not is_tiled(shape, gran):
        return xp.reshape(x, (*batch, math.prod(shape)))
    p, h, w, bh, bw, hf, wf = _dims(shape, gran)
    hp, wp = h - hf, w - wf
    nb = len(batch)
    x = xp.reshape(x, (*batch, p, h, w))
    parts = []
    if hf and wf:
        a = xp.reshape(x[..., :hf, :wf], (*batch, p, hf // bh, bh, wf // bw, bw))
        a = xp.transpose(a, (*range(nb), nb, nb + 1, nb + 3, nb + 2, nb + 4))
        parts.append(xp.reshape(a, (*batch, -1)))
    if hf and wp:
        parts.append(xp.reshape(x[..., :hf, wf:], (*batch, -1)))
    if hp and wf:
        c = xp.reshape(x[..., hf:, :wf], (*batch, p, hp, wf // bw, bw))
        c = xp.transpose(c, (*range(nb), nb, nb + 2, nb + 1, nb + 3))
        parts.append(xp.reshape(c, (*batch, -1)))
    if hp and wp:
        parts.append(xp.reshape(x[..., hf:, wf:], (*batch, -1)))
    if not parts:
        return xp.reshape(x, (*batch, 0))
    return parts[0] if len(parts) == 1 else xp.concatenate(parts, axis=-1)


def from_storage(flat: Any, shape: Sequence[int], gran: Any, xp: Any = np) -> Any:
    """``flat`` of shape ``(*batch, size)`` in storage order -> ``(*batch, *shape)``."""
    shape = tuple(int(d) for d in shape)
    batch = tuple(flat.shape[:-1])
    if not is_tiled(shape, gran) or not math.prod(shape):  # row-major, or empty (a zero-width leaf has no tiles)
        return xp.reshape(flat, (*batch, *shape))
    p, h, w, bh, bw, hf, wf = _dims(shape, gran)
    hp, wp = h - hf, w - wf
    nb = len(batch)
    pieces, start = {}, 0
    for name, n in (("a", p * hf * wf), ("b", p * hf * wp), ("c", p * hp * wf), ("d", p * hp * wp)):
        if n:
            pieces[name] = flat[..., start : start + n]
        start += n
    rows = []
    if hf:
        top = []
        if wf:
            a = xp.reshape(pieces["a"], (*batch, p, hf // bh, wf // bw, bh, bw))
            a = xp.transpose(a, (*range(nb), nb, nb + 1, nb + 3, nb + 2, nb + 4))
            top.append(xp.reshape(a, (*batch, p, hf, wf)))
        if wp:
            top.append(xp.reshape(pieces["b"], (*batch, p, hf, wp)))
        rows.append(top[0] if len(top) == 1 else xp.concatenate(top, axis=-1))
    if hp:
        bottom = []
        if wf:
            c = xp.reshape(pieces["c"], (*batch, p, wf // bw, hp, bw))
            c = xp.transpose(c, (*range(nb), nb, nb + 2, nb + 1, nb + 3))
            bottom.append(xp.reshape(c, (*batch, p, hp, wf)))
        if wp:
            bottom.append(xp.reshape(pieces["d"], (*batch, p, hp, wp)))
        rows.append(bottom[0] if len(bottom) == 1 else xp.concatenate(bottom, axis=-1))
    if not rows:
        return xp.reshape(flat, (*batch, *shape))
    x = rows[0] if len(rows) == 1 else xp.concatenate(rows, axis=-2)
    return xp.reshape(x, (*batch, *shape))


def storage_index(shape: Sequence[int], gran: Any) -> np.ndarray:
    """``index[j]``: the row-major logical flat index of the element at storage position ``j`` (int64)."""
    n = math.prod(int(d) for d in shape)
    return to_storage(np.arange(n, dtype=np.int64).reshape(tuple(shape)), shape, gran)


def coords(offset: Any, shape: Sequence[int], gran: Any, xp: Any = np) -> tuple[Any, Any, Any]:
    """``(lead, row, col)`` of the elements at storage positions ``offset`` (integer array) of a leaf.

    ``lead`` is the flat index over the leading dims (0 for a matrix); for a leaf of fewer than two dims,
    ``row`` is 0 and ``col`` the flat index. Pure integer arithmetic, elementwise in ``offset``.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        zero = offset * 0
        return zero, zero, offset
    if not is_tiled(shape, gran):
        h, w = shape[-2:]
        return offset // (h * w), offset % (h * w) // w, offset % w
    p, h, w, bh, bw, hf, wf = _dims(shape, gran)
    hp, wp = h - hf, w - wf
    ntj = wf // bw
    bounds = np.cumsum([0, p * hf * wf, p * hf * wp, p * hp * wf])
    lead, row, col = offset * 0, offset * 0, offset * 0
    # full tiles
    r = offset
    if hf * wf:
        pa, ra = r // (hf * wf), r % (hf * wf)
        tile, e = ra // (bh * bw), ra % (bh * bw)
        lead, row, col = pa, tile // ntj * bh + e // bw, tile % ntj * bw + e % bw
    for k, (size, rows_of, cols_of) in enumerate(
        (
            (hf * wp, lambda q: q // max(wp, 1), lambda q: wf + q % max(wp, 1)),
            (hp * wf, lambda q: hf + q % (hp * bw) // bw, lambda q: q // max(hp * bw, 1) * bw + q % bw),
            (hp * wp, lambda q: hf + q // max(wp, 1), lambda q: wf + q % max(wp, 1)),
        ),
        start=1,
    ):
        if not size:
            continue
        q = offset - int(bounds[k])
        inside = offset >= int(bounds[k])
        pq, rq = q // size, q % size
        lead = xp.where(inside, pq, lead)
        row = xp.where(inside, rows_of(rq), row)
        col = xp.where(inside, cols_of(rq), col)
    return lead, row, col


def position(lead: Any, row: Any, col: Any, shape: Sequence[int], gran: Any, xp: Any = np) -> Any:
    """The storage position of logical element ``(lead, row, col)`` of a leaf: the inverse of :func:`coords`.

    ``lead`` is the flat index over the leading dims; for a leaf of fewer than two dims pass ``lead = row = 0``
    and ``col`` its flat index. Pure integer arithmetic, elementwise.
    """
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        return col + 0 * (lead + row)
    if not is_tiled(shape, gran):
        h, w = shape[-2:]
        return (lead * h + row) * w + col
    p, h, w, bh, bw, hf, wf = _dims(shape, gran)
    hp, wp = h - hf, w - wf
    full = lead * hf * wf + ((row // bh) * (wf // bw) + col // bw) * bh * bw + row % bh * bw + col % bw
    right = p * hf * wf + lead * hf * wp + row * wp + (col - wf)
    bottom = p * hf * (wf + wp) + lead * hp * wf + col // bw * hp * bw + (row - hf) * bw + col % bw
    corner = p * (hf * (wf + wp) + hp * wf) + lead * hp * wp + (row - hf) * wp + (col - wf)
    top = xp.where(col < wf, full, right)
    return xp.where(row < hf, top, xp.where(col < wf, bottom, corner))
