"""The batch of a ``vj.fsdp`` step: its sharding (dim 0 over the data axes), placement and checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vescale_jax._compat import is_tracer
from vescale_jax.layout._checks import check_axes
from vescale_jax.layout._plan import Plan
from vescale_jax.step._checks import check_microbatches

__all__ = ["data_sharding", "place_batch"]


def _axes(axis: str | Sequence[str]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _data_size(mesh: jax.sharding.Mesh, data_axes: tuple[str, ...]) -> int:
    return int(np.prod([mesh.shape[a] for a in data_axes]))


def data_sharding(plan: Plan, data_axes: str | Sequence[str] | None = None) -> NamedSharding:
    """The sharding of a batch: dim 0 split over the data axes (default: the plan's axis)."""
    axes = _axes(plan.axis if data_axes is None else data_axes)
    if not axes:
        raise ValueError(
            f"vj.fsdp: data_axes=() names no mesh axis; the batch's dim 0 is split over the data axes (default: the "
            f"plan's axis {plan.axis!r}). Leave data_axes unset, or name mesh axes of {dict(plan.mesh.shape)}."
        )
    check_axes(axes, plan.mesh, "vj.fsdp: data_axes")
    return NamedSharding(plan.mesh, P(axes))


def _check_batch(batch: Any, size: int, data_axes: tuple[str, ...], what: str = "batch") -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = tuple(np.shape(leaf))
        if not shape:
            raise _scalar_leaf(f"{what} leaf {jax.tree_util.keystr(path) or '<root>'}", leaf, data_axes)
        if shape[0] % size:
            raise ValueError(
                f"vj.fsdp: {what} leaf {jax.tree_util.keystr(path) or '<root>'} has shape {shape}; its leading "
                f"(batch) dim must be divisible by the data-parallel size {size} (mesh axes {data_axes}). Use a "
                f"batch size that is a multiple of {size}."
            )


def _scalar_leaf(name: str, leaf: Any, data_axes: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"vj.fsdp: {name} is a scalar ({leaf!r:.40}); every batch leaf needs a leading batch dim to split over "
        f"{data_axes}. Give it one (e.g. x[None] repeated per example), or pass per-step constants as later step "
        "arguments / close over them."
    )


def _check_placed(args: Any, plan: Plan, axes: tuple[str, ...], what: str | None = None) -> None:
    """On Explicit mesh axes a batch must already carry dim 0 over the data axes (shard_map does not move it)."""
    types = dict(zip(plan.mesh.axis_names, plan.mesh.axis_types, strict=True))
    explicit = [a for a in axes if types[a] == jax.sharding.AxisType.Explicit]
    if not explicit or _data_size(plan.mesh, axes) == 1:
        return
    for path, leaf in jax.tree_util.tree_flatten_with_path(args)[0]:
        sharding = getattr(jax.typeof(leaf), "sharding", None)
        spec = tuple(getattr(sharding, "spec", ()) or ())
        dim0 = _axes(spec[0]) if spec and spec[0] is not None else ()
        if dim0 != axes:
            if what is not None:  # a dict of named inputs (keyword arguments)
                where = f"{what} {path[0].key}" + jax.tree_util.keystr(path[1:])
            else:
                where = f"batch argument {path[0].idx}" + jax.tree_util.keystr(path[1:]) if path else "batch argument"
            if len(spec) > 1 and spec[1] is not None and _axes(spec[1]) == axes:
                raise ValueError(
                    f"vj.apply: {where} (shape {tuple(np.shape(leaf))}) still has its leading micro-batch dim (the "
                    "step was compiled with microbatches=); compute the loss through vj.accumulate(loss_fn, params, "
                    "batch), which hands vj.apply one micro-batch at a time."
                )
            raise ValueError(
                f"vj.apply: {where} (shape {tuple(np.shape(leaf))}) has dim 0 sharded as {spec[:1] or '(unplaced)'}, "
                f"but the mesh's axes are Explicit and the batch must be split over {axes}; place it first: "
                "batch = vj.place_batch(batch, plan) (a vj.fsdp step does this), or "
                "jax.device_put(x, vj.data_sharding(plan))."
            )


def place_batch(
    batch: Any, plan: Plan, data_axes: str | Sequence[str] | None = None, *, microbatches: int | None = None
) -> Any:
    """Puts a batch on the mesh with dim 0 split over the data axes.

    In a single-process job ``batch`` is the global batch. In a multi-process job each process passes only its
    own part (the rows for its devices, in process order) and the global batch is assembled without copying
    through one host (``jax.make_array_from_process_local_data``).

    Leaves that are already global ``jax.Array``s with the target sharding pass through as they are (with
    ``microbatches``: ``(k, B/k, ...)`` arrays with dim 1 split, i.e. a batch this function placed). Other device
    arrays (on one device, replicated, split otherwise) are resharded and, for ``microbatches``, split on device,
    never copied through the host; shapes are checked from ``.shape`` alone. In a multi-process job a fully
    addressable array is taken as the process's own part. Under an outer ``jax.jit`` / ``jax.export`` a traced
    leaf is the global batch (with ``microbatches`` not yet split): it is reshaped and given the sharding as a
    constraint.

    Args:
      batch: a pytree of arrays with a leading batch dim.
      plan: the plan (its mesh).
      data_axes: mesh axes dim 0 is split over (default: the plan's axis).
      microbatches: split dim 0 into this many micro-batches: leaves become ``(k, B/k, ...)`` (micro-batch ``i``
        is rows ``[i·B/k, (i+1)·B/k)`` of each process's part) with dim 1 split over the data axes.

    Returns:
      The batch as global arrays with :func:`data_sharding` (dim 1 of it with ``microbatches``).
    """
    axes = _axes(plan.axis if data_axes is None else data_axes)
    flat = data_sharding(plan, axes)
    microbatches = check_microbatches(microbatches, "vj.place_batch")
    size = _data_size(plan.mesh, axes)
    k = microbatches or 1
    sharding = NamedSharding(plan.mesh, P(None, axes)) if microbatches else flat
    multi = jax.process_count() > 1
    what = "micro-batch" if microbatches else "batch"

    def on_device(x):  # a global array (any array in a single-process job): placed on device, never via the host
        return isinstance(x, jax.Array) and (is_tracer(x) or not (multi and x.is_fully_addressable))

    def split_already(x):  # already (k, B/k, ...) with dim 1 split: a batch placed with these micro-batches
        return microbatches and x.ndim >= 2 and x.shape[0] == k and _has_sharding(x, sharding)

    def placed_shape(path, x):  # checks a leaf from its shape alone; the shape of its micro-batch (or batch)
        name = jax.tree_util.keystr(path) or "<root>"
        shape = tuple(x.shape) if isinstance(x, jax.Array) else np.shape(x)
        if not shape:
            raise _scalar_leaf(f"batch leaf {name}", x, axes)
        if on_device(x) and not is_tracer(x) and split_already(x):
            return jax.ShapeDtypeStruct(shape[1:], x.dtype)
        if shape[0] % k:
            raise ValueError(
                f"vj.fsdp: batch leaf {name} has shape {shape}: its leading dim {shape[0]} does not split into "
                f"{k} micro-batches (microbatches={k}); use a batch size that is a multiple of {k}."
            )
        return jax.ShapeDtypeStruct((shape[0] // k, *shape[1:]) if microbatches else shape, np.float32)

    def traced_place(x):  # under an outer jit / export: a global batch, reshaped and constrained, never moved
        if microbatches:
            x = jnp.reshape(x, (k, x.shape[0] // k, *x.shape[1:]))
        types = dict(zip(plan.mesh.axis_names, plan.mesh.axis_types, strict=True))
        if any(t == jax.sharding.AxisType.Explicit for t in types.values()):
            return jax.sharding.reshard(x, sharding)
        return jax.lax.with_sharding_constraint(x, sharding)

    def device_place(path, x):
        if is_tracer(x):
            return traced_place(x)
        if _has_sharding(x, sharding) and (not microbatches or split_already(x)):
            return x
        if not microbatches:
            return jax.device_put(x, sharding)  # device to device (a reshard), or onto the mesh
        if multi:
            raise ValueError(
                f"vj.place_batch: batch leaf {jax.tree_util.keystr(path) or '<root>'} is a global array of shape "
                f"{tuple(x.shape)}; with microbatches={k} in a multi-process job pass each process's own part "
                "(micro-batch i is rows [i·b/k, (i+1)·b/k) of every part), or an array placed by "
                f"vj.place_batch(..., microbatches={k})."
            )
        x = x if _has_sharding(x, flat) else jax.device_put(x, flat)
        shape = (k, x.shape[0] // k, *x.shape[1:])
        types = dict(zip(plan.mesh.axis_names, plan.mesh.axis_types, strict=True))
        explicit = any(types[a] == jax.sharding.AxisType.Explicit for a in axes)  # the split dim's sharding is typed
        y = jnp.reshape(x, shape, out_sharding=sharding) if explicit else jnp.reshape(x, shape)
        return jax.device_put(y, sharding)  # the spec as placing host data spells it (one jit cache entry)

    def host_place(x):  # host data (a process's own part in a multi-process job)
        x = np.asarray(x)
        x = x.reshape(k, x.shape[0] // k, *x.shape[1:]) if microbatches else x
        return jax.make_array_from_process_local_data(sharding, x) if multi else jax.device_put(x, sharding)

    shapes = jax.tree_util.tree_map_with_path(placed_shape, batch)
    if not multi:
        _check_batch(shapes, size, axes, what=what)
    out = jax.tree_util.tree_map_with_path(
        lambda path, x: device_place(path, x) if on_device(x) else host_place(x), batch
    )
    if multi:
        _check_batch(
            jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape[1:2] if microbatches else x.shape[:1], np.float32), out
            ),
            size,
            axes,
            what=f"global {what} (all processes' parts)",
        )
    return out


def _has_sharding(x: jax.Array, sharding: NamedSharding) -> bool:
    """Whether ``x`` is laid out as ``sharding`` on its mesh (same mesh and axis types, equivalent spec)."""
    s = x.sharding
    return (
        isinstance(s, NamedSharding)
        and s.mesh == sharding.mesh
        and x.ndim >= len(sharding.spec)
        and s.is_equivalent_to(sharding, x.ndim)
    )
