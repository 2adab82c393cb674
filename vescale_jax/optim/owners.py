"""Owner routing for distributed Muon: which device orthogonalises which matrix, and the static index tables
that move each matrix's elements from the devices that hold them to its owner and back.

Everything here is NumPy over the :class:`~vescale_jax.plan.Plan`, built once per plan (the tables are baked
into the compiled update as constants). :func:`route_newton_schulz` is the device side: one ``shard_map``
with at most two padded all-to-alls (there and back) around batched Newton–Schulz on the owners.

Terms: a *matrix* is one ``(p, q)`` slice of a Muon leaf after the leaf's dimension numbers are applied
(a stacked ``(L, p, q)`` leaf is ``L`` matrices). Matrices are stored on their owner with ``p <= q`` (the
transpose is folded into the index tables, as Newton–Schulz transposes tall matrices anyway), grouped by
``(p, q)`` *class* into ``(K_c, p, q)`` work arrays, ``K_c`` the most matrices of that class on any device
(zero matrices pad the rest; Newton–Schulz maps zero to zero).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.plan import Plan

__all__ = ["MatrixRoute", "Routing", "build_routing", "matrix_indices", "route_newton_schulz"]


def _normalize(ndim: int, axes: Any) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(int(a) % ndim for a in axes)


def matrix_indices(shape: Sequence[int], reduction_axis: Any, output_axis: Any) -> np.ndarray:
    """Flat logical indices of a leaf arranged ``(batch, p, q)`` as ``optax.contrib.muon`` reshapes it."""
    shape = tuple(shape)
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"Muon needs rank >= 2, got shape {shape}")
    red, out = _normalize(ndim, reduction_axis), _normalize(ndim, output_axis)
    if set(red) & set(out):
        raise ValueError(f"reduction axes {red} and output axes {out} overlap for shape {shape}")
    batch = tuple(sorted(set(range(ndim)) - set(red) - set(out)))
    idx = np.arange(math.prod(shape), dtype=np.int64).reshape(shape).transpose(batch + red + out)
    dims = lambda axes: math.prod(shape[a] for a in axes)
    return idx.reshape(dims(batch), dims(red), dims(out))


@dataclasses.dataclass(frozen=True)
class MatrixRoute:
    """One matrix: its leaf, batch index, stored shape ``(p, q)`` (``p <= q``), owner and slot."""

    leaf: int
    batch: int
    shape: tuple[int, int]
    transposed: bool
    devices: tuple[int, ...]
    owner: int
    slot: int

    @property
    def cost(self) -> int:
        p, q = self.shape
        return p * q * min(p, q)


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
    """Static tables for one plan (see the module docstring). Index tables are ``(m, ...)``, row ``k`` for
    device ``k``; the last index of each source is a zero sentinel.

    Attributes:
      buckets: buckets whose local shards are concatenated (in this order) into the local vector ``X``.
      local_size: ``T``, the length of ``X``.
      classes: ``((p, q, K), ...)`` work classes.
      work_size: elements of all work arrays of one device.
      width: ``W``, elements per message of the padded all-to-all (0: no communication needed).
      send: ``(m, m, W)`` indices into ``X + [0]``: what device ``k`` sends to each owner.
      gather: ``(m, work_size)`` indices into ``X + received + [0]``: how the owner fills its work arrays.
      back_send: ``(m, m, W)`` indices into ``work + [0]``: what an owner returns to each device.
      back_gather: ``(m, T)`` indices into ``work + received + [0]``: how a device refills ``X``.
      matrix_leaf: ``(m, sum K)`` leaf index of each work matrix (``num_leaves`` for padding).
      matrices: every :class:`MatrixRoute`.
      loads: Newton–Schulz cost (``sum p*q*min(p, q)``) per device.
    """

    buckets: tuple[int, ...]
    local_size: int
    classes: tuple[tuple[int, int, int], ...]
    work_size: int
    width: int
    send: np.ndarray
    gather: np.ndarray
    back_send: np.ndarray
    back_gather: np.ndarray
    matrix_leaf: np.ndarray
    matrices: tuple[MatrixRoute, ...]
    loads: tuple[int, ...]
    num_leaves: int

    def summary(self) -> str:
        m = len(self.loads)
        total = sum(self.loads)
        moved = sum(1 for r in self.matrices if r.devices != (r.owner,))
        lines = [
            f"{len(self.matrices)} matrices in {len(self.classes)} shape classes over {m} devices; "
            f"{moved} gathered to an owner; all-to-all width {self.width}",
            "NS cost per device / (total / m): "
            + " ".join(f"{x / (total / m):.2f}" if total else "0" for x in self.loads),
        ]
        return "\n".join(lines)


def _element_positions(plan: Plan, leaf: int, bases: dict[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """For every logical flat element of a leaf: (device, index in that device's local vector X)."""
    spec = plan.leaves[leaf]
    bucket = plan.buckets[spec.bucket]
    layout = bucket.layout
    s, offset = layout.shard_size, layout.offsets[spec.slot]
    i = np.arange(spec.size, dtype=np.int64)
    if bucket.layers is None:
        g, layer = offset + i, 0
    else:
        per = layout.sizes[spec.slot]
        layer, g = i // per, offset + i % per
    dev = g // s
    local = layer * s + g % s + bases[spec.bucket]
    return dev, local


def build_routing(plan: Plan, dims: Sequence[tuple[Any, Any] | None], *, fixed_whole: bool = True) -> Routing:
    """Chooses owners and builds the tables.

    Args:
      plan: the plan.
      dims: per leaf (flattening order) ``(reduction_axis, output_axis)`` or ``None`` for a non-Muon leaf.
      fixed_whole: a matrix that lies whole on one device is orthogonalised there (no communication); the
        others go to the least-loaded device, largest cost first (ties: the device holding most of it).

    Returns:
      A :class:`Routing`.
    """
    m = plan.num_devices
    buckets = tuple(sorted({plan.leaves[i].bucket for i, d in enumerate(dims) if d is not None}))
    bases, cursor = {}, 0
    for b in buckets:
        bases[b] = cursor
        cursor += math.prod(plan.buckets[b].local_shape)
    local_size = cursor

    # 1. Matrices and the (device, local index) of each element, arranged (p, q) with p <= q.
    mats, elems = [], []
    for leaf, d in enumerate(dims):
        if d is None:
            continue
        idx = matrix_indices(plan.leaves[leaf].shape, *d)
        transposed = idx.shape[1] > idx.shape[2]
        if transposed:
            idx = idx.transpose(0, 2, 1)
        dev, local = _element_positions(plan, leaf, bases)
        for b in range(idx.shape[0]):
            md, ml = dev[idx[b]], local[idx[b]]
            devices, counts = np.unique(md, return_counts=True)
            mats.append((leaf, b, idx.shape[1:], transposed, tuple(int(x) for x in devices), counts))
            elems.append((md.reshape(-1), ml.reshape(-1)))

    # 2. Owners: whole-on-one-device matrices stay; the rest LPT to the least-loaded device.
    loads = [0] * m
    owners = [-1] * len(mats)
    cost = [p * q * min(p, q) for _, _, (p, q), _, _, _ in mats]
    for j, (_, _, _, _, devices, _) in enumerate(mats):
        if fixed_whole and len(devices) == 1:
            owners[j] = devices[0]
            loads[devices[0]] += cost[j]
    # Zero matrices pad each class to its busiest owner's count (K_c), and they cost real FLOPs: cap each
    # device at ceil(n_c / m) matrices of class c (or what whole matrices already put there).
    shape_of = [tuple(int(x) for x in mt[2]) for mt in mats]
    per_class: dict[tuple[int, int], int] = {}
    held_c: dict[tuple[int, tuple[int, int]], int] = {}
    for j, c in enumerate(shape_of):
        per_class[c] = per_class.get(c, 0) + 1
        if owners[j] >= 0:
            held_c[(owners[j], c)] = held_c.get((owners[j], c), 0) + 1
    cap = {c: max([-(-n // m)] + [v for (k, cc), v in held_c.items() if cc == c]) for c, n in per_class.items()}
    for j in sorted((j for j in range(len(mats)) if owners[j] < 0), key=lambda j: (-cost[j], j)):
        held = dict(zip(mats[j][4], mats[j][5].tolist(), strict=True))
        c = shape_of[j]
        room = [k for k in range(m) if held_c.get((k, c), 0) < cap[c]] or list(range(m))
        owners[j] = min(room, key=lambda k: (loads[k], -held.get(k, 0), k))
        loads[owners[j]] += cost[j]
        held_c[(owners[j], c)] = held_c.get((owners[j], c), 0) + 1

    # 3. Classes and slots.
    class_keys = sorted({tuple(int(x) for x in mt[2]) for mt in mats})
    counts = {(k, c): 0 for k in range(m) for c in class_keys}
    slots = []
    for j, mt in enumerate(mats):
        key = (owners[j], tuple(int(x) for x in mt[2]))
        slots.append(counts[key])
        counts[key] += 1
    classes, class_base, mat_base, work_size, n_mats = [], {}, {}, 0, 0
    for c in class_keys:
        k_c = max(counts[(k, c)] for k in range(m))
        classes.append((c[0], c[1], k_c))
        class_base[c], mat_base[c] = work_size, n_mats
        work_size += k_c * c[0] * c[1]
        n_mats += k_c

    num_leaves = len(plan.leaves)
    matrix_leaf = np.full((m, n_mats), num_leaves, np.int32)
    routes = []
    src_dev, src_pos, dst_dev, dst_pos = [], [], [], []
    for j, (leaf, b, shape, transposed, devices, _) in enumerate(mats):
        c = tuple(int(x) for x in shape)
        routes.append(MatrixRoute(leaf, b, c, transposed, devices, owners[j], slots[j]))
        matrix_leaf[owners[j], mat_base[c] + slots[j]] = leaf
        n = c[0] * c[1]
        md, ml = elems[j]
        src_dev.append(md)
        src_pos.append(ml)
        dst_dev.append(np.full(n, owners[j], np.int64))
        dst_pos.append(class_base[c] + slots[j] * n + np.arange(n, dtype=np.int64))
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.int64)
    src_dev, src_pos, dst_dev, dst_pos = cat(src_dev), cat(src_pos), cat(dst_dev), cat(dst_pos)

    # 4. Tables. Elements that stay on their device skip the all-to-all.
    home = src_dev == dst_dev
    away = ~home
    pair = src_dev[away] * m + dst_dev[away]
    order = np.argsort(pair, kind="stable")
    pair_sorted = pair[order]
    starts = np.searchsorted(pair_sorted, pair_sorted, side="left")
    w_sorted = np.arange(len(pair_sorted)) - starts
    w = np.empty_like(w_sorted)
    w[order] = w_sorted
    width = int(w.max()) + 1 if len(w) else 0

    send = np.full((m, m, width), local_size, np.int32)
    back_send = np.full((m, m, width), work_size, np.int32)
    gather = np.full((m, work_size), local_size + m * width, np.int32)
    back_gather = np.full((m, local_size), work_size + m * width, np.int32)

    sd, sp, dd, dp = src_dev[home], src_pos[home], dst_dev[home], dst_pos[home]
    gather[dd, dp] = sp
    back_gather[sd, sp] = dp
    sd, sp, dd, dp = src_dev[away], src_pos[away], dst_dev[away], dst_pos[away]
    send[sd, dd, w] = sp
    gather[dd, dp] = local_size + sd * width + w
    back_send[dd, sd, w] = dp
    back_gather[sd, sp] = work_size + dd * width + w

    return Routing(
        buckets, local_size, tuple(classes), work_size, width, send, gather, back_send, back_gather,
        matrix_leaf, tuple(routes), tuple(loads), num_leaves,
    )


def _const(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x)


def route_newton_schulz(
    buffers: Sequence[jax.Array],
    plan: Plan,
    routing: Routing,
    orthogonalize: Callable[[jax.Array], jax.Array],
    *,
    leaf_scale: np.ndarray | None = None,
    adaptive: bool = False,
    dtype: Any = None,
) -> list[jax.Array]:
    """Orthogonalises every Muon matrix of ``buffers`` (global bucket buffers) on its owner.

    Args:
      buffers: one global buffer per bucket of ``plan`` (e.g. the momentum).
      plan: the plan.
      routing: from :func:`build_routing`.
      orthogonalize: ``(K, p, q) -> (K, p, q)`` batched Newton–Schulz, ``p <= q``.
      leaf_scale: optional ``(num_leaves,)`` factor per leaf applied on the owner.
      adaptive: multiply each leaf's result by ``sum(input * result)`` over the leaf (``optax``'s adaptive).
      dtype: working dtype (default: the promoted dtype of the routed buckets).

    Returns:
      One global buffer per bucket: the orthogonalised matrices in place, zero elsewhere (buckets without
      Muon leaves are all zero).
    """
    axis = plan.axis
    rt = routing
    if dtype is None:
        dtypes = [jnp.dtype(plan.buckets[b].dtype) for b in rt.buckets] or [jnp.dtype(jnp.float32)]
        dtype = functools.reduce(jnp.promote_types, dtypes)
    scale = np.ones(rt.num_leaves + 1, np.float32) if leaf_scale is None else np.append(leaf_scale, 0.0)
    scale[-1] = 0.0

    def local(*shards):
        k = jax.lax.axis_index(axis)
        zero = jnp.zeros((1,), dtype)
        x = jnp.concatenate([jnp.reshape(shards[b], (-1,)).astype(dtype) for b in rt.buckets] + [zero])
        parts = [x[:-1]]
        if rt.width:
            rows = jnp.take(x, _const(rt.send)[k], axis=0)  # (m, W)
            parts.append(jnp.reshape(jax.lax.all_to_all(rows, axis, 0, 0, tiled=False), (-1,)))
        src = jnp.concatenate([*parts, zero])
        work = jnp.take(src, _const(rt.gather)[k], axis=0)
        outs, base = [], 0
        for p, q, kc in rt.classes:
            w_in = jnp.reshape(work[base : base + kc * p * q], (kc, p, q))
            w_out = orthogonalize(w_in)
            outs.append((w_in, w_out))
            base += kc * p * q
        leaf_of = _const(rt.matrix_leaf)[k]
        factor = jnp.take(_const(scale).astype(dtype), leaf_of)
        if adaptive:
            dots = jnp.concatenate([jnp.sum(a * b, axis=(1, 2)) for a, b in outs]) if outs else jnp.zeros((0,), dtype)
            per_leaf = jax.ops.segment_sum(dots, leaf_of, num_segments=rt.num_leaves + 1)
            per_leaf = jax.lax.psum(per_leaf, axis)
            factor = factor * jnp.take(per_leaf, leaf_of)
        scaled, n0 = [], 0
        for (_, _, kc), (_, b) in zip(rt.classes, outs, strict=True):
            scaled.append(jnp.reshape(b * factor[n0 : n0 + kc, None, None], (-1,)))
            n0 += kc
        result = jnp.concatenate([*scaled, zero])
        parts = [result[:-1]]
        if rt.width:
            rows = jnp.take(result, _const(rt.back_send)[k], axis=0)
            parts.append(jnp.reshape(jax.lax.all_to_all(rows, axis, 0, 0, tiled=False), (-1,)))
        back = jnp.take(jnp.concatenate([*parts, zero]), _const(rt.back_gather)[k], axis=0)
        out, base = [], 0
        for i, s in enumerate(shards):
            if i in rt.buckets:
                n = math.prod(s.shape)
                out.append(jnp.reshape(back[base : base + n], s.shape).astype(s.dtype))
                base += n
            else:
                out.append(jnp.zeros_like(s))
        return tuple(out)

    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=specs, out_specs=specs, check_vma=False)
    return list(mapped(*buffers))
