"""Thin adapters for Flax NNX and Linen models under ``vj.fsdp``.

NNX: split the model into ``(graphdef, params_state)``, plan and shard the state, and call the model through
:func:`nnx_apply`; a model with a stacked layer group loops over it with :func:`nnx_scan_layers`, which is an
ordinary scan outside FSDP. Linen: plan the ``{"params": ...}`` dict and call :func:`linen_apply`.
:func:`partition_specs` reads Flax's partitioning annotations as the ``tp=`` argument of ``vj.plan``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from vescale_jax.state._sharded import ShardedParams
from vescale_jax.step._fsdp import apply
from vescale_jax.step._scan_layers import scan_layers

__all__ = ["linen_apply", "nnx_apply", "nnx_scan_layers", "partition_specs"]


def nnx_apply(
    graphdef: Any,
    params: ShardedParams,
    *args: Any,
    method: str | Callable[..., Any] | None = None,
    data_axes: str | Sequence[str] | None = None,
    reshard_after_forward: bool | None = None,
    out_specs: Any = None,
) -> Any:
    """Calls an NNX model rebuilt from ``graphdef`` and the gathered ``params`` on each device's batch shard.

    Args:
      graphdef: from ``graphdef, state = nnx.split(model)`` where ``state`` is what was planned (all of the
        model's state: split off non-parameter variables first if the model has any).
      params: the sharded state.
      *args: batch-like inputs (dim 0 split over the data axes).
      method: a method name or ``lambda model, *args: ...`` to call instead of ``__call__``.
      data_axes, reshard_after_forward, out_specs: as in :func:`vj.apply`.

    Returns:
      The model's outputs as global arrays (dim 0 over the data axes).

    Sharding:
      As :func:`vj.apply`.
    """
    from flax import nnx

    if isinstance(graphdef, nnx.Module):
        raise TypeError(
            f"vj.flax.nnx_apply: the first argument is a {type(graphdef).__name__} module; pass its graphdef: "
            "graphdef, state = nnx.split(model), with state the tree that was planned."
        )

    def fn(state, *a):
        model = nnx.merge(graphdef, state)
        if method is None:
            return model(*a)
        return getattr(model, method)(*a) if isinstance(method, str) else method(model, *a)

    return apply(
        fn, params, *args, data_axes=data_axes, reshard_after_forward=reshard_after_forward, out_specs=out_specs
    )


def nnx_scan_layers(
    layers: Any, carry: Any, fn: Callable[..., Any] | None = None, xs: Any = None, *, unroll: int | bool = 1
) -> Any:
    """Runs ``carry = fn(layer, carry[, x])`` over a stacked NNX layer group (e.g. built with ``nnx.vmap``).

    Inside :func:`nnx_apply` each layer is gathered in the loop body with the next one prefetched; outside it is
    an ordinary ``lax.scan`` over the stacked parameters.

    Args:
      layers: the stacked module (every parameter with a leading layer dim).
      carry: the loop carry.
      fn: ``(layer_module, carry[, x]) -> carry``; default calls the layer on the carry.
      xs: optional per-layer inputs with leading layer dim.
      unroll: passed to :func:`vj.scan_layers`.

    Returns:
      The final carry.
    """
    from flax import nnx

    graphdef, state = nnx.split(layers)
    call = fn if fn is not None else (lambda layer, c, *x: layer(c, *x))

    def body(layer_state, c, *x):
        return call(nnx.merge(graphdef, layer_state), c, *x)

    return scan_layers(body, state, carry, xs, unroll=unroll)


def linen_apply(
    model: Any,
    params: ShardedParams,
    *args: Any,
    method: str | Callable[..., Any] | None = None,
    data_axes: str | Sequence[str] | None = None,
    reshard_after_forward: bool | None = None,
    out_specs: Any = None,
    **kwargs: Any,
) -> Any:
    """``model.apply(variables, *args)`` with the gathered variables, on each device's batch shard.

    Args:
      model: a Linen module.
      params: the sharded variables (plan the whole ``{"params": ...}`` dict).
      *args: batch-like inputs.
      method, **kwargs: passed to ``model.apply``.
      data_axes, reshard_after_forward, out_specs: as in :func:`vj.apply`.

    Returns:
      The outputs as global arrays.
    """

    if isinstance(params, ShardedParams):
        tops = list(dict.fromkeys(s.path.split("/")[0] for s in params.plan.leaves))
        if "params" not in tops:
            raise ValueError(
                f"vj.flax.linen_apply: the plan's top-level keys are {tops[:6]}, not Linen collections: plan the "
                "whole variables dict (vj.plan({'params': variables['params']}, mesh) or model.init(...)), not "
                "variables['params']."
            )

    def fn(variables, *a):
        return model.apply(variables, *a, method=method, **kwargs)

    return apply(
        fn, params, *args, data_axes=data_axes, reshard_after_forward=reshard_after_forward, out_specs=out_specs
    )


def partition_specs(tree: Any, *, rules: Any = None) -> Any:
    """The ``tp=`` argument of ``vj.plan`` from Flax's partitioning annotations.

    NNX: a ``State`` (or any tree) of ``nnx.Variable`` leaves whose metadata carries ``nnx.with_partitioning``'s
    names (``out_sharding``), as ``nnx.get_partition_spec`` reads them; in Flax 0.12 an annotated model is
    created (or its ``nnx.eval_shape`` taken) under ``jax.set_mesh(mesh)``. Linen: variables (e.g.
    ``jax.eval_shape(model.init, ...)``) whose leaves are ``nn.with_partitioning`` (mesh axes) or
    ``nn.with_logical_partitioning`` (logical names) boxes. Logical names are mapped to mesh axes by
    ``nn.logical_to_mesh_axes`` with ``rules`` (then a box's own rules, then the ``nn.logical_axis_rules``
    context), as Flax does: a logical name that no rule maps is not split. Without any rule, logical names are
    kept as they are, so ``vj.plan`` raises naming the leaf and the name.

    An NNX ``Variable`` whose value carries a ``NamedSharding`` that splits it (a model, or its
    ``nnx.eval_shape``, made under ``jax.set_mesh``) gives that sharding's spec: it is where JAX placed the
    array, with Flax's rules applied and, for a stacked layer group made with ``nnx.vmap``, the layer dim
    inserted (the ``out_sharding`` metadata lacks it unless the vmap has
    ``transform_metadata={nnx.PARTITION_NAME: None}``).

    The FSDP axis may appear in a spec (MaxText style ``P("fsdp", "tensor")``): ``vj.plan`` drops the entries
    naming its ``axis``, since the FSDP layout is ragged over it; the other named axes are the leaf's tensor /
    expert axes.

    Args:
      tree: the annotated parameters: the tree that is planned (NNX ``State``; Linen variables, boxed or with
        ``nn.unbox`` applied) or the boxed tree it came from. The key paths match in both cases (a box's or
        a ``Variable``'s ``value`` is not part of a leaf's name).
      rules: logical axis rules, ``((logical_name, mesh_axes), ...)``, as ``nn.logical_axis_rules`` takes.

    Returns:
      A tree of ``PartitionSpec | None`` over the mesh axes, one per annotated ``Variable`` or box (``None`` for
      an array leaf without an annotation), for ``vj.plan(params, mesh, tp=...)``.

    Raises:
      TypeError: ``tree`` has no array leaf, ``Variable`` or box (naming what it got).
    """
    import flax.linen as nn
    from flax import nnx
    from flax.core import meta
    from flax.core import spmd as core_spmd

    def is_annotated(x):
        return isinstance(x, nnx.Variable | meta.AxisMetadata)

    def with_rules(names, own):
        context = core_spmd.get_logical_axis_rules()
        if rules is None and not own and not context:
            return jax.sharding.PartitionSpec(*names)  # mesh axes, or logical names vj.plan reports
        combined = (*(rules or ()), *(own or ()), *(context or ()))  # the first rule naming a name wins
        return nn.logical_to_mesh_axes(tuple(names), combined)

    def one(x):
        if isinstance(x, nnx.Variable):
            value = x.get_value() if hasattr(x, "get_value") else x.value
            placed = getattr(value, "sharding", None)
            if isinstance(placed, jax.sharding.NamedSharding) and any(e is not None for e in placed.spec):
                return placed.spec  # where the array lives: a stacked group's layer dim included
            metadata = x.get_metadata()
            names = metadata.get("out_sharding") or metadata.get("sharding_names") or metadata.get("sharding")
            if not names:
                return None
            if isinstance(names, jax.sharding.PartitionSpec):
                names = tuple(names)
            return with_rules(names, metadata.get("sharding_rules"))
        if isinstance(x, nn.LogicallyPartitioned):
            return with_rules(x.names, x.rules)
        if isinstance(x, meta.AxisMetadata):
            spec = x.get_partition_spec() if hasattr(x, "get_partition_spec") else None
            return spec if isinstance(spec, jax.sharding.PartitionSpec) else None
        return None

    if not jax.tree_util.tree_leaves(tree, is_leaf=is_annotated):
        raise TypeError(
            f"vj.flax.partition_specs: {type(tree).__name__} {tree!r:.80} has no array leaves, Variables or "
            "partitioning boxes; pass the annotated parameters (nnx.state(model), or Linen variables made with "
            "nn.with_partitioning / nn.with_logical_partitioning)."
        )
    return jax.tree_util.tree_map(one, tree, is_leaf=is_annotated)
