"""The live ranges of an optimised module's buffers as XLA dumps them, and the schedule position of the peak.

``*after_optimizations-live-range.txt`` lists XLA's own peak (:func:`parse_live`: its schedule position and the
values live there) and every value's live range over the schedule (:func:`parse_ranges`). XLA's peak line sums
value sizes, so it counts an in-place update's bytes twice; :func:`physical_peak` finds the position where the most
distinct bytes of counted allocations are live, from the ranges and the buffer assignment.
"""

from __future__ import annotations

import re

from vescale_jax.testing._dump_buffer_assignment import COUNTED, Slot, distinct_bytes, value_key

__all__ = ["parse_live", "parse_ranges", "physical_peak"]

_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s+(\S+?): (\d+) bytes")
_RANGE = re.compile(r"^\s+(\S+?):(\d+)-(\d+)\s*$")
_CUMULATIVE = re.compile(r"\(cumulative: (\d+) bytes\)")


def parse_live(text: str, path: str) -> tuple[int, list[tuple[str, int]]]:
    """The peak's schedule position and its live ``(buffer name, bytes)``; a line of the section that does not parse
    becomes an ``"<unparsed>"`` entry, sized from the running ``cumulative`` total where it can be."""
    lines = text.splitlines()
    found = next(((i, m) for i, m in enumerate(map(_PEAK.match, lines)) if m), None)
    if found is None:
        raise ValueError(f"{path} has no 'Live ranges at N (peak):' section; the XLA version writes another format")
    i, m = found
    indent = len(lines[i]) - len(lines[i].lstrip())
    live, total, cumulative = [], 0, None
    for line in lines[i + 1 :]:
        if not line.strip() or len(line) - len(line.lstrip()) <= indent:
            break
        lm = _LIVE.match(line)
        cm = _CUMULATIVE.search(line)
        if lm is not None:
            live.append((lm.group(1), int(lm.group(2))))
            total += int(lm.group(2))
        if cm is not None:
            cumulative = int(cm.group(1))
        if (lm is None or cm is not None) and cumulative is not None and cumulative != total:
            live.append(("<unparsed>", cumulative - total))
            total = cumulative
    return int(m.group(1)), live


def parse_ranges(text: str) -> dict[str, tuple[int, int]]:
    """``BufferLiveRange:`` of the live-range dump: value name -> (first, last) schedule position, inclusive."""
    ranges: dict[str, tuple[int, int]] = {}
    inside = False
    for line in text.splitlines():
        if line.strip() == "BufferLiveRange:":
            inside = True
            continue
        if inside:
            rm = _RANGE.match(line)
            if rm is None:
                break
            ranges[rm.group(1)] = (int(rm.group(2)), int(rm.group(3)))
    return ranges


def physical_peak(ranges: dict[str, tuple[int, int]], slots: dict[tuple[str, str], Slot]) -> int | None:
    """The schedule position where the most distinct bytes of counted (argument, output, temp) allocations are live.

    XLA's own "(peak)" line sums value sizes, so it counts twice the bytes of an in-place update (the old and the new
    value of a donated argument); this position counts them once."""
    counted = [
        (s, e, slot) for n, (s, e) in ranges.items() if (slot := slots.get(value_key(n))) and slot.kind in COUNTED
    ]
    if not counted:
        return None
    delta: dict[int, int] = {}
    for s, e, slot in counted:
        delta[s] = delta.get(s, 0) + slot.size
        delta[e + 1] = delta.get(e + 1, 0) - slot.size
    naive, running = {}, 0
    starts = {s for s, _, _ in counted}
    for t in sorted(delta):
        running += delta[t]
        if t in starts:
            naive[t] = running
    best, position = -1, None
    for t in sorted(naive, key=lambda t: (-naive[t], t)):
        if naive[t] <= best:  # a position's distinct bytes never exceed its summed sizes
            break
        here = distinct_bytes([(slot, slot.size) for s, e, slot in counted if s <= t <= e])
        if here > best:
            best, position = here, t
    return position
