"""The pytrees of sharded state: ``ShardedParams`` (one flat buffer per bucket), ``GatheredParams``, ``PerDevice``.

Each carries its :class:`~vescale_jax.Plan` as static aux data, so the plan travels with the data through
``jax.jit``, Optax and checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from vescale_jax.layout._plan import Plan
from vescale_jax.state._guards import check_children, check_eager_norm, check_per_leaf_transform

__all__ = ["GatheredParams", "PerDevice", "ShardedParams"]


class _Buffers:
    """One array per bucket of a plan, as pytree children; the plan is the static aux data."""

    __slots__ = ("buffers", "plan")

    def __init__(self, buffers: Sequence[Any], plan: Plan):
        self.buffers = tuple(buffers)
        self.plan = plan

    def tree_flatten(self):
        check_per_leaf_transform(self.plan)  # optax.lamb & co. mapping over the buckets raise before computing
        check_eager_norm(self.buffers, self.plan)  # optax.global_norm outside jax.set_mesh, where JAX cannot
        return self.buffers, self.plan

    @classmethod
    def tree_unflatten(cls, plan, buffers):
        check_children(plan, buffers, kind=cls.__name__)  # a per-leaf mask/label (or Orbax) over the buckets raises
        return cls(buffers, plan)


@jax.tree_util.register_pytree_node_class
class ShardedParams(_Buffers):
    """A parameter tree stored as one flat buffer per bucket of a :class:`Plan`.

    A pytree whose children are the bucket buffers (so ``optax`` transforms, ``jax.tree.map`` and
    ``jax.jit`` see flat arrays) and whose static aux data is the plan.

    Attributes:
      buffers: one array per bucket, of shape ``bucket.shape`` (``bucket.local_shape`` inside shard_map).
      plan: the :class:`Plan`.

    Sharding:
      Outside ``shard_map`` each buffer is a global array with the plan's ``NamedSharding``; inside, each
      device sees its local ``(S,)`` (or ``(L, S)``) shard.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        shapes = ", ".join(
            f"{b.name}{tuple(getattr(x, 'shape', ()))}" for b, x in zip(self.plan.buckets, self.buffers, strict=True)
        )
        return f"ShardedParams({shapes})"


@jax.tree_util.register_pytree_node_class
class GatheredParams(_Buffers):
    """Every device's full copy of each bucket, for steps that hold the gathered model (``reduce="once"``).

    Attributes:
      buffers: one array per bucket of shape ``(m * total_size,)`` (``(L, m * total_size)`` stacked) with the
        plan's partition spec, so each device's local block is the whole ``(total_size,)`` bucket.
      plan: the :class:`Plan`.
    """

    __slots__ = ()


@jax.tree_util.register_pytree_node_class
class PerDevice:
    """Optimizer state kept per device (e.g. Shampoo's block statistics): an array whose dim 0 is
    ``m * B``, device ``k`` holding rows ``[k*B, (k+1)*B)``.

    Attributes:
      value: the array (a pytree child).
      plan: the :class:`Plan` (static aux data) whose axis dim 0 is sharded over.
      layout: ``None`` or a hashable description of what the rows hold (static aux data, e.g.
        :class:`vescale_jax.optim._state_layouts.BlockLayout`), with ``to_logical(value)``, ``logical_shapes()`` and
        ``from_logical(arrays)``: a view whose keys and shapes do not depend on the plan, so the state can be
        checkpointed under one plan and re-placed under another.

    Sharding:
      ``PartitionSpec(axes)`` on dim 0 (:attr:`axes`: the plan's axis, or the layout's axes for state that differs
      per tensor / expert group); :func:`vescale_jax.init_opt_state` places it so.
    """

    __slots__ = ("layout", "plan", "value")

    def __init__(self, value: Any, plan: Plan, layout: Any = None):
        self.value = value
        self.plan = plan
        self.layout = layout

    def tree_flatten(self):
        return (self.value,), (self.plan, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def axes(self) -> Any:
        """The mesh axes dim 0 is sharded over: ``layout.axes`` where the layout has them (rows that differ per
        tensor / expert group, e.g. Shampoo's blocks under a plan with ``tp``: the group axes, then the plan's
        axis), else the plan's axis."""
        return getattr(self.layout, "axes", None) or self.plan.axis

    def replace(self, value: Any) -> PerDevice:
        """The same plan and layout around another value (e.g. a sharding or a ``ShapeDtypeStruct``)."""
        return PerDevice(value, self.plan, self.layout)

    def __repr__(self) -> str:
        return f"PerDevice{tuple(getattr(self.value, 'shape', ()))}"
