"""Pallas kernels, each beside its plain-jnp ``*_reference`` and with an ``interpret=`` flag.

``pack`` / ``unpack`` move a bucket's tensors into and out of its flat buffer in one launch, with the hot-path
casts (and a scale on pack) fused; ``choose_backend`` tells a caller whether to use them or the XLA reference, and
:class:`KernelPolicy` is the policy the gather path takes (``vj.fsdp(kernels=...)``).
"""

from vescale_jax.kernels._policy import KernelPolicy
from vescale_jax.kernels._ragged import (
    DEFAULT_CHUNK,
    Backend,
    choose_backend,
    gpu_backends_available,
    pack,
    pack_reference,
    refusal,
    unpack,
    unpack_reference,
)
from vescale_jax.kernels._schedule import Schedule, Segment, pack_schedule, unpack_schedule

__all__ = [
    "DEFAULT_CHUNK",
    "Backend",
    "KernelPolicy",
    "Schedule",
    "Segment",
    "choose_backend",
    "gpu_backends_available",
    "pack",
    "pack_reference",
    "pack_schedule",
    "refusal",
    "unpack",
    "unpack_reference",
    "unpack_schedule",
]
