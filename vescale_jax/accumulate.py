"""Gradient accumulation over micro-batches inside one ``vj.fsdp`` step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["accumulate"]


def accumulate(
    fun: Callable[..., Any], params: Any, batch: Any, *, has_aux: bool = False
) -> tuple[Any, Any]:
    """``jax.value_and_grad(fun)(params, micro_batch)`` averaged over the leading micro-batch dim of ``batch``.

    Use it inside a step compiled with ``vj.fsdp(..., microbatches=k)``, which hands the step a batch whose
    leaves have shape ``(k, b, ...)`` with dim 1 split over the data axes. A ``lax.scan`` runs one forward and
    backward per micro-batch and sums the gradients, so ``k`` micro-batches of ``b`` give the step of one
    batch of ``k·b`` (for a loss that is a mean over the batch).

    Args:
      fun: ``(params, micro_batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      params: the parameters (a ``ShardedParams`` under ``vj.fsdp``).
      batch: leaves with a leading micro-batch dim.
      has_aux: whether ``fun`` returns ``(loss, aux)``; aux comes back stacked over micro-batches.

    Returns:
      ``(loss, grads)`` or ``((loss, aux), grads)``, loss and grads averaged over the micro-batches.

    Sharding:
      Each micro-batch's backward reduce-scatters its gradient into the local shard (one reduce-scatter per
      bucket and micro-batch), so the accumulator is shard-sized: memory stays that of one micro-batch.
    """
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("vj.accumulate: the batch has no arrays.")
    k = leaves[0].shape[0]
    for x in leaves:
        if x.ndim < 2 or x.shape[0] != k:
            raise ValueError(
                f"vj.accumulate: every batch leaf needs a leading micro-batch dim of {k} and a batch dim, got "
                f"shape {x.shape}; compile the step with vj.fsdp(..., microbatches={k})."
            )
    grad_fn = jax.value_and_grad(fun, has_aux=has_aux)

    def body(carry, micro_batch):
        loss_sum, grad_sum = carry
        value, grads = grad_fn(params, micro_batch)
        loss, aux = value if has_aux else (value, None)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), aux

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss_sum, grad_sum), aux = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), batch)
    loss = loss_sum / k
    grads = jax.tree.map(lambda g: (g / k).astype(g.dtype), grad_sum)
    return ((loss, aux) if has_aux else loss), grads
