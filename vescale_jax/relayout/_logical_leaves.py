"""Flat buckets <-> logical leaves, evenly sharded, one all-to-all per leaf and no gathered bucket.

A checkpoint stores every leaf at its logical shape. Turning a bucket into its leaves with ``jit(unpack,
out_shardings=...)`` makes XLA all-gather the whole bucket on every device and slice; this module instead moves
each device's ragged range of a leaf straight to the devices that own it under an even *storage sharding*, by
one (padded) all-to-all per leaf inside ``shard_map``.

Storage sharding of a leaf (per layer for a stacked leaf): the plan's ``m`` devices are viewed as a mesh of
``m``'s prime factors (ascending); a leaf dim ``D`` is split over the longest prefix of those factors whose
product ``g`` divides ``D`` (the dim with the largest ``g`` wins, then the larger dim). ``g == m`` for any dim
divisible by ``m``; a leaf with no dim sharing a factor with ``m`` is replicated (``g == 1``). Each device then
holds ``size / g`` elements of the leaf. Both sides are placements of the relayout engine
(:mod:`vescale_jax.relayout._moves`: the ragged ranges, and per storage block its ``A`` rows of ``R`` elements),
moved by its padded all-to-all (:func:`vescale_jax.relayout._execute.all_to_all`); the block rows of one device
pair are ``P`` apart on the ragged side, so its run tables compress them into at most three periodic runs per
pair, whatever the leaf size.

Transient memory per device: each leaf's all-to-all send and receive buffers, ``m * W`` elements each, where
``W`` is the largest piece one device sends another (``W <= size / g``), so at most twice one leaf (one layer
of it: stacked leaves are converted layer by layer, one collective per layer in a static sequence, none inside a
loop) and about ``2 * size / m`` for a leaf spread over all devices. The outputs (the logical leaves, or the
packed buckets) are one more copy of the device's share. (XLA keeps the unrolled layers' index tables live, so
the compiled temp is larger than this; see docs/checkpoint.md.)

A leaf stored tile-major (``vj.tiles``, see :mod:`vescale_jax.layout._tiles`) takes a simpler, costlier path: its
ragged ranges are all-gathered (the leaf's storage order is not a row-major range, so the closed-form ranks
above do not apply), relaid out to the logical leaf on every device, and each device keeps its storage block
(restore: the blocks are all-gathered, relaid out to storage order and each device keeps its range). Per
tiled leaf (one layer of it) every device then receives and holds the whole leaf, about ``2 * size`` elements
of transient memory and ``size`` elements received instead of ``size / m``; the stored form is the same.

Leaves split over tensor / expert mesh axes (a *grouped* bucket, ``vj.plan(..., tp=...)``; see
:mod:`vescale_jax.layout._tp`) take the same all-to-all, generalised rather than reassembled: every TP/EP group holds
its own shards of the leaves in one shared layout, so the route tables above are those of the leaf's TP shard
(its local shape), and the all-to-all runs over the FSDP factor axes only, within each group. The stored leaf
is still the whole logical leaf at its full shape (the stored form does not depend on the TP split): its
storage sharding is the leaf's TP split (its ``LeafSpec.tp`` axes, major) composed with the even storage split
of its TP shard (the factor axes, minor), so device ``(group, k)`` stores block ``k`` of its group's shard and
no element crosses a group. Checksums are of the whole logical leaf, so they agree across plans.
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

from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout._plan import Bucket, Plan
from vescale_jax.relayout._execute import all_to_all
from vescale_jax.relayout._moves import Moves, Placement, plan_moves

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

    def spec(self, stacked: bool, tp: Sequence[tuple[str, ...]] = ()) -> P:
        """The storage ``PartitionSpec`` of the whole leaf: per dim its TP/EP axes ``tp`` (the leaf's
        ``LeafSpec.tp``, over the full leaf's dims, layer dim included), then the factor axes on ``dim``."""
        per_layer = tuple(tp[1:] if stacked else tp) if tp else ((),) * len(self.shape)
        parts: list[Any] = []
        for d, axes in enumerate(per_layer):
            axes = (*axes, *(self.axes if d == self.dim else ()))
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*([None] if stacked else []), *parts)


