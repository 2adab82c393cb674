"""Flax's own layer loops over a stacked plan: ``nnx.scan`` (with ``nnx.remat``, ``nnx.split_rngs``) and Linen's
``nn.scan`` (with ``nn.remat``, ``variable_axes``, ``split_rngs``) over a group planned with ``stacked=`` run as
``vj.scan_layers`` (one layer gathered per iteration), against the same model run unsharded; the forms that stay
refused name the way out; the memory of an ``nnx.scan`` loop against ``vj.flax.nnx_scan_layers``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from helpers import assert_trees_close

import vescale_jax as vj
from vescale_jax import testing

D, LAYERS, BATCH = 8, 2, 24


def _data(d_in: int, d_out: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((BATCH, d_in)).astype(np.float32), rng.standard_normal((BATCH, d_out)).astype(np.float32)


def _key_data(tree):
    is_key = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


# --- NNX: nnx.scan over layers made with nnx.vmap, nnx.remat and dropout keys from nnx.split_rngs ----------------


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d: int = D, rate: float = 0.25):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.drop = nnx.Dropout(rate)

    def __call__(self, h: jax.Array, rngs: nnx.Rngs) -> jax.Array:
        return h + self.drop(jnp.tanh(self.lin(self.norm(h))), rngs=rngs)


class Net(nnx.Module):
    """``inp -> nnx.scan over the stacked blocks -> out``; ``loop`` picks how the blocks are looped."""

    def __init__(self, rngs: nnx.Rngs, *, d: int = D, layers: int = LAYERS, rate: float = 0.25, loop: str = "scan"):
        self.inp = nnx.Linear(5, d, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs, d, rate)

        self.blocks = make(rngs)
        self.out = nnx.Linear(d, 3, rngs=rngs)
        self.shared = nnx.Linear(d, d, rngs=rngs)  # not stacked: broadcast into every layer by "broadcast"
        self.rngs = nnx.Rngs(dropout=1)  # the model's state: dropout keys split per layer in the loop
        self.loop, self.layers = loop, layers

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.inp(x)
        if self.loop == "nnx_scan_layers":
            h = vj.flax.nnx_scan_layers(self.blocks, h, lambda block, h: block(h, self.rngs))
            return self.out(h)
        body = nnx.remat(lambda block, h, rngs: block(h, rngs))

        if self.loop == "scan":

            @nnx.split_rngs(splits=self.layers)
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry)
            def loop(h, block, rngs):
                return body(block, h, rngs)

        elif self.loop == "broadcast":  # a module of the unstacked plan passed whole to every layer

            @nnx.split_rngs(splits=self.layers)
            @nnx.scan(in_axes=(nnx.Carry, 0, 0, None), out_axes=nnx.Carry)
            def loop(h, block, rngs, shared):
                return shared(body(block, h, rngs))

            return self.out(loop(h, self.blocks, self.rngs, self.shared))

        elif self.loop == "reverse":

            @nnx.split_rngs(splits=self.layers)
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=nnx.Carry, reverse=True)
            def loop(h, block, rngs):
                return body(block, h, rngs)

        else:  # "ys": a per-layer activation as the scan's output

            @nnx.split_rngs(splits=self.layers)
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def loop(h, block, rngs):
                h = body(block, h, rngs)
                return h, h

            h = loop(h, self.blocks, self.rngs)[0]
            return self.out(h)
        return self.out(loop(h, self.blocks, self.rngs))


def _mse(out, y):
    return jnp.mean((out - y) ** 2)


def _nnx_grads(model: Net, mesh: jax.sharding.Mesh):
    """(unsharded, sharded): (loss, new state), grads of the model's MSE, the model planned with ``stacked=``."""
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    x, y = _data(5, 3)

    def unsharded(p, st):
        m = nnx.merge(graphdef, p, jax.tree.map(lambda a: a, st))
        return _mse(m(x), y), nnx.split(m, nnx.Param, ...)[2]

    want = jax.jit(jax.value_and_grad(unsharded, has_aux=True))(params, state)
    plan = vj.plan(params, mesh, stacked=("blocks",))

    @vj.fsdp(plan=plan, donate=False)
    def step(p, o, x, st):
        def loss(p):
            out, new = vj.flax.nnx_apply(graphdef, p, x, state=st)
            return _mse(out, y), new

        return p, o, jax.value_and_grad(loss, has_aux=True)(p)

    (loss, new), grads = step(vj.shard(params, plan), None, vj.place_batch(x, plan), state)[2]
    return want, ((loss, new), vj.unshard(grads))


