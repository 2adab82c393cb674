"""Owner routing for distributed Muon: which device orthogonalises which matrix, and the static run tables
that move each matrix's elements from the devices that hold them to its owner and back.

Everything here is NumPy over the :class:`~vescale_jax._plan.Plan`, built once per plan. :func:`route_newton_schulz`
is the device side: one ``shard_map`` with at most two padded all-to-alls (there and back) around batched
Newton–Schulz on the owners.

Terms: a *matrix* is one ``(p, q)`` slice of a Muon leaf after the leaf's dimension numbers are applied
(a stacked ``(L, p, q)`` leaf is ``L`` matrices). Matrices are stored on their owner with ``p <= q`` (the
transpose is folded into the routing, as Newton–Schulz transposes tall matrices anyway), grouped by
``(p, q)`` *class* into ``(K_c, p, q)`` work arrays, ``K_c`` the most matrices of that class on any device
(zero matrices pad the rest; Newton–Schulz maps zero to zero).

Run tables: the element mapping is piecewise arithmetic (a stored row piece of a matrix on one device is a
*run*: consecutive positions on one side whose indices on the other side form an arithmetic progression,
stride 1 for a matrix stored as it is, the stored row length or the original's for a transposed one). Each
of the four index tables (``send``, ``gather``, ``back_send``, ``back_gather``; :class:`Routing`) is kept as
``(m, 4, R)`` int32 runs ``(start, value, stride, length)`` sorted by ``start`` and padded to the most runs
``R`` of any device: ``O(m * rows)`` instead of the ``O(m * elements)`` of dense index tables. What is
baked into the update is their :class:`RunLookup` form (segments covering every position plus a block
table); each device expands its row into the index array of one gather just before that gather
(:func:`run_indices`: a short loop over chunks, ``probes + 3`` small-table lookups per position).
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

from vescale_jax._plan import Plan
from vescale_jax.optim._leaves import local_vector, split_local

__all__ = [
    "MatrixRoute", "Routing", "RunLookup", "build_routing", "expand_runs", "matrix_indices",
    "route_newton_schulz", "run_indices",
]


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
    """Static tables for one plan (see the module docstring). Run tables are ``(m, 4, R)`` int32, row ``k``
    for device ``k``: run ``r`` maps the positions ``start[r] + i``, ``0 <= i < length[r]``, to the indices
    ``value[r] + i * stride[r]``; positions outside every run map to the sentinel, the last index of what
    they index (a zero appended there).

    Attributes:
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
        return sum(x.nbytes for x in self.lookups.values()) + self.matrix_leaf.nbytes

    def dense(self) -> dict[str, np.ndarray]:
        """The run tables expanded in NumPy: ``send`` and ``back_send`` ``(m, m, W)``, ``gather``
        ``(m, work_size)``, ``back_gather`` ``(m, T)`` (for tests and inspection: ``O(m * elements)``)."""
        m, w = len(self.loads), self.width
        out = {name: _expand_np(getattr(self, name), *ext) for name, ext in self._extents().items()}
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


_NO_RUN = np.iinfo(np.int32).max  # start of the padding runs (after every position)
_PROBES = 4  # most run starts inside one block of a RunLookup (more probes stop XLA fusing the lookups)


