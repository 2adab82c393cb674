"""The bucket all-gather and its transpose: the collectives on one bucket's parameters and gradients.

Every collective on parameters and gradients is in this module and its two companions:
:mod:`vescale_jax.step._wire_segment` (a segment of the model with its buckets gathered at the point of use) and
:mod:`vescale_jax.step._wire_copies` (whole buffers, for ``vj.accumulate(reduce="once")``), both built on the
functions here.

Forward, :func:`gather_leaves` (one bucket, or one layer of a stacked bucket, inside ``shard_map``)::

    local (S,) master dtype
      -> cast to the gather dtype          the wire carries the compute dtype (MixedPrecision.gather_dtype)
      -> vary over the replica axes        HSDP: the per-replica computation stays varying (see vary)
      -> all_gather(tiled) over plan.axis  (m*S,)
      -> unpack                            static slices, or the Pallas unpack kernel (KernelPolicy)
      -> leaves                            logical shapes; upcast to the reduce dtype when widened

Transpose, :func:`scatter_leaves`::

    the leaves' cotangents
      -> pack in the reduce dtype          one concatenate with zero padding, or the Pallas pack kernel
      -> psum_scatter(tiled) over axis     (S,)
      -> psum over the replica axes        HSDP: replicas saw other data
      -> cast to the master dtype

:func:`gather_bucket` is the two as one ``custom_vjp``; ``vj.scan_layers`` calls them once per layer and
:func:`gather_stacked` gathers every layer of a stacked bucket at once. :func:`pack` / :func:`unpack` pick XLA or
the kernels by policy; the XLA path is the kernels' own reference (``vescale_jax.kernels.pack_reference`` /
``unpack_reference``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._compat import varying_axes
from vescale_jax.kernels import KernelPolicy
from vescale_jax.kernels._dispatch import DEFAULT_KERNELS, pack, unpack, unpack_differentiable
from vescale_jax.layout._plan import Bucket, Plan
from vescale_jax.step import _fp8 as fp8
from vescale_jax.step._precision import MixedPrecision

__all__ = [
    "Gather",
    "example_leaves",
    "gather_bucket",
    "gather_buffer",
    "gather_flat",
    "gather_leaves",
    "gather_params",
    "gather_stacked",
    "layer_shapes",
    "pack",
    "replica_sum",
    "scatter_leaves",
    "tie",
    "unpack",
    "unpack_differentiable",
    "vary",
    "varying_axes",
    "varying_like",
]


@dataclasses.dataclass(frozen=True)
class Gather:
    """How buckets are gathered and their gradients reduced (static: part of what a step is compiled for).

    Attributes:
      precision: the mixed-precision policy (gather / compute dtype, reduce dtype); None keeps each bucket's.
      replica_axes: HSDP replica axes: the shard is marked varying over them before the gather and the
        gradient is summed over them after the reduce-scatter.
      kernels: how buffers are packed and unpacked (XLA or the Pallas kernels).
      widen: hand the model low-precision leaves upcast to their reduce dtype where it is wider
        (:meth:`widens`); ``vj.apply`` does, wrapping the model so it still sees the narrow dtype.
      wide_grads: the local shards of low-precision buckets whose gradient reduces wider are exact upcasts to
        that dtype (:meth:`grad_out_dtype`), and their reduced gradient is returned in it, not rounded to the
        bucket's dtype: ``vj.accumulate`` sums micro-batch gradients unrounded and rounds once.
    """

    precision: MixedPrecision | None = None
    replica_axes: tuple[str, ...] = ()
    kernels: KernelPolicy = DEFAULT_KERNELS
    widen: bool = False
    wide_grads: bool = False

    @property
    def policy(self) -> MixedPrecision:
        return self.precision or MixedPrecision()

    def widens(self, dtype: Any) -> bool:
        """Whether a bucket of ``dtype`` is gathered wide: a low-precision bucket whose gradient reduces in a
        wider dtype (bf16 parameters reduce in fp32 by default) hands the model an upcast copy, so the model's
        per-device partial sums reach the reduce-scatter unrounded (see :mod:`vescale_jax.step._fp32_grads`). fp32
        masters computing in bf16 keep the bf16 gathered copy."""
        gather, grad = self.policy.gather_dtype(dtype), self.policy.grad_dtype(dtype)
        return (
            self.widen
            and jnp.issubdtype(gather, jnp.floating)
            and np.dtype(dtype).itemsize < 4
            and grad.itemsize > gather.itemsize
        )

    def leaf_dtype(self, dtype: Any) -> np.dtype:
        """The dtype :func:`gather_leaves` returns a bucket of ``dtype``'s leaves in."""
        return self.policy.grad_dtype(dtype) if self.widens(dtype) else self.policy.gather_dtype(dtype)

    def grad_out_dtype(self, dtype: Any) -> np.dtype:
        """The dtype the wire returns a bucket of ``dtype``'s reduced gradient (and takes its local shard) in: the
        bucket's own, or with ``wide_grads`` its reduce dtype where that is wider."""
        dtype, grad = np.dtype(dtype), self.policy.grad_dtype(dtype)
        wider = jnp.issubdtype(dtype, jnp.floating) and grad.itemsize > dtype.itemsize
        return grad if self.wide_grads and wider else dtype

    def model_dtype(self, dtype: Any) -> np.dtype | None:
        """The dtype the model sees a widened bucket's leaves in (None when the bucket is not widened)."""
        return self.policy.gather_dtype(dtype) if self.widens(dtype) else None


