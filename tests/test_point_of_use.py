"""Buckets gathered at their point of use: gradients equal the unsharded ones whatever the model does with a
leaf, and a large table is alive only around its own use."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICE_COUNTS, make_mesh
from helpers import assert_trees_close

import vescale_jax as vj
from vescale_jax import testing
from vescale_jax.step._point_of_use import _segments

V, D, B, T = 61, 24, 24, 5


def params(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
    return {
        "embed": f(V, D),
        "pos": f(T, D),
        "mix": {"w": f(D, D), "b": f(D)},
        "gate": f(D),  # used non-linearly (tanh) and twice
        "scan": f(3, D),  # closed over by a lax.scan body
        "head": f(D, V),
    }


def model(p, tokens):
    x = p["embed"][tokens] + p["pos"][None, : tokens.shape[1]]
    x = jax.jit(lambda x, w, b: jnp.tanh(x @ w + b))(x, p["mix"]["w"], p["mix"]["b"])
    x = x * jnp.tanh(p["gate"]) + 0.1 * p["gate"] ** 2
    x = jax.lax.scan(lambda c, s: (c + jnp.sin(c * s) * p["scan"][0], None), x, p["scan"])[0]
    return x @ p["head"]


def loss(logits, tokens):
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0])


def data(seed=1):
    return np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int32)


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("m", DEVICE_COUNTS, ids=lambda m: f"m{m}")
def test_gradients_match_unsharded_for_every_kind_of_use(m, reshard):
    tree, tokens = params(), data()
    want_loss, want = jax.value_and_grad(lambda p: loss(model(p, tokens), tokens))(tree)
    plan = vj.plan(tree, make_mesh(m), split="leaves")

    @vj.fsdp(plan=plan, donate=False, reshard_after_forward=reshard)
    def step(sp, _, batch):
        return jax.value_and_grad(lambda q: loss(vj.apply(model, q, batch), batch))(sp)

    got_loss, grads = step(vj.shard(tree, plan), None, tokens)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close(vj.unshard(grads), want, rtol=2e-5)


def test_segments_are_affine_only_for_linear_uses():
    def f(w, b, g, x):
        return (x @ w) * jnp.tanh(g) + b

    args = [jnp.ones((4, 4)), jnp.ones(4), jnp.ones(4), jnp.ones((2, 4))]
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    w, b, g, _ = jaxpr.invars
    # g's tanh is read between w's matmul and the bias: one merged segment, not affine (tanh)
    segs, upfront = _segments(jaxpr, {w: 0, b: 0, g: 1})
    assert not upfront
    assert len(segs) == 1 and set(segs[0].buckets) == {0, 1} and not segs[0].affine
    # alone, (x @ w) * t + b is affine in (w, b)
    segs, _ = _segments(jaxpr, {w: 0, b: 0})
    assert len(segs) == 1 and segs[0].affine
    # a bilinear use of two leaves is not affine in them
    jaxpr = jax.make_jaxpr(lambda w, v: w @ v)(jnp.ones((3, 3)), jnp.ones((3, 3))).jaxpr
    segs, _ = _segments(jaxpr, {jaxpr.invars[0]: 0, jaxpr.invars[1]: 0})
    assert not segs[0].affine


def test_a_leaf_the_model_returns_has_no_segment():
    jaxpr = jax.make_jaxpr(lambda w, x: (w, x * w))(jnp.ones(3), jnp.ones(3)).jaxpr
    segs, upfront = _segments(jaxpr, {jaxpr.invars[0]: 0})
    assert upfront == {0} and not segs


def test_a_large_table_is_alive_only_around_its_use():
    # An embedding and an untied head of the same size, everything else small: gathered up front (as before)
    # both tables and full-size gradients are alive together; at their points of use one at a time.
    vocab, d = 3072, 256  # no padding on 1, 2, 3 or 8 devices: a one-leaf bucket is its leaf
    rng = np.random.default_rng(0)
    tree = {
        "embed": jnp.asarray(rng.standard_normal((vocab, d)), jnp.float32),
        "head": jnp.asarray(rng.standard_normal((d, vocab)), jnp.float32),
    }
    table = vocab * d * 4
    plan = vj.plan(tree, make_mesh(8) if len(jax.devices()) >= 8 else make_mesh(len(jax.devices())))

    def net(p, tokens):
        return jnp.tanh(p["embed"][tokens]) @ p["head"]

    @vj.fsdp(plan=plan)
    def step(sp, opt, tokens):
        g = jax.grad(lambda q: loss(vj.apply(net, q, tokens), tokens))(sp)
        return jax.tree.map(lambda a, b: a - 0.1 * b, sp, g), opt

    tokens = rng.integers(0, vocab, (24, 4)).astype(np.int32)
    mem = testing.memory(step.lower(vj.shard(tree, plan), None, tokens).compile())
    # one full table (gathered, or its gradient) at a time, the two tables' gradient shards, half a table for the
    # rest (activations, logits); gathered up front it was 3.2 to 3.9 tables on 1, 2, 3 and 8 devices
    m = plan.num_devices
    assert mem.temp < table * (1.5 + 2 / m), mem


def test_a_tied_bucket_gets_a_segment_per_use_when_the_layers_between_are_at_least_its_size():
    def f(e, w1, w2, x):
        h = x @ e.T  # the lookup (as a matmul)
        h = jnp.tanh(h @ w1) @ w2  # the layers
        return h @ e  # the tied head

    e, w1, w2, x = jnp.ones((6, 4)), jnp.ones((6, 6)), jnp.ones((6, 6)), jnp.ones((2, 4))
    jaxpr = jax.make_jaxpr(f)(e, w1, w2, x).jaxpr
    ve, v1, v2, _ = jaxpr.invars
    segs, _ = _segments(jaxpr, {ve: 0, v1: 1, v2: 2}, {0: "embed", 1: "layers/0", 2: "layers/1"})
    assert [s.buckets for s in segs] == [(0,), (1,), (2,), (0,)]  # the table twice, around the layers
    # an interlude smaller than the table (one 4x4 layer of 16 elements against 24) keeps one segment over both
    jaxpr = jax.make_jaxpr(lambda e, w, x: jnp.tanh((x @ e.T)[:, :4] @ w) @ e[:4])(e, jnp.ones((4, 4)), x).jaxpr
    ve, vw, _ = jaxpr.invars
    segs, _ = _segments(jaxpr, {ve: 0, vw: 1}, {0: "embed", 1: "layer"})
    assert len(segs) == 1 and set(segs[0].buckets) == {0, 1}


def test_a_stacked_group_between_two_uses_splits_a_tied_bucket():
    # A stacked layer group's buffer has no segment of its own, but its reads mark where the layers run.
    def f(e, stack, x):
        h = x @ e.T
        h = jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), h, stack)[0]
        return h @ e

    e, stack, x = jnp.ones((6, 4)), jnp.ones((3, 6, 6)), jnp.ones((2, 4))
    jaxpr = jax.make_jaxpr(f)(e, stack, x).jaxpr
    ve, vs, _ = jaxpr.invars
    segs, _ = _segments(jaxpr, {ve: 0}, {0: "embed"})
    assert len(segs) == 1  # nothing marks the layers: one segment over both uses
    segs, _ = _segments(jaxpr, {ve: 0}, {0: "embed"}, marks={vs: ("blocks", 3 * 6 * 6 * 4)})
    assert [s.buckets for s in segs] == [(0,), (0,)]


@pytest.mark.parametrize("m", [1, 3], ids=lambda m: f"m{m}")
def test_a_tied_table_gathered_twice_gives_the_unsharded_gradients(m):
    rng = np.random.default_rng(0)
    tree = {"embed": jnp.asarray(rng.standard_normal((V, D)) * 0.3, jnp.float32)}
    tree["layers"] = [{"w": jnp.asarray(rng.standard_normal((D, D)) * 0.3, jnp.float32)} for _ in range(3)]

    def net(p, tokens):
        x = p["embed"][tokens]
        for layer in p["layers"]:
            x = jnp.tanh(x @ layer["w"])
        return x @ p["embed"].T

    plan = vj.plan(tree, make_mesh(m))
    assert {b.unit for b in plan.buckets} == {"embed", "layers/0", "layers/1", "layers/2"}
    tokens = data()

    @vj.fsdp(plan=plan)
    def step(sp, opt, tokens):
        return jax.grad(lambda q: loss(vj.apply(net, q, tokens), tokens))(sp), opt

    want = jax.grad(lambda q: loss(net(q, tokens), tokens))(tree)
    assert_trees_close(vj.unshard(step(vj.shard(tree, plan), None, tokens)[0]), want, rtol=1e-5)
