"""Flops and bytes accessed of a compiled executable, from XLA's cost analysis."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["cost"]


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
