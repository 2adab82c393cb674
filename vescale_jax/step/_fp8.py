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

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from vescale_jax.kernels import _fp8 as kfp8
from vescale_jax.kernels._dispatch import kernel_choices, per_platform
from vescale_jax.kernels._policy import KernelPolicy
from vescale_jax.layout._blocks import BlockCut, BucketBlocks, block_index
from vescale_jax.layout._bucket_layout import BucketLayout
from vescale_jax.layout._plan import Plan

__all__ = [
    "block_table",
    "dequantize_full",
    "fused",
    "num_blocks",
    "quantize_local",
    "wire_bytes",
    "wire_gather",
    "wire_gather_leaves",
]

FP8 = kfp8.FP8


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
    return kfp8.num_blocks(table)


quantize_local = kfp8.quantize_reference
"""Device ``k``'s local ``(S,)`` shard -> (``(S,)`` fp8 codes, ``(NB,)`` fp32 scales): the XLA path, and the
reference of the fused kernel :func:`vescale_jax.kernels._fp8.quantize`."""

dequantize_full = kfp8.dequantize_reference
"""``(m, S)`` gathered codes and ``(m, NB)`` scales -> the ``(m*S,)`` buffer in ``dtype`` (the XLA path)."""


def fused(
    kernels_policy: KernelPolicy | None, layout: BucketLayout, table: BucketBlocks
) -> dict[str, tuple[tuple[str, Any], ...] | None] | None:
    """The fused FP8 kernels' options per lowering platform under ``kernels_policy`` (None: the XLA path).

    The Pallas policy (``KernelPolicy(mode="pallas")``) runs them interpreted on CPU and compiled when lowered
    for CUDA: on Mosaic GPU for a bucket whose blocks are contiguous runs under a Mosaic GPU policy (the default
    on JAX 0.11 and later), else with Triton (per-lane gathers) while JAX ships it;
    :meth:`KernelPolicy.fused_implementation` answers per bucket and platform. A bucket no kernel takes stays on
    the XLA path."""
    if kernels_policy is None:
        return None
    return kernel_choices(kernels_policy, layout, jnp.float32, FP8, blocks=table)


def _wire(
    x: jax.Array, table: BucketBlocks, axis: Any, opts: dict[str, tuple[tuple[str, Any], ...] | None] | None
) -> jax.Array:
    """The local ``(S,)`` (or ``(L, S)``) shard's wire, all-gathered: ``(m, S + 4*NB)`` (or ``(L, m, ...)``) bytes."""
    k = jax.lax.axis_index(axis)
    m = table.starts.shape[0]

    def quantize(c, row, k):
        return quantize_local(row, table, k) if c is None else kfp8.quantize(row, table, k, **dict(c))

    def one(row):
        codes, scales = quantize(None, row, k) if opts is None else per_platform(opts, quantize, row, k)
        return jnp.concatenate(
            [
                jax.lax.bitcast_convert_type(codes, jnp.uint8),
                jnp.reshape(jax.lax.bitcast_convert_type(scales, jnp.uint8), (-1,)),
            ]
        )

    if x.ndim == 1:
        return jnp.reshape(jax.lax.all_gather(one(x), axis, tiled=True), (m, -1))
    wire = jax.vmap(one)(x)
    return jnp.reshape(jax.lax.all_gather(wire, axis, axis=1, tiled=True), (x.shape[0], m, -1))


def _split(full: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """``(m, S + 4*NB)`` bytes -> ``(m, S)`` codes and ``(m, NB)`` scales."""
    m = full.shape[0]
    codes = jax.lax.bitcast_convert_type(full[:, :size], FP8)
    scales = jax.lax.bitcast_convert_type(jnp.reshape(full[:, size:], (m, -1, 4)), jnp.float32)
    return codes, scales


def wire_gather(
    x: jax.Array,
    table: BucketBlocks,
    axis: Any,
    dtype: Any,
    *,
    kernels_policy: KernelPolicy | None = None,
    layout: BucketLayout | None = None,
) -> jax.Array:
    """FP8 block-scaled all-gather of a local ``(S,)`` (or stacked ``(L, S)``) shard over ``axis``, dequantized
    to ``dtype``: ``(m*S,)`` (or ``(L, m*S)``). Inside ``shard_map``; not differentiable by itself (the callers'
    custom VJPs reduce-scatter the cotangent). Under a Pallas ``kernels_policy`` the quantizer is the fused
    kernel (:func:`vescale_jax.kernels._fp8.quantize`; pass the bucket's ``layout`` with it); the dequantization
    into a whole buffer stays XLA's."""
    full = _wire(x, table, axis, None if layout is None else fused(kernels_policy, layout, table))
    back = lambda f: dequantize_full(*_split(f, x.shape[-1]), table, dtype)
    return back(full) if x.ndim == 1 else jax.vmap(back)(full)


def wire_gather_leaves(
    x: jax.Array,
    table: BucketBlocks,
    axis: Any,
    dtype: Any,
    *,
    layout: BucketLayout,
    shapes: Sequence[tuple[int, ...]],
    storage: Sequence[Any],
    kernels_policy: KernelPolicy,
) -> list[jax.Array] | None:
    """The FP8 gather straight into the leaves with the fused kernels: quantize in one kernel, all-gather
    the bytes, dequantize + unpack (+ tile relayout) in one kernel. None when the policy takes the XLA path
    (then :func:`wire_gather` and an unpack).

    Args:
      x: the local ``(S,)`` shard (or a stacked bucket's ``(L, S)`` rows).
      table: the bucket's block index.
      axis: the plan's mesh axis.
      dtype: the leaves' (gather) dtype.
      layout: the bucket layout.
      shapes: each slot's per-layer logical shape.
      storage: the bucket's ``storage``.
      kernels_policy: the step's kernel policy.

    Returns:
      The leaves in slot order (with a leading ``L`` for stacked rows), or None.

    Sharding:
      Inside ``shard_map``: ``x`` varies over ``axis``; the leaves are the full tensors on every device.
    """
    opts = fused(kernels_policy, layout, table)
    if opts is None:
        return None
    full = _wire(x, table, axis, opts)

    def dequantize(c, codes, scales):
        kw = dict(dtype=dtype, storage=storage)
        if c is None:
            return kfp8.dequantize_unpack_reference(codes, scales, table, layout, shapes, **kw)
        return kfp8.dequantize_unpack(codes, scales, table, layout, shapes, **kw, **dict(c))

    def back(f):
        return per_platform(opts, dequantize, *_split(f, x.shape[-1]))

    return list(back(full) if x.ndim == 1 else jax.vmap(back)(full))


def wire_bytes(table: BucketBlocks, shard_size: int) -> int:
    """Bytes one device sends per layer: ``S`` codes and ``NB`` fp32 scales."""
    return shard_size + 4 * num_blocks(table)
