"""Ragged pack / unpack kernels against their plain-jnp references, interpreted on CPU.

Every output is poisoned first (``out=`` filled with NaN, aliased into the kernel), so an element the kernel
fails to write (padding included) shows up; comparisons are bitwise. Inputs are random and never zero.
``dispatch="serial"`` is the interpreter's fast default; ``dispatch="grid"`` runs the GPU kernel's shape (one
program per window, found by a tree of ``pl.when``) on small buckets with tiny windows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_equal

import vescale_jax as vj
from vescale_jax import kernels as _K
from vescale_jax.kernels._schedule import ZERO

F32, BF16 = jnp.float32, jnp.bfloat16
# On a GPU the kernels run compiled with the lowering VESCALE_JAX_KERNEL_BACKEND names (benchmarks/gpu_check.sh).
BACKEND = _K.KernelPolicy.from_env().backend


def _skip_unsupported(fn):
    """A case the compiled backend refuses (a JAX without it) is skipped, unless the test asked for it by name."""

    def wrapped(*args, **kwargs):
        kwargs.setdefault("backend", BACKEND)
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            if kwargs.get("interpret") is False:
                raise
            pytest.skip(f"unsupported on this backend: {e}")

    return wrapped


# The module's own names: on CPU these run interpreted; on a GPU (JAX_PLATFORMS=cuda) they run compiled with
# BACKEND.
class K:  # a namespace standing in for the module
    pack = staticmethod(_skip_unsupported(_K.pack))
    unpack = staticmethod(_skip_unsupported(_K.unpack))
    pack_reference = staticmethod(_K.pack_reference)
    unpack_reference = staticmethod(_K.unpack_reference)
    pack_schedule = staticmethod(_K.pack_schedule)
    unpack_schedule = staticmethod(_K.unpack_schedule)
    choose_backend = staticmethod(_K.choose_backend)


ODD_SHAPES = [(3, 5), (7,), (16, 16), (1,), (33, 2), (), (0, 4), (9, 1, 3)]


def _random(rng, shape, dtype):
    x = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    return jnp.asarray(x, jnp.float32).astype(dtype)


def _bucket(shapes, m=3, align=4, seed=0, dtype=F32, block=1):
    sizes = [math.prod(s) for s in shapes]
    layout = vj.plan_bucket(sizes, [block] * len(sizes), m, align=align)
    rng = np.random.default_rng(seed)
    return layout, [_random(rng, s, dtype) for s in shapes]


def _many(n, seed=1):
    rng = np.random.default_rng(seed)
    return [tuple(int(d) for d in rng.integers(1, 9, size=rng.integers(1, 3))) for _ in range(n)]


def _nan(shape, dtype):
    return jnp.full(shape, jnp.nan, dtype)


BUCKETS = {
    "one": [(37, 3)],
    "odd": ODD_SHAPES,
    "many24": _many(24),
}


# --------------------------------------------------------------------------------------------------------------
# Schedule (pure Python)


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("seed", range(4))
def test_pack_schedule_covers_buffer_exactly_once_per_element(chunk, seed):
    rng = np.random.default_rng(seed)
    sizes = [int(x) for x in rng.integers(0, 50, size=rng.integers(1, 12))]
    layout = vj.plan_bucket(sizes, [int(b) for b in rng.integers(1, 6, size=len(sizes))], 3, align=2)
    sched = K.pack_schedule(layout.sizes, layout.offsets, layout.total_size, chunk=chunk)
    written = np.full(layout.total_size, -2)
    for src, src_off, dst, dst_off, w in sched.windows():
        assert dst == 0 and w <= chunk and w & (w - 1) == 0
        values = np.full(w, ZERO) if src == ZERO else np.arange(src_off, src_off + w) + 1000 * src
        if src != ZERO:
            assert 0 <= src_off and src_off + w <= layout.sizes[src]
        prev = written[dst_off : dst_off + w]
        assert np.all((prev == -2) | (prev == values)), "overlapping windows must write the same values"
        written[dst_off : dst_off + w] = values
    expect = np.full(layout.total_size, ZERO)
    for i, (n, o) in enumerate(zip(layout.sizes, layout.offsets, strict=True)):
        expect[o : o + n] = np.arange(n) + 1000 * i
    np.testing.assert_array_equal(written, expect)
    assert sched.num_programs == len(sched.windows())


def test_schedule_window_count_and_errors():
    sched = K.unpack_schedule([0, 1, 5, 16, 17], [0, 0, 8, 16, 32], chunk=4)
    assert [(s.dst, s.width, s.num_windows) for s in sched.segments] == [(1, 1, 1), (2, 4, 2), (3, 4, 4), (4, 4, 5)]
    with pytest.raises(ValueError, match="power of two"):
        K.unpack_schedule([3], [0], chunk=6)
    with pytest.raises(ValueError, match="overlaps"):
        K.pack_schedule([4, 4], [0, 2], 8, chunk=4)


# --------------------------------------------------------------------------------------------------------------
# Pack


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(BUCKETS))
def test_pack_matches_reference_and_writes_padding(name, dtype):
    layout, leaves = _bucket(BUCKETS[name], dtype=dtype)
    assert layout.padding > 0 or name == "one"
    got = K.pack(leaves, layout, out=_nan((layout.total_size,), dtype))
    assert_trees_equal(got, K.pack_reference(leaves, layout))


@pytest.mark.parametrize("scale", [0.125, "array"])
def test_pack_fused_scale_and_cast(scale):
    layout, leaves = _bucket(ODD_SHAPES, seed=3)
    scale = jnp.asarray(1 / 3, F32) if scale == "array" else scale
    got = K.pack(leaves, layout, dtype=BF16, scale=scale, out=_nan((layout.total_size,), BF16))
    assert_trees_equal(got, K.pack_reference(leaves, layout, dtype=BF16, scale=scale))


def test_pack_bf16_to_f32_under_jit():
    layout, leaves = _bucket(BUCKETS["odd"], dtype=BF16, seed=4)
    fn = jax.jit(lambda xs, out: K.pack(xs, layout, dtype=F32, scale=2.0, out=out), donate_argnums=1)
    assert_trees_equal(
        fn(leaves, _nan((layout.total_size,), F32)), K.pack_reference(leaves, layout, dtype=F32, scale=2.0)
    )


def test_pack_hundreds_of_tensors():
    layout, leaves = _bucket(_many(120, seed=5), m=8, align=1, dtype=BF16)
    got = K.pack(leaves, layout, out=_nan((layout.total_size,), BF16))
    assert_trees_equal(got, K.pack_reference(leaves, layout))


@pytest.mark.parametrize("chunk", [4])
def test_pack_grid_dispatch(chunk):
    """The GPU kernel's shape: one program per window, tails overlapping, interpreted."""
    layout, leaves = _bucket([(3, 5), (7,), (19,), (1,), (2, 2)], seed=6)
    got = K.pack(
        leaves, layout, dtype=BF16, scale=0.5, out=_nan((layout.total_size,), BF16), dispatch="grid", chunk=chunk
    )
    assert_trees_equal(got, K.pack_reference(leaves, layout, dtype=BF16, scale=0.5))


