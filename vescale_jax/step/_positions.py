"""``vj.positions``: the global positions of the tokens a model holds (for RoPE and learned position tables).

Inside a ``vj.fsdp`` step with a context axis the model sees only this device's tokens, in the order of
:func:`vescale_jax.step._context.sequence_order`; position-dependent layers must use the tokens' global positions,
not ``jnp.arange`` of the local length.
"""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.step._context import enclosing_context, local_positions, sequence_order

__all__ = ["positions"]


def positions(length_or_x: int | Any, *, axis: int = 1, segment_ids: Any = None) -> jax.Array:
    """The global positions of the tokens of a sequence dim, as the model holds them.

    Args:
      length_or_x: an array whose dim ``axis`` is the sequence dim (e.g. token ids ``(B, T)`` or activations
        ``(B, T, D)``), or that dim's length as the model sees it (the local length inside a step).
      axis: the sequence dim of ``length_or_x`` when it is an array (default 1, after the batch dim).
      segment_ids: optional int ids ``(B, T)`` of packed documents (the same ids as ``vj.attention``'s, local
        inside a step): positions then count from the start of each token's document (a new document starts
        where the id changes).

    Returns:
      An int32 array of shape ``(T,)``: ``jnp.arange(T)`` outside a step with a context axis; inside one, the
      global positions of this device's ``T`` local tokens in their local order (with causal balancing, the two
      chunks ``i`` and ``2 * cp - 1 - i`` of the ``2 * cp`` chunks of the sequence on device ``i``). With
      ``segment_ids``: int32 ``(B, T)``, each token's position within its document.

    Sharding:
      Inside a context step the result varies over the context axis (it is derived from ``lax.axis_index``); use
      it like any per-device value, e.g. ``table[vj.positions(tokens)]`` or the angles of a rotary embedding.
    """
    if isinstance(length_or_x, (int, np.integer)):
        length = operator.index(length_or_x)
    else:
        shape = jnp.shape(length_or_x)
        if not shape:
            raise ValueError(
                "vj.positions: length_or_x is a scalar array of shape (): pass the sequence length as a Python int, "
                "or an array whose dim `axis` is the sequence dim."
            )
        if not -len(shape) <= axis < len(shape):
            raise ValueError(
                f"vj.positions: axis={axis} is out of range for length_or_x of shape {tuple(shape)}: pass the index "
                "of the sequence dim (axis=1 for (batch, sequence, ...) arrays)."
            )
        length = int(shape[axis])
    if length < 0:
        raise ValueError(f"vj.positions: length {length} is negative: pass the sequence length (>= 0).")
    ctx = enclosing_context()
    if ctx is None or ctx.size == 1:
        pos = jnp.arange(length, dtype=jnp.int32)
    else:
        pos = local_positions(length, ctx)
    if segment_ids is None:
        return pos
    ids = jnp.asarray(segment_ids)
    if ids.ndim != 2 or ids.shape[1] != length:
        raise ValueError(
            f"vj.positions: segment_ids of shape {ids.shape} do not match the sequence length {length}: pass one id "
            f"per token, shape (batch, {length}) (the local ids inside a step)."
        )
    if ctx is not None and ctx.size > 1:
        # The whole sequences' ids in natural order: a document may start on another device.
        ids = jax.lax.all_gather(ids, ctx.axis, axis=1, tiled=True)
        ids = ids[:, np.argsort(sequence_order(ids.shape[1], ctx))]
    index = jnp.arange(ids.shape[1], dtype=jnp.int32)
    starts = jnp.concatenate([jnp.ones_like(ids[:, :1], dtype=bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)  # the start of each token's document
    return (pos[None, :] - jnp.take(start, pos, axis=1)).astype(jnp.int32)
