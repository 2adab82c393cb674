"""Differentiable gathering of bucket shards inside ``shard_map`` (the building block of ``vj.fsdp``).

``gather_bucket`` all-gathers one bucket's local shard ``(S,)`` into the global buffer ``(m*S,)`` and unpacks
the bucket's leaves by static slices. Under ``jax.grad`` its transpose is one reduce-scatter of the packed
gradient back into the local shard (the transpose of ``all_gather(tiled=True)`` is ``psum_scatter``), and the
padding's gradient is exactly zero because no leaf reads it.

This is the straightforward path: the backward pass builds a full-size packed gradient before the
reduce-scatter. The ``vj.fsdp`` runtime (issue 3) builds on it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from vescale_jax._plan import Bucket, Plan
from vescale_jax._precision import MixedPrecision, all_gather_cast, vary
from vescale_jax._unpacking import unpack_gathered

__all__ = ["gather_bucket", "gather_params"]


def gather_bucket(
    local: jax.Array,
    bucket: Bucket,
    plan: Plan,
    *,
    precision: MixedPrecision | None = None,
    vary_axes: tuple[str, ...] = (),
    widen: bool = False,
) -> list[jax.Array]:
    """All-gathers one bucket's local shard and unpacks its leaves (one layer for a stacked bucket).

    Args:
      local: this device's ``(S,)`` shard of the bucket (for a stacked bucket, one layer's ``(S,)`` row).
      bucket: the bucket.
      plan: the plan it belongs to.
      precision: cast the local shard to the policy's compute dtype before the all-gather (and reduce-scatter
        the gradient in its reduce dtype).
      vary_axes: HSDP replica axes: the shard is marked varying over them before the gather, so the sum of the
        gradient over replicas happens on the shard (see ``vescale_jax._precision.vary``).
      widen: return low-precision leaves upcast to their reduce dtype (fp32) so their cotangents arrive
        unrounded (see ``vescale_jax._precision.all_gather_cast`` and :mod:`vescale_jax.widen`).

    Returns:
      The bucket's leaves in slot order, with their logical shapes (per-layer shapes for a stacked bucket).

    Sharding:
      Input varies over ``plan.axis``; outputs are the full tensors on every device. The transpose is one
      reduce-scatter of the packed gradient.
    """
    if tuple(local.shape) != (bucket.layout.shard_size,):
        raise ValueError(
            f"gather_bucket: bucket {bucket.name!r} expects a local shard of shape ({bucket.layout.shard_size},), "
            f"got {tuple(local.shape)}; pass one layer's row for a stacked bucket, inside shard_map over "
            f"{plan.axis!r}."
        )
    if not bucket.layout.total_size:  # only zero-size leaves: nothing to gather (XLA rejects an empty all-gather)
        empty = vary(local, vary_axes).astype(local.dtype if precision is None else precision.gather_dtype(local.dtype))
        return [jnp.reshape(empty, plan.layer_shape(plan.leaves[i])) for i in bucket.leaves]
    full = all_gather_cast(local, plan.axis, precision, vary_axes=vary_axes, widen=widen)
    return unpack_gathered(full, bucket.layout, [plan.layer_shape(plan.leaves[i]) for i in bucket.leaves])


def gather_params(local_buffers: Any, plan: Plan) -> Any:
    """All-gathers every non-stacked bucket and returns the logical tree.

    Stacked buckets are returned as their local ``(L, S)`` shards in place of each leaf's slot: gather them
    one layer at a time inside the scan body with :func:`gather_bucket`.

    Args:
      local_buffers: the local shards, one per bucket (``ShardedParams.buffers`` inside ``shard_map``).
      plan: the plan.

    Returns:
      A tree with the plan's structure.
    """
    leaves: list[Any] = [None] * len(plan.leaves)
    for bucket, local in zip(plan.buckets, local_buffers, strict=True):
        if bucket.layers is not None:
            for i in bucket.leaves:
                leaves[i] = local
            continue
        for i, x in zip(bucket.leaves, gather_bucket(local, bucket, plan), strict=True):
            leaves[i] = x
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)
