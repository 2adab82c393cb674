"""Pallas kernels that pack a bucket's tensors into its flat buffer and unpack them back, one launch each.

``pack``: leaves -> ``(total_size,)`` buffer, leaf ``i`` flattened row-major at ``layout.offsets[i]``, every
padding element written as zero, with an optional fused scale and cast (gradients -> reduce dtype).
``unpack``: buffer -> leaves, with an optional fused cast (fp32 master -> bf16 compute). Each sits beside a
plain-jnp ``*_reference`` (what XLA does on its own: a concatenate, static slices) that the tests compare to.

How: a static schedule (:mod:`vescale_jax.kernels.schedule`) splits the copy into power-of-two windows; the
grid has one program per window, and each program finds its segment by a binary tree of ``pl.when`` on the
program id (``log2(#segments)`` scalar compares), then copies one window from the leaf's own ref: leaves are
never concatenated by XLA first. Windows never cross a segment's ends, so nothing is masked.

Backends (``backend=``): ``"mosaic_gpu"`` (``plgpu.kernel``: each program loads its window into a
warpgroup's registers, scales and casts there and stores it; the vector width per segment follows the alignment of
its offsets, runs under a warpgroup are copied element by element in the same launch; the default on JAX 0.11 and
later), ``"triton"`` (the same register copies through Pallas's Triton backend, which JAX deprecates from 0.11;
the default on 0.10), ``"xla"`` (the reference). ``interpret=True`` (the default on CPU) runs the register body in
the Pallas interpreter; ``interpret=True, backend="mosaic_gpu"`` runs the Mosaic GPU kernel itself in Mosaic GPU's
interpreter where JAX has one.
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

from vescale_jax._compat import (
    mosaic_gpu_interpret_params,
    mosaic_gpu_kernel,
    mosaic_gpu_load,
    pallas_triton_deprecated,
    varying_axes,
)
from vescale_jax.kernels._reference import (
    Scale,
    _check_leaves,
    _check_unpack,
    _convert,
    _leaf_dtype,
    pack_reference,
    unpack_reference,
)
from vescale_jax.kernels._schedule import ZERO, Schedule, Segment, pack_schedule, unpack_schedule
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = [
    "DEFAULT_CHUNK",
    "Backend",
    "choose_backend",
    "default_gpu_backend",
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

DEFAULT_CHUNK = {"interpret": 1024, "triton": 8192, "mosaic_gpu": 4096}
"""Largest window (elements) one program copies, per backend."""
TRITON_NUM_WARPS = 8
WARPGROUP = 128
"""Threads of the warpgroup that runs one Mosaic GPU program; a window of it holds a multiple of 128 elements."""
VECTOR_BYTES = 16
"""Widest vector one thread loads or stores (``ld.global.v4.b32``)."""
MOSAIC_VECTORS_PER_THREAD = 2
"""Vectors each thread moves per iteration of a Mosaic GPU window's loop: the loop body is emitted once per
segment whatever the window (a 256-tensor bucket lowers to small code), and two loads in flight per thread."""
_MAX_ELEMENTS = 2**31 - 1  # window offsets are int32


# ----------------------------------------------------------------------------------------------------------
# Backend choice


@functools.cache
def default_gpu_backend() -> str:
    """The compiled backend a policy takes unless told: ``"mosaic_gpu"`` where JAX deprecates Pallas's Triton
    backend (0.11 and later) and has the Mosaic GPU kernel API, else ``"triton"`` while JAX ships it."""
    if mosaic_gpu_kernel() and (pallas_triton_deprecated() or "triton" not in gpu_backends_available()):
        return "mosaic_gpu"
    return "triton"


def choose_backend(
    layout: BucketLayout,
    src_dtype: Any,
    dst_dtype: Any,
    *,
    scaled: bool = False,
    platform: str | None = None,
    backend: str | None = None,
) -> Backend:
    """Which implementation a hot path should use for one bucket.

    ``"xla"`` on CPU (the kernels only run interpreted there) and whenever no kernel can take the bucket (empty,
    or past the kernels' int32 offsets); on GPU ``backend``, or the other compiled backend where ``backend``
    refuses the bucket (a JAX without its API).

    Args:
      layout: the bucket layout.
      src_dtype: dtype read (leaves for pack, the buffer for unpack).
      dst_dtype: dtype written.
      scaled: whether a scale is fused.
      platform: ``jax.default_backend()`` if None.
      backend: the preferred GPU lowering, ``"mosaic_gpu"`` or ``"triton"`` (e.g.
        :attr:`vescale_jax.kernels.KernelPolicy.backend`); None: :func:`default_gpu_backend`.

    Returns:
      ``"xla"``, ``"triton"`` or ``"mosaic_gpu"``.
    """
    platform = jax.default_backend() if platform is None else platform
    backend = backend or default_gpu_backend()
    if platform not in ("gpu", "cuda") or layout.total_size > _MAX_ELEMENTS or not layout.total_size:
        return "xla"
    if backend not in BACKENDS:
        raise ValueError(f"choose_backend: backend={backend!r}; use one of {BACKENDS}.")
    for b in (backend, *(x for x in BACKENDS if x != backend)):
        if not refusal(layout, src_dtype, dst_dtype, backend=b, scaled=scaled):
            return b  # type: ignore[return-value]
    return "xla"


def refusal(layout: BucketLayout, src_dtype: Any, dst_dtype: Any, *, backend: str, scaled: bool = False) -> str:
    """Why the compiled ``backend`` kernel cannot pack or unpack this bucket; ``""`` when it can.

    Both: buckets past the kernels' int32 offsets. ``mosaic_gpu``: a JAX without Mosaic GPU's ``plgpu.kernel``.
    ``triton``: a JAX that no longer ships Pallas's Triton backend. Casts, scales, small leaves and offsets of any
    alignment are taken by both.
    """
    del src_dtype, dst_dtype, scaled  # every cast and scale of the hot path is fused by both backends
    if layout.total_size > _MAX_ELEMENTS:
        return f"{layout.total_size} elements exceed the kernels' int32 offsets (split the bucket)"
    if backend not in gpu_backends_available() or (backend == "mosaic_gpu" and not mosaic_gpu_kernel()):
        return f"this JAX ({jax.__version__}) has no Pallas {backend} backend"
    return ""


def _resolve(interpret: bool | None, backend: str | None) -> tuple[bool, str]:
    """``(interpret, backend)``: ``"interpret"`` for the Pallas interpreter, else a compiled backend (an
    explicit ``backend="mosaic_gpu"`` with ``interpret=True``: Mosaic GPU's own interpreter)."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be 'triton' or 'mosaic_gpu' for a compiled kernel, got {backend!r}.")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if interpret and backend == "mosaic_gpu":
        if mosaic_gpu_interpret_params() is None:
            raise NotImplementedError(
                f"interpret=True, backend='mosaic_gpu': this JAX ({jax.__version__}) has no Mosaic GPU interpreter "
                "(plgpu.InterpretGPUParams); use backend=None for the Pallas interpreter."
            )
        return True, "mosaic_gpu"
    if interpret:
        return True, "interpret"
    return False, backend or default_gpu_backend()


def _chunk(chunk: int | None, backend: str) -> int:
    """The window width; a ``mosaic_gpu`` window holds at least one element per thread of its warpgroup."""
    chunk = chunk or DEFAULT_CHUNK[backend]
    if backend == "mosaic_gpu" and chunk < WARPGROUP:
        raise ValueError(
            f"mosaic_gpu: chunk={chunk}; a window is spread over a warpgroup's {WARPGROUP} threads (chunk >= "
            f"{WARPGROUP})."
        )
    return chunk


def _serial(dispatch: str | None, interpret: bool, backend: str) -> bool:
    if dispatch not in (None, "grid", "serial"):
        raise ValueError(f"dispatch must be 'grid' or 'serial', got {dispatch!r}.")
    if dispatch == "serial" and backend == "mosaic_gpu":
        raise ValueError("dispatch='serial' is for the Pallas interpreter and Triton, not mosaic_gpu.")
    return backend != "mosaic_gpu" and (dispatch == "serial" or (dispatch is None and interpret))


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


def _dispatch(schedule: Schedule, copy, serial: bool, pid: Any = None, one_body: bool = False) -> None:
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
    if one_body:  # the tail's window is the last full one moved back: min(k * w, length - w), one body
        emit = lambda j, k: copy(j, _one_body_offset(schedule.segments[j], k), schedule.segments[j].width)
    else:
        emit = lambda j, k: _window(schedule.segments[j], k, lambda off: copy(j, off, schedule.segments[j].width))
    pid = pl.program_id(0) if pid is None else pid
    _dispatch_tree(pid, schedule.starts, emit, 0, len(schedule.segments))


def _one_body_offset(seg, k: jax.Array) -> Any:
    """Window ``k``'s offset in ``seg``: ``k * width``, or ``length - width`` for the tail."""
    if seg.num_windows == 1:
        return 0
    if not seg.has_tail:
        return k * seg.width
    return jnp.minimum(k * seg.width, seg.length - seg.width)


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


def vector_width(seg: Segment, src_itemsize: int, dst_itemsize: int) -> int:
    """Elements one thread moves per vector in ``seg``'s windows: the widest power of two whose loads and stores
    fit :data:`VECTOR_BYTES` and which divides every window's start on both sides (the segment's starts, and its
    length when a tail window starts at ``length - width``) and the window's share per thread."""
    vec = max(1, VECTOR_BYTES // max(src_itemsize, dst_itemsize))
    starts = [seg.dst_start, *([] if seg.src == ZERO else [seg.src_start]), *([seg.length] if seg.has_tail else [])]
    while vec > 1 and (seg.width % (WARPGROUP * vec) or any(x % vec for x in starts)):
        vec //= 2
    return vec


def _mosaic_body(schedule: Schedule, n_in: int, n_out: int, in_dtypes, out_dtypes, scale: Any, scale_is_ref: bool):
    """Mosaic GPU body: one warpgroup per window, which it moves in a loop of tiles of
    :data:`MOSAIC_VECTORS_PER_THREAD` vectors per thread: each tile is loaded into registers in a strided layout
    (thread ``t`` holds vectors ``t, t + 128, ...``), scaled and cast there, and stored. A run under a warpgroup
    (:data:`WARPGROUP` elements) is copied one element at a time by a loop in the same program."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(*refs):
        in_refs = refs[:n_in]
        scale_val = refs[n_in][0] if scale_is_ref else scale
        out_refs = refs[len(refs) - n_out :]

        def copy(j, off, width):
            seg = schedule.segments[j]
            dtype, dst_ref = out_dtypes[seg.dst], out_refs[seg.dst]
            src_ref = None if seg.src == ZERO else in_refs[seg.src]
            if width < WARPGROUP:  # the whole (short) run, element by element

                def element(e, carry):
                    val = (
                        jnp.zeros((), dtype)
                        if src_ref is None
                        else _convert(src_ref[seg.src_start + e], dtype, scale_val)
                    )
                    dst_ref[seg.dst_start + e] = val
                    return carry

                jax.lax.fori_loop(0, width, element, 0)
                return
            vec = vector_width(
                seg, 1 if src_ref is None else np.dtype(in_dtypes[seg.src]).itemsize, np.dtype(dtype).itemsize
            )
            tile = min(width, WARPGROUP * vec * MOSAIC_VECTORS_PER_THREAD)
            layout = plgpu.Layout.WG_STRIDED((tile,), vec_size=vec)

            def piece(i, carry):  # one tile of the window: a few vectors per thread, in a loop (small code)
                at = off + i * tile
                if src_ref is None:
                    val = plgpu.layout_cast(jnp.zeros((tile,), dtype), layout)
                else:
                    val = _convert(mosaic_gpu_load(src_ref, seg.src_start + at, tile, layout), dtype, scale_val)
                dst_ref[pl.ds(seg.dst_start + at, tile)] = val
                return carry

            if width == tile:
                piece(0, 0)
            else:
                jax.lax.fori_loop(0, width // tile, piece, 0)

        _dispatch(schedule, copy, serial=False, pid=jax.lax.axis_index("window"), one_body=True)

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
    """One kernel launch with a program per window (a ``pallas_call``, or a ``plgpu.kernel`` for Mosaic GPU).

    The kernel's refs are ``srcs``, extras (scale or zero source), ``into`` (aliased to the outputs, never
    read), the outputs, then scratch.
    """
    n_src, n_out = len(srcs), len(out_shapes)
    static = scale is None or isinstance(scale, int | float | np.generic)
    extra = [] if static else [jnp.reshape(jnp.asarray(scale), (1,)).astype(jnp.float32)]
    static_scale = None if scale is None or not static else float(scale)
    out_dtypes = [s.dtype for s in out_shapes]
    if backend == "mosaic_gpu":
        from jax.experimental.pallas import mosaic_gpu as plgpu

        kernel = _mosaic_body(schedule, n_src, n_out, [x.dtype for x in srcs], out_dtypes, static_scale, not static)
        # plgpu.kernel aliases nothing: ``into`` is not reused (every element is written all the same)
        call = plgpu.kernel(
            kernel,
            out_type=tuple(out_shapes),
            grid=(schedule.num_programs,),
            grid_names=("window",),
            **_mosaic_params(),
            **({"interpret": mosaic_gpu_interpret_params()} if interpret else {}),
        )
        return _vary_like(list(call(*srcs, *extra)), srcs)
    kernel = _register_body(schedule, n_src, n_out, out_dtypes, static_scale, not static, serial)
    kwargs: dict[str, Any] = {"interpret": True} if interpret else {}
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


def _mosaic_params() -> dict[str, Any]:
    """Lane semantics: the layouts are the ones the body gives (``WG_STRIDED``), so Mosaic GPU runs no layout
    inference, whose constraint solving grows with the segments (a 256-tensor bucket lowered in 53 s under the
    Warpgroup semantics JAX 0.12 defaults to, 8 s under Lane; JAX 0.10 defaults to Lane)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return {"compiler_params": plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)}


def _vary_like(outs: list[jax.Array], srcs: list[jax.Array]) -> list[jax.Array]:
    """Inside ``shard_map`` (with ``check_vma``) the outputs vary over the inputs' mesh axes (``plgpu.kernel``
    traces its body with the check off and returns invariant types)."""
    axes = frozenset().union(*(varying_axes(x) for x in srcs))
    if not axes:
        return outs
    return [jax.lax.pcast(o, tuple(sorted(axes - varying_axes(o))), to="varying") for o in outs]


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
      out: a ``(total_size,)`` buffer of ``dtype`` to write into (aliased: donate it under jit to reuse it;
        ``mosaic_gpu`` writes a new buffer, ``plgpu.kernel`` aliases nothing). Every element is overwritten.
      interpret: run in the Pallas interpreter; None means ``jax.default_backend() == "cpu"``.
      backend: ``"mosaic_gpu"`` or ``"triton"`` when compiled (default: :func:`default_gpu_backend`);
        ``"mosaic_gpu"`` with ``interpret=True`` runs the Mosaic GPU kernel in Mosaic GPU's interpreter.
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
    _check_backend(layout, backend, interpret, "pack")
    chunk = _chunk(chunk, backend)
    schedule = pack_schedule(layout.sizes, layout.offsets, layout.total_size, chunk=chunk, **_min_width(backend))
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
    _check_backend(layout, backend, interpret, "unpack")
    chunk = _chunk(chunk, backend)
    schedule = unpack_schedule(layout.sizes, layout.offsets, chunk=chunk, **_min_width(backend))
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


def _check_backend(layout: BucketLayout, backend: str, interpret: bool, what: str) -> None:
    if backend in BACKENDS and not interpret:
        why = refusal(layout, None, None, backend=backend)
        if why:
            other = [b for b in BACKENDS if b != backend]
            raise NotImplementedError(f"{backend} {what}: {why}; use backend={other[0]!r}.")


def _min_width(backend: str) -> dict[str, int]:
    """Mosaic GPU copies a run under a warpgroup in one program, element by element."""
    return {"min_width": WARPGROUP} if backend == "mosaic_gpu" else {}


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
