"""The fused Pallas kernels (FP8 quantize into the wire, dequantize + unpack, tile relayout in pack / unpack)
against their jnp references, bitwise, interpreted on CPU; through the real step (``KernelPolicy(mode="pallas")``
against ``mode="xla"``); and lowered for CUDA (Triton) from the CPU."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from helpers import GPTConfig, abstract_model, assert_trees_equal, batches, init_params, loss_fn

import vescale_jax as vj
from vescale_jax.kernels import _bands
from vescale_jax.kernels import _fp8 as kfp8
from vescale_jax.kernels import _tiles as ktiles
from vescale_jax.layout._blocks import local_slots
from vescale_jax.step import _fp8 as step_fp8

F32, BF16 = jnp.float32, jnp.bfloat16
BLOCK = (16, 16)
GRAN = {
    "tiles": lambda path, leaf: vj.tiles(*BLOCK) if leaf.ndim >= 2 else vj.element(),
    "rows": lambda path, leaf: vj.rows(BLOCK[0]) if leaf.ndim >= 2 else vj.element(),
}


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def _tree(seed):
    """Edge tiles (70 x 45), a zero block, leading dims with columns of very different magnitudes, a vector with
    signed zeros (exact leaf), a small matrix: uneven shards and padding on every device count."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(70, 45))
    w[:16, :16] = 0.0  # a zero block: scale 0, codes 0
    w[20, 3] = -0.0
    b = rng.normal(size=45)
    b[[3, 4]] = [-0.0, 0.0]  # exact leaf: -0.0 travels as +0.0, as the reference's segment sum does
    return {
        "a": {
            "w": jnp.asarray(w, F32),
            "b": jnp.asarray(b, F32),
            "v": jnp.asarray(rng.normal(size=(3, 32, 36)) * np.logspace(-3, 2, 36), F32),
            "s": jnp.asarray(rng.normal(size=(8, 16)), F32),
        }
    }


def _bucket(gran, m, dtype, seed=0):
    params = _tree(seed)
    plan = vj.plan(params, make_mesh(m), granularity=GRAN[gran])
    (bucket,) = plan.buckets
    table = step_fp8.block_table(plan, 0, BLOCK)
    buf = np.asarray(vj.shard(params, plan).buffers[0])
    shards = jnp.asarray(buf.reshape(m, -1), dtype)
    shapes = [plan.layer_shape(plan.leaves[i]) for i in bucket.leaves]
    return bucket, table, shards, shapes


INTERPRET = None
"""The kernels' default: interpreted on CPU, compiled (Triton) on a GPU, where benchmarks/gpu_check.sh runs the
one-device cases of this file against the same references."""
QUICK = {("tiles", 3, BF16), ("rows", 3, F32), ("tiles", 8, BF16)}
CASES = [
    pytest.param(g, m, d, marks=() if (g, m, d) in QUICK else pytest.mark.slow, id=f"{g}-m{m}-{d.__name__}")
    for g in ("tiles", "rows")
    for m in (1, 3, 8)
    for d in (BF16, F32)
]


@pytest.mark.parametrize(("gran", "m", "dtype"), CASES)
def test_quantize_matches_reference_bitwise(gran, m, dtype):
    bucket, table, shards, _ = _bucket(gran, m, dtype)
    kernel = jax.jit(lambda x, k: kfp8.quantize(x, table, k, interpret=INTERPRET))
    ref = jax.jit(lambda x, k: kfp8.quantize_reference(x, table, k))
    zero_block = False
    for k in range(m):
        (codes, scales), (rc, rs) = kernel(shards[k], k), ref(shards[k], k)
        assert_trees_equal(codes, rc)
        assert_trees_equal(scales, rs)
        zero_block |= bool(np.any(np.asarray(rs)[: table.nb] == 0))
    assert zero_block  # the zero block (and -0.0 exact elements) are in the comparison
    assert bucket.layout.padding_fraction > 0


@pytest.mark.parametrize(("gran", "m", "dtype"), CASES)
def test_dequantize_unpack_matches_reference_bitwise(gran, m, dtype):
    bucket, table, shards, shapes = _bucket(gran, m, dtype)
    q = jax.jit(jax.vmap(lambda x, k: kfp8.quantize_reference(x, table, k)))
    codes, scales = q(shards, jnp.arange(m))
    kw = dict(dtype=dtype, storage=bucket.storage)
    got = kfp8.dequantize_unpack(codes, scales, table, bucket.layout, shapes, interpret=INTERPRET, **kw)
    want = kfp8.dequantize_unpack_reference(codes, scales, table, bucket.layout, shapes, **kw)
    for g, w in zip(got, want, strict=True):
        assert_trees_equal(g, w)