def _runs(key: np.ndarray, pos: np.ndarray, val: np.ndarray, m: int) -> np.ndarray:
    """Run table ``(m, 4, R)`` of the entries ``(key, pos) -> val`` (device, position, index), listed in an
    order in which the positions of a run follow each other. Greedy, vectorised: an entry continues the
    previous one's run when it has the same device, the next position and (from a run's third entry on)
    the same step of values; anything else, a non-arithmetic row included, just starts more runs."""
    n = len(pos)
    if n == 0:
        return np.array([[[_NO_RUN], [0], [0], [0]]] * m, np.int32)
    brk = np.empty(n, bool)  # i cannot continue i - 1's run
    brk[0] = True
    np.not_equal(key[1:], key[:-1], out=brk[1:])
    brk[1:] |= pos[1:] - pos[:-1] != 1
    step = val[1:] - val[:-1]
    c = brk.copy()  # ... or its step differs from the one into i - 1
    c[2:] |= step[1:] != step[:-1]
    # start[i] = brk[i] or (c[i] and not start[i-1]) (a one-entry run takes any step): in a stretch of
    # consecutive c entries the starts alternate from the stretch's first entry (or a brk).
    first = c.copy()
    first[1:] &= brk[1:] | ~c[:-1]
    i = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    origin = np.where(first, i, 0)
    np.maximum.accumulate(origin, out=origin)
    s = np.flatnonzero(c & ((i - origin) & 1 == 0))
    length = np.diff(np.append(s, n))
    stride = np.where(length > 1, step[np.minimum(s, n - 2)], 0) if n > 1 else np.zeros(1, val.dtype)
    k, start, value = key[s], pos[s], val[s]
    order = np.lexsort((start, k))
    k, cols = k[order], np.stack([start, value, stride, length])[:, order]
    counts = np.bincount(k, minlength=m)
    r = max(int(counts.max()), 1)
    slot = np.arange(len(k)) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.zeros((m, 4, r), np.int64)
    out[:, 0] = _NO_RUN
    out[k, :, slot] = cols.T
    last = out[:, 1] + out[:, 2] * np.maximum(out[:, 3] - 1, 0)
    if min(out[:, 1].min(), last.min()) < 0 or max(np.abs(out[:, 1:]).max(), last.max()) >= _NO_RUN:
        raise ValueError("Muon routing: indices exceed int32")
    return out.astype(np.int32)


def _expand_np(runs: np.ndarray, n: int, sentinel: int) -> np.ndarray:
    """A run table ``(m, 4, R)`` as the ``(m, n)`` indices of positions ``0 .. n-1`` (NumPy; what the devices
    compute): ``value + (i - start) * stride`` for ``i`` in a run, ``sentinel`` elsewhere."""
    pos = np.arange(n, dtype=np.int64)
    out = np.full((runs.shape[0], n), sentinel, np.int64)
    for k, (start, value, stride, length) in enumerate(runs.astype(np.int64)):
        r = np.maximum(np.searchsorted(start, pos, side="right") - 1, 0)
        off = pos - start[r]
        ok = (off >= 0) & (off < length[r])
        out[k, ok] = (value[r] + off * stride[r])[ok]
    return out


