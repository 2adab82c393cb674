"""FP8 block-scaled all-gather: each device quantizes its own whole blocks, the wire carries codes + scales.

With ``vj.MixedPrecision(fp8_gather=(bh, bw))`` a floating bucket is gathered as ``float8_e4m3fn`` codes with
one fp32 scale per ``bh × bw`` tile of every matrix (a leaf of two or more dims per layer), DeepSeek-V3's
weight format. The quantizer is :func:`vescale_jax.quant.quantize`'s, bit for bit::

    scale = max|x| over the tile * fp32(1/448)      code = fp8(x / scale)      x' = code * scale

Each device owns whole tiles (the plan never cuts one), so the scale of a tile is computed where the tile
lives, with no collective. Which tile each local element is in comes from the bucket's block index
(:mod:`vescale_jax.layout._blocks`, the one 8-bit AdamW uses, with every matrix quantized), which refuses a
layout that cuts a tile. A leaf split over tensor / expert axes (``vj.plan(..., tp=...)``) is tiled per TP/EP
shard, its local shape, as each group gathers it; a split dim of the shard (one of the last two) must be a
multiple of the tile's (else ValueError naming the leaf), so the tiles are the logical leaf's and the gathered
weights the FSDP-only plan's.

Vectors and other leaves of fewer than two dims are sent exactly: each element is its own block with scale
``x`` and code ``1``, so ``x' = x`` (they are a small part of a model; quantizing a norm's scale to 3 mantissa
bits would change the numerics for nothing).

The wire is one ``uint8`` all-gather per bucket: ``S`` code bytes then the device's ``NB`` scales (4 bytes
each; ``NB`` is the most blocks any device holds, plus one for padding). After the gather every device
dequantizes the whole buffer into the compute dtype and unpacks it as usual. The backward is unchanged: the
cotangent of the dequantized leaves is reduce-scattered in the reduce dtype (a straight-through gradient).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.layout._blocks import BlockCut, BucketBlocks, block_index, local_slots
from vescale_jax.layout._plan import Plan

__all__ = ["block_table", "dequantize_full", "num_blocks", "quantize_local", "wire_bytes", "wire_gather"]

_QMAX = 448.0
_FP8 = jnp.float8_e4m3fn


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


def _refuse_split(cut: BlockCut) -> ValueError:
    """A matrix split over tensor / expert axes whose shard's split dim (one of the last two) is not a multiple
    of the tile's: its shards' edge tiles would not be tiles of the logical leaf (the gathered weights would
    depend on the TP/EP size)."""
    spec, shape, block = cut.spec, cut.shape, cut.block
    d, t, axes = cut.split
    return ValueError(
        f"vj.MixedPrecision(fp8_gather={block}): leaf {spec.path!r} of shape {spec.shape} is split over "
        f"{'/'.join(axes)} into shards of {shape} (per layer), whose dim {d} ({shape[d]}) is not a "
        f"multiple of the tile's {t}: the shards' tiles would not be tiles of the leaf. Choose a tile that "
        f"divides {shape[d]}, or leave that dim unsplit (tp=)."
    )


def block_table(plan: Plan, bucket_index: int, block: tuple[int, int]) -> BucketBlocks:
    """The block index (:func:`vescale_jax.layout._blocks.block_index`) of one bucket for ``block`` tiles:
    every matrix (two or more dims per layer) quantized, every other leaf exact.

    Raises:
      ValueError: naming the leaf, its shape, the block and the granularity to plan it with, when a device
        boundary would cut a block of a matrix, or a TP/EP split would cut the leaf's tiles.
    """
    try:
        return block_index(plan, bucket_index, block, 0)
    except BlockCut as cut:
        if cut.reason == "split":
            raise _refuse_split(cut) from None
        if cut.reason == "tiles":
            g, (bh, bw) = cut.storage, block
            why = f"its {g.bh}x{g.bw} tiles are not the {bh}x{bw} blocks (nor multiples of them) and span devices"
        else:
            why = "a device boundary cuts a band of its tiles"
        raise _refuse(cut.spec, cut.shape, block, cut.element, why) from None


def num_blocks(table: BucketBlocks) -> int:
    """``NB``: scale slots per device on the wire: the most blocks any device holds, plus one for padding."""
    return table.nb + 1


def _ids(table: BucketBlocks, k: Any, size: int) -> jax.Array:
    """``(S,)`` int32: the block (slot) of each local element of device ``k`` (``NB - 1`` at padding)."""
    return local_slots(table, k, size, xp=jnp)


def quantize_local(x: jax.Array, table: BucketBlocks, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Device ``k``'s local ``(S,)`` shard -> (``(S,)`` fp8 codes, ``(NB,)`` fp32 scales)."""
    nb = num_blocks(table)
    xf = x.astype(jnp.float32)
    ids = _ids(table, k, x.shape[-1])
    exact = jnp.asarray(table.exact_slots)[k][ids]
    amax = jax.ops.segment_max(jnp.abs(xf), ids, num_segments=nb)
    amax = jnp.where(amax > 0, amax, jnp.float32(0))  # empty segments: -inf
    value = jax.ops.segment_sum(jnp.where(exact, xf, 0), ids, num_segments=nb)
    is_exact = jax.ops.segment_max(exact.astype(jnp.int32), ids, num_segments=nb) > 0
    scales = jnp.where(is_exact, value, amax * np.float32(1.0 / _QMAX))
    s = scales[ids]
    y = jnp.where(exact, jnp.float32(1), xf / jnp.where(s != 0, s, jnp.float32(1)))
    y = jnp.where(exact | (s != 0), y, jnp.float32(0))
    return y.astype(_FP8), scales


def dequantize_full(codes: jax.Array, scales: jax.Array, table: BucketBlocks, dtype: Any) -> jax.Array:
    """``(m, S)`` gathered codes and ``(m, NB)`` scales -> the ``(m*S,)`` buffer in ``dtype``."""
    m, s = codes.shape
    ids = jax.vmap(lambda k: _ids(table, k, s))(jnp.arange(m))
    out = codes.astype(jnp.float32) * jnp.take_along_axis(scales, ids, axis=1)
    return jnp.reshape(out, (m * s,)).astype(dtype)


def wire_gather(x: jax.Array, table: BucketBlocks, axis: Any, dtype: Any) -> jax.Array:
    """FP8 block-scaled all-gather of a local ``(S,)`` (or stacked ``(L, S)``) shard over ``axis``, dequantized
    to ``dtype``: ``(m*S,)`` (or ``(L, m*S)``). Inside ``shard_map``; not differentiable by itself (the callers'
    custom VJPs reduce-scatter the cotangent)."""
    k = jax.lax.axis_index(axis)
    m = table.starts.shape[0]

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


def wire_bytes(table: BucketBlocks, shard_size: int) -> int:
    """Bytes one device sends per layer: ``S`` codes and ``NB`` fp32 scales."""
    return shard_size + 4 * num_blocks(table)
