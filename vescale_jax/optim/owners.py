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


def ns_macs(p: int, q: int) -> int:
    """Multiply-adds of one Newton–Schulz iteration on a ``(p, q)`` matrix, ``p <= q``: ``X X^T``, ``A A``
    and ``B X``."""
    return 2 * p * p * q + p**3


def split_macs(p: int, q: int, m: int) -> int:
    """Per-device multiply-adds of one iteration on a matrix split by columns over ``m`` devices (the Gram
    products are split, ``A A`` is repeated on every device)."""
    return 2 * p * p * -(-q // m) + p**3


@dataclasses.dataclass(frozen=True)
class MatrixRoute:
    """One matrix: its leaf, batch index, stored shape ``(p, q)`` (``p <= q``), owner and slot.

    ``owner == -1`` marks a *split* matrix: its columns are spread over every device, which run its
    Newton–Schulz together (one ``p x p`` all-reduce per iteration). ``slot`` then indexes the split class.
    """

    leaf: int
    batch: int
    shape: tuple[int, int]
    transposed: bool
    devices: tuple[int, ...]
    owner: int
    slot: int

    @property
    def cost(self) -> int:
        return ns_macs(*self.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
    """Static tables for one plan (see the module docstring). Index tables are ``(m, ...)``, row ``k`` for
    device ``k``; the last index of each source is a zero sentinel.

    Attributes:
      buckets: buckets whose local shards are concatenated (in this order) into the local vector ``X``.
      local_size: ``T``, the length of ``X``.
      classes: ``((p, q, K), ...)`` owner work classes: ``K`` matrices of ``(p, q)`` on every device.
      splits: ``((p, q, r), ...)`` split classes: ``r`` matrices of ``(p, q)`` whose columns are cut into
        ``ceil(q / m)``-wide pieces, one per device (zero columns pad).
      work_size: elements of all work arrays of one device.
      width: ``W``, elements per message of the padded all-to-all (0: no communication needed).
      send: ``(m, m, W)`` indices into ``X + [0]``: what device ``k`` sends to each owner.
      gather: ``(m, work_size)`` indices into ``X + received + [0]``: how the owner fills its work arrays.
      back_send: ``(m, m, W)`` indices into ``work + [0]``: what an owner returns to each device.
      back_gather: ``(m, T)`` indices into ``work + received + [0]``: how a device refills ``X``.
      matrix_leaf: ``(m, sum K)`` leaf index of each work matrix (``num_leaves`` for padding).
      matrices: every :class:`MatrixRoute`.
      loads: real Newton–Schulz multiply-adds per iteration per device (:func:`ns_macs`; split matrices
        count :func:`split_macs` on every device).
      slot_cost: what every device computes, zero padding slots included (SPMD runs the same shapes on
        every device): ``sum K * ns_macs(p, q) + sum r * split_macs(p, q, m)``.
      total_cost: ``sum ns_macs`` over all matrices (one device doing everything).
    """

    buckets: tuple[int, ...]
    local_size: int
    classes: tuple[tuple[int, int, int], ...]
    splits: tuple[tuple[int, int, int], ...]
    work_size: int
    width: int
    send: np.ndarray
    gather: np.ndarray
    back_send: np.ndarray
    back_gather: np.ndarray
    matrix_leaf: np.ndarray
    matrices: tuple[MatrixRoute, ...]
    loads: tuple[int, ...]
    slot_cost: int
    total_cost: int
    num_leaves: int

    @property
    def balance(self) -> float:
        """Per-device Newton–Schulz work (padding slots included) over the total divided by ``m``."""
        m = len(self.loads)
        return self.slot_cost * m / self.total_cost if self.total_cost else 1.0

    def summary(self) -> str:
        m = len(self.loads)
        total = sum(self.loads)
        moved = sum(1 for r in self.matrices if r.devices != (r.owner,) and r.owner >= 0)
        split = sum(r for _, _, r in self.splits)
        lines = [
            f"{len(self.matrices)} matrices over {m} devices: {len(self.classes)} owner classes, "
            f"{len(self.splits)} split classes; {moved} gathered to an owner, {split} split by columns over all "
            f"devices; all-to-all width {self.width}",
            "real NS work per device / (total / m): "
            + " ".join(f"{x / (total / m):.2f}" if total else "0" for x in self.loads),
            f"NS work every device runs (padding slots included) / (total / m): {self.balance:.3f}",
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


def build_routing(
    plan: Plan, dims: Sequence[tuple[Any, Any] | None], *, fixed_whole: bool = True, split: bool = True
) -> Routing:
    """Chooses owners and builds the tables.

    Every device runs ``K_c`` Newton–Schulz slots of each shape class ``c`` (SPMD shapes are uniform), so a
    class of ``n_c`` matrices costs ``ceil(n_c / m)`` slots everywhere. When the ``r = n_c mod m`` leftover
    matrices are cheaper to share than a whole extra slot (``r * split_macs < ns_macs``), they are *split*:
    each device takes a ``ceil(q / m)``-column piece and the devices run their Newton–Schulz together.

    Args:
      plan: the plan.
      dims: per leaf (flattening order) ``(reduction_axis, output_axis)`` or ``None`` for a non-Muon leaf.
      fixed_whole: a matrix of a ``vj.whole()`` leaf is orthogonalised where the plan put it (no
        communication). Other matrices whole on a device stay there while it has a free slot of their class;
        the rest go, largest first, to the least-loaded device with a free slot (ties: the one holding most
        of their elements).
      split: allow splitting leftover matrices (needs Frobenius preconditioning; see above).

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
            elems.append((md, ml))
    shape_of = [tuple(int(x) for x in mt[2]) for mt in mats]
    cost = [ns_macs(*c) for c in shape_of]

    # 2. Slots per class. A matrix of a vj.whole() leaf stays where the plan put it. K_c = max(those on one
    #    device, floor(n_c / m)); the r leftovers either take one more slot everywhere or are split.
    owners = [-1] * len(mats)
    held_c: dict[tuple[int, tuple[int, int]], int] = {}

    def take(j: int, k: int) -> None:
        owners[j] = k
        held_c[(k, shape_of[j])] = held_c.get((k, shape_of[j]), 0) + 1

    for j, (leaf, _, _, _, devices, _) in enumerate(mats):
        if fixed_whole and len(devices) == 1 and plan.leaves[leaf].granularity.kind == "whole":
            take(j, devices[0])
    class_keys = sorted(set(shape_of))
    cap, to_split = {}, set()
    for c in class_keys:
        members = [j for j in range(len(mats)) if shape_of[j] == c]
        movable = [j for j in members if owners[j] < 0]
        k0 = max([len(members) // m] + [held_c.get((k, c), 0) for k in range(m)])
        room = sum(k0 - held_c.get((k, c), 0) for k in range(m))
        r = len(movable) - room
        if r <= 0:
            cap[c] = k0
        elif split and m > 1 and r * split_macs(*c, m) < ns_macs(*c):
            cap[c] = k0
            # Split the most scattered ones: they have to move anyway.
            to_split |= set(sorted(movable, key=lambda j: (-len(mats[j][4]), j))[:r])
        else:
            cap[c] = k0 + 1
    # Every device runs cap[c] slots whatever the assignment, so the assignment only decides communication:
    # a matrix whole on a device with a free slot stays; the others go to the least-loaded device with a free
    # slot (spreading the messages keeps the padded all-to-all narrow), ties to the one holding most of them.
    rest = [j for j in range(len(mats)) if owners[j] < 0 and j not in to_split]
    for j in rest:
        devices = mats[j][4]
        if len(devices) == 1 and held_c.get((devices[0], shape_of[j]), 0) < cap[shape_of[j]]:
            take(j, devices[0])
    loads = [0] * m
    for j, k in enumerate(owners):
        if k >= 0:
            loads[k] += cost[j]
    for j in sorted((j for j in rest if owners[j] < 0), key=lambda j: (-cost[j], j)):
        held = dict(zip(mats[j][4], mats[j][5].tolist(), strict=True))
        c = shape_of[j]
        room = [k for k in range(m) if held_c.get((k, c), 0) < cap[c]]
        take(j, min(room, key=lambda k: (loads[k], -held.get(k, 0), k)))
        loads[owners[j]] += cost[j]
    for j in to_split:
        for k in range(m):
            loads[k] += split_macs(*shape_of[j], m)

    # 3. Work layout: owner classes (K_c, p, q), then split classes (r_c, p, ceil(q / m)).
    counts = {(k, c): 0 for k in range(m) for c in class_keys}
    split_counts = dict.fromkeys(class_keys, 0)
    slots = []
    for j in range(len(mats)):
        c = shape_of[j]
        if j in to_split:
            slots.append(split_counts[c])
            split_counts[c] += 1
        else:
            slots.append(counts[(owners[j], c)])
            counts[(owners[j], c)] += 1
    classes, splits, class_base, split_base, mat_base, split_mat_base = [], [], {}, {}, {}, {}
    work_size = n_mats = 0
    for c in class_keys:
        k_c = max(counts[(k, c)] for k in range(m))
        if k_c:
            classes.append((c[0], c[1], k_c))
            class_base[c], mat_base[c] = work_size, n_mats
            work_size += k_c * c[0] * c[1]
            n_mats += k_c
    for c in class_keys:
        r = split_counts[c]
        if r:
            splits.append((c[0], c[1], r))
            split_base[c], split_mat_base[c] = work_size, n_mats
            work_size += r * c[0] * -(-c[1] // m)
            n_mats += r
    slot_cost = sum(k * ns_macs(p, q) for p, q, k in classes) + sum(r * split_macs(p, q, m) for p, q, r in splits)

    num_leaves = len(plan.leaves)
    matrix_leaf = np.full((m, n_mats), num_leaves, np.int32)
    routes = []
    src_dev, src_pos, dst_dev, dst_pos = [], [], [], []
    for j, (leaf, b, _, transposed, devices, _) in enumerate(mats):
        c = shape_of[j]
        p, q = c
        md, ml = elems[j]
        if j in to_split:
            qs = -(-q // m)
            routes.append(MatrixRoute(leaf, b, c, transposed, devices, -1, slots[j]))
            matrix_leaf[:, split_mat_base[c] + slots[j]] = leaf
            cols = np.arange(q, dtype=np.int64)[None, :]
            rows = np.arange(p, dtype=np.int64)[:, None]
            dd = np.broadcast_to(cols // qs, (p, q))
            dp = split_base[c] + slots[j] * p * qs + rows * qs + cols % qs
        else:
            routes.append(MatrixRoute(leaf, b, c, transposed, devices, owners[j], slots[j]))
            matrix_leaf[owners[j], mat_base[c] + slots[j]] = leaf
            dd = np.full((p, q), owners[j], np.int64)
            dp = class_base[c] + slots[j] * p * q + np.arange(p * q, dtype=np.int64).reshape(p, q)
        src_dev.append(md.reshape(-1))
        src_pos.append(ml.reshape(-1))
        dst_dev.append(dd.reshape(-1))
        dst_pos.append(dp.reshape(-1))
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
        buckets, local_size, tuple(classes), tuple(splits), work_size, width, send, gather, back_send, back_gather,
        matrix_leaf, tuple(routes), tuple(loads), slot_cost, sum(cost), num_leaves,
    )


def _const(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x)


def route_newton_schulz(
    buffers: Sequence[jax.Array],
    plan: Plan,
    routing: Routing,
    orthogonalize: Callable[[jax.Array], jax.Array],
    *,
    orthogonalize_split: Callable[[jax.Array, Any], jax.Array] | None = None,
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
      orthogonalize_split: ``(x, axis) -> x`` for split classes: ``x`` is ``(r, p, q_local)``, this device's
        columns of ``r`` matrices; sums over columns need ``psum`` over ``axis``. Required if the routing
        has split classes.
      leaf_scale: optional ``(num_leaves,)`` factor per leaf applied on the owner.
      adaptive: multiply each leaf's result by ``sum(input * result)`` over the leaf (``optax``'s adaptive).
      dtype: working dtype (default: the promoted dtype of the routed buckets).

    Returns:
      One global buffer per bucket: the orthogonalised matrices in place, zero elsewhere (buckets without
      Muon leaves are all zero).
    """
    axis = plan.axis
    rt = routing
    m = plan.num_devices
    if rt.splits and orthogonalize_split is None:
        raise ValueError("route_newton_schulz: the routing splits matrices; pass orthogonalize_split")
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
        for p, q, r in rt.splits:
            qs = -(-q // m)
            w_in = jnp.reshape(work[base : base + r * p * qs], (r, p, qs))
            outs.append((w_in, orthogonalize_split(w_in, axis)))
            base += r * p * qs
        leaf_of = _const(rt.matrix_leaf)[k]
        factor = jnp.take(_const(scale).astype(dtype), leaf_of)
        if adaptive:
            dots = jnp.concatenate([jnp.sum(a * b, axis=(1, 2)) for a, b in outs]) if outs else jnp.zeros((0,), dtype)
            per_leaf = jax.ops.segment_sum(dots, leaf_of, num_segments=rt.num_leaves + 1)
            per_leaf = jax.lax.psum(per_leaf, axis)
            factor = factor * jnp.take(per_leaf, leaf_of)
        scaled, n0 = [], 0
        for (_, _, kc), (_, b) in zip(rt.classes + rt.splits, outs, strict=True):
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
