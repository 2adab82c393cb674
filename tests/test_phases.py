"""A stacked layer's backward in two halves: same gradients as unsharded, fewer bytes held gathered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICE_COUNTS, make_mesh
from helpers import assert_trees_close

import vescale_jax as vj
from vescale_jax import testing
from vescale_jax.step import _scan_layers as _layers

L, D, F, B = 3, 128, 512, 24


def params(seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 2 else 1), jnp.float32)
    return {
        "layers": {"a": f(L, D, F), "b": f(L, F, D), "s": 1.0 + 0.1 * f(L, D), "c": f(L, D, D)},
        "head": f(D, 4),
    }


def model(p, x):
    def body(q, h):
        h = h * q["s"]
        h = h + jnp.tanh(h @ q["a"]) @ q["b"]  # the first half reads a and b
        return h + jnp.sin(h @ q["c"])  # the second half reads c

    return vj.scan_layers(body, p["layers"], x) @ p["head"]


def loss(out):
    return jnp.mean(out**2)


def data():
    return np.random.default_rng(1).standard_normal((B, D)).astype(np.float32)


def grads_step(plan):
    @vj.fsdp(plan=plan, donate=False)
    def step(sp, _, x):
        return jax.value_and_grad(lambda q: loss(vj.apply(model, q, x)))(sp)

    return step


@pytest.mark.parametrize("m", DEVICE_COUNTS, ids=lambda m: f"m{m}")
def test_a_layer_cut_in_two_gives_the_unsharded_gradients(m):
    tree, x = params(), data()
    plan = vj.plan(tree, make_mesh(m), stacked=("layers",), split="leaves")
    assert _layers._whole_buckets(plan, [b for b, bucket in enumerate(plan.buckets) if bucket.layers])
    want_loss, want = jax.value_and_grad(
        lambda p: loss(jax.lax.scan(lambda h, q: (_body(q, h), None), x, p["layers"])[0] @ p["head"])
    )(tree)
    got_loss, grads = grads_step(plan)(vj.shard(tree, plan), None, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close(vj.unshard(grads), want, rtol=2e-5)


def _body(q, h):
    h = h * q["s"]
    h = h + jnp.tanh(h @ q["a"]) @ q["b"]
    return h + jnp.sin(h @ q["c"])


def test_the_cut_is_taken_and_lowers_the_peak(monkeypatch):
    tree, x = params(), data()
    plan = vj.plan(tree, make_mesh(min(8, len(jax.devices()))), stacked=("layers",), split="leaves")
    calls = []
    real = _layers._split

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out)
        return out

    monkeypatch.setattr(_layers, "_split", spy)
    cut = testing.memory(grads_step(plan).lower(vj.shard(tree, plan), None, x).compile())
    assert calls and calls[0] is not None
    phases = calls[0][0]
    assert phases.first_buckets != phases.second_buckets
    monkeypatch.setattr(_layers, "_split", lambda *a, **k: None)
    whole = testing.memory(grads_step(plan).lower(vj.shard(tree, plan), None, x).compile())
    assert cut.temp < whole.temp, (cut, whole)


@pytest.mark.parametrize(
    "options",
    [{"prefetch": True}, {"reshard_after_forward": False}, {"prefetch": True, "reshard_after_forward": False}],
    ids=["prefetch", "keep", "keep-prefetch"],
)
def test_whole_gathered_small_buckets_with_every_option(options):
    tree, x = params(), data()
    plan = vj.plan(tree, make_mesh(3), stacked=("layers",), split="leaves")
    want_loss, want = jax.value_and_grad(
        lambda p: loss(jax.lax.scan(lambda h, q: (_body(q, h), None), x, p["layers"])[0] @ p["head"])
    )(tree)

    @vj.fsdp(plan=plan, donate=False, **options)
    def step(sp, _, x):
        return jax.value_and_grad(lambda q: loss(vj.apply(model, q, x)))(sp)

    got_loss, grads = step(vj.shard(tree, plan), None, x)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert_trees_close(vj.unshard(grads), want, rtol=2e-5)
