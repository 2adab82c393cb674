"""What a recorded GPU run showed: is a Pallas kernel faster than XLA for this pack or unpack?

``KernelPolicy(mode="auto")`` picks a Pallas kernel only where :class:`MeasuredTable` holds a record of it
beating XLA's own slices / concatenate on the same device kind, direction, dtype pair and size class, by at
least :data:`MIN_SPEEDUP`; with no such record it answers XLA. The table shipped with the package
(``vescale_jax/kernels/_measured.json``) is written by ``benchmarks/kernels.py --json`` from a GPU run and
is plain JSON::

    {"format": 1,
     "records": [{"device_kind": "NVIDIA H200", "backend": "triton", "direction": "unpack",
                  "src": "float32", "dst": "bfloat16", "size_class": "large",
                  "xla_ms": 0.91, "pallas_ms": 0.80, "jax": "0.11.0"}]}

Empty ``records`` (the shipped state until a GPU run is recorded) means XLA everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax.kernels._ragged import Backend, choose_backend
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = [
    "MIN_SPEEDUP",
    "SIZE_CLASSES",
    "MeasuredTable",
    "Record",
    "auto_implementation",
    "shipped_table",
    "size_class",
]

FORMAT = 1
MIN_SPEEDUP = 1.05
"""A kernel counts as faster when XLA's median time ÷ the kernel's is at least this (5 %: beyond run noise)."""
SIZE_CLASSES = (("small", 1 << 20), ("medium", 64 << 20), ("large", None))
"""Size classes of a bucket by the bytes its buffer holds: < 1 MiB, < 64 MiB, the rest."""
DIRECTIONS = ("pack", "unpack")
SHIPPED = os.path.join(os.path.dirname(__file__), "_measured.json")


def size_class(nbytes: int) -> str:
    """The size class of a bucket buffer of ``nbytes`` bytes: ``"small"``, ``"medium"`` or ``"large"``."""
    for name, limit in SIZE_CLASSES:
        if limit is None or nbytes < limit:
            return name
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class Record:
    """One measured case: a Pallas backend against XLA on one device kind.

    Attributes:
      device_kind: ``jax.Device.device_kind`` of the GPU measured (e.g. ``"NVIDIA H200"``).
      backend: the Pallas lowering timed, ``"triton"`` or ``"mosaic_gpu"``.
      direction: ``"pack"`` (leaves -> buffer) or ``"unpack"`` (buffer -> leaves).
      src: dtype read, by name (``"float32"``).
      dst: dtype written, by name.
      size_class: one of :data:`SIZE_CLASSES`' names.
      xla_ms: median time of XLA's jitted reference.
      pallas_ms: median time of the kernel (bit-identical output checked before timing).
      jax: the JAX version of the run.
    """

    device_kind: str
    backend: str
    direction: str
    src: str
    dst: str
    size_class: str
    xla_ms: float
    pallas_ms: float
    jax: str = ""

    def __post_init__(self):
        if self.direction not in DIRECTIONS:
            raise ValueError(f"Record.direction={self.direction!r}; use one of {DIRECTIONS}.")
        names = [n for n, _ in SIZE_CLASSES]
        if self.size_class not in names:
            raise ValueError(f"Record.size_class={self.size_class!r}; use one of {names}.")
        if not (self.xla_ms > 0 and self.pallas_ms > 0):
            raise ValueError(f"Record times must be positive, got xla_ms={self.xla_ms}, pallas_ms={self.pallas_ms}.")

    @property
    def speedup(self) -> float:
        """XLA's time ÷ the kernel's (> 1: the kernel is faster)."""
        return self.xla_ms / self.pallas_ms


@dataclasses.dataclass(frozen=True)
class MeasuredTable:
    """Recorded GPU results, immutable and hashable (a field of the frozen ``KernelPolicy``).

    Attributes:
      records: the measured cases; an empty table answers XLA everywhere.
    """

    records: tuple[Record, ...] = ()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MeasuredTable:
        """The table of a decoded ``_measured.json``.

        Args:
          data: ``{"format": 1, "records": [...]}``.

        Returns:
          The table.
        """
        if data.get("format") != FORMAT:
            raise ValueError(f"measured-kernel table: format {data.get('format')!r}, expected {FORMAT}.")
        fields = {f.name for f in dataclasses.fields(Record)}
        records = []
        for i, r in enumerate(data.get("records", ())):
            unknown = set(r) - fields
            if unknown:
                raise ValueError(f"measured-kernel table: record {i} has unknown keys {sorted(unknown)}.")
            records.append(Record(**r))
        return cls(records=tuple(records))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> MeasuredTable:
        """Read a table written by :meth:`to_json` (or ``benchmarks/kernels.py --json``).

        Args:
          path: the JSON file.

        Returns:
          The table.
        """
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form: ``{"format": 1, "records": [...]}``."""
        return {"format": FORMAT, "records": [dataclasses.asdict(r) for r in self.records]}

    def to_json(self, path: str | os.PathLike) -> None:
        """Write the table as JSON (sorted keys, one record per line block)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")

    def faster(
        self,
        *,
        backend: str,
        direction: str,
        src_dtype: Any,
        dst_dtype: Any,
        nbytes: int,
        device_kind: str,
    ) -> bool:
        """Whether ``backend`` was measured faster than XLA (by :data:`MIN_SPEEDUP`) for this case.

        Args:
          backend: the Pallas lowering that would run (``"triton"`` or ``"mosaic_gpu"``).
          direction: ``"pack"`` or ``"unpack"``.
          src_dtype: dtype read.
          dst_dtype: dtype written.
          nbytes: bytes of the bucket buffer (``dst`` for pack, ``src`` for unpack); its size class is used.
          device_kind: the GPU's ``device_kind``.

        Returns:
          True only if a matching record exists and every matching record shows the kernel ahead.
        """
        key = (device_kind, backend, direction, np.dtype(src_dtype).name, np.dtype(dst_dtype).name)
        cls = size_class(nbytes)
        hits = [r for r in self.records if (r.device_kind, r.backend, r.direction, r.src, r.dst) == key]
        hits = [r for r in hits if r.size_class == cls]
        return bool(hits) and all(r.speedup >= MIN_SPEEDUP for r in hits)

    def cases(self) -> Sequence[Record]:
        """The records that make ``auto`` pick a kernel (every record of their case ahead by MIN_SPEEDUP)."""
        key = lambda r: (r.device_kind, r.backend, r.direction, r.src, r.dst, r.size_class)
        behind = {key(r) for r in self.records if r.speedup < MIN_SPEEDUP}
        return tuple(r for r in self.records if key(r) not in behind)


@functools.cache
def shipped_table() -> MeasuredTable:
    """The table shipped with the package, ``vescale_jax/kernels/_measured.json`` (read once)."""
    return MeasuredTable.from_json(SHIPPED)


def _device_kind(platform: str) -> str:
    """The ``device_kind`` of the first device of ``platform``, ``""`` if there is none (no record matches).

    One place, so tests can stand in a GPU."""
    try:
        return jax.devices(platform)[0].device_kind
    except RuntimeError:
        return ""


def auto_implementation(
    table: MeasuredTable | None,
    layout: BucketLayout,
    src_dtype: Any,
    dst_dtype: Any,
    *,
    direction: str | None,
    platform: str | None = None,
    backend: str | None = None,
    device_kind: str | None = None,
) -> Backend:
    """What ``KernelPolicy(mode="auto")`` runs for one bucket: a Pallas backend only where measured faster.

    The backend considered is the one :func:`~vescale_jax.kernels.choose_backend` would compile for the bucket
    (never on CPU); it is used only if ``table`` records it beating XLA for this device kind, direction,
    dtype pair and size class.

    Args:
      table: the measured results; None means :func:`shipped_table`.
      layout: the bucket layout.
      src_dtype: dtype read.
      dst_dtype: dtype written.
      direction: ``"pack"`` or ``"unpack"``; None (unknown) answers ``"xla"``.
      platform: ``jax.default_backend()`` if None.
      backend: the preferred GPU lowering (None: :func:`~vescale_jax.kernels.default_gpu_backend`).
      device_kind: the GPU's ``device_kind``; None reads the first device of ``platform``.

    Returns:
      ``"xla"``, ``"triton"`` or ``"mosaic_gpu"``.
    """
    platform = jax.default_backend() if platform is None else platform
    if direction is None:
        return "xla"
    impl = choose_backend(layout, src_dtype, dst_dtype, platform=platform, backend=backend)
    if impl == "xla":
        return "xla"
    table = shipped_table() if table is None else table
    if not table.records:
        return "xla"
    if device_kind is None:
        device_kind = _device_kind(platform)
    buffer_dtype = dst_dtype if direction == "pack" else src_dtype
    nbytes = layout.total_size * np.dtype(buffer_dtype).itemsize
    ok = table.faster(
        backend=impl,
        direction=direction,
        src_dtype=src_dtype,
        dst_dtype=dst_dtype,
        nbytes=nbytes,
        device_kind=device_kind,
    )
    return impl if ok else "xla"
