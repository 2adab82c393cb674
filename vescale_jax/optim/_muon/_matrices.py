"""The matrices of Muon leaves and their Newton–Schulz cost.

A *matrix* is one ``(p, q)`` slice of a Muon leaf after the leaf's dimension numbers are applied (a stacked
``(L, p, q)`` leaf is ``L`` matrices). Matrices are stored on their owner with ``p <= q`` (the transpose is folded
into the routing, as Newton–Schulz transposes tall matrices anyway). The cost model counts the multiply-adds of one
Newton–Schulz iteration, whole on one device or split by columns over all of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["MatrixRoute", "matrix_indices", "ns_macs", "split_macs"]


def _normalize(ndim: int, axes: Any) -> tuple[int, ...]:
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    return tuple(int(a) % ndim for a in axes)


def matrix_indices(shape: Sequence[int], reduction_axis: Any, output_axis: Any) -> np.ndarray:
    """Flat logical indices of a leaf arranged ``(batch, p, q)`` as ``optax.contrib.muon`` reshapes it."""
    shape = tuple(shape)
    ndim = len(shape)
    if ndim < 2:
        raise ValueError(f"Muon needs rank >= 2, got shape {shape}")
    red, out = _normalize(ndim, reduction_axis), _normalize(ndim, output_axis)
    if set(red) & set(out):
        raise ValueError(f"reduction axes {red} and output axes {out} overlap for shape {shape}")
    batch = tuple(sorted(set(range(ndim)) - set(red) - set(out)))
    idx = np.arange(math.prod(shape), dtype=np.int64).reshape(shape).transpose(batch + red + out)
    dims = lambda axes: math.prod(shape[a] for a in axes)
    return idx.reshape(dims(batch), dims(red), dims(out))


def ns_macs(p: int, q: int) -> int:
    """Multiply-adds of one Newton–Schulz iteration on a ``(p, q)`` matrix, ``p <= q``: ``X X^T``, ``A A``
    and ``B X``."""
    return 2 * p * p * q + p**3


def split_macs(p: int, q: int, m: int) -> int:
    """Per-device multiply-adds of one iteration on a matrix split by columns over ``m`` devices (the Gram
    products are split, ``A A`` is repeated on every device)."""
    return 2 * p * p * -(-q // m) + p**3


@dataclasses.dataclass(frozen=True)
class MatrixRoute:
    """One matrix: its leaf, batch index, stored shape ``(p, q)`` (``p <= q``), owner and slot.

    ``owner == -1`` marks a *split* matrix: its columns are spread over every device, which run its
    Newton–Schulz together (one ``p x p`` all-reduce per iteration). ``slot`` then indexes the split class.
    """

    leaf: int
    batch: int
    shape: tuple[int, int]
    transposed: bool
    devices: tuple[int, ...]
    owner: int
    slot: int

    @property
    def cost(self) -> int:
        return ns_macs(*self.shape)
