"""FP8 block-scaled all-gather: each device quantizes its own whole blocks, the wire carries codes + scales.

With ``vj.MixedPrecision(fp8_gather=(bh, bw))`` a floating bucket is gathered as ``float8_e4m3fn`` codes with
one fp32 scale per ``bh × bw`` tile of every matrix (a leaf of two or more dims per layer), DeepSeek-V3's
weight format. The quantizer is :func:`vescale_jax.quant.quantize`'s, bit for bit::

    scale = max|x| over the tile * fp32(1/448)      code = fp8(x / scale)      x' = code * scale

Each device owns whole tiles (the plan never cuts one: see :func:`block_table`), so the scale of a tile is
computed where the tile lives, with no collective. A leaf split over tensor / expert axes (``vj.plan(...,
tp=...)``) is tiled per TP/EP shard, its local shape, as each group gathers it; a split dim of the shard (one of
the last two) must be a multiple of the tile's (else ValueError naming the leaf), so the tiles are the logical
leaf's and the gathered weights the FSDP-only plan's.

Vectors and other leaves of fewer than two dims are sent exactly: each element is its own block with scale
``x`` and code ``1``, so ``x' = x`` (they are a small part of a model; quantizing a norm's scale to 3 mantissa
bits would change the numerics for nothing).

The wire is one ``uint8`` all-gather per bucket: ``S`` code bytes then the device's ``NB`` scales (4 bytes
each; ``NB`` is the most blocks any device holds, plus one for padding). After the gather every device
dequantizes the whole buffer into the compute dtype and unpacks it as usual. The backward is unchanged: the
cotangent of the dequantized leaves is reduce-scattered in the reduce dtype (a straight-through gradient).

Block ids come from a small per-device table of *pieces* (at most a few per leaf), evaluated with integer
arithmetic on an iota: a piece ``(lo, hi, base, w, bh, bw)`` numbers element ``j`` as
``base + (j - lo) // (bh * w) * ceil(w / bw) + (j - lo) % w // bw``, which covers a run of contiguous tiles
(``w = bh*bw``-sized blocks, one row), a run of whole ``bh``-row bands of a row-major matrix, and single
elements (``w = bh = bw = 1``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._cache import plan_cache
from vescale_jax.layout import _tp as _tp
from vescale_jax.layout._plan import Bucket, Plan

__all__ = ["BlockTable", "block_table", "dequantize_full", "quantize_local", "wire_bytes", "wire_gather"]

_QMAX = 448.0
_FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True, eq=False)
class BlockTable:
    """Where each device's blocks of one bucket are (one layer's layout for a stacked bucket).

    Attributes:
      pieces: ``(m, P, 7)`` int64: ``lo, hi, base, w, bh, bw, exact`` per piece (unused pieces are empty).
      num_blocks: ``NB``: blocks per device, padded to the most any device holds, plus one for padding.
      quantized: how many elements of one layer are sent as FP8 tile codes (the rest exactly).
    """

    pieces: np.ndarray
    num_blocks: int
    quantized: int


def _refuse(spec: Any, shape: tuple[int, ...], block: tuple[int, int], d: int, why: str) -> ValueError:
    bh, bw = block
    rows = f" (or vj.rows({bh}), whose bands hold whole tiles)" if shape[-2] % bh == 0 else ""
    if spec.tp:  # a TP/EP-split leaf is quantized in tiles of its shards
        axes = sorted({a for dim in spec.tp for a in dim})
        shape_text = f"{spec.shape}, split over {'/'.join(axes)} into shards of {shape} per layer,"
    else:
        shape_text = f"{shape}"
    return ValueError(
        f"vj.MixedPrecision(fp8_gather={block}): leaf {spec.path!r} of shape {shape_text} is planned with "
        f"{spec.granularity!r}, and {why} (element {d} of the leaf): a block's scale is computed over the whole "
        f"block on the device that owns it, never over part of it. Plan the leaf with "
        f"granularity=vj.tiles({bh}, {bw}){rows}."
    )


def _check_split(spec: Any, shape: tuple[int, ...], block: tuple[int, int], *, stacked: bool) -> None:
    """Refuses a matrix split over tensor / expert axes whose shard's split dim (one of the last two) is not a
    multiple of the tile's: its shards' edge tiles would not be tiles of the logical leaf (the gathered weights
    would depend on the TP/EP size)."""
    bad = _tp.misaligned_split(spec.tp, shape, block, stacked=stacked)
    if bad is None:
        return
    d, t, axes = bad
    raise ValueError(
        f"vj.MixedPrecision(fp8_gather={block}): leaf {spec.path!r} of shape {spec.shape} is split over "
        f"{'/'.join(axes)} into shards of {shape} (per layer), whose dim {d} ({shape[d]}) is not a "
        f"multiple of the tile's {t}: the shards' tiles would not be tiles of the leaf. Choose a tile that "
        f"divides {shape[d]}, or leave that dim unsplit (tp=)."
    )


def _leaf_pieces(spec, shape, gran, d0, d1, lo, block, base):
    """Pieces for elements ``[d0, d1)`` of one leaf (its storage order) at local offset ``lo``; (pieces, blocks)."""
    bh, bw = block
    out = []
    if len(shape) < 2:  # exact: one block per element
        return [(lo, lo + d1 - d0, base, 1, 1, 1, 1)], d1 - d0
    h, w = shape[-2:]
    if getattr(gran, "kind", None) == "tiles":
        if (gran.bh, gran.bw) != (bh, bw):
            raise _refuse(spec, shape, block, d0, f"its {gran.bh}x{gran.bw} tiles are not the {bh}x{bw} blocks")
        start, count = 0, 0
        for n, b in gran.segments(shape):
            a, z = max(d0, start), min(d1, start + n)
            if z > a:
                if (a - start) % b or ((z - start) % b and z != start + n):
                    raise _refuse(spec, shape, block, a, "a device boundary cuts one of its tiles")
                k = -(-(z - a) // b)
                out.append((lo + a - d0, lo + z - d0, base + count, b, 1, b, 0))
                count += k
            start += n
        return out, count
    # row-major: each device's part must be whole bh-row bands of each matrix
    per, band, ntj = h * w, bh * w, -(-w // bw)
    count, a = 0, d0
    while a < d1:
        z = min(d1, (a // per + 1) * per) if h % bh else d1  # bands continue across matrices when bh | h
        ra, rz = a % per, (z - 1) % per + 1
        if ra % band or (rz % band and rz != per):
            raise _refuse(spec, shape, block, a if ra % band else z, "a device boundary cuts a band of its tiles")
        k = -(-(z - a) // band) * ntj if h % bh == 0 else -(-(rz - ra) // band) * ntj
        out.append((lo + a - d0, lo + z - d0, base + count, w, bh, bw, 0))
        count, a = count + k, z
    return out, count


@plan_cache
def block_table(plan: Plan, bucket_index: int, block: tuple[int, int]) -> BlockTable:
    """The :class:`BlockTable` of one bucket for ``block`` tiles.

    Raises:
      ValueError: naming the leaf, its shape, the block and the granularity to plan it with, when a device
        boundary would cut a block of a matrix.
    """
    bucket: Bucket = plan.buckets[bucket_index]
    layout, s, m = bucket.layout, bucket.layout.shard_size, bucket.layout.num_devices
    per_device: list[list[tuple[int, ...]]] = [[] for _ in range(m)]
    counts = [0] * m
    quantized = 0
    for slot, leaf in enumerate(bucket.leaves):
        spec = plan.leaves[leaf]
        shape = plan.layer_shape(spec)
        o, n = layout.offsets[slot], layout.sizes[slot]
        if len(shape) >= 2:
            quantized += n
            _check_split(spec, shape, block, stacked=bucket.layers is not None)
        for k in range(o // s if s else 0, -(-(o + n) // s) if s else 0):
            a, z = max(o, k * s), min(o + n, (k + 1) * s)
            if z <= a:
                continue
            pieces, count = _leaf_pieces(spec, shape, spec.granularity, a - o, z - o, a - k * s, block, counts[k])
            per_device[k].extend(pieces)
            counts[k] += count
    width = max(1, max(len(p) for p in per_device))
    table = np.zeros((m, width, 7), np.int64)
    table[:, :, 3:6] = 1
    for k, pieces in enumerate(per_device):
        for r, piece in enumerate(pieces):
            table[k, r] = piece
    return BlockTable(table, max(counts, default=0) + 1, quantized)


def _ids(table: BlockTable, k: Any, j: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(block id, exact) of local element ``j`` on device ``k`` (``k`` broadcasts against ``j``)."""
    pieces = jnp.asarray(table.pieces.astype(np.int32))[k]  # (..., P, 7)
    shape = jnp.broadcast_shapes(jnp.shape(j), (*pieces.shape[:-2], 1))
    ids = jnp.full(shape, table.num_blocks - 1, jnp.int32)
    exact = jnp.zeros(ids.shape, bool)
    for r in range(table.pieces.shape[1]):
        lo, hi, base, w, bh, bw, ex = (pieces[..., r, f][..., None] for f in range(7))
        q = j - lo
        inside = (q >= 0) & (j < hi)
        num = base + q // (bh * w) * ((w + bw - 1) // bw) + q % w // bw
        ids = jnp.where(inside, num, ids)
        exact = jnp.where(inside, ex > 0, exact)
    return ids, exact