def test_small_units_group_fewer_blocks():
    """A small register budget: one 16 x 16 block per band unit, flat units of 16; still bitwise."""
    bucket, table, shards, _ = _bucket("tiles", 3, BF16, seed=1)
    units = _bands.quantize_units(table, bucket.layout.shard_size, chunk=256)
    assert max(c.elements for c in units.classes) <= 256
    kernel = jax.jit(lambda x, k: kfp8.quantize(x, table, k, interpret=INTERPRET, chunk=256))
    for k in range(3):
        for g, w in zip(kernel(shards[k], k), kfp8.quantize_reference(shards[k], table, k), strict=True):
            assert_trees_equal(g, w)


def test_units_cover_every_element_once():
    """The quantizer's units cover each device's leaf elements once and no padding; the dequantizer's write
    each leaf element once."""
    for gran in ("tiles", "rows"):
        bucket, table, _, _ = _bucket(gran, 3, F32)
        s = bucket.layout.shard_size
        slots = [np.asarray(local_slots(table, k, s)) for k in range(3)]
        units = _bands.quantize_units(table, s, chunk=4096)
        for k in range(3):
            hits = np.zeros(s, int)
            for src, _, _, c, n in units.table[k]:
                if c < 0:
                    continue
                cls = units.classes[c]
                if cls.kind == _bands.FLAT:
                    hits[src : src + n] += 1
                else:
                    for r in range(cls.rows):
                        hits[src + r * cls.src_stride : src + r * cls.src_stride + cls.width] += 1
            np.testing.assert_array_equal(hits, (slots[k] != table.nb).astype(int))
        dq = _bands.dequantize_units(table, s, chunk=4096)
        for j, lb in enumerate(table.leaves):
            hits = np.zeros(math.prod(lb.shape), int)
            for _, dst, _, c, n in dq.table:
                cls = dq.classes[c]
                if cls.dst_ref != j:
                    continue
                rows = 1 if cls.kind == _bands.FLAT else cls.rows
                width = n if cls.kind == _bands.FLAT else cls.width
                for r in range(rows):
                    hits[dst + r * cls.dst_stride : dst + r * cls.dst_stride + width] += 1
            np.testing.assert_array_equal(hits, 1)


def test_tiles_that_are_not_multiples_of_the_block_stay_on_xla():
    params = _tree(0)
    plan = vj.plan(params, make_mesh(1), granularity=lambda p, x: vj.tiles(8, 8) if x.ndim >= 2 else vj.element())
    table = step_fp8.block_table(plan, 0, BLOCK)
    assert not kfp8.supported(table, plan.buckets[0].layout.shard_size)
    with pytest.raises(NotImplementedError, match="XLA path"):
        kfp8.quantize(jnp.zeros((plan.buckets[0].layout.shard_size,)), table, 0, interpret=INTERPRET)
    assert step_fp8.fused(vj.kernels.KernelPolicy(mode="pallas"), plan.buckets[0].layout, table) is None


# --- Tile relayout inside pack / unpack -----------------------------------------------------------------------

TILE_SHAPES = [(70, 45), (45,), (3, 32, 36), (0, 5), (8, 8), (5, 40)]


def _tiled_bucket(dtype, gran=None):
    gran = gran or vj.tiles(16, 16)
    rng = np.random.default_rng(3)
    storage = tuple(gran if len(s) >= 2 else None for s in TILE_SHAPES)
    layout = vj.plan_bucket([math.prod(s) for s in TILE_SHAPES], [1] * len(TILE_SHAPES), 3, align=4)
    leaves = [jnp.asarray(rng.normal(size=s), F32).astype(dtype) for s in TILE_SHAPES]
    return layout, storage, leaves


