"""Dropout from a key that does not come through the batch draws, on each device, what the unsharded run draws for
that device's examples (was: the same mask on every device, at the local shape).

Every test compares against the same model run on one device over the global batch with the same key: the masks
bit for bit for partitionable threefry keys (typed and raw), the loss and the step-1 gradients within 1e-5; a key
of another implementation gives independent masks per device.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx
from helpers import assert_trees_close

import vescale_jax as vj

D = 8
KEYS = {"typed": lambda: jax.random.key(7), "raw": lambda: jax.random.PRNGKey(7)}
COUNTS = (1, 3, 8)


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # Flax's dropout and optax mix weak scalars
        yield


def params_of():
    k = jax.random.split(jax.random.key(0), 3)
    return {"w1": jax.random.normal(k[0], (D, D)) / 3, "w2": jax.random.normal(k[1], (D, D)) / 3}


def batch_of(m):
    k = jax.random.split(jax.random.key(1), 2)
    return jax.random.normal(k[0], (4 * m, D)), jax.random.normal(k[1], (4 * m, D))


def mlp(p, x, key):
    h = jnp.tanh(x @ p["w1"])
    keep = jax.random.bernoulli(key, 0.5, h.shape)
    return jnp.where(keep, h / 0.5, 0.0) @ p["w2"]


def applied(model, params, *batch, **kw):
    """``vj.apply(model, sharded params, *batch)`` jitted on the plan's mesh."""
    plan = params.plan
    placed = [vj.place_batch(x, plan) for x in batch]
    with jax.set_mesh(plan.mesh):
        return jax.jit(lambda p, *b: vj.apply(model, p, *b, **kw))(params, *placed)


def blocks(mask, m):
    return np.split(np.asarray(mask), m)


def assert_masks(got, want, m, *, exact=True):
    """The masks (a model output that is the mask) equal the unsharded ones bit for bit, and differ across
    devices."""
    got, want = np.asarray(got), np.asarray(want)
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=f"{m} devices: the mask is not the unsharded one")
    if m > 1:
        b = blocks(got, m)
        assert not any(np.array_equal(b[0], o) for o in b[1:]), f"{m} devices: two devices drew the same mask"


# --- the draw itself ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KEYS)
@pytest.mark.parametrize("m", COUNTS)
def test_closed_over_key_draws_the_unsharded_mask(m, kind):
    key = KEYS[kind]()
    params = params_of()
    x, _ = batch_of(m)
    sp = vj.shard(params, vj.plan(params, make_mesh(m)))
    model = lambda p, x: jax.random.bernoulli(key, 0.5, (x.shape[0], 3, D)).astype(jnp.float32) + 0 * x[:, None]
    assert_masks(applied(model, sp, x), model(params, x), m)


@pytest.mark.parametrize("kind", KEYS)
@pytest.mark.parametrize("m", COUNTS)
def test_key_as_a_keyword_argument_draws_the_unsharded_mask(m, kind):
    """A key passed as a keyword argument reaches every device whole: its draws are split like a closed-over
    key's, and a branch on the dropped activations (different on every device) is refused."""
    key = KEYS[kind]()
    params = params_of()
    x, _ = batch_of(m)
    sp = vj.shard(params, vj.plan(params, make_mesh(m)))

    def model(p, x, *, key, rate=0.5):
        h = jnp.tanh(x @ p["w1"])
        return jnp.where(jax.random.bernoulli(key, 1 - rate, h.shape), h / (1 - rate), 0.0)

    assert_masks(applied(model, sp, x, key=key) != 0, model(params, x, key=key) != 0, m)
    if m > 1:
        branchy = lambda p, x, *, key: jax.lax.cond(jnp.sum(model(p, x, key=key)) > 0, lambda: x, lambda: -x)
        with pytest.raises(ValueError, match=r"lax\.cond"):
            applied(branchy, sp, x, key=key)