def test_pack_empty_and_zero_sized():
    layout = vj.plan_bucket([0, 0], [1, 1], 2)
    out = K.pack([jnp.ones((0,), F32), jnp.ones((0, 3), F32)], layout)
    assert out.shape == (0,) and out.dtype == F32
    layout = vj.plan_bucket([0, 5], [1, 1], 2, align=4)  # all padding but one leaf
    leaves = [jnp.ones((0,), F32), jnp.full((5,), 3.0, F32)]
    assert_trees_equal(K.pack(leaves, layout, out=_nan((layout.total_size,), F32)), K.pack_reference(leaves, layout))


def test_pack_errors():
    layout, leaves = _bucket([(3,), (4,)])
    with pytest.raises(ValueError, match="2 slots"):
        K.pack(leaves[:1], layout)
    with pytest.raises(ValueError, match="leaf 1 has shape"):
        K.pack([leaves[0], jnp.ones((5,), F32)], layout)
    with pytest.raises(ValueError, match="dtype="):
        K.pack([leaves[0], leaves[1].astype(BF16)], layout)
    with pytest.raises(ValueError, match="out="):
        K.pack(leaves, layout, out=jnp.zeros((layout.total_size,), BF16))
    with pytest.raises(ValueError, match=r"chunk=64.*warpgroup"):
        K.pack(leaves, vj.plan_bucket([3, 4], [1, 1], 1), interpret=False, backend="mosaic_gpu", chunk=64)
    with pytest.raises(ValueError, match="'cuda'"):
        K.pack(leaves, layout, interpret=False, backend="cuda")


