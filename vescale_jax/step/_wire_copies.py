"""Whole buffers on the wire, for ``vj.accumulate(reduce="once")``: every bucket gathered once, reduced once.

:func:`gather_copies` all-gathers every bucket's full buffer (the same cast / FP8 wire as one bucket's gather,
:func:`vescale_jax.step._wire.gather_buffer`); :func:`unpack_copies` unpacks them into the logical leaves
(differentiable: its transpose packs each bucket's cotangents into a full per-device gradient);
:func:`reduce_copies` reduce-scatters those gradients into the plan's shards, summed over the replica axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from vescale_jax.kernels._dispatch import unpack_differentiable
from vescale_jax.layout._plan import Plan
from vescale_jax.step._wire import (
    Gather,
    gather_buffer,
    replica_sum,
    vary,
)

__all__ = ["gather_copies", "reduce_copies", "unpack_copies"]


def gather_copies(buffers: Sequence[jax.Array], plan: Plan, how: Gather) -> tuple[jax.Array, ...]:
    """Every bucket's full ``(m*S,)`` (stacked ``(L, m*S)``) buffer on each device, in the gather dtype; a
    bucket the wire widens (:meth:`Gather.widens`: bf16 parameters whose gradient reduces in fp32) upcast,
    exactly, to its reduce dtype, so the gradients of the copy (each device's partial sums, accumulated over
    micro-batches) stay in it until :func:`reduce_copies` and are rounded once.

    Call inside ``shard_map``; the result's transpose is not needed (gradients come back through
    :func:`reduce_copies`)."""
    out = []
    for bucket, b in zip(plan.buckets, buffers, strict=True):
        if b.shape[-1]:
            copy = gather_buffer(b, bucket, plan, how)
        else:
            copy = vary(b, how.replica_axes).astype(how.policy.gather_dtype(b.dtype))
        out.append(copy.astype(how.policy.grad_dtype(bucket.dtype)) if how.widens(bucket.dtype) else copy)
    return tuple(out)


def unpack_copies(copies: Sequence[jax.Array], plan: Plan, how: Gather) -> list[jax.Array]:
    """The logical leaves (flattened, plan order) of full per-device copies; the transpose packs each bucket's
    cotangents into a full per-device gradient (padding zero) for :func:`reduce_copies`."""
    leaves: list[Any] = [None] * len(plan.leaves)
    for bucket, copy in zip(plan.buckets, copies, strict=True):
        shapes = [plan.leaves[i].local_shape for i in bucket.leaves]
        if not copy.shape[-1]:  # zero-size leaves only: plain autodiff keeps the copy's varying axes
            for i, s in zip(bucket.leaves, shapes, strict=True):
                leaves[i] = jnp.reshape(copy, s)
            continue
        for i, x in zip(
            bucket.leaves,
            unpack_differentiable(
                copy, bucket.layout, shapes, kernels_policy=how.kernels, storage=bucket.storage, name=bucket.name
            ),
            strict=True,
        ):
            leaves[i] = x
    return leaves


def reduce_copies(grads: Sequence[jax.Array], plan: Plan, how: Gather) -> tuple[jax.Array, ...]:
    """Reduce-scatters full per-device gradients into the plan's shards (in the reduce dtype, then the
    bucket's); inside ``shard_map``."""
    out = []
    for g, bucket in zip(grads, plan.buckets, strict=True):
        g = g.astype(how.policy.grad_dtype(bucket.dtype))
        if not g.shape[-1]:  # a bucket of zero-size leaves: nothing to reduce
            out.append(g.astype(bucket.dtype))
            continue
        r = jax.lax.psum_scatter(g, plan.axis, scatter_dimension=g.ndim - 1, tiled=True)
        shard_axes = frozenset(plan.bucket_axes(bucket))
        out.append(replica_sum(r, shard_axes).astype(bucket.dtype))
    return tuple(out)