@pytest.mark.parametrize("m", COUNTS)
def test_every_sampler_and_split_match_unsharded(m):
    key = jax.random.key(3)
    params = params_of()
    x, _ = batch_of(m)
    sp = vj.shard(params, vj.plan(params, make_mesh(m)))

    def model(p, x):
        n = x.shape[0]
        per_example = jax.random.split(key, n)  # keys split from the replicated key: the unsharded ones
        return {
            "normal": jax.random.normal(jax.random.fold_in(key, 1), (n, D)),
            "uniform": jax.random.uniform(key, (D, n)).T,  # the batch dim second
            "randint": jax.random.randint(key, (n, 2), 0, 1000),
            "per_example": jax.vmap(lambda k: jax.random.normal(k, (D,)))(per_example),
            "bits8": jax.random.bits(key, (n, 3), jnp.uint8),
            "shared": jnp.broadcast_to(jax.random.normal(key, (D,)), (n, D)),  # no batch dim: shared by all
        }

    got, want = applied(model, sp, x), model(params, x)
    for name in want:
        assert_masks(got[name], want[name], m) if name != "shared" else np.testing.assert_array_equal(
            got[name], want[name]
        )


@pytest.mark.parametrize("m", COUNTS)
def test_per_example_keys_in_the_batch_are_left_as_they_are(m):
    params = params_of()
    x, _ = batch_of(m)
    keys = jax.random.split(jax.random.key(5), x.shape[0])
    sp = vj.shard(params, vj.plan(params, make_mesh(m)))
    model = lambda p, x, k: jax.vmap(lambda kk, xx: jax.random.bernoulli(kk, 0.5, xx.shape))(k, x)
    np.testing.assert_array_equal(applied(model, sp, x, keys), model(params, x, keys))


@pytest.mark.parametrize("m", (3, 8))
def test_other_key_implementations_draw_independently_per_device(m):
    key = jax.random.key(7, impl="rbg")
    params = params_of()
    x = jnp.ones((64 * m, D))
    sp = vj.shard(params, vj.plan(params, make_mesh(m)))
    model = lambda p, x: jax.random.bernoulli(key, 0.5, x.shape).astype(jnp.float32)
    got = np.asarray(applied(model, sp, x))
    assert_masks(got, None, m, exact=False)
    assert abs(got.mean() - 0.5) < 0.02, got.mean()  # Bernoulli(0.5) over 512 m draws: 4+ sigma


# --- dropout inside nested jaxprs -------------------------------------------------------------------------------


@pytest.mark.parametrize("m", COUNTS)
def test_dropout_in_scan_remat_jit_and_cond(m):
    key = jax.random.key(11)
    params = {"layers": jax.random.normal(jax.random.key(2), (3, D, D)) / 3}
    x, _ = batch_of(m)
    sp = vj.shard(params, vj.plan(params, make_mesh(m)))

    def model(p, x):
        def layer(h, wi):
            w, i = wi
            k = jax.random.fold_in(key, i)
            h = jax.checkpoint(lambda h: jnp.tanh(h @ w))(h)
            h = jax.jit(lambda h: jnp.where(jax.random.bernoulli(k, 0.7, h.shape), h, 0.0))(h)
            h = jax.lax.cond(i > 0, lambda h: h * jax.random.uniform(k, h.shape), lambda h: h, h)
            return h, None

        return jax.lax.scan(layer, x, (p["layers"], jnp.arange(3)))[0]

    got, want = applied(model, sp, x), model(params, x)
    assert_masks(np.asarray(got) == 0, np.asarray(want) == 0, m)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def stacked_model(p, x, key):
    def body(lp, h, i):
        h = jnp.tanh(h @ lp["w"])
        return jnp.where(jax.random.bernoulli(jax.random.fold_in(key, i), 0.6, h.shape), h, 0.0)

    return vj.scan_layers(body, p["blocks"], x, jnp.arange(3))


@pytest.mark.parametrize("m", COUNTS)
def test_dropout_in_every_layer_of_scan_layers_trains_like_unsharded(m):
    key = jax.random.key(13)
    params = {"blocks": {"w": jax.random.normal(jax.random.key(4), (3, D, D)) / 3}}
    x, y = batch_of(m)
    plan = vj.plan(params, make_mesh(m), stacked=("blocks",))
    sp = vj.shard(params, plan)
    loss = lambda out, y: jnp.mean((out - y) ** 2)

    @vj.fsdp(donate=False)
    def grads(p, o, batch, k):
        return jax.value_and_grad(lambda p: loss(vj.apply(lambda t, x: stacked_model(t, x, k), p, batch[0]), batch[1]))(
            p
        )

    (got_loss, got_g) = grads(sp, None, (x, y), key)
    want_loss, want_g = jax.value_and_grad(lambda p: loss(stacked_model(p, x, key), y))(params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_trees_close(vj.unshard(got_g), want_g, what=f"{m} devices, step-1 gradients")


# --- the three forms: NNX Rngs, a step argument, Linen rngs= -----------------------------------------------------


class NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(D, D, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jnp.tanh(self.l1(x))))


