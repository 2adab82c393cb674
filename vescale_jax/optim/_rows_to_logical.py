"""The conversion both ways between a plan's per-device rows of optimizer state and plan-independent arrays.

A layout of :mod:`vescale_jax.optim._state_layouts` lists its logical arrays as :class:`Entry` tables (where each
device's piece of a leaf starts in its rows, how the leaf is placed) and subclasses :class:`Relayout`, which gives
it ``logical_shapes``, ``to_logical`` and ``from_logical``: one jitted ``shard_map`` each way per plan.

Sharding of the logical arrays, and how the rows get there (inside one ``shard_map``):

* blocks, when the device count divides ``b``: the rows inside every block are split over the devices, one
  balanced all-to-all of exactly one device's rows;
* otherwise, a leaf's (per-layer) dim 0 when the device count divides it, else a stacked leaf's layers when it
  divides their number: each device's piece of a leaf is one contiguous run of its rows (per layer), i.e. a
  :class:`~vescale_jax.RaggedShard`, and all pieces move together by :func:`vescale_jax.relayout._exchange.exchange`
  (edge-coloured collective-permutes; a device holds its rows, its share and about what it sends);
* otherwise the leaf is replicated, whole on each device (one all-gather of that leaf).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._cache import plan_cache
from vescale_jax._compat import is_tracer
from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout._plan import Plan
from vescale_jax.layout._ragged import RaggedShard
from vescale_jax.relayout import _redistribute as redistribute
from vescale_jax.relayout._exchange import exchange

__all__ = ["Entry", "Relayout", "Tables", "check_pieces", "per_device_axes"]

P = jax.sharding.PartitionSpec


def _even_spec(per_layer: tuple[int, ...], layers: int | None, chunked: bool, axis: Any, m: int) -> P:
    """Even sharding of a logical array, spelled out over every dim: the rows inside each block when
    ``chunked``; else its per-layer dim 0 when the device count divides it; else its layers when the device
    count divides their number; else replicated (the leaf is then gathered whole on every device)."""
    dims: list[Any] = [None] * (len(per_layer) + (layers is not None))
    if chunked:
        dims[-2] = axis
    elif per_layer and per_layer[0] % m == 0 and per_layer[0] >= m:
        dims[0 if layers is None else 1] = axis
    elif layers is not None and layers % m == 0 and math.prod(per_layer):
        dims[0] = axis  # whole layers per device
    return P(*dims)


@dataclasses.dataclass(frozen=True, eq=False)
class Entry:
    """One logical array: ``layers`` copies (``None``: not stacked) of a per-layer tensor placed by ``rs``.

    ``start[k, l]`` is where device ``k``'s piece of layer ``l`` begins in its flattened local value; the
    piece is ``rs.local_sizes[k]`` elements long. ``slots`` (block layouts whose block edge the device count
    divides): ``(L, nb)`` global slot (``device * B + slot``) of each block; the logical array is then split
    over the rows inside each block.

    A leaf stored tile-major (``vj.tiles``) keeps its rows in an order that is not the logical one, so ``rs``
    places that order instead: ``perm`` (blocks) says logical block ``j`` is block ``perm[j]`` of it;
    ``tiled`` (compact vectors) is ``(logical per-layer shape, granularity)`` with ``rs`` over the storage
    order (see :mod:`vescale_jax.layout._tiles`). Such an entry is relaid out whole on every device (one all-gather of
    the leaf, then each device keeps its share of the logical array): a correct, costlier fallback.
    """

    key: str
    layers: int | None
    rs: RaggedShard
    start: np.ndarray
    slots: np.ndarray | None = None
    perm: np.ndarray | None = None
    tiled: tuple[tuple[int, ...], Any] | None = None

    @property
    def reordered(self) -> bool:
        return self.slots is None and (self.perm is not None or self.tiled is not None)

    @property
    def per_layer(self) -> tuple[int, ...]:
        """The logical per-layer shape."""
        return self.rs.shape if self.tiled is None else tuple(self.tiled[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical array's shape."""
        return self.per_layer if self.layers is None else (self.layers, *self.per_layer)

    def spec(self, axis: Any, m: int) -> P:
        """The logical array's even sharding (see :func:`_even_spec`)."""
        return _even_spec(self.per_layer, self.layers, self.slots is not None, axis, m)

    def replicated(self, axis: Any, m: int) -> bool:
        """Whether the rows are gathered whole on every device (a replicated or a reordered entry)."""
        return self.reordered or all(d is None for d in self.spec(axis, m))

    def to_logical_order(self, x: jax.Array) -> jax.Array:
        """The whole ``(L, ...)`` array in ``rs``'s order -> in the logical order."""
        if self.perm is not None:
            return jnp.take(x, jnp.asarray(self.perm), axis=1)
        if self.tiled is not None:
            return tiles.from_storage(jnp.reshape(x, (x.shape[0], -1)), self.tiled[0], self.tiled[1], jnp)
        return x

    def to_rows_order(self, x: jax.Array) -> jax.Array:
        """Inverse of :meth:`to_logical_order`."""
        if self.perm is not None:
            return jnp.take(x, jnp.asarray(np.argsort(self.perm)), axis=1)
        if self.tiled is not None:
            return jnp.reshape(tiles.to_storage(x, self.tiled[0], self.tiled[1], jnp), (x.shape[0], *self.rs.shape))
        return x

    def share(self, x: jax.Array, axis: Any, m: int, k: jax.Array) -> jax.Array:
        """Device ``k``'s share under :meth:`spec` of the whole logical array ``x``."""
        for d, name in enumerate(self.spec(axis, m)):
            if name is not None:
                n = x.shape[d] // m
                return jax.lax.dynamic_slice_in_dim(x, k * n, n, axis=d)
        return x

    def whole(self, x: jax.Array, axis: Any, m: int) -> jax.Array:
        """Inverse of :meth:`share`: the whole logical array from every device's share."""
        for d, name in enumerate(self.spec(axis, m)):
            if name is not None:
                return jax.lax.all_gather(x, axis, axis=d, tiled=True)
        return x


