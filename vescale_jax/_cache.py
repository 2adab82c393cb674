"""Bounded caches of what is built from a :class:`~vescale_jax.Plan` (jitted functions, routing and layout
tables).

A long-lived process may build many plans (one per model, mesh or re-plan); an unbounded cache keyed by the
plan keeps every plan, its mesh and its tables alive. :func:`plan_cache` is ``functools.lru_cache`` with one
shared bound: the arguments (the plan and the other static options) are the key, so they must be hashable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["PLAN_CACHE_SIZE", "plan_cache"]

PLAN_CACHE_SIZE = 64
"""How many entries each plan-keyed cache keeps (least recently used evicted first)."""

F = TypeVar("F", bound=Callable[..., Any])


def plan_cache(fn: F) -> F:
    """``functools.lru_cache(maxsize=PLAN_CACHE_SIZE)``: ``fn``'s results by its (hashable) arguments.

    Args:
      fn: a pure builder, e.g. ``(plan, block_size) -> tables``.

    Returns:
      The cached function (``cache_info()`` / ``cache_clear()`` as for ``lru_cache``).
    """
    return functools.lru_cache(maxsize=PLAN_CACHE_SIZE)(fn)  # type: ignore[return-value]