def _wrap32(x: np.ndarray) -> np.ndarray:
    """int64 -> int32 modulo 2**32 (what int32 arithmetic on the device does)."""
    return ((x + 2**31) % 2**32 - 2**31).astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class RunLookup:
    """A run table in the form the devices expand (:func:`expand_runs`).

    The positions ``0 .. n-1`` of device ``k`` are covered by segments: its runs, and stride-0 segments of
    the sentinel in between. Position ``i`` lies in segment ``r0 + #{u = 1..probes: starts[r0 + u] <= i}``,
    ``r0 = blocks[k, i >> shift]`` the segment holding the start of ``i``'s block of ``2**shift`` positions
    (``shift`` is chosen so that no block has more than ``probes`` segment starts inside it), and maps to
    ``base + i * stride`` of that segment (``base = value - start * stride``, modulo ``2**32`` like the
    device's int32 arithmetic, which makes the sum exact).

    Attributes:
      blocks: ``(m, ceil(n / 2**shift))`` int32.
      segments: ``(m, 3, S + probes)`` int32 rows ``starts`` (padding: ``2**31 - 1``), ``base``, ``stride``.
      shift, probes: see above.
    """

    blocks: np.ndarray
    segments: np.ndarray
    shift: int
    probes: int

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.segments.nbytes

    @classmethod
    def build(cls, runs: np.ndarray, n: int, sentinel: int) -> RunLookup:
        m = runs.shape[0]
        segs = []
        for start, value, stride, length in runs.astype(np.int64):
            real = (length > 0) & (start < _NO_RUN)
            start, value, stride, length = start[real], value[real], stride[real], length[real]
            gap = np.append(0, start + length)
            gap_len = np.append(start, n) - gap
            s = np.concatenate([start, gap[gap_len > 0]])
            v = np.concatenate([value, np.full(int((gap_len > 0).sum()), sentinel)])
            st = np.concatenate([stride, np.zeros(int((gap_len > 0).sum()), np.int64)])
            order = np.argsort(s, kind="stable")
            segs.append((s[order], v[order], st[order]))
        most = max(len(s) for s, _, _ in segs)
        # The smallest blocks table no longer than the segments, then smaller blocks while a block holds more
        # than _PROBES segment starts.
        shift = max(0, math.ceil(math.log2(max(n, 1) / max(most, 1))))

        def probes(shift: int) -> int:
            inner = [s[s & ((1 << shift) - 1) != 0] >> shift for s, _, _ in segs]
            return max([int(np.bincount(x).max()) for x in inner if len(x)] + [0])

        while shift > 0 and probes(shift) > _PROBES:
            shift -= 1
        c = probes(shift)
        nb = max(-(-n // (1 << shift)), 1)
        blocks = np.zeros((m, nb), np.int32)
        segments = np.zeros((m, 3, most + c), np.int32)
        segments[:, 0] = _NO_RUN
        for k, (s, v, st) in enumerate(segs):
            blocks[k] = np.maximum(np.searchsorted(s, np.arange(nb) << shift, side="right") - 1, 0)
            segments[k, :, : len(s)] = s, _wrap32(v - s * st), _wrap32(st)
        return cls(blocks, segments, shift, c)


def expand_runs(lookup: RunLookup, k: jax.Array, pos: jax.Array) -> jax.Array:
    """Device ``k``'s int32 indices at the int32 positions ``pos`` of a :class:`RunLookup`: elementwise
    arithmetic and ``probes + 3`` lookups in small tables."""
    nb, ns = lookup.blocks.shape[1], lookup.segments.shape[2]
    blocks, segments = _const(lookup.blocks.reshape(-1)), _const(lookup.segments.reshape(-1))
    take = functools.partial(jnp.take, mode="clip")  # every index is in bounds
    r0 = take(blocks, k * nb + (pos >> lookup.shift)) + k * (3 * ns)
    r = r0
    for u in range(1, lookup.probes + 1):
        r = r + (pos >= take(segments, r0 + u)).astype(jnp.int32)
    return take(segments, r + ns) + pos * take(segments, r + 2 * ns)


_CHUNK = 1 << 16  # least positions per step of run_indices


def run_indices(lookup: RunLookup, k: jax.Array, n: int, after: jax.Array) -> jax.Array:
    """Device ``k``'s ``(n,)`` int32 indices of the positions ``0 .. n - 1`` of a run table.

    A loop over chunks of at least ``_CHUNK`` positions (at most 32 steps) writing into one index array:
    whatever XLA fuses, the temporaries are one chunk. The array starts from ``after`` (any value, every
    entry is overwritten) so that it cannot be computed, and held, before the data it indexes exists.
    """
    tie = jnp.real(jnp.ravel(after)[0]) if after.size else 0  # real: a complex tie would warn on the int cast
    init = jnp.broadcast_to(jax.lax.convert_element_type(tie, jnp.int32), (n,))
    if n == 0:
        return init
    chunk = min(n, max(_CHUNK, -(-n // 32)))

    def step(i, out):
        at = jnp.minimum(i * chunk, n - chunk)  # the last chunk overlaps the one before
        idx = expand_runs(lookup, k, at + jax.lax.iota(jnp.int32, chunk))
        return jax.lax.dynamic_update_slice(out, idx, (at,))

    return jax.lax.fori_loop(0, -(-n // chunk), step, init)


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
    if max(local_size, work_size) >= 2**31:
        raise ValueError("Muon routing: indices exceed int32")
    cat = lambda xs: np.concatenate(xs).astype(np.int32) if xs else np.zeros(0, np.int32)
    src_dev, src_pos, dst_dev, dst_pos = cat(src_dev), cat(src_pos), cat(dst_dev), cat(dst_pos)

    # 4. Tables. Elements that stay on their device skip the all-to-all; a message (source, owner) carries its
    #    elements in the order of their positions in the source's X (a transposed matrix then moves by
    #    original rows: long runs on the source, at most two per stored row and source on the owner).
    n_el = len(src_dev)
    ids = np.int32 if n_el < 2**31 else np.int64
    at = np.full(m * local_size, -1, ids)
    at[src_dev.astype(np.int64) * local_size + src_pos] = np.arange(n_el, dtype=ids)
    by_pos = at[at >= 0]  # elements in (device, position in X) order
    away = src_dev != dst_dev
    moving = by_pos[away[by_pos]]
    pair = src_dev[moving] * m + dst_dev[moving]
    order = np.argsort(pair.astype(np.int16) if m * m < 2**15 else pair, kind="stable")  # radix for int16
    msg, pair = moving[order], pair[order]  # elements in message order
    first = np.flatnonzero(np.r_[True, pair[1:] != pair[:-1]])
    w_msg = np.arange(len(msg), dtype=np.int32) - np.repeat(first, np.diff(np.append(first, len(msg))))
    width = int(w_msg.max()) + 1 if len(msg) else 0
    if max(local_size, work_size) + m * width >= 2**31:
        raise ValueError("Muon routing: indices exceed int32")
    w = np.zeros(n_el, np.int32)
    w[msg] = w_msg

    # Runs of (device, position) -> index, from the entries listed in an order in which each table's positions
    # run consecutively: message order for the all-to-all tables, element order (stored rows) for the work
    # arrays, position order for X.
    send = _runs(src_dev[msg], dst_dev[msg] * width + w_msg, src_pos[msg], m)
    back_send = _runs(dst_dev[msg], src_dev[msg] * width + w_msg, dst_pos[msg], m)
    gather = _runs(dst_dev, dst_pos, np.where(away, local_size + src_dev * width + w, src_pos), m)
    index = np.where(away, work_size + dst_dev * width + w, dst_pos)
    back_gather = _runs(src_dev[by_pos], src_pos[by_pos], index[by_pos], m)

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
    operands: Sequence[Any] = (),
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
      operands: replicated values (e.g. traced hyperparameters) passed on as trailing arguments of
        ``orthogonalize`` and ``orthogonalize_split`` (``shard_map`` cannot close over traced values).

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
    lookups = rt.lookups

    n_ops = len(operands)

    def local(*args):
        shards, ops = args[: len(args) - n_ops], args[len(args) - n_ops:]
        k = jax.lax.axis_index(axis)
        zero = jnp.zeros((1,), dtype)
        x = jnp.concatenate([local_vector(shards, rt.buckets, dtype), zero])
        parts = [x[:-1]]
        if rt.width:
            idx = run_indices(lookups["send"], k, m * rt.width, shards[rt.buckets[0]])
            rows = jnp.reshape(jnp.take(x, idx, axis=0), (m, rt.width))
            parts.append(jnp.reshape(jax.lax.all_to_all(rows, axis, 0, 0, tiled=False), (-1,)))
        src = jnp.concatenate([*parts, zero])
        work = jnp.take(src, run_indices(lookups["gather"], k, rt.work_size, parts[-1]), axis=0)
        outs, base = [], 0
        for p, q, kc in rt.classes:
            w_in = jnp.reshape(work[base : base + kc * p * q], (kc, p, q))
            w_out = orthogonalize(w_in, *ops)
            outs.append((w_in, w_out))
            base += kc * p * q
        for p, q, r in rt.splits:
            qs = -(-q // m)
            w_in = jnp.reshape(work[base : base + r * p * qs], (r, p, qs))
            outs.append((w_in, orthogonalize_split(w_in, axis, *ops)))
            base += r * p * qs
        leaf_of = _const(rt.matrix_leaf)[k]
        factor = jnp.take(_const(scale).astype(dtype), leaf_of)
        if adaptive:
            dots = [jnp.sum(jnp.conj(a) * b, axis=(1, 2)) for a, b in outs]  # <input, result>, conj for complex
            dots = jnp.concatenate(dots) if outs else jnp.zeros((0,), dtype)
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
            idx = run_indices(lookups["back_send"], k, m * rt.width, outs[-1][1])
            rows = jnp.reshape(jnp.take(result, idx, axis=0), (m, rt.width))
            parts.append(jnp.reshape(jax.lax.all_to_all(rows, axis, 0, 0, tiled=False), (-1,)))
        idx = run_indices(lookups["back_gather"], k, rt.local_size, parts[-1])
        back = jnp.take(jnp.concatenate([*parts, zero]), idx, axis=0)
        return tuple(split_local(back, shards, rt.buckets))

    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    ops_specs = (jax.sharding.PartitionSpec(),) * n_ops
    mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=(*specs, *ops_specs), out_specs=specs, check_vma=False)
    return list(mapped(*buffers, *operands))
