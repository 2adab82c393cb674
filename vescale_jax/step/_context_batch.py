"""The batch and outputs of ``vj.apply`` under a context axis: which leaves carry the sequence, in what order.

Under context parallelism (``vj.fsdp(..., context_axis=...)``) the model runs on each device's tokens: the batch's
dim 0 is split over the data axes as always and its dim 1, the sequence, over the context axis. The rule for which
leaves carry the sequence is one and simple: the sequence length ``L`` is dim 1 of the first batch leaf with two or
more dims, and every batch leaf with two or more dims has dim 1 equal to ``L`` and has it split; a leaf of one dim
(a per-example label, weight or document count) is split on dim 0 only, the same on every device of the context
axis. A leaf of two or more dims whose dim 1 is not ``L`` is refused, naming it.

The step's own arrays stay in the global token order: ``vj.apply`` puts dim 1 of each sequence leaf in the order
the devices hold it (:func:`vescale_jax.step._context.sequence_order`, the causal load balance) on the global
array right before the ``shard_map``, and puts per-token outputs back in the global order right after it. So
``batch["tokens"][:, :-1]`` written in the step, a loss computed outside the model on its logits, and the
checkpoints mean what they mean without a context axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from vescale_jax.step._context import Context, sequence_order

__all__ = ["ContextBatch", "context_batch"]


class ContextBatch:
    """The sequence of one ``vj.apply`` call under a context axis.

    Attributes:
      ctx: the context axis.
      length: the global sequence length ``L``.
      local: each device's number of tokens ``L / cp``.
      order: :func:`sequence_order` of ``L`` (device order -> global position).
      inverse: its inverse permutation (global position -> index in device order).
    """

    def __init__(self, ctx: Context, length: int):
        ctx.check_length(length)
        self.ctx, self.length, self.local = ctx, length, length // ctx.size
        self.order = sequence_order(length, ctx)
        self.inverse = np.argsort(self.order)
        self._identity = bool(np.all(self.order == np.arange(length)))

    def carries(self, leaf: Any) -> bool:
        """Whether a batch leaf carries the sequence (two or more dims)."""
        return np.ndim(leaf) >= 2

    def spec(self, axes: tuple[str, ...]) -> P:
        """The ``PartitionSpec`` of a sequence leaf: dim 0 over ``axes``, dim 1 over the context axis."""
        return P(axes, self.ctx.axis)

    def to_devices(self, x: jax.Array) -> jax.Array:
        """A global sequence leaf with dim 1 in the order the devices hold it."""
        return x if self._identity else jnp.take(jnp.asarray(x), self.order, axis=1)

    def to_global(self, x: jax.Array, mesh: jax.sharding.Mesh | None = None) -> jax.Array:
        """A per-token output (dim 1 in the devices' order) with dim 1 back in the global order (on ``mesh``'s
        Explicit axes first resharded to dim 0's split alone, as the gather needs)."""
        if self._identity:
            return x
        if mesh is not None and any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
            spec = tuple(getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ())
            x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, P(spec[0] if spec else None)))
        return jnp.take(x, self.inverse, axis=1)


def _sequence_length(trees: Sequence[Any]) -> int | None:
    for tree in trees:
        for leaf in jax.tree.leaves(tree):
            if np.ndim(leaf) >= 2:
                return int(np.shape(leaf)[1])
    return None


def context_batch(ctx: Context, args: Sequence[Any], kwargs_split: dict[str, Any]) -> ContextBatch | None:
    """The :class:`ContextBatch` of a call's batch (positional ``args``, then the keyword arrays split with the
    batch), checked: every leaf of two or more dims has dim 1 equal to the sequence length, a multiple of the
    context's chunks.

    Returns:
      ``None`` when no batch leaf has a sequence dim (then nothing is split over the context axis).

    Raises:
      ValueError: naming the leaf, its shape, the sequence length and the fix.
    """
    length = _sequence_length([*args, *kwargs_split.values()])
    if length is None:
        return None
    named = [(f"vj.apply argument {i}", a) for i, a in enumerate(args)]
    named += [(f"vj.apply keyword argument {k}", v) for k, v in kwargs_split.items()]
    for what, tree in named:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            shape = tuple(np.shape(leaf))
            if len(shape) >= 2 and shape[1] != length:
                raise ValueError(
                    f"vj.fsdp: {what}{jax.tree_util.keystr(path)} has shape {shape}, but under the context axis "
                    f"{ctx.axis!r} every batch leaf of two or more dims has dim 1 as the sequence (length {length}, "
                    "from the first such leaf) split over it. Give it the sequence as dim 1 ((B, L, ...): per-token "
                    "values), or close over it in the model function to pass it whole to every device."
                )
    return ContextBatch(ctx, length)