@dataclasses.dataclass(frozen=True, eq=False)
class Tables:
    """A layout's static tables: its logical arrays and the shape of one device's rows."""

    entries: tuple[Entry, ...]
    local_shape: tuple[int, ...]  # one device's rows of the PerDevice value


def check_pieces(what: str, key: str, counts: Sequence[int], firsts: Sequence[int]) -> None:
    """Device pieces must tile the leaf in device order (true of every plan: a device owns one range)."""
    cursor = 0
    for k, (n, first) in enumerate(zip(counts, firsts, strict=True)):
        if n and first != cursor:
            raise AssertionError(f"{what}: {key}: device {k}'s piece starts at {first}, expected {cursor}")
        cursor += n


class Relayout:
    """Shared conversion machinery; subclasses build the entries (static tables from the plan)."""

    plan: Plan

    def _build(self) -> Tables:
        raise NotImplementedError

    @property
    def _tables(self) -> Tables:
        return _tables_of(self)

    def _sharding(self, entry: Entry) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.plan.mesh, entry.spec(self.plan.axis, self.plan.num_devices))

    def default_dtype(self) -> Any:
        raise NotImplementedError

    def logical_shapes(self, dtype: Any = None) -> dict[str, jax.ShapeDtypeStruct]:
        """The abstract result of :meth:`to_logical` for a value of ``dtype`` (default: the optimizer's usual
        state dtype), with the shardings :meth:`to_logical` gives (the restore target of a checkpoint).

        Sharding:
          Each array is split evenly over the plan's axis on its (per-layer) dim 0 when the device count
          divides it, replicated otherwise.
        """
        dtype = jnp.dtype(self.default_dtype() if dtype is None else dtype)
        return {e.key: jax.ShapeDtypeStruct(e.shape, dtype, sharding=self._sharding(e)) for e in self._tables.entries}

    def _check_value(self, value: Any) -> None:
        want = (self.plan.num_devices * self._tables.local_shape[0], *self._tables.local_shape[1:])
        if tuple(value.shape) != want:
            raise ValueError(
                f"{type(self).__name__}.to_logical: the PerDevice value has shape {tuple(value.shape)}, but this "
                f"layout's rows are {want} (plan of {self.plan.num_devices} devices); the state was built for "
                f"another plan or by a transformation that reshapes its state."
            )

    def to_logical(self, value: jax.Array) -> dict[str, jax.Array]:
        """The plan-independent arrays held by a ``PerDevice`` value of this layout.

        Args:
          value: the ``PerDevice`` value (``(m * rows, ...)`` sharded over the plan's axis on dim 0).

        Returns:
          ``{key: array}``, keys and shapes as in :meth:`logical_shapes`; values exact (a permutation).

        Sharding:
          See :meth:`logical_shapes`. Pieces move by collective-permutes between the devices that exchange data;
          a device holds its own rows, its share of the result and the messages (a whole leaf only where the
          result is replicated).
        """
        self._check_value(value)
        if not self._tables.entries:
            return {}
        return dict(zip([e.key for e in self._tables.entries], _to_logical_fn(self)(value), strict=True))

    def from_logical(self, arrays: Mapping[str, jax.Array]) -> jax.Array:
        """The ``PerDevice`` value under this layout's plan, from :meth:`to_logical` of any plan.

        Args:
          arrays: ``{key: array}`` with exactly the keys and shapes of :meth:`logical_shapes` (one dtype); arrays
            on other devices or with other shardings are moved to the shardings of :meth:`logical_shapes`.

        Returns:
          ``(m * rows, ...)`` sharded over the plan's axis on dim 0; rows no leaf uses are zero.
        """
        entries = self._tables.entries
        keys = [e.key for e in entries]
        missing, extra = [k for k in keys if k not in arrays], [k for k in arrays if k not in keys]
        if missing or extra:
            raise ValueError(
                f"{type(self).__name__}.from_logical: missing keys {missing[:5]}, unexpected keys {extra[:5]}; the "
                f"arrays come from a state over another tree or another optimizer configuration (block size, "
                f"leaves handled by the optimizer)."
            )
        dtypes = {jnp.dtype(arrays[k].dtype) for k in keys}
        if len(dtypes) > 1:
            raise ValueError(f"{type(self).__name__}.from_logical: arrays of several dtypes {sorted(map(str, dtypes))}")
        for e in entries:
            got = tuple(arrays[e.key].shape)
            if got != e.shape:
                raise ValueError(
                    f"{type(self).__name__}.from_logical: {e.key!r} has shape {got}, this layout expects {e.shape}; "
                    f"the arrays come from another tree, block size or stacking of layers."
                )
        placed = []
        for e in entries:
            x, want = arrays[e.key], self._sharding(e)
            sharding = getattr(x, "sharding", None)
            if not is_tracer(x) and not (  # inside jit: leave the shardings to the caller
                isinstance(sharding, jax.sharding.Sharding)
                and sharding.device_set == want.device_set
                and sharding.is_equivalent_to(want, len(e.shape))
            ):
                x = jax.device_put(x, want)
            placed.append(x)
        dtype = dtypes.pop() if dtypes else jnp.dtype(self.default_dtype())
        if not entries:  # nothing to hold (no matrix leaf, no chosen leaf): the rows are all padding
            shape = (self.plan.num_devices * self._tables.local_shape[0], *self._tables.local_shape[1:])
            spec = P(self.plan.axis, *[None] * (len(shape) - 1))
            return jax.device_put(jnp.zeros(shape, dtype), jax.sharding.NamedSharding(self.plan.mesh, spec))
        return _from_logical_fn(self, dtype)(*placed)


