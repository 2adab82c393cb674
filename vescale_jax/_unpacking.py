"""Unpacking a gathered bucket on the hot path: XLA's static slices or the Pallas kernel, same results.

``unpack_gathered`` is what the gather path (``gather_bucket``, ``scan_layers``) calls on a gathered buffer.
It reads ``VESCALE_JAX_KERNELS``:

* ``auto`` (default): the implementation measured faster on this platform. XLA's static slices everywhere
  until a GPU measurement shows the kernel ahead (``benchmarks/kernels.py``; see ``docs/kernels.md``).
* ``xla``: static slices and reshapes (the transpose is XLA's pad-and-add).
* ``pallas``: the Pallas unpack kernel (compiled on GPU with ``VESCALE_JAX_KERNEL_BACKEND``'s lowering,
  interpreted on CPU), whose custom VJP packs the leaves' cotangents with the Pallas pack kernel, padding
  zero — one launch each way per bucket.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax

from vescale_jax import kernels
from vescale_jax._buffer import unpack_layout
from vescale_jax._planner import BucketLayout

__all__ = ["kernel_mode", "unpack_gathered"]

_MODES = ("auto", "xla", "pallas")


def kernel_mode() -> str:
    """``VESCALE_JAX_KERNELS`` (``auto`` | ``xla`` | ``pallas``), checked."""
    mode = os.environ.get("VESCALE_JAX_KERNELS", "auto")
    if mode not in _MODES:
        raise ValueError(f"VESCALE_JAX_KERNELS={mode!r}; use one of {_MODES}.")
    return mode


def _use_kernel(layout: BucketLayout, dtype) -> str | None:
    """The Pallas lowering to use for this bucket, or None for XLA's slices."""
    mode = kernel_mode()
    if mode == "xla" or not layout.total_size:
        return None
    if mode == "auto":
        # No GPU measurement has shown the kernel ahead of XLA's fused slices yet: stay on XLA.
        return None
    if jax.default_backend() == "cpu":
        return "interpret"
    backend = os.environ.get("VESCALE_JAX_KERNEL_BACKEND", "triton")
    chosen = kernels.choose_backend(layout, dtype, dtype, platform="gpu")
    return chosen if chosen != "xla" else backend


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _kernel_unpack(full, layout, shapes, how):
    interpret = how == "interpret"
    return kernels.unpack(full, layout, shapes, interpret=interpret, backend=None if interpret else how)


def _kernel_unpack_fwd(full, layout, shapes, how):
    return _kernel_unpack(full, layout, shapes, how), None


def _kernel_unpack_bwd(layout, shapes, how, _, cts):
    interpret = how == "interpret"
    return (kernels.pack(list(cts), layout, interpret=interpret, backend=None if interpret else how),)


_kernel_unpack.defvjp(_kernel_unpack_fwd, _kernel_unpack_bwd)


def unpack_gathered(full: jax.Array, layout: BucketLayout, shapes: Sequence[tuple[int, ...]]) -> list[jax.Array]:
    """A gathered ``(m*S,)`` buffer's leaves, in slot order, with the given shapes.

    Args:
      full: the gathered buffer.
      layout: its bucket layout.
      shapes: each slot's shape (per-layer shapes for a stacked bucket).

    Returns:
      One array per slot; its gradient is the packed buffer of the leaves' cotangents (padding zero).
    """
    shapes = tuple(tuple(s) for s in shapes)
    how = _use_kernel(layout, full.dtype)
    if how is None:
        return unpack_layout(full, layout, shapes)
    return list(_kernel_unpack(full, layout, shapes, how))
