"""Batch statistics inside vj.apply mean what they mean unsharded: vj.batch_mean / vj.batch_sum, auxiliary
outputs returned whole, and control flow on a per-device statistic refused at trace time.

Every comparison is against the same model run unsharded on one device (where vj.batch_mean is jnp.mean).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import assert_trees_close

import vescale_jax as vj

COUNTS = (1, 3, 8)
B, T, D, E, H = 24, 4, 8, 4, 16  # batch, tokens per example, width, experts, expert width


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


# --- A mixture-of-experts layer with a load-balancing loss ------------------------------------------------------


def moe_params(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "router": jax.random.normal(k[0], (D, E)) * 0.5,
        "experts": jax.random.normal(k[1], (E, D, H)) / np.sqrt(D),
        "head": jax.random.normal(k[2], (H,)) / np.sqrt(H),
        "embed": jax.random.normal(k[3], (D, D)) / np.sqrt(D),
    }


def moe(p, x):
    """``x`` (b, T, D) -> per-example outputs (b, T) and the Switch load-balancing loss E * sum_i f_i * P_i, with
    f_i the fraction of tokens routed to expert i and P_i the mean router probability, over the batch."""
    tok = jnp.tanh(x.reshape(-1, D) @ p["embed"])
    probs = jax.nn.softmax(tok @ p["router"], axis=-1)
    top = jnp.argmax(probs, axis=-1)
    gate = jnp.take_along_axis(probs, top[:, None], axis=-1)[:, 0]
    hidden = jnp.einsum("nd,edh->neh", tok, p["experts"])
    chosen = jnp.take_along_axis(hidden, top[:, None, None], axis=1)[:, 0]
    y = (jnp.tanh(chosen) @ p["head"]) * gate
    f = vj.batch_mean(jax.nn.one_hot(top, E), axis=0)
    router_p = vj.batch_mean(probs, axis=0)
    return y.reshape(x.shape[0], T), E * jnp.sum(f * router_p)


def moe_loss(out, y):
    pred, aux = out
    return jnp.mean((pred - y) ** 2) + 0.5 * aux


def moe_data(steps=3, seed=1):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(B, T, D)).astype(np.float32), "y": rng.normal(size=(B, T)).astype(np.float32)}
        for _ in range(steps)
    ]


def reference(params, model, loss, tx, data):
    """The unsharded run: per step the gradients, the loss and the params after the update."""

    @jax.jit
    def step(p, o, batch):
        value, g = jax.value_and_grad(lambda p: loss(model(p, batch["x"]), batch["y"]))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value, g

    out, o = [], tx.init(params)
    for batch in data:
        params, o, value, g = step(params, o, batch)
        out.append((g, float(value), params))
    return out


def sharded(params, model, loss, tx, data, m, **options):
    plan = vj.plan(params, make_mesh(m))

    @vj.fsdp(plan=plan, **options)
    def step(p, o, batch):
        value, g = jax.value_and_grad(lambda p: loss(vj.apply(model, p, batch["x"]), batch["y"]))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, {"loss": value, "grads": g}

    sp, o, out = vj.shard(params, plan), vj.init_opt_state(tx, vj.shard(params, plan)), []
    for batch in data:
        sp, o, metrics = step(sp, o, batch)
        out.append((vj.unshard(metrics["grads"]), float(metrics["loss"]), vj.unshard(sp)))
    return out


def moe_tx():
    return optax.adamw(1e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def moe_reference():
    params, data = moe_params(), moe_data()
    with jax.numpy_dtype_promotion("standard"):
        return params, data, reference(params, moe, moe_loss, moe_tx(), data)


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_moe_aux_loss_gradients_match_unsharded(m, moe_reference):
    params, data, want = moe_reference
    _check_steps(sharded(params, moe, moe_loss, moe_tx(), data, m), want)
    # The load-balancing term moves the router: without it the router's gradient differs (the test can fail).
    no_aux = reference(params, moe, lambda out, y: jnp.mean((out[0] - y) ** 2), moe_tx(), data[:1])
    assert np.max(np.abs(no_aux[0][0]["router"] - want[0][0]["router"])) > 1e-2 * np.max(np.abs(want[0][0]["router"]))


@pytest.mark.slow
def test_moe_aux_loss_with_interpreted_kernels(moe_reference):
    # The Pallas kernels run interpreted on CPU with shard_map's varying-axes check off: the batch dependence is
    # followed through the sums all the same, so the auxiliary loss is still returned whole and exact.
    params, data, want = moe_reference
    kernels = vj.kernels.KernelPolicy(mode="pallas", interpret=True)
    _check_steps(sharded(params, moe, moe_loss, moe_tx(), data[:2], 3, kernels=kernels), want[:2])


def _check_steps(got, want):
    for i, ((g, loss, p), (g0, loss0, p0)) in enumerate(zip(got, want, strict=True)):
        assert_trees_close(g, g0, rtol=1e-5, what=f"step {i} gradients")
        np.testing.assert_allclose(loss, loss0, rtol=1e-5, err_msg=f"step {i} loss")
        assert_trees_close(p, p0, rtol=1e-5, what=f"step {i} params")


def test_moe_aux_output_is_the_unsharded_value():
    # The auxiliary loss leaves vj.apply whole (a scalar), equal to the unsharded one; the outputs per example.
    params, batch = moe_params(), moe_data(1)[0]
    plan = vj.plan(params, make_mesh(3))
    pred, aux = jax.jit(lambda sp, x: vj.apply(moe, sp, x))(vj.shard(params, plan), vj.place_batch(batch["x"], plan))
    pred0, aux0 = moe(params, batch["x"])
    assert aux.shape == () and pred.shape == (B, T)
    np.testing.assert_allclose(aux, aux0, rtol=1e-6)
    np.testing.assert_allclose(pred, pred0, rtol=1e-5, atol=1e-6)


# --- vj.batch_mean / vj.batch_sum -------------------------------------------------------------------------------


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_batch_mean_and_sum_are_global(m):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(B, 5)).astype(np.float32)
    mask = rng.random((B, 5)) > 0.4
    w = rng.normal(size=(5,)).astype(np.float32)

    def stats(p, x, mask):
        h = x * p["w"]
        return {
            "mean": vj.batch_mean(h),
            "all": vj.batch_mean(h, axis=None),
            "keep": vj.batch_mean(h, axis=(0, 1), keepdims=True),
            "masked": vj.batch_mean(h, where=mask),
            "sum": vj.batch_sum(h),
            "count": vj.batch_sum(mask.astype(jnp.int32)),
            "bf16": vj.batch_mean(h.astype(jnp.bfloat16)),
        }

    params = {"w": jnp.asarray(w)}
    want = stats(params, x, mask)
    plan = vj.plan(params, make_mesh(m))
    got = jax.jit(lambda sp, x, k: vj.apply(stats, sp, x, k))(
        vj.shard(params, plan), vj.place_batch(x, plan), vj.place_batch(mask, plan)
    )
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
    assert_trees_close(
        {k: v.astype(jnp.float32) for k, v in got.items() if k != "bf16"},
        {k: v.astype(jnp.float32) for k, v in want.items() if k != "bf16"},
        rtol=1e-6,
    )
    np.testing.assert_array_equal(got["count"], want["count"])
    # bf16: summed in fp32 and rounded once, as jnp.mean does: within one bf16 ulp.
    np.testing.assert_allclose(got["bf16"].astype(np.float32), want["bf16"].astype(np.float32), rtol=2**-7)


def test_gradient_of_a_product_of_batch_means():
    # d/dw of mean(x·w)·mean((x·w)²): per-device products averaged afterwards would be off; the global ones are not.
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(B, 3)).astype(np.float32), rng.normal(size=(3,)).astype(np.float32)
    f = lambda p, x: jnp.sum(vj.batch_mean(x * p["w"]) * vj.batch_mean((x * p["w"]) ** 2))[None].repeat(x.shape[0])
    params = {"w": jnp.asarray(w)}
    want = jax.grad(lambda p: jnp.mean(f(p, x)))(params)
    plan = vj.plan(params, make_mesh(8))
    got = jax.jit(jax.grad(lambda sp, x: jnp.mean(vj.apply(f, sp, x))))(vj.shard(params, plan), vj.place_batch(x, plan))
    assert_trees_close(vj.unshard(got), want, rtol=1e-5)


def test_batch_mean_outside_apply_is_jnp_mean():
    x = jnp.arange(12.0).reshape(4, 3)
    np.testing.assert_array_equal(vj.batch_mean(x), jnp.mean(x, axis=0))
    np.testing.assert_array_equal(vj.batch_sum(x, axis=None), jnp.sum(x))
    with pytest.raises(ValueError, match=r"axis=5 for an array of shape \(4, 3\)"):
        vj.batch_mean(x, axis=5)


# --- Outputs: whole when they do not vary, refused when a scalar varies ------------------------------------------


def small_params(seed=0):
    k = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k[0], (D, H)) / np.sqrt(D), "w2": jax.random.normal(k[1], (H, 1)) / np.sqrt(H)}


def signed_batch(seed=4):
    """Rows whose mean activation has opposite signs in the two halves of the batch: per-device statistics of
    it disagree with the global one on 3 and 8 devices."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(B, D)).astype(np.float32)
    x[: B // 2] += 1.5
    x[B // 2 :] -= 1.0
    return x


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_invariant_non_scalar_output_is_returned_whole(m):
    def model(p, x):
        h = jnp.tanh(x @ p["w1"])
        return {"y": h @ p["w2"], "stat": vj.batch_mean(h, axis=0), "norm": jnp.sum(p["w1"] ** 2, axis=0)}

    params, x = small_params(), signed_batch()
    want = model(params, x)
    plan = vj.plan(params, make_mesh(m))
    sp, xb = vj.shard(params, plan), vj.place_batch(x, plan)
    got = jax.jit(lambda sp, x: vj.apply(model, sp, x))(sp, xb)
    assert got["stat"].shape == (H,) and got["norm"].shape == (H,) and got["y"].shape == (B, 1)
    assert_trees_close(got, want, rtol=1e-5)
    loss = lambda out: jnp.mean(out["y"] ** 2) + jnp.sum(out["stat"] ** 2) + 0.1 * jnp.sum(out["norm"])
    g0 = jax.grad(lambda p: loss(model(p, x)))(params)
    g = jax.jit(jax.grad(lambda sp, x: loss(vj.apply(model, sp, x))))(sp, xb)
    assert_trees_close(vj.unshard(g), g0, rtol=1e-5)


def test_invariant_output_on_an_auto_mesh():
    def model(p, x):
        return jnp.tanh(x @ p["w1"]) @ p["w2"], vj.batch_mean(x @ p["w1"], axis=None)

    params, x = small_params(), signed_batch()
    plan = vj.plan(params, make_mesh(3, auto=True))
    y, s = vj.apply(model, vj.shard(params, plan), vj.place_batch(x, plan))
    assert_trees_close((y, s), model(params, x), rtol=1e-5)


def test_per_device_scalar_output_is_refused():
    def model(p, x):
        h = jnp.tanh(x @ p["w1"])
        return {"y": h @ p["w2"], "aux": jnp.mean(h)}

    params = small_params()
    plan = vj.plan(params, make_mesh(3))
    with pytest.raises(ValueError, match=r"output \['aux'\] of the model is a scalar computed from each device's") as e:
        vj.apply(model, vj.shard(params, plan), vj.place_batch(signed_batch(), plan))
    assert (
        "vj.batch_mean" in str(e.value) and "per-example" in str(e.value) and "differs between devices" in str(e.value)
    )
    assert "one for the whole batch" in str(e.value) and "not batch-shaped" in str(e.value)  # the way out


@pytest.mark.parametrize("m", (3, 8), ids=lambda m: f"m{m}")
def test_per_device_array_statistic_is_refused(m):
    """A non-scalar statistic of the device's slice (``jnp.mean(h, axis=0)``) is neither per-example nor the
    unsharded value: refused, naming the output and both shapes."""

    def model(p, x):
        h = jnp.tanh(x @ p["w1"])
        return {"y": h @ p["w2"], "centre": jnp.mean(h, axis=0)}

    params = small_params()
    plan = vj.plan(params, make_mesh(m))
    with pytest.raises(
        ValueError, match=r"output \['centre'\] of the model \(shape \(16,\) on each device, \(16,\)"
    ) as e:
        vj.apply(model, vj.shard(params, plan), vj.place_batch(signed_batch(), plan))
    assert "vj.batch_mean" in str(e.value) and "not per-example" in str(e.value)


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_outputs_per_example_by_their_unsharded_shape(m):
    """Token rows (``b * T`` per device) are per-example; a parameter broadcast over the batch is per-example
    too (its rows are the same on every device); a batch mean whose length happens to equal the device's batch
    rows is whole. Each as the unsharded model returns it."""
    n_local = B // m

    def model(p, x):
        tok = jnp.tanh(jnp.repeat(x, T, axis=0) @ p["w1"])  # (b * T, H): token rows
        return {
            "tokens": tok,
            "bias": jnp.broadcast_to(p["w2"][:, 0], (x.shape[0], H)),  # batch-free, dim 0 = b
            "stat": vj.batch_mean(jnp.tanh(x @ p["w1"])[:, :n_local], axis=0),  # batch-free, length b
        }

    params, x = small_params(), signed_batch()
    want = model(params, x)
    plan = vj.plan(params, make_mesh(m))
    sp, xb = vj.shard(params, plan), vj.place_batch(x, plan)
    got = jax.jit(lambda sp, x: vj.apply(model, sp, x))(sp, xb)
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert_trees_close(got, want, rtol=1e-5)


def test_user_out_specs_still_win():
    def model(p, x):
        return jax.lax.pmean(jnp.mean(x @ p["w1"]), "fsdp")[None]

    params, x = small_params(), signed_batch()
    plan = vj.plan(params, make_mesh(3))
    got = vj.apply(model, vj.shard(params, plan), vj.place_batch(x, plan), out_specs=jax.sharding.PartitionSpec())
    np.testing.assert_allclose(got, jnp.mean(x @ params["w1"])[None], rtol=1e-5)


# --- Control flow on a batch statistic -------------------------------------------------------------------------


def cond_model(stat):
    def model(p, x):
        h = jnp.tanh(x @ p["w1"])
        h = jax.lax.cond(stat(h) > 0, lambda h: 2.0 * h, lambda h: -h, h)
        return h @ p["w2"]

    return model


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_cond_on_a_per_device_mean_is_refused(m):
    params = small_params()
    plan = vj.plan(params, make_mesh(m))
    with pytest.raises(ValueError, match=r"lax\.cond / lax\.switch at .*test_batch_statistics\.py:\d+") as e:
        vj.apply(cond_model(jnp.mean), vj.shard(params, plan), vj.place_batch(signed_batch(), plan))
    assert "differs between devices" in str(e.value) and "vj.batch_mean" in str(e.value)
    assert "jnp.where" in str(e.value)
    assert "one for the whole batch" in str(e.value) and "not batch-shaped" in str(e.value)  # the way out


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_cond_on_batch_mean_matches_unsharded(m):
    params, x = small_params(), signed_batch()
    model = cond_model(lambda h: vj.batch_mean(h, axis=None))
    # The data is such that per-device means disagree in sign (the refused model would branch differently).
    h = np.tanh(x @ np.asarray(params["w1"]))
    if m > 1:
        local = h.reshape(m, -1, H).mean(axis=(1, 2))
        assert ((local > 0).any() and (local <= 0).any()) or (local > 0).all() != (h.mean() > 0)
    tx = optax.adamw(1e-2)
    data = [{"x": x, "y": np.ones((B, 1), np.float32)}] * 3
    loss = lambda out, y: jnp.mean((out - y) ** 2)
    want = reference(params, model, loss, tx, data)
    got = sharded(params, model, loss, tx, data, m)
    for i, ((g, value, p), (g0, value0, p0)) in enumerate(zip(got, want, strict=True)):
        assert_trees_close(g, g0, rtol=1e-5, what=f"step {i} gradients")
        np.testing.assert_allclose(value, value0, rtol=1e-5)
        assert_trees_close(p, p0, rtol=1e-5, what=f"step {i} params")


def test_nested_switch_and_while_are_refused():
    params = small_params()
    plan = vj.plan(params, make_mesh(3))
    sp, xb = vj.shard(params, plan), vj.place_batch(signed_batch(), plan)

    def switch_in_scan(p, x):
        h = jnp.tanh(x @ p["w1"])

        def body(h, _):
            i = jnp.clip(jnp.max(h).astype(jnp.int32), 0, 1)
            return jax.checkpoint(lambda h: jax.lax.switch(i, [lambda: h, lambda: h * 0.5]))(h), None

        return jax.lax.scan(body, h, None, length=2)[0] @ p["w2"]

    with pytest.raises(ValueError, match=r"lax\.cond / lax\.switch at .*\(inside scan > jax\.checkpoint\)"):
        vj.apply(switch_in_scan, sp, xb)

    def while_loop(p, x):
        h = jnp.tanh(x @ p["w1"])
        h = jax.lax.while_loop(lambda h: jnp.mean(h) < 1.0, lambda h: h + 0.5, h)
        return h @ p["w2"]

    with pytest.raises(ValueError, match=r"lax\.while_loop at .*test_batch_statistics\.py:\d+.* loops while"):
        vj.apply(while_loop, sp, xb)


def test_control_flow_that_does_not_vary_is_kept():
    # A predicate from the parameters, a per-example jnp.where and a fori_loop with a fixed trip count all mean
    # the same on every device: nothing is refused, and the outputs are the unsharded ones.
    def model(p, x):
        h = jnp.tanh(x @ p["w1"])
        h = jax.lax.cond(jnp.sum(p["w2"]) > 0, lambda h: h * 2.0, lambda h: h - 1.0, h)
        h = jnp.where(jnp.mean(h, axis=1, keepdims=True) > 0, h, -h)
        h = jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h + 0.1 * i), h)
        return h @ p["w2"]

    params, x = small_params(), signed_batch()
    plan = vj.plan(params, make_mesh(8))
    got = jax.jit(lambda sp, x: vj.apply(model, sp, x))(vj.shard(params, plan), vj.place_batch(x, plan))
    np.testing.assert_allclose(got, model(params, x), rtol=1e-5, atol=1e-6)
