"""What is live at a compiled step's memory peak, buffer by buffer, and a per-MiB account of that peak.

XLA's dump of an optimised module holds the exact answer: ``*after_optimizations-live-range.txt`` gives every
buffer's live range over the schedule, ``*after_optimizations.txt`` the instruction that defines each buffer
(opcode, shape, the JAX ``op_name`` with its named scopes) and ``*after_optimizations-buffer-assignment.txt`` the
allocation and offset each buffer lives at (an argument, an output, the temp block, a constant).
:func:`peak_account` compiles with a temporary dump directory, joins the three and sums the live buffers by
category so that, with two computed remainders, the lines add up to the peak of :func:`vescale_jax.testing.memory`
exactly:

- *not live at the peak*: argument and output allocations that hold no live value at the peak (e.g. an output
  written after it, an argument last read before it);
- *allocator packing*: the temp block (``memory_analysis().temp``) minus the temp buffers live at the peak. XLA
  packs temps at offsets in one block sized by the largest offset + size over the whole schedule, so the block
  can exceed what is live at the schedule's peak (fragmentation: a hole left by a freed buffer too small for the
  next one).

The account is of the schedule position where the most distinct bytes are live. XLA's own "Live ranges at N
(peak)" line sums value sizes, so it counts twice the bytes of an in-place update (the old and the new value of
a donated argument, both listed as live); here bytes of one allocation at one offset count once
(:attr:`LiveBuffer.shared`). Without a buffer assignment in the dump, XLA's line is used.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
import tempfile
from collections.abc import Callable
from typing import Any

from vescale_jax.testing._hlo import _parse_module
from vescale_jax.testing._memory import Memory, memory
from vescale_jax.testing._shapes import _MIB, _split_top, _strip_layout, _tuple_elements, shape_bytes

__all__ = ["LiveBuffer", "PeakAccount", "default_category", "peak_account"]

_PEAK = re.compile(r"^\s*Live ranges at (\d+) \(peak\):")
_LIVE = re.compile(r"^\s+(\S+?): (\d+) bytes")
_RANGE = re.compile(r"^\s+(\S+?):(\d+)-(\d+)\s*$")
_CUMULATIVE = re.compile(r"\(cumulative: (\d+) bytes\)")
_VALUE_NAME = re.compile(r"^([\w.\-]+)\{([\d,\s]*)\}$")
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
_ALLOC_VALUE = re.compile(r"^\s*value: <\d+ ([\w.\-]+)(\{[\d,\s]*\})?(?: \(phi\))? @\d+>")
_PARAM_NUMBER = re.compile(r"\bparameter (\d+)")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)")
_ARG_ROOTS = ("params", "opt_state", "batch")
_COUNTED = ("argument", "output", "temp")  # the allocations memory_analysis() adds up
_COLLECTIVE_OUT = {
    "all-gather": "gathered params",
    "all-gather-start": "gathered params",
    "all-gather-done": "gathered params",
    "reduce-scatter": "reduce-scatter outputs",
    "all-reduce": "other collective outputs",
    "all-reduce-start": "other collective outputs",
    "all-reduce-done": "other collective outputs",
    "all-to-all": "other collective outputs",
    "collective-permute": "other collective outputs",
    "collective-permute-start": "other collective outputs",
    "collective-permute-done": "other collective outputs",
}
_VIEWS = ("bitcast", "copy", "get-tuple-element", "slice", "dynamic-slice", "reshape", "transpose", "fusion")


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """One buffer live at the peak of the schedule.

    Attributes:
        name: the buffer as the live-range dump names it: instruction and shape index, e.g. ``all_gather.3{}``
            or ``while.38{2}`` (element 2 of a loop's state).
        bytes: its size on one device.
        opcode: the defining instruction's opcode (``parameter``, ``all-gather``, ``fusion``, ``while``, ...);
            ``""`` when the instruction was not found in the optimised HLO.
        shape: the buffer's shape without layout (the tuple element for a non-empty shape index).
        op_name: the JAX op name (named scopes included), e.g. ``jit(step)/.../all_gather``; an argument is named
            by its path, e.g. ``params[0]`` or ``opt_state[0].mu[1]``; a loop's state, a ``get-tuple-element`` or
            an unnamed copy is named after what it resolves to (the ``while``, the tuple element, the operand).
        allocation: ``"argument"``, ``"output"``, ``"temp"`` (what ``memory_analysis()`` counts), ``"constant"``,
            ``"thread-local"`` (not counted), or ``"unknown"`` when the buffer assignment did not list it.
        argument: for a buffer in an argument's allocation, that argument's op name (e.g. ``opt_state[0].mu[1]``;
            a donated argument's buffer may hold the updated value at the peak); else ``""``.
        operands: opcodes of the defining instruction's operands.
        in_loop: whether the buffer is a ``while`` loop's state (the loop, its body's parameter or an element of
            either).
        param_shaped: whether its dims equal those of an argument (other than ``batch``), an all-gather result, a
            slice of one or a reduce-scatter operand, or their flattening (how the default categoriser tells a
            gradient from an activation).
        shared: bytes of its memory that a larger (or earlier listed) live buffer also occupies: XLA lists both
            values of an in-place update (a donated argument and the new value written over it) as live; the
            account counts those bytes once, for the other buffer.
        from_gather: whether it is a slice, copy, conversion or single-input fusion of an all-gather result
            (through at most three such steps): a gathered parameter's unpacked or converted copy.
    """

    name: str
    bytes: int
    opcode: str
    shape: str
    op_name: str
    allocation: str
    argument: str = ""
    operands: tuple[str, ...] = ()
    in_loop: bool = False
    param_shaped: bool = False
    shared: int = 0
    from_gather: bool = False

    @property
    def counted(self) -> int:
        """The bytes the account counts for it: ``bytes − shared``."""
        return self.bytes - self.shared


def default_category(buffer: LiveBuffer) -> str:
    """The default category of a live buffer, from its allocation, opcode and op name.

    Args:
        buffer: a :class:`LiveBuffer`.

    Returns:
        ``"params"``, ``"opt_state"``, ``"batch"`` or ``"other arguments"`` for a buffer in an argument's allocation
        (by the argument's root name); ``"outputs"`` for an output allocation; ``"gathered params"`` (all-gather
        results), ``"reduce-scatter outputs"``, ``"other collective outputs"``; ``"gradients"`` for a
        parameter-shaped buffer of the backward pass (an op name under ``transpose(``); ``"loop state / saved
        activations"`` for a loop's state; ``"gathered param copies"`` for a slice, copy, conversion or fusion
        of an all-gather result; ``"constants"``; else ``"other temps"``.
    """
    if buffer.allocation == "argument":
        root = re.split(r"[\[.]", buffer.argument or buffer.op_name, maxsplit=1)[0]
        return root if root in _ARG_ROOTS else "other arguments"
    if buffer.allocation == "output":
        return "outputs"
    if buffer.allocation == "constant":
        return "constants"
    if buffer.opcode in _COLLECTIVE_OUT:
        return _COLLECTIVE_OUT[buffer.opcode]
    if buffer.param_shaped and "transpose(" in buffer.op_name:
        return "gradients"
    if buffer.in_loop:
        return "loop state / saved activations"
    if buffer.from_gather:
        return "gathered param copies"
    return "other temps"


@dataclasses.dataclass(frozen=True)
class PeakAccount:
    """What is live at a compiled step's memory peak, and a per-category account that sums to the peak.

    Attributes:
        memory: the executable's :class:`~vescale_jax.testing.Memory` figures; ``memory.peak`` is what the account
            adds up to.
        buffers: every buffer live at the peak, largest first.
        module: the dumped HLO module the account was read from.
        peak_position: the schedule position accounted for: where the most distinct bytes of argument, output and
            temp allocations are live (XLA's own "(peak)" line, used when the dump has no buffer assignment, sums
            value sizes and so counts an in-place update's bytes twice).
        categorize: the ``(LiveBuffer) -> str`` categoriser :meth:`by_category` uses.
    """

    memory: Memory
    buffers: tuple[LiveBuffer, ...]
    module: str
    peak_position: int
    categorize: Callable[[LiveBuffer], str] = dataclasses.field(default=default_category, compare=False)

    def _live(self, *allocations: str) -> int:
        return sum(b.counted for b in self.buffers if b.allocation in allocations)

    @property
    def live_bytes(self) -> int:
        """Bytes of the live buffers that ``memory_analysis()`` counts (argument, output and temp allocations), each
        byte once (see :attr:`LiveBuffer.shared`)."""
        return self._live(*_COUNTED, "unknown")

    @property
    def packing(self) -> int:
        """Allocator packing: the temp block minus the temp buffers live at the peak (see the module docstring).
        A buffer the buffer assignment did not list is taken as a temp."""
        return self.memory.temp - self._live("temp", "unknown")

    @property
    def not_live(self) -> int:
        """Bytes of argument and output allocations (``argument + output − alias``) that hold no buffer live at the
        peak."""
        return self.memory.argument + self.memory.output - self.memory.alias - self._live("argument", "output")

    @property
    def unaccounted(self) -> int:
        """Bytes of live buffers that could not be joined with an instruction or an allocation (0 when the dump
        parsed)."""
        return sum(b.counted for b in self.buffers if b.allocation == "unknown" or not b.opcode)

    @property
    def uncounted(self) -> int:
        """Bytes of live constants and thread-local buffers, which ``memory_analysis()`` leaves out."""
        return self._live("constant", "thread-local")

    def by_category(self) -> dict[str, int]:
        """Bytes live at the peak by category (the counted allocations only), largest first.

        Returns:
            An ordered ``{category: bytes}``; buffers that could not be joined are under ``"unaccounted"``.
        """
        out: dict[str, int] = {}
        for b in self.buffers:
            if b.allocation not in (*_COUNTED, "unknown"):
                continue
            key = "unaccounted" if b.allocation == "unknown" or not b.opcode else self.categorize(b)
            out[key] = out.get(key, 0) + b.counted
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def rows(self) -> dict[str, int]:
        """The account: categories, then "not live at the peak" and "allocator packing"; sums to ``memory.peak``.

        Returns:
            An ordered ``{line: bytes}`` whose values sum to ``self.memory.peak`` exactly.
        """
        rows = self.by_category()
        rows.setdefault("unaccounted", 0)
        rows["unaccounted"] = rows.pop("unaccounted")
        rows["not live at the peak (arguments/outputs)"] = self.not_live
        rows["allocator packing"] = self.packing
        return rows

    def largest(self, n: int = 10, category: str | None = None) -> tuple[LiveBuffer, ...]:
        """The largest live buffers, optionally of one category.

        Args:
            n: how many.
            category: only buffers the categoriser puts there.

        Returns:
            Up to ``n`` buffers, largest first.
        """
        picked = [b for b in self.buffers if category is None or self.categorize(b) == category]
        return tuple(picked[:n])

    def table(self, *, buffers: int = 0) -> str:
        """The account as a text table in MiB.

        Args:
            buffers: also list this many of the largest live buffers.

        Returns:
            One line per row of :meth:`rows`, then the total (``memory.peak``).
        """
        rows = self.rows()
        width = max(len(k) for k in (*rows, "peak"))
        lines = [f"{k:<{width}}  {v / _MIB:10.3f} MiB" for k, v in rows.items()]
        lines.append(f"{'peak':<{width}}  {self.memory.peak / _MIB:10.3f} MiB")
        if self.uncounted:
            lines.append(f"(live constants / thread-local, outside memory_analysis: {self.uncounted} bytes)")
        for b in self.largest(buffers):
            note = f"  (shares {b.shared / _MIB:.3f} MiB with a larger live buffer)" if b.shared else ""
            lines.append(f"  {b.bytes / _MIB:9.3f} MiB  {b.name}  {b.opcode} {b.shape}  {b.op_name}{note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# --- the dump ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Ins:
    name: str
    computation: str
    entry: bool
    shape: str
    opcode: str
    operands: list[str]
    op_name: str
    calls: list[tuple[str, str]]
    tuple_index: int | None = None
    parameter: int | None = None


def _operands(tail: str) -> tuple[list[str], str]:
    """Operand names of ``opcode(...)`` (the text after the opcode's ``(``) and the attributes after it."""
    depth = 1
    for i, ch in enumerate(tail):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                names = [re.findall(r"%?([\w.\-]+)\s*$", p) for p in _split_top(tail[:i])]
                return [n[0] for n in names if n], tail[i + 1 :]
    return [], tail


def _parse_hlo(text: str) -> dict[str, _Ins]:
    instrs: dict[str, _Ins] = {}
    for comp in _parse_module(text)[0]:
        for instr in comp.instrs:
            operands, attrs = _operands(instr.attrs)
            ins = _Ins(
                instr.name,
                comp.name,
                comp.entry,
                _strip_layout(instr.shape).strip(),
                instr.opcode,
                operands,
                instr.op_name,
                _CALLS.findall(attrs),
            )
            if ins.opcode == "get-tuple-element":
                ti = re.search(r"\bindex=(\d+)", attrs)
                ins.tuple_index = int(ti.group(1)) if ti else None
            if ins.opcode == "parameter":
                pn = re.match(r"\s*(\d+)", instr.attrs)
                ins.parameter = int(pn.group(1)) if pn else None
            instrs[instr.name] = ins
    return instrs


def _element(shape: str, index: tuple[int, ...]) -> str:
    for i in index:
        elements = _tuple_elements(shape)
        if elements is None or i >= len(elements):
            return shape
        shape = elements[i]
    return shape


class _Resolver:
    """Names a buffer after what it holds: through loop parameters, tuple elements and unnamed copies."""

    def __init__(self, instrs: dict[str, _Ins]):
        self.instrs = instrs
        self.by_computation: dict[str, list[_Ins]] = {}
        for ins in instrs.values():
            self.by_computation.setdefault(ins.computation, []).append(ins)
        self.callers: dict[str, list[tuple[str, _Ins]]] = {}
        for ins in instrs.values():
            for attr, callee in ins.calls:
                self.callers.setdefault(callee, []).append((attr, ins))

    def loop_of(self, ins: _Ins) -> _Ins | None:
        """The ``while`` whose body or condition takes ``ins`` (a parameter) as its state."""
        for attr, caller in self.callers.get(ins.computation, []):
            if caller.opcode == "while" and attr in ("body", "condition"):
                return caller
        return None

    def from_gather(self, ins: _Ins, depth: int = 3) -> bool:
        """Whether ``ins`` copies, slices or converts one all-gather result (scalar operands such as a
        dynamic-slice's indices aside), through at most ``depth`` such steps."""
        if ins.opcode not in (*_VIEWS, "convert") or depth == 0:
            return False
        arrays = [self.instrs[o] for o in ins.operands if o in self.instrs and _dims(self.instrs[o].shape) != ()]
        if len(arrays) != 1:
            return False
        (op,) = arrays
        return op.opcode.startswith("all-gather") or self.from_gather(op, depth - 1)

    def in_loop(self, ins: _Ins) -> bool:
        if ins.opcode == "while":
            return True
        if ins.opcode == "parameter" and not ins.entry:
            return self.loop_of(ins) is not None
        if ins.opcode == "get-tuple-element" and ins.operands and ins.operands[0] in self.instrs:
            return self.in_loop(self.instrs[ins.operands[0]])
        return False

    def op_name(self, ins: _Ins, index: tuple[int, ...], depth: int = 0) -> str:
        if depth > 64:
            return ins.op_name
        nxt = None
        if ins.opcode == "parameter" and not ins.entry:
            loop = self.loop_of(ins)
            if loop is not None:
                return loop.op_name or self.op_name(loop, index, depth + 1)
            for _, caller in self.callers.get(ins.computation, []):  # call / conditional: the caller's operand
                if ins.parameter is not None and ins.parameter < len(caller.operands):
                    nxt = (caller.operands[ins.parameter], index)
                    break
        elif ins.opcode == "get-tuple-element" and ins.operands and ins.tuple_index is not None:
            if ins.op_name:
                return ins.op_name
            nxt = (ins.operands[0], (ins.tuple_index, *index))
        elif ins.opcode == "tuple" and index and index[0] < len(ins.operands):
            nxt = (ins.operands[index[0]], index[1:])
        elif not ins.op_name and ins.opcode in ("copy", "bitcast", "copy-start", "copy-done", "while") and ins.operands:
            nxt = (ins.operands[0], index)
        elif not ins.op_name and ins.opcode == "fusion":  # XLA may drop a fusion's metadata: name it by its body
            body = next((c for a, c in ins.calls if a == "calls"), None)
            named = [i.op_name for i in self.by_computation.get(body, ()) if i.op_name]
            return named[-1] if named else ""
        if nxt is not None and nxt[0] in self.instrs:
            return self.op_name(self.instrs[nxt[0]], nxt[1], depth + 1)
        return ins.op_name


def _parse_live(text: str, path: str) -> tuple[int, list[tuple[str, int]]]:
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


@dataclasses.dataclass(frozen=True)
class _Slot:
    kind: str  # argument / output / temp / constant / thread-local
    allocation: int
    offset: int
    size: int
    parameter: int | None  # the entry parameter of an argument allocation


def _parse_assignment(text: str) -> dict[tuple[str, str], _Slot]:
    """``(name, "{index}") -> _Slot``: where the buffer assignment put each value."""
    slots: dict[tuple[str, str], _Slot] = {}
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
            slots[key] = _Slot(kind, index, int(om.group(1)) if om else 0, int(sm.group(1)) if sm else 0, number)
        elif not line.startswith(" "):
            kind = None
    return slots


def _key(name: str) -> tuple[str, str]:
    vm = _VALUE_NAME.match(name)
    return (vm.group(1), "{" + vm.group(2).replace(" ", "") + "}") if vm else (name, "{}")


def _parse_ranges(text: str) -> dict[str, tuple[int, int]]:
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


def _distinct(values: list[tuple[_Slot, int]]) -> int:
    """Bytes the values occupy, each byte of an allocation once."""
    by_allocation: dict[int, list[tuple[int, int]]] = {}
    for slot, size in values:
        by_allocation.setdefault(slot.allocation, []).append((slot.offset, slot.offset + size))
    return sum(b - a for ranges in by_allocation.values() for a, b in _merge(ranges))


def _physical_peak(ranges: dict[str, tuple[int, int]], slots: dict[tuple[str, str], _Slot]) -> int | None:
    """The schedule position where the most distinct bytes of counted (argument, output, temp) allocations are live.

    XLA's own "(peak)" line sums value sizes, so it counts twice the bytes of an in-place update (the old and the new
    value of a donated argument); this position counts them once."""
    counted = [(s, e, slot) for n, (s, e) in ranges.items() if (slot := slots.get(_key(n))) and slot.kind in _COUNTED]
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
        here = _distinct([(slot, slot.size) for s, e, slot in counted if s <= t <= e])
        if here > best:
            best, position = here, t
    return position


def _overlap(covered: list[tuple[int, int]], lo: int, hi: int) -> int:
    """Bytes of ``[lo, hi)`` already in the disjoint intervals ``covered``."""
    return sum(max(0, min(hi, b) - max(lo, a)) for a, b in covered)


def _module_files(directory: str, module_name: str | None) -> tuple[str, str, str | None]:
    """The (live-range, optimised HLO, buffer-assignment) files of the main module in an XLA dump directory."""
    ranges = glob.glob(os.path.join(directory, "*after_optimizations-live-range.txt"))
    if not ranges:
        raise ValueError(
            "the backend wrote no '*after_optimizations-live-range.txt' into the dump directory; peak_account needs "
            "an XLA backend that dumps its buffer live ranges (CPU and GPU do)"
        )
    if module_name:
        named = [p for p in ranges if f".{module_name}." in os.path.basename(p)]
        ranges = named or ranges
    live = max(ranges, key=os.path.getsize)
    stem = live[: -len("-live-range.txt")]
    assignment = stem + "-buffer-assignment.txt"
    return live, stem + ".txt", assignment if os.path.exists(assignment) else None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def peak_account(
    lowered: Any,
    *,
    compiler_options: dict[str, Any] | None = None,
    categorize: Callable[[LiveBuffer], str] | None = None,
) -> PeakAccount:
    """Compile ``lowered`` with an XLA dump and account for its per-device memory peak buffer by buffer.

    Args:
        lowered: a ``jax.stages.Lowered`` (``jax.jit(f).lower(...)``, or ``vj.fsdp``'s ``.lower(...)``).
        compiler_options: further XLA options for the compile (``xla_dump_to`` is set to a temporary directory,
            removed afterwards).
        categorize: ``(LiveBuffer) -> str`` replacing :func:`default_category` in :meth:`PeakAccount.by_category`.

    Returns:
        A :class:`PeakAccount`: ``memory`` (of this compile), the live buffers and ``rows()``, which sum to
        ``memory.peak`` exactly.

    Raises:
        TypeError: if ``lowered`` has no ``.compile``.
        ValueError: if the backend writes no live-range file, or the file has no peak section.
    """
    if not callable(getattr(lowered, "compile", None)):
        raise TypeError(
            f"peak_account needs a jax.stages.Lowered (jax.jit(f).lower(*args)), got {type(lowered).__name__}; "
            "lower the function first"
        )
    with tempfile.TemporaryDirectory(prefix="vj_peak_") as directory:
        compiled = lowered.compile(compiler_options={**(compiler_options or {}), "xla_dump_to": directory})
        text = compiled.as_text()
        text = "\n".join(text) if isinstance(text, list | tuple) else text
        m = re.match(r"\s*HloModule\s+([\w.\-]+)", text or "")
        live_path, hlo_path, assignment_path = _module_files(directory, m.group(1) if m else None)
        live_text = _read(live_path)
        position, live = _parse_live(live_text, os.path.basename(live_path))
        hlo = _read(hlo_path) if os.path.exists(hlo_path) else text
        slots = _parse_assignment(_read(assignment_path)) if assignment_path else {}
        module = os.path.basename(live_path).split(".")[1]
    instrs = _parse_hlo(hlo)
    ranges = _parse_ranges(live_text)
    physical = _physical_peak(ranges, slots)
    if physical is not None:  # the live set at the position with the most distinct bytes, sized as assigned
        position = physical
        live = []
        for name, (s, e) in ranges.items():
            if s <= position <= e:
                slot = slots.get(_key(name))
                live.append((name, slot.size if slot else _value_bytes(instrs, name)))
    resolver = _Resolver(instrs)
    entry_params = {i.parameter: i for i in instrs.values() if i.opcode == "parameter" and i.entry}
    dims = {_dims(i.shape) for i in entry_params.values() if not i.op_name.startswith("batch")}
    for i in instrs.values():
        if i.opcode.startswith("all-gather"):
            dims.add(_dims(_element(i.shape, (1,)) if i.opcode == "all-gather-start" else i.shape))
        elif resolver.from_gather(i):
            dims.add(_dims(i.shape))  # a leaf sliced out of a gathered bucket
        elif i.opcode.startswith("reduce-scatter") and i.operands and i.operands[0] in instrs:
            dims.add(_dims(instrs[i.operands[0]].shape))
    dims.discard(None)
    dims |= {(math.prod(d),) for d in dims}  # and flattened (a leaf's gradient before it is packed)

    buffers = []
    covered: dict[int, list[tuple[int, int]]] = {}  # allocation -> byte ranges of the live buffers seen so far
    for name, size in sorted(live, key=lambda nl: -nl[1]):
        vm = _VALUE_NAME.match(name)
        ins = instrs.get(vm.group(1)) if vm else None
        slot = slots.get(_key(name))
        kind = slot.kind if slot else "unknown"
        if not slots and ins is not None:  # no buffer assignment: entry parameters are arguments, the rest temps
            kind = "argument" if ins.opcode == "parameter" and ins.entry else "temp"
        shared = 0
        if slot is not None:  # two live values in the same bytes (an in-place update) occupy them once
            spans = covered.setdefault(slot.allocation, [])
            shared = _overlap(spans, slot.offset, slot.offset + size)
            spans[:] = _merge([*spans, (slot.offset, slot.offset + size)])
        if ins is None:
            buffers.append(LiveBuffer(name, size, "", "", "", kind, shared=shared))
            continue
        index = tuple(int(x) for x in vm.group(2).split(",") if x.strip())
        shape = _element(ins.shape, index)
        number = slot.parameter if slot else None
        if number is None and ins.opcode == "parameter" and ins.entry:
            number = ins.parameter
        argument = entry_params[number].op_name if kind == "argument" and number in entry_params else ""
        operands = tuple(instrs[o].opcode for o in ins.operands if o in instrs)
        buffers.append(
            LiveBuffer(
                name=name,
                bytes=size,
                opcode=ins.opcode,
                shape=shape,
                op_name=resolver.op_name(ins, index),
                allocation=kind,
                argument=argument,
                operands=operands,
                in_loop=resolver.in_loop(ins),
                param_shaped=_dims(shape) in dims,
                shared=shared,
                from_gather=resolver.from_gather(ins),
            )
        )
    return PeakAccount(memory(compiled), tuple(buffers), module, position, categorize or default_category)


def _value_bytes(instrs: dict[str, _Ins], name: str) -> int:
    """Bytes of a value from its instruction's shape (for a value the buffer assignment does not list)."""
    vm = _VALUE_NAME.match(name)
    ins = instrs.get(vm.group(1)) if vm else None
    if ins is None:
        return 0
    try:
        elements = _element(ins.shape, tuple(int(x) for x in vm.group(2).split(",") if x.strip()))
        return 0 if _tuple_elements(elements) is not None else shape_bytes(elements)
    except ValueError:
        return 0


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _dims(shape: str) -> tuple[int, ...] | None:
    m = re.match(r"\s*[a-z][a-z0-9]*\[([^\]]*)\]", shape)
    if m is None:
        return None
    return tuple(int(d.strip().lstrip("<=")) for d in m.group(1).split(",") if d.strip())
