"""The gather path in one module: reshard-after-forward keeps its state in the residuals, the backward's tie to
the cotangent changes no value, the stacked path packs gradients as the flat one does, and HSDP's replica sum
does not depend on shard_map's varying-axes check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh

import vescale_jax as vj
from vescale_jax.step import _wire as collectives

V, D, L, T = 19, 6, 3, 5


def tiny_params(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"embed": (V, D), "blocks": {"w": (L, D, D), "b": (L, D)}, "head": (D, V)}
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s) * 0.5, jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def tiny_model(p, tokens):
    h = p["embed"][tokens]
    h = vj.scan_layers(lambda lp, h: jnp.tanh(h @ lp["w"] + lp["b"]), p["blocks"], h)
    return h @ p["head"]


def tokens(batch, seed=1):
    return np.random.default_rng(seed).integers(0, V, size=(batch, T)).astype(np.int32)


def grad_step(plan, loss, **kw):
    @vj.fsdp(plan=plan, donate=False, **kw)
    def step(params, _, batch):
        return jax.grad(lambda p: loss(lambda *a: vj.apply(lambda q, *b: tuple_out(q, *b), p, *a), batch))(params)

    return step


def tuple_out(p, x, tok):
    return x, tiny_model(p, tok)


def assert_close_trees(got, ref, rtol=1e-5):
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(ref), strict=True):
        g, r = np.asarray(g), np.asarray(r)
        assert np.all(np.isfinite(g)), f"{jax.tree_util.keystr(path)} is not finite"
        np.testing.assert_allclose(g, r, rtol=rtol, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_an_inf_cotangent_leaves_the_regathered_parameters_alone(reshard):
    """The first cotangent element is inf (an output the parameters do not affect, weighted by inf): the
    parameters' gradients stay finite and equal the unsharded ones."""
    params = tiny_params()
    plan = vj.plan(params, make_mesh(3), stacked=("blocks",))
    x = np.ones((6, T), np.float32)
    batch = {"x": x, "tok": tokens(6)}

    def loss(model, b):
        passthrough, logits = model(b["x"], b["tok"])
        return jnp.sum(passthrough * jnp.inf) + jnp.mean(logits**2)

    def ref_loss(p):
        return loss(lambda xx, tok: (xx, tiny_model(p, tok)), batch)

    got = grad_step(plan, loss, reshard_after_forward=reshard)(vj.shard(params, plan), None, batch)
    assert_close_trees(vj.unshard(got), jax.grad(ref_loss)(params))


def test_tie_changes_no_value():
    bufs = [
        jnp.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 1.5], jnp.float32),
        jnp.arange(4, dtype=jnp.int32),
        jnp.array([-0.0, 2.0], jnp.bfloat16),
        jnp.zeros((0,), jnp.float32),
    ]
    for anchor in (
        jnp.array([np.inf, 1.0]),
        jnp.array([np.nan]),
        jnp.array([-3.0]),
        jnp.array([0.0], jnp.bfloat16),
        jnp.array([1 + 2j], jnp.complex64),
        {"no": jnp.arange(3)},
    ):
        out = jax.jit(collectives.tie)(bufs, anchor)
        for a, b in zip(out, bufs, strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_flat_and_stacked_buckets_pack_gradients_the_same_way(reshard):
    """Every bucket's gradient is packed by one concatenate (collectives.pack), never by the transposes of
    the unpack's slices (one full-size pad per leaf)."""
    params = tiny_params()
    plan = vj.plan(params, make_mesh(2), stacked=("blocks",))
    batch = {"x": np.ones((4, T), np.float32), "tok": tokens(4)}
    step = grad_step(plan, lambda model, b: jnp.mean(model(b["x"], b["tok"])[1] ** 2), reshard_after_forward=reshard)
    text = step.lower(vj.shard(params, plan), None, batch).as_text()
    assert "stablehlo.pad" not in text
    assert text.count("stablehlo.concatenate") >= len(plan.buckets)


def test_hsdp_replica_sum_does_not_depend_on_the_varying_axes_check():
    """With the Pallas kernels interpreted (check_vma off, nothing typed as varying) HSDP still sums the
    gradient over the replicas: the same gradients as the XLA path, and as unsharded."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.make_mesh(
        (2, 2), ("replica", "fsdp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2, devices=jax.devices()[:4]
    )
    params = tiny_params()
    plan = vj.plan(params, mesh, axis="fsdp", stacked=("blocks",))
    batch = {"x": np.ones((4, T), np.float32), "tok": tokens(4)}

    def loss(model, b):
        return jnp.mean(model(b["x"], b["tok"])[1] ** 2)

    ref = jax.grad(lambda p: loss(lambda xx, tok: (xx, tiny_model(p, tok)), batch))(params)
    for mode in ("xla", "pallas"):
        policy = vj.kernels.KernelPolicy(mode=mode)
        assert policy.check_vma == (mode == "xla")
        got = grad_step(plan, loss, data_axes=("replica", "fsdp"), kernels=policy)(vj.shard(params, plan), None, batch)
        assert_close_trees(vj.unshard(got), ref)


def test_apply_on_gathered_copies_takes_the_kernel_policy(monkeypatch):
    """vj.apply on the full copies of vj.accumulate(reduce="once") honours kernels= as on shards."""
    from vescale_jax.step import _accumulate as _accumulate

    params = tiny_params()
    plan = vj.plan(params, make_mesh(2), stacked=("blocks",))
    copies = _accumulate.gather_copies(vj.shard(params, plan))
    tok = vj.place_batch(tokens(4), plan)
    calls = []
    real = vj.kernels.unpack
    monkeypatch.setattr(vj.kernels._ragged, "unpack", lambda *a, **k: calls.append(1) or real(*a, **k))
    outs = {
        mode: vj.apply(tiny_model, copies, tok, kernels=vj.kernels.KernelPolicy(mode=mode))
        for mode in ("xla", "pallas")
    }
    assert calls
    np.testing.assert_array_equal(np.asarray(outs["xla"]), np.asarray(outs["pallas"]))
