"""Mixed precision for the FSDP step: which dtype is gathered and computed in, and which gradients reduce in.

The master shards stay in the plan's dtype (e.g. fp32). With ``compute_dtype=bfloat16`` each floating-point
bucket's *local shard* is cast before the all-gather, so the wire and the gathered copy are bf16; the
backward reduce-scatters the packed gradient in ``reduce_dtype`` and casts the result back to the master
dtype for the optimizer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MixedPrecision", "all_gather_cast", "reduce_scatter_cast", "vary", "varying_axes"]


def _name(dtype: Any) -> str | None:
    return None if dtype is None else np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """A mixed-precision policy for ``vj.fsdp``.

    Attributes:
      compute_dtype: dtype floating-point buckets are gathered and computed in (cast on the local shard
        before the all-gather); None keeps the master dtype.
      reduce_dtype: dtype gradients are reduce-scattered in; None means ``compute_dtype`` (or the master's).
      master_dtype: dtype of the sharded parameters and optimizer state; checked against the plan's
        floating-point buckets when given.
    """

    compute_dtype: Any = None
    reduce_dtype: Any = None
    master_dtype: Any = None

    def __post_init__(self):
        for field in ("compute_dtype", "reduce_dtype", "master_dtype"):
            try:
                value = _name(getattr(self, field))
            except TypeError:
                raise ValueError(
                    f"MixedPrecision.{field}={getattr(self, field)!r} is not a dtype; pass one such as jnp.bfloat16 "
                    "or 'bfloat16'."
                ) from None
            if value is not None and not jnp.issubdtype(np.dtype(value), jnp.floating):
                raise ValueError(
                    f"MixedPrecision.{field} must be a floating dtype, got {value}; integer buckets are never cast, "
                    "pass e.g. jnp.bfloat16."
                )
            object.__setattr__(self, field, value)

    def gather_dtype(self, dtype: Any) -> np.dtype:
        """The dtype a bucket of ``dtype`` is gathered and computed in."""
        dtype = np.dtype(dtype)
        if self.compute_dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return dtype
        return np.dtype(self.compute_dtype)

    def grad_dtype(self, dtype: Any) -> np.dtype:
        """The dtype a bucket of ``dtype`` has its gradient reduce-scattered in: ``reduce_dtype``, else
        ``compute_dtype``, else fp32 for a master narrower than 32 bits (bf16 parameters sum their per-device
        gradients in fp32 and round once, as the unsharded step does), else the master's."""
        dtype = np.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            return dtype
        if self.reduce_dtype or self.compute_dtype:
            return np.dtype(self.reduce_dtype or self.compute_dtype)
        return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


def all_gather_cast(
    local: jax.Array, axis: Any, policy: MixedPrecision | None, *, vary_axes: Any = (), widen: bool = False
) -> jax.Array:
    """``all_gather(local.astype(gather dtype), tiled)`` whose transpose reduce-scatters in the reduce dtype.

    Args:
      local: this device's ``(S,)`` shard.
      axis: the mesh axis (or axes) to gather over.
      policy: the mixed-precision policy; None gathers and reduces in ``local``'s dtype.
      vary_axes: replica axes to mark the shard varying over first (see :func:`vary`).
      widen: when the reduce dtype is wider than the gather dtype (a bf16 bucket reducing in fp32), return the
        gathered buffer upcast to the reduce dtype (exact), so its cotangent arrives unrounded (see
        :mod:`vescale_jax.widen`).

    Returns:
      The ``(m*S,)`` buffer in the gather dtype (the reduce dtype with ``widen``). Its cotangent is cast to the
      reduce dtype, reduce-scattered and cast back to ``local``'s dtype.
    """
    policy = policy or MixedPrecision()
    gather_dtype, grad_dtype = policy.gather_dtype(local.dtype), policy.grad_dtype(local.dtype)
    if not vary_axes and gather_dtype == local.dtype == grad_dtype:
        return jax.lax.all_gather(local, axis, tiled=True)
    out_dtype = grad_dtype if widen and grad_dtype.itemsize > gather_dtype.itemsize else gather_dtype
    return _gather(local, axis, policy, tuple(vary_axes), out_dtype)


def _gather(local, axis, policy, vary_axes, out_dtype):
    gather_dtype, grad_dtype = policy.gather_dtype(local.dtype), policy.grad_dtype(local.dtype)

    @jax.custom_vjp
    def gather(x):
        full = jax.lax.all_gather(vary(x, vary_axes).astype(gather_dtype), axis, tiled=True)
        return full.astype(out_dtype)

    def fwd(x):
        return gather(x), None

    def bwd(_, ct):
        return (reduce_scatter_cast(ct.astype(grad_dtype), axis, None, local.dtype, like=local),)

    gather.defvjp(fwd, bwd)
    return gather(local)


def varying_axes(x: Any) -> frozenset[str]:
    """Mesh axes ``x`` varies over inside ``shard_map`` (empty outside, or when the check is off)."""
    t = jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    return frozenset(getattr(t, "vma", None) or (mat.varying if mat is not None else ()))


def vary(x: jax.Array, axes: Any) -> jax.Array:
    """Marks ``x`` as varying over ``axes`` (``lax.pcast``) where it does not already.

    HSDP gathers each shard within its replica and computes on that replica's batch: marking the local shard as
    varying over the replica axes *before* the all-gather keeps the per-replica computation varying, so the
    gradient's sum over replicas is left to :func:`reduce_scatter_cast`, on the shard after the reduce-scatter,
    instead of being inserted by autodiff on every full-size gathered leaf.
    """
    axes = tuple(a for a in axes if a not in varying_axes(x))
    if not axes or not varying_axes(x):  # outside shard_map, or with the varying-axes check off
        return x
    return jax.lax.pcast(x, axes, to="varying")


def reduce_scatter_cast(
    packed: jax.Array, axis: Any, policy: MixedPrecision | None, master: Any, *, like: Any = None
) -> jax.Array:
    """Reduce-scatters a packed gradient in the policy's reduce dtype; the result is in the ``master`` dtype.

    With ``like`` (the local shard the gradient is for), the result is also summed over every mesh axis the
    gradient varies over but the shard does not: the replica axes of HSDP, where each replica saw other data.
    That all-reduce runs on the shard, after the reduce-scatter.
    """
    packed = packed.astype((policy or MixedPrecision()).grad_dtype(master))
    out = jax.lax.psum_scatter(packed, axis, tiled=True)
    if like is not None:
        extra = varying_axes(out) - varying_axes(like)
        if extra:
            out = jax.lax.psum(out, tuple(sorted(extra)))
    return out.astype(master)
