"""HLO shape strings: bits per element type, byte sizes (tuples summed), layouts stripped."""

from __future__ import annotations

import math
import re

__all__ = ["shape_bytes"]


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