# ----------------------------------------------------------------------------------------------------------
# Varying mesh axes (HSDP)


def vary(x: jax.Array, axes: Any) -> jax.Array:
    """Marks ``x`` as varying over ``axes`` (``lax.pcast``) where it does not already.

    HSDP gathers each shard within its replica and computes on that replica's batch: marking the local shard as
    varying over the replica axes *before* the all-gather keeps the per-replica computation varying, so the
    gradient's sum over replicas is left to :func:`scatter_leaves`, on the shard after the reduce-scatter,
    instead of being inserted by autodiff on every full-size gathered leaf.
    """
    axes = tuple(a for a in axes if a not in varying_axes(x))
    if not axes or not varying_axes(x):  # outside shard_map, or with the varying-axes check off
        return x
    return jax.lax.pcast(x, axes, to="varying")


def varying_like(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    """``x`` marked varying over ``axes`` (a gradient that must carry its primal's varying axes)."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def replica_sum(x: jax.Array, like_axes: frozenset[str]) -> jax.Array:
    """Sums a reduce-scattered gradient over the mesh axes it varies over but its shard does not (HSDP's
    replica axes, where each replica saw other data).

    With ``shard_map``'s ``check_vma`` off nothing is typed as varying and this is the identity: ``shard_map``'s
    own transpose then sums the cotangent of each input over the mesh axes its spec does not name, which are
    the same replica axes (``tests/test_collectives.py`` checks both give the unsharded gradient)."""
    extra = varying_axes(x) - like_axes
    return jax.lax.psum(x, tuple(sorted(extra))) if extra else x


def tie(buffers: Sequence[jax.Array], anchor: Any) -> list[jax.Array]:
    """``buffers`` unchanged bit for bit, as values computed from ``anchor`` (the incoming cotangent).

    The backward re-gather of reshard-after-forward is tied to the cotangent this way, so XLA can neither
    merge it with the forward's all-gather (same operand: the gathered copy would stay alive through the whole
    forward) nor hoist it. (``lax.optimization_barrier`` does not do this on CPU: XLA expands it before CSE.)
    The dependency is ``-0.0`` whatever the cotangent holds: ``select(isfinite(c), -(|c| * 0), -0.0)`` for
    its first inexact element ``c``; XLA does not fold ``|c| * 0`` (it is NaN for non-finite ``c``, which the
    select discards), and ``x + -0.0 == x`` for every ``x``, signed zeros and NaN included.
    """
    c = next(
        (
            jnp.ravel(a)[0]
            for a in jax.tree.leaves(anchor)
            if isinstance(a, jax.Array) and jnp.issubdtype(a.dtype, jnp.inexact) and a.size
        ),
        None,
    )
    if c is None:
        return list(buffers)
    if jnp.issubdtype(c.dtype, jnp.complexfloating):
        c = jnp.real(c)
    neg_zero = jnp.array(-0.0, c.dtype)
    dep = jnp.where(jnp.isfinite(c), -(jnp.abs(c) * jnp.zeros((), c.dtype)), neg_zero)
    return [b + dep.astype(b.dtype) if b.size and jnp.issubdtype(b.dtype, jnp.number) else b for b in buffers]


# ----------------------------------------------------------------------------------------------------------
# One bucket: gather and its transpose


def layer_shapes(bucket: Bucket, plan: Plan) -> list[tuple[int, ...]]:
    """The per-layer logical shapes of a bucket's leaves, in slot order."""
    return [plan.layer_shape(plan.leaves[i]) for i in bucket.leaves]


