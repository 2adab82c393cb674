"""The padding invariant: the padding of every :class:`~vescale_jax.ShardedParams` bucket is exactly zero.

The planner puts padding between tensors (alignment, block boundaries, the tail of the last device). ``pack``
writes zeros there and the gradient of padding is zero, but an Optax transformation runs on the whole flat
buffer: ``jax.tree.map(lambda x: x + 1, sp)``, a non-finite global norm or ``0 / 0`` in an ``eps=0`` Adam put
non-zero values in the padding, and anything summed over the buffers (``optax.global_norm``) then reads them.

This module keeps the invariant cheaply and locally: each device builds its padding mask from an iota over
its own ``S`` elements and a small static table of its leaf ranges (no communication, no index past ``S``, so
no overflow however large the bucket). ``vj.fsdp`` zeroes the padding of every ``ShardedParams`` a step
returns (parameters and optimizer moments alike); :func:`zero_padding`, :func:`apply_updates`,
:func:`tree_map` and :func:`global_norm` give the same guarantee outside it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vescale_jax._compat import is_tracer
from vescale_jax.layout._plan import Plan
from vescale_jax.state._checks import check_not_donated, plan_states
from vescale_jax.state._sharded import ShardedParams, as_bits, from_bits

__all__ = [
    "apply_updates",
    "global_norm",
    "has_padding",
    "leaf_runs",
    "local_leaf_ids",
    "local_padding_mask",
    "padding_mask",
    "tree_map",
    "zero_padding",
]


@functools.lru_cache(maxsize=256)
def leaf_runs(plan: Plan, bucket: int, *, merge: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each device's leaf ranges in its local shard of one bucket, in local coordinates.

    Args:
      plan: the plan.
      bucket: the bucket's index.
      merge: merge adjacent ranges (the leaf index is then meaningless): fewer entries for a padding mask.

    Returns:
      ``(starts, ends, leaves)``, each ``(m, R)`` int32: on device ``k``, local elements
      ``[starts[k, r], ends[k, r])`` belong to leaf ``leaves[k, r]`` (an index into ``plan.leaves``). Rows are
      sorted by start; unused entries are ``(S, S, num_leaves)``.
    """
    b = plan.buckets[bucket]
    m, s = plan.num_devices, b.layout.shard_size
    runs: list[list[tuple[int, int, int]]] = [[] for _ in range(m)]
    for slot, leaf in enumerate(b.leaves):
        o, n = b.layout.offsets[slot], b.layout.sizes[slot]
        if not n:
            continue
        for k in range(o // s, (o + n - 1) // s + 1):
            runs[k].append((max(o, k * s) - k * s, min(o + n, (k + 1) * s) - k * s, leaf))
    for k, rs in enumerate(runs):
        rs.sort()
        if merge:
            merged: list[tuple[int, int, int]] = []
            for lo, hi, leaf in rs:
                if merged and merged[-1][1] == lo:
                    merged[-1] = (merged[-1][0], hi, merged[-1][2])
                else:
                    merged.append((lo, hi, leaf))
            runs[k] = merged
    width = max(1, max(len(r) for r in runs))
    starts = np.full((m, width), s, np.int32)
    ends = np.full((m, width), s, np.int32)
    leaves = np.full((m, width), len(plan.leaves), np.int32)
    for k, rs in enumerate(runs):
        for r, (lo, hi, leaf) in enumerate(rs):
            starts[k, r], ends[k, r], leaves[k, r] = lo, hi, leaf
    return starts, ends, leaves


def has_padding(plan: Plan, bucket: int) -> bool:
    """Whether any device's shard of the bucket holds a padding element."""
    starts, ends, _ = leaf_runs(plan, bucket, merge=True)
    s = plan.buckets[bucket].layout.shard_size
    return bool(s) and not (np.all(starts[:, 0] == 0) and np.all(ends[:, 0] == s))


def _lookup(plan: Plan, bucket: int, merge: bool) -> tuple[jax.Array, jax.Array, np.ndarray]:
    """(run index clipped, inside a run) for each local element of ``bucket`` (inside ``shard_map``)."""
    starts, ends, leaves = leaf_runs(plan, bucket, merge=merge)
    k = jax.lax.axis_index(plan.axis)
    size = plan.buckets[bucket].layout.shard_size
    st, en = jnp.asarray(starts)[k], jnp.asarray(ends)[k]
    i = jnp.arange(size, dtype=jnp.int32)
    r = jnp.searchsorted(st, i, side="right", method="compare_all" if st.shape[0] <= 16 else "scan") - 1
    rc = jnp.clip(r, 0, st.shape[0] - 1)
    return rc, (r >= 0) & (i < en[rc]), leaves


def local_padding_mask(plan: Plan, bucket: int) -> jax.Array:
    """Inside ``shard_map``: ``(S,)`` bool, True at this device's non-padding elements of ``bucket``."""
    return _lookup(plan, bucket, True)[1]


def local_leaf_ids(plan: Plan, bucket: int) -> jax.Array:
    """Inside ``shard_map``: ``(S,)`` int32, the leaf index (into ``plan.leaves``) of each of this device's
    elements of ``bucket``; ``len(plan.leaves)`` at padding."""
    rc, inside, leaves = _lookup(plan, bucket, False)
    k = jax.lax.axis_index(plan.axis)
    return jnp.where(inside, jnp.asarray(leaves)[k][rc], len(plan.leaves))


def _specs(plan: Plan, buckets: list[int]) -> tuple[jax.sharding.PartitionSpec, ...]:
    return tuple(plan.partition_spec(plan.buckets[b]) for b in buckets)


def padding_mask(plan: Plan) -> list[jax.Array]:
    """Global bool buffers, one per bucket, sharded like it: True at leaf elements, False at padding."""
    buckets = list(range(len(plan.buckets)))

    def local():
        return tuple(jnp.broadcast_to(local_padding_mask(plan, b), plan.buckets[b].local_shape) for b in buckets)

    return list(jax.shard_map(local, mesh=plan.mesh, in_specs=(), out_specs=_specs(plan, buckets), check_vma=False)())


def _is_global_buffer(x: Any, bucket: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray) and tuple(x.shape) == bucket.shape


def _zero_node(sp: ShardedParams) -> ShardedParams:
    check_not_donated(sp, "vj.zero_padding (also under vj.apply_updates, vj.tree_map, vj.global_norm)")
    plan = sp.plan
    todo = [
        b
        for b, (bucket, x) in enumerate(zip(plan.buckets, sp.buffers, strict=True))
        if _is_global_buffer(x, bucket) and has_padding(plan, b)
    ]
    if not todo:
        return sp

    zeroed = _zeroing(plan, tuple(todo))(*[sp.buffers[b] for b in todo])
    buffers = list(sp.buffers)
    for b, x in zip(todo, zeroed, strict=True):
        buffers[b] = x
    return ShardedParams(buffers, plan)


@functools.lru_cache(maxsize=64)
def _zeroing(plan: Plan, todo: tuple[int, ...]) -> Callable[..., Any]:
    """The jitted zeroing of buckets ``todo`` (one compiled program per plan and set of buckets; called eagerly,
    an un-jitted ``shard_map`` would dispatch its mask's operations one by one)."""

    def local(*shards):  # the select on the bits of low-precision floats: NaN payloads stay as they are
        return tuple(
            from_bits(jnp.where(local_padding_mask(plan, b), as_bits(x, x.dtype), 0), x.dtype)
            for b, x in zip(todo, shards, strict=True)
        )

    specs = _specs(plan, list(todo))
    return jax.jit(jax.shard_map(local, mesh=plan.mesh, in_specs=specs, out_specs=specs, check_vma=False))


def zero_piece(
    plan: Plan, bucket: int, x: jax.Array, *, full_shape: tuple[int, ...], local: tuple[int, int] | None = None
) -> jax.Array:
    """``x``, a piece of a global buffer of ``bucket`` (the whole buffer, rows of a stacked one, or with ``local``
    the local elements ``[a, b)`` of every device's shard; the buffer has ``full_shape``), with the padding set to
    exactly zero, as :func:`zero_padding` zeroes the whole buffer."""
    if tuple(full_shape) != plan.buckets[bucket].shape or not has_padding(plan, bucket):
        return x
    if local is None:
        return _zeroing(plan, (bucket,))(x)[0]
    return _zeroing_range(plan, bucket, *local)(x)


@functools.lru_cache(maxsize=256)
def _zeroing_range(plan: Plan, bucket: int, start: int, stop: int) -> Callable[..., Any]:
    """The jitted zeroing of the local elements ``[start, stop)`` of each device's shard of ``bucket``."""

    def local(x):
        return from_bits(jnp.where(local_padding_mask(plan, bucket)[start:stop], as_bits(x, x.dtype), 0), x.dtype)

    spec = plan.partition_spec(plan.buckets[bucket])
    return jax.jit(jax.shard_map(local, mesh=plan.mesh, in_specs=(spec,), out_specs=spec, check_vma=False))


def _is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedParams)