# --------------------------------------------------------------------------------------------------------------
# Unpack


@pytest.mark.parametrize(
    ("src", "dst"),
    [(F32, F32), (F32, BF16), (BF16, F32), (BF16, BF16)],
    ids=["f32-f32", "f32-bf16", "bf16-f32", "bf16-bf16"],
)
@pytest.mark.parametrize("name", ["one", "odd"])
def test_unpack_matches_reference(name, src, dst):
    shapes = BUCKETS[name]
    layout, leaves = _bucket(shapes, dtype=src, seed=7)
    buf = K.pack_reference(leaves, layout)
    out = [_nan(s, dst) for s in shapes]
    got = K.unpack(buf, layout, shapes, dtype=dst, out=out)
    want = K.unpack_reference(buf, layout, shapes, dtype=dst)
    for g, w in zip(got, want, strict=True):
        assert_trees_equal(g, w)


def test_unpack_many_roundtrip_under_jit():
    shapes = BUCKETS["many24"]
    layout, leaves = _bucket(shapes, dtype=F32, seed=8)
    fn = jax.jit(lambda xs: K.unpack(K.pack(xs, layout), layout, shapes))
    for g, x in zip(fn(leaves), leaves, strict=True):
        assert_trees_equal(g, x)


@pytest.mark.parametrize("chunk", [16])
def test_unpack_grid_dispatch(chunk):
    shapes = [(3, 5), (7,), (0,), (19,), (1,)]
    layout, leaves = _bucket(shapes, seed=9)
    buf = K.pack_reference(leaves, layout)
    out = [_nan(s, BF16) for s in shapes]
    got = K.unpack(buf, layout, shapes, dtype=BF16, out=out, dispatch="grid", chunk=chunk)
    for g, w in zip(got, K.unpack_reference(buf, layout, shapes, dtype=BF16), strict=True):
        assert_trees_equal(g, w)


def test_unpack_errors():
    layout, leaves = _bucket([(3,), (4,)])
    buf = K.pack_reference(leaves, layout)
    with pytest.raises(ValueError, match="buffer has shape"):
        K.unpack(buf[:-1], layout, [(3,), (4,)])
    with pytest.raises(ValueError, match="leaf 0 has shape"):
        K.unpack(buf, layout, [(2,), (4,)])
    with pytest.raises(ValueError, match=r"chunk=16.*warpgroup"):
        K.unpack(buf, layout, [(3,), (4,)], interpret=False, backend="mosaic_gpu", chunk=16)


# --------------------------------------------------------------------------------------------------------------
# Backends