def gather_leaves(local: jax.Array, bucket: Bucket, plan: Plan, how: Gather) -> list[jax.Array]:
    """Cast, vary, all-gather and unpack one bucket's local ``(S,)`` shard (not differentiable by itself:
    :func:`scatter_leaves` is its transpose).

    Returns:
      The bucket's leaves in slot order (per-layer shapes for a stacked bucket), in ``how.leaf_dtype``.

    Sharding:
      Input varies over ``plan.axis``; the leaves are the full tensors on every device.
    """
    out_dtype = how.leaf_dtype(bucket.dtype)
    shapes = layer_shapes(bucket, plan)
    if not bucket.layout.total_size:  # only zero-size leaves: nothing to gather (XLA rejects an empty all-gather)
        x = vary(local, how.replica_axes).astype(how.policy.gather_dtype(bucket.dtype))
        return [jnp.reshape(x, s).astype(out_dtype) for s in shapes]
    leaves = _fp8_leaves(local, bucket, plan, how, shapes)
    if leaves is None:
        full = gather_buffer(local, bucket, plan, how)
        leaves = unpack(
            full, bucket.layout, shapes, kernels_policy=how.kernels, storage=bucket.storage, name=bucket.name
        )
    return [leaf.astype(out_dtype) for leaf in leaves]


def _fp8_leaves(
    local: jax.Array, bucket: Bucket, plan: Plan, how: Gather, shapes: Sequence[tuple[int, ...]]
) -> list[jax.Array] | None:
    """The FP8 gather straight into the leaves by the fused kernels (quantize; dequantize + unpack + tile
    relayout) when the policy gathers in FP8 and selects Pallas; None otherwise (the caller gathers a buffer)."""
    block = how.policy.fp8_block(bucket.dtype)
    if block is None or how.kernels.mode != "pallas":
        return None
    table = fp8.block_table(plan, plan.buckets.index(bucket), block)
    per_layer = [s[local.ndim - 1 :] for s in shapes]
    return fp8.wire_gather_leaves(
        vary(local, how.replica_axes),
        table,
        plan.axis,
        how.policy.gather_dtype(bucket.dtype),
        layout=bucket.layout,
        shapes=per_layer,
        storage=bucket.storage,
        kernels_policy=how.kernels,
    )


def gather_buffer(local: jax.Array, bucket: Bucket, plan: Plan, how: Gather) -> jax.Array:
    """The full buffer of a local ``(S,)`` (stacked rows ``(L, S)``) shard in the gather dtype: cast then
    all-gather, or the FP8 block-scaled gather (:mod:`vescale_jax.step._fp8`) when the policy asks for one.
    Dtypes follow the bucket's (the local shard may be a wide copy, :attr:`Gather.wide_grads`)."""
    x = vary(local, how.replica_axes)
    gather_dtype = how.policy.gather_dtype(bucket.dtype)
    block = how.policy.fp8_block(bucket.dtype)
    if block is not None:
        table = fp8.block_table(plan, plan.buckets.index(bucket), block)
        return fp8.wire_gather(x, table, plan.axis, gather_dtype, kernels_policy=how.kernels, layout=bucket.layout)
    return jax.lax.all_gather(x.astype(gather_dtype), plan.axis, axis=x.ndim - 1, tiled=True)