def zero_padding(tree: Any) -> Any:
    """``tree`` with the padding of every :class:`~vescale_jax.ShardedParams` in it set to exactly zero.

    Args:
      tree: any pytree: a ``ShardedParams``, an optimizer state holding some (Adam's ``mu`` / ``nu``), a
        step's outputs. Buffers that are not global bucket-shaped arrays (``None``, ``optax.MaskedNode``,
        local shards inside ``shard_map``) are left as they are.

    Returns:
      The same structure; leaf elements are unchanged (a select, not arithmetic: NaN or inf in a leaf stays).

    Sharding:
      Each device masks its own shard with a local iota (``shard_map``, no communication); outputs are
      sharded like the inputs. Call it at the global level (outside ``shard_map``), under ``jit`` or eagerly.
    """
    return jax.tree.map(lambda x: _zero_node(x) if _is_sharded(x) else x, tree, is_leaf=_is_sharded)


def apply_updates(params: Any, updates: Any) -> Any:
    """``optax.apply_updates`` that keeps the padding of every :class:`~vescale_jax.ShardedParams` zero.

    Args:
      params: the parameters (a ``ShardedParams`` or any tree holding some).
      updates: updates of the same structure.

    Returns:
      ``params + updates`` (cast to the params' dtypes) with zero padding.
    """
    return zero_padding(optax.apply_updates(params, updates))


