"""The FP8 quantize and dequantize-unpack kernels on Mosaic GPU, for buckets whose blocks are contiguous runs.

Which buckets they take is a property of the plan (NumPy, every JAX); the kernels themselves run in Mosaic GPU's
own interpreter (JAX 0.12 and later; skipped on a JAX without it, where tests/test_cuda_lowering.py lowers them),
bit for bit against the plain-jnp references on 3 and 8 devices: tile-major matrices with edge tiles and a zero
block, blocks of whole rows, exact vectors with signed zeros, padding, bf16 and fp32 shards, stacked layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from helpers import assert_trees_equal

import vescale_jax as vj
from vescale_jax._compat import mosaic_gpu_interpret_params
from vescale_jax.kernels import _fp8 as kfp8
from vescale_jax.kernels import _fp8_mosaic
from vescale_jax.step import _fp8 as step_fp8

F32, BF16 = jnp.float32, jnp.bfloat16
BLOCK = (16, 16)
INTERPRET = jax.default_backend() == "cpu"  # on a GPU the kernels run compiled
needs_kernels = pytest.mark.skipif(
    INTERPRET and mosaic_gpu_interpret_params() is None, reason=f"JAX {jax.__version__} has no Mosaic GPU interpreter"
)
GRAN = {
    # tile-major storage whose tiles are the blocks (edge tiles partial): one contiguous run per block
    "tiles": lambda path, leaf: vj.tiles(*BLOCK) if leaf.ndim >= 2 else vj.element(),
    # row-major, blocks of whole rows (every matrix 16 columns wide or less)
    "rows": lambda path, leaf: vj.rows(BLOCK[0]) if leaf.ndim >= 2 else vj.element(),
}


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def _tree(gran, seed=0):
    rng = np.random.default_rng(seed)
    wide = 48 if gran == "tiles" else 16
    w = rng.normal(size=(70, wide))
    w[:16, :16] = 0.0  # a zero block: scale 0, codes 0
    w[20, 3] = -0.0
    b = rng.normal(size=45)
    b[[3, 4]] = [-0.0, 0.0]  # exact leaf: -0.0 travels as +0.0
    return {  # one module: one bucket
        "a": {
            "w": jnp.asarray(w, F32),
            "b": jnp.asarray(b, F32),
            "v": jnp.asarray(rng.normal(size=(3, 32, 16)) * np.logspace(-3, 2, 16), F32),
            "big": jnp.asarray(rng.normal(size=(64, 256 if gran == "tiles" else 8)), F32),
            "s": jnp.asarray(rng.normal(size=(9, 16)), F32),
        }
    }


def _bucket(gran, m):
    params = _tree(gran)
    plan = vj.plan(params, make_mesh(m), granularity=GRAN[gran], split="none")
    (bucket,) = plan.buckets
    return params, plan, bucket, step_fp8.block_table(plan, 0, BLOCK)


@pytest.mark.parametrize("m", [3, 8])
def test_which_buckets_mosaic_gpu_takes(m):
    """Contiguous blocks are taken (tiles that are the blocks; blocks of whole rows; exact leaves), a row-major
    leaf whose 16x16 blocks are 16 pieces of rows is not: the policy then says Triton or XLA."""
    for gran in GRAN:
        _, _, bucket, table = _bucket(gran, m)
        assert _fp8_mosaic.takes(table, bucket.layout.shard_size), gran
    params = {"a": {"w": jnp.ones((64, 48), F32), "b": jnp.ones((5,), F32)}}
    plan = vj.plan(params, make_mesh(m), granularity=lambda p, x: vj.rows(16) if x.ndim >= 2 else vj.element())
    table = step_fp8.block_table(plan, 0, BLOCK)
    size = plan.buckets[0].layout.shard_size
    assert not _fp8_mosaic.takes(table, size)
    layout = plan.buckets[0].layout
    mosaic = vj.kernels.KernelPolicy(mode="pallas", interpret=False, backend="mosaic_gpu")
    assert mosaic.fused_implementation(layout, F32, jnp.float8_e4m3fn, platform="cuda", blocks=table) in (
        "triton",
        "xla",
    )
    _, _, bucket, tiled = _bucket("tiles", m)
    assert mosaic.fused_implementation(bucket.layout, F32, jnp.float8_e4m3fn, platform="cuda", blocks=tiled) == (
        "mosaic_gpu"
    )


@needs_kernels
@pytest.mark.parametrize(
    ("gran", "m", "dtype"),
    [("tiles", 1, F32), ("tiles", 3, F32), ("tiles", 8, BF16), pytest.param("rows", 3, BF16, marks=pytest.mark.slow)],
)
def test_quantize_and_dequantize_unpack_match_the_references(gran, m, dtype):
    params, plan, bucket, table = _bucket(gran, m)
    shards = jnp.asarray(np.asarray(vj.shard(params, plan).buffers[0]).reshape(m, -1), dtype)
    kw = dict(interpret=INTERPRET, backend="mosaic_gpu")
    codes, scales = [], []
    for k in range(m):
        c, s = kfp8.quantize(shards[k], table, k, **kw)
        rc, rs = kfp8.quantize_reference(shards[k], table, jnp.int32(k))
        assert_trees_equal(c, rc)
        assert_trees_equal(s, rs)
        codes.append(c)
        scales.append(s)
    codes, scales = jnp.stack(codes), jnp.stack(scales)
    shapes = [plan.layer_shape(plan.leaves[i]) for i in bucket.leaves]
    for out in (F32, BF16):
        got = kfp8.dequantize_unpack(
            codes, scales, table, bucket.layout, shapes, dtype=out, storage=bucket.storage, **kw
        )
        want = kfp8.dequantize_unpack_reference(
            codes, scales, table, bucket.layout, shapes, dtype=out, storage=bucket.storage
        )
        for g, w in zip(got, want, strict=True):
            assert_trees_equal(g, w)


@needs_kernels
@pytest.mark.slow
def test_stacked_layers_inside_shard_map():
    """Each device quantizes its own (L, S) rows (vmapped over layers) inside ``shard_map``: the outputs vary
    like the inputs and match the reference per device and layer."""
    m = 3
    params, plan, _, table = _bucket("tiles", m)
    base = np.asarray(vj.shard(params, plan).buffers[0]).reshape(m, -1)
    rows = jnp.asarray(np.stack([base, -2 * base], axis=1))  # (m, L=2, S)
    mesh = jax.make_mesh((m,), ("fsdp",), devices=jax.devices()[:m])
    spec = jax.sharding.PartitionSpec("fsdp")

    def local(x):
        k = jax.lax.axis_index("fsdp")
        c, s = jax.vmap(lambda r: kfp8.quantize(r, table, k, interpret=INTERPRET, backend="mosaic_gpu"))(x[0])
        return c[None], s[None]

    fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=(spec, spec)))
    codes, scales = fn(jax.device_put(rows, jax.sharding.NamedSharding(mesh, spec)))
    for k in range(m):
        for layer in range(2):
            rc, rs = kfp8.quantize_reference(rows[k, layer], table, jnp.int32(k))
            assert_trees_equal(np.asarray(codes)[k, layer], rc)
            assert_trees_equal(np.asarray(scales)[k, layer], rs)


def test_integer_fp8_codes_round_as_xla():
    """The element-by-element path's FP8 codes (integer arithmetic: no scalar of an 8-bit float on Mosaic GPU)
    are XLA's conversion bit for bit: normals, subnormals, ties, signed zeros; and the 256 codes decode alike."""
    rng = np.random.default_rng(0)
    edges = [0.0, -0.0, 448.0, -448.0, 2**-6, 2**-7, 2**-9, 2**-10, 3 * 2**-10, 1.5 * 2**-9, 2.5 * 2**-9, 241, 1e-40]
    y = np.concatenate(
        [rng.uniform(-448, 448, 50_000), rng.normal(size=50_000) * 1e-2, rng.normal(size=20_000) * 1e-3, edges]
    ).astype(np.float32)
    got = np.asarray(jax.jit(jax.vmap(_fp8_mosaic.code_bits))(jnp.asarray(y))).astype(np.uint8)
    want = np.asarray(jnp.asarray(y).astype(jnp.float8_e4m3fn)).view(np.uint8)
    np.testing.assert_array_equal(got, want)
    codes = jnp.arange(256, dtype=jnp.int32)
    values = jax.jit(jax.vmap(_fp8_mosaic.code_value))(codes)
    assert_trees_equal(values, jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), jnp.float8_e4m3fn).astype(F32))