def test_choose_backend():
    """Every cast, scale and leaf size is taken by both compiled backends; the preferred one wins, this JAX's
    default when none is named; a backend this JAX lacks falls back to the other, then XLA."""
    layout, _ = _bucket([(3,), (4,)], align=4)
    default = _K.default_gpu_backend()
    assert default == ("mosaic_gpu" if jax.__version_info__ >= (0, 11) else "triton")
    assert K.choose_backend(layout, F32, F32, platform="cpu") == "xla"
    assert K.choose_backend(layout, F32, BF16, platform="gpu") == default
    short = vj.plan_bucket([8, 3, 5], [1, 1, 1], 2, align=1)  # leaves of 32, 12 and 20 bytes, unaligned offsets
    for backend in _K.gpu_backends_available():
        for src, dst in [(F32, F32), (F32, BF16), (BF16, F32)]:
            assert K.choose_backend(short, src, dst, platform="gpu", backend=backend) == backend
            assert _K.refusal(short, src, dst, backend=backend, scaled=True) == ""
    huge = vj.plan_bucket([2**31], [1], 1)
    assert "int32" in _K.refusal(huge, F32, F32, backend="mosaic_gpu")
    assert K.choose_backend(huge, F32, F32, platform="gpu") == "xla"
    empty = vj.plan_bucket([0], [1], 2)
    assert K.choose_backend(empty, F32, F32, platform="gpu") == "xla"
    with pytest.raises(ValueError, match="backend="):
        K.choose_backend(layout, F32, F32, platform="gpu", backend="cuda")


def test_vector_width_follows_every_windows_alignment():
    """Thread vectors of up to 16 bytes, narrowed until every window's start on both sides (and the tail's)
    is a multiple of the vector and a warpgroup's share of the window is whole."""
    from vescale_jax.kernels._ragged import vector_width
    from vescale_jax.kernels._schedule import Segment

    assert vector_width(Segment(0, 0, 0, 0, 4096, 4096), 4, 4) == 4  # fp32: 16 bytes
    assert vector_width(Segment(0, 0, 0, 0, 4096, 4096), 4, 2) == 4  # fp32 -> bf16: 16-byte loads
    assert vector_width(Segment(0, 0, 0, 0, 4096, 4096), 2, 2) == 8  # bf16: 8 x 2 bytes
    assert vector_width(Segment(0, 0, 0, 6, 4096, 4096), 4, 4) == 2  # destination offset 6: pairs
    assert vector_width(Segment(0, 3, 0, 0, 4096, 4096), 4, 4) == 1  # source offset 3: one at a time
    assert vector_width(Segment(0, 0, 0, 0, 4097, 4096), 4, 4) == 1  # tail window at 1
    assert vector_width(Segment(0, 0, 0, 0, 256, 256), 4, 4) == 2  # 256 over 128 threads: 2 each
    assert vector_width(Segment(ZERO, 0, 0, 8, 1024, 512), 1, 4) == 4  # zeros: the destination only


def test_schedule_min_width_makes_short_runs_one_window():
    sched = K.pack_schedule([5, 300, 127], [0, 8, 400], 600, chunk=256, min_width=128)
    widths = [(s.src, s.length, s.width, s.num_windows) for s in sched.segments]
    assert widths == [
        (0, 5, 5, 1),
        (ZERO, 3, 3, 1),
        (1, 300, 256, 2),
        (ZERO, 92, 92, 1),
        (2, 127, 127, 1),
        (ZERO, 73, 73, 1),
    ]
    assert sched.num_programs == sum(n for *_, n in widths)
    with pytest.raises(ValueError, match="min_width=256 exceeds chunk=128"):
        K.unpack_schedule([300], [0], chunk=128, min_width=256)


def test_kernel_policy_reads_the_environment_only_in_from_env(monkeypatch):
    monkeypatch.setenv("VESCALE_JAX_KERNELS", "pallas")
    monkeypatch.setenv("VESCALE_JAX_KERNEL_BACKEND", "mosaic_gpu")
    assert _K.KernelPolicy() == _K.KernelPolicy(mode="auto", backend=None)  # the constructor ignores it
    assert _K.KernelPolicy.from_env() == _K.KernelPolicy(mode="pallas", backend="mosaic_gpu")
    assert _K.KernelPolicy.from_env({}) == _K.KernelPolicy()
    with pytest.raises(ValueError, match="VESCALE_JAX_KERNELS='fast'"):
        _K.KernelPolicy.from_env({"VESCALE_JAX_KERNELS": "fast"})
    with pytest.raises(ValueError, match="mode="):
        _K.KernelPolicy(mode="fast")