@pytest.mark.parametrize(
    ("m", "loop"), [(1, "scan"), (3, "scan"), (8, "scan"), (3, "broadcast")], ids=["m1", "m3", "m8", "m3-broadcast"]
)
def test_nnx_scan_over_a_stacked_plan_matches_unsharded(m, loop):
    """Also with a module of the unstacked plan broadcast into the loop (in_axes=None): its gathered leaves are
    closed over by the layer, not carried."""
    model = Net(nnx.Rngs(0), loop=loop)
    ((want_loss, want_state), want_grads), ((got_loss, got_state), got_grads) = _nnx_grads(model, make_mesh(m))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_grads, want_grads, rtol=1e-5, what="grads")
    assert_trees_close(_key_data(got_state), _key_data(want_state), rtol=0, what="state (the dropout keys' counts)")


@pytest.mark.parametrize(
    ("loop", "fragment"),
    [
        ("reverse", r"runs in reverse"),
        ("ys", r"per-layer floating-point output computed in the loop \(shape \(8, 8\)\)"),
    ],
)
def test_nnx_scan_forms_that_stay_refused_name_the_way_out(loop, fragment):
    with pytest.raises(ValueError, match=fragment) as e:
        _nnx_grads(Net(nnx.Rngs(0), loop=loop), make_mesh(3))
    assert "blocks/" in str(e.value)
    assert "vj.flax.nnx_scan_layers(model.blocks, x)" in str(e.value)
    assert "stacked=" in str(e.value)


# --- Linen: nn.scan(variable_axes={"params": 0}, split_rngs=...) over an nn.remat block ---------------------------


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        h = h + nn.Dropout(0.25, deterministic=False)(jnp.tanh(nn.Dense(D)(nn.LayerNorm()(h))))
        return h, None


class ScannedNet(nn.Module):
    remat: bool = True
    reverse: bool = False

    @nn.compact
    def __call__(self, x):
        block = nn.remat(ScanBlock) if self.remat else ScanBlock
        scan = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=LAYERS,
            reverse=self.reverse,
        )
        h, _ = scan(name="layers")(nn.Dense(D)(x), None)
        return nn.Dense(3)(h)


def _linen_grads(model: ScannedNet, mesh: jax.sharding.Mesh):
    variables = model.init(jax.random.key(0), jnp.ones((2, 5)))
    x, y = _data(5, 3)
    rngs = {"dropout": jax.random.key(5)}
    want = jax.jit(jax.value_and_grad(lambda v: _mse(model.apply(v, x, rngs=rngs), y)))(variables)
    plan = vj.plan(variables, mesh, stacked=("layers",))
    assert [b.layers for b in plan.buckets if b.unit == "layers"] == [LAYERS]

    @vj.fsdp(plan=plan, donate=False)
    def step(p, o, x):
        return p, o, jax.value_and_grad(lambda p: _mse(vj.flax.linen_apply(model, p, x, rngs=rngs), y))(p)

    loss, grads = step(vj.shard(variables, plan), None, vj.place_batch(x, plan))[2]
    return want, (loss, vj.unshard(grads))


@pytest.mark.parametrize(
    ("m", "remat"), [(1, True), (3, True), (8, True), (3, False)], ids=["m1-remat", "m3-remat", "m8-remat", "m3"]
)
def test_linen_scan_over_a_stacked_plan_matches_unsharded(m, remat):
    (want_loss, want_grads), (got_loss, got_grads) = _linen_grads(ScannedNet(remat=remat), make_mesh(m))
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_grads, want_grads, rtol=1e-5, what="grads")


def test_linen_reverse_scan_over_a_stacked_plan_is_refused():
    with pytest.raises(ValueError, match=r"params/layers/\w+/\w+ \(shape \(2, \d+\)\).*vj\.scan_layers.*stacked="):
        _linen_grads(ScannedNet(reverse=True), make_mesh(3))


# --- Memory: nnx.scan over the stacked blocks against vj.flax.nnx_scan_layers ------------------------------------


def _peak(loop: str, mesh: jax.sharding.Mesh) -> int:
    model = Net(nnx.Rngs(0), d=128, layers=4, rate=0.0, loop=loop)
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    plan = vj.plan(params, mesh, stacked=("blocks",))
    sp = vj.shard(params, plan)
    x = vj.place_batch(np.ones((16, 5), np.float32), plan)

    @vj.fsdp(plan=plan)
    def step(p, o, x, st):
        def loss(p):
            out, new = vj.flax.nnx_apply(graphdef, p, x, state=st)
            return jnp.mean(out**2), new

        (value, _), grads = jax.value_and_grad(loss, has_aux=True)(p)
        return vj.tree_map(lambda a, g: a - 0.1 * g, p, grads), o, value

    return testing.memory(step.lower(sp, None, x, state).compile()).peak


def test_nnx_scan_over_a_stacked_plan_has_the_memory_of_nnx_scan_layers():
    mesh = make_mesh(8)
    scan, scan_layers = _peak("scan", mesh), _peak("nnx_scan_layers", mesh)
    assert scan <= 1.05 * scan_layers, (scan, scan_layers)
