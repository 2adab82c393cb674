"""Which implementation packs and unpacks bucket buffers on the gather path: an explicit, frozen policy.

The gather path (``vj.fsdp``, ``vj.apply``, ``vj.scan_layers``, ``vj.accumulate``) takes a
:class:`KernelPolicy`; the environment is read in one place only, :meth:`KernelPolicy.from_env`, which is the
default of ``vj.fsdp(kernels=None)`` and ``vj.apply(kernels=None)`` (read when the step is built, not while it
is traced).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

import jax
import numpy as np

from vescale_jax.kernels import _fp8, _fp8_mosaic
from vescale_jax.kernels._measured import MeasuredTable, auto_implementation
from vescale_jax.kernels._ragged import BACKENDS, choose_backend, default_gpu_backend, refusal
from vescale_jax.layout._blocks import BucketBlocks
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = ["Implementation", "KernelPolicy"]

Implementation = Literal["xla", "interpret", "triton", "mosaic_gpu"]
_MODES = ("auto", "xla", "pallas")
_GPU = ("gpu", "cuda")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """How bucket buffers are packed and unpacked around the all-gather and the reduce-scatter.

    Attributes:
      mode: ``"auto"`` (default): a Pallas kernel on GPU only where ``measured`` records it faster than XLA
        for the device kind, direction, dtypes and size class; XLA's static slices and concatenate elsewhere
        (everywhere while the table is empty, as shipped). ``"xla"``: XLA's
        static slices (unpack) and one concatenate (pack). ``"pallas"``: the Pallas unpack and pack kernels,
        one launch per bucket each way.
      backend: the GPU lowering of the Pallas pack and unpack kernels, ``"mosaic_gpu"`` or ``"triton"``; None
        (default): :func:`vescale_jax.kernels.default_gpu_backend`, Mosaic GPU on JAX 0.11 and later (where
        Pallas's Triton backend is deprecated), Triton on 0.10. Both fuse every cast and scale of the hot path and
        take leaves of any size and alignment. The fused FP8 and tile kernels gather per lane, which only Triton
        lowers: under either backend they run on Triton while JAX ships it, else on XLA
        (:meth:`fused_implementation` says which, per bucket).
      interpret: ``None`` (default): the kernels follow the platform the step is *lowered* for, not the
        devices': on CPU devices each pack / unpack is a ``jax.lax.platform_dependent`` whose ``cpu`` branch
        runs the kernel in the Pallas interpreter and whose ``cuda`` branch is the compiled kernel (lowering
        keeps only the target's branch), so ``jax.export(..., platforms=["cuda"])`` of a step traced on a CPU
        machine holds the compiled kernels; on GPU devices the compiled kernels. A bucket the preferred
        ``backend`` cannot take falls back per bucket (``mosaic_gpu`` -> ``triton`` -> XLA, as
        :func:`vescale_jax.kernels.choose_backend` answers). ``True``: the interpreter on every platform.
        ``False``: an *explicit* request for the compiled ``backend``, honoured or refused, never replaced:
        every non-empty bucket runs the compiled ``backend`` kernel whatever the devices, a bucket it cannot
        take raises a ``ValueError`` naming the bucket when the step is traced, and lowering for a platform
        without compiled Pallas kernels (``cpu``) raises (:meth:`check_platform` when the step knows the
        platform: a call on CPU devices, ``step.lower(..., lowering_platforms=("cpu",))``; JAX's own
        ``ValueError`` under an outer ``jax.export`` for ``cpu``). Either way one export for several platforms
        (``platforms=["cuda", "cpu"]``) cannot hold compiled kernels: Pallas lowers each compiled call for
        every platform of the module and its CPU rule raises.
      measured: the recorded GPU results ``mode="auto"`` consults
        (:class:`vescale_jax.kernels.MeasuredTable`); None (default): the table shipped with the package.

    The interpreter's loops do not track varying mesh axes, so a policy that may interpret on the devices'
    platform turns ``shard_map``'s ``check_vma`` off (:attr:`check_vma`); HSDP's replica sums stay explicit
    either way.
    """

    mode: str = "auto"
    backend: str | None = None
    interpret: bool | None = None
    measured: MeasuredTable | None = None

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"KernelPolicy(mode={self.mode!r}); use one of {_MODES}.")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"KernelPolicy(backend={self.backend!r}); use one of {BACKENDS} or None.")
        if self.interpret not in (None, True, False):
            raise ValueError(f"KernelPolicy(interpret={self.interpret!r}); use None, True or False.")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> KernelPolicy:
        """The policy named by ``VESCALE_JAX_KERNELS`` (``auto`` | ``xla`` | ``pallas``) and
        ``VESCALE_JAX_KERNEL_BACKEND`` (``triton`` | ``mosaic_gpu``) and ``VESCALE_JAX_KERNEL_TABLE`` (a JSON
        table of measured results for ``auto``, replacing the shipped one); the library reads them nowhere
        else.

        Args:
          environ: the environment to read (default ``os.environ``).

        Returns:
          The policy; unset variables take the defaults.
        """
        environ = os.environ if environ is None else environ
        mode = environ.get("VESCALE_JAX_KERNELS", "auto")
        backend = environ.get("VESCALE_JAX_KERNEL_BACKEND") or None
        if mode not in _MODES:
            raise ValueError(f"VESCALE_JAX_KERNELS={mode!r}; use one of {_MODES} (or unset it).")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"VESCALE_JAX_KERNEL_BACKEND={backend!r}; use one of {BACKENDS} (or unset it).")
        table = environ.get("VESCALE_JAX_KERNEL_TABLE")
        measured = MeasuredTable.from_json(table) if table else None
        return cls(mode=mode, backend=backend, measured=measured)

    def interprets(self, platform: str | None = None) -> bool:
        """Whether the Pallas kernels run in the interpreter under this policy on ``platform``."""
        if self.mode != "pallas":
            return False
        if self.interpret is not None:
            return self.interpret
        return (jax.default_backend() if platform is None else platform) == "cpu"

    @property
    def check_vma(self) -> bool:
        """Whether ``shard_map`` checks varying mesh axes (off when the kernels may run interpreted)."""
        return not self.interprets()

    @property
    def explicit(self) -> bool:
        """Whether the policy asks for the compiled kernels explicitly (``mode="pallas"``, ``interpret=False``):
        refused, never replaced, where they cannot run."""
        return self.mode == "pallas" and self.interpret is False

    def lowering_platforms(self) -> tuple[str, ...]:
        """The platforms that get their own pack / unpack branch (a ``jax.lax.platform_dependent``), or one
        platform whose implementation is used whatever the step is lowered for.

        ``("cpu", "cuda")`` for ``mode="pallas"``, ``interpret=None`` on CPU devices (interpreted on CPU,
        compiled for CUDA); ``("cuda",)`` for an explicit request (compiled everywhere); else the devices'.
        """
        if self.mode == "pallas" and self.interpret is None and jax.default_backend() == "cpu":
            return ("cpu", "cuda")
        if self.explicit:
            return ("cuda",)
        return (jax.default_backend(),)

    def check_platform(self, platform: str, what: str = "vj.fsdp") -> None:
        """Raises ``ValueError`` when this policy asks explicitly for compiled kernels and ``platform`` (one the
        step is lowered for) has none: the Pallas kernels compile for GPUs only.

        Args:
          platform: a lowering platform (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``) or ``"gpu"``.
          what: the caller, for the message.
        """
        if self.explicit and platform not in _GPU:
            raise ValueError(
                f"{what}: KernelPolicy(mode='pallas', interpret=False, backend={self.backend!r}) asks for the "
                f"compiled Pallas kernels, which lower for GPU only, but the step is lowered for {platform!r}. "
                "Lower it for CUDA (step.lower(..., lowering_platforms=('cuda',)) or jax.export(..., "
                "platforms=['cuda'])), or use KernelPolicy(mode='pallas') (interpreted on CPU, compiled for CUDA) "
                "or KernelPolicy(mode='pallas', interpret=True)."
            )

    def implementation(
        self,
        layout: BucketLayout,
        src_dtype: Any,
        dst_dtype: Any,
        *,
        platform: str | None = None,
        direction: str | None = None,
        name: str = "",
    ) -> Implementation:
        """What packs or unpacks this bucket when lowered for ``platform``: ``"xla"``, ``"interpret"``,
        ``"triton"`` or ``"mosaic_gpu"``.

        ``"xla"`` under ``mode="xla"``, for an empty bucket and, under ``mode="auto"``, wherever ``measured``
        holds no record of the kernel beating XLA for this ``direction`` (``"pack"`` | ``"unpack"``; None:
        unknown, so XLA). Otherwise ``"interpret"`` where the
        policy interprets; else the compiled kernel :func:`vescale_jax.kernels.choose_backend` picks (which may
        answer ``"triton"`` for a ``mosaic_gpu`` bucket, or ``"xla"``) -- except for an :attr:`explicit` policy,
        which raises ``ValueError`` naming the bucket instead of replacing its ``backend``.

        Args:
          layout: the bucket layout.
          src_dtype: dtype read (leaves for pack, the buffer for unpack).
          dst_dtype: dtype written.
          platform: the platform lowered for (default: ``jax.default_backend()``).
          direction: ``"pack"`` or ``"unpack"`` (what ``mode="auto"`` looks up).
          name: the bucket's name, for errors.

        Returns:
          The implementation.
        """
        if self.mode == "auto" and layout.total_size:
            return auto_implementation(
                self.measured,
                layout,
                src_dtype,
                dst_dtype,
                direction=direction,
                platform=platform,
                backend=self.backend,
            )
        if self.mode != "pallas" or not layout.total_size:
            return "xla"
        if self.interprets(platform):
            return "interpret"
        platform = platform or jax.default_backend()
        if self.explicit:
            self.check_platform(platform, "vj.kernels")
            backend = self.compiled_backend
            why = refusal(layout, src_dtype, dst_dtype, backend=backend)
            if why:
                raise ValueError(
                    f"vj.kernels: {f'bucket {name!r}' if name else 'a bucket'} ({len(layout.sizes)} leaves, "
                    f"{layout.total_size} elements, "
                    f"{np.dtype(src_dtype).name} -> {np.dtype(dst_dtype).name}) cannot run the compiled "
                    f"{backend} kernel that KernelPolicy(mode='pallas', interpret=False, backend="
                    f"{self.backend!r}) asks for: {why}. Use another backend, or KernelPolicy(mode='pallas') "
                    "to let such buckets fall back."
                )
            return backend  # type: ignore[return-value]
        return choose_backend(layout, src_dtype, dst_dtype, platform=platform, backend=self.backend)

    @property
    def compiled_backend(self) -> str:
        """The compiled pack / unpack backend this policy prefers: :attr:`backend`, or this JAX's default."""
        return self.backend or default_gpu_backend()

    def fused_implementation(
        self,
        layout: BucketLayout,
        src_dtype: Any,
        dst_dtype: Any,
        *,
        platform: str | None = None,
        direction=None,
        blocks: BucketBlocks | None = None,
    ) -> Implementation:
        """What runs the fused FP8 quantize / dequantize and tile relayout kernels of this bucket when lowered for
        ``platform``: ``"xla"``, ``"interpret"``, ``"triton"`` or ``"mosaic_gpu"``.

        Mosaic GPU moves vectors of consecutive elements. It takes the tile relayout (``blocks=None``: every tile
        row is one contiguous run each side) and the FP8 kernels of a bucket whose blocks are contiguous runs
        (:func:`vescale_jax.kernels._fp8_mosaic.takes`: tile-major leaves whose tiles are the blocks' row bands,
        blocks of whole rows, exact leaves), and runs them when it is the backend the policy compiles (the default
        on JAX 0.11 and later) or when Triton is missing. Other FP8 buckets gather and scatter per lane (a block's
        scale over pieces of rows), which Pallas lowers through Triton only: they take Triton while JAX ships it
        and XLA where it does not.

        Args:
          layout: the bucket layout.
          src_dtype, dst_dtype: the dtypes read and written.
          platform: the platform lowered for (default: ``jax.default_backend()``).
          direction: ``"pack"`` or ``"unpack"`` (what ``mode="auto"`` looks up).
          blocks: for the FP8 kernels, the bucket's block index (which layouts Mosaic GPU and the band units
            take); None for the tile relayout.

        Returns:
          The implementation.
        """
        impl = self.implementation(layout, src_dtype, dst_dtype, platform=platform, direction=direction)
        size = layout.shard_size
        bands = blocks is None or _fp8.supported(blocks, size)
        if impl == "xla":
            return impl
        if impl == "interpret":
            return impl if bands else "xla"
        mosaic = not refusal(layout, src_dtype, dst_dtype, backend="mosaic_gpu")
        mosaic = mosaic and (blocks is None or _fp8_mosaic.takes(blocks, size))
        triton = bands and not refusal(layout, src_dtype, dst_dtype, backend="triton")
        if mosaic and (impl == "mosaic_gpu" or not triton):
            return "mosaic_gpu"
        return "triton" if triton else "xla"
