"""A bf16 leaf's gradient is summed in fp32 wherever the model casts it: also inside the model's own
``jax.lax.scan`` / ``nnx.scan`` over a stacked leaf planned without ``stacked=``, ``jax.checkpoint``, a nested
``jax.jit`` and ``cond``, and after a slice (``b[i].astype(f32)``).

Before, only a cast of the whole leaf at the model's top level was widened: a cast inside those rounded each
device's partial gradient to bf16 before the reduce-scatter, and after 5 AdamW steps on 3 devices the fp32 leaves
were 2.3e-4 off the unsharded run (now about 1e-7).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx

import vescale_jax as vj
from vescale_jax.step._fp32_grads import widened

STEPS = 5
D = 32


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes float and int32
        yield


def ulps(got, ref):
    """Per element, |got - ref| in bf16 ulps of ref."""
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    spacing = np.spacing(np.abs(ref).astype(np.float32)) * 2.0**16  # bf16 spacing: 16 fewer mantissa bits
    return np.abs(got - ref) / np.maximum(spacing, np.finfo(np.float32).tiny)


# --- Functional models: the stacked bf16 leaf layers/b reaches its cast inside a nested construct ---------------


def init():
    k = jax.random.split(jax.random.key(0), 4)
    return {
        "w_in": jax.random.normal(k[0], (16, D)) / 4,
        "layers": {
            "w": jax.random.normal(k[1], (3, D, D)) / 6,
            "b": jax.random.normal(k[2], (3, D)).astype(jnp.bfloat16),
        },
        "w_out": jax.random.normal(k[3], (D, 8)) / 4,
    }


def layer(lp, h):
    return jnp.tanh(h @ lp["w"] + lp["b"].astype(jnp.float32))


def layer_at(layers, i):
    return jax.tree.map(lambda a: a[i], layers)


def lax_scan(layers, h):
    return jax.lax.scan(lambda h, lp: (layer(lp, h), None), h, layers)[0]


def checkpoint(layers, h):
    remat = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_saveable)
    for i in range(3):
        h = remat(layer_at(layers, i), h)
    return h


def nested_jit(layers, h):
    loop = lambda layers, h: jax.lax.fori_loop(0, 3, lambda i, h: layer(layer_at(layers, i), h), h)
    return jax.jit(loop)(layers, h)


def cond(layers, h):
    for i in range(3):
        h = jax.lax.cond(i % 2 == 0, layer, lambda lp, h: -layer(lp, h), layer_at(layers, i), h)
    return h


def sliced(layers, h):  # no nested construct: a slice of the leaf, then the cast
    for i in range(3):
        h = layer(layer_at(layers, i), h)
    return h


BODIES = {f.__name__: f for f in (lax_scan, checkpoint, nested_jit, cond, sliced)}


def functional_model(body):
    return lambda p, x: body(p["layers"], x @ p["w_in"]) @ p["w_out"]


# --- NNX: the model's own nnx.scan over a stacked group, planned without stacked= --------------------------------


class Block(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (D, D)) / 6)
        self.b = nnx.Param(jax.random.normal(rngs.params(), (D,)).astype(jnp.bfloat16))

    def __call__(self, h):
        return jnp.tanh(h @ self.w[...] + self.b[...].astype(jnp.float32))


class ScanModel(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(16, D, rngs=rngs)

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return Block(rngs)

        self.blocks = stack(rngs)
        self.out = nnx.Linear(D, 8, rngs=rngs)

    def __call__(self, x):
        scan = nnx.scan(lambda block, h: (block(h), None), in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
        return self.out(scan(self.blocks, self.inp(x))[0])


def data(i):
    k = jax.random.split(jax.random.key(100 + i), 2)
    return jax.random.normal(k[0], (48, 16)), jax.random.normal(k[1], (48, 8))


def train(params, model, plan_model, m):
    """``STEPS`` AdamW steps under vj.fsdp on ``m`` devices and unsharded; returns (sharded run, unsharded run)."""
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    loss = lambda out, y: jnp.mean((out - y) ** 2)
    plan = vj.plan(params, make_mesh(m))
    assert "bfloat16" in {b.dtype for b in plan.buckets}

    @vj.fsdp(plan=plan)
    def step(p, o, batch):
        g = jax.grad(lambda p: loss(plan_model(p, batch["x"]), batch["y"]))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    @jax.jit
    def ref_step(p, o, x, y):
        u, o = tx.update(jax.grad(lambda p: loss(model(p, x), y))(p), o, p)
        return optax.apply_updates(p, u), o

    sp, rp = vj.shard(params, plan), params
    so, ro = vj.init_opt_state(tx, sp), tx.init(params)
    for i in range(STEPS):
        x, y = data(i)
        sp, so = step(sp, so, {"x": x, "y": y})
        rp, ro = ref_step(rp, ro, x, y)
    return vj.unshard(sp), rp


def assert_matches_unsharded(got, ref):
    """fp32 leaves within 1e-5 (relative to the leaf's largest value), bf16 leaves within 1 ulp."""
    flat = jax.tree_util.tree_flatten_with_path(ref)[0]
    for (path, r), g in zip(flat, jax.tree.leaves(got), strict=True):
        name = jax.tree_util.keystr(path)
        assert g.dtype == r.dtype, (name, g.dtype, r.dtype)
        if r.dtype == jnp.bfloat16:
            assert np.max(ulps(g, r)) <= 1, f"{name}: {np.max(ulps(g, r))} bf16 ulps off the unsharded run"
        else:
            g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
            err = np.max(np.abs(g - r)) / np.max(np.abs(r))
            assert err <= 1e-5, f"{name}: max|diff|/max|ref| = {err:.2e} off the unsharded run"


def _cases(kinds, fast):
    return [
        pytest.param(kind, m, marks=() if (kind, m) in fast else pytest.mark.slow) for kind in kinds for m in (1, 3, 8)
    ]


@pytest.mark.parametrize(("kind", "m"), _cases(sorted(BODIES), {("lax_scan", 3)}))
def test_bf16_leaf_inside_nested_construct_trains_like_unsharded(kind, m):
    model = functional_model(BODIES[kind])
    got, ref = train(init(), model, lambda p, x: vj.apply(model, p, x), m)
    assert_matches_unsharded(got, ref)


@pytest.mark.parametrize(("m"), [pytest.param(1, marks=pytest.mark.slow), 3, 8])
def test_bf16_leaf_inside_the_models_own_nnx_scan_trains_like_unsharded(m):
    graphdef, state = nnx.split(ScanModel(nnx.Rngs(0)))
    assert state["blocks"]["b"].get_value().dtype == jnp.bfloat16
    model = lambda s, x: nnx.merge(graphdef, s)(x)
    got, ref = train(state, model, lambda p, x: vj.flax.nnx_apply(graphdef, p, x), m)
    assert_matches_unsharded(got, ref)


# --- widened itself, on one device ------------------------------------------------------------------------------


def copy_grads(model, params, x):
    """(gradient through ``widened`` w.r.t. the fp32 copies, the model's gradient with fp32 leaves)."""
    leaves, treedef = jax.tree.flatten(params)
    narrow = [x.dtype if x.dtype == jnp.bfloat16 else None for x in leaves]
    copies = jax.tree.unflatten(treedef, [x.astype(jnp.float32) for x in leaves])
    loss = lambda f: lambda p: jnp.sum(jnp.sin(f(p, x)))
    return jax.grad(loss(widened(model, narrow)))(copies), jax.grad(loss(model))(copies)


@pytest.mark.parametrize("kind", sorted(BODIES))
def test_gradient_reaches_the_fp32_copy_unrounded(kind):
    """The copy's gradient is the fp32 gradient (as if the cast were the identity), not one rounded to bf16."""
    params, x = init(), data(0)[0]
    got, want = copy_grads(functional_model(BODIES[kind]), params, x)
    b, wb = np.asarray(got["layers"]["b"]), np.asarray(want["layers"]["b"])
    assert np.any(wb != wb.astype(jnp.bfloat16).astype(np.float32))  # rounding would show
    np.testing.assert_allclose(b, wb, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got["w_in"]), np.asarray(want["w_in"]), rtol=1e-6, atol=1e-7)


