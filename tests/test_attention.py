"""vj.attention and vj.positions mean the whole sequence, also when it is split over a context axis.

The same per-device model (positions, a mask and bias built from them, attention) runs once on the whole sequences
outside any step, and once inside ``jax.shard_map`` under ``over_context`` on the sequences reordered by
``sequence_order`` and split over the context axis; outputs (after undoing the order) and gradients with respect to
query, key and value are compared. Outside a step vj.attention is checked against jax.nn.dot_product_attention.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
from vescale_jax.step._context import Context, over_context, sequence_order

B, T, N, H = 2, 32, 4, 8  # batch, global sequence, query heads, head dim


def _inputs(K, dtype, *, batch=B, seed=0):
    r = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(r.normal(size=(batch, T, n, H)), dtype) for n in (N, K, K))
    # Packed documents: sorted ids, several documents per row, the cuts at random places.
    ids = jnp.asarray(np.sort(r.integers(0, 4, size=(batch, T)), axis=1), jnp.int32)
    w = jnp.asarray(r.normal(size=(batch, T, N, H)), jnp.float32)
    return q, k, v, ids, w


def _model(q, k, v, ids, *, causal, impl, extras):
    """What a model does per device: positions, a window mask and an ALiBi-like bias from them, attention."""
    mask = bias = None
    if extras:
        q_pos = vj.positions(q)
        k_pos = jnp.arange(T, dtype=jnp.int32)  # the global key positions, natural order
        dist = q_pos[:, None] - k_pos[None, :]
        mask = (jnp.abs(dist) < 12)[None, None]
        slopes = jnp.asarray([0.05, 0.1, 0.2, 0.4], jnp.float32)[:, None, None]
        bias = (-slopes * jnp.abs(dist).astype(jnp.float32))[None]  # (1, N, T, S)
    return vj.attention(q, k, v, causal=causal, segment_ids=ids, mask=mask, bias=bias, implementation=impl)


def _sharded(model, mesh, ctx, *, vma=True):
    """``model`` on the whole sequences, computed per device under the context axis (and the data axis, if any)."""
    spec = P("data" if "data" in mesh.axis_names else None, ctx.axis)
    order = sequence_order(T, ctx)
    undo = np.argsort(order)

    def local(*args):
        with over_context(ctx):
            return model(*args)

    mapped = jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=vma)

    def whole(q, k, v, ids):
        ids = None if ids is None else ids[:, order]
        return mapped(q[:, order], k[:, order], v[:, order], ids)[:, undo]

    return whole


def _compare(mesh, ctx, *, K=2, causal=True, impl=None, segments=True, extras=False, dtype=jnp.float32, vma=True):
    batch = B * (mesh.shape["data"] if "data" in mesh.axis_names else 1)
    q, k, v, ids, w = _inputs(K, dtype, batch=batch)
    ids = ids if segments else None
    model = functools.partial(_model, causal=causal, impl=impl, extras=extras)
    sharded = _sharded(model, mesh, ctx, vma=vma)

    def loss(f):
        return lambda q, k, v: jnp.sum(f(q, k, v, ids).astype(jnp.float32) * w)

    def both(f):
        return f(q, k, v, ids), jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)

    want = jax.jit(functools.partial(both, model))()
    got = jax.jit(functools.partial(both, sharded))()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    for name, a, b in zip(("out", "d_query", "d_key", "d_value"), (got[0], *got[1]), (want[0], *want[1]), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol:.0e}"


def _mesh(shape, names):
    n = int(np.prod(shape))
    if n > len(jax.devices()):
        pytest.skip(f"needs {n} devices, {len(jax.devices())} available")
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


# --- Outside a context step: jax.nn.dot_product_attention ---------------------------------------------------------


def test_outside_a_step_is_jax_dot_product_attention():
    q, k, v, ids, _ = _inputs(2, jnp.float32)
    same = (ids[:, :, None] == ids[:, None, :])[:, None]
    got = vj.attention(q, k, v, segment_ids=ids)
    want = jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True)
    np.testing.assert_array_equal(got, want)
    got = vj.attention(q, k, v, causal=False, segment_ids=(ids, ids))
    np.testing.assert_array_equal(got, jax.nn.dot_product_attention(q, k, v, mask=same))
    np.testing.assert_array_equal(vj.positions(q), np.arange(T))
    np.testing.assert_array_equal(vj.positions(7), np.arange(7))


# --- Under a context axis: the whole sequence's attention ---------------------------------------------------------


def test_context_all_gather_matches_whole_sequence():
    # Balanced causal chunks on 4 devices, packed documents, grouped-query attention (N=4, K=2).
    _compare(_mesh((4,), ("context",)), Context("context", 4), K=2, impl="all_gather")


def test_context_ring_with_mask_and_bias_on_data_and_context_axes():
    # A (data, context) mesh of 3 x 2: multi-query attention (K=1), packed documents, and a window mask and an
    # ALiBi-like bias built from vj.positions, by the ring with causal block skipping.
    _compare(_mesh((3, 2), ("data", "context")), Context("context", 2), K=1, impl="ring", extras=True)


@pytest.mark.parametrize("cp,K,want", [(2, 4, "all_gather"), (4, 4, "ppermute"), (4, 2, "all_gather")])
def test_the_rule_chooses_the_ring_when_gathered_keys_outgrow_the_queries(cp, K, want):
    # implementation=None: the ring when cp * K > 2 * N (N = 4 here), the all-gather otherwise. Traced only.
    ctx = Context("context", cp)
    q, k, v, _, _ = _inputs(K, jnp.float32)

    def local(q, k, v):
        with over_context(ctx):
            return vj.attention(q, k, v)

    spec = P(None, "context")
    mapped = jax.shard_map(local, mesh=_mesh((cp,), ("context",)), in_specs=spec, out_specs=spec)
    text = str(jax.make_jaxpr(mapped)(q, k, v))
    assert want in text and ({"all_gather", "ppermute"} - {want}).pop() not in text


def test_positions_under_a_context_axis():
    ctx = Context("context", 4)
    mesh = _mesh((4,), ("context",))

    def local(x):
        with over_context(ctx):
            return vj.positions(x)[None], vj.positions(x.shape[1])[None]

    x = jnp.zeros((2, T, 3))
    got, by_length = jax.shard_map(local, mesh=mesh, in_specs=P(None, "context"), out_specs=P("context"))(x)
    np.testing.assert_array_equal(got.reshape(-1), sequence_order(T, ctx))
    np.testing.assert_array_equal(by_length.reshape(-1), sequence_order(T, ctx))

    # Positions within packed documents: they restart where the id changes, also across devices.
    ids = _inputs(2, jnp.float32)[3]
    within = vj.positions(ids, segment_ids=ids)
    starts = [np.flatnonzero(np.diff(row, prepend=-1)) for row in np.asarray(ids)]
    want = [np.arange(T) - s[np.searchsorted(s, np.arange(T), side="right") - 1] for s in starts]
    np.testing.assert_array_equal(within, np.stack(want))

    def local_within(ids):
        with over_context(ctx):
            return vj.positions(ids, segment_ids=ids)

    order = sequence_order(T, ctx)
    mapped = jax.shard_map(local_within, mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"))
    np.testing.assert_array_equal(mapped(ids[:, order])[:, np.argsort(order)], within)


def test_errors_name_the_argument_and_the_fix():
    q, k, v, ids, _ = _inputs(2, jnp.float32)
    with pytest.raises(ValueError, match="implementation='flash'"):
        vj.attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError, match=r"not a multiple of key heads K=3"):
        vj.attention(q, jnp.zeros((B, T, 3, H)), jnp.zeros((B, T, 3, H)))
    with pytest.raises(ValueError, match=r"segment_ids of shape \(2, 5\)"):
        vj.attention(q, k, v, segment_ids=ids[:, :5])
    with pytest.raises(ValueError, match="pass a boolean mask"):
        vj.attention(q, k, v, mask=jnp.ones((1, 1, T, T), jnp.float32))
    with pytest.raises(ValueError, match="axis=3 is out of range"):
        vj.positions(ids, axis=3)
    ctx = Context("context", 2)
    mesh = _mesh((2,), ("context",))

    def cross(q, k, v):
        with over_context(ctx):
            return vj.attention(q, k[:, :4], v[:, :4])

    with pytest.raises(ValueError, match=r"key's sequence length 4 .* only self-attention"):
        jax.shard_map(cross, mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"))(q, k, v)

    def bad_mask(q, k, v):
        with over_context(ctx):
            return vj.attention(q, k, v, mask=jnp.ones((1, 1, T // 2, T // 2), bool))

    with pytest.raises(ValueError, match=r"mask of shape \(1, 1, 16, 16\) under context axis 'context'"):
        jax.shard_map(bad_mask, mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"))(q, k, v)

    def odd(q, k, v):
        with over_context(ctx):
            return vj.attention(q, k, v)

    with pytest.raises(ValueError, match=r"query sequence length 6 does not split .* multiple of 2 x 2"):
        jax.shard_map(odd, mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"))(
            *(x[:, :6] for x in (q, k, v))
        )


# --- The broad matrix ---------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["all_gather", "ring"])
@pytest.mark.parametrize("cp", [2, 4, 8])
@pytest.mark.parametrize("balance", ["causal", None], ids=["balanced", "contiguous"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("K", [4, 1], ids=["K4", "K1"])
def test_context_attention_matrix(impl, cp, balance, causal, K):
    _compare(_mesh((cp,), ("context",)), Context("context", cp, balance), K=K, causal=causal, impl=impl)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["all_gather", "ring"])
@pytest.mark.parametrize("shape", [(2, 4), (3, 2)], ids=["2x4", "3x2"])
@pytest.mark.parametrize("vma", [True, False], ids=["vma", "no-vma"])
@pytest.mark.parametrize("extras", [False, True], ids=["segments", "mask-bias"])
def test_context_attention_data_and_context_axes(impl, shape, vma, extras):
    mesh = _mesh(shape, ("data", "context"))
    _compare(mesh, Context("context", shape[1]), impl=impl, vma=vma, extras=extras)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["all_gather", "ring"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_context_attention_bf16(impl, causal):
    # jax.nn.dot_product_attention promotes bf16 logits to fp32 implicitly: not allowed under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        _compare(_mesh((4,), ("context",)), Context("context", 4), impl=impl, causal=causal, dtype=jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["all_gather", "ring"])
@pytest.mark.parametrize("balance", ["causal", None], ids=["balanced", "contiguous"])
def test_context_attention_mask_bias_without_segments_on_8(impl, balance):
    _compare(_mesh((8,), ("context",)), Context("context", 8, balance), impl=impl, segments=False, extras=True)
