"""Sharded flat buffers: ``ShardedParams`` and the pure-jnp pack / unpack reference path.

``pack`` lays a bucket's leaves into its flat global buffer at the plan's offsets (padding is zero);
``unpack`` reads them back by static slices and reshapes (zero-copy under XLA). ``shard`` / ``unshard`` and
``init_sharded`` move whole trees in and out of the sharded form.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._cache import plan_cache
from vescale_jax.kernels import _dispatch as collectives
from vescale_jax.layout import _tp as tp
from vescale_jax.layout._bucket_layout import BucketLayout
from vescale_jax.layout._checks import tree_difference
from vescale_jax.layout._paths import path_str
from vescale_jax.layout._plan import Bucket, Plan
from vescale_jax.state._checks import check_buffers_fit_plan, check_not_donated, check_sharded_params
from vescale_jax.state._containers import GatheredParams, PerDevice, ShardedParams

__all__ = [
    "GatheredParams",
    "PerDevice",
    "ShardedParams",
    "check_tree",
    "init_sharded",
    "init_sharded_fn",
    "pack",
    "pack_bucket",
    "shard",
    "unpack",
    "unpack_bucket",
    "unpack_layout",
    "unshard",
]


def check_tree(params: Any, plan: Plan, *, what: str = "params") -> list[Any]:
    """Returns the leaves of ``params`` after checking structure, shapes and dtypes against ``plan``."""
    if not isinstance(plan, Plan):
        raise TypeError(
            f"expected a vj.Plan, got {type(plan).__name__}; the arguments are ({what}, plan) with plan from "
            "vj.plan(params, mesh)."
        )
    if isinstance(params, ShardedParams | GatheredParams):
        raise TypeError(
            f"{what} are already a vj.{type(params).__name__}; pass them as they are (vj.unshard(sp) gives the "
            "logical tree back)."
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if treedef != plan.treedef:
        got = [path_str(p) for p, _ in flat]
        raise ValueError(
            f"{what} do not match the plan's tree structure ({len(flat)} leaves, the plan has {len(plan.leaves)}): "
            f"{tree_difference(got, [s.path for s in plan.leaves])}. Pass the tree the plan was made from, or "
            "re-run vj.plan on this tree."
        )
    leaves = []
    for (path, leaf), spec in zip(flat, plan.leaves, strict=True):
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = np.dtype(getattr(leaf, "dtype", type(leaf)))
        if shape != spec.shape or dtype.name != spec.dtype:
            raise ValueError(
                f"{what} leaf {jax.tree_util.keystr(path)} has shape {shape} and dtype {dtype.name}, but the plan "
                f"expects {spec.shape} {spec.dtype}; re-run vj.plan on this tree."
            )
        leaves.append(leaf)
    return leaves


def pack_bucket(leaves: Sequence[jax.Array], bucket: Bucket, *, dtype: Any = None) -> jax.Array:
    """Lays ``leaves`` (the bucket's, in slot order) into its global flat buffer; padding is zero.

    The XLA path of :func:`vescale_jax.step._wire.pack` (the kernels' ``pack_reference``), mapped over the
    layer dim of a stacked bucket.

    Args:
      leaves: one array per slot, of the logical shape (stacked leaves with their layer dim first).
      bucket: the bucket.
      dtype: the buffer's dtype (default: the bucket's).

    Returns:
      The ``(m*S,)`` (or ``(L, m*S)``) buffer.
    """
    lead = () if bucket.layers is None else (bucket.layers,)
    dtype = jnp.dtype(bucket.dtype if dtype is None else dtype)
    return collectives.pack(
        leaves,
        bucket.layout,
        dtype=dtype,
        kernels_policy=collectives.DEFAULT_KERNELS,
        lead=lead,
        storage=bucket.storage,
    )


def unpack_bucket(buffer: jax.Array, bucket: Bucket, shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
    """Reads each slot's leaf out of a full (gathered) buffer by a static slice and reshape (and the
    relayout of a leaf stored tile-major)."""
    return collectives.unpack(
        buffer, bucket.layout, shapes, kernels_policy=collectives.DEFAULT_KERNELS, storage=bucket.storage
    )


def unpack_layout(buffer: jax.Array, layout: BucketLayout, shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
    """Slot ``i`` of a full buffer laid out by ``layout``: ``buffer[..., o:o+n].reshape(shapes[i])`` (the
    kernels' ``unpack_reference``, mapped over leading dims)."""
    return collectives.unpack(buffer, layout, shapes, kernels_policy=collectives.DEFAULT_KERNELS)


def bits_dtype(dtype: Any) -> np.dtype | None:
    """The unsigned integer dtype of a floating dtype narrower than 32 bits (bf16, fp16, fp8), else None.

    XLA:CPU computes data movement of such floats (concatenate, pad) through fp32 and rounds back, which
    turns every NaN into the canonical one (bf16 ``0xff81`` -> ``0xffc0``); moved as these integers, the
    bits stay as they are."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(f"uint{8 * dtype.itemsize}")
    return None


def as_bits(x: Any, dtype: Any) -> Any:
    """``x`` (of floating ``dtype``) bitcast to :func:`bits_dtype` of ``dtype`` (unchanged when that is None)."""
    bits = bits_dtype(dtype)
    return x if bits is None else jax.lax.bitcast_convert_type(jnp.asarray(x, dtype), bits)


def from_bits(x: Any, dtype: Any) -> Any:
    """Inverse of :func:`as_bits`."""
    return x if bits_dtype(dtype) is None else jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))


def pack(leaves: Sequence[jax.Array], plan: Plan) -> tuple[jax.Array, ...]:
    """Packs the flattened logical leaves into one global buffer per bucket (a bucket split over tensor /
    expert axes: each group's shards packed, the groups side by side). Bit-exact: low-precision floats
    move as integers (:func:`bits_dtype`), so NaN payloads are kept."""
    return tuple(from_bits(x, b.dtype) for x, b in zip(pack_bits(leaves, plan), plan.buckets, strict=True))


def pack_bits(leaves: Sequence[jax.Array], plan: Plan) -> tuple[jax.Array, ...]:
    """:func:`pack`, the buffers of low-precision float buckets left as their bits (:func:`bits_dtype`)."""
    return pack_moved([as_bits(x, s.dtype) for x, s in zip(leaves, plan.leaves, strict=True)], plan)


def pack_moved(leaves: Sequence[jax.Array], plan: Plan) -> tuple[jax.Array, ...]:
    """:func:`pack` of leaves as they are (low-precision floats already as their bits: :func:`pack_bits`)."""
    out = []
    sizes = dict(plan.mesh.shape)
    for b in plan.buckets:
        bits = bits_dtype(b.dtype)
        mine = {i: leaves[i] for i in b.leaves}
        if not b.groups:
            out.append(pack_bucket([mine[i] for i in b.leaves], b, dtype=bits))
            continue
        parts = []
        for g in range(b.num_groups):
            coords = tp.group_coords(g, b.groups, sizes)
            blocks = [tp.local_block(mine[i], plan.leaves[i].tp, coords, sizes) for i in b.leaves]
            parts.append(pack_bucket(blocks, b, dtype=bits))
        out.append(jnp.concatenate(parts, axis=-1))
    return tuple(out)


def unpack(buffers: Sequence[jax.Array], plan: Plan) -> list[jax.Array]:
    """Inverse of :func:`pack`: the flattened logical leaves from full buffers (bit-exact, as :func:`pack`).

    Each leaf keeps its buffer's dtype, which may differ from the plan's (a parameter-shaped optimizer state)."""
    leaves = unpack_bits([as_bits(buf, buf.dtype) for buf in buffers], plan)
    return [from_bits(x, buffers[spec.bucket].dtype) for x, spec in zip(leaves, plan.leaves, strict=True)]


def unpack_bits(buffers: Sequence[jax.Array], plan: Plan) -> list[jax.Array]:
    """:func:`unpack` on buffers as they are (static slices, reshapes, the tensor-parallel assembly): from
    :func:`pack_bits`' buffers, the leaves as bits."""
    leaves: list[Any] = [None] * len(plan.leaves)
    sizes = dict(plan.mesh.shape)
    for b, buf in zip(plan.buckets, buffers, strict=True):
        if not b.groups:
            for i, x in zip(b.leaves, unpack_bucket(buf, b, [plan.leaves[i].shape for i in b.leaves]), strict=True):
                leaves[i] = x
            continue
        n = b.layout.total_size
        per_group = [
            unpack_bucket(buf[..., g * n : (g + 1) * n], b, [plan.leaves[i].local_shape for i in b.leaves])
            for g in range(b.num_groups)
        ]
        for slot, i in enumerate(b.leaves):
            spec = plan.leaves[i]
            leaves[i] = tp.assemble([xs[slot] for xs in per_group], spec.shape, spec.tp, b.groups, sizes)
    return leaves


def shard(params: Any, plan: Plan) -> ShardedParams:
    """Packs a logical parameter tree into sharded flat buckets.

    Args:
      params: a tree matching ``plan`` (same structure, shapes and dtypes).
      plan: from :func:`vescale_jax.plan`.

    Returns:
      :class:`ShardedParams` whose buffers carry the plan's shardings.

    Sharding:
      Each device ends up with ``S`` elements per bucket (per layer); see :func:`init_sharded` to create
      parameters without ever holding the whole model.
    """
    leaves = check_tree(params, plan)
    for spec, leaf in zip(plan.leaves, leaves, strict=True):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"vj.shard: leaf {spec.path!r} is an abstract jax.ShapeDtypeStruct {spec.shape} {spec.dtype}, not an "
                "array; shard real values, or create them straight into the shards with "
                "vj.init_sharded(init_fn, plan, key) (abstract trees are for vj.plan)."
            )
    # Bitcast to bits before the jit and back after it: a low-precision float that enters or leaves a
    # partitioned program can come out with its NaNs made canonical (XLA:CPU), an integer cannot.
    bits = _shard_fn(plan)([as_bits(x, s.dtype) for x, s in zip(leaves, plan.leaves, strict=True)])
    return ShardedParams([from_bits(x, b.dtype) for x, b in zip(bits, plan.buckets, strict=True)], plan)


@plan_cache
def _shard_fn(plan: Plan) -> Callable[[Sequence[Any]], tuple[jax.Array, ...]]:
    """The jitted pack of :func:`shard` (low-precision floats as bits, :func:`pack_moved`), one per plan (a
    second call on the plan does not compile again)."""

    def shard_leaves(leaves):
        return pack_moved(leaves, plan)

    return jax.jit(shard_leaves, out_shardings=plan.shardings())


def unshard(sp: ShardedParams) -> Any:
    """The logical tree back from :class:`ShardedParams`, bit-exact, replicated on the plan's mesh.

    Args:
      sp: sharded parameters, or any parameter-shaped optimizer state (its buffers of the plan's shapes, of any
        dtype: fp32 moments of bf16 params, 8-bit codes).

    Returns:
      The logical tree (the plan's structure); each leaf in its bucket's buffer dtype (fp32 moments come back
      fp32, whatever the params' dtype).
    """
    check_sharded_params(sp, "vj.unshard", what="its argument")
    check_not_donated(sp, "vj.unshard")
    check_buffers_fit_plan(sp, "vj.unshard")
    plan = sp.plan
    dtypes = [jnp.dtype(x.dtype) for x in sp.buffers]
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
    # all-gather (works on Auto and Explicit axes), as bits: bit-exact for NaN payloads, as vj.shard
    buffers = [jax.device_put(as_bits(x, d), replicated) for x, d in zip(sp.buffers, dtypes, strict=True)]
    leaves = _unshard_fn(plan)(buffers)
    return jax.tree_util.tree_unflatten(
        plan.treedef, [from_bits(x, dtypes[s.bucket]) for x, s in zip(leaves, plan.leaves, strict=True)]
    )


@plan_cache
def _unshard_fn(plan: Plan) -> Callable[[Sequence[jax.Array]], list[jax.Array]]:
    """The jitted unpack of :func:`unshard`, one per plan (traced once per tuple of buffer dtypes)."""
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())

    def unshard_buffers(buffers):
        return unpack_bits(buffers, plan)

    return jax.jit(unshard_buffers, out_shardings=[replicated] * len(plan.leaves))


