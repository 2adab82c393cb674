"""Flat buckets <-> logical leaves, evenly sharded, one all-to-all per leaf and no gathered bucket.

A checkpoint stores every leaf at its logical shape. Turning a bucket into its leaves with ``jit(unpack,
out_shardings=...)`` makes XLA all-gather the whole bucket on every device and slice; this module instead moves
each device's ragged range of a leaf straight to the devices that own it under an even *storage sharding*, by
one (padded) all-to-all per leaf inside ``shard_map``.

Storage sharding of a leaf (per layer for a stacked leaf): the plan's ``m`` devices are viewed as a mesh of
``m``'s prime factors (ascending); a leaf dim ``D`` is split over the longest prefix of those factors whose
product ``g`` divides ``D`` (the dim with the largest ``g`` wins, then the larger dim). ``g == m`` for any dim
divisible by ``m``; a leaf with no dim sharing a factor with ``m`` is replicated (``g == 1``). Each device then
holds ``size / g`` elements of the leaf. The element ranks are computed in closed form, so every index table
is ``m x m`` integers, whatever the leaf size.

Transient memory per device while one bucket is converted: the all-to-all's send and receive buffers, ``m * W``
elements each, where ``W`` is the largest piece one device sends another (``W <= min(local range, size/g)``),
so at most ``2 * min(S, size / g) * m``-ish, bounded by twice the largest leaf of the bucket; with leaves
spread over all devices it is about ``2 * size / m``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vescale_jax.plan import Bucket, Plan

__all__ = ["LeafStorage", "from_logical", "leaf_storage", "storage_mesh", "to_logical"]

_PREFIX = "vj_ckpt_"


def _prime_factors(m: int) -> list[int]:
    out, p = [], 2
    while p * p <= m:
        while m % p == 0:
            out.append(p)
            m //= p
        p += 1
    if m > 1:
        out.append(m)
    return out or [1]


def _plan_axes(plan: Plan) -> tuple[str, ...]:
    return (plan.axis,) if isinstance(plan.axis, str) else tuple(plan.axis)


@functools.lru_cache(maxsize=64)
def storage_mesh(plan: Plan) -> jax.sharding.Mesh:
    """The plan's devices as ``(*other mesh axes, f1, f2, ...)`` with ``f_i`` the prime factors of ``m``.

    The linear index over the factor axes equals the index over the plan's axis (or axes), so device ``k`` of
    the plan's buckets is device ``k`` here too; other mesh axes (HSDP replicas) keep their place.
    """
    mesh, axes = plan.mesh, _plan_axes(plan)
    rest = [a for a in mesh.axis_names if a not in axes]
    order = [mesh.axis_names.index(a) for a in (*rest, *axes)]
    factors = _prime_factors(plan.num_devices)
    devices = np.transpose(mesh.devices, order).reshape(*[mesh.shape[a] for a in rest], *factors)
    names = (*rest, *[f"{_PREFIX}{i}" for i in range(len(factors))])
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _factor_axes(plan: Plan) -> tuple[str, ...]:
    return tuple(f"{_PREFIX}{i}" for i in range(len(_prime_factors(plan.num_devices))))


class LeafStorage:
    """How one leaf (one layer of it, for a stacked leaf) is split for storage.

    Attributes:
      shape: the leaf's per-layer shape.
      dim: the split dim (``None``: replicated).
      g: how many parts the dim is split into (a prefix product of ``m``'s prime factors).
      axes: the storage-mesh factor axes the dim is split over.
    """

    __slots__ = ("axes", "dim", "g", "shape")

    def __init__(self, shape: tuple[int, ...], dim: int | None, g: int, axes: tuple[str, ...]):
        self.shape, self.dim, self.g, self.axes = shape, dim, g, axes

    def view(self) -> tuple[int, int, int]:
        """``(A, D, B)``: the leaf as ``A`` outer rows, the split dim ``D`` and ``B`` inner elements."""
        if self.dim is None:
            return 1, 1, math.prod(self.shape)
        d = self.dim
        return math.prod(self.shape[:d]), self.shape[d], math.prod(self.shape[d + 1 :])

    def spec(self, stacked: bool) -> P:
        parts: list[Any] = [None] * len(self.shape)
        if self.dim is not None and self.axes:
            parts[self.dim] = self.axes if len(self.axes) > 1 else self.axes[0]
        return P(*([None] if stacked else []), *parts)


def leaf_storage(shape: Sequence[int], plan: Plan) -> LeafStorage:
    """The storage split of a leaf of per-layer ``shape`` under ``plan`` (see the module docstring)."""
    shape = tuple(int(d) for d in shape)
    factors, names = _prime_factors(plan.num_devices), _factor_axes(plan)
    best = (1, -1, None, 0)  # (g, dim size, dim, prefix length)
    for d, size in enumerate(shape):
        g, j = 1, 0
        while j < len(factors) and factors[j] > 1 and size % (g * factors[j]) == 0:
            g, j = g * factors[j], j + 1
        if g > 1 and (g, size) > best[:2]:
            best = (g, size, d, j)
    g, _, dim, j = best
    return LeafStorage(shape, dim, g, names[:j])


def storage_sharding(spec_shape: Sequence[int], plan: Plan, *, stacked: bool) -> NamedSharding:
    """The ``NamedSharding`` a leaf is stored (and restored) with; ``spec_shape`` is its per-layer shape."""
    return NamedSharding(storage_mesh(plan), leaf_storage(spec_shape, plan).spec(stacked))


# ----------------------------------------------------------------------------------------------- index math
def _ranks(x: np.ndarray, block: np.ndarray, A: int, D: int, B: int, g: int) -> np.ndarray:
    """How many elements of storage block ``block`` have flat index ``< x`` (both broadcast)."""
    R, Pd = (D // g) * B, D * B
    if Pd == 0:
        return np.zeros(np.broadcast(x, block).shape, np.int64)
    return (x // Pd) * R + np.clip(x % Pd - block * R, 0, R)


class _Route:
    """Static tables of one leaf's all-to-all between its ragged ranges and its storage blocks."""

    def __init__(self, bucket: Bucket, slot: int, storage: LeafStorage, m: int):
        S, o, n = bucket.layout.shard_size, bucket.layout.offsets[slot], bucket.layout.sizes[slot]
        A, D, B = storage.view()
        g = storage.g
        r = m // g
        s = np.arange(m)
        self.starts = np.clip(s * S - o, 0, n)
        self.ends = np.clip((s + 1) * S - o, 0, n)
        blocks = (np.arange(m) // r)[None, :]  # [.., k]: storage block of device k
        self.cs = _ranks(self.starts[:, None], blocks, A, D, B, g)  # [s, k]
        self.ce = _ranks(self.ends[:, None], blocks, A, D, B, g)
        self.count = self.ce - self.cs
        self.width = max(1, int(self.count.max(initial=0)))
        self.local_max = max(1, int((self.ends - self.starts).max(initial=0)))
        self.S, self.o, self.n, self.m, self.r, self.g = S, o, n, m, r, g
        self.R, self.P = (D // g) * B, D * B
        self.block_size = n // g


def _t(values: Any) -> jax.Array:
    return jnp.asarray(np.asarray(values, np.int32))


def _leaf_out(local: jax.Array, rt: _Route, k: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Bucket local ``(L, S)`` -> this device's storage block ``(L, n / g)`` of one leaf."""
    m, W = rt.m, rt.width
    t = jnp.arange(W, dtype=jnp.int32)
    q = _t(rt.cs)[k][:, None] + t[None, :]  # (m, W): ranks in each destination's block
    blk = _t(np.arange(m) // rt.r)[:, None]
    flat = (q // rt.R) * rt.P + blk * rt.R + q % rt.R
    idx = rt.o + flat - k * rt.S
    valid = t[None, :] < _t(rt.count)[k][:, None]
    rows = jnp.take(local, jnp.clip(jnp.where(valid, idx, 0), 0, rt.S - 1), axis=-1)  # (L, m, W)
    rows = jnp.where(valid[None], rows, jnp.zeros((), local.dtype))
    received = jax.lax.all_to_all(rows, axes, 1, 1, tiled=True)  # [:, s] came from source s
    p = jnp.arange(rt.block_size, dtype=jnp.int32)
    starts = _t(rt.cs.T)[k]  # (m,): where source s's piece starts in my block
    source = jnp.clip(jnp.searchsorted(starts, p, side="right") - 1, 0, m - 1)
    index = source * W + (p - starts[source])
    return jnp.take(jnp.reshape(received, (local.shape[0], m * W)), index, axis=-1)


def _leaf_in(block: jax.Array, out: jax.Array, rt: _Route, k: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """This device's storage block ``(L, n / g)`` -> its ragged range written into ``out`` ``(L, S + pad)``."""
    m, W = rt.m, rt.width
    t = jnp.arange(W, dtype=jnp.int32)
    # As a source: send destination s the ranks [cs[s, k], ce[s, k]) of my block, if I am its replica.
    mine = (jnp.arange(m, dtype=jnp.int32) % rt.r) == (k % rt.r)
    first = _t(rt.cs)[:, k]  # (m,) over destinations s
    valid = (t[None, :] < _t(rt.count)[:, k][:, None]) & mine[:, None]
    idx = jnp.clip(first[:, None] + t[None, :], 0, max(rt.block_size - 1, 0))
    rows = jnp.take(block, idx, axis=-1) if rt.block_size else jnp.zeros((block.shape[0], m, W), block.dtype)
    rows = jnp.where(valid[None], rows, jnp.zeros((), block.dtype))
    received = jnp.reshape(jax.lax.all_to_all(rows, axes, 1, 1, tiled=True), (block.shape[0], m * W))
    # As a destination: element u of my range is flat index start + u of the leaf.
    u = jnp.arange(rt.local_max, dtype=jnp.int32)
    start, end = _t(rt.starts)[k], _t(rt.ends)[k]
    flat = start + u
    ok = flat < end
    blk = (flat % rt.P) // rt.R
    rank = (flat // rt.P) * rt.R + flat % rt.P - blk * rt.R
    src = blk * rt.r + k % rt.r
    pos = src * W + rank - _t(rt.cs)[k][src]
    vals = jnp.take(received, jnp.clip(jnp.where(ok, pos, 0), 0, m * W - 1), axis=-1)
    lo = jnp.clip(rt.o + start - k * rt.S, 0, rt.S)
    window = jax.lax.dynamic_slice_in_dim(out, lo, rt.local_max, axis=-1)
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(ok[None], vals, window), lo, axis=-1)


# --------------------------------------------------------------------------------------------- conversions
def _bucket_storages(plan: Plan, b: int) -> list[LeafStorage]:
    bucket = plan.buckets[b]
    return [leaf_storage(plan.layer_shape(plan.leaves[i]), plan) for i in bucket.leaves]


@functools.lru_cache(maxsize=256)
def _to_logical_fn(plan: Plan, b: int):
    bucket, m = plan.buckets[b], plan.num_devices
    stacked = bucket.layers is not None
    storages = _bucket_storages(plan, b)
    routes = [_Route(bucket, j, st, m) for j, st in enumerate(storages)]
    axes = _factor_axes(plan)
    mesh = storage_mesh(plan)

    def local(buf):
        k = jax.lax.axis_index(axes)
        buf2 = buf if stacked else buf[None]
        outs = []
        for st, rt in zip(storages, routes, strict=True):
            blk = _leaf_out(buf2, rt, k, axes) if rt.n else jnp.zeros((buf2.shape[0], 0), buf.dtype)
            shape = list(st.shape)
            if st.dim is not None:
                shape[st.dim] //= st.g
            blk = jnp.reshape(blk, (buf2.shape[0], *shape))
            outs.append(blk if stacked else blk[0])
        return outs

    in_spec = P(*([None] if stacked else []), axes)
    out_specs = [st.spec(stacked) for st in storages]
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(in_spec,), out_specs=out_specs, check_vma=False)
    return jax.jit(mapped), NamedSharding(mesh, in_spec), [NamedSharding(mesh, s) for s in out_specs]


@functools.lru_cache(maxsize=256)
def _from_logical_fn(plan: Plan, b: int):
    bucket, m = plan.buckets[b], plan.num_devices
    stacked = bucket.layers is not None
    storages = _bucket_storages(plan, b)
    routes = [_Route(bucket, j, st, m) for j, st in enumerate(storages)]
    axes = _factor_axes(plan)
    mesh = storage_mesh(plan)
    S = bucket.layout.shard_size
    pad = max([rt.local_max for rt in routes], default=0)

    def local(*blocks):
        k = jax.lax.axis_index(axes)
        lead = blocks[0].shape[0] if stacked and blocks else 1
        out = jnp.zeros((lead, S + pad), jnp.dtype(bucket.dtype))
        for blk, rt in zip(blocks, routes, strict=True):
            if rt.n:
                out = _leaf_in(jnp.reshape(blk, (lead, -1)), out, rt, k, axes)
        out = out[:, :S]
        return out if stacked else out[0]

    in_specs = tuple(st.spec(stacked) for st in storages)
    out_spec = P(*([None] if stacked else []), axes)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)
    return jax.jit(mapped), [NamedSharding(mesh, s) for s in in_specs]


def to_logical(buffers: Sequence[jax.Array], plan: Plan) -> list[jax.Array]:
    """The flattened logical leaves of ``plan`` from its bucket buffers, each evenly sharded for storage.

    Args:
      buffers: one global array per bucket (``ShardedParams.buffers`` or a parameter-shaped optimizer state).
      plan: their plan.

    Returns:
      One global array per leaf of the plan (flattening order), of the leaf's shape and the bucket's dtype,
      with :func:`storage_sharding` (on :func:`storage_mesh`).

    Sharding:
      Each bucket is converted by one ``shard_map`` of one all-to-all per leaf; no device receives a leaf
      element it will not store, and no bucket is gathered.
    """
    leaves: list[Any] = [None] * len(plan.leaves)
    for b, (bucket, buf) in enumerate(zip(plan.buckets, buffers, strict=True)):
        fn, in_sharding, _ = _to_logical_fn(plan, b)
        outs = fn(jax.device_put(buf, in_sharding))  # same devices, same layout: a relabelling
        for i, x in zip(bucket.leaves, outs, strict=True):
            leaves[i] = x
    return leaves


def logical_shardings(plan: Plan) -> list[NamedSharding]:
    """The storage sharding of every leaf of ``plan``, in flattening order."""
    out: list[Any] = [None] * len(plan.leaves)
    for bucket in plan.buckets:
        stacked = bucket.layers is not None
        for i in bucket.leaves:
            out[i] = storage_sharding(plan.layer_shape(plan.leaves[i]), plan, stacked=stacked)
    return out


def from_logical(leaves: Sequence[jax.Array], plan: Plan) -> tuple[jax.Array, ...]:
    """Inverse of :func:`to_logical`: bucket buffers with the plan's shardings, packed bucket by bucket.

    Args:
      leaves: the flattened logical leaves (any sharding; storage sharding avoids a reshard).
      plan: the target plan.

    Returns:
      One buffer per bucket with ``plan.shardings()``; padding is zero.
    """
    out = []
    for b, (bucket, target) in enumerate(zip(plan.buckets, plan.shardings(), strict=True)):
        fn, in_shardings = _from_logical_fn(plan, b)
        blocks = [jax.device_put(leaves[i], s) for i, s in zip(bucket.leaves, in_shardings, strict=True)]
        out.append(jax.device_put(fn(*blocks), target))
    return tuple(out)
