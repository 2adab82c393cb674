"""Block-wise quantization against a NumPy implementation of the same formulas, bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import vescale_jax as vj


def reference(x, block, dtype):
    """NumPy, one block at a time: scale = absmax * fp32(1 / qmax), code = round-half-even(x / scale)."""
    x = np.asarray(x, np.float32)
    q = np.float32(127.0 if dtype == "int8" else 448.0)
    codes = np.zeros(x.shape, np.int8 if dtype == "int8" else ml_dtypes.float8_e4m3fn)
    if len(block) == 1:
        lead, spans = (), [range(0, x.shape[0], block[0])]
    else:
        lead, spans = x.shape[:-2], [range(0, x.shape[-2], block[0]), range(0, x.shape[-1], block[1])]
    scales = np.zeros((*lead, *(len(s) for s in spans)), np.float32)
    for idx in np.ndindex(*lead):
        for bi in np.ndindex(*(len(s) for s in spans)):
            sl = tuple(slice(s[i], s[i] + b) for s, i, b in zip(spans, bi, block, strict=True))
            tile = x[idx + sl]
            scale = np.float32(np.max(np.abs(tile))) * np.float32(1.0 / q)
            scales[idx + bi] = scale
            y = tile / (scale if scale > 0 else np.float32(1))
            codes[idx + sl] = np.clip(np.round(y), -q, q).astype(np.int8) if dtype == "int8" else y.astype(codes.dtype)
    return codes, scales


CASES = [((300,), (128,)), ((7, 5), (4, 2)), ((256, 384), (128, 128)), ((3, 130, 70), (32, 32)), ((1, 1), (128, 128))]


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize(("shape", "block"), CASES, ids=[f"{s}-{b}" for s, b in CASES])
def test_quantize_matches_the_numpy_reference_bitwise(shape, block, dtype):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * rng.uniform(0.01, 100)).astype(np.float32)
    if x.size > 4:
        x.reshape(-1)[:3] = 0.0  # a block may hold zeros
    got = vj.quant.quantize(jnp.asarray(x), block=block if len(block) == 2 else block[0], dtype=getattr(jnp, dtype))
    codes, scales = reference(x, block, dtype)
    np.testing.assert_array_equal(np.asarray(got.scales).view(np.uint32), scales.view(np.uint32))
    np.testing.assert_array_equal(np.asarray(got.codes).view(np.uint8), codes.view(np.uint8))
    deq = np.asarray(vj.quant.dequantize(got))
    if len(block) == 2:
        per = np.repeat(np.repeat(scales, block[0], axis=-2), block[1], axis=-1)[..., : shape[-2], : shape[-1]]
    else:
        per = np.repeat(scales, block[0])[: shape[0]]
    want = codes.astype(np.float32) * per
    np.testing.assert_array_equal(deq.view(np.uint32), want.astype(np.float32).view(np.uint32))
    assert vj.quant.num_blocks(shape, block if len(block) == 2 else block[0]) == scales.size
    jitted = jax.jit(
        lambda a: vj.quant.quantize(a, block=got.block if len(block) == 2 else block[0], dtype=getattr(jnp, dtype))
    )
    again = jitted(jnp.asarray(x))  # compiled whole, XLA's rewrites change nothing
    np.testing.assert_array_equal(np.asarray(again.codes).view(np.uint8), codes.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(again.scales).view(np.uint32), scales.view(np.uint32))


def test_error_is_bounded_by_half_a_step():
    x = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    q = vj.quant.quantize(jnp.asarray(x), block=(16, 16))
    err = np.abs(np.asarray(vj.quant.dequantize(q)) - x)
    step = np.repeat(np.repeat(np.asarray(q.scales), 16, 0), 16, 1)
    assert np.all(err <= step / 2 * (1 + 1e-6))


def test_a_zero_block_has_zero_scale_and_codes():
    x = jnp.zeros((8, 8)).at[4:, 4:].set(1.0)
    q = vj.quant.quantize(x, block=(4, 4))
    np.testing.assert_array_equal(np.asarray(q.scales), np.array([[0, 0], [0, np.float32(1 / 127)]], np.float32))
    np.testing.assert_array_equal(np.asarray(vj.quant.dequantize(q)), np.asarray(x))


@pytest.mark.parametrize(
    ("shape", "block", "dtype", "match"),
    [
        ((8,), (4, 4), jnp.int8, "at least 2 dims"),
        ((8, 8), 4, jnp.int8, "for vectors"),
        ((8, 8), (0, 4), jnp.int8, "positive"),
        ((8, 8), (4, 4), jnp.int16, "int8 or float8_e4m3fn"),
    ],
)
def test_bad_inputs_are_refused(shape, block, dtype, match):
    with pytest.raises(ValueError, match=match):
        vj.quant.quantize(jnp.ones(shape), block=block, dtype=dtype)


def test_integer_input_is_refused():
    with pytest.raises(ValueError, match="floating"):
        vj.quant.quantize(jnp.ones((4, 4), jnp.int32), block=(2, 2))
