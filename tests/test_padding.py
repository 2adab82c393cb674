"""The padding invariant: padding stays exactly zero in params and optimizer moments whatever the data, and
norms over ShardedParams exclude it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import vescale_jax as vj
from vescale_jax.state._padding import has_padding


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def mlp_params():
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.5, jnp.float32)
    return {"l1": {"w": arr(5, 7), "b": arr(7)}, "l2": {"w": arr(7, 3), "b": arr(3)}}


def mlp(p, x):
    return jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"]) @ p["l2"]["w"] + p["l2"]["b"]


def loss_of(out, y):
    return jnp.mean((out - y) ** 2)


def data(n, nan_at=()):
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        x = rng.standard_normal((24, 5)).astype(np.float32)
        if i in nan_at:
            x[0, 0] = np.nan
        out.append({"x": x, "y": rng.standard_normal((24, 3)).astype(np.float32)})
    return out


def padding_values(sp):
    """All padding elements of a ShardedParams, gathered to the host."""
    vals = []
    for bucket, buf in zip(sp.plan.buckets, sp.buffers, strict=True):
        used = np.zeros(bucket.layout.total_size, bool)
        for n, o in zip(bucket.layout.sizes, bucket.layout.offsets, strict=True):
            used[o : o + n] = True
        vals.append(np.asarray(buf)[..., ~used].ravel())
    return np.concatenate(vals)


def sharded_nodes(tree):
    return [
        x
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, vj.ShardedParams))
        if isinstance(x, vj.ShardedParams)
    ]


def runs(tx, batches, m):
    """The unsharded run and the vj.fsdp run of ``tx``: per step (params, opt_state)."""
    params = mlp_params()
    plan = vj.plan(params, make_mesh(m))
    assert any(has_padding(plan, b) for b in range(len(plan.buckets)))

    @jax.jit
    def ref_step(p, s, batch):
        g = jax.grad(lambda p: loss_of(mlp(p, batch["x"]), batch["y"]))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    @vj.fsdp(plan=plan, donate=False)
    def step(p, s, batch):
        g = jax.grad(lambda p: loss_of(vj.apply(mlp, p, batch["x"]), batch["y"]))(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    ref, got = [], []
    p, s = params, tx.init(params)
    sp = vj.shard(params, plan)
    ss = vj.init_opt_state(tx, sp)
    for batch in batches:
        p, s = ref_step(p, s, batch)
        sp, ss = step(sp, ss, batch)
        ref.append((p, s))
        got.append((sp, ss))
    return ref, got


@pytest.mark.parametrize("m", [3, 8], ids=lambda m: f"m{m}")
def test_a_nan_batch_leaves_padding_of_params_and_moments_zero(m):
    """chain(clip_by_global_norm, adamw): a NaN batch makes every leaf NaN (in the reference too); the padding of
    params, mu and nu stays exactly 0. Under apply_if_finite the NaN step is skipped and later steps match."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(0.05, weight_decay=0.1))
    ref, got = runs(tx, data(2, nan_at=(0,)), m)
    for (p_ref, _), (sp, state) in zip(ref, got, strict=True):
        nodes = [sp, *sharded_nodes(state)]
        assert len(nodes) == 3  # params, mu, nu
        for node in nodes:
            np.testing.assert_array_equal(padding_values(node), 0.0)
        for r, g in zip(jax.tree.leaves(p_ref), jax.tree.leaves(vj.unshard(sp)), strict=True):
            np.testing.assert_array_equal(np.isnan(np.asarray(g)), np.isnan(np.asarray(r)))

    ref, got = runs(optax.apply_if_finite(tx, 5), data(3, nan_at=(0,)), m)
    for (p_ref, _), (sp, state) in zip(ref, got, strict=True):
        for node in [sp, *sharded_nodes(state)]:
            np.testing.assert_array_equal(padding_values(node), 0.0)
        for r, g in zip(jax.tree.leaves(p_ref), jax.tree.leaves(vj.unshard(sp)), strict=True):
            assert np.all(np.isfinite(np.asarray(g)))
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_zero_over_zero_in_the_padding_does_not_reach_norms():
    """Adam with eps=0 computes 0/0 = NaN on the padding (zero gradient there): the padding stays 0 and the
    params' global norm stays the logical one; vj.optim.clip_by_global_norm after it still clips right."""
    tx = optax.chain(optax.scale_by_adam(eps=0.0), vj.optim.clip_by_global_norm(0.5), optax.scale(-0.1))
    ref, got = runs(tx, data(3), 3)
    norm_of = jax.jit(optax.tree.norm)
    for (p_ref, _), (sp, _) in zip(ref, got, strict=True):
        np.testing.assert_array_equal(padding_values(sp), 0.0)
        np.testing.assert_allclose(float(norm_of(sp)), float(optax.tree.norm(p_ref)), rtol=1e-6)
        for r, g in zip(jax.tree.leaves(p_ref), jax.tree.leaves(vj.unshard(sp)), strict=True):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [1, 3, 8], ids=lambda m: f"m{m}")