@pytest.mark.parametrize("m", COUNTS)
def test_nnx_dropout_with_rngs_trains_like_unsharded(m):
    model = NNXModel(nnx.Rngs(params=0, dropout=21))
    graphdef, params, rng_state = nnx.split(model, nnx.Param, ...)  # the Rngs outside the planned state
    x, y = batch_of(m)
    plan = vj.plan(params, make_mesh(m))
    tx = optax.adamw(1e-2)

    def forward(p, x):  # the Rngs state closed over (fresh Variables per call: the call advances their count)
        return nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, rng_state))(x)

    def mask(p, x):
        return nnx.merge(graphdef, p, jax.tree.map(jnp.asarray, rng_state)).drop(jnp.ones_like(x))

    def loss(p, x, y, run):
        return jnp.mean((run(p, x) - y) ** 2)

    @vj.fsdp
    def step(p, o, batch):
        value, g = jax.value_and_grad(lambda p: loss(p, *batch, lambda t, x: vj.apply(forward, t, x)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value, vj.apply(mask, p, batch[0])

    sp = vj.shard(params, plan)
    sp, _, got_loss, got_mask = step(sp, vj.init_opt_state(tx, sp), (x, y))
    want_loss, g = jax.value_and_grad(lambda p: loss(p, x, y, forward))(params)
    want = optax.apply_updates(params, tx.update(g, tx.init(params), params)[0])
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_trees_close(vj.unshard(sp), want, what=f"{m} devices, params after step 1")
    assert_masks(got_mask, mask(params, x), m)


@pytest.mark.parametrize("kind", KEYS)
@pytest.mark.parametrize("m", COUNTS)
def test_key_as_a_step_argument_trains_like_unsharded(m, kind):
    params = params_of()
    x, y = batch_of(m)
    plan = vj.plan(params, make_mesh(m))
    tx = optax.sgd(0.1)
    loss = lambda out, y: jnp.mean((out - y) ** 2)

    @vj.fsdp
    def step(p, o, batch, key):
        value, g = jax.value_and_grad(lambda p: loss(vj.apply(lambda t, x: mlp(t, x, key), p, batch[0]), batch[1]))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, value

    sp = vj.shard(params, plan)
    for i in range(2):  # a new key per step
        key = jax.random.fold_in(KEYS[kind](), i)
        sp, _, got = step(sp, vj.init_opt_state(tx, sp), (x, y), key)
        want, g = jax.value_and_grad(lambda p, k=key: loss(mlp(p, x, k), y))(params)
        params = optax.apply_updates(params, tx.update(g, tx.init(params), params)[0])
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert_trees_close(vj.unshard(sp), params, what=f"{m} devices, params after step {i + 1}")


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(D)(x))
        h = nn.Dropout(0.5, deterministic=False)(h)
        return nn.Dense(D)(h)


@pytest.mark.parametrize("kind", KEYS)
@pytest.mark.parametrize("m", COUNTS)
def test_linen_dropout_rngs_trains_like_unsharded(m, kind):
    module = LinenModel()
    x, y = batch_of(m)
    variables = module.init(jax.random.key(0), x[:1])
    plan = vj.plan(variables, make_mesh(m))
    loss = lambda out, y: jnp.mean((out - y) ** 2)
    key = KEYS[kind]()

    @vj.fsdp(donate=False)
    def grads(p, o, batch, key):
        run = lambda p: vj.flax.linen_apply(module, p, batch[0], rngs={"dropout": key})
        return jax.value_and_grad(lambda p: loss(run(p), batch[1]))(p)

    got_loss, got_g = grads(vj.shard(variables, plan), None, (x, y), key)
    want_loss, want_g = jax.value_and_grad(lambda v: loss(module.apply(v, x, rngs={"dropout": key}), y))(variables)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    assert_trees_close(vj.unshard(got_g), want_g, what=f"{m} devices, step-1 gradients")
    drop = lambda v, x: nn.Dropout(0.5, deterministic=False).apply({}, jnp.ones_like(x), rngs={"dropout": key})
    assert_masks(applied(drop, vj.shard(variables, plan), x), drop(variables, x), m)
