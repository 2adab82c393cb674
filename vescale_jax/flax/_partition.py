"""``vj.flax.partition_specs``: the ``tp=`` argument of ``vj.plan`` from Flax's partitioning annotations."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["partition_specs"]


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
