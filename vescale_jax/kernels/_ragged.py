"""Pallas kernels that pack a bucket's tensors into its flat buffer and unpack them back, one launch each.

``pack``: leaves -> ``(total_size,)`` buffer, leaf ``i`` flattened row-major at ``layout.offsets[i]``, every
padding element written as zero, with an optional fused scale and cast (gradients -> reduce dtype).
``unpack``: buffer -> leaves, with an optional fused cast (fp32 master -> bf16 compute). Each sits beside a
plain-jnp ``*_reference`` (what XLA does on its own: a concatenate, static slices) that the tests compare to.

How: a static schedule (:mod:`vescale_jax.kernels.schedule`) splits the copy into power-of-two windows; the
grid has one program per window, and each program finds its segment by a binary tree of ``pl.when`` on the
program id (``log2(#segments)`` scalar compares), then copies one window from the leaf's own ref: leaves are
never concatenated by XLA first. Windows never cross a segment's ends, so nothing is masked.

Backends (``backend=``): ``"triton"`` (register copies with the cast and scale fused; selected by Triton
``CompilerParams``, deprecated from JAX 0.11 but still lowered), ``"mosaic_gpu"`` (TMA bulk copies
GMEM -> SMEM -> GMEM; plain copies only, every offset and size a multiple of 16 bytes), ``"xla"`` (the
reference). ``interpret=True`` (the default on CPU) runs the Triton-style body in the Pallas interpreter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from vescale_jax._compat import mosaic_gpu_pallas_call
from vescale_jax.kernels._reference import (
    Scale,
    _check_leaves,
    _check_unpack,
    _convert,
    _leaf_dtype,
    pack_reference,
    unpack_reference,
)
from vescale_jax.kernels._schedule import ZERO, Schedule, pack_schedule, unpack_schedule
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = [
    "DEFAULT_CHUNK",
    "Backend",
    "choose_backend",
    "gpu_backends_available",
    "pack",
    "pack_reference",
    "refusal",
    "unpack",
    "unpack_reference",
]

Backend = Literal["triton", "mosaic_gpu", "xla"]
BACKENDS = ("triton", "mosaic_gpu")
"""The compiled GPU lowerings."""
Dispatch = Literal["grid", "serial"]

DEFAULT_CHUNK = {"interpret": 1024, "triton": 8192, "mosaic_gpu": 8192}
"""Largest window (elements) one program copies, per backend."""
TRITON_NUM_WARPS = 8
_MAX_ELEMENTS = 2**31 - 1  # window offsets are int32


# ----------------------------------------------------------------------------------------------------------
# Backend choice


def choose_backend(
    layout: BucketLayout,
    src_dtype: Any,
    dst_dtype: Any,
    *,
    scaled: bool = False,
    platform: str | None = None,
    backend: str = "triton",
) -> Backend:
    """Which implementation a hot path should use for one bucket.

    ``"xla"`` on CPU (the kernels only run interpreted there) and whenever a kernel cannot take the bucket
    (empty, or past the kernels' int32 offsets); on GPU ``backend``, with ``mosaic_gpu`` falling back to
    ``triton`` for casts, scales or offsets and sizes that are not multiples of 16 bytes.

    Args:
      layout: the bucket layout.
      src_dtype: dtype read (leaves for pack, the buffer for unpack).
      dst_dtype: dtype written.
      scaled: whether a scale is fused.
      platform: ``jax.default_backend()`` if None.
      backend: the preferred GPU lowering, ``"triton"`` or ``"mosaic_gpu"`` (e.g.
        :attr:`vescale_jax.kernels.KernelPolicy.backend`).

    Returns:
      ``"xla"``, ``"triton"`` or ``"mosaic_gpu"``.
    """
    platform = jax.default_backend() if platform is None else platform
    if platform not in ("gpu", "cuda") or layout.total_size > _MAX_ELEMENTS or not layout.total_size:
        return "xla"
    if backend not in BACKENDS:
        raise ValueError(f"choose_backend: backend={backend!r}; use one of {BACKENDS}.")
    if backend == "mosaic_gpu" and refusal(layout, src_dtype, dst_dtype, backend=backend, scaled=scaled):
        return "triton"
    return backend  # type: ignore[return-value]


WARPGROUP_BYTES = 128
"""Mosaic GPU copies a multiple of a warpgroup's 128 bytes per TMA transfer."""


def _mosaic_refusal(
    sizes: Sequence[int], offsets: Sequence[int], total: int | None, src: Any, dst: Any, scaled: bool
) -> str:
    """Why the TMA kernel cannot copy these runs ("" when it can): a JAX that does not lower it, else
    :func:`_mosaic_layout_refusal`."""
    if not mosaic_gpu_pallas_call():
        return (
            f"this JAX ({jax.__version__}) has no pallas_call lowering for Mosaic GPU (from JAX 0.11 Mosaic GPU "
            "kernels run through plgpu.kernel only)"
        )
    return _mosaic_layout_refusal(sizes, offsets, total, src, dst, scaled)


def _mosaic_layout_refusal(
    sizes: Sequence[int], offsets: Sequence[int], total: int | None, src: Any, dst: Any, scaled: bool
) -> str:
    """Why the TMA copies cannot move these runs ("" when they can): no cast or scale; every offset and size a
    multiple of 16 bytes; every run (leaf, and padding gap when ``total`` is given) at least 128 bytes, so its
    power-of-two windows move a multiple of a warpgroup's 128 bytes."""
    if scaled or np.dtype(src) != np.dtype(dst):
        return f"a fused {'scale' if scaled else 'cast'} ({np.dtype(src).name} -> {np.dtype(dst).name}); it copies only"
    item = np.dtype(src).itemsize
    q, least = max(1, 16 // item), max(1, WARPGROUP_BYTES // item)
    for i, (n, o) in enumerate(zip(sizes, offsets, strict=True)):
        if n and (n % q or o % q):
            return f"leaf {i} ({n} elements at offset {o}) is not 16-byte aligned (plan with align_bytes=128)"
        if n and n < least:
            return f"leaf {i} has {n * item} bytes, under a warpgroup's {WARPGROUP_BYTES}"
    if total is not None:
        ends = sorted((o, o + n) for n, o in zip(sizes, offsets, strict=True) if n)
        cursor = 0
        for start, end in [*ends, (total, total)]:
            if 0 < start - cursor < least:
                return (
                    f"a padding gap of {(start - cursor) * item} bytes at element {cursor} is under a warpgroup's "
                    f"{WARPGROUP_BYTES} (plan with align_bytes=128 and leaves of multiples of 128 bytes)"
                )
            cursor = max(cursor, end)
    return ""


def refusal(layout: BucketLayout, src_dtype: Any, dst_dtype: Any, *, backend: str, scaled: bool = False) -> str:
    """Why the compiled ``backend`` kernel cannot pack or unpack this bucket; ``""`` when it can.

    ``triton``: buckets past the kernels' int32 offsets. ``mosaic_gpu``: also a JAX whose ``pallas_call`` has no
    Mosaic GPU lowering (0.11 and later), casts and scales, offsets or sizes that are not multiples of 16 bytes, and
    leaves or padding gaps under 128 bytes (each TMA transfer moves a multiple of a warpgroup's 128 bytes).
    """
    if layout.total_size > _MAX_ELEMENTS:
        return f"{layout.total_size} elements exceed the kernels' int32 offsets (split the bucket)"
    if backend == "mosaic_gpu":
        return _mosaic_refusal(layout.sizes, layout.offsets, layout.total_size, src_dtype, dst_dtype, scaled)
    return ""


def _resolve(interpret: bool | None, backend: str | None) -> tuple[bool, str]:
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret:
        return True, "interpret"
    backend = backend or "triton"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'triton' or 'mosaic_gpu' for a compiled kernel, got {backend!r}.")
    return False, backend


def _chunk(chunk: int | None, backend: str, dtype: Any) -> int:
    """The window width; a ``mosaic_gpu`` window must move a multiple of a warpgroup's 128 bytes."""
    chunk = chunk or DEFAULT_CHUNK[backend]
    item = np.dtype(dtype).itemsize
    if backend == "mosaic_gpu" and (chunk * item) % WARPGROUP_BYTES:
        raise ValueError(
            f"mosaic_gpu: chunk={chunk} moves {chunk * item} bytes per window; each TMA transfer must be a "
            f"multiple of {WARPGROUP_BYTES} bytes (chunk >= {WARPGROUP_BYTES // item})."
        )
    return chunk


def _serial(dispatch: str | None, interpret: bool, backend: str) -> bool:
    if dispatch not in (None, "grid", "serial"):
        raise ValueError(f"dispatch must be 'grid' or 'serial', got {dispatch!r}.")
    if dispatch == "serial" and backend == "mosaic_gpu":
        raise ValueError("dispatch='serial' is for the interpreter and Triton, not mosaic_gpu.")
    return dispatch == "serial" or (dispatch is None and interpret)


# ----------------------------------------------------------------------------------------------------------
# Kernel bodies


def _dispatch_tree(pid: jax.Array, starts: Sequence[int], emit, lo: int, hi: int) -> None:
    """Calls ``emit(j, pid - starts[j])`` for the segment ``j`` holding ``pid`` (a binary tree of pl.when)."""
    if hi - lo == 1:
        emit(lo, pid - starts[lo])
        return
    mid = (lo + hi) // 2

    @pl.when(pid < starts[mid])
    def _():
        _dispatch_tree(pid, starts, emit, lo, mid)

    @pl.when(pid >= starts[mid])
    def _():
        _dispatch_tree(pid, starts, emit, mid, hi)


def _dispatch(schedule: Schedule, copy, serial: bool) -> None:
    """Calls ``copy(j, offset, width)`` for the piece(s) of segment ``j`` this program copies.

    ``serial=False`` (the GPU kernel): the grid has one program per window; each finds its segment by
    :func:`_dispatch_tree` and copies one window (:func:`_window`). ``serial=True`` (the interpreter's
    default): a single program copies each segment whole by one static slice; XLA:CPU compiles that in a
    fraction of the time of a tree of conds per grid step.
    """
    if serial:
        for j, seg in enumerate(schedule.segments):
            copy(j, 0, seg.length)
        return
    emit = lambda j, k: _window(schedule.segments[j], k, lambda off: copy(j, off, schedule.segments[j].width))
    _dispatch_tree(pl.program_id(0), schedule.starts, emit, 0, len(schedule.segments))


def _window(seg, k: jax.Array, copy) -> None:
    """Calls ``copy(offset)`` for window ``k`` of ``seg``: ``k * width`` (alignment-hinted) or the static tail."""
    w = seg.width
    if seg.num_windows == 1:  # then length == width
        copy(0)
        return
    if seg.num_full:

        @pl.when(k < seg.num_full)
        def _():
            copy(pl.multiple_of(k * w, w))

    if seg.has_tail:

        @pl.when(k >= seg.num_full)
        def _():
            copy(seg.length - w)


def _register_body(schedule: Schedule, n_in: int, n_out: int, out_dtypes, scale: Any, scale_is_ref: bool, serial: bool):
    """Triton / interpreter body: load a window into registers, scale and cast, store it."""

    def kernel(*refs):
        in_refs = refs[:n_in]
        scale_val = refs[n_in][0] if scale_is_ref else scale
        out_refs = refs[len(refs) - n_out :]

        def copy(j, off, width):
            seg = schedule.segments[j]
            dtype = out_dtypes[seg.dst]
            if seg.src == ZERO:
                val = jnp.zeros((width,), dtype)
            else:
                val = _convert(in_refs[seg.src][pl.ds(seg.src_start + off, width)], dtype, scale_val)
            dst = seg.dst_start + off
            if not isinstance(off, int) and seg.dst_start:  # a Triton vectorisation hint
                dst = pl.multiple_of(dst, math.gcd(seg.dst_start, width))
            out_refs[seg.dst][pl.ds(dst, width)] = val

        _dispatch(schedule, copy, serial)

    return kernel


def _tma_body(schedule: Schedule, n_in: int, n_out: int):
    """Mosaic GPU body: TMA bulk copy of a window GMEM -> SMEM -> GMEM (inputs: sources, then a zero source)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(*refs):
        in_refs, zero_ref = refs[:n_in], refs[n_in]
        out_refs = refs[len(refs) - n_out - 2 : len(refs) - 2]
        smem, barrier = refs[-2], refs[-1]
        oob = getattr(plgpu, "OOBFillMode", None)
        in_bounds = {} if oob is None else {"oob_mode": oob.PROMISE_IN_BOUNDS}

        def copy(j, off, w):
            seg = schedule.segments[j]
            src = zero_ref.at[pl.ds(0, w)] if seg.src == ZERO else in_refs[seg.src].at[pl.ds(seg.src_start + off, w)]
            buf = smem.at[pl.ds(0, w)]
            # Windows never leave their arrays: promising it selects the plain bulk copy (cp.async.bulk, any
            # length) over the tiled TMA path (<= 256 elements per dim).
            plgpu.copy_gmem_to_smem(src, buf, barrier, **in_bounds)
            plgpu.barrier_wait(barrier)
            plgpu.copy_smem_to_gmem(buf, out_refs[seg.dst].at[pl.ds(seg.dst_start + off, w)])
            plgpu.wait_smem_to_gmem(0)

        _dispatch(schedule, copy, serial=False)

    return kernel


# ----------------------------------------------------------------------------------------------------------
# Launch


def _launch(
    schedule: Schedule,
    srcs: list[jax.Array],
    out_shapes: list[jax.ShapeDtypeStruct],
    *,
    interpret: bool,
    backend: str,
    scale: Scale,
    into: Sequence[jax.Array] = (),
    serial: bool = False,
) -> list[jax.Array]:
    """One ``pallas_call`` with a program per window.

    The kernel's refs are ``srcs``, extras (scale or zero source), ``into`` (aliased to the outputs, never
    read), the outputs, then scratch.
    """
    n_src, n_out = len(srcs), len(out_shapes)
    extra: list[jax.Array] = []
    if backend == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        dtype = out_shapes[0].dtype
        if scale is not None or any(s.dtype != dtype for s in out_shapes) or any(x.dtype != dtype for x in srcs):
            raise NotImplementedError("mosaic_gpu: casts and scales are not fused; use backend='triton'.")
        width = max(s.width for s in schedule.segments)
        extra = [jnp.zeros((width,), dtype)]
        kernel = _tma_body(schedule, n_src, n_out)
        gmem = pl.BlockSpec(memory_space=plgpu.GMEM)
        kwargs: dict[str, Any] = dict(
            in_specs=[gmem] * (n_src + 1 + len(into)),
            out_specs=[gmem] * n_out,
            scratch_shapes=[plgpu.SMEM((width,), dtype), plgpu.Barrier()],
            compiler_params=plgpu.CompilerParams(),
        )
    else:
        static = scale is None or isinstance(scale, int | float | np.generic)
        if not static:
            extra = [jnp.reshape(jnp.asarray(scale), (1,)).astype(jnp.float32)]
        static_scale = None if scale is None or not static else float(scale)
        kernel = _register_body(schedule, n_src, n_out, [s.dtype for s in out_shapes], static_scale, not static, serial)
        kwargs = {"interpret": True} if interpret else {}
        if backend == "triton" and not interpret:
            from jax.experimental.pallas import triton as pltriton

            kwargs["compiler_params"] = pltriton.CompilerParams(num_warps=TRITON_NUM_WARPS, num_stages=1)
    first = n_src + len(extra)
    call = pl.pallas_call(
        kernel,
        out_shape=_with_manual_axes(out_shapes, srcs),
        grid=(1 if serial else schedule.num_programs,),
        input_output_aliases={first + r: r for r in range(len(into))},
        **kwargs,
    )
    return list(call(*srcs, *extra, *into))


def _with_manual_axes(out_shapes: list[jax.ShapeDtypeStruct], srcs: list[jax.Array]) -> list[jax.ShapeDtypeStruct]:
    """Inside ``shard_map`` (with ``check_vma``) outputs vary over the same mesh axes as the inputs."""
    mats = [getattr(jax.typeof(x), "manual_axis_type", None) for x in srcs]
    mats = [t for t in mats if t is not None]
    if not mats:
        return out_shapes
    mat = max(mats, key=lambda t: len(getattr(t, "varying", ())))
    try:
        return [jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=mat) for s in out_shapes]
    except TypeError:  # a JAX without the argument
        return out_shapes


# ----------------------------------------------------------------------------------------------------------
# Public API


def pack(
    leaves: Sequence[jax.Array],
    layout: BucketLayout,
    *,
    dtype: Any = None,
    scale: Scale = None,
    out: jax.Array | None = None,
    interpret: bool | None = None,
    backend: str | None = None,
    chunk: int | None = None,
    dispatch: Dispatch | None = None,
) -> jax.Array:
    """Packs a bucket's leaves into its flat buffer in one kernel launch; padding is written as zero.

    Args:
      leaves: one array per layout slot (any shape with ``layout.sizes[i]`` elements), read in place.
      layout: the bucket layout (``offsets``, ``sizes``, ``total_size``).
      dtype: buffer dtype (default: the leaves' common dtype); the cast is fused.
      scale: fused multiplier (Python float, baked in; or a scalar array, read at run time), applied in float32
        (or wider) before the cast.
      out: a ``(total_size,)`` buffer of ``dtype`` to write into (aliased: donate it under jit to reuse it).
        Every element is overwritten.
      interpret: run in the Pallas interpreter; None means ``jax.default_backend() == "cpu"``.
      backend: ``"triton"`` (default) or ``"mosaic_gpu"`` when compiled; ``mosaic_gpu`` takes plain copies with
        16-byte aligned offsets and sizes only.
      chunk: largest window per program (a power of two; default per backend, ``DEFAULT_CHUNK``).
      dispatch: ``"grid"`` (one program per window, the GPU kernel) or ``"serial"`` (one program looping over
        the windows: the same copies, compiled much faster by the interpreter). Default: serial when
        interpreting, else grid.

    Returns:
      The ``(layout.total_size,)`` buffer; leaf ``i`` flattened at ``layout.offsets[i]``.
    """
    _check_leaves(leaves, layout, "pack")
    dtype = _leaf_dtype(leaves, dtype)
    if out is not None and (tuple(out.shape) != (layout.total_size,) or out.dtype != dtype):
        raise ValueError(f"pack: out= must be ({layout.total_size},) {dtype.name}, got {out.shape} {out.dtype}.")
    if layout.total_size > _MAX_ELEMENTS:
        raise ValueError(f"pack: {layout.total_size} elements exceed the kernel's int32 offsets; split the bucket.")
    if not layout.total_size:
        return jnp.zeros((0,), dtype)
    interpret, backend = _resolve(interpret, backend)
    # what the backend cannot do at all comes before a window width it would need
    why = refusal(layout, leaves[0].dtype, dtype, backend=backend, scaled=scale is not None)
    if backend == "mosaic_gpu" and why:
        raise NotImplementedError(f"mosaic_gpu pack: {why}; use backend='triton'.")
    chunk = _chunk(chunk, backend, dtype)
    schedule = pack_schedule(layout.sizes, layout.offsets, layout.total_size, chunk=chunk)
    used = [i for i, n in enumerate(layout.sizes) if n]
    index = {i: r for r, i in enumerate(used)}
    schedule = _remap(schedule, src=index)
    (buf,) = _launch(
        schedule,
        [jnp.reshape(leaves[i], (layout.sizes[i],)) for i in used],
        [jax.ShapeDtypeStruct((layout.total_size,), dtype)],
        interpret=interpret,
        backend=backend,
        scale=scale,
        into=() if out is None else (out,),
        serial=_serial(dispatch, interpret, backend),
    )
    return buf


def unpack(
    buffer: jax.Array,
    layout: BucketLayout,
    shapes: Sequence[Sequence[int]],
    *,
    dtype: Any = None,
    out: Sequence[jax.Array] | None = None,
    interpret: bool | None = None,
    backend: str | None = None,
    chunk: int | None = None,
    dispatch: Dispatch | None = None,
) -> list[jax.Array]:
    """Unpacks a bucket's leaves from its flat buffer in one kernel launch, with a fused cast.

    Args:
      buffer: the ``(layout.total_size,)`` buffer.
      layout: the bucket layout.
      shapes: each leaf's shape.
      dtype: leaf dtype (default: the buffer's), e.g. bf16 compute copies of fp32 masters.
      out: optional arrays (one per leaf, of its shape and ``dtype``) to write into (aliased).
      interpret: run in the Pallas interpreter; None means ``jax.default_backend() == "cpu"``.
      backend: ``"triton"`` or ``"mosaic_gpu"`` when compiled (see :func:`pack`).
      chunk: largest window per program (a power of two).
      dispatch: ``"grid"`` or ``"serial"`` (see :func:`pack`).

    Returns:
      The leaves in slot order: ``buffer[o:o+n].reshape(shape).astype(dtype)``.
    """
    _check_unpack(buffer, layout, shapes, "unpack")
    dtype = buffer.dtype if dtype is None else np.dtype(dtype)
    shapes = [tuple(s) for s in shapes]
    if out is not None and [(tuple(x.shape), x.dtype) for x in out] != [(s, dtype) for s in shapes]:
        raise ValueError(f"unpack: out= must match the leaves' shapes {shapes[:4]}... and dtype {dtype}.")
    if layout.total_size > _MAX_ELEMENTS:
        raise ValueError(f"unpack: {layout.total_size} elements exceed the kernel's int32 offsets.")
    used = [i for i, n in enumerate(layout.sizes) if n]
    result: list[Any] = [jnp.zeros(s, dtype) for s in shapes]
    if not used:
        return result
    interpret, backend = _resolve(interpret, backend)
    why = (
        _mosaic_refusal(layout.sizes, layout.offsets, None, buffer.dtype, dtype, False)
        if backend == "mosaic_gpu"
        else ""
    )
    if why:
        raise NotImplementedError(f"mosaic_gpu unpack: {why}; use backend='triton'.")
    chunk = _chunk(chunk, backend, dtype)
    schedule = unpack_schedule(layout.sizes, layout.offsets, chunk=chunk)
    schedule = _remap(schedule, dst={i: r for r, i in enumerate(used)})
    flat = _launch(
        schedule,
        [buffer],
        [jax.ShapeDtypeStruct((layout.sizes[i],), dtype) for i in used],
        interpret=interpret,
        backend=backend,
        scale=None,
        into=() if out is None else [jnp.reshape(out[i], (layout.sizes[i],)) for i in used],
        serial=_serial(dispatch, interpret, backend),
    )
    for i, x in zip(used, flat, strict=True):
        result[i] = jnp.reshape(x, shapes[i])
    return result


def _remap(schedule: Schedule, *, src: dict[int, int] | None = None, dst: dict[int, int] | None = None) -> Schedule:
    """Renumbers sources / destinations after dropping empty leaves."""
    segs = tuple(
        dataclasses.replace(
            s,
            src=s.src if src is None or s.src == ZERO else src[s.src],
            dst=s.dst if dst is None else dst[s.dst],
        )
        for s in schedule.segments
    )
    return Schedule(segs, schedule.starts)


@functools.cache
def gpu_backends_available() -> tuple[str, ...]:
    """Pallas GPU backends importable in this JAX (lowering may still fail; see benchmarks/gpu_check.sh)."""
    found = []
    for name, mod in (
        ("triton", "jax.experimental.pallas.triton"),
        ("mosaic_gpu", "jax.experimental.pallas.mosaic_gpu"),
    ):
        try:
            __import__(mod)
            found.append(name)
        except Exception:  # any import failure means "not available"
            pass
    return tuple(found)
