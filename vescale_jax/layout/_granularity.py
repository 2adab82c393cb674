"""Granularity policies: how big a leaf's atomic block is.

``vj.element()`` (block 1), ``vj.rows(k)`` (``k * shape[-1]`` elements for ndim >= 2, else ``k``) and
``vj.whole()`` (the whole tensor) and ``vj.tiles(bh, bw)`` (one ``bh × bw`` tile of a matrix, stored tile-major:
see :mod:`vescale_jax.layout._tiles`). A device boundary of the flat buffer never cuts a block.

``vj.whole(max_padding=x)`` asks for the whole tensor *where that is cheap*: the planner keeps such leaves
whole while their bucket pads at most ``x`` of its buffer, releasing the largest ones to ``vj.element()``
first (a Muon matrix whole on one device is orthogonalised there with no communication).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Sequence

from vescale_jax.layout import _tiles

__all__ = ["Granularity", "element", "rows", "tiles", "whole"]


@dataclasses.dataclass(frozen=True)
class Granularity:
    """A block policy. Build it with :func:`element`, :func:`rows`, :func:`tiles` or :func:`whole`.

    Attributes:
      kind: ``"element"``, ``"rows"``, ``"tiles"`` or ``"whole"``.
      k: rows per block for ``"rows"``; the tile height ``bh`` for ``"tiles"``.
      bw: the tile width for ``"tiles"``.
      max_padding: for ``"whole"``: ``None`` (always whole) or the bucket padding fraction up to which the
        planner keeps the leaf whole (else it plans it as ``element()``).
    """

    kind: str
    k: int = 1
    max_padding: float | None = None
    bw: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("element", "rows", "whole", "tiles"):
            raise ValueError(
                f"unknown granularity kind {self.kind!r}; use vj.element(), vj.rows(k), vj.tiles(bh, bw), vj.whole()"
            )
        if self.kind == "tiles":
            for name, v in (("bh", self.k), ("bw", self.bw)):
                if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                    raise ValueError(f"vj.tiles(bh, bw): {name} must be an integer >= 1, got {v!r}.")
            object.__setattr__(self, "bw", int(self.bw))
        elif self.bw is not None:
            raise ValueError("bw applies to vj.tiles(bh, bw) only")
        if isinstance(self.k, bool) or not isinstance(self.k, numbers.Integral) or self.k < 1:
            raise ValueError(
                f"vj.rows(k): k (rows of the last dim per block) must be an integer k >= 1, got {self.k!r}. "
                "Use vj.rows(1) for whole rows, vj.element() for no blocking."
            )
        object.__setattr__(self, "k", int(self.k))
        if self.max_padding is not None:
            if self.kind != "whole":
                raise ValueError("max_padding applies to vj.whole() only")
            if isinstance(self.max_padding, bool) or not 0 <= float(self.max_padding) <= 1:
                raise ValueError(f"vj.whole(max_padding=x) needs 0 <= x <= 1, got {self.max_padding!r}")

    def block(self, shape: Sequence[int]) -> int:
        """Block size in elements for a leaf of ``shape`` (at least 1)."""
        size = math.prod(shape)
        if self.kind == "element":
            return 1
        if self.kind == "whole":
            return max(size, 1)
        if self.kind == "tiles":
            segs = _tiles.segments(shape, self)
            return segs[0][1] if segs else self.bw
        return self.k * shape[-1] if len(shape) >= 2 and shape[-1] else self.k

    @property
    def bh(self) -> int:
        """The tile height of ``vj.tiles(bh, bw)`` (``k``)."""
        return self.k

    def segments(self, shape: Sequence[int]) -> tuple[tuple[int, int], ...] | None:
        """``((elements, block), ...)`` of a tile-major leaf's storage segments; None for a uniform block."""
        return _tiles.segments(shape, self)

    @classmethod
    def parse(cls, text: str) -> Granularity:
        """The granularity whose ``repr`` is ``text`` (``"element()"``, ``"rows(4)"``, ``"tiles(8, 8)"``,
        ``"whole()"``, ``"whole(max_padding=0.1)"``), e.g. from :meth:`vescale_jax.Plan.to_dict`."""
        m = re.fullmatch(r"\s*(element|rows|tiles|whole)\((.*)\)\s*", str(text))
        args = [a.strip() for a in m.group(2).split(",")] if m and m.group(2).strip() else []
        try:
            if m and m.group(1) == "element" and not args:
                return element()
            if m and m.group(1) == "rows" and len(args) == 1:
                return rows(int(args[0]))
            if m and m.group(1) == "tiles" and len(args) == 2:
                return tiles(int(args[0]), int(args[1]))
            if m and m.group(1) == "whole" and not args:
                return whole()
            if m and m.group(1) == "whole" and len(args) == 1 and args[0].startswith("max_padding="):
                return whole(max_padding=float(args[0].split("=", 1)[1]))
        except ValueError as e:
            raise ValueError(f"Granularity.parse: {text!r} is not a valid granularity ({e})") from None
        raise ValueError(
            f"Granularity.parse: {text!r} is not a granularity repr; expected element(), rows(k), tiles(bh, bw), "
            "whole() or whole(max_padding=x)."
        )

    def __repr__(self) -> str:
        if self.kind == "rows":
            return f"rows({self.k})"
        if self.kind == "tiles":
            return f"tiles({self.k}, {self.bw})"
        if self.max_padding is not None:
            return f"whole(max_padding={self.max_padding})"
        return f"{self.kind}()"


def element() -> Granularity:
    """Block of one element: devices may split a tensor anywhere."""
    return Granularity("element")


def rows(k: int = 1) -> Granularity:
    """Block of ``k`` rows of the last dim (``k * shape[-1]`` elements); ``k`` elements for ndim <= 1."""
    return Granularity("rows", k)


def tiles(bh: int, bw: int) -> Granularity:
    """Block of one ``bh × bw`` tile of a matrix's last two dims, the matrix stored tile-major in its bucket.

    Each tile is contiguous (row-major inside), so a device boundary falls between tiles and the atomic block
    is ``bh * bw`` elements instead of ``bh`` full rows. Edge tiles may be partial; they are stored after the
    full ones (see :mod:`vescale_jax.layout._tiles`). Leading dims (layers, experts) are tiled independently. A leaf
    of fewer than two dims is stored row-major with blocks of ``bw`` elements. Unpacking such a leaf is a
    relayout (a reshape and a transpose), not a free slice.

    Args:
      bh: tile height (rows of the second-to-last dim).
      bw: tile width (columns of the last dim).
    """
    return Granularity("tiles", bh, bw=bw)


def whole(*, max_padding: float | None = None) -> Granularity:
    """The whole tensor is one block: it lives on exactly one device.

    Args:
      max_padding: keep it whole only while its bucket pads at most this fraction of the buffer; the planner
        releases such leaves (largest first) to ``element()`` until the bucket fits. ``None``: always whole.
    """
    return Granularity("whole", max_padding=max_padding)