def quantize_local(x: jax.Array, table: BlockTable, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Device ``k``'s local ``(S,)`` shard -> (``(S,)`` fp8 codes, ``(NB,)`` fp32 scales)."""
    nb = table.num_blocks
    xf = x.astype(jnp.float32)
    ids, exact = _ids(table, k, jnp.arange(x.shape[-1], dtype=jnp.int32))
    amax = jax.ops.segment_max(jnp.abs(xf), ids, num_segments=nb)
    amax = jnp.where(amax > 0, amax, jnp.float32(0))  # empty segments: -inf
    value = jax.ops.segment_sum(jnp.where(exact, xf, 0), ids, num_segments=nb)
    is_exact = jax.ops.segment_max(exact.astype(jnp.int32), ids, num_segments=nb) > 0
    scales = jnp.where(is_exact, value, amax * np.float32(1.0 / _QMAX))
    s = scales[ids]
    y = jnp.where(exact, jnp.float32(1), xf / jnp.where(s != 0, s, jnp.float32(1)))
    y = jnp.where(exact | (s != 0), y, jnp.float32(0))
    return y.astype(_FP8), scales


def dequantize_full(codes: jax.Array, scales: jax.Array, table: BlockTable, dtype: Any) -> jax.Array:
    """``(m, S)`` gathered codes and ``(m, NB)`` scales -> the ``(m*S,)`` buffer in ``dtype``."""
    m, s = codes.shape
    ids, _ = _ids(table, jnp.arange(m), jnp.arange(s, dtype=jnp.int32))
    out = codes.astype(jnp.float32) * jnp.take_along_axis(scales, ids, axis=1)
    return jnp.reshape(out, (m * s,)).astype(dtype)


def wire_gather(x: jax.Array, table: BlockTable, axis: Any, dtype: Any) -> jax.Array:
    """FP8 block-scaled all-gather of a local ``(S,)`` (or stacked ``(L, S)``) shard over ``axis``, dequantized
    to ``dtype``: ``(m*S,)`` (or ``(L, m*S)``). Inside ``shard_map``; not differentiable by itself (the callers'
    custom VJPs reduce-scatter the cotangent)."""
    k = jax.lax.axis_index(axis)
    m = table.pieces.shape[0]

    def one(row):
        codes, scales = quantize_local(row, table, k)
        return jnp.concatenate(
            [
                jax.lax.bitcast_convert_type(codes, jnp.uint8),
                jnp.reshape(jax.lax.bitcast_convert_type(scales, jnp.uint8), (-1,)),
            ]
        )

    def back(full):
        full = jnp.reshape(full, (m, -1))
        s = x.shape[-1]
        codes = jax.lax.bitcast_convert_type(full[:, :s], _FP8)
        scales = jax.lax.bitcast_convert_type(jnp.reshape(full[:, s:], (m, -1, 4)), jnp.float32)
        return dequantize_full(codes, scales, table, dtype)

    if x.ndim == 1:
        return back(jax.lax.all_gather(one(x), axis, tiled=True))
    wire = jax.vmap(one)(x)
    full = jax.lax.all_gather(wire, axis, axis=1, tiled=True)
    return jax.vmap(back)(full)


def wire_bytes(table: BlockTable, shard_size: int) -> int:
    """Bytes one device sends per layer: ``S`` codes and ``NB`` fp32 scales."""
    return shard_size + 4 * table.num_blocks
