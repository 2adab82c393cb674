"""The collective census of a compiled module: every collective with its bytes, group size and launches."""

from __future__ import annotations

import dataclasses
from typing import Any

from vescale_jax.testing._collectives import KINDS, _check_kind, _group_size, parse_replica_groups, wire_bytes
from vescale_jax.testing._hlo import _hlo_text, _multipliers, _output_shape, _parse_module
from vescale_jax.testing._shapes import _human, _strip_layout, shape_bytes

__all__ = ["Census", "CollectiveOp", "census"]


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the compiled module.

    Attributes:
        kind: one of :data:`KINDS` (async ``*-start`` ops are reported under their base kind).
        name: the HLO instruction name, e.g. ``all_gather.3``.
        computation: the HLO computation holding it.
        shape: the result dtype/shape without layout, e.g. ``f32[128]`` or ``(f32[16], f32[8])``.
        result_bytes: bytes of the result of one launch on one device (tuple elements summed; for an async start
            only the output part).
        group_size: replica-group size (for collective-permute: the number of devices in its source/target pairs).
        multiplier: how many times it runs per step (product of the trip counts of the loops around it).
        in_loop: whether it sits (directly or through calls) inside a ``while`` body.
        unknown_trip_count: whether some enclosing loop had no ``known_trip_count`` (counted as 1).
        is_async: whether it appeared as a ``*-start``/``*-done`` pair.
        replica_groups: the device ids of each replica group (see :func:`parse_replica_groups`; positions in the
            compiled mesh's ``devices.flat`` order), ``None`` for collective-permute or a form not expanded;
            :func:`group_axes` names the mesh axes they span.
    """

    kind: str
    name: str
    computation: str
    shape: str
    result_bytes: int
    group_size: int
    multiplier: int = 1
    in_loop: bool = False
    unknown_trip_count: bool = False
    is_async: bool = False
    replica_groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def wire_bytes(self) -> float:
        """Ring wire bytes per device of one launch (see :func:`wire_bytes`)."""
        return wire_bytes(self.kind, self.result_bytes, self.group_size)

    @property
    def total_bytes(self) -> int:
        """Result bytes × multiplier."""
        return self.result_bytes * self.multiplier

    @property
    def total_wire_bytes(self) -> float:
        """Wire bytes × multiplier."""
        return self.wire_bytes * self.multiplier


@dataclasses.dataclass(frozen=True)
class Census:
    """The collectives of a compiled module, as returned by :func:`census`.

    Attributes:
        ops: every collective instruction found, in text order.
        unknown_trip_counts: names of ``while`` instructions without a known trip count (counted once).
    """

    ops: tuple[CollectiveOp, ...]
    unknown_trip_counts: tuple[str, ...] = ()

    def of(self, kind: str) -> tuple[CollectiveOp, ...]:
        """The ops of one kind.

        Args:
            kind: one of :data:`KINDS`.

        Returns:
            Those ops, in text order.
        """
        _check_kind(kind)
        return tuple(op for op in self.ops if op.kind == kind)

    def instructions(self, kind: str) -> int:
        """Number of HLO instructions of a kind (each counted once, whatever its loop).

        Args:
            kind: one of :data:`KINDS`.

        Returns:
            The static instruction count.
        """
        return len(self.of(kind))

    def count(self, kind: str) -> int:
        """Number of launches per step of a kind (instructions × their multipliers).

        Args:
            kind: one of :data:`KINDS`.

        Returns:
            The dynamic launch count.
        """
        return sum(op.multiplier for op in self.of(kind))

    def bytes(self, kind: str) -> int:
        """Result bytes per device per step of a kind (result bytes × multiplier, summed).

        Args:
            kind: one of :data:`KINDS`.

        Returns:
            The total in bytes.
        """
        return sum(op.total_bytes for op in self.of(kind))

    def wire_bytes(self, kind: str) -> float:
        """Ring wire bytes per device per step of a kind (see :func:`wire_bytes`), multipliers applied.

        Args:
            kind: one of :data:`KINDS`.

        Returns:
            The total in bytes.
        """
        return sum(op.total_wire_bytes for op in self.of(kind))

    def largest(self, kind: str) -> CollectiveOp | None:
        """The op of a kind with the largest result (per launch).

        Args:
            kind: one of :data:`KINDS`.

        Returns:
            That op, or None if there is none of that kind.
        """
        ops = self.of(kind)
        return max(ops, key=lambda op: op.result_bytes) if ops else None

    @property
    def total_wire_bytes(self) -> float:
        """Ring wire bytes per device per step over all kinds."""
        return sum(op.total_wire_bytes for op in self.ops)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per-kind totals.

        Returns:
            ``{kind: {"instructions", "count", "bytes", "wire_bytes"}}`` for every kind in :data:`KINDS`.
        """
        return {
            k: {
                "instructions": self.instructions(k),
                "count": self.count(k),
                "bytes": self.bytes(k),
                "wire_bytes": self.wire_bytes(k),
            }
            for k in KINDS
        }

    def table(self, *, ops: bool = False) -> str:
        """A fixed-width text table of the per-kind totals, optionally followed by one row per op.

        Args:
            ops: also list every op with its shape, group size, multiplier and loop flag.

        Returns:
            The table as a string.
        """
        rows = [f"{'collective':<20}{'instr':>7}{'launches':>10}{'result bytes':>14}{'wire bytes':>14}"]
        for k in KINDS:
            rows.append(
                f"{k:<20}{self.instructions(k):>7}{self.count(k):>10}"
                f"{_human(self.bytes(k)):>14}{_human(self.wire_bytes(k)):>14}"
            )
        if ops and self.ops:
            rows.append("")
            rows.append(f"{'kind':<20}{'g':>4}{'x':>6}  {'loop':<5}{'bytes':>12}  shape")
            for op in self.ops:
                loop = ("yes?" if op.unknown_trip_count else "yes") if op.in_loop else "no"
                rows.append(
                    f"{op.kind:<20}{op.group_size:>4}{op.multiplier:>6}  {loop:<5}"
                    f"{_human(op.result_bytes):>12}  {op.shape}"
                )
        if self.unknown_trip_counts:
            rows.append(f"unknown trip count (counted once): {', '.join(self.unknown_trip_counts)}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


# opcode -> (kind, async start?)
_OPCODES: dict[str, tuple[str, bool]] = {}
for _k in KINDS:
    _OPCODES[_k] = (_k, False)
    _OPCODES[f"{_k}-start"] = (_k, True)


def census(compiled_or_hlo_text: Any) -> Census:
    """Count the collectives of an optimised XLA HLO module.

    Async ``*-start``/``*-done`` pairs count once (at the start, taking the output part of its tuple result). Ops in
    a ``while`` body are multiplied by the loop's ``known_trip_count`` (nested loops multiply; computations reached
    through ``call``, ``fusion``, conditional branches or async wrappers inherit their caller's multiplier; a
    computation called from several sites sums them). A loop without a known trip count counts once and is flagged.

    Args:
        compiled_or_hlo_text: a ``jax.stages.Compiled`` (anything with ``.as_text()`` returning post-optimisation
            HLO) or that text itself, or a hand-written HLO snippet. Not StableHLO: use ``.compile()`` first.

    Returns:
        A :class:`Census`.

    Raises:
        ValueError: if the text looks like StableHLO/MLIR, or a group size cannot be determined.
    """
    text = _hlo_text(compiled_or_hlo_text)
    if "HloModule" not in text and ("func.func" in text or "stablehlo." in text):
        raise ValueError("census needs post-optimisation HLO (compiled.as_text()), not StableHLO")
    comps, devices = _parse_module(text)
    mult, in_loop, unk, unknown = _multipliers(comps)
    ops = []
    for c in comps:
        if mult[c.name] == 0:
            continue
        for ins in c.instrs:
            if ins.opcode not in _OPCODES:
                continue
            kind, is_async = _OPCODES[ins.opcode]
            out = _output_shape(ins.opcode, ins.shape)
            ops.append(
                CollectiveOp(
                    kind=kind,
                    name=ins.name,
                    computation=c.name,
                    shape=_strip_layout(out).strip(),
                    result_bytes=shape_bytes(out),
                    group_size=_group_size(kind, ins.attrs, devices),
                    multiplier=mult[c.name],
                    in_loop=in_loop[c.name],
                    unknown_trip_count=unk[c.name],
                    is_async=is_async,
                    replica_groups=None if kind == "collective-permute" else parse_replica_groups(ins.attrs, devices),
                )
            )
    return Census(tuple(ops), tuple(unknown))
