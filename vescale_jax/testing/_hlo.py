"""Optimised HLO text as computations and instructions, and how many times each computation runs per step."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from vescale_jax.testing._shapes import _COMMENT, _tuple_elements

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TRIP_COUNT = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
_SINGLE_REF = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_MULTI_REF = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")
_HEADER_INT = re.compile(r"\b(num_partitions|replica_count)=(\d+)")


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    attrs: str  # everything after the opcode, quoted strings blanked out
    trip_count: int | None
    op_name: str = ""  # the metadata's op_name (JAX's name stack), unescaped


@dataclasses.dataclass
class _Comp:
    name: str
    entry: bool
    instrs: list[_Instr]


def _split_shape(rest: str) -> tuple[str, str]:
    """Split ``"<shape> <opcode>(...)..."`` into the shape and the remainder."""
    rest = rest.lstrip()
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            if ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
                if depth == 0:
                    return rest[: i + 1], rest[i + 1 :].lstrip()
        raise ValueError(f"unbalanced tuple shape in {rest[:80]!r}")
    shape, _, tail = rest.partition(" ")
    return shape, tail.lstrip()


def _parse_module(text: str) -> tuple[list[_Comp], int | None]:
    comps: list[_Comp] = []
    current: _Comp | None = None
    header: dict[str, int] = {}
    for raw in text.splitlines():
        line = raw.rstrip()
        if current is None:
            if line.startswith("HloModule"):
                header.update({k: int(v) for k, v in _HEADER_INT.findall(_QUOTED.sub('""', line))})
                continue
            m = _COMPUTATION.match(line)
            if m and not line.lstrip().startswith(("FileNames", "FunctionNames", "FileLocations", "StackFrames")):
                current = _Comp(m.group(2), bool(m.group(1)), [])
            continue
        if line.strip() == "}":
            comps.append(current)
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, rest = m.groups()
        trip = _TRIP_COUNT.search(rest)
        op = _OP_NAME.search(rest)
        rest = _COMMENT.sub("", _QUOTED.sub('""', rest))
        shape, tail = _split_shape(rest)
        om = re.match(r"([\w\-]+)\(", tail)
        if om is None:
            continue
        op_name = re.sub(r"\\(.)", r"\1", op.group(1)) if op else ""
        trip_count = int(trip.group(1)) if trip else None
        current.instrs.append(_Instr(name, shape, om.group(1), tail[om.end() :], trip_count, op_name))
    if current is not None:  # tolerate a snippet without its closing brace
        comps.append(current)
    devices = None
    if header:
        devices = header.get("num_partitions", 1) * header.get("replica_count", 1)
    return comps, devices


def _references(instr: _Instr) -> list[tuple[str, str]]:
    """(attribute, computation) pairs an instruction calls; async done/update ops are skipped (the start counts)."""
    if instr.opcode in ("async-done", "async-update"):
        return []
    refs = []
    for attr, names in _MULTI_REF.findall(instr.attrs):
        refs += [(attr, n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
    refs += [(attr, name) for attr, name in _SINGLE_REF.findall(instr.attrs) if not name.startswith("{")]
    return refs


def _multipliers(
    comps: list[_Comp],
) -> tuple[dict[str, int], dict[str, bool], dict[str, bool], list[str]]:
    """Executions per step, in-loop and unknown-trip-count flags of every computation, and the unknown loops."""
    by_name = {c.name: c for c in comps}
    callers: dict[str, list[tuple[str, int, bool, bool]]] = {c.name: [] for c in comps}
    unknown: list[str] = []
    for c in comps:
        for ins in c.instrs:
            is_while = ins.opcode == "while"
            if is_while and ins.trip_count is None:
                unknown.append(ins.name)
            for attr, callee in _references(ins):
                if callee not in callers:
                    continue
                looped = is_while and attr in ("body", "condition")
                factor = (ins.trip_count if ins.trip_count is not None else 1) if looped else 1
                if looped and attr == "condition" and ins.trip_count is not None:
                    factor = ins.trip_count + 1
                callers[callee].append((c.name, factor, looped, looped and ins.trip_count is None))

    entries = [c.name for c in comps if c.entry]
    roots = set(entries) if entries else {n for n, cs in callers.items() if not cs}
    mult: dict[str, int] = {}
    in_loop: dict[str, bool] = {}
    unk: dict[str, bool] = {}

    def visit(name: str, stack: tuple[str, ...] = ()) -> None:
        if name in mult:
            return
        if name in stack:
            raise ValueError(f"recursive HLO call graph through {name!r}")
        total, loop, flag = (1, False, False) if name in roots else (0, False, False)
        for caller, factor, looped, unknown_here in callers[name]:
            visit(caller, (*stack, name))
            if mult[caller] == 0:
                continue
            total += mult[caller] * factor
            loop = loop or looped or in_loop[caller]
            flag = flag or unknown_here or unk[caller]
        mult[name], in_loop[name], unk[name] = total, loop, flag

    for name in by_name:
        visit(name)
    return mult, in_loop, unk, unknown


def _output_shape(opcode: str, shape: str) -> str:
    """The output part of a collective's result shape (async starts carry their operands too)."""
    if not opcode.endswith("-start") or opcode == "all-reduce-start":
        return shape  # all-reduce-start's result is its output
    elements = _tuple_elements(shape)
    if elements is None or len(elements) < 2:
        return shape
    # all-gather-start: (operands, outputs); collective-permute-start: (operand, output, u32[], u32[]);
    # async-wrapped reduce-scatter/all-to-all-start: ((operands), output, context...).
    return elements[1]


def _hlo_text(compiled_or_hlo_text: Any) -> str:
    if isinstance(compiled_or_hlo_text, str):
        return compiled_or_hlo_text
    as_text = getattr(compiled_or_hlo_text, "as_text", None)
    if as_text is None:
        raise TypeError(f"expected HLO text or a compiled object with .as_text(), got {type(compiled_or_hlo_text)}")
    text = as_text()
    if isinstance(text, list | tuple):  # some versions return one text per executable
        text = "\n".join(text)
    if not isinstance(text, str):
        raise TypeError(f".as_text() returned {type(text)}")
    return text