def test_norms_and_maps_exclude_padding(m):
    params = mlp_params()
    plan = vj.plan(params, make_mesh(m))
    sp = vj.shard(params, plan)
    plus = jax.tree.map(lambda x: x + 1, params)
    want = float(optax.tree.norm(plus))

    def everything(sp):
        mapped = jax.tree.map(lambda x: x + 1, sp)  # puts 1.0 in the padding
        kept = vj.tree_map(lambda x: x + 1, sp)
        updated = vj.apply_updates(sp, jax.tree.map(lambda x: x * 0 + 2, sp))
        # zero_padding selects: leaf values are untouched, NaN included; non-ShardedParams leaves pass through.
        zeroed = vj.zero_padding({"a": jax.tree.map(lambda x: x * jnp.nan, sp), "n": jnp.ones(3)})
        return optax.tree.norm(mapped), vj.global_norm(mapped), kept, optax.tree.norm(kept), updated, zeroed

    with jax.set_mesh(plan.mesh):
        naive, norm, kept, kept_norm, updated, zeroed = jax.jit(everything)(sp)
    assert float(naive) > want * 1.01  # what optax reads off the buckets
    assert float(norm) == pytest.approx(want, rel=1e-6)
    assert float(kept_norm) == pytest.approx(want, rel=1e-6)
    for node in (kept, updated, zeroed["a"]):
        np.testing.assert_array_equal(padding_values(node), 0.0)
    assert all(np.isnan(np.asarray(x)).all() for x in jax.tree.leaves(vj.unshard(zeroed["a"])))
    np.testing.assert_array_equal(np.asarray(zeroed["n"]), 1.0)
    for x, y in zip(jax.tree.leaves(vj.unshard(kept)), jax.tree.leaves(plus), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_step_that_maps_over_params_keeps_padding_zero():
    params = mlp_params()
    plan = vj.plan(params, make_mesh(3))

    @vj.fsdp(plan=plan, donate=False)
    def step(p, s, batch):
        return jax.tree.map(lambda x: x + 1, p), s

    out, _ = step(vj.shard(params, plan), None, data(1)[0])
    np.testing.assert_array_equal(padding_values(out), 0.0)
    assert float(jax.jit(optax.tree.norm)(out)) == pytest.approx(
        float(optax.tree.norm(jax.tree.map(lambda x: x + 1, params))), rel=1e-6
    )


NAN_PAYLOADS = {  # dtype -> (unsigned bits dtype, NaNs with payloads and signs, no canonical one among them)
    "bfloat16": (np.uint16, [0xFF81, 0x7F81, 0x7FC1, 0xFFFF, 0x7FA5]),
    "float16": (np.uint16, [0xFC01, 0x7D01, 0xFE01, 0x7FFF]),
    "float32": (np.uint32, [0xFF800001, 0x7F800123, 0xFFC00001, 0x7FFFFFFF]),
}


def nan_tree():
    """Per dtype: a bucket shared by a NaN-payload leaf and a plain one; for bf16 a stacked group of them too."""
    tree = {}
    for dtype, (bits, payloads) in NAN_PAYLOADS.items():
        raw = lambda n, bits=bits, payloads=payloads: jnp.asarray(np.resize(np.array(payloads, bits), n))
        nans = lambda n, *shape, raw=raw, dtype=dtype: jax.lax.bitcast_convert_type(raw(n), jnp.dtype(dtype)).reshape(
            shape or (n,)
        )
        tree[dtype] = {"x": nans(11), "y": jnp.arange(5).astype(dtype)}
        if dtype == "bfloat16":
            tree["layers"] = {"w": nans(21, 3, 7), "b": jnp.ones((3, 2), dtype)}
    return tree


def bits_of(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(p): np.asarray(x).view(f"uint{8 * np.dtype(x.dtype).itemsize}") for p, x in flat}


@pytest.mark.parametrize("m", [1, 3, 8])
def test_nan_payloads_are_bit_exact_through_shard_unshard_and_zero_padding(m):
    """vj.shard / vj.unshard, vj.zero_padding and vj.tree_map keep NaN payloads of bf16, fp16 and fp32 leaves
    as they are, bit for bit against the input (bf16 0xff81 became 0xffc0: XLA:CPU moved it through fp32)."""
    params = nan_tree()
    plan = vj.plan(params, make_mesh(m), stacked=["layers"])
    assert m == 1 or all(has_padding(plan, b) for b in range(len(plan.buckets)))
    sp = vj.shard(params, plan)
    want = bits_of(params)
    for what, got in [
        ("shard/unshard", sp),
        ("zero_padding", vj.zero_padding(sp)),
        ("tree_map", vj.tree_map(lambda x: x, sp)),
    ]:
        for path, g in bits_of(vj.unshard(got)).items():
            w = want[path]
            assert g.tobytes() == w.tobytes(), (
                what,
                path,
                [hex(v) for v in g.ravel()[:4]],
                [hex(v) for v in w.ravel()[:4]],
            )
