"""Flat buckets <-> logical leaves, evenly sharded, compiled once per plan, never a gathered bucket.

A checkpoint stores every leaf at its logical shape. Turning a bucket into its leaves with ``jit(unpack,
out_shardings=...)`` makes XLA all-gather the whole bucket on every device and slice; this module instead moves
each device's ragged range of a leaf straight to the devices that own it under an even *storage sharding*,
inside ``shard_map``, and computes each leaf's checksums on the way.

Storage sharding of a leaf (per layer for a stacked leaf): the plan's ``m`` devices are viewed as a mesh of
``m``'s prime factors (ascending); a leaf dim ``D`` is split over the longest prefix of those factors whose
product ``g`` divides ``D`` (the dim with the largest ``g`` wins, then the earlier dim: a leaf's storage blocks are
then contiguous row blocks wherever its leading dim splits as far as any, which move by local copies and a few
permutes instead of a strided all-to-all; before issue 42 the larger dim won ties, see
:func:`leaf_storage`). ``g == m`` for any dim
divisible by ``m``; a leaf with no dim sharing a factor with ``m`` is replicated (``g == 1``). Each device then
holds ``size / g`` elements of the leaf. Both sides are placements of the relayout engine
(:mod:`vescale_jax.relayout._moves`: the ragged ranges, and per storage block its ``A`` rows of ``R`` elements).

How a leaf (one layer of it) moves, chosen per leaf from its runs: a leaf whose storage blocks are contiguous
(split on its first dim, or few rows) has few runs per device pair, mostly one that stays on its device; it moves
by collective-permute rounds (:func:`vescale_jax.relayout._execute.permute_rounds`: a local copy, then one small
permute per round for the pieces that cross a shard boundary). A strided storage block (split on a later dim,
many rows per device, e.g. a ragged embedding stored in column blocks) moves as whole rows
(:class:`_RowOwners`): each row belongs to the device holding its first element, which completes its last row
with the next device's first elements (one small permute), and one all-to-all of ``(m, H, R)`` carries every
owner's rows cut into column blocks; each device's block is then what it got, source after source, in one
static concatenation (restore: the same the other way, each owner writing the part of its rows in its range
and passing the rest of its last row on). Where a row spans more than two devices' ranges, it moves by one padded
all-to-all (:func:`vescale_jax.relayout._execute.all_to_all`), whose run tables compress a pair's block rows
(``P`` apart on the ragged side) into at most three periodic runs, whatever the leaf size.

Executables (:func:`compile_conversions`): one per bucket and direction, compiled ahead of time and cached by
plan and dtype, so a second save or restore under the same plan compiles nothing. A stacked bucket whose every
leaf stays on its devices (each device's range is its storage block, e.g. a one-leaf bucket split on dim 0) is
converted in one call, all layers at once, by local copies, and so is a stacked bucket no larger than the plan's
largest layer (one call instead of one per layer). Any other stacked bucket runs one call per layer, its
outputs donated and written in place, so the transient memory per device is one layer's moved pieces (about twice
its share of the layer), whatever the layer count. No collective runs inside a loop (XLA:CPU's in-process
rendezvous intermittently aborts on one there). Checksums are reduced per device where each block lands (one
pass per leaf, a variadic reduction) and summed over the devices in the same executable. A restore whose leaves
are its own (:func:`from_logical` with ``donate=True``, as the optimizer state's restore runs it) donates them:
a bucket holding one leaf whose storage blocks are its devices' ranges (split ``m`` ways on its first dim) then
takes the leaf's memory as its buffer, and its conversion only reads the leaf for the checksums.

``_to_logical_fn`` / ``_from_logical_fn`` are the former single-executable form (one all-to-all per leaf and
layer, unrolled); the conversions no longer run them, tests inspect their collectives and lowering.

A leaf stored tile-major (``vj.tiles``, see :mod:`vescale_jax.layout._tiles`) takes a simpler, costlier path: its
ragged ranges are all-gathered (the leaf's storage order is not a row-major range, so the closed-form ranks
above do not apply), relaid out to the logical leaf on every device, and each device keeps its storage block
(restore: the blocks are all-gathered, relaid out to storage order and each device keeps its range). Per
tiled leaf (one layer of it) every device then receives and holds the whole leaf, about ``2 * size`` elements
of transient memory and ``size`` elements received instead of ``size / m``; the stored form is the same.

Leaves split over tensor / expert mesh axes (a *grouped* bucket, ``vj.plan(..., tp=...)``; see
:mod:`vescale_jax.layout._tp`) take the same moves, generalised rather than reassembled: every TP/EP group holds
its own shards of the leaves in one shared layout, so the route tables above are those of the leaf's TP shard
(its local shape), and the moves run over the FSDP factor axes only, within each group. The stored leaf
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

from vescale_jax._cache import plan_cache
from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout._plan import Bucket, Plan
from vescale_jax.relayout._execute import _exact_columns, all_to_all, permute_rounds, rounds
from vescale_jax.relayout._moves import Moves, Placement, plan_moves

__all__ = ["LeafStorage", "compile_conversions", "from_logical", "leaf_storage", "storage_mesh", "to_logical"]

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


def leaf_storage(shape: Sequence[int], plan: Plan, *, earlier: bool = True) -> LeafStorage:
    """The storage split of a leaf of per-layer ``shape`` under ``plan`` (see the module docstring).

    ``earlier=False`` is the rule before issue 42 (on a tie in ``g`` the larger dim, so a ``(d, 3d)``
    projection was stored in column blocks and converted by a strided all-to-all). The stored arrays are the same
    logical arrays either way (only Orbax's chunking follows the split), so checkpoints written under either rule
    restore under the other; tests write one under the old rule to check that.
    """
    shape = tuple(int(d) for d in shape)
    factors, names = _prime_factors(plan.num_devices), _factor_axes(plan)
    best = (1, -1, None, 0)  # (g, dim size, dim, prefix length)
    for d, size in enumerate(shape if math.prod(shape) else ()):  # an empty leaf is "replicated" (no data)
        g, j = 1, 0
        while j < len(factors) and factors[j] > 1 and size % (g * factors[j]) == 0:
            g, j = g * factors[j], j + 1
        if g > 1 and (g > best[0] if earlier else (g, size) > best[:2]):
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


def _runs_of(box: Sequence[int], dims: Sequence[int]) -> list[tuple[int, int]]:
    """A box of a row-major array of shape ``dims`` as ``(size, stride)`` per merged dim: a dim merges with the
    dims after it while those span their whole extent (the box is contiguous there)."""
    out: list[tuple[int, int]] = []
    stride, whole = 1, False  # whole: every dim of the current run is taken at its full extent
    for n, extent in zip(reversed(box), reversed(dims), strict=True):
        if whole:
            out[-1] = (out[-1][0] * n, out[-1][1])
        else:
            out.append((n, stride))
        whole = n == extent
        stride *= extent
    return out[::-1]


def _partial_sums(blk: jax.Array, full: tuple[int, ...], starts: Sequence[jax.Array], layer: jax.Array) -> jax.Array:
    """The two checksums of this device's box of one layer: ``blk`` is ``(1, *box)``, at per-dim ``starts`` of a
    per-layer leaf of shape ``full``; ``layer`` its index. The weights are the word indices of the whole leaf, as
    :func:`vescale_jax.checkpoint._integrity.checksums` computes them (uint32 arithmetic).

    With ``first`` the index of the box's first word and ``i`` a word's offset from it, ``sum w (2 index + 1)`` is
    ``(2 first + 1) sum w + 2 sum w i``: both sums in one pass (a variadic reduction), the offsets from one iota
    per run of contiguous dims.
    """
    box = tuple(blk.shape[1:])
    w = words(blk[0])
    nw = w.shape[-1] if w.ndim == len(box) + 1 else 1
    u32 = jnp.uint32
    dims = (*full, nw)
    strides = [math.prod(dims[d + 1 :]) % 2**32 for d in range(len(dims))]
    first = layer * u32(math.prod(dims) % 2**32)
    for d, start in enumerate(starts):
        first = first + start * u32(strides[d])
    runs = _runs_of((*box, nw), dims)
    w = jnp.reshape(w, tuple(n for n, _ in runs))
    offset = jnp.zeros(w.shape, u32)
    for d, (_, stride) in enumerate(runs):
        offset = offset + jax.lax.broadcasted_iota(u32, w.shape, d) * u32(stride % 2**32)
    zero = u32(0)
    total, moment = jax.lax.reduce(
        (w, w * offset), (zero, zero), lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(w.ndim))
    )
    return jnp.stack([total, total * (first * u32(2) + u32(1)) + moment * u32(2)])


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


# ------------------------------------------------------------------------ per-bucket executables, layer by layer
_FEW_RUNS = 8
"""Runs per device pair up to which a leaf moves by collective-permute rounds instead of a padded all-to-all."""


def _by_permutes(moves: Moves) -> bool:
    """Whether ``moves`` go by :func:`permute_rounds`: few runs per pair (contiguous storage blocks, pieces that
    mostly stay on their device). A padded all-to-all sizes every message by the largest pair, ``m`` times a
    device's piece when pieces barely move; strided blocks (many rows per pair) take the all-to-all."""
    if not len(moves):
        return True
    m = moves.num_devices
    return int(np.bincount(moves.src * m + moves.dst).max()) <= _FEW_RUNS


class _RowOwners:
    """The static tables of a strided leaf moved as whole rows: row ``a`` (its ``P`` elements) is owned by the
    device whose range holds its first element, and the elements of an owner's last row that lie past its range
    (``need``, fewer than ``P``) are the first of the next device's range.

    Attributes:
      first: ``(m,)`` each device's first owned row (0 where it owns none).
      count: ``(m,)`` how many rows it owns (the counts add up to the leaf's ``A`` rows).
      rows: ``H``, the most rows a device owns.
      need: ``(m,)`` elements of its last owned row past its range (taken from the next device).
      halo: the largest ``need``.
      window: ``(m,)`` where its first owned row starts in its bucket row (0 where it owns none).
    """

    def __init__(self, rt: _Route, first: np.ndarray, count: np.ndarray, need: np.ndarray):
        self.first, self.count, self.need = first, count, need
        self.rows, self.halo = int(count.max(initial=0)), int(need.max(initial=0))
        self.window = np.where(count > 0, rt.o + first * rt.P - np.arange(rt.m) * rt.S, 0)
        self.pairs = [(k + 1, k) for k in np.nonzero(need)[0].tolist()]  # next device -> owner

    @classmethod
    def of(cls, rt: _Route) -> _RowOwners | None:
        """The tables, or ``None`` unless the storage blocks are strided (``A > 1`` rows), a device owns at most
        about two shards' worth of rows, and every owner's missing tail lies in the next device's range."""
        if not rt.R or rt.block_size // rt.R <= 1:
            return None
        P, some = rt.P, rt.ends > rt.starts
        first = np.where(some, -(-rt.starts // P), 0)
        count = np.where(some, np.maximum(-(-rt.ends // P) - first, 0), 0)
        need = np.where(count > 0, (first + count) * P - rt.ends, 0)
        rows = int(count.max(initial=0))
        if not rows or rows * P > 2 * rt.S + P or int(need.max(initial=0)) > rt.S:
            return None
        for k in np.nonzero(need)[0]:
            nxt = k + 1
            if nxt >= rt.m or rt.starts[nxt] != rt.ends[k] or rt.ends[nxt] < rt.ends[k] + need[k]:
                return None
        return cls(rt, first, count, need)


def _exchange(msgs: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``msgs[d]`` to device ``d`` by one all-to-all; returns ``got[s]``, from device ``s``. The messages travel
    as rows of one row-major ``(m, H * R)`` array (XLA:CPU's all-to-all wants every split part alike laid out)."""
    flat = jnp.reshape(msgs, (msgs.shape[0], -1))
    return jnp.reshape(jax.lax.all_to_all(flat, axes, 0, 0, tiled=False), msgs.shape)


def _rows_out(row: jax.Array, rt: _Route, ow: _RowOwners, k: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """:func:`_layer_out` of a strided leaf by whole rows: each owner completes its last row with the next
    device's first elements (one small permute), cuts its ``H`` rows into the ``g`` column blocks, one
    all-to-all of ``(m, H, R)`` sends each block to its storage devices, and each device's block is what it got,
    source after source (``count[s]`` rows each, static): no mask, every element copied once per pass."""
    P, R, g, r, H = rt.P, rt.R, rt.g, rt.r, ow.rows
    if ow.halo:
        row = jnp.concatenate([row, jax.lax.ppermute(row[: ow.halo], axes, ow.pairs)])
    row = jnp.pad(row, (0, max(0, int((ow.window + H * P).max()) - row.shape[0])))  # a window never clamps
    win = jnp.reshape(jax.lax.dynamic_slice_in_dim(row, _t(ow.window)[k], H * P), (H, g, R))
    msgs = jnp.swapaxes(win, 0, 1)  # (g, H, R): block b of every owned row, for its storage devices
    if r > 1:
        msgs = jnp.repeat(msgs, r, axis=0)  # device d stores block d // r
    got = _exchange(msgs, axes)  # [s]: from device s
    blk = jnp.concatenate([got[s, :n] for s, n in enumerate(ow.count.tolist()) if n], axis=0)
    return jnp.reshape(blk, (-1,))


def _rows_in(block: jax.Array, out: jax.Array, rt: _Route, ow: _RowOwners, k, axes: tuple[str, ...]) -> jax.Array:
    """:func:`_layer_in` of a strided leaf by whole rows: each device sends every owner its owned rows of the
    block (one all-to-all of ``(m, H, R)``); each owner joins one replica of every block into whole rows, writes
    the part of them in its range and sends the rest (the head of the next device's range) on by one permute."""
    P, R, g, r, H = rt.P, rt.R, rt.g, rt.r, ow.rows
    blk = jnp.reshape(block, (-1, R))
    A = blk.shape[0]
    msgs = jnp.stack(  # (m, H, R): for device d, its rows (zeros past the block's end)
        [blk[a : a + H] if a + H <= A else jnp.pad(blk[a:], ((0, a + H - A), (0, 0))) for a in ow.first.tolist()]
    )
    got = _exchange(msgs, axes)
    if r > 1:  # one replica of each block: device b * r + k % r (the replicas spread the reads)
        got = jnp.take(got, jnp.arange(g, dtype=jnp.int32) * r + k % r, axis=0)
    rows = jnp.reshape(jnp.swapaxes(got, 0, 1), (H * P,)).astype(out.dtype)  # elements from first[k] * P
    mine = np.where(ow.count > 0, rt.ends - (ow.first * P), 0)  # how many of them are in this device's range
    size, n = out.shape[-1], _t(mine)[k]
    short = int((ow.window + H * P).max()) - size  # a window never clamps
    padded = jnp.pad(out, (0, short)) if short > 0 else out
    at = _t(ow.window)[k]
    cur = jax.lax.dynamic_slice_in_dim(padded, at, H * P)
    new = jnp.where(jnp.arange(H * P, dtype=jnp.int32) < n, rows, cur)
    out = jax.lax.dynamic_update_slice_in_dim(padded, new, at, 0)
    out = out[:size] if short > 0 else out
    if ow.halo:  # the rest of my last row: the head of the next device's range, at its offset 0
        tail = jax.lax.dynamic_slice_in_dim(jnp.pad(rows, (0, ow.halo)), n, ow.halo)  # never clamped
        tail = jax.lax.ppermute(tail, axes, [(s, d) for d, s in ow.pairs])
        head = np.zeros(rt.m, np.int64)
        head[[d for d, _ in ow.pairs]] = ow.need[[s for _, s in ow.pairs]]
        keep = jnp.arange(ow.halo, dtype=jnp.int32) < _t(head)[k]
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, tail, out[: ow.halo]), 0, 0)
    return out


def _layer_out(row: jax.Array, rt: _Route, st: LeafStorage, gran: Any, k: jax.Array, axes: tuple[str, ...]):
    """One layer of one leaf: this device's bucket row ``(S,)`` -> its storage block ``(n / g,)``."""
    if gran is not None:
        return _tiled_out(row[None], rt, st, gran, k, axes)[0]
    if _by_permutes(rt.to_blocks):
        return permute_rounds(row, jnp.zeros((rt.block_size,), row.dtype), rt.to_blocks, axis=axes)
    owners = _RowOwners.of(rt)
    if owners is not None:
        return _rows_out(row, rt, owners, k, axes)
    return all_to_all(row[None], rt.to_blocks, axis=axes, size=rt.block_size)[0]


def _layer_in(block: jax.Array, out: jax.Array, rt: _Route, st: LeafStorage, gran: Any, k, axes):
    """One layer of one leaf: this device's storage block ``(n / g,)`` -> its range written into ``out``."""
    if gran is not None:
        return _tiled_in(block[None], out[None], rt, st, gran, k, axes)[0]
    if _by_permutes(rt.to_ranges):
        return permute_rounds(block, out, rt.to_ranges, axis=axes)
    owners = _RowOwners.of(rt)
    if owners is not None:
        return _rows_in(block, out, rt, owners, k, axes)
    return all_to_all(block[None], rt.to_ranges, axis=axes, size=out.shape[-1], out=out[None])[0]


def _replica_axes(plan: Plan, bucket: Bucket) -> tuple[str, ...]:
    """Storage-mesh axes over which a bucket's devices hold the same data (HSDP replicas): counted once."""
    return tuple(a for a in storage_mesh(plan).axis_names if a not in (*bucket.groups, *_factor_axes(plan)))


def _own_sums(
    blk: jax.Array, plan: Plan, bucket: Bucket, i: int, st: LeafStorage, rt: _Route, k: jax.Array, layer
) -> jax.Array:
    """This device's share ``(2,)`` of leaf ``i``'s checksums over its storage block ``blk`` (zero on all but one
    replica of the block); summed over every device they are the leaf's checksums. ``blk`` is one layer (of
    index ``layer``) for a stacked leaf, or every layer at once where ``layer`` is ``None``."""
    shape = plan.leaves[i].shape
    starts = _box_starts(plan, i, st, rt, k)
    if bucket.layers is None:
        sums = _partial_sums(blk[None], shape, starts, jnp.uint32(0))
    elif layer is None:
        sums = _partial_sums(blk[None], shape, [jnp.uint32(0), *starts], jnp.uint32(0))
    else:
        sums = _partial_sums(blk[None], shape[1:], starts, layer.astype(jnp.uint32))
    mine = (k % rt.r) == 0
    for a in _replica_axes(plan, bucket):
        mine = mine & (jax.lax.axis_index(a) == 0)
    return jnp.where(mine, sums, jnp.zeros_like(sums))


def _stays(moves: Moves) -> bool:
    """Whether every run of ``moves`` stays on its device and each device copies one run per column at the
    column's full width: the move is then an unmasked local copy, the same for every layer (no collective)."""
    if not len(moves):
        return True
    if (moves.src != moves.dst).any():
        return False
    return all(all(_exact_columns(*r[:4], moves.num_devices)) for r in rounds(moves))


def _row_bytes(plan: Plan, bucket: Bucket) -> int:
    """Bytes of one layer of ``bucket`` across all devices (the whole bucket if it is not stacked)."""
    return bucket.num_groups * plan.num_devices * bucket.layout.shard_size * np.dtype(bucket.dtype).itemsize


def _whole(plan: Plan, bucket: Bucket, routes: Sequence[_Route], direction: str) -> bool:
    """Whether a stacked bucket converts every layer at once (none of its leaves tiled): when each leaf's move
    :func:`_stays` (a local copy per leaf, no temporary beyond the outputs), or when the whole bucket is no
    larger than the plan's largest layer (a small bucket: one call instead of one per layer, its transient
    memory still within one layer's)."""
    tiled = bool(bucket.storage) and any(g is not None for g in bucket.storage)
    if bucket.layers is None or tiled:
        return False
    small = bucket.layers * _row_bytes(plan, bucket) <= max(_row_bytes(plan, b) for b in plan.buckets)
    return small or all(_stays(getattr(rt, direction)) for rt in routes)


def _summed(parts: Sequence[jax.Array], mesh: jax.sharding.Mesh) -> jax.Array:
    """Inside ``shard_map``: this device's checksum shares ``(leaves, 2)`` summed over every device (``psum``):
    each stored block counts once (:func:`_own_sums` zeroes the other replicas)."""
    if not parts:
        return jnp.zeros((0, 2), jnp.uint32)
    return jax.lax.psum(jnp.stack(parts), tuple(mesh.axis_names))


class _BucketIO:
    """Shapes and shardings of one bucket's conversion on the storage mesh.

    Attributes:
      buffer: the bucket buffer's ``ShapeDtypeStruct`` (storage-mesh sharding).
      leaves: its leaves' ``ShapeDtypeStruct`` s (storage shardings).
      sums: the checksums ``(leaves, 2)`` uint32, replicated (every device's share summed in the executable).
      layer: the layer index argument (a replicated int32 scalar).
    """

    def __init__(self, plan: Plan, b: int, dtype: str):
        mesh, axes = storage_mesh(plan), _factor_axes(plan)
        bucket = plan.buckets[b]
        lead = () if bucket.layers is None else (bucket.layers,)
        size = bucket.num_groups * plan.num_devices * bucket.layout.shard_size
        self.buffer = jax.ShapeDtypeStruct(
            (*lead, size), np.dtype(dtype), sharding=NamedSharding(mesh, _bucket_spec(plan, bucket, axes))
        )
        self.leaves = tuple(
            jax.ShapeDtypeStruct(plan.leaves[i].shape, np.dtype(dtype), sharding=leaf_sharding(plan, i))
            for i in bucket.leaves
        )
        self.sums = jax.ShapeDtypeStruct(
            (len(bucket.leaves), 2), np.dtype(np.uint32), sharding=NamedSharding(mesh, P())
        )
        self.layer = jax.ShapeDtypeStruct((), np.dtype(np.int32), sharding=NamedSharding(mesh, P()))


@plan_cache
def _out_executables(plan: Plan, b: int, dtype: str, memory_kind: str | None = None) -> tuple[Any, Any, Any]:
    """Bucket ``b`` -> its logical leaves, compiled: ``(start, step, finish)`` (:func:`out_programs`, each
    program lowered for its arguments and compiled; ``start`` makes the zeros a stacked bucket starts from)."""
    layered, programs = out_programs(plan, b, dtype, memory_kind)
    step, finish = (fn.lower(*args).compile() if fn is not None else None for fn, args in programs)
    if not layered:
        return None, step, finish
    io = _BucketIO(plan, b, dtype)
    return _zeros(io.leaves, io.sums), step, finish


def out_programs(plan: Plan, b: int, dtype: str, memory_kind: str | None = None) -> tuple[bool, Any]:
    """Bucket ``b`` -> its logical leaves, as jitted programs: ``(layered, ((step, args), (finish, args)))``.

    A stacked bucket whose layers move differently is ``layered``, converted one layer per call: the caller
    starts from zero leaves and checksum shares, and ``step(buffer, leaves, sums, layer)`` writes layer
    ``layer`` of every leaf in place (``leaves`` and ``sums`` donated) and adds its checksums; otherwise
    ``step(buffer) -> (leaves, sums)`` converts the bucket in one call. ``memory_kind`` (e.g.
    ``"pinned_host"``): the leaves end in that memory, written there by ``step`` itself (``finish`` is
    ``None``) or, for a layered bucket, by ``finish(leaves)`` after the last layer; ``finish`` is ``None``
    without a ``memory_kind``. Each ``args`` are the program's abstract arguments (to lower it for any
    platform).

    Sharding:
      Inside ``shard_map`` over the storage mesh; per call each device holds one layer's bucket row, the moved
      pieces (collective-permute rounds, or a padded all-to-all for strided storage blocks) and its blocks.
    """
    mesh, axes, io = storage_mesh(plan), _factor_axes(plan), _BucketIO(plan, b, dtype)
    bucket, storages = plan.buckets[b], _bucket_storages(plan, b)
    routes = [_Route(bucket, j, st, plan.num_devices) for j, st in enumerate(storages)]
    stacked, whole = bucket.layers is not None, _whole(plan, bucket, routes, "to_blocks")

    def local(buf, *rest):
        outs, sums, layer = rest if stacked and not whole else ((), None, None)
        k = jax.lax.axis_index(axes)
        row = jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False) if layer is not None else buf
        new, parts = [], []
        for j, (i, st, rt) in enumerate(zip(bucket.leaves, storages, routes, strict=True)):
            gran = bucket.storage[j] if bucket.storage else None
            if not rt.n:
                new.append(jnp.zeros((*row.shape[:-1], *_local_shape(st)), buf.dtype))
                parts.append(jnp.zeros((2,), jnp.uint32))
                continue
            if whole:  # every layer at once, the same move per layer
                blk = jax.vmap(lambda r, rt=rt, st=st: _layer_out(r, rt, st, None, k, axes))(row)
            else:
                blk = _layer_out(row, rt, st, gran, k, axes)
            blk = jnp.reshape(blk, (*row.shape[:-1], *_local_shape(st)))
            parts.append(_own_sums(blk, plan, bucket, i, st, rt, k, layer))
            if layer is not None:
                blk = jax.lax.dynamic_update_index_in_dim(outs[j], blk, layer, 0)
            new.append(blk)
        share = _summed(parts, mesh)
        return tuple(new), share if sums is None else sums + share

    leaf_specs = tuple(x.sharding.spec for x in io.leaves)
    sums_spec = io.sums.sharding.spec
    placed = tuple(x.sharding.with_memory_kind(memory_kind) for x in io.leaves) if memory_kind else None
    if whole or not stacked:
        fn = jax.shard_map(
            local, mesh=mesh, in_specs=(io.buffer.sharding.spec,), out_specs=(leaf_specs, sums_spec), check_vma=False
        )
        # with a memory kind, the program itself writes the leaves there: no device copy outlives it
        outs = (placed, io.sums.sharding) if placed else None
        return False, ((jax.jit(fn, out_shardings=outs), (io.buffer,)), (None, ()))
    in_specs = (io.buffer.sharding.spec, leaf_specs, sums_spec, P())
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(leaf_specs, sums_spec), check_vma=False)
    step = (jax.jit(fn, donate_argnums=(1, 2)), (io.buffer, io.leaves, io.sums, io.layer))
    # (not donated: no output can alias a device buffer; the device copy is freed once this program ran)
    finish = (jax.jit(lambda leaves: leaves, out_shardings=placed), (io.leaves,)) if placed else (None, ())
    return True, (step, finish)


@functools.lru_cache(maxsize=256)
def _reshapes(plan: Plan, b: int) -> bool:
    """Whether bucket ``b`` holds one leaf whose storage blocks are its devices' ranges, whole and in order (a
    leaf split ``m`` ways on its first dim, filling the bucket): each device's buffer row (every layer's, for a
    stacked bucket) is then its storage block reshaped, and a logical -> bucket conversion that may donate its
    input writes nothing (the output is the input's memory)."""
    bucket = plan.buckets[b]
    if len(bucket.leaves) != 1 or (bucket.storage and bucket.storage[0] is not None):
        return False
    (st,) = _bucket_storages(plan, b)
    rt = _Route(bucket, 0, st, plan.num_devices)
    S = bucket.layout.shard_size
    return rt.o == 0 and rt.g == plan.num_devices and rt.block_size == S and rt.n == rt.g * S and st.view()[0] == 1


def _in_step(plan: Plan, b: int, dtype: str, donate: bool = False) -> tuple[Any, Any]:
    """:func:`_in_executables` of bucket ``b``; ``donate``: the caller's leaves are not used afterwards (a restore's
    freshly read arrays), so a bucket that :func:`_reshapes` takes them as its buffer without a copy."""
    return _in_executables(plan, b, dtype, donate and _reshapes(plan, b))


@plan_cache
def _in_executables(plan: Plan, b: int, dtype: str, donate: bool = False) -> tuple[Any, Any]:
    """Logical leaves -> bucket ``b``'s buffer, compiled: ``(start, step)`` as in :func:`_out_executables`.

    A stacked bucket: ``start()`` makes the zero buffer and checksum shares, ``step(leaves, buffer, sums,
    layer)`` writes layer ``layer`` of the buffer in place (``buffer`` and ``sums`` donated) and adds the
    checksums of that layer of every leaf; otherwise ``step(leaves) -> (buffer, sums)``. ``donate`` (only for a
    bucket that :func:`_reshapes`): ``step`` donates ``leaves``, whose memory becomes the buffer.
    """
    mesh, axes, io = storage_mesh(plan), _factor_axes(plan), _BucketIO(plan, b, dtype)
    bucket, storages = plan.buckets[b], _bucket_storages(plan, b)
    routes = [_Route(bucket, j, st, plan.num_devices) for j, st in enumerate(storages)]
    stacked, S = bucket.layers is not None, bucket.layout.shard_size
    reshapes = _reshapes(plan, b)
    whole = reshapes or _whole(plan, bucket, routes, "to_ranges")
    pad = 0 if whole else max([rt.local_max for rt in routes], default=0)

    def local(leaves, *rest):
        buf, sums, layer = rest if stacked and not whole else (None, None, None)
        k = jax.lax.axis_index(axes)
        lead = (bucket.layers,) if whole and stacked else ()
        if reshapes:  # the storage block is the buffer row: checksums, and a reshape (no copy if donated)
            (i,), (st,), (rt,) = bucket.leaves, storages, routes
            share = _summed([_own_sums(leaves[0], plan, bucket, i, st, rt, k, None)], mesh)
            return jnp.reshape(leaves[0], (*lead, S)), share
        out = jnp.zeros((*lead, S + pad), io.buffer.dtype)
        parts = []
        for j, (i, st, rt) in enumerate(zip(bucket.leaves, storages, routes, strict=True)):
            blk = leaves[j] if layer is None else jax.lax.dynamic_index_in_dim(leaves[j], layer, 0, keepdims=False)
            if not rt.n:
                parts.append(jnp.zeros((2,), jnp.uint32))
                continue
            parts.append(_own_sums(blk, plan, bucket, i, st, rt, k, layer))
            gran = bucket.storage[j] if bucket.storage else None
            if whole:  # every layer at once, the same move per layer
                rows = jnp.reshape(blk, (*lead, -1))
                out = jax.vmap(lambda r, o, rt=rt, st=st: _layer_in(r, o, rt, st, None, k, axes))(rows, out)
            else:
                out = _layer_in(jnp.reshape(blk, (-1,)), out, rt, st, gran, k, axes)
        share = _summed(parts, mesh)
        if layer is None:
            return out[..., :S], share
        return jax.lax.dynamic_update_index_in_dim(buf, out[:S], layer, 0), sums + share

    leaf_specs = tuple(x.sharding.spec for x in io.leaves)
    buf_spec, sums_spec = io.buffer.sharding.spec, io.sums.sharding.spec
    if whole or not stacked:
        fn = jax.shard_map(local, mesh=mesh, in_specs=(leaf_specs,), out_specs=(buf_spec, sums_spec), check_vma=False)
        return None, jax.jit(fn, donate_argnums=(0,) if donate else ()).lower(io.leaves).compile()
    in_specs = (leaf_specs, buf_spec, sums_spec, P())
    fn = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(buf_spec, sums_spec), check_vma=False)
    step = jax.jit(fn, donate_argnums=(1, 2)).lower(io.leaves, io.buffer, io.sums, io.layer).compile()
    return _zeros(io.buffer, io.sums), step


def _zeros(*targets: Any) -> Any:
    """A compiled function returning zero arrays of ``targets``' shapes, dtypes and shardings."""
    shardings = jax.tree.map(lambda t: t.sharding, targets)
    fn = jax.jit(lambda: jax.tree.map(lambda t: jnp.zeros(t.shape, t.dtype), targets), out_shardings=shardings)
    return fn.lower().compile()


def _one_at_a_time(results: Any) -> Any:
    """``results``, once computed where the platform needs it: on XLA:CPU a conversion's next executable is
    launched only after this one has finished; elsewhere it returns at once (the device's stream orders them).

    Launched asynchronously, consecutive executables whose collectives span every device may run at once on
    XLA:CPU's simulated devices, and their in-process rendezvous then waits on threads held by the other one
    (an abort after 40 s, seen on a GPT-like tree); one at a time, each collective's participants all arrive.
    A GPU runs each device's programs in the order they were launched, so there the conversions are only
    enqueued: the caller goes on (e.g. to the next train step) while they run.
    """
    if must_wait(results):
        return jax.block_until_ready(results)
    return results


def _in_program(memory_kind: str | None) -> str | None:
    """The memory kind a conversion program writes its outputs to itself: ``"pinned_host"`` (what a GPU's
    programs can place their outputs in); any other kind (``"unpinned_host"``) is reached by a copy after it."""
    return memory_kind if memory_kind == "pinned_host" else None


def must_wait(results: Any) -> bool:
    """Whether a conversion's executables must run one at a time from the host (:func:`_one_at_a_time`): the
    arrays ``results`` live on XLA:CPU devices."""
    for x in jax.tree.leaves(results):
        if isinstance(x, jax.Array):
            return any(d.platform == "cpu" for d in x.sharding.device_set)
    return True


def _layer_indices(plan: Plan, layers: int) -> list[jax.Array]:
    """The replicated int32 scalars ``0 .. layers - 1`` a stacked bucket's ``step`` takes."""
    sharding = NamedSharding(storage_mesh(plan), P())
    return [jax.device_put(np.int32(i), sharding) for i in range(layers)]


def _bucket_dtypes(plan: Plan, dtypes: Sequence[str] | None) -> tuple[str, ...]:
    if dtypes is None:
        return tuple(np.dtype(b.dtype).name for b in plan.buckets)
    return tuple(np.dtype(d).name for d in dtypes)


def compile_conversions(
    plan: Plan, dtypes: Sequence[str] | None = None, *, donate: bool = False, memory_kind: str | None = None
) -> None:
    """Compiles (ahead of time, cached by plan) every executable :func:`to_logical` (with its ``memory_kind``)
    and :func:`from_logical` (with its ``donate``) run for ``plan`` with bucket dtypes ``dtypes`` (default the
    plan's); runs nothing."""
    for b, dtype in enumerate(_bucket_dtypes(plan, dtypes)):
        _out_executables(plan, b, dtype, _in_program(memory_kind))
        _in_step(plan, b, dtype, donate)


def _relabel(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` under an equivalent sharding on another mesh of the same devices, without copying when possible."""
    if isinstance(x, jax.Array) and x.sharding.devices_indices_map(x.shape) == sharding.devices_indices_map(x.shape):
        return jax.make_array_from_single_device_arrays(x.shape, sharding, [s.data for s in x.addressable_shards])
    return jax.device_put(x, sharding)


def to_logical(
    buffers: Sequence[jax.Array], plan: Plan, *, memory_kind: str | None = None, defer_sums: bool = False
) -> tuple[list[jax.Array], Any]:
    """The flattened logical leaves of ``plan`` from its bucket buffers, each evenly sharded for storage.

    Args:
      buffers: one global array per bucket (``ShardedParams.buffers`` or a parameter-shaped optimizer state).
      plan: their plan.
      memory_kind: the memory each bucket's conversion writes its leaves to: ``"pinned_host"`` inside its
        program (a stacked bucket: one more program after its last layer), another host kind by a copy right
        after it; the device holds one bucket's logical copy at a time, and none once the conversions have run.
        ``None``: device memory.
      defer_sums: return the checksums as a function that fetches them (from another thread, say), so that
        nothing here waits for the conversions on a platform that runs them in launch order (a GPU): this
        call only enqueues them. On XLA:CPU each conversion still finishes before the next launches.

    Returns:
      ``(leaves, sums)``: one global array per leaf of the plan (flattening order), of the leaf's shape and the
      bucket's dtype, with :func:`storage_sharding` (on :func:`storage_mesh`) in ``memory_kind``; and each
      leaf's two checksums (``(num_leaves, 2)`` uint32, as :func:`vescale_jax.checkpoint._integrity.checksums`
      computes them), or with ``defer_sums`` a function of no arguments returning them.

    Sharding:
      One compiled executable per bucket, cached by plan and dtype (:func:`compile_conversions`); a stacked
      bucket converted one layer per call, in place. Every leaf moves by collective-permute rounds (an
      all-to-all for strided storage blocks) over the plan's axis, within each TP/EP group for a grouped
      bucket; no device receives a leaf element it will not store, and no bucket is gathered.
    """
    leaves: list[Any] = [None] * len(plan.leaves)
    shares = []
    in_program = _in_program(memory_kind)
    for b, bucket in enumerate(plan.buckets):
        start, step, finish = _out_executables(plan, b, np.dtype(buffers[b].dtype).name, in_program)
        # Same devices, same layout: relabelling onto the storage mesh moves no data.
        buf = _relabel(buffers[b], NamedSharding(storage_mesh(plan), _bucket_spec(plan, bucket, _factor_axes(plan))))
        outs, sums = _run(plan, bucket, start, step, buf)
        if finish is not None:  # a stacked bucket's leaves to their memory (the device copy dropped here)
            outs = _one_at_a_time(finish(outs))
        elif memory_kind is not None and in_program is None:  # moved before the next bucket
            outs = _one_at_a_time([jax.device_put(x, x.sharding.with_memory_kind(memory_kind)) for x in outs])
        for i, x in zip(bucket.leaves, outs, strict=True):
            leaves[i] = x
        shares.append(sums)
    if defer_sums:
        return leaves, functools.partial(_gather_sums, plan, shares)
    return leaves, _gather_sums(plan, shares)


def _run(plan: Plan, bucket: Any, start: Any, step: Any, source: Any) -> tuple[Any, jax.Array]:
    """Runs one bucket's conversion (either direction): ``step(source)`` in one call when ``start`` is None,
    else ``start()``'s zero outputs and checksums filled one layer per ``step(source, outs, sums, layer)`` call,
    each finished before the next launches."""
    if start is None:
        return _one_at_a_time(step(source))
    outs, sums = start()
    for layer in _layer_indices(plan, bucket.layers):
        outs, sums = _one_at_a_time(step(source, outs, sums, layer))
    return outs, sums


def _gather_sums(plan: Plan, shares: Sequence[jax.Array]) -> np.ndarray:
    """Per-bucket checksums (replicated arrays) -> ``(num_leaves, 2)`` in the plan's leaf order."""
    out = np.zeros((len(plan.leaves), 2), np.uint32)
    for bucket, share in zip(plan.buckets, jax.device_get(list(shares)), strict=True):
        if bucket.leaves:
            out[list(bucket.leaves)] = np.asarray(share, np.uint32)
    return out


def logical_shardings(plan: Plan) -> list[NamedSharding]:
    """The storage sharding of every leaf of ``plan``, in flattening order."""
    return [leaf_sharding(plan, i) for i in range(len(plan.leaves))]


def from_logical(
    leaves: Sequence[jax.Array], plan: Plan, *, donate: bool = False
) -> tuple[tuple[jax.Array, ...], np.ndarray]:
    """Inverse of :func:`to_logical`: bucket buffers with the plan's shardings, and the leaves' checksums.

    Args:
      leaves: the flattened logical leaves (any sharding; storage sharding avoids a reshard).
      plan: the target plan.
      donate: the leaves are not used afterwards (e.g. freshly read by a restore): a one-leaf bucket whose
        storage blocks are its devices' ranges then takes the leaf's memory as its buffer (no copy), and the
        leaf is deleted.

    Returns:
      ``(buffers, sums)``: one buffer per bucket with ``plan.shardings()`` (padding zero), and the input
      leaves' checksums as in :func:`to_logical`.

    Sharding:
      As :func:`to_logical`, the other way: one executable per bucket, a stacked bucket one layer per call.
    """
    # A parameter-shaped optimizer state may hold another dtype than the params (e.g. bf16 momentum): each
    # bucket takes its leaves' dtype.
    dtypes = tuple(np.dtype(leaves[b.leaves[0]].dtype).name if b.leaves else b.dtype for b in plan.buckets)
    bufs, shares = [], []
    for b, bucket in enumerate(plan.buckets):
        start, step = _in_step(plan, b, dtypes[b], donate)
        mine = tuple(_relabel(leaves[i], leaf_sharding(plan, i)) for i in bucket.leaves)
        buf, sums = _run(plan, bucket, start, step, mine)
        bufs.append(buf)
        shares.append(sums)
    out = tuple(_relabel(b, s) for b, s in zip(bufs, plan.shardings(), strict=True))
    return out, _gather_sums(plan, shares)


def words(x: jax.Array) -> jax.Array:
    """The leaf's bits as uint32 words: one per element for <= 4-byte dtypes, a trailing dim of 2 for 8-byte."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = np.dtype(x.dtype).itemsize
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    w = jax.lax.bitcast_convert_type(x, unsigned)
    return w.astype(jnp.uint32)