def test_kernel_policy_xla_answer_means_xla():
    """A bucket the compiled kernel cannot take (choose_backend answers "xla") is unpacked by XLA, not by the
    policy's preferred lowering; the tile relayout (every tile row one contiguous run) takes the policy's Mosaic GPU
    and Triton where the policy compiles Triton."""
    layout = vj.plan_bucket([64, 128], [1, 1], 2, align=32)
    empty = vj.plan_bucket([0], [1], 2)
    pallas = _K.KernelPolicy(mode="pallas", backend="mosaic_gpu")
    assert pallas.implementation(empty, F32, F32, platform="gpu") == "xla"
    assert pallas.implementation(layout, F32, F32, platform="cpu") == "interpret"
    assert pallas.implementation(layout, F32, F32, platform="gpu") == "mosaic_gpu"
    assert pallas.implementation(layout, F32, BF16, platform="gpu") == "mosaic_gpu"
    assert pallas.fused_implementation(layout, F32, BF16, platform="gpu") == "mosaic_gpu"
    fused = "triton" if "triton" in _K.gpu_backends_available() else "mosaic_gpu"
    triton = _K.KernelPolicy(mode="pallas", backend="triton")
    assert triton.fused_implementation(layout, F32, BF16, platform="gpu") == fused
    assert pallas.fused_implementation(layout, F32, BF16, platform="cpu") == "interpret"
    assert pallas.fused_implementation(empty, F32, BF16, platform="gpu") == "xla"
    for mode in ("auto", "xla"):
        assert _K.KernelPolicy(mode=mode).implementation(layout, F32, F32, platform="gpu") == "xla"
    assert not pallas.check_vma or jax.default_backend() != "cpu"
    assert _K.KernelPolicy().check_vma


@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
def test_gpu_kernels_trace_on_cpu(backend):
    """The compiled kernels' Python code runs (tracing only: they lower on GPU alone)."""
    pytest.importorskip(f"jax.experimental.pallas.{backend}")
    shapes = [(8, 4), (32,), (64,)]
    layout, leaves = _bucket(shapes, align=32)
    kw = dict(interpret=False, backend=backend, chunk=32)
    kw["chunk"] = 128 if backend == "mosaic_gpu" else 32
    dt = BF16
    jax.jit(lambda xs: K.pack(xs, layout, dtype=dt, **kw)).trace(leaves)
    buf = K.pack_reference(leaves, layout)
    jax.jit(lambda b: K.unpack(b, layout, shapes, dtype=dt, **kw)).trace(buf)


# --------------------------------------------------------------------------------------------------------------
# Heavier (run with -m slow)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_hundreds_roundtrip_slow(dtype):
    shapes = _many(300, seed=10)
    layout, leaves = _bucket(shapes, m=8, align=4, dtype=dtype)
    buf = K.pack(leaves, layout, out=_nan((layout.total_size,), dtype))
    assert_trees_equal(buf, K.pack_reference(leaves, layout))
    for g, w in zip(
        K.unpack(buf, layout, shapes, dtype=BF16), K.unpack_reference(buf, layout, shapes, dtype=BF16), strict=True
    ):
        assert_trees_equal(g, w)


@pytest.mark.slow
def test_grid_dispatch_many_slow():
    shapes = _many(40, seed=11)
    layout, leaves = _bucket(shapes, align=1)
    got = K.pack(leaves, layout, out=_nan((layout.total_size,), F32), dispatch="grid", chunk=8)
    assert_trees_equal(got, K.pack_reference(leaves, layout))
    for g, x in zip(K.unpack(got, layout, shapes, dispatch="grid", chunk=8), leaves, strict=True):
        assert_trees_equal(g, x)
