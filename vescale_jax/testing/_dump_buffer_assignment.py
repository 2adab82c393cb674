"""Where XLA's buffer assignment puts each value: allocation, offset and size, and the bytes values occupy.

:func:`parse_assignment` reads ``*after_optimizations-buffer-assignment.txt`` into one :class:`Slot` per value (the
allocation's kind: an argument, an output, the temp block, a constant or thread-local; its number, the value's
offset and size), keyed by :func:`value_key`. Two values of one allocation may share bytes (an in-place update);
:func:`distinct_bytes`, :func:`merge_spans` and :func:`overlap` count such bytes once.
"""

from __future__ import annotations

import dataclasses
import re

from vescale_jax.testing._dump_instructions import VALUE_NAME

__all__ = ["COUNTED", "Slot", "distinct_bytes", "merge_spans", "overlap", "parse_assignment", "value_key"]

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
_ALLOC_VALUE = re.compile(r"^\s*value: <\d+ ([\w.\-]+)(\{[\d,\s]*\})?(?: \(phi\))? @\d+>")
_PARAM_NUMBER = re.compile(r"\bparameter (\d+)")
COUNTED = ("argument", "output", "temp")  # the allocations memory_analysis() adds up


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one value lives: its allocation's kind and number, the value's offset and size in it, and for an
    argument allocation the entry parameter it holds."""

    kind: str  # argument / output / temp / constant / thread-local
    allocation: int
    offset: int
    size: int
    parameter: int | None  # the entry parameter of an argument allocation


def parse_assignment(text: str) -> dict[tuple[str, str], Slot]:
    """``(name, "{index}") -> Slot``: where the buffer assignment put each value."""
    slots: dict[tuple[str, str], Slot] = {}
    kind, number, index = None, None, -1
    for line in text.splitlines():
        am = _ALLOCATION.match(line)
        if am:
            index, header = int(am.group(1)), am.group(3)
            pm = _PARAM_NUMBER.search(header)
            number = int(pm.group(1)) if pm else None
            if pm:
                kind = "argument"
            elif "thread-local" in header:
                kind = "thread-local"
            elif "constant" in header:
                kind = "constant"
            elif "output shape" in header or "maybe-live-out" in header:
                kind = "output"
            else:
                kind = "temp"
            continue
        vm = _ALLOC_VALUE.match(line)
        if vm and kind is not None:
            om = re.search(r"offset=(\d+)", line)
            sm = re.search(r"size=(\d+)", line)
            key = (vm.group(1), (vm.group(2) or "{}").replace(" ", ""))
            slots[key] = Slot(kind, index, int(om.group(1)) if om else 0, int(sm.group(1)) if sm else 0, number)
        elif not line.startswith(" "):
            kind = None
    return slots


def value_key(name: str) -> tuple[str, str]:
    """The buffer assignment's key of a buffer name: ``while.38{2}`` -> ``("while.38", "{2}")``."""
    vm = VALUE_NAME.match(name)
    return (vm.group(1), "{" + vm.group(2).replace(" ", "") + "}") if vm else (name, "{}")


def distinct_bytes(values: list[tuple[Slot, int]]) -> int:
    """Bytes the values occupy, each byte of an allocation once."""
    by_allocation: dict[int, list[tuple[int, int]]] = {}
    for slot, size in values:
        by_allocation.setdefault(slot.allocation, []).append((slot.offset, slot.offset + size))
    return sum(b - a for ranges in by_allocation.values() for a, b in merge_spans(ranges))


def merge_spans(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``[lo, hi)`` byte ranges as sorted, disjoint ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(covered: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Bytes of ``[lo, hi)`` already in the disjoint intervals ``covered``."""
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in covered)
