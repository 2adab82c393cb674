"""Per-device memory of a compiled executable, from XLA's memory analysis."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from vescale_jax.testing._shapes import _MIB, _human

__all__ = ["Memory", "memory"]


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device memory of a compiled executable, from ``compiled.memory_analysis()`` (bytes).

    Attributes:
        argument: argument buffers.
        output: output buffers.
        alias: output bytes aliased to (donated) arguments.
        temp: temporaries.
        generated_code: generated code size.
        reported_peak: ``peak_memory_in_bytes`` as XLA reports it, if present (on CPU it leaves temp out).
    """

    argument: int
    output: int
    alias: int
    temp: int
    generated_code: int = 0
    reported_peak: int | None = None

    @property
    def peak(self) -> int:
        """Estimated peak per device: ``argument + output − alias + temp``."""
        return self.argument + self.output - self.alias + self.temp

    def mib(self) -> dict[str, float]:
        """The fields and the peak in MiB.

        Returns:
            ``{"argument", "output", "alias", "temp", "generated_code", "peak"}`` in MiB.
        """
        names = ("argument", "output", "alias", "temp", "generated_code", "peak")
        return {n: getattr(self, n) / _MIB for n in names}

    def __str__(self) -> str:
        return (
            f"peak {_human(self.peak)} = argument {_human(self.argument)} + output {_human(self.output)}"
            f" - alias {_human(self.alias)} + temp {_human(self.temp)} (code {_human(self.generated_code)})"
        )


def memory(compiled: Any) -> Memory:
    """Per-device memory figures of a compiled executable.

    Args:
        compiled: a ``jax.stages.Compiled`` (anything with ``.memory_analysis()``).

    Returns:
        A :class:`Memory`; ``.peak`` is ``argument + output − alias + temp``.

    Raises:
        ValueError: if the backend reports no memory analysis.
    """
    stats = compiled.memory_analysis()
    if isinstance(stats, list | tuple):
        stats = stats[0] if stats else None
    if stats is None:
        raise ValueError("this backend reports no memory analysis")

    def get(name: str, default: int | None = 0) -> int | None:
        value = stats.get(name, default) if isinstance(stats, Mapping) else getattr(stats, name, default)
        return None if value is None else int(value)

    return Memory(
        argument=get("argument_size_in_bytes"),
        output=get("output_size_in_bytes"),
        alias=get("alias_size_in_bytes"),
        temp=get("temp_size_in_bytes"),
        generated_code=get("generated_code_size_in_bytes"),
        reported_peak=get("peak_memory_in_bytes", None),
    )
