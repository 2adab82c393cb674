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

**Dynamic-exponent codes** (:func:`dynamic_code`, the 8-bit optimizer-state code of Dettmers et al.,
"8-bit Optimizers via Block-wise Quantization"): a linear code spends its 256 levels evenly, so values far
below the block's absmax (most of Adam's second moment) round to zero. The dynamic code spends them per
decade instead: for ``e = 0 .. 6`` the decade ``(10^-(e+1), 10^-e]`` holds ``2^(F-e)`` levels at
``10^-e * (0.1 + 0.9 j / 2^(F-e))``, ``j = 1 .. 2^(F-e)`` (``F = 6`` signed, 7 unsigned: the unsigned code
spends the sign bit on magnitude), plus ``0`` and one extra level at ``10^-7`` (``-10^-7`` for the signed
code, so its zero sits at index 128). Every level is an fp32 number; the table contains exactly ``0``, ``1.0``
and (signed) ``-1.0``. With ``y = x / scale`` (fp32, ``scale`` the block's absmax, 1 for an all-zero block)::

    index = #{i : mid[i] < y}     mid = fp32 midpoints of adjacent levels (``np.searchsorted(..., "left")``):
                                  the nearest level; a tie (y exactly on a midpoint) takes the lower level
    code  = index - 128 (int8, signed) | index (uint8, unsigned)     so the zero byte decodes to 0.0
    x'    = table[code] * scale   (fp32)

:func:`dynamic_quantize` / :func:`dynamic_dequantize` are the NumPy reference of that code on a logical array
(tiles of the last two dims, or one element per block); :func:`dynamic_encode` / :func:`dynamic_decode` the
element-wise ``jax.numpy`` halves the optimizers use on their flat shards.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Quantized",
    "dequantize",
    "dynamic_code",
    "dynamic_decode",
    "dynamic_dequantize",
    "dynamic_encode",
    "dynamic_midpoints",
    "dynamic_quantize",
    "num_blocks",
    "qmax",
    "quantize",
]

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


# --------------------------------------------------------------------------------------- dynamic-exponent code
def _dynamic_table(signed: bool) -> np.ndarray:
    frac = 6 if signed else 7
    mags = [10.0**-e * (0.1 + 0.9 * np.arange(1, 2 ** (frac - e) + 1) / 2 ** (frac - e)) for e in range(7)]
    pos = np.concatenate(mags)
    pos[np.argmax(pos)] = 1.0
    levels = [np.zeros(1), pos, -pos, [-1e-7]] if signed else [np.zeros(1), pos, [1e-7]]
    table = np.sort(np.concatenate(levels).astype(np.float32))
    assert table.shape == (256,) and np.all(np.diff(table) > 0)
    return table


_TABLES = {s: _dynamic_table(s) for s in (True, False)}
_MIDS = {s: ((t[:-1].astype(np.float64) + t[1:]) / 2).astype(np.float32) for s, t in _TABLES.items()}


def dynamic_code(signed: bool) -> np.ndarray:
    """The 256 levels of the dynamic-exponent code, ascending, fp32 (see the module docstring).

    Args:
      signed: ``True`` for the signed code (first moments: 128 negative levels, 0, 127 positive), ``False``
        for the unsigned one (second moments: 0 and 255 positive levels).

    Returns:
      ``(256,)`` float32, strictly increasing, containing ``0.0``, ``1.0`` and (signed) ``-1.0``; a copy.
    """
    return _TABLES[bool(signed)].copy()


def dynamic_midpoints(signed: bool) -> np.ndarray:
    """``(255,)`` float32: the fp32-rounded midpoints of adjacent levels of :func:`dynamic_code`."""
    return _MIDS[bool(signed)].copy()


def _offset(signed: bool) -> int:
    return 128 if signed else 0


def dynamic_encode(y: jax.Array, *, signed: bool) -> jax.Array:
    """Codes of normalised values ``y`` (``x / scale``, in ``[-1, 1]``): the nearest level, ties to the lower
    one (``jnp.searchsorted(mid, y, side="left")``); int8 (signed, index - 128) or uint8. Element-wise."""
    index = jnp.searchsorted(jnp.asarray(_MIDS[bool(signed)]), jnp.asarray(y, jnp.float32), side="left")
    return (index - _offset(signed)).astype(jnp.int8 if signed else jnp.uint8)


def dynamic_decode(codes: jax.Array, *, signed: bool) -> jax.Array:
    """The fp32 levels of ``codes`` (from :func:`dynamic_encode`); the zero code decodes to 0.0."""
    index = codes.astype(jnp.int32) + _offset(signed)
    return jnp.take(jnp.asarray(_TABLES[bool(signed)]), index)


def _tile_view(x: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, tuple[int, ...]]:
    bh, bw = block
    *lead, p, q = x.shape
    xp = np.pad(x, [(0, 0)] * len(lead) + [(0, -p % bh), (0, -q % bw)])
    return xp.reshape(*lead, xp.shape[-2] // bh, bh, xp.shape[-1] // bw, bw), xp.shape


def dynamic_quantize(x: Any, *, block: tuple[int, int] | None, signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference of the dynamic-exponent block quantizer on a logical array.

    Args:
      x: a floating array (computed in fp32).
      block: ``(bh, bw)`` tiles of the last two dims (leading dims independent, edge tiles partial), or
        ``None``: every element its own block (scale ``|x|``, code of ``±1.0``: exact).
      signed: the code (:func:`dynamic_code`).

    Returns:
      ``(codes, scales)``: codes in ``x``'s shape (int8 signed, uint8 unsigned), fp32 scales of shape
      ``(*lead, ceil(p/bh), ceil(q/bw))`` (``x``'s shape with ``block=None``), each its block's absmax.
    """
    x = np.asarray(x, np.float32)
    if block is None:
        scales = np.abs(x)
        y = x / np.where(scales > 0, scales, np.float32(1))
    else:
        tiles, padded = _tile_view(x, block)
        scales = np.max(np.abs(tiles), axis=(-3, -1))
        safe = np.where(scales > 0, scales, np.float32(1))
        y = (tiles / safe[..., :, None, :, None]).reshape(padded)[tuple(slice(0, s) for s in x.shape)]
    index = np.searchsorted(_MIDS[bool(signed)], y, side="left")
    return (index - _offset(signed)).astype(np.int8 if signed else np.uint8), scales.astype(np.float32)


def dynamic_dequantize(codes: Any, scales: Any, *, block: tuple[int, int] | None, signed: bool) -> np.ndarray:
    """NumPy reference inverse of :func:`dynamic_quantize`: ``table[code] * scale`` in fp32."""
    codes = np.asarray(codes)
    levels = _TABLES[bool(signed)][codes.astype(np.int64) + _offset(signed)]
    scales = np.asarray(scales, np.float32)
    if block is None:
        return levels * scales
    bh, bw = block
    full = np.repeat(np.repeat(scales, bh, axis=-2), bw, axis=-1)
    return levels * full[..., : codes.shape[-2], : codes.shape[-1]]