@pytest.mark.parametrize(
    ("src", "dst", "chunk"),
    [(F32, BF16, None), (BF16, F32, 64), pytest.param(F32, F32, 8, marks=pytest.mark.slow)],
    ids=["f32-bf16", "bf16-f32-chunk64", "f32-chunk8"],
)
def test_tiled_pack_and_unpack_match_reference_bitwise(src, dst, chunk):
    layout, storage, leaves = _tiled_bucket(src)
    assert sum(layout.sizes) < layout.total_size  # padding, written as zero
    buf = ktiles.pack_tiled(leaves, layout, storage=storage, dtype=dst, interpret=INTERPRET, chunk=chunk)
    assert_trees_equal(buf, ktiles.pack_tiled_reference(leaves, layout, storage=storage, dtype=dst))
    got = ktiles.unpack_tiled(buf, layout, TILE_SHAPES, storage=storage, dtype=src, interpret=INTERPRET, chunk=chunk)
    want = ktiles.unpack_tiled_reference(buf, layout, TILE_SHAPES, storage=storage, dtype=src)
    for g, w in zip(got, want, strict=True):
        assert_trees_equal(g, w)


def test_tiled_unpack_of_rectangular_tiles():
    layout, storage, leaves = _tiled_bucket(F32, gran=vj.tiles(4, 32))
    buf = ktiles.pack_tiled_reference(leaves, layout, storage=storage)
    got = ktiles.unpack_tiled(buf, layout, TILE_SHAPES, storage=storage, interpret=INTERPRET)
    for g, x in zip(got, leaves, strict=True):
        assert_trees_equal(g, x)


# --- Through the real step ------------------------------------------------------------------------------------

CFG = GPTConfig(vocab=257, max_len=16, d_model=32, num_heads=2, num_layers=2, d_ff=80)
FP8 = vj.MixedPrecision(compute_dtype=BF16, reduce_dtype=F32, fp8_gather=BLOCK)
BF16_MP = vj.MixedPrecision(compute_dtype=BF16, reduce_dtype=F32)


def _step_results(m, precision, mode):
    graphdef, shapes = abstract_model(CFG)
    plan = vj.plan(shapes, make_mesh(m), stacked=("blocks",), granularity=GRAN["tiles"])
    params, batch = init_params(CFG, jax.random.key(0)), next(batches(1, batch=24))

    @vj.fsdp(plan=plan, precision=precision, donate=False, kernels=vj.kernels.KernelPolicy(mode=mode))
    def grads_of(p, _, batch):
        return jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"]))(p)

    loss, grads = grads_of(vj.shard(params, plan), None, batch)
    return loss, grads.buffers


def _count_calls(monkeypatch):
    calls = {}
    for mod, name in (
        (kfp8, "quantize"),
        (kfp8, "dequantize_unpack"),
        (ktiles, "pack_tiled"),
        (ktiles, "unpack_tiled"),
    ):
        fn = getattr(mod, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _fn(*a, **kw)

        monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.mark.parametrize(
    ("precision", "m"),
    [
        pytest.param("fp8", 3, id="fp8-m3"),
        pytest.param("fp8", 1, id="fp8-m1", marks=pytest.mark.slow),
        pytest.param("fp8", 8, id="fp8-m8", marks=pytest.mark.slow),
        pytest.param("bf16", 3, id="bf16-m3", marks=pytest.mark.slow),
    ],
)
def test_step_with_fused_kernels_is_bitwise_the_xla_step(precision, m, monkeypatch):
    """Loss and gradients of a GPT step with ``KernelPolicy(mode="pallas")`` (the fused kernels, interpreted)
    equal the ``mode="xla"`` step's bit for bit."""
    mp = FP8 if precision == "fp8" else BF16_MP
    want_loss, want = _step_results(m, mp, "xla")
    calls = _count_calls(monkeypatch)
    got_loss, got = _step_results(m, mp, "pallas")
    if precision == "fp8":
        assert calls.get("quantize") and calls.get("dequantize_unpack") and calls.get("pack_tiled"), calls
    else:
        assert calls.get("unpack_tiled") and calls.get("pack_tiled"), calls
    assert_trees_equal(got_loss, want_loss)
    for g, w in zip(got, want, strict=True):
        assert_trees_equal(g, w)


# --- Lowered for CUDA (on the CPU) ----------------------------------------------------------------------------

TRITON = "__gpu$xla.gpu.triton"


def _export(f, *avals):
    with vj.kernels.gpu_lowering_target():  # no GPU here: lower for an H100-class one
        return jax.export.export(
            jax.jit(f), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)]
        )(*avals)


