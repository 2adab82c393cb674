"""Mixed precision for the FSDP step: which dtype is gathered and computed in, and which gradients reduce in.

The master shards stay in the plan's dtype (e.g. fp32). With ``compute_dtype=bfloat16`` each floating-point
bucket's *local shard* is cast before the all-gather, so the wire and the gathered copy are bf16; the
backward reduce-scatters the packed gradient in ``reduce_dtype`` and casts the result back to the master
dtype for the optimizer. This module is the policy only; the casts happen on the gather path
(:mod:`vescale_jax.step._wire`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["MixedPrecision"]


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
      fp8_gather: ``(bh, bw)``: gather floating buckets as ``float8_e4m3fn`` codes with one fp32 scale per
        ``bh × bw`` tile of every matrix (vectors exactly), dequantized to ``compute_dtype`` on arrival; the
        gradient is reduce-scattered in ``reduce_dtype`` as without it (straight-through). Each device
        quantizes the tiles it owns, so the plan must keep every tile whole on one device: plan matrices with
        ``vj.tiles(bh, bw)`` (or ``vj.rows(bh)``). ``None`` (default): no quantization.
    """

    compute_dtype: Any = None
    reduce_dtype: Any = None
    master_dtype: Any = None
    fp8_gather: tuple[int, int] | None = None

    def __post_init__(self):
        if self.fp8_gather is not None:
            block = self.fp8_gather
            if (
                not isinstance(block, (tuple, list))
                or len(block) != 2
                or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in block)
            ):
                raise ValueError(
                    f"MixedPrecision.fp8_gather={block!r}: pass a tile (bh, bw) of positive ints, e.g. (128, 128), "
                    "or None."
                )
            object.__setattr__(self, "fp8_gather", (int(block[0]), int(block[1])))
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

    def fp8_block(self, dtype: Any) -> tuple[int, int] | None:
        """The FP8 tile a bucket of ``dtype`` is gathered in (None: not quantized; integer buckets never are)."""
        return self.fp8_gather if jnp.issubdtype(np.dtype(dtype), jnp.floating) else None

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
