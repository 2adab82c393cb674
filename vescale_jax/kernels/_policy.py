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

from vescale_jax.kernels._measured import MeasuredTable, auto_implementation
from vescale_jax.kernels._ragged import BACKENDS, choose_backend
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = ["Implementation", "KernelPolicy"]

Implementation = Literal["xla", "interpret", "triton", "mosaic_gpu"]
_MODES = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class KernelPolicy:
    """How bucket buffers are packed and unpacked around the all-gather and the reduce-scatter.

    Attributes:
      mode: ``"auto"`` (default): a Pallas kernel on GPU only where ``measured`` records it faster than XLA
        for the device kind, direction, dtypes and size class; XLA's static slices and concatenate elsewhere
        (everywhere while the table is empty, as shipped). ``"xla"``: XLA's
        static slices (unpack) and one concatenate (pack). ``"pallas"``: the Pallas unpack and pack kernels,
        one launch per bucket each way (interpreted on CPU).
      backend: the GPU lowering of the Pallas kernels, ``"triton"`` (default) or ``"mosaic_gpu"``
        (plain copies with 16-byte aligned offsets and sizes; other buckets use ``"triton"``).
      interpret: run the Pallas kernels in the interpreter; None (default) interprets on CPU only.
      measured: the recorded GPU results ``mode="auto"`` consults
        (:class:`vescale_jax.kernels.MeasuredTable`); None (default): the table shipped with the package.

    The interpreter's loops do not track varying mesh axes, so a policy that interprets turns
    ``shard_map``'s ``check_vma`` off (:attr:`check_vma`); HSDP's replica sums stay explicit either way.
    """

    mode: str = "auto"
    backend: str = "triton"
    interpret: bool | None = None
    measured: MeasuredTable | None = None

    def __post_init__(self):
        if self.mode not in _MODES:
            raise ValueError(f"KernelPolicy(mode={self.mode!r}); use one of {_MODES}.")
        if self.backend not in BACKENDS:
            raise ValueError(f"KernelPolicy(backend={self.backend!r}); use one of {BACKENDS}.")
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
        backend = environ.get("VESCALE_JAX_KERNEL_BACKEND", "triton")
        if mode not in _MODES:
            raise ValueError(f"VESCALE_JAX_KERNELS={mode!r}; use one of {_MODES} (or unset it).")
        if backend not in BACKENDS:
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
        """Whether ``shard_map`` checks varying mesh axes (off when the kernels run interpreted)."""
        return not self.interprets()

    def implementation(
        self,
        layout: BucketLayout,
        src_dtype: Any,
        dst_dtype: Any,
        *,
        platform: str | None = None,
        direction: str | None = None,
    ) -> Implementation:
        """What packs or unpacks this bucket: ``"xla"``, ``"interpret"``, ``"triton"`` or ``"mosaic_gpu"``.

        ``"xla"`` under ``mode="xla"``, for an empty bucket, wherever the compiled kernel cannot take the
        bucket (:func:`vescale_jax.kernels.choose_backend` answering ``"xla"``) and, under ``mode="auto"``,
        wherever ``measured`` holds no record of the kernel beating XLA for this ``direction`` (``"pack"`` |
        ``"unpack"``; None: unknown, so XLA).
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
        return choose_backend(
            layout, src_dtype, dst_dtype, platform=platform or jax.default_backend(), backend=self.backend
        )
