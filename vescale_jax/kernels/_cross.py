"""Lowering the compiled kernels for a GPU from a process that has none (``jax.export``, CUDA lowering on CPU)."""

from __future__ import annotations

import contextlib

from vescale_jax._compat import TRITON_CROSS_TARGET, triton_lowering_target

__all__ = ["gpu_lowering_target"]


def gpu_lowering_target(device_kind: str = TRITON_CROSS_TARGET) -> contextlib.AbstractContextManager[None]:
    """A context in which compiled Triton kernels lower for CUDA as for a GPU of ``device_kind`` where the process
    has no GPU (a no-op where it has one).

    Lowering a Triton kernel needs the target's compute capability. With a GPU in the process, JAX reads it off the
    device; without one (a step exported for CUDA on a CPU machine) JAX <= 0.10 assumes 9.0 and JAX >= 0.11
    refuses (``No supported GPU devices found``). Wrap the lowering in this context::

        with vj.kernels.gpu_lowering_target("NVIDIA H200"):
            exported = jax.export.export(jax.jit(step), platforms=["cuda"])(*args)

    Mosaic GPU kernels and XLA's pack and unpack need no target.

    Args:
      device_kind: a device kind JAX's Triton lowering knows (``"NVIDIA H100"``, ``"NVIDIA H200"``, ``"NVIDIA
        B200"``, ...); the default, compute capability 9.0, is what JAX <= 0.10 assumes and the only one it
        accepts.

    Returns:
      A context manager; only the lowering inside it reads the target.

    Raises:
      ValueError: an unknown ``device_kind`` (the message lists the known ones), or on JAX <= 0.10 another than
        the default.
    """
    return triton_lowering_target(device_kind)