class RematScanModel(ScanModel):
    def __call__(self, x):
        body = nnx.remat(lambda block, h: (block(h), None))
        scan = nnx.scan(body, in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
        return self.out(scan(self.blocks, self.inp(x))[0])


def test_gradient_reaches_the_fp32_copy_through_nnx_remat_inside_nnx_scan():
    graphdef, state = nnx.split(RematScanModel(nnx.Rngs(0)))
    got, want = copy_grads(lambda s, x: nnx.merge(graphdef, s)(x), state, data(0)[0])
    b, wb = np.asarray(got["blocks"]["b"].get_value()), np.asarray(want["blocks"]["b"].get_value())
    assert np.any(wb != wb.astype(jnp.bfloat16).astype(np.float32))  # rounding would show
    np.testing.assert_allclose(b, wb, rtol=1e-6, atol=1e-7)


@jax.custom_vjp
def doubled_grad(b):
    return b.astype(jnp.float32)


doubled_grad.defvjp(lambda b: (b.astype(jnp.float32), None), lambda _, g: ((2 * g).astype(jnp.bfloat16),))


def test_custom_vjp_keeps_its_rule_and_receives_the_leaf_in_its_dtype():
    """Widening never drops a custom rule: the leaf enters in bf16 and its gradient is the rule's."""
    b = jax.random.normal(jax.random.key(3), (8,)).astype(jnp.bfloat16)
    model = lambda p, x: x * doubled_grad(p["b"])
    x = jnp.linspace(0.1, 1.0, 8)
    got = jax.grad(lambda c: jnp.sum(widened(model, [jnp.bfloat16])(c, x)))({"b": b.astype(jnp.float32)})
    want = jax.grad(lambda p: jnp.sum(model(p, x)))({"b": b})
    np.testing.assert_array_equal(np.asarray(got["b"]), np.asarray(want["b"], np.float32))


def test_while_loop_sees_the_leaf_in_its_dtype():
    b = jax.random.normal(jax.random.key(4), (8,)).astype(jnp.bfloat16)
    model = lambda p, x: jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * p["b"]), (0, x))[1]
    x = jnp.ones(8, jnp.bfloat16)
    got = widened(model, [jnp.bfloat16])({"b": b.astype(jnp.float32)}, x)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(model({"b": b}, x), np.float32))
