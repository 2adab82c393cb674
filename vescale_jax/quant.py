"""Block-wise quantization: one fp32 scale per block, symmetric absmax, int8 or float8_e4m3fn codes.

A *block* is a ``bh × bw`` tile of a matrix's last two dims (leading dims are independent: a stacked
``(L, p, q)`` leaf has tiles per layer), or ``b`` consecutive elements of a vector. Edge tiles may be
partial: their scale is the absmax of the elements they hold. ::

    scale = max|x| over the block * (1/qmax)    (fp32, 1/qmax rounded to fp32; qmax = 127 int8, 448 fp8)
    code  = round(x / scale)                    int8: round half to even, then clipped to [-127, 127]
                                                fp8:  the cast's round-to-nearest-even (|x / scale| <= 448)
    x'    = code * scale                        (dequantize, in fp32, then cast)

A block of zeros has scale 0 and codes 0. Pure ``jax.numpy``: the same on every backend, bit for bit, and
equal to a NumPy implementation of the formulas above (the tests compare against one). The codes keep the
input's logical shape; the scales have one entry per block.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Quantized", "dequantize", "num_blocks", "qmax", "quantize"]

_CODES = {np.dtype(jnp.int8): 127.0, np.dtype(jnp.float8_e4m3fn): 448.0}


def qmax(dtype: Any) -> float:
    """The largest code magnitude of ``dtype`` (127 for int8, 448 for float8_e4m3fn)."""
    d = np.dtype(dtype)
    if d not in _CODES:
        raise ValueError(f"vj.quant: codes must be int8 or float8_e4m3fn, got {d}.")
    return _CODES[d]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized:
    """Block-quantized array: ``codes`` (the input's shape, int8 or float8_e4m3fn) and fp32 ``scales``.

    Attributes:
      codes: the codes, in the logical shape.
      scales: one fp32 scale per block: ``(*lead, ceil(p/bh), ceil(q/bw))`` for tiles of the last two dims,
        ``(ceil(n/b),)`` for a vector.
      block: ``(bh, bw)`` or ``(b,)``.
    """

    codes: jax.Array
    scales: jax.Array
    block: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes and the scales."""
        return self.codes.size * self.codes.dtype.itemsize + self.scales.size * 4


def _check_block(shape: tuple[int, ...], block: Any) -> tuple[int, ...]:
    block = (block,) if isinstance(block, int) else tuple(block)
    if not block or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in block) or len(block) > 2:
        raise ValueError(f"vj.quant: block must be a positive int (vectors) or (bh, bw) (tiles), got {block!r}.")
    if len(block) == 2 and len(shape) < 2:
        raise ValueError(
            f"vj.quant: a {block} tile needs at least 2 dims; the array has shape {shape}. Quantize a vector with "
            "an int block (e.g. block=256)."
        )
    if len(block) == 1 and len(shape) != 1:
        raise ValueError(
            f"vj.quant: block={block[0]} is for vectors; the array has shape {shape}. Use a (bh, bw) tile for the "
            "last two dims (e.g. block=(128, 128))."
        )
    return block


def _blocked(x: jax.Array, block: tuple[int, ...]) -> tuple[jax.Array, tuple[int, ...]]:
    """``x`` zero-padded to whole blocks and reshaped so the block's elements are axes ``-3`` and ``-1`` (tiles)
    or ``-1`` (vectors); with the padded shape."""
    if len(block) == 1:
        (b,) = block
        n = x.shape[0]
        pad = -n % b
        return jnp.pad(x, (0, pad)).reshape(-1, b), (n + pad,)
    bh, bw = block
    *lead, p, q = x.shape
    ph, pw = -p % bh, -q % bw
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, ph), (0, pw)])
    return xp.reshape(*lead, (p + ph) // bh, bh, (q + pw) // bw, bw), xp.shape


def _axes(block: tuple[int, ...]) -> tuple[int, ...]:
    return (-1,) if len(block) == 1 else (-3, -1)


def _expand(scales: jax.Array, block: tuple[int, ...]) -> jax.Array:
    return scales[..., None] if len(block) == 1 else scales[..., :, None, :, None]


def _crop(blocked: jax.Array, padded: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    full = blocked.reshape(padded)
    return full[tuple(slice(0, s) for s in shape)]


def quantize(x: jax.Array, *, block: int | tuple[int, int], dtype: Any = jnp.int8) -> Quantized:
    """Block-wise symmetric absmax quantization (see the module docstring for the exact arithmetic).

    Args:
      x: a floating array; vectors take an int ``block``, arrays of two or more dims a ``(bh, bw)`` tile of
        their last two dims.
      block: ``b`` elements (vectors) or a ``(bh, bw)`` tile; edge blocks may be partial.
      dtype: ``jnp.int8`` or ``jnp.float8_e4m3fn``.

    Returns:
      A :class:`Quantized` with the codes in ``x``'s shape and one fp32 scale per block.

    Raises:
      ValueError: naming the shape, for a block that does not fit the array or an unsupported code dtype.
    """
    q = qmax(dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"vj.quant: quantize a floating array, got {x.dtype} of shape {tuple(x.shape)}.")
    block = _check_block(tuple(x.shape), block)
    xf = jnp.asarray(x, jnp.float32)
    blocked, padded = _blocked(xf, block)
    # times the fp32 reciprocal (exactly rounded everywhere; XLA may rewrite a division by a constant)
    scales = jnp.max(jnp.abs(blocked), axis=_axes(block)) * np.float32(1.0 / q)
    safe = jnp.where(scales > 0, scales, jnp.float32(1))
    y = blocked / _expand(safe, block)
    if np.dtype(dtype) == np.dtype(jnp.int8):
        codes = jnp.clip(jnp.round(y), -q, q).astype(jnp.int8)
    else:
        codes = y.astype(dtype)
    return Quantized(_crop(codes, padded, tuple(x.shape)), scales, block)


def dequantize(q: Quantized, *, dtype: Any = jnp.float32) -> jax.Array:
    """``codes * scale`` per block, computed in fp32 and cast to ``dtype``.

    Args:
      q: a :class:`Quantized`.
      dtype: the result's dtype.

    Returns:
      An array of ``q.shape``.
    """
    shape = q.shape
    blocked, padded = _blocked(q.codes.astype(jnp.float32), q.block)
    return _crop(blocked * _expand(q.scales, q.block), padded, shape).astype(dtype)


def num_blocks(shape: tuple[int, ...], block: int | tuple[int, int]) -> int:
    """How many blocks (scales) an array of ``shape`` has."""
    block = _check_block(tuple(shape), block)
    if len(block) == 1:
        return -(-shape[0] // block[0])
    *lead, p, q = shape
    return math.prod(lead) * -(-p // block[0]) * -(-q // block[1])