def example_leaves(local: jax.Array, bucket: Bucket, plan: Plan, how: Gather) -> list[jax.Array]:
    """Leaves with :func:`gather_leaves`'s shapes, dtypes and varying axes for the local ``(S,)`` shard ``local``,
    computed without a collective (they only shape a trace and are dead code once it is evaluated)."""
    full = jnp.tile(vary(local, how.replica_axes), bucket.layout.num_devices)
    full = full.astype(how.policy.gather_dtype(bucket.dtype))
    shapes = [plan.layer_shape(plan.leaves[i]) for i in bucket.leaves]
    leaves = unpack(full, bucket.layout, shapes, kernels_policy=DEFAULT_KERNELS, storage=bucket.storage)
    return [x.astype(how.leaf_dtype(bucket.dtype)) for x in leaves]


def scatter_leaves(
    cts: Sequence[jax.Array], bucket: Bucket, plan: Plan, how: Gather, *, like_axes: frozenset[str] = frozenset()
) -> jax.Array:
    """Pack, cast, reduce-scatter and replica-sum one bucket's leaf cotangents into its ``(S,)`` shard.

    Args:
      cts: the leaves' cotangents, in slot order (per-layer shapes for a stacked bucket).
      bucket: the bucket.
      plan: the plan.
      how: the gather options (reduce dtype, replica axes, kernels).
      like_axes: the mesh axes the local shard varies over (:func:`varying_axes` of it).

    Returns:
      The local gradient shard, in the bucket's dtype (:meth:`Gather.grad_out_dtype`); padding exactly zero.
    """
    master = how.grad_out_dtype(bucket.dtype)
    grad_dtype = how.policy.grad_dtype(bucket.dtype)
    if not bucket.layout.total_size:  # nothing to reduce
        return varying_like(jnp.zeros((0,), master), like_axes)
    packed = pack(
        cts, bucket.layout, dtype=grad_dtype, kernels_policy=how.kernels, storage=bucket.storage, name=bucket.name
    )
    out = jax.lax.psum_scatter(packed, plan.axis, tiled=True)
    return replica_sum(out, like_axes).astype(master)


def gather_bucket(
    local: jax.Array,
    bucket: Bucket,
    plan: Plan,
    *,
    precision: MixedPrecision | None = None,
    vary_axes: tuple[str, ...] = (),
    widen: bool = False,
    kernels_policy: KernelPolicy | None = None,
) -> list[jax.Array]:
    """All-gathers one bucket's local shard and unpacks its leaves; differentiable, its transpose is
    :func:`scatter_leaves` (one pack and one reduce-scatter).

    Args:
      local: this device's ``(S,)`` shard of the bucket (for a stacked bucket, one layer's ``(S,)`` row).
      bucket: the bucket.
      plan: the plan it belongs to.
      precision: cast the local shard to the policy's compute dtype before the all-gather (and reduce-scatter
        the gradient in its reduce dtype).
      vary_axes: HSDP replica axes (see :func:`vary`).
      widen: return low-precision leaves upcast to their reduce dtype where it is wider, so their cotangents
        arrive unrounded (see :meth:`Gather.widens`).
      kernels_policy: XLA or the Pallas kernels for the unpack and the pack (default XLA).

    Returns:
      The bucket's leaves in slot order, with their logical shapes (per-layer shapes for a stacked bucket).

    Sharding:
      Input varies over ``plan.axis``; outputs are the full tensors on every device. The transpose is one
      reduce-scatter of the packed gradient (and a replica all-reduce of the shard under HSDP).
    """
    if tuple(local.shape) != (bucket.layout.shard_size,):
        raise ValueError(
            f"gather_bucket: bucket {bucket.name!r} expects a local shard of shape ({bucket.layout.shard_size},), "
            f"got {tuple(local.shape)}; pass one layer's row for a stacked bucket, inside shard_map over "
            f"{plan.axis!r}."
        )
    return _gather_bucket(
        local, bucket, plan, Gather(precision, tuple(vary_axes), kernels_policy or DEFAULT_KERNELS, widen)
    )


