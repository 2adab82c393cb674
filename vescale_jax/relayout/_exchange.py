"""Moving many ragged tensors between two flat per-device buffers at once (inside ``shard_map``).

Each tensor (of ``L`` layers) is placed by a :class:`~vescale_jax.RaggedShard` on each side, at per-device, per-layer
offsets of the two buffers. The placements become one :class:`~vescale_jax.relayout._moves.Moves`
(:func:`plan`), run by the engine's collective-permute rounds
(:func:`vescale_jax.relayout._execute.permute_rounds`): every device sends to at most one device and receives from at
most one per round, each message sized by the round's heaviest pair, where a padded all-to-all would size every
message by the largest overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax.layout._ragged import RaggedShard
from vescale_jax.relayout._execute import permute_rounds
from vescale_jax.relayout._moves import Moves, Placement, plan_moves

__all__ = ["exchange", "plan"]


def plan(
    moves: Sequence[tuple[RaggedShard, RaggedShard]],
    src_at: Sequence[np.ndarray],
    out_at: Sequence[np.ndarray],
    m: int,
) -> Moves:
    """The runs of :func:`exchange`: tensor ``e``'s layers numbered one after another on both sides."""
    sources, targets, key = [], [], 0
    for (a, b), at_a, at_b in zip(moves, src_at, out_at, strict=True):
        if a.size != b.size or a.num_devices != m or b.num_devices != m:
            raise ValueError(f"exchange: {a} and {b} do not describe the same tensor on the axis' {m} devices.")
        sources.append(Placement.ragged(a, at_a, key=key))
        targets.append(Placement.ragged(b, at_b, key=key))
        key += np.asarray(at_a).reshape(a.num_devices, -1).shape[1]
    return plan_moves(Placement.concat(sources, m), Placement.concat(targets, m))


def exchange(
    src: jax.Array,
    src_at: Sequence[np.ndarray],
    out: jax.Array,
    out_at: Sequence[np.ndarray],
    moves: Sequence[tuple[RaggedShard, RaggedShard]],
    axis: Any,
    m: int,
) -> jax.Array:
    """Moves many ragged tensors at once between two flat local buffers (inside ``shard_map``).

    Tensor ``e`` has ``L_e`` layers, each placed by ``moves[e][0]`` in ``src`` (device ``k``'s piece of layer
    ``l`` at ``src[src_at[e][k, l]:]``) and wanted as placed by ``moves[e][1]`` in ``out`` (at ``out_at[e][k, l]``).
    Pieces are read from ``src`` and written into ``out`` in place by collective-permute rounds (see
    :func:`vescale_jax.relayout._execute.permute_rounds`).

    Returns:
      ``out`` with every tensor's elements at their places.
    """
    return permute_rounds(src, out, plan(moves, src_at, out_at, m), axis=axis)
