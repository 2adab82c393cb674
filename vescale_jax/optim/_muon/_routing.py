"""Owner routing for distributed Muon: which device orthogonalises which matrix, and the static run tables
that move each matrix's elements from the devices that hold them to its owner and back.

Everything here is NumPy over the :class:`~vescale_jax.layout._plan.Plan`, built once per plan. Matrices
(:mod:`._matrices`) are grouped by ``(p, q)`` *class* into ``(K_c, p, q)`` work arrays, ``K_c`` the
most matrices of that class on any device (zero matrices pad the rest; Newton–Schulz maps zero to zero). Each of the
four index tables (``send``, ``gather``, ``back_send``, ``back_gather``; :class:`Routing`) is a strided run table
of the relayout engine (:mod:`vescale_jax.relayout._run_lookup`), built from per-element entries rather than from
two ``Placement`` objects and ``plan_moves``: a matrix whose axes are permuted (transposed, or reduction / output axes
reordered) is strided on one side, so a placement would hold one piece per element, and elements that stay on
their device skip the all-to-all (its width counts moving elements only).

With buckets split over tensor / expert axes the devices are those of the buckets' group axes and the plan's axis
together (:func:`routing_axes`): a matrix is the whole logical matrix, gathered from every TP/EP group holding a
piece of it, and a matrix replicated over some of those axes is one copy per replica (see :func:`build_routing`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout import _tp as _tp
from vescale_jax.layout._plan import Plan
from vescale_jax.optim._muon._matrices import MatrixRoute, matrix_indices, ns_macs, split_macs
from vescale_jax.relayout._run_lookup import RunLookup, expand_strided, strided_runs

__all__ = ["Routing", "build_routing", "routing_axes"]


@dataclasses.dataclass(frozen=True, eq=False)
class Routing:
    """Static tables for one plan (see the module docstring). Run tables are ``(m, 4, R)`` int32, row ``k``
    for device ``k``: run ``r`` maps the positions ``start[r] + i``, ``0 <= i < length[r]``, to the indices
    ``value[r] + i * stride[r]``; positions outside every run map to the sentinel, the last index of what
    they index (a zero appended there).

    ``m`` here is the number of devices the routing runs over, ``D``: the plan's axis, times the routed buckets'
    TP/EP groups when some are split over tensor / expert axes (see :attr:`axes`).

    Attributes:
      axes: the mesh axes of the routing's all-to-alls and sums (device ``k`` is ``jax.lax.axis_index(axes)``):
        the plan's axis, or the routed buckets' group axes then the plan's axis (:func:`routing_axes`).
      buckets: buckets whose local shards are concatenated (in this order) into the local vector ``X``.
      local_size: ``T``, the length of ``X``.
      classes: ``((p, q, K), ...)`` owner work classes: ``K`` matrices of ``(p, q)`` on every device.
      splits: ``((p, q, r), ...)`` split classes: ``r`` matrices of ``(p, q)`` whose columns are cut into
        ``ceil(q / m)``-wide pieces, one per device (zero columns pad).
      work_size: elements of all work arrays of one device.
      width: ``W``, elements per message of the padded all-to-all (0: no communication needed).
      send: runs over the ``m * W`` positions ``(owner, w)`` of the outgoing messages: indices into
        ``X + [0]`` (what device ``k`` sends to each owner).
      gather: runs over the ``work_size`` positions of the work arrays: indices into ``X + received + [0]``
        (``received``: the ``m * W`` incoming elements, ``(source, w)``): how the owner fills its work arrays.
      back_send: runs over the ``m * W`` positions ``(device, w)``: indices into ``work + [0]``: what an
        owner returns to each device.
      back_gather: runs over the ``T`` positions of ``X``: indices into ``work + received + [0]``: how a
        device refills ``X`` (runs follow the original rows, stride the stored row length when transposed).
      matrix_leaf: ``(m, sum K)`` leaf index of each work matrix (``num_leaves`` for padding).
      matrix_copy: ``(m, sum K)`` bool: the work matrix is a second or later copy of a matrix replicated over
        TP/EP axes (sums over a leaf's matrices, e.g. ``adaptive``'s, count each matrix once).
      matrices: every :class:`MatrixRoute`.
      loads: real Newton–Schulz multiply-adds per iteration per device (:func:`ns_macs`; split matrices
        count :func:`split_macs` on every device).
      slot_cost: what every device computes, zero padding slots included (SPMD runs the same shapes on
        every device): ``sum K * ns_macs(p, q) + sum r * split_macs(p, q, m)``.
      total_cost: ``sum ns_macs`` over all matrices (one device doing everything).
    """

    axes: Any
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
    matrix_copy: np.ndarray
    matrices: tuple[MatrixRoute, ...]
    loads: tuple[int, ...]
    slot_cost: int
    total_cost: int
    num_leaves: int

    def _extents(self) -> dict[str, tuple[int, int]]:
        """Per table: (positions, sentinel)."""
        m, w, t, n = len(self.loads), self.width, self.local_size, self.work_size
        return {"send": (m * w, t), "gather": (n, t + m * w), "back_send": (m * w, n), "back_gather": (t, n + m * w)}

    @functools.cached_property
    def lookups(self) -> dict[str, RunLookup]:
        """What is baked into the update: each run table as a :class:`RunLookup`."""
        return {name: RunLookup.build(getattr(self, name), *ext) for name, ext in self._extents().items()}

    @property
    def index_bytes(self) -> int:
        """Bytes of the index constants baked into the update (:attr:`lookups` and ``matrix_leaf``)."""
        return sum(x.nbytes for x in self.lookups.values()) + self.matrix_leaf.nbytes + self.matrix_copy.nbytes

    def dense(self) -> dict[str, np.ndarray]:
        """The run tables expanded in NumPy: ``send`` and ``back_send`` ``(m, m, W)``, ``gather``
        ``(m, work_size)``, ``back_gather`` ``(m, T)`` (for tests and inspection: ``O(m * elements)``)."""
        m, w = len(self.loads), self.width
        out = {name: expand_strided(getattr(self, name), *ext) for name, ext in self._extents().items()}
        out["send"], out["back_send"] = out["send"].reshape(m, m, w), out["back_send"].reshape(m, m, w)
        return out

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


def routing_axes(plan: Plan, buckets: Sequence[int]) -> tuple[Any, tuple[str, ...]]:
    """The mesh axes Muon's owner routing runs over for the routed ``buckets``, and their tensor / expert part.

    Without grouped buckets it is the plan's axis (as given); otherwise the group axes of the routed buckets
    (in mesh order), then the plan's axis (or axes): device ``d = t * m + k`` is TP/EP group ``t`` (row-major
    over those axes) at position ``k`` on the plan's axis, as ``jax.lax.axis_index`` numbers the tuple.
    """
    used = {a for b in buckets for a in plan.buckets[b].groups}
    tp_axes = tuple(a for a in plan.mesh.axis_names if a in used)
    if not tp_axes:
        return plan.axis, ()
    fsdp = (plan.axis,) if isinstance(plan.axis, str) else tuple(plan.axis)
    return (*tp_axes, *fsdp), tp_axes


def _group_index(coords: dict[str, Any], axes: Sequence[str], sizes: dict[str, int]) -> Any:
    g = 0
    for a in axes:
        g = g * sizes[a] + coords[a]
    return g


def _replica_groups(plan: Plan, bucket: int, tp_axes: Sequence[str]) -> np.ndarray:
    """``(G_b, R_b)``: the routing's TP group ``t`` holding bucket group ``g`` as replica ``r`` (the bucket is
    replicated over the routing's TP axes it is not split over)."""
    sizes = dict(plan.mesh.shape)
    groups = plan.buckets[bucket].groups
    others = [a for a in tp_axes if a not in groups]
    n_g, n_r = math.prod(sizes[a] for a in groups), math.prod(sizes[a] for a in others)
    out = np.zeros((n_g, n_r), np.int64)
    for t in range(n_g * n_r):
        coords = _tp.group_coords(t, tp_axes, sizes)
        out[_group_index(coords, groups, sizes), _group_index(coords, others, sizes)] = t
    return out