def _gather_bucket(local: jax.Array, bucket: Bucket, plan: Plan, how: Gather) -> list[jax.Array]:
    """:func:`gather_leaves` with :func:`scatter_leaves` as its VJP (:func:`gather_bucket` after its checks)."""
    if not bucket.layout.total_size:  # zero-size leaves: nothing to gather or reduce, plain autodiff
        return gather_leaves(local, bucket, plan, how)
    like_axes = varying_axes(local)

    @jax.custom_vjp
    def run(x):
        return gather_leaves(x, bucket, plan, how)

    def fwd(x):
        return run(x), None

    def bwd(_, cts):
        return (scatter_leaves(cts, bucket, plan, how, like_axes=like_axes),)

    run.defvjp(fwd, bwd)
    return list(run(local))


def gather_stacked(rows: jax.Array, bucket: Bucket, plan: Plan, how: Gather) -> list[jax.Array]:
    """Every layer of a stacked bucket at once: its local ``(L, S)`` rows all-gathered in one collective and
    unpacked into ``(L, ...)`` leaves; differentiable, its transpose packs the stacked cotangents and
    reduce-scatters them in one collective. For a layer group's small leaves (norms, biases): one launch per
    step in each direction instead of one per layer.

    Sharding:
      Inside ``shard_map``; ``rows`` vary over ``plan.axis``, the leaves are the full tensors on every device.
    """
    like = varying_axes(rows)
    master = np.dtype(bucket.dtype)
    shapes = [(rows.shape[0], *plan.layer_shape(plan.leaves[i])) for i in bucket.leaves]

    @jax.custom_vjp
    def run(r):
        leaves = _fp8_leaves(r, bucket, plan, how, shapes)
        if leaves is None:
            full = gather_buffer(r, bucket, plan, how)
            leaves = unpack(
                full, bucket.layout, shapes, kernels_policy=how.kernels, storage=bucket.storage, name=bucket.name
            )
        return [leaf.astype(how.leaf_dtype(master)) for leaf in leaves]

    def fwd(r):
        return run(r), None

    def bwd(_, cts):
        packed = pack(
            cts,
            bucket.layout,
            dtype=how.policy.grad_dtype(master),
            kernels_policy=how.kernels,
            lead=shapes[0][:1],
            storage=bucket.storage,
            name=bucket.name,
        )
        out = jax.lax.psum_scatter(packed, plan.axis, scatter_dimension=1, tiled=True)
        return (replica_sum(out, like).astype(how.grad_out_dtype(master)),)

    run.defvjp(fwd, bwd)
    return list(run(rows))


def gather_flat(local_buffers: Sequence[jax.Array], plan: Plan, how: Gather | None = None) -> dict[int, jax.Array]:
    """Every non-stacked bucket gathered by :func:`gather_bucket` (differentiable): ``{leaf index: leaf}``."""
    how = how or Gather()
    out: dict[int, jax.Array] = {}
    for bucket, local in zip(plan.buckets, local_buffers, strict=True):
        if bucket.layers is None:
            out.update(zip(bucket.leaves, _gather_bucket(local, bucket, plan, how), strict=True))
    return out


def gather_params(local_buffers: Sequence[jax.Array], plan: Plan, how: Gather | None = None) -> Any:
    """All-gathers every non-stacked bucket and returns the logical tree (differentiable).

    Stacked buckets are returned as their local ``(L, S)`` shards in place of each leaf's slot: gather them
    one layer at a time inside the scan body with :func:`gather_bucket`.
    """
    gathered = gather_flat(local_buffers, plan, how)
    leaves = [gathered.get(i) for i in range(len(plan.leaves))]
    for bucket, local in zip(plan.buckets, local_buffers, strict=True):
        if bucket.layers is not None:
            for i in bucket.leaves:
                leaves[i] = local
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)
