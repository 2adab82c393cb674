"""Pallas kernels, each beside its plain-jnp ``*_reference`` and with an ``interpret=`` flag.

``pack`` / ``unpack`` move a bucket's tensors into and out of its flat buffer in one launch, with the hot-path
casts (and a scale on pack) fused; ``pack_tiled`` / ``unpack_tiled`` do it with the tile-major relayout of
``vj.tiles`` slots inside the kernel; ``quantize`` / ``dequantize_unpack`` are the FP8 block-scaled gather's
two ends (codes and scales from the local shard; leaves from the gathered codes and scales).
``choose_backend`` tells a caller whether to use them or the XLA reference, and :class:`KernelPolicy` is the
policy the gather path takes (``vj.fsdp(kernels=...)``); its ``auto`` mode reads the GPU results recorded in
:class:`MeasuredTable`.
"""

from vescale_jax.kernels._cross import gpu_lowering_target
from vescale_jax.kernels._fp8 import (
    dequantize_reference,
    dequantize_unpack,
    dequantize_unpack_reference,
    quantize,
    quantize_reference,
)
from vescale_jax.kernels._measured import MeasuredTable, Record, shipped_table, size_class
from vescale_jax.kernels._policy import KernelPolicy
from vescale_jax.kernels._ragged import (
    DEFAULT_CHUNK,
    Backend,
    choose_backend,
    default_gpu_backend,
    gpu_backends_available,
    pack,
    pack_reference,
    refusal,
    unpack,
    unpack_reference,
)
from vescale_jax.kernels._schedule import Schedule, Segment, pack_schedule, unpack_schedule
from vescale_jax.kernels._tiles import pack_tiled, pack_tiled_reference, unpack_tiled, unpack_tiled_reference

__all__ = [
    "DEFAULT_CHUNK",
    "Backend",
    "KernelPolicy",
    "MeasuredTable",
    "Record",
    "Schedule",
    "Segment",
    "choose_backend",
    "default_gpu_backend",
    "dequantize_reference",
    "dequantize_unpack",
    "dequantize_unpack_reference",
    "gpu_backends_available",
    "gpu_lowering_target",
    "pack",
    "pack_reference",
    "pack_schedule",
    "pack_tiled",
    "pack_tiled_reference",
    "quantize",
    "quantize_reference",
    "refusal",
    "shipped_table",
    "size_class",
    "unpack",
    "unpack_reference",
    "unpack_schedule",
    "unpack_tiled",
    "unpack_tiled_reference",
]
