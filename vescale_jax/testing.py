"""Static measurements of a compiled step: collective census, memory and cost (DESIGN.md §5).

All three read what XLA reports for a ``jax.jit(...).lower(...).compile()`` object, so they are deterministic and
can be asserted in tests:

- :func:`census` parses the optimised HLO text (``compiled.as_text()``) and lists every all-gather, reduce-scatter,
  all-reduce, all-to-all and collective-permute with its result bytes, replica-group size, ring wire bytes per device
  and how many times it runs (the product of the known trip counts of the ``while`` loops around it).
- :func:`memory` reads ``compiled.memory_analysis()`` and derives the per-device peak
  ``argument + output − alias + temp`` (on CPU ``peak_memory_in_bytes`` leaves temp out).
- :func:`cost` reads ``compiled.cost_analysis()`` (flops, bytes accessed). XLA's cost analysis counts a ``while``
  body once, not trip-count times.

Ring wire bytes per device, with ``b`` the result bytes of one launch and ``g`` the replica-group size:
all-gather ``b(g−1)/g``, reduce-scatter ``b(g−1)``, all-reduce ``2b(g−1)/g``, all-to-all ``b(g−1)/g``,
collective-permute ``b``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "KINDS",
    "Census",
    "CollectiveOp",
    "Memory",
    "census",
    "cost",
    "memory",
    "parse_replica_group_size",
    "shape_bytes",
    "wire_bytes",
]

#: Collective kinds the census reports, in table order.
KINDS: tuple[str, ...] = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_MIB = float(1 << 20)


def _human(n: float) -> str:
    """Bytes with a binary unit, e.g. ``2.50 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# Bits per element of the HLO primitive types (sub-byte types are rounded up per array).
_DTYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 1,
    "u1": 1,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "opaque": 0,
}


def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    m = re.fullmatch(r"f(\d+)(?:e\d+m\d+\w*)?", dtype)  # f8e4m3fn, f8e5m2, f4e2m1fn, f6e3m2fn, ...
    if m:
        return int(m.group(1))
    raise ValueError(f"unknown HLO element type {dtype!r}")


# ---------------------------------------------------------------------------------------------------------------
# Shapes
# ---------------------------------------------------------------------------------------------------------------

_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")


def _split_top(text: str) -> list[str]:
    """Split ``text`` on the commas that are not nested in (), [] or {}."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _tuple_elements(shape: str) -> list[str] | None:
    """The top-level element shapes of a tuple shape string, or None if ``shape`` is an array shape."""
    shape = _COMMENT.sub("", shape).strip()
    if not shape.startswith("("):
        return None
    return _split_top(shape[1:-1])


def _array_bytes(shape: str) -> int:
    m = _ARRAY.match(shape.strip())
    if m is None:
        if shape.strip() in ("token[]", "token"):
            return 0
        raise ValueError(f"cannot parse HLO shape {shape!r}")
    dtype, dims = m.groups()
    n = 1
    for d in dims.split(","):
        d = d.strip().lstrip("<=")  # dynamic dims are printed as <=N: count the bound
        if d:
            n *= int(d)
    return math.ceil(n * _dtype_bits(dtype) / 8)


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string; tuples are summed recursively.

    Args:
        shape: e.g. ``"f32[8,16]{1,0}"`` or ``"(f32[16]{0}, /*index=1*/bf16[4,2])"``. Layouts and comments are
            ignored; a dynamic dimension ``<=N`` counts as N.

    Returns:
        The size in bytes (sub-byte element types are rounded up per array).
    """
    elements = _tuple_elements(shape)
    if elements is None:
        return _array_bytes(shape)
    return sum(shape_bytes(e) for e in elements)


def _strip_layout(shape: str) -> str:
    """``f32[8,16]{1,0}`` -> ``f32[8,16]`` (recursively inside tuples)."""
    shape = _COMMENT.sub("", shape)
    return re.sub(r"\]\{[^}]*\}", "]", shape).replace("  ", " ")


# ---------------------------------------------------------------------------------------------------------------
# Replica groups
# ---------------------------------------------------------------------------------------------------------------

_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,\s]+)\]<=\[[\d,\s]+\](?:T\([\d,\s]+\))?")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(.*?)\}(?=,\s*[a-z_]+=|\s*$)")
# XLA's mesh-axes form (JAX 0.11): mesh['a'=2,'b'=4] {'a'}, optionally with ", device_ids=(...)" after the mesh
# and sub-axes written 'a':(pre_size)size.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(.*?\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"^'?([^'=:]+?)'?(?::\((\d+)\)(\d+))?$")
_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}(?=,\s*[a-z_]+=|\s*$)")


def _mesh_group_size(mesh: str, axes: str) -> int:
    sizes = {}
    for entry in _split_top(mesh):
        name, _, size = entry.rpartition("=")
        sizes[name.strip().strip("'")] = int(size)
    g = 1
    for axis in _split_top(axes):
        m = _MESH_AXIS.match(axis)
        if m is None or (m.group(3) is None and m.group(1) not in sizes):
            raise ValueError(f"cannot parse mesh axis {axis!r} of replica_groups=mesh[{mesh}] {{{axes}}}")
        g *= int(m.group(3)) if m.group(3) is not None else sizes[m.group(1)]
    return g