@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("kernel", ["quantize", "dequantize_unpack", "unpack_tiled", "pack_tiled"])
def test_kernels_lower_for_cuda(kernel, backend):
    """Each fused kernel of a tiles(16, 16) bucket with 16x16 FP8 blocks (every block one tile: a contiguous run)
    lowers for CUDA on either backend, to that backend's custom call."""
    if backend == "triton":
        pytest.importorskip("jax.experimental.pallas.triton")
    bucket, table, _, shapes = _bucket("tiles", 3, BF16)
    layout, s, nb = bucket.layout, bucket.layout.shard_size, kfp8.num_blocks(table)
    kw = dict(interpret=False, backend=backend)
    av = jax.ShapeDtypeStruct
    if kernel == "quantize":
        exported = _export(lambda x, k: kfp8.quantize(x, table, k, **kw), av((s,), BF16), av((), jnp.int32))
    elif kernel == "dequantize_unpack":
        f = lambda c, sc: kfp8.dequantize_unpack(c, sc, table, layout, shapes, dtype=BF16, storage=bucket.storage, **kw)
        exported = _export(f, av((3, s), kfp8.FP8), av((3, nb), F32))
    elif kernel == "unpack_tiled":
        f = lambda b: ktiles.unpack_tiled(b, layout, shapes, storage=bucket.storage, dtype=BF16, **kw)
        exported = _export(f, av((3 * s,), F32))
    else:
        f = lambda *xs: ktiles.pack_tiled(xs, layout, storage=bucket.storage, dtype=F32, **kw)
        exported = _export(f, *[av(x, BF16) for x in shapes])
    text = exported.mlir_module()
    assert (TRITON in text) == (backend == "triton") and ("@mosaic_gpu" in text) == (backend == "mosaic_gpu")


def test_mosaic_gpu_refuses_naming_triton():
    """Blocks that are pieces of rows (16x16 blocks of a row-major 70x45 matrix) are no contiguous runs: Mosaic
    GPU's FP8 kernels refuse them (tests/test_mosaic_fp8.py runs the ones it takes; tests/test_mosaic_kernels.py
    the tile relayout, which it always takes)."""
    _, rows_table, row_shards, _ = _bucket("rows", 3, BF16)
    with pytest.raises(NotImplementedError, match=r"mosaic_gpu.*backend='triton'"):
        kfp8.quantize(row_shards[0], rows_table, 0, interpret=False, backend="mosaic_gpu")


def test_fp8_gather_path_lowers_for_triton_inside_shard_map(monkeypatch):
    """The wire's FP8 gather and its transpose (flat and stacked buckets, shard_map with check_vma) lower for
    CUDA with the fused kernels: quantize, dequantize + unpack forward, pack_tiled backward."""
    pytest.importorskip("jax.experimental.pallas.triton")
    from vescale_jax.step import _wire

    rng = np.random.default_rng(0)
    params = {
        "a": {"w": jnp.asarray(rng.normal(size=(70, 45)), F32), "b": jnp.zeros(45)},
        "layers": {"w": jnp.asarray(rng.normal(size=(4, 40, 24)), F32), "s": jnp.zeros((4, 24))},
    }
    plan = vj.plan(params, make_mesh(3), granularity=GRAN["tiles"], stacked=("layers",))
    buffers = vj.shard(params, plan).buffers
    policy = vj.kernels.KernelPolicy(mode="pallas", interpret=False)
    # What the policy answers when the step is lowered for a GPU (here: exported for CUDA from the CPU).
    monkeypatch.setattr(vj.kernels.KernelPolicy, "implementation", lambda self, *a, **k: "triton")
    calls = _count_calls(monkeypatch)

    def f(*bufs):
        total = jnp.zeros((), F32)
        for b, buf in zip(plan.buckets, bufs, strict=True):

            def loss(x, b=b):
                if b.layers is None:
                    leaves = _wire.gather_bucket(x, b, plan, precision=FP8, kernels_policy=policy)
                else:
                    leaves = _wire.gather_stacked(x, b, plan, _wire.Gather(FP8, (), policy))
                return sum(jnp.sum(leaf.astype(F32) ** 2) for leaf in leaves)

            total = total + jnp.sum(jax.grad(loss)(buf))
        return jax.lax.psum(total, "fsdp")

    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    mapped = jax.shard_map(f, mesh=plan.mesh, in_specs=specs, out_specs=jax.sharding.PartitionSpec(), check_vma=True)
    text = _export(mapped, *buffers).mlir_module()
    assert calls == {"quantize": 2, "dequantize_unpack": 2, "pack_tiled": 2}, calls
    assert text.count(TRITON) >= 6
