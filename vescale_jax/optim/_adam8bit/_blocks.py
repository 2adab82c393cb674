"""The blocks of 8-bit AdamW's state: the layout's block index of every bucket, and the refusals in its words.

Which quantization block each local element is in, the scale slots of each device and the logical order of the
blocks come from :mod:`vescale_jax.layout._blocks` (the index the FP8 gather uses too): a floating leaf with at
least two dims and at least ``min_size`` elements per layer is quantized in ``block`` tiles, every other leaf is
exact (one-element blocks). This module builds it for every bucket and turns a layout the index refuses into
``vj.optim.adamw_8bit``'s error, naming the leaf, its shape, the block, its granularity and the fix.
"""

from __future__ import annotations

import math

from vescale_jax._cache import plan_cache
from vescale_jax.layout._blocks import BlockCut, BucketBlocks, block_index
from vescale_jax.layout._plan import Plan

__all__ = ["build"]


def _refuse(cut: BlockCut) -> ValueError:
    spec, shape, (bh, bw) = cut.spec, cut.shape, cut.block
    if cut.reason == "split":
        d, blk, axes = cut.split
        return ValueError(
            f"vj.optim.adamw_8bit: leaf {spec.path!r} of shape {spec.shape} is split over "
            f"{'/'.join(axes)} into shards of {shape} (per layer), whose dim {d} ({shape[d]}) is not a "
            f"multiple of the {bh}x{bw} block's {blk}: the blocks of the shards would not be blocks "
            f"of the leaf. Choose a block that divides {shape[d]}, or keep the leaf in fp32 with min_size above "
            f"{math.prod(shape)}."
        )
    if cut.reason == "tiles":
        g = cut.storage
        detail = f"spreads it over devices in {g.bh}x{g.bw} tiles, which the {bh}x{bw} blocks do not divide"
    else:
        detail = f"starts device {cut.device} at its element {cut.element}"
    return ValueError(
        f"vj.optim.adamw_8bit: leaf {spec.path!r} of shape {spec.shape} (per layer {shape}) is quantized in "
        f"{bh}x{bw} blocks, but its layout (granularity {spec.granularity!r}) {detail}, so a block's scale would "
        f"need another device's elements. Plan it with granularity vj.tiles({bh}, {bw}) or vj.rows({bh}) (e.g. "
        f"granularity=lambda path, leaf: vj.tiles({bh}, {bw}) if leaf.ndim >= 2 else vj.element()), or keep it "
        f"in fp32 with a larger min_size."
    )


@plan_cache
def build(plan: Plan, block: tuple[int, int], min_size: int) -> tuple[BucketBlocks, ...]:
    """The block index of every bucket (:func:`vescale_jax.layout._blocks.block_index`).

    Raises:
      ValueError: a device boundary inside a quantization block, or a TP/EP split whose shards' blocks are not
        the leaf's (naming the leaf, shape, block, granularity and the fix).
    """
    try:
        return tuple(block_index(plan, b, block, min_size) for b in range(len(plan.buckets)))
    except BlockCut as cut:
        raise _refuse(cut) from None