def tree_map(f: Callable[..., Any], tree: Any, *rest: Any, is_leaf: Callable[[Any], bool] | None = None) -> Any:
    """``jax.tree.map`` whose :class:`~vescale_jax.ShardedParams` results keep zero padding.

    ``jax.tree.map(lambda x: x + 1, sp)`` maps the bucket buffers, padding included; this maps them and then
    zeroes the padding, so the result is the sharded form of the map over the logical tree for any ``f``
    that acts element-wise.

    Args:
      f: the function, applied to each leaf (each bucket buffer of a ``ShardedParams``).
      tree: the first tree.
      *rest: more trees of the same structure.
      is_leaf: as in ``jax.tree.map``.

    Returns:
      The mapped tree, padding zeroed.
    """
    return zero_padding(jax.tree.map(f, tree, *rest, is_leaf=is_leaf))


def global_norm(tree: Any) -> jax.Array:
    """``optax.global_norm`` with the padding of every :class:`~vescale_jax.ShardedParams` excluded.

    Args:
      tree: updates, gradients or parameters (any tree; ``ShardedParams`` nodes are read without padding).

    Returns:
      The L2 norm over all leaf elements: equal to ``optax.global_norm`` of the logical (unsharded) tree.

    Sharding:
      Each device sums its own masked shard; the partitioner adds one scalar all-reduce. Called eagerly outside
      ``jax.set_mesh``, it runs under the mesh of the first ``ShardedParams``'s plan (JAX needs a mesh context
      for arrays on ``Explicit`` axes).
    """
    plans = [node.plan for _, node in plan_states(tree) if isinstance(node, ShardedParams)]
    eager = not any(is_tracer(x) for x in jax.tree.leaves(tree))
    outside = plans and eager and jax.sharding.get_abstract_mesh().empty
    with jax.set_mesh(plans[0].mesh) if outside else contextlib.nullcontext():
        return optax.tree.norm(zero_padding(tree))
