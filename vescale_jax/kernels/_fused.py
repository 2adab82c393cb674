"""The launcher of the fused kernels: one program per unit of a :class:`~vescale_jax.kernels._bands.Units`
table, one ``pl.when`` body per unit class, masked power-of-two register blocks.

Each program reads its row ``(src, dst, slot, cls, n)`` of the int32 table (an input, so a per-device table
can be selected at run time), then runs the body of its class: :func:`lanes` gives the body the element
indices of the unit as a power-of-two block and the mask of the lanes inside it; masked lanes point one past
the end of their array (never touched: Triton masks them, the interpreter drops their writes).

Backends: ``"triton"`` (gathers and scatters through pointer blocks, selected by Triton ``CompilerParams``) and
the interpreter. Mosaic GPU copies whole rectangles by TMA and has no per-lane gather or scatter, so it takes
none of these kernels: :func:`resolve` raises ``NotImplementedError`` naming ``backend="triton"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from vescale_jax.kernels._bands import FLAT, UnitClass, Units
from vescale_jax.kernels._ragged import _with_manual_axes

__all__ = ["Lanes", "lanes", "launch", "load", "resolve", "store"]

TRITON_NUM_WARPS = 4
DEFAULT_UNIT = {"interpret": 4096, "triton": 4096}
"""Most elements of one unit's register block, per backend."""


def resolve(interpret: bool | None, backend: str | None, what: str) -> tuple[bool, str]:
    """``(interpret, backend)``: the interpreter on CPU by default, else ``"triton"``.

    Raises:
      NotImplementedError: ``backend="mosaic_gpu"`` (no per-lane gathers in Mosaic GPU's Pallas lowering).
      ValueError: an unknown backend.
    """
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret:
        return True, "interpret"
    backend = backend or "triton"
    if backend == "mosaic_gpu":
        raise NotImplementedError(
            f"{what}: backend='mosaic_gpu' cannot take this kernel (it gathers and scatters per lane: FP8 scales "
            "per column block, tile-major to row-major strides), which Pallas lowers through Triton only. Use "
            "backend='triton' (KernelPolicy.fused_implementation says what runs it on the gather path)."
        )
    if backend != "triton":
        raise ValueError(f"{what}: backend must be 'triton' or 'mosaic_gpu' for a compiled kernel, got {backend!r}.")
    return False, backend


class Lanes:
    """The lanes of one unit: ``src`` / ``dst`` element indices, ``valid`` mask, ``block`` (column block of
    each lane), each of the class's register shape, and ``blocks`` / ``block_valid`` (one lane per column
    block: ``(B,)`` for a band, the lanes themselves for a flat unit)."""

    def __init__(self, cls: UnitClass, src: jax.Array, dst: jax.Array, n: jax.Array, src_end: int, dst_end: int):
        shape = cls.shape
        if cls.kind == FLAT:
            i = jax.lax.iota(jnp.int32, shape[0])
            valid = i < n
            s, d, block = src + i, dst + i, i
            self.blocks, self.block_valid = i, valid
        else:
            r = jax.lax.broadcasted_iota(jnp.int32, shape, 0)
            block = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
            c = jax.lax.broadcasted_iota(jnp.int32, shape, 2)
            col = block * cls.block + c
            valid = (r < cls.rows) & (c < cls.block) & (col < cls.width)
            s, d = src + r * cls.src_stride + col, dst + r * cls.dst_stride + col
            b = jax.lax.iota(jnp.int32, shape[1])
            self.blocks, self.block_valid = b, b * cls.block < cls.width
        self.cls, self.valid, self.block = cls, valid, block
        self.src = jnp.where(valid, s, src_end)
        self.dst = jnp.where(valid, d, dst_end)

    def per_block(self, v: jax.Array) -> jax.Array:
        """A ``(B,)`` per-block value broadcast to the lanes (a flat unit's values are already per lane)."""
        return v if self.cls.kind == FLAT else v[None, :, None]


def lanes(cls: UnitClass, row: Sequence[jax.Array], src_ref: Any, dst_ref: Any) -> Lanes:
    """The :class:`Lanes` of the unit in table row ``row`` reading ``src_ref`` and writing ``dst_ref``."""
    return Lanes(cls, row[0], row[1], row[4], src_ref.shape[0], dst_ref.shape[0])


def load(ref: Any, idx: jax.Array, mask: jax.Array) -> jax.Array:
    """A masked gather load (Triton pointer block; the interpreter's gather); masked lanes read zero."""
    from jax.experimental.pallas import triton as pltriton

    return pltriton.load(ref.at[idx], mask=mask, other=jnp.zeros((), ref.dtype))


def store(ref: Any, idx: jax.Array, val: jax.Array, mask: jax.Array) -> None:
    """A masked scatter store."""
    from jax.experimental.pallas import triton as pltriton

    pltriton.store(ref.at[idx], val.astype(ref.dtype), mask=mask)


Body = Callable[[UnitClass, list[jax.Array], list[Any], list[Any]], None]


def launch(
    units: Units,
    table: jax.Array,
    body: Body,
    ins: Sequence[jax.Array],
    out_shapes: Sequence[jax.ShapeDtypeStruct],
    *,
    interpret: bool,
    zero_init: Sequence[int] = (),
) -> list[jax.Array]:
    """One ``pallas_call`` with a program per unit.

    Args:
      units: the launch's classes (static).
      table: its ``(U, 5)`` int32 table (a traced array: a per-device row of a ``(m, U, 5)`` table).
      body: ``body(cls, row, in_refs, out_refs)`` emits the work of one unit of class ``cls``.
      ins: the inputs (refs in order).
      out_shapes: the outputs.
      interpret: run in the Pallas interpreter (else lower for Triton).
      zero_init: outputs that start as zeros (aliased to a zero input) because no unit writes all of them.

    Returns:
      The outputs.
    """
    n_in, n_out = len(ins), len(out_shapes)
    classes = units.classes
    inits = [jnp.zeros(out_shapes[o].shape, out_shapes[o].dtype) for o in zero_init]

    def kernel(tab_ref, *refs):
        in_refs, out_refs = list(refs[:n_in]), list(refs[len(refs) - n_out :])
        p = pl.program_id(0)
        row = [tab_ref[p * 5 + c] for c in range(5)]
        for c, cls in enumerate(classes):

            @pl.when(row[3] == c)
            def _(cls=cls):
                body(cls, row, in_refs, out_refs)

    kwargs: dict[str, Any] = {"interpret": True} if interpret else {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=TRITON_NUM_WARPS, num_stages=1)
    first = 1 + n_in
    call = pl.pallas_call(
        kernel,
        out_shape=_with_manual_axes(list(out_shapes), [table, *ins]),
        grid=(units.num_units,),
        input_output_aliases={first + r: o for r, o in enumerate(zero_init)},
        **kwargs,
    )
    return list(call(jnp.reshape(table, (-1,)), *ins, *inits))
