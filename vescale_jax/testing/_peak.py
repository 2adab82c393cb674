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

This module holds the account and the join; the three files are parsed by :mod:`._dump_live_ranges`,
:mod:`._dump_instructions` and :mod:`._dump_buffer_assignment`.
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

from vescale_jax.testing._dump_buffer_assignment import COUNTED, merge_spans, overlap, parse_assignment, value_key
from vescale_jax.testing._dump_instructions import (
    VALUE_NAME,
    Resolver,
    parse_instructions,
    shape_dims,
    tuple_element,
    value_bytes,
)
from vescale_jax.testing._dump_live_ranges import parse_live, parse_ranges, physical_peak
from vescale_jax.testing._memory import Memory, memory
from vescale_jax.testing._shapes import _MIB

__all__ = ["LiveBuffer", "PeakAccount", "default_category", "peak_account"]

_ARG_ROOTS = ("params", "opt_state", "batch")
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
        return self._live(*COUNTED, "unknown")

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
            if b.allocation not in (*COUNTED, "unknown"):
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


# --- the compile and the join --------------------------------------------------------------------------------


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
        position, live = parse_live(live_text, os.path.basename(live_path))
        hlo = _read(hlo_path) if os.path.exists(hlo_path) else text
        slots = parse_assignment(_read(assignment_path)) if assignment_path else {}
        module = os.path.basename(live_path).split(".")[1]
    instrs = parse_instructions(hlo)
    ranges = parse_ranges(live_text)
    physical = physical_peak(ranges, slots)
    if physical is not None:  # the live set at the position with the most distinct bytes, sized as assigned
        position = physical
        live = []
        for name, (s, e) in ranges.items():
            if s <= position <= e:
                slot = slots.get(value_key(name))
                live.append((name, slot.size if slot else value_bytes(instrs, name)))
    resolver = Resolver(instrs)
    entry_params = {i.parameter: i for i in instrs.values() if i.opcode == "parameter" and i.entry}
    dims = {shape_dims(i.shape) for i in entry_params.values() if not i.op_name.startswith("batch")}
    for i in instrs.values():
        if i.opcode.startswith("all-gather"):
            dims.add(shape_dims(tuple_element(i.shape, (1,)) if i.opcode == "all-gather-start" else i.shape))
        elif resolver.from_gather(i):
            dims.add(shape_dims(i.shape))  # a leaf sliced out of a gathered bucket
        elif i.opcode.startswith("reduce-scatter") and i.operands and i.operands[0] in instrs:
            dims.add(shape_dims(instrs[i.operands[0]].shape))
    dims.discard(None)
    dims |= {(math.prod(d),) for d in dims}  # and flattened (a leaf's gradient before it is packed)

    buffers = []
    covered: dict[int, list[tuple[int, int]]] = {}  # allocation -> byte ranges of the live buffers seen so far
    for name, size in sorted(live, key=lambda nl: -nl[1]):
        vm = VALUE_NAME.match(name)
        ins = instrs.get(vm.group(1)) if vm else None
        slot = slots.get(value_key(name))
        kind = slot.kind if slot else "unknown"
        if not slots and ins is not None:  # no buffer assignment: entry parameters are arguments, the rest temps
            kind = "argument" if ins.opcode == "parameter" and ins.entry else "temp"
        shared = 0
        if slot is not None:  # two live values in the same bytes (an in-place update) occupy them once
            spans = covered.setdefault(slot.allocation, [])
            shared = overlap(spans, slot.offset, slot.offset + size)
            spans[:] = merge_spans([*spans, (slot.offset, slot.offset + size)])
        if ins is None:
            buffers.append(LiveBuffer(name, size, "", "", "", kind, shared=shared))
            continue
        index = tuple(int(x) for x in vm.group(2).split(",") if x.strip())
        shape = tuple_element(ins.shape, index)
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
                param_shaped=shape_dims(shape) in dims,
                shared=shared,
                from_gather=resolver.from_gather(ins),
            )
        )
    return PeakAccount(memory(compiled), tuple(buffers), module, position, categorize or default_category)
