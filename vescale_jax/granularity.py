"""Granularity policies: how big a leaf's atomic block is.

``vj.element()`` (block 1), ``vj.rows(k)`` (``k * shape[-1]`` elements for ndim >= 2, else ``k``) and
``vj.whole()`` (the whole tensor). A device boundary of the flat buffer never cuts a block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["Granularity", "element", "rows", "whole"]


@dataclasses.dataclass(frozen=True)
class Granularity:
    """A block policy. Build it with :func:`element`, :func:`rows` or :func:`whole`.

    Attributes:
      kind: ``"element"``, ``"rows"`` or ``"whole"``.
      k: rows per block for ``"rows"``.
    """

    kind: str
    k: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("element", "rows", "whole"):
            raise ValueError(f"unknown granularity kind {self.kind!r}; use vj.element(), vj.rows(k), vj.whole()")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"vj.rows(k) needs an integer k >= 1, got {self.k!r}")

    def block(self, shape: Sequence[int]) -> int:
        """Block size in elements for a leaf of ``shape`` (at least 1)."""
        size = math.prod(shape)
        if self.kind == "element":
            return 1
        if self.kind == "whole":
            return max(size, 1)
        return self.k * shape[-1] if len(shape) >= 2 and shape[-1] else self.k

    def __repr__(self) -> str:
        return f"rows({self.k})" if self.kind == "rows" else f"{self.kind}()"


def element() -> Granularity:
    """Block of one element: devices may split a tensor anywhere."""
    return Granularity("element")


def rows(k: int = 1) -> Granularity:
    """Block of ``k`` rows of the last dim (``k * shape[-1]`` elements); ``k`` elements for ndim <= 1."""
    return Granularity("rows", k)


def whole() -> Granularity:
    """The whole tensor is one block: it lives on exactly one device."""
    return Granularity("whole")