def leaf_storage(shape: Sequence[int], plan: Plan) -> LeafStorage:
    """The storage split of a leaf of per-layer ``shape`` under ``plan`` (see the module docstring)."""
    shape = tuple(int(d) for d in shape)
    factors, names = _prime_factors(plan.num_devices), _factor_axes(plan)
    best = (1, -1, None, 0)  # (g, dim size, dim, prefix length)
    for d, size in enumerate(shape if math.prod(shape) else ()):  # an empty leaf is "replicated" (no data)
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


def leaf_sharding(plan: Plan, i: int) -> NamedSharding:
    """The storage ``NamedSharding`` of leaf ``i`` of ``plan`` (its whole logical shape): the even split of its
    TP/EP shard, beside its TP/EP split for a leaf of a grouped bucket."""
    spec = plan.leaves[i]
    stacked = plan.buckets[spec.bucket].layers is not None
    return NamedSharding(storage_mesh(plan), leaf_storage(plan.layer_shape(spec), plan).spec(stacked, spec.tp))


# ----------------------------------------------------------------------------------------------- placements
class _Route:
    """One leaf's (one layer's) relayout between its ragged ranges in the bucket and its storage blocks: the two
    placements and the engine's :class:`~vescale_jax.relayout._moves.Moves` both ways."""

    def __init__(self, bucket: Bucket, slot: int, storage: LeafStorage, m: int):
        S, o, n = bucket.layout.shard_size, bucket.layout.offsets[slot], bucket.layout.sizes[slot]
        A, D, B = storage.view()
        g = storage.g
        r = m // g
        s = np.arange(m)
        self.starts = np.clip(s * S - o, 0, n)
        self.ends = np.clip((s + 1) * S - o, 0, n)
        self.local_max = max(1, int((self.ends - self.starts).max(initial=0)))
        self.S, self.o, self.n, self.m, self.r, self.g = S, o, n, m, r, g
        self.R, self.P = (D // g) * B, D * B
        self.block_size = n // g
        # Device k holds leaf elements [starts[k], ends[k]) at bucket-local offset o + starts[k] - k * S; as a
        # storage block b = k // r it holds, per outer row a, elements [a * P + b * R, + R) at a * R.
        self.ranges = Placement.of(m, s, 0, self.starts, self.ends - self.starts, o + self.starts - s * S)
        rows = np.arange(A if self.R else 0, dtype=np.int64)
        dev = np.repeat(s, rows.size)
        a = np.tile(rows, m)
        self.blocks = Placement.of(m, dev, 0, a * self.P + (dev // r) * self.R, self.R, a * self.R)

    @functools.cached_property
    def to_blocks(self) -> Moves:
        return plan_moves(self.ranges, self.blocks)

    @functools.cached_property
    def to_ranges(self) -> Moves:
        """Device d's range from the replicas ``s`` of its blocks with ``s % r == d % r`` (spread evenly)."""
        parts = []
        for j in range(self.r):
            src = self.blocks.device % self.r == j
            dst = self.ranges.device % self.r == j
            parts.append(plan_moves(_pieces(self.blocks, src), _pieces(self.ranges, dst)))
        cols = [np.concatenate([getattr(p, c) for p in parts]) for c in _MOVE_COLUMNS]
        return Moves.of(self.m, *cols)


_MOVE_COLUMNS = ("src", "dst", "src_offset", "dst_offset", "length")


def _pieces(p: Placement, keep: np.ndarray) -> Placement:
    return Placement(p.num_devices, p.device[keep], p.key[keep], p.start[keep], p.length[keep], p.offset[keep])


def _t(values: Any) -> jax.Array:
    return jnp.asarray(np.asarray(values, np.int32))


def _leaf_out(local: jax.Array, rt: _Route, k: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Bucket local ``(L, S)`` -> this device's storage block ``(L, n / g)`` of one leaf (one all-to-all)."""
    return all_to_all(local, rt.to_blocks, axis=axes, size=rt.block_size)


def _leaf_in(block: jax.Array, out: jax.Array, rt: _Route, k: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """This device's storage block ``(L, n / g)`` -> its ragged range written into ``out`` ``(L, S + pad)``."""
    return all_to_all(block, rt.to_ranges, axis=axes, size=out.shape[-1], out=out)


def _tiled_out(
    local: jax.Array, rt: _Route, st: LeafStorage, gran: Any, k: jax.Array, axes: tuple[str, ...]
) -> jax.Array:
    """:func:`_leaf_out` of a leaf stored tile-major: all-gather its ranges, relayout, keep this device's block."""
    w = rt.local_max
    padded = jnp.pad(local, ((0, 0), (0, w)))
    lo = jnp.clip(rt.o + _t(rt.starts)[k] - k * rt.S, 0, rt.S)
    piece = jax.lax.dynamic_slice_in_dim(padded, lo, w, axis=-1)  # (L, w): my range of the leaf, then junk
    pieces = jax.lax.all_gather(piece, axes, axis=1)  # (L, m, w)
    lengths = (rt.ends - rt.starts).tolist()
    flat = jnp.concatenate([pieces[:, s, :n] for s, n in enumerate(lengths) if n], axis=-1)  # (L, n)
    logical = tiles.from_storage(flat, st.shape, gran, jnp)
    A, D, B = st.view()
    logical = jnp.reshape(logical, (local.shape[0], A, D, B))
    blk = jax.lax.dynamic_slice_in_dim(logical, (k // rt.r) * (D // rt.g), D // rt.g, axis=2)
    return jnp.reshape(blk, (local.shape[0], rt.block_size))


def _tiled_in(
    block: jax.Array, out: jax.Array, rt: _Route, st: LeafStorage, gran: Any, k: jax.Array, axes: tuple[str, ...]
) -> jax.Array:
    """:func:`_leaf_in` of a leaf stored tile-major: all-gather the blocks, relayout, write this device's range."""
    lead, (A, D, B), g = block.shape[0], st.view(), rt.g
    blocks = jax.lax.all_gather(block, axes, axis=1)[:, :: rt.r]  # (L, g, n / g): one replica of each block
    logical = jnp.reshape(jnp.swapaxes(jnp.reshape(blocks, (lead, g, A, D // g, B)), 1, 2), (lead, *st.shape))
    flat = jnp.pad(tiles.to_storage(logical, st.shape, gran, jnp), ((0, 0), (0, rt.local_max)))
    start, end = _t(rt.starts)[k], _t(rt.ends)[k]
    vals = jax.lax.dynamic_slice_in_dim(flat, start, rt.local_max, axis=-1)
    ok = jnp.arange(rt.local_max, dtype=jnp.int32) < end - start
    lo = jnp.clip(rt.o + start - k * rt.S, 0, rt.S)
    window = jax.lax.dynamic_slice_in_dim(out, lo, rt.local_max, axis=-1)
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(ok[None], vals.astype(out.dtype), window), lo, axis=-1)


# --------------------------------------------------------------------------------------------- conversions
def _after(x: Any, done: Any) -> tuple[Any, Any]:
    """``(x, done)``, ``x`` available only once ``done`` is (``lax.optimization_barrier``).

    The conversions run their collectives one after another, each one layer of one leaf, none inside a loop:
    the next collective's input waits for the previous one's result, so XLA neither overlaps their buffers (the
    transient memory stays one layer's) nor reorders them. Callers go on with the returned ``done`` (a buffer
    they then update in place), so the barrier adds no copy. A collective inside a ``while`` loop (``lax.map``
    over layers) intermittently aborts XLA:CPU's in-process rendezvous on simulated devices; a static sequence
    of launches does not.
    """
    return jax.lax.optimization_barrier((x, done))


def _bucket_storages(plan: Plan, b: int) -> list[LeafStorage]:
    bucket = plan.buckets[b]
    return [leaf_storage(plan.layer_shape(plan.leaves[i]), plan) for i in bucket.leaves]


def _per_layer_tp(plan: Plan, i: int) -> tuple[tuple[str, ...], ...]:
    """Leaf ``i``'s TP/EP axes per dim of one layer (``()`` per dim for a leaf that is not split)."""
    spec = plan.leaves[i]
    dims = spec.tp[1:] if spec.tp and plan.buckets[spec.bucket].layers is not None else spec.tp
    return tuple(dims) if dims else ((),) * len(plan.layer_shape(spec))


def _box_starts(plan: Plan, i: int, st: LeafStorage, rt: _Route, k: jax.Array) -> list[jax.Array]:
    """Inside ``shard_map``: where this device's storage block of one layer of leaf ``i`` starts, per dim of the
    whole (per-layer) leaf: its group's TP/EP shard, then its block of that shard on the storage dim."""
    u32, sizes = jnp.uint32, dict(plan.mesh.shape)
    starts = []
    for d, (n, axes) in enumerate(zip(st.shape, _per_layer_tp(plan, i), strict=True)):
        index = u32(0)
        for a in axes:
            index = index * u32(sizes[a]) + jax.lax.axis_index(a).astype(u32)
        start = index * u32(n % 2**32)
        if d == st.dim:
            start = start + (k // rt.r).astype(u32) * u32((n // st.g) % 2**32)
        starts.append(start)
    return starts


def _partial_sums(blk: jax.Array, full: tuple[int, ...], starts: Sequence[jax.Array], layer: jax.Array) -> jax.Array:
    """The two checksums of this device's box of one layer: ``blk`` is ``(1, *box)``, at per-dim ``starts`` of a
    per-layer leaf of shape ``full``; ``layer`` its index. The weights are the word indices of the whole leaf, as
    :func:`vescale_jax.checkpoint._integrity.checksums` computes them (uint32 arithmetic)."""
    box = tuple(blk.shape[1:])
    w = words(blk[0])
    nw = w.shape[-1] if w.ndim == len(box) + 1 else 1
    w = jnp.reshape(w, (*box, nw))
    u32 = jnp.uint32
    flat = jnp.full(w.shape, layer, u32)
    for d, n in enumerate(full):
        flat = flat * u32(n % 2**32) + (starts[d] + jax.lax.broadcasted_iota(u32, w.shape, d))
    flat = flat * u32(nw) + jax.lax.broadcasted_iota(u32, w.shape, len(box))
    weight = flat * u32(2) + u32(1)
    return jnp.stack([jnp.sum(w, dtype=u32), jnp.sum(w * weight, dtype=u32)])


def _block_sums(
    blk: jax.Array, plan: Plan, i: int, st: LeafStorage, rt: _Route, k: jax.Array, axes: tuple[str, ...]
) -> jax.Array:
    """This device's part of the checkpoint's checksums of leaf ``i`` (one replica counts), summed
    over devices (the FSDP factor axes and the leaf's TP/EP group axes). A stacked leaf is summed one layer at a
    time, so no full-size word array is materialised."""
    u32 = jnp.uint32
    spec = plan.leaves[i]
    bucket = plan.buckets[spec.bucket]
    full = spec.shape if bucket.layers is None else spec.shape[1:]
    starts = _box_starts(plan, i, st, rt, k)
    lead = blk.shape[0]
    if lead > 1:
        parts = jax.lax.map(lambda a: _partial_sums(a[0][None], full, starts, a[1]), (blk, jnp.arange(lead, dtype=u32)))
        sums = jnp.sum(parts, axis=0, dtype=u32)
    else:
        sums = _partial_sums(blk, full, starts, u32(0))
    mine = (k % rt.r) == 0
    return jax.lax.psum(jnp.where(mine, sums, jnp.zeros_like(sums)), (*bucket.groups, *axes))


def _bucket_spec(plan: Plan, bucket: Bucket, axes: tuple[str, ...]) -> P:
    """A bucket buffer's ``PartitionSpec`` on the storage mesh (the plan's axis as its factor axes)."""
    flat = (*bucket.groups, *axes) if bucket.groups else axes
    return P(*([None] if bucket.layers is not None else []), flat)


def _leaf_specs(plan: Plan, tables) -> list[Any]:
    out: list[Any] = [None] * len(plan.leaves)
    for bucket, storages, _ in tables:
        for i, st in zip(bucket.leaves, storages, strict=True):
            out[i] = st.spec(bucket.layers is not None, plan.leaves[i].tp)
    return out


def _local_shape(st: LeafStorage) -> tuple[int, ...]:
    shape = list(st.shape)
    if st.dim is not None:
        shape[st.dim] //= st.g
    return tuple(shape)


def _plan_tables(plan: Plan):
    m = plan.num_devices
    per_bucket = []
    for b, bucket in enumerate(plan.buckets):
        storages = _bucket_storages(plan, b)
        per_bucket.append((bucket, storages, [_Route(bucket, j, st, m) for j, st in enumerate(storages)]))
    return per_bucket


@functools.lru_cache(maxsize=64)
def _to_logical_fn(plan: Plan):
    tables, axes, mesh = _plan_tables(plan), _factor_axes(plan), storage_mesh(plan)

    def local(*bufs):
        k = jax.lax.axis_index(axes)
        outs: list[Any] = [None] * len(plan.leaves)
        sums: list[Any] = [None] * len(plan.leaves)
        last: Any = ()  # the previous leaf's result: every collective waits for the one before (_after)
        for buf, (bucket, storages, routes) in zip(bufs, tables, strict=True):
            stacked = bucket.layers is not None
            buf2 = buf if stacked else buf[None]
            for j, (i, st, rt) in enumerate(zip(bucket.leaves, storages, routes, strict=True)):
                gran = bucket.storage[j] if bucket.storage else None
                out_fn = _leaf_out if gran is None else functools.partial(_tiled_out, st=st, gran=gran)
                blk = jnp.zeros((buf2.shape[0], rt.block_size), buf.dtype)
                # One layer at a time, unrolled: the collective buffers hold one layer's piece.
                for layer in range(buf2.shape[0] if rt.n else 0):
                    # k too: the layer's index tables are computed after the barrier, not hoisted and kept.
                    (src, kk), (blk, _) = _after((buf2, k), (blk, last))
                    piece = out_fn(src[layer : layer + 1], rt, k=kk, axes=axes)
                    blk = jax.lax.dynamic_update_slice_in_dim(blk, piece, layer, axis=0)
                last = blk
                blk = jnp.reshape(blk, (buf2.shape[0], *_local_shape(st)))
                sums[i] = _block_sums(blk, plan, i, st, rt, k, axes)
                outs[i] = blk if stacked else blk[0]
        return outs, jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)

    in_specs = tuple(_bucket_spec(plan, b, axes) for b, _, _ in tables)
    out_specs = _leaf_specs(plan, tables)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(out_specs, P()), check_vma=False)
    return jax.jit(mapped), [NamedSharding(mesh, s) for s in in_specs]


@functools.lru_cache(maxsize=64)
def _from_logical_fn(plan: Plan, dtypes: tuple[str, ...] | None = None):
    tables, axes, mesh = _plan_tables(plan), _factor_axes(plan), storage_mesh(plan)

    def local(*leaves):
        k = jax.lax.axis_index(axes)
        sums: list[Any] = [None] * len(plan.leaves)
        bufs = []
        last: Any = ()  # the previous bucket's result: every collective waits for the one before (_after)
        for b, (bucket, storages, routes) in enumerate(tables):
            stacked = bucket.layers is not None
            S = bucket.layout.shard_size
            pad = max([rt.local_max for rt in routes], default=0)
            lead = bucket.layers if stacked else 1
            dtype = jnp.dtype(bucket.dtype if dtypes is None else dtypes[b])
            for i, st, rt in zip(bucket.leaves, storages, routes, strict=True):
                sums[i] = _block_sums(jnp.reshape(leaves[i], (lead, *_local_shape(st))), plan, i, st, rt, k, axes)
            rows = [jnp.reshape(leaves[i], (lead, -1)) for i in bucket.leaves]

            def fill(rows, routes=routes, storages=storages, grans=bucket.storage, S=S, pad=pad, dtype=dtype):
                out = jnp.zeros((rows[0].shape[0] if rows else 1, S + pad), dtype)
                for j, (row, rt) in enumerate(zip(rows, routes, strict=True)):
                    gran = grans[j] if grans else None
                    if not rt.n:
                        continue
                    row, out = _after(row, out)  # the previous leaf's unpack first
                    if gran is None:
                        out = _leaf_in(row, out, rt, k, axes)
                    else:
                        out = _tiled_in(row, out, rt, storages[j], gran, k, axes)
                return out[:, :S]

            # One layer at a time, every leaf of it, unrolled: each layer's row of the buffer is written once.
            buf = jnp.zeros((lead, S), dtype)
            for layer in range(lead):
                src, (buf, _) = _after(rows, (buf, last))
                buf = jax.lax.dynamic_update_slice_in_dim(buf, fill([r[layer : layer + 1] for r in src]), layer, 0)
            last = buf
            bufs.append(buf if stacked else buf[0])
        return bufs, jnp.stack(sums) if sums else jnp.zeros((0, 2), jnp.uint32)

    in_specs = _leaf_specs(plan, tables)
    out_specs = [_bucket_spec(plan, b, axes) for b, _, _ in tables]
    mapped = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs), out_specs=(out_specs, P()), check_vma=False)
    return jax.jit(mapped), [NamedSharding(mesh, s) for s in in_specs]


def _relabel(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` under an equivalent sharding on another mesh of the same devices, without copying when possible."""
    if isinstance(x, jax.Array) and x.sharding.devices_indices_map(x.shape) == sharding.devices_indices_map(x.shape):
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [s.data for s in x.addressable_shards])
    return jax.device_put(x, sharding)


def to_logical(buffers: Sequence[jax.Array], plan: Plan) -> tuple[list[jax.Array], np.ndarray]:
    """The flattened logical leaves of ``plan`` from its bucket buffers, each evenly sharded for storage.

    Args:
      buffers: one global array per bucket (``ShardedParams.buffers`` or a parameter-shaped optimizer state).
      plan: their plan.

    Returns:
      ``(leaves, sums)``: one global array per leaf of the plan (flattening order), of the leaf's shape and the
      bucket's dtype, with :func:`storage_sharding` (on :func:`storage_mesh`); and each leaf's two checksums
      (``(num_leaves, 2)`` uint32, as :func:`vescale_jax.checkpoint._integrity.checksums` computes them).

    Sharding:
      One ``shard_map`` moves every leaf by one all-to-all (over the plan's axis, within each TP/EP group for a
      grouped bucket); no device receives a leaf element it will not store, and no bucket is gathered.
    """
    fn, in_shardings = _to_logical_fn(plan)
    # Same devices, same layout: relabelling onto the storage mesh moves no data.
    outs, sums = fn(*[_relabel(b, s) for b, s in zip(buffers, in_shardings, strict=True)])
    return list(outs), np.asarray(jax.device_get(sums))


def logical_shardings(plan: Plan) -> list[NamedSharding]:
    """The storage sharding of every leaf of ``plan``, in flattening order."""
    return [leaf_sharding(plan, i) for i in range(len(plan.leaves))]


def from_logical(leaves: Sequence[jax.Array], plan: Plan) -> tuple[tuple[jax.Array, ...], np.ndarray]:
    """Inverse of :func:`to_logical`: bucket buffers with the plan's shardings, and the leaves' checksums.

    Args:
      leaves: the flattened logical leaves (any sharding; storage sharding avoids a reshard).
      plan: the target plan.

    Returns:
      ``(buffers, sums)``: one buffer per bucket with ``plan.shardings()`` (padding zero), and the input
      leaves' checksums as in :func:`to_logical`.
    """
    # A parameter-shaped optimizer state may hold another dtype than the params (e.g. bf16 momentum): each
    # bucket takes its leaves' dtype.
    dtypes = tuple(np.dtype(leaves[b.leaves[0]].dtype).name if b.leaves else b.dtype for b in plan.buckets)
    fn, in_shardings = _from_logical_fn(plan, dtypes)
    bufs, sums = fn(*[_relabel(x, s) for x, s in zip(leaves, in_shardings, strict=True)])
    out = tuple(_relabel(b, s) for b, s in zip(bufs, plan.shardings(), strict=True))
    return out, np.asarray(jax.device_get(sums))


def words(x: jax.Array) -> jax.Array:
    """The leaf's bits as uint32 words: one per element for <= 4-byte dtypes, a trailing dim of 2 for 8-byte."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    w = jax.lax.bitcast_convert_type(x, unsigned)
    return w.astype(jnp.uint32)