def _local_elements(plan: Plan, leaf: int) -> tuple[np.ndarray, np.ndarray]:
    """For every logical flat element of a leaf: (its bucket group, its flat index in that group's TP shard)."""
    spec = plan.leaves[leaf]
    i = np.arange(spec.size, dtype=np.int64)
    if not spec.tp:
        return np.zeros(spec.size, np.int64), i
    sizes = dict(plan.mesh.shape)
    index = np.unravel_index(i, spec.shape)
    coords: dict[str, Any] = {}
    within = []
    for d, axes in enumerate(spec.tp):
        block, rest = np.divmod(index[d], spec.local_shape[d])
        within.append(rest)
        for a in reversed(axes):
            block, coords[a] = np.divmod(block, sizes[a])
    group = _group_index(coords, plan.buckets[spec.bucket].groups, sizes)
    return np.asarray(group, np.int64), np.ravel_multi_index(within, spec.local_shape).astype(np.int64)


def _element_positions(plan: Plan, leaf: int, bases: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every logical flat element of a leaf: (bucket group, device on the plan's axis, index in that
    device's local vector X)."""
    spec = plan.leaves[leaf]
    bucket = plan.buckets[spec.bucket]
    layout = bucket.layout
    s, offset = layout.shard_size, layout.offsets[spec.slot]
    group, i = _local_elements(plan, leaf)
    per = layout.sizes[spec.slot]
    layer, within = (0, i) if bucket.layers is None else (i // per, i % per)
    gran = bucket.storage[spec.slot] if bucket.storage else None
    if gran is not None:  # stored tile-major: local element e of a layer sits at storage position where[e]
        where = np.empty(per, np.int64)
        where[tiles.storage_index(plan.layer_shape(spec), gran)] = np.arange(per, dtype=np.int64)
        within = where[within]
    g = offset + within
    dev = g // s
    local = layer * s + g % s + bases[spec.bucket]
    return group, dev, local


def build_routing(
    plan: Plan, dims: Sequence[tuple[Any, Any] | None], *, fixed_whole: bool = True, split: bool = True
) -> Routing:
    """Chooses owners and builds the tables.

    Every device runs ``K_c`` Newton–Schulz slots of each shape class ``c`` (SPMD shapes are uniform), so a
    class of ``n_c`` matrices costs ``ceil(n_c / D)`` slots everywhere (``D`` devices, see below). When the
    ``r = n_c mod D`` leftover matrices are cheaper to share than a whole extra slot
    (``r * split_macs < ns_macs``), they are *split*: each device takes a ``ceil(q / D)``-column piece and the
    devices run their Newton–Schulz together.

    Tensor / expert parallelism: a matrix of a leaf split over TP/EP axes is the whole *logical* matrix, its
    pieces gathered from every group's devices. The routing then runs over the routed buckets' group axes and
    the plan's axis together (:func:`routing_axes`, ``D = G * m`` devices), and a matrix of a bucket replicated
    over some of those axes (e.g. an ungrouped one, over ``tensor``) is orthogonalised once per replica (group
    of those axes), each copy gathered from and returned to its own replica's devices, with the same owner
    position and slot in every replica (so the copies stay bit-identical). Replicated matrices are never
    split.

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
    axes, tp_axes = routing_axes(plan, buckets)
    n_groups = math.prod(plan.mesh.shape[a] for a in tp_axes)
    n_dev = n_groups * m
    bases, cursor = {}, 0
    for b in buckets:
        bases[b] = cursor
        cursor += math.prod(plan.buckets[b].local_shape)
    local_size = cursor
    replicas = {b: _replica_groups(plan, b, tp_axes) for b in buckets}

    # 1. Matrices (one per replica: ``units[u]`` lists a matrix's copies) and the (device, local index) of each
    #    element, arranged (p, q) with p <= q. A unit's owner is a position (bucket group g, device k on the plan's
    #    axis), the same in every replica: ``where[u][g * m + k]`` are that position's devices, one per replica.
    mats, elems, units, where = [], [], [], []
    for leaf, d in enumerate(dims):
        if d is None:
            continue
        idx = matrix_indices(plan.leaves[leaf].shape, *d)
        transposed = idx.shape[1] > idx.shape[2]
        if transposed:
            idx = idx.transpose(0, 2, 1)
        rep = replicas[plan.leaves[leaf].bucket]
        group, dev, local = _element_positions(plan, leaf, bases)
        spots = (rep[:, None, :] * m + np.arange(m)[None, :, None]).reshape(-1, rep.shape[1])
        for b in range(idx.shape[0]):
            units.append([])
            where.append([tuple(int(x) for x in row) for row in spots])
            gb, kb, ml = group[idx[b]], dev[idx[b]], local[idx[b]]
            for r in range(rep.shape[1]):
                md = rep[gb, r] * m + kb
                devices, counts = np.unique(md, return_counts=True)
                units[-1].append(len(mats))
                mats.append((leaf, b, idx.shape[1:], transposed, tuple(int(x) for x in devices), counts))
                elems.append((md, ml))
    shape_of = [tuple(int(x) for x in mt[2]) for mt in mats]
    cost = [ns_macs(*c) for c in shape_of]
    unit_of = [u for u, js in enumerate(units) for _ in js]

    # 2. Slots per class. A matrix of a vj.whole() leaf stays where the plan put it. K_c = max(those on one
    #    device, floor(n_c / D)); the r leftovers either take one more slot everywhere or are split.
    owners = [-1] * len(mats)
    held_c: dict[tuple[int, tuple[int, int]], int] = {}

    def take(u: int, spot: int) -> None:
        for j, k in zip(units[u], where[u][spot], strict=True):
            owners[j] = k
            held_c[(k, shape_of[j])] = held_c.get((k, shape_of[j]), 0) + 1

    def home(u: int) -> int | None:
        """The owner position holding all of unit u's elements, if one does."""
        devices = mats[units[u][0]][4]
        return next(s for s, row in enumerate(where[u]) if row[0] == devices[0]) if len(devices) == 1 else None

    for u, js in enumerate(units):
        leaf = mats[js[0]][0]
        if fixed_whole and home(u) is not None and plan.leaves[leaf].granularity.kind == "whole":
            take(u, home(u))
    class_keys = sorted(set(shape_of))
    cap, to_split = {}, set()
    for c in class_keys:
        members = [j for j in range(len(mats)) if shape_of[j] == c]
        movable = [j for j in members if owners[j] < 0]
        k0 = max([len(members) // n_dev] + [held_c.get((k, c), 0) for k in range(n_dev)])
        room = sum(k0 - held_c.get((k, c), 0) for k in range(n_dev))
        r = len(movable) - room
        single = [j for j in movable if len(units[unit_of[j]]) == 1]  # only a matrix held once can be split
        if r <= 0:
            cap[c] = k0
        elif split and n_dev > 1 and r <= len(single) and r * split_macs(*c, n_dev) < ns_macs(*c):
            cap[c] = k0
            # Split the most scattered ones: they have to move anyway.
            to_split |= set(sorted(single, key=lambda j: (-len(mats[j][4]), j))[:r])
        else:
            cap[c] = k0 + 1
    # Every device runs cap[c] slots whatever the assignment, so the assignment only decides communication:
    # a matrix whole on a device with a free slot stays; the others go to the least-loaded device with a free
    # slot (spreading the messages keeps the padded all-to-all narrow), ties to the one holding most of them.
    free = lambda u, spot, c: all(held_c.get((k, c), 0) < cap[c] for k in where[u][spot])
    rest = [u for u, js in enumerate(units) if owners[js[0]] < 0 and js[0] not in to_split]
    for u in rest:
        spot = home(u)
        if spot is not None and free(u, spot, shape_of[units[u][0]]):
            take(u, spot)
    loads = [0] * n_dev
    for j, k in enumerate(owners):
        if k >= 0:
            loads[k] += cost[j]
    for u in sorted((u for u in rest if owners[units[u][0]] < 0), key=lambda u: (-cost[units[u][0]], u)):
        j = units[u][0]
        held = dict(zip(mats[j][4], mats[j][5].tolist(), strict=True))
        c = shape_of[j]
        room = [s for s in range(len(where[u])) if free(u, s, c)]
        while not room:  # the replicas' free slots do not line up: one more slot of this class everywhere
            cap[c] += 1
            room = [s for s in range(len(where[u])) if free(u, s, c)]
        spot = min(room, key=lambda s: (sum(loads[k] for k in where[u][s]), -held.get(where[u][s][0], 0), s))
        take(u, spot)
        for i in units[u]:
            loads[owners[i]] += cost[i]
    for j in to_split:
        for k in range(n_dev):
            loads[k] += split_macs(*shape_of[j], n_dev)

    # 3. Work layout: owner classes (K_c, p, q), then split classes (r_c, p, ceil(q / D)).
    counts = {(k, c): 0 for k in range(n_dev) for c in class_keys}
    split_counts = dict.fromkeys(class_keys, 0)
    slots = [0] * len(mats)
    # Replicated matrices first (most replicas first), so that a matrix's copies take the same slot everywhere.
    order = lambda j: (-len(units[unit_of[j]]), plan.buckets[plan.leaves[mats[j][0]].bucket].groups, j)
    for j in sorted(range(len(mats)), key=order):
        c = shape_of[j]
        if j in to_split:
            slots[j] = split_counts[c]
            split_counts[c] += 1
        else:
            slots[j] = counts[(owners[j], c)]
            counts[(owners[j], c)] += 1
    classes, splits, class_base, split_base, mat_base, split_mat_base = [], [], {}, {}, {}, {}
    work_size = n_mats = 0
    for c in class_keys:
        k_c = max(counts[(k, c)] for k in range(n_dev))
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
            work_size += r * c[0] * -(-c[1] // n_dev)
            n_mats += r
    slot_cost = sum(k * ns_macs(p, q) for p, q, k in classes) + sum(r * split_macs(p, q, n_dev) for p, q, r in splits)

    num_leaves = len(plan.leaves)
    matrix_leaf = np.full((n_dev, n_mats), num_leaves, np.int32)
    matrix_copy = np.zeros((n_dev, n_mats), bool)
    copy_of = [r > 0 for js in units for r in range(len(js))]
    routes = []
    src_dev, src_pos, dst_dev, dst_pos = [], [], [], []
    for j, (leaf, b, _, transposed, devices, _) in enumerate(mats):
        c = shape_of[j]
        p, q = c
        md, ml = elems[j]
        if j in to_split:
            qs = -(-q // n_dev)
            routes.append(MatrixRoute(leaf, b, c, transposed, devices, -1, slots[j]))
            matrix_leaf[:, split_mat_base[c] + slots[j]] = leaf
            cols = np.arange(q, dtype=np.int64)[None, :]
            rows = np.arange(p, dtype=np.int64)[:, None]
            dd = np.broadcast_to(cols // qs, (p, q))
            dp = split_base[c] + slots[j] * p * qs + rows * qs + cols % qs
        else:
            routes.append(MatrixRoute(leaf, b, c, transposed, devices, owners[j], slots[j]))
            matrix_leaf[owners[j], mat_base[c] + slots[j]] = leaf
            matrix_copy[owners[j], mat_base[c] + slots[j]] = copy_of[j]
            dd = np.full((p, q), owners[j], np.int64)
            dp = class_base[c] + slots[j] * p * q + np.arange(p * q, dtype=np.int64).reshape(p, q)
        src_dev.append(md.reshape(-1))
        src_pos.append(ml.reshape(-1))
        dst_dev.append(dd.reshape(-1))
        dst_pos.append(dp.reshape(-1))
    if max(local_size, work_size) >= 2**31:
        raise ValueError("Muon routing: indices exceed int32")
    cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32)
    src_dev, src_pos, dst_dev, dst_pos = cat(src_dev), cat(src_pos), cat(dst_dev), cat(dst_pos)

    # 4. Tables. Elements that stay on their device skip the all-to-all; a message (source, owner) carries its
    #    elements in the order of their positions in the source's X (a transposed matrix then moves by
    #    original rows: long runs on the source, at most two per stored row and source on the owner).
    n_el = len(src_dev)
    ids = np.int32 if n_el < 2**31 else np.int64
    at = np.full(n_dev * local_size, -1, ids)
    at[src_dev.astype(np.int64) * local_size + src_pos] = np.arange(n_el, dtype=ids)
    by_pos = at[at >= 0]  # elements in (device, position in X) order
    away = src_dev != dst_dev
    moving = by_pos[away[by_pos]]
    pair = src_dev[moving] * n_dev + dst_dev[moving]
    order = np.argsort(pair.astype(np.int16) if n_dev * n_dev < 2**15 else pair, kind="stable")  # radix for int16
    msg, pair = moving[order], pair[order]  # elements in message order
    first = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]])
    w_msg = np.arange(len(msg), dtype=np.int32) - np.repeat(first, np.diff(np.append(first, len(msg))))
    width = int(w_msg.max()) + 1 if len(msg) else 0
    if max(local_size, work_size) + n_dev * width >= 2**31:
        raise ValueError("Muon routing: indices exceed int32")
    w = np.zeros(n_el, np.int32)
    w[msg] = w_msg

    # Runs of (device, position) -> index, from the entries listed in an order in which each table's positions
    # run consecutively: message order for the all-to-all tables, element order (stored rows) for the work
    # arrays, position order for X.
    send = strided_runs(src_dev[msg], dst_dev[msg] * width + w_msg, src_pos[msg], n_dev)
    back_send = strided_runs(dst_dev[msg], src_dev[msg] * width + w_msg, dst_pos[msg], n_dev)
    gather = strided_runs(dst_dev, dst_pos, np.where(away, local_size + src_dev * width + w, src_pos), n_dev)
    index = np.where(away, work_size + dst_dev * width + w, dst_pos)
    back_gather = strided_runs(src_dev[by_pos], src_pos[by_pos], index[by_pos], n_dev)

    return Routing(
        axes,
        buckets,
        local_size,
        tuple(classes),
        tuple(splits),
        work_size,
        width,
        send,
        gather,
        back_send,
        back_gather,
        matrix_leaf,
        matrix_copy,
        tuple(routes),
        tuple(loads),
        slot_cost,
        sum(cost),
        num_leaves,
    )