@plan_cache
def _tables_of(layout: Relayout) -> Tables:
    return layout._build()


def _moves(entries: Sequence[Entry], axis: Any, m: int):
    """The pieces :func:`_exchange` moves between the rows and the logical arrays split over the devices.

    Returns:
      ``(moves, value_at, logical_at, shares, size)``: per moved tensor its ``(rows placement, logical
      placement)`` and offset tables (value side, logical side); per entry index, the offset and local shape
      of its share in one flat buffer of all shares; that buffer's size.
    """
    moves, value_at, logical_at, shares, cursor = [], [], [], {}, 0
    for i, e in enumerate(entries):
        if not e.rs.size or e.slots is not None or e.replicated(axis, m):
            continue
        layers, size = e.layers or 1, e.rs.size
        if e.layers is not None and e.spec(axis, m)[0] is not None:  # whole layers per device
            per = layers // m
            for layer in range(layers):
                owner = tuple(size if k == layer // per else 0 for k in range(m))
                moves.append((e.rs, RaggedShard(e.rs.shape, 1, owner)))
                value_at.append(e.start[:, layer : layer + 1])
                logical_at.append(np.full((m, 1), cursor + (layer % per) * size, np.int64))
            shares[i] = (cursor, (per, *e.rs.shape))
            cursor += per * size
        else:
            share = size // m
            moves.append((e.rs, RaggedShard.dim0(e.rs.shape, m)))
            value_at.append(e.start)
            logical_at.append(np.broadcast_to(cursor + share * np.arange(layers, dtype=np.int64), (m, layers)))
            local = (e.rs.shape[0] // m, *e.rs.shape[1:])
            shares[i] = (cursor, local if e.layers is None else (layers, *local))
            cursor += share * layers
    return moves, value_at, logical_at, shares, cursor


@plan_cache
def _to_logical_fn(layout: Relayout):
    plan, tables = layout.plan, layout._tables
    axis, m = plan.axis, plan.num_devices
    moves, value_at, logical_at, shares_of, share_size = _moves(tables.entries, axis, m)
    chunked = any(e.slots is not None for e in tables.entries)

    def local(v):
        k = jax.lax.axis_index(axis)
        flat = jnp.reshape(v, (-1,))
        if chunked:  # device d gets rows [d*c, (d+1)*c) of every block: one balanced all-to-all
            slots, b = v.shape[0], v.shape[-1]
            x = jnp.swapaxes(jnp.reshape(v, (slots, m, b // m, b)), 0, 1)
            rows = jnp.reshape(jax.lax.all_to_all(x, axis, 0, 0), (m * slots, b // m, b))
        shares = exchange(flat, value_at, jnp.zeros((share_size,), v.dtype), logical_at, moves, axis, m)
        width = max([e.rs.max_local_size for e in tables.entries] + [1])
        padded = jnp.pad(flat, (0, width))
        out = []
        for i, e in enumerate(tables.entries):
            if e.slots is not None:
                x = jnp.take(rows, jnp.asarray(e.slots), axis=0)
                out.append(x[0] if e.layers is None else x)
            elif e.rs.size == 0:  # an empty leaf: replicated zeros of its shape
                out.append(jnp.zeros(e.shape, v.dtype))
            elif e.replicated(axis, m):
                w = e.rs.max_local_size
                valid = jnp.arange(w) < jnp.asarray(np.asarray(e.rs.local_sizes, np.int32))[k]
                pieces = jax.vmap(lambda s, w=w: jax.lax.dynamic_slice(padded, (s,), (w,)))(jnp.asarray(e.start)[k])
                pieces = jnp.where(valid[None], pieces, jnp.zeros((), v.dtype))
                x = jax.vmap(lambda p, rs=e.rs: redistribute.from_ragged(p, rs, axis=axis))(pieces)
                if e.reordered:
                    x = e.to_logical_order(x)
                    x = e.share(x if e.layers is not None else x[0], axis, m, k)
                    out.append(x)
                    continue
                out.append(x[0] if e.layers is None else x)
            else:
                lo, shape = shares_of[i]
                out.append(jnp.reshape(shares[lo : lo + math.prod(shape)], shape))
        return tuple(out)

    specs = tuple(e.spec(axis, m) for e in tables.entries)
    fn = jax.jit(jax.shard_map(local, mesh=plan.mesh, in_specs=P(axis), out_specs=specs, check_vma=False))
    return fn


def _from_logical_fn(layout: Relayout, dtype: Any):
    return _from_logical_cached(layout, jnp.dtype(dtype).name)


@plan_cache
def _from_logical_cached(layout: Relayout, dtype: str):
    plan, tables = layout.plan, layout._tables
    axis, m = plan.axis, plan.num_devices
    size = math.prod(tables.local_shape)
    moves, value_at, logical_at, shares_of, _ = _moves(tables.entries, axis, m)
    chunked = any(e.slots is not None for e in tables.entries)

    def local(*xs):
        k = jax.lax.axis_index(axis)
        out = jnp.zeros((size,), dtype)
        if chunked:  # inverse of to_logical's all-to-all
            slots, b = tables.local_shape[0], tables.local_shape[-1]
            rows = jnp.zeros((m * slots, b // m, b), dtype)
            for e, x in zip(tables.entries, xs, strict=True):
                if e.slots is not None:
                    rows = rows.at[jnp.asarray(e.slots)].set((x[None] if e.layers is None else x).astype(dtype))
            x = jax.lax.all_to_all(jnp.reshape(rows, (m, slots, b // m, b)), axis, 0, 0)
            out = jnp.reshape(jnp.swapaxes(x, 0, 1), (size,))
        for e, x in zip(tables.entries, xs, strict=True):
            if e.rs.size == 0 or e.slots is not None or not e.replicated(axis, m):
                continue
            if e.reordered:
                x = e.whole(x, axis, m)
                x = e.to_rows_order(x[None] if e.layers is None else x)
            else:
                x = x[None] if e.layers is None else x
            x = x.astype(dtype)
            pieces = jax.vmap(lambda t, rs=e.rs: redistribute.to_ragged(t, rs, axis=axis))(x)
            w = e.rs.max_local_size
            valid = jnp.arange(w) < jnp.asarray(np.asarray(e.rs.local_sizes, np.int32))[k]
            index = jnp.asarray(e.start)[k][:, None] + jnp.arange(w, dtype=jnp.int32)[None]
            out = out.at[jnp.where(valid[None], index, size)].set(pieces, mode="drop")  # past the end: dropped
        sharded = [jnp.reshape(xs[i], (-1,)).astype(dtype) for i in sorted(shares_of)]  # in offset order
        if sharded:
            src = jnp.concatenate(sharded) if len(sharded) > 1 else sharded[0]
            out = exchange(src, logical_at, out, value_at, [(b, a) for a, b in moves], axis, m)
        return jnp.reshape(out, tables.local_shape)

    specs = tuple(e.spec(axis, m) for e in tables.entries)
    fn = jax.jit(jax.shard_map(local, mesh=plan.mesh, in_specs=specs, out_specs=P(axis), check_vma=False))
    return fn


def per_device_axes(plan: Plan) -> Any:
    """The mesh axes of per-device rows that differ per tensor / expert group: ``plan.tp_axes`` then the plan's
    axis (device ``t * m + k`` of ``jax.lax.axis_index``), or the plan's axis alone without ``tp``."""
    if not plan.tp_axes:
        return plan.axis
    return (*plan.tp_axes, *((plan.axis,) if isinstance(plan.axis, str) else plan.axis))
