"""The instructions of an optimised HLO module as XLA dumps it, and what each buffer holds.

:func:`parse_instructions` reads ``*after_optimizations.txt`` into one :class:`Ins` per instruction (computation,
shape, opcode, operands, the JAX ``op_name``, the computations it calls). :class:`Resolver` follows loop parameters,
tuple elements and unnamed copies to name a buffer after what it holds, tells a ``while`` loop's state and a copy of
an all-gather result. :data:`VALUE_NAME` splits a buffer name such as ``while.38{2}`` into the instruction and its
shape index; :func:`value_bytes` sizes a value from its instruction's shape.
"""

from __future__ import annotations

import dataclasses
import re

from vescale_jax.testing._hlo import _parse_module
from vescale_jax.testing._shapes import _split_top, _strip_layout, _tuple_elements, shape_bytes

__all__ = ["VALUE_NAME", "Ins", "Resolver", "parse_instructions", "shape_dims", "tuple_element", "value_bytes"]

VALUE_NAME = re.compile(r"^([\w.\-]+)\{([\d,\s]*)\}$")
_CALLS = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)")
_VIEWS = ("bitcast", "copy", "get-tuple-element", "slice", "dynamic-slice", "reshape", "transpose", "fusion")


@dataclasses.dataclass
class Ins:
    """One instruction of the dump: its computation (the entry or not), shape without layout, opcode, operand
    names, JAX ``op_name``, the computations it calls (``(attribute, name)``), a ``get-tuple-element``'s index and
    a ``parameter``'s number."""

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


def parse_instructions(text: str) -> dict[str, Ins]:
    """Every instruction of an optimised HLO module's text, by name."""
    instrs: dict[str, Ins] = {}
    for comp in _parse_module(text)[0]:
        for instr in comp.instrs:
            operands, attrs = _operands(instr.attrs)
            ins = Ins(
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


def tuple_element(shape: str, index: tuple[int, ...]) -> str:
    """The shape of element ``index`` of a tuple shape, followed as far as the tuple goes."""
    for i in index:
        elements = _tuple_elements(shape)
        if elements is None or i >= len(elements):
            return shape
        shape = elements[i]
    return shape


class Resolver:
    """Names a buffer after what it holds: through loop parameters, tuple elements and unnamed copies."""

    def __init__(self, instrs: dict[str, Ins]):
        self.instrs = instrs
        self.by_computation: dict[str, list[Ins]] = {}
        for ins in instrs.values():
            self.by_computation.setdefault(ins.computation, []).append(ins)
        self.callers: dict[str, list[tuple[str, Ins]]] = {}
        for ins in instrs.values():
            for attr, callee in ins.calls:
                self.callers.setdefault(callee, []).append((attr, ins))

    def loop_of(self, ins: Ins) -> Ins | None:
        """The ``while`` whose body or condition takes ``ins`` (a parameter) as its state."""
        for attr, caller in self.callers.get(ins.computation, []):
            if caller.opcode == "while" and attr in ("body", "condition"):
                return caller
        return None

    def from_gather(self, ins: Ins, depth: int = 3) -> bool:
        """Whether ``ins`` copies, slices or converts one all-gather result (scalar operands such as a
        dynamic-slice's indices aside), through at most ``depth`` such steps."""
        if ins.opcode not in (*_VIEWS, "convert") or depth == 0:
            return False
        arrays = [self.instrs[o] for o in ins.operands if o in self.instrs and shape_dims(self.instrs[o].shape) != ()]
        if len(arrays) != 1:
            return False
        (op,) = arrays
        return op.opcode.startswith("all-gather") or self.from_gather(op, depth - 1)

    def in_loop(self, ins: Ins) -> bool:
        if ins.opcode == "while":
            return True
        if ins.opcode == "parameter" and not ins.entry:
            return self.loop_of(ins) is not None
        if ins.opcode == "get-tuple-element" and ins.operands and ins.operands[0] in self.instrs:
            return self.in_loop(self.instrs[ins.operands[0]])
        return False

    def op_name(self, ins: Ins, index: tuple[int, ...], depth: int = 0) -> str:
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


def value_bytes(instrs: dict[str, Ins], name: str) -> int:
    """Bytes of a value from its instruction's shape (for a value the buffer assignment does not list)."""
    vm = VALUE_NAME.match(name)
    ins = instrs.get(vm.group(1)) if vm else None
    if ins is None:
        return 0
    try:
        elements = tuple_element(ins.shape, tuple(int(x) for x in vm.group(2).split(",") if x.strip()))
        return 0 if _tuple_elements(elements) is not None else shape_bytes(elements)
    except ValueError:
        return 0


def shape_dims(shape: str) -> tuple[int, ...] | None:
    """The dims of an array shape string (``f32[8,16]`` -> ``(8, 16)``); None for a tuple shape."""
    m = re.match(r"\s*[a-z][a-z0-9]*\[([^\]]*)\]", shape)
    if m is None:
        return None
    return tuple(int(d.strip().lstrip("<=")) for d in m.group(1).split(",") if d.strip())