def parse_replica_group_size(attrs: str, num_devices: int | None = None) -> int | None:
    """The size of the (first) replica group named in an HLO instruction's attributes.

    Args:
        attrs: the instruction text after the operands, containing ``replica_groups=...`` in the explicit form
            ``{{0,1,2},{3,4,5}}``, the iota form ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)`` (shape
            ``[groups, group_size]``) or the mesh-axes form of newer XLA, ``mesh['a'=2,'b'=4] {'a'}`` (product of
            the named axes' sizes; a sub-axis ``'a':(1)2`` counts its own size).
        num_devices: the group size to use for an empty ``replica_groups={}`` (all devices).

    Returns:
        The group size, or ``num_devices`` when the groups are empty or absent.

    Raises:
        ValueError: for a ``replica_groups=`` value in none of these forms.
    """
    m = _MESH_GROUPS.search(attrs)
    if m:
        return _mesh_group_size(m.group(1), m.group(2))
    m = _IOTA_GROUPS.search(attrs)
    if m:
        dims = [int(d) for d in m.group(1).split(",") if d.strip()]
        return dims[-1]
    m = _EXPLICIT_GROUPS.search(attrs)
    if m:
        groups = re.findall(r"\{([^{}]*)\}", m.group(1))
        if groups:
            return len([d for d in groups[0].split(",") if d.strip()])
        if m.group(1).strip():
            raise ValueError(f"cannot parse replica_groups in {attrs[:200]!r}")
        return num_devices
    if "replica_groups=" in attrs:
        raise ValueError(f"unrecognised replica_groups form in {attrs[:200]!r}")
    return num_devices


def wire_bytes(kind: str, result_bytes: float, group_size: int) -> float:
    """Ring wire bytes sent per device by one launch of a collective.

    Args:
        kind: one of :data:`KINDS`.
        result_bytes: bytes of the collective's result on one device (``b``).
        group_size: replica-group size (``g``); ignored for collective-permute.

    Returns:
        all-gather ``b(g−1)/g``, reduce-scatter ``b(g−1)``, all-reduce ``2b(g−1)/g``, all-to-all ``b(g−1)/g``,
        collective-permute ``b``.
    """
    b, g = result_bytes, group_size
    if kind == "collective-permute":
        return float(b)
    if g <= 0:
        raise ValueError(f"group size must be positive, got {g}")
    if kind in ("all-gather", "all-to-all"):
        return b * (g - 1) / g
    if kind == "reduce-scatter":
        return float(b * (g - 1))
    if kind == "all-reduce":
        return 2 * b * (g - 1) / g
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")


# ---------------------------------------------------------------------------------------------------------------
# Census
# ---------------------------------------------------------------------------------------------------------------


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


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")


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


# --- HLO text parsing ------------------------------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->\s*.*)?\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_TRIP_COUNT = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')
_SINGLE_REF = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_MULTI_REF = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")
_HEADER_INT = re.compile(r"\b(num_partitions|replica_count)=(\d+)")

# opcode -> (kind, async start?)
_OPCODES: dict[str, tuple[str, bool]] = {}
for _k in KINDS:
    _OPCODES[_k] = (_k, False)
    _OPCODES[f"{_k}-start"] = (_k, True)


@dataclasses.dataclass
class _Instr:
    name: str
    shape: str
    opcode: str
    attrs: str  # everything after the opcode, quoted strings blanked out
    trip_count: int | None


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
        rest = _COMMENT.sub("", _QUOTED.sub('""', rest))
        shape, tail = _split_shape(rest)
        om = re.match(r"([\w\-]+)\(", tail)
        if om is None:
            continue
        current.instrs.append(_Instr(name, shape, om.group(1), tail[om.end() :], int(trip.group(1)) if trip else None))
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


def _group_size(kind: str, attrs: str, devices: int | None) -> int:
    if kind == "collective-permute":
        m = _PAIRS.search(attrs)
        ids = set(re.findall(r"\d+", m.group(1))) if m else set()
        return len(ids) or 2
    g = parse_replica_group_size(attrs, devices)
    if g is None:
        raise ValueError(f"cannot tell the replica-group size of a {kind} (empty replica_groups, no module header)")
    return g


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
                )
            )
    return Census(tuple(ops), tuple(unknown))


# ---------------------------------------------------------------------------------------------------------------
# Memory and cost
# ---------------------------------------------------------------------------------------------------------------


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


def _first_cost(entries: Iterable[Mapping[str, Any]]) -> Mapping[str, Any]:
    entries = [e for e in entries if e]
    return entries[0] if entries else {}


def cost(compiled: Any) -> dict[str, float]:
    """Flops and bytes accessed of a compiled executable, from ``compiled.cost_analysis()``.

    XLA counts a ``while`` body once, not trip-count times, so these undercount looped programs.

    Args:
        compiled: a ``jax.stages.Compiled``; ``cost_analysis()`` may return a dict or (older JAX) a list of dicts,
            one per executable, of which the first is used.

    Returns:
        ``{"flops", "bytes_accessed", "transcendentals"}`` as floats (0.0 when not reported).
    """
    raw = compiled.cost_analysis()
    if raw is None:
        raw = {}
    elif not isinstance(raw, Mapping):
        raw = _first_cost(raw)
    return {
        "flops": float(raw.get("flops", 0.0)),
        "bytes_accessed": float(raw.get("bytes accessed", 0.0)),
        "transcendentals": float(raw.get("transcendentals", 0.0)),
    }
