"""The Mosaic GPU pack / unpack kernels run in Mosaic GPU's own interpreter (``interpret=True,
backend="mosaic_gpu"``: the ``plgpu.kernel`` itself, its strided register layouts, vector widths and element
loops), bit for bit against the plain-jnp references; on a GPU the same tests run the compiled kernels.

Buckets cover what the kernel must take in one launch: leaves under a warpgroup (128 elements) and under 16 bytes,
offsets off every 16-byte boundary, odd tails, padding gaps of every size, casts both ways (fp32 -> bf16 gather,
bf16 -> fp32 gradient), a static and a run-time scale, fp8 codes. The device cases run the kernel inside
``shard_map`` on 1, 3 and 8 devices, each device packing its own values. A JAX without the interpreter (0.10)
skips the module: there the kernels are only lowered (tests/test_cuda_lowering.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_equal

import vescale_jax as vj
from vescale_jax import kernels as K
from vescale_jax._compat import mosaic_gpu_interpret_params
from vescale_jax.kernels import _tiles as ktiles

INTERPRET = jax.default_backend() == "cpu"  # on a GPU (benchmarks/gpu_check.sh) the kernels run compiled
pytestmark = pytest.mark.skipif(
    INTERPRET and mosaic_gpu_interpret_params() is None, reason=f"JAX {jax.__version__} has no Mosaic GPU interpreter"
)

F32, BF16, FP8 = jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn
MOSAIC = dict(interpret=INTERPRET, backend="mosaic_gpu")

BUCKETS = {
    # name: (leaf shapes, plan alignment)
    "small-unaligned": ([(3,), (1,), (5, 3), (130,), (2,)], 1),
    "windows-and-tails": ([(300,), (129,), (16, 16), (4097,)], 1),
    "aligned": ([(64, 8), (256,), (128, 4)], 32),
    "gaps": ([(7,), (200,), (0,), (33, 5)], 24),
}


def _bucket(name, m=3, dtype=F32, seed=0):
    shapes, align = BUCKETS[name]
    layout = vj.plan_bucket([math.prod(s) for s in shapes], [1] * len(shapes), m, align=align)
    rng = np.random.default_rng(seed)
    leaves = [jnp.asarray(rng.uniform(0.5, 2.0, s) * rng.choice([-1.0, 1.0], s), F32).astype(dtype) for s in shapes]
    return shapes, layout, leaves


@pytest.mark.parametrize(
    ("src", "dst", "scale"),
    [(F32, F32, None), (F32, BF16, None), (BF16, F32, None), (F32, BF16, 0.5), (BF16, F32, "array"), (F32, FP8, 4.0)],
    ids=["f32", "f32-bf16", "bf16-f32", "scaled", "array-scale", "fp8"],
)
@pytest.mark.parametrize("name", list(BUCKETS))
def test_pack_and_unpack_match_the_references(name, src, dst, scale):
    shapes, layout, leaves = _bucket(name, dtype=src)
    scale = jnp.float32(0.25) if scale == "array" else scale
    got = jax.jit(lambda xs: K.pack(xs, layout, dtype=dst, scale=scale, **MOSAIC))(leaves)
    assert_trees_equal(got, K.pack_reference(leaves, layout, dtype=dst, scale=scale))
    back_dtype = F32 if dst == FP8 else src
    back = jax.jit(lambda b: K.unpack(b, layout, shapes, dtype=back_dtype, **MOSAIC))(got)
    for g, w in zip(back, K.unpack_reference(got, layout, shapes, dtype=back_dtype), strict=True):
        assert_trees_equal(g, w)


def test_narrow_windows_use_the_grid_of_many_programs():
    """chunk=128: many windows per leaf, each found by the program's tree of ``pl.when``."""
    shapes, layout, leaves = _bucket("windows-and-tails", seed=3)
    got = K.pack(leaves, layout, dtype=BF16, chunk=128, **MOSAIC)
    assert_trees_equal(got, K.pack_reference(leaves, layout, dtype=BF16))
    for g, w in zip(K.unpack(got, layout, shapes, chunk=128, **MOSAIC), leaves, strict=True):
        assert_trees_equal(g, w.astype(BF16))


@pytest.mark.parametrize("m", [1, 3, 8])
def test_inside_shard_map_on_each_device_count(m):
    """Each device packs its own leaves (the values differ by device) and unpacks them back, inside
    ``shard_map`` with the varying-axes check on: the outputs vary like the inputs."""
    mesh = jax.make_mesh((m,), ("fsdp",), devices=jax.devices()[:m])
    shapes, layout, leaves = _bucket("small-unaligned", m=m, seed=m)
    spec = jax.sharding.PartitionSpec("fsdp")
    sharding = jax.sharding.NamedSharding(mesh, spec)
    stacked = [jax.device_put(jnp.stack([x * (d + 1) for d in range(m)]), sharding) for x in leaves]

    def local(*xs):
        xs = [x[0] for x in xs]
        buf = K.pack(xs, layout, dtype=BF16, **MOSAIC)
        back = K.unpack(buf, layout, shapes, dtype=F32, **MOSAIC)
        return buf[None], *(b[None] for b in back)

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(spec,) * len(leaves), out_specs=spec))
    buf, *back = (np.asarray(x) for x in fn(*stacked))
    for d in range(m):
        mine = [jnp.asarray(np.asarray(x)[d]) for x in stacked]
        want = K.pack_reference(mine, layout, dtype=BF16)
        assert_trees_equal(buf[d], want)
        for g, w in zip(back, K.unpack_reference(want, layout, shapes, dtype=F32), strict=True):
            assert_trees_equal(g[d], w)


# --- The tile relayout (tile rows as vectors) ---------------------------------------------------------------------

TILE_SHAPES = [(70, 45), (45,), (3, 32, 36), (0, 5), (8, 8), (5, 160)]


@pytest.mark.parametrize(
    ("gran", "src", "dst"),
    [((16, 16), F32, BF16), ((8, 128), BF16, F32), pytest.param((4, 32), F32, F32, marks=pytest.mark.slow)],
    ids=["16x16-f32-bf16", "8x128-bf16-f32", "4x32-f32"],
)
def test_tile_relayout_pack_and_unpack_match_the_references(gran, src, dst):
    """Tile-major slots with edge tiles, leading dims, an empty and a row-major slot, padding: the Mosaic GPU
    pack writes tiles row by row from the logical leaves (casting), the unpack the reverse, bit for bit; rows of
    128 elements as vectors, shorter ones element by element."""
    rng = np.random.default_rng(3)
    g = vj.tiles(*gran)
    storage = tuple(g if len(s) >= 2 else None for s in TILE_SHAPES)
    layout = vj.plan_bucket([math.prod(s) for s in TILE_SHAPES], [1] * len(TILE_SHAPES), 3, align=4)
    leaves = [jnp.asarray(rng.normal(size=s), F32).astype(src) for s in TILE_SHAPES]
    assert sum(layout.sizes) < layout.total_size  # padding, written as zero
    buf = ktiles.pack_tiled(leaves, layout, storage=storage, dtype=dst, **MOSAIC)
    assert_trees_equal(buf, ktiles.pack_tiled_reference(leaves, layout, storage=storage, dtype=dst))
    got = ktiles.unpack_tiled(buf, layout, TILE_SHAPES, storage=storage, dtype=src, **MOSAIC)
    want = ktiles.unpack_tiled_reference(buf, layout, TILE_SHAPES, storage=storage, dtype=src)
    for a, b in zip(got, want, strict=True):
        assert_trees_equal(a, b)