def _auto_mesh(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def _even_spec(shape: tuple[int, ...], axis: Any, m: int, dims: tp.DimAxes = ()) -> jax.sharding.PartitionSpec:
    """Shards the largest dim divisible by ``m`` (replicated if none), beside the leaf's tensor / expert split
    ``dims``: a cheap layout to create a leaf in."""
    spec: list[Any] = [axes or None for axes in dims] if dims else [None] * len(shape)
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if spec[d] is None and shape[d] % m == 0 and shape[d] >= m:
            spec[d] = axis
            break
    return jax.sharding.PartitionSpec(*spec)


def init_sharded_fn(init_fn: Callable[..., Any], plan: Plan) -> Callable[..., tuple[jax.Array, ...]]:
    """The jitted function behind :func:`init_sharded`: ``(*args) -> bucket buffers`` (lower it to inspect)."""
    mesh = _auto_mesh(plan.mesh)
    m = plan.num_devices

    def packed(*a):
        leaves = check_tree(init_fn(*a), plan, what="init_fn output")
        leaves = [
            jax.lax.with_sharding_constraint(
                x, jax.sharding.NamedSharding(mesh, _even_spec(x.shape, plan.axis, m, spec.tp))
            )
            for x, spec in zip(leaves, plan.leaves, strict=True)
        ]
        return tuple(
            _pack_in_groups([leaves[i] for i in b.leaves], b, plan, mesh)
            if b.groups
            else pack_bucket([leaves[i] for i in b.leaves], b)
            for b in plan.buckets
        )

    out = tuple(jax.sharding.NamedSharding(mesh, plan.partition_spec(b)) for b in plan.buckets)
    return jax.jit(packed, out_shardings=out)


def _pack_in_groups(leaves: Sequence[jax.Array], bucket: Bucket, plan: Plan, mesh: jax.sharding.Mesh) -> jax.Array:
    """A grouped bucket's global buffer packed where its blocks lie: a ``shard_map`` manual over the group axes
    hands each group its leaves' TP/EP blocks (the fsdp axis stays automatic), so no device assembles another
    group's part of a leaf."""
    P = jax.sharding.PartitionSpec
    in_specs = tuple(P(*[axes or None for axes in plan.leaves[i].tp]) for i in bucket.leaves)
    groups = tuple(bucket.groups)
    out_specs = P(groups) if bucket.layers is None else P(None, groups)
    local = lambda *xs: pack_bucket(xs, bucket)
    return jax.shard_map(
        local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=set(groups), check_vma=False
    )(*leaves)


def init_sharded(init_fn: Callable[..., Any], plan: Plan, *args: Any) -> ShardedParams:
    """Runs ``init_fn(*args)`` straight into the plan's shards, under ``jit``.

    Each leaf is created sharded on its largest dim divisible by the device count (XLA partitions the
    initialisers, threefry included, so each device draws only its part), then moved into the bucket layout.
    No device holds the whole model: the transient peak is about one leaf (``init_sharded_fn(...)`` lowers
    to inspect it; the tests check its ``memory_analysis()``).

    Args:
      init_fn: returns a tree matching ``plan`` (e.g. ``lambda key: model.init(key, x)["params"]``).
      plan: the plan, typically made from ``jax.eval_shape(init_fn, *args)``.
      *args: arguments of ``init_fn`` (PRNG keys, example inputs).

    Returns:
      :class:`ShardedParams` with the plan's shardings. Values equal ``jax.jit(init_fn)(*args)`` bit for bit.
    """
    buffers = init_sharded_fn(init_fn, plan)(*args)
    # Same devices, same layout: relabelling onto the plan's own mesh moves no data.
    return ShardedParams([jax.device_put(x, s) for x, s in zip(buffers, plan.shardings(), strict=True)], plan)
