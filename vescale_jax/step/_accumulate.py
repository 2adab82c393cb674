"""Gradient accumulation over micro-batches inside one ``vj.fsdp`` step."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.kernels import KernelPolicy
from vescale_jax.state._sharded import GatheredParams, ShardedParams
from vescale_jax.step import _wire_copies as copies_wire
from vescale_jax.step._policy import StepPolicy, enclosing_policy, running
from vescale_jax.step._wire import Gather

__all__ = ["accumulate"]


def accumulate(
    fun: Callable[..., Any], params: Any, batch: Any, *, has_aux: bool = False, reduce: str = "each"
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
      reduce: ``"each"`` (default): every micro-batch's backward reduce-scatters its gradient, the accumulator
        is shard-sized. ``"once"``: every bucket is all-gathered once per step into a full per-device copy,
        the micro-batches accumulate unreduced full-size gradients, and each bucket is reduce-scattered once
        at the end — one all-gather and one reduce-scatter per bucket and step, for the memory of the whole
        model and its gradient on every device.

    Returns:
      ``(loss, grads)`` or ``((loss, aux), grads)``, loss and grads averaged over the micro-batches. The
      gradients are summed in the reduce dtype (fp32 for a bf16 / fp16 bucket unless a ``vj.MixedPrecision``
      says otherwise, :meth:`vj.MixedPrecision.grad_dtype`) or the bucket's own where that is wider, and rounded
      to the bucket's dtype once, after the mean: a low-precision leaf gets the gradient of one batch of
      ``k·b``, not a sum of ``k`` rounded ones.

    Sharding:
      ``"each"``: one reduce-scatter per bucket and micro-batch, shard-sized accumulator. ``"once"``: one
      all-gather and one reduce-scatter per bucket per step, full-size copies and accumulator.
    """
    if reduce not in ("each", "once"):
        raise ValueError(f"vj.accumulate: reduce={reduce!r}; use 'each' or 'once'.")
    k = _micro_count(batch)
    grad_fn = jax.value_and_grad(fun, has_aux=has_aux)
    reduced = params
    scope = contextlib.nullcontext()
    if reduce == "once":
        params = gather_copies(params)
    elif isinstance(params, ShardedParams):
        params, scope = _wide_shards(params)

    def body(carry, micro_batch):
        loss_sum, grad_sum = carry
        value, grads = grad_fn(params, micro_batch)
        loss, aux = value if has_aux else (value, None)
        return (loss_sum + loss, jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_sum, grads)), aux

    if reduce == "once":  # accumulate unreduced gradients in the reduce dtype
        mixed = _step_wire(params.plan).policy
        zeros = GatheredParams(
            [
                jnp.zeros_like(x, dtype=mixed.grad_dtype(b.dtype))
                for x, b in zip(params.buffers, reduced.buffers, strict=True)
            ],
            params.plan,
        )
    else:
        zeros = jax.tree.map(jnp.zeros_like, params)
    with scope:
        (loss_sum, grad_sum), aux = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), batch)
    loss = loss_sum / k
    if reduce == "once":
        grad_sum = reduce_copies(grad_sum, reduced)
    grads = jax.tree.map(lambda g, p: (g / k).astype(p.dtype), grad_sum, reduced)
    return ((loss, aux) if has_aux else loss), grads


def _wide_shards(params: ShardedParams) -> tuple[ShardedParams, Any]:
    """``params`` with each low-precision buffer upcast (exactly) to its reduce dtype where that is wider, and
    the policy scope in which the wire returns those buckets' gradients in it, unrounded
    (:attr:`vescale_jax.step._wire.Gather.wide_grads`). Unchanged, and no scope, without such a bucket."""
    plan = params.plan
    outer = enclosing_policy() or StepPolicy.for_plan(plan, kernels=KernelPolicy.from_env())
    policy = dataclasses.replace(outer, wide_grads=True)
    how = policy.wire()
    dtypes = [how.grad_out_dtype(b.dtype) for b in plan.buckets]
    if all(d == np.dtype(b.dtype) for d, b in zip(dtypes, plan.buckets, strict=True)):
        return params, contextlib.nullcontext()
    buffers = [x if x.dtype == d else x.astype(d) for x, d in zip(params.buffers, dtypes, strict=True)]
    return ShardedParams(buffers, plan), running(policy)


def _micro_count(batch: Any) -> int:
    """The leading micro-batch count ``k`` shared by every batch leaf (checked against ``vj.fsdp(microbatches=)``)."""
    flat = jax.tree_util.tree_flatten_with_path(batch)[0]
    if not flat:
        raise ValueError(f"vj.accumulate: the batch has no arrays (got {type(batch).__name__}); pass the step's batch.")
    policy = enclosing_policy()
    expected = None if policy is None else policy.microbatches
    if policy is not None and expected is None:
        raise ValueError(
            "vj.accumulate: the enclosing vj.fsdp step was compiled without microbatches=, so the batch has no "
            "micro-batch dim; compile it with vj.fsdp(step, microbatches=k)."
        )
    first_path, first = flat[0]
    k = expected if expected is not None else (np.shape(first)[0] if np.ndim(first) else 0)
    for path, x in flat:
        shape, name = tuple(np.shape(x)), jax.tree_util.keystr(path) or "<root>"
        if len(shape) < 2 or shape[0] != k or k < 1:
            raise ValueError(
                f"vj.accumulate: batch leaf {name} has shape {shape}; every leaf needs a leading micro-batch dim of "
                f"{k} (from {'vj.fsdp(microbatches=)' if expected else jax.tree_util.keystr(first_path) or '<root>'}) "
                "and a batch dim. Compile the step with vj.fsdp(..., microbatches=k) (it splits the batch), or "
                "reshape leaves to (k, batch // k, ...)."
            )
    return k


def _step_wire(plan: Any) -> Gather:
    """The wire of the enclosing ``vj.fsdp``'s policy (precision, kernels; outside a step the defaults, kernels
    from the environment); HSDP is not supported here."""
    policy = enclosing_policy()
    if policy is not None and policy.replica_axes:
        raise ValueError("vj.accumulate(reduce='once') does not support HSDP replica axes; use reduce='each'.")
    if policy is None:
        policy = StepPolicy.for_plan(plan, kernels=KernelPolicy.from_env())
    return policy.wire()


def _on_devices(fn: Callable[..., Any], plan: Any, how: Gather) -> Callable[..., Any]:
    """``fn(buffers)`` under ``shard_map`` over the plan's mesh, every buffer with its bucket's spec."""
    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    return jax.shard_map(fn, mesh=plan.mesh, in_specs=(specs,), out_specs=specs, check_vma=how.kernels.check_vma)


def gather_copies(params: ShardedParams) -> GatheredParams:
    """All-gathers every bucket once into a full copy on each device (in the policy's compute dtype)."""
    if not isinstance(params, ShardedParams):
        raise TypeError(f"vj.accumulate(reduce='once'): params must be a vj.ShardedParams, got {type(params)}.")
    plan = params.plan
    how = _step_wire(plan)
    copies = _on_devices(lambda bufs: copies_wire.gather_copies(bufs, plan, how), plan, how)(params.buffers)
    return GatheredParams(copies, plan)


def reduce_copies(grads: GatheredParams, like: ShardedParams) -> ShardedParams:
    """Reduce-scatters full per-device gradients into the plan's shards (in the policy's reduce dtype)."""
    plan = like.plan
    how = _step_wire(plan)
    return ShardedParams(
        _on_devices(lambda gs: copies_wire.reduce_copies(gs, plan, how), plan, how)(grads.buffers), plan
    )
