"""The transform matrix: every Flax / JAX transform a model uses, under ``vj.fsdp`` as unsharded.

One small model per construct, the same model code trained unsharded (``jax.jit``) and under ``vj.fsdp``; the loss
of each of 3 AdamW steps and the parameters (and the model's state) after them agree to 1e-5. Meshes of 1 and 3
devices run in the default matrix, 8 in the slow tier. ``docs/devices.md`` shows the matrix as a table, checked
against :data:`MATRIX` by ``test_the_docs_table_is_this_matrix``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx
from helpers import assert_trees_close
from jax.ad_checkpoint import checkpoint_name

import vescale_jax as vj

D_IN, D, D_OUT, BATCH, STEPS = 5, 8, 3, 24, 3
TX = optax.adamw(1e-2, weight_decay=0.1)
SUPPORT = np.linspace(-1.0, 1.0, 4 * D, dtype=np.float32).reshape(4, D)  # a meta-learning inner set, not the batch


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def data() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": (2 * rng.standard_normal((BATCH, D_IN)) + 0.5).astype(np.float32),
            "y": rng.standard_normal((BATCH, D_OUT)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def mse(out: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((out - y) ** 2)


# --- NNX models -------------------------------------------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return jnp.tanh(self.lin(h))


class NNXNet(nnx.Module):
    """``inp -> body(h) -> out``; each construct overrides :meth:`body` (and may add layers)."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(D_IN, D, rngs=rngs)
        self.out = nnx.Linear(D, D_OUT, rngs=rngs)
        self.build(rngs)

    def build(self, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([Block(rngs), Block(rngs)])

    def body(self, h: jax.Array) -> jax.Array:
        raise NotImplementedError

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.body(self.inp(x)))


class NNXRemat(NNXNet):
    def body(self, h):
        for block in self.blocks:
            h = nnx.remat(lambda m, h: m(h))(block, h)
        return h


class NNXRematPolicy(NNXNet):
    def body(self, h):
        call = nnx.remat(lambda m, h: m(h), policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        for block in self.blocks:
            h = call(block, h)
        return h


class NNXScan(NNXNet):
    def build(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.layers = make(rngs)

    def body(self, h):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def loop(h, layer):
            return layer(h)

        return loop(h, self.layers)


class NNXScanStacked(NNXScan):
    """``nnx.scan`` over the layers planned with ``stacked=("layers",)``: runs as ``vj.scan_layers``."""

    def body(self, h):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def loop(h, layer):
            return nnx.remat(lambda m, h: m(h))(layer, h)

        return loop(h, self.layers)


class NNXScanStackedReverse(NNXScan):
    def body(self, h):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, reverse=True)
        def loop(h, layer):
            return layer(h)

        return loop(h, self.layers)


class NNXVmapEnsemble(NNXNet):
    def build(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.members = make(rngs)

    def body(self, h):
        return nnx.vmap(lambda m, h: m(h), in_axes=(0, None), out_axes=0)(self.members, h).mean(0)


class NNXJit(NNXNet):
    def body(self, h):
        for block in self.blocks:
            h = nnx.jit(lambda m, h: m(h))(block, h)
        return h


class NNXCond(NNXNet):
    def body(self, h):
        a, b = self.blocks
        pred = jnp.sum(a.lin.kernel[...]) > jnp.sum(b.lin.kernel[...])  # from the weights: one for the batch
        return nnx.cond(pred, lambda a, b, h: a(h), lambda a, b, h: b(h), a, b, h)


class NNXSwitch(NNXNet):
    def body(self, h):
        a, b = self.blocks
        index = (jnp.abs(jnp.sum(a.lin.kernel[...])) * 7).astype(jnp.int32) % 3
        branches = [lambda a, b, h: a(h), lambda a, b, h: b(h), lambda a, b, h: a(b(h))]
        return nnx.switch(index, branches, a, b, h)


class NNXForiLoop(NNXNet):
    def body(self, h):
        def step(i, carry):
            block, h = carry
            return block, block(h)

        return nnx.fori_loop(0, 3, step, (self.blocks[0], h))[1]


class NNXWhileLoop(NNXNet):
    def body(self, h):
        def cond(carry):
            return carry[2] < 3

        def step(carry):
            block, h, i = carry
            return block, block(h), i + 1

        return nnx.while_loop(cond, step, (self.blocks[0], h, jnp.int32(0)))[1]


class NNXInnerGrad(NNXNet):
    """A meta-learning inner step: the block adapted by one gradient step on a support set (not the batch)."""

    def body(self, h):
        block = self.blocks[0]

        def inner_loss(m):
            return jnp.mean(m(jnp.asarray(SUPPORT)) ** 2)

        loss, grads = nnx.value_and_grad(inner_loss)(block)
        del loss
        adapted = jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(block, nnx.Param), grads)
        graphdef = nnx.graphdef(block)
        return nnx.merge(graphdef, adapted)(h)


@nnx.custom_vjp
def _linear_tanh(m: Block, h: jax.Array) -> jax.Array:
    return jnp.tanh(m.lin(h))


def _linear_tanh_fwd(m, h):
    y = _linear_tanh(m, h)
    return y, (y, m, h)


def _linear_tanh_bwd(res, g):
    (m_updates_g, _), out_g = g
    y, m, h = res
    dz = out_g * (1 - y**2)
    m_g = jax.tree.map(lambda x: x, m_updates_g)
    m_g["lin"]["kernel"][...] = h.T @ dz
    m_g["lin"]["bias"][...] = dz.sum(0)
    return m_g, dz @ m.lin.kernel[...].T


_linear_tanh.defvjp(_linear_tanh_fwd, _linear_tanh_bwd)


class NNXCustomVjp(NNXNet):
    def body(self, h):
        for block in self.blocks:
            h = _linear_tanh(block, h)
        return h


class NNXDropout(NNXNet):
    def build(self, rngs):
        super().build(rngs)
        self.drop = nnx.Dropout(0.25, rngs=nnx.Rngs(dropout=3))

    def body(self, h):
        for block in self.blocks:
            h = self.drop(block(h))
        return h


class NNXBatchNorm(NNXNet):
    def build(self, rngs):
        super().build(rngs)
        self.bn = nnx.BatchNorm(D, momentum=0.8, rngs=rngs)

    def body(self, h):
        return self.blocks[1](self.bn(self.blocks[0](h)))


class NNXSequential(NNXNet):
    def build(self, rngs):
        self.seq = nnx.Sequential(Block(rngs), Block(rngs), nnx.Linear(D, D, rngs=rngs))

    def body(self, h):
        return self.seq(h)


class NNXList(NNXNet):
    def body(self, h):
        for block in self.blocks:
            h = block(h)
        return h


# --- Plain JAX inside an NNX model ------------------------------------------------------------------------------


class JaxCheckpoint(NNXNet):
    policy: Any = None

    def body(self, h):
        def layer(k, b, h):
            z = checkpoint_name(h @ k, "pre")
            return jnp.tanh(z + b)

        for block in self.blocks:
            h = jax.checkpoint(layer, policy=self.policy)(block.lin.kernel[...], block.lin.bias[...], h)
        return h


class JaxCheckpointDots(JaxCheckpoint):
    policy = staticmethod(jax.checkpoint_policies.dots_saveable)


class JaxCheckpointNothing(JaxCheckpoint):
    policy = staticmethod(jax.checkpoint_policies.nothing_saveable)


class JaxCheckpointNames(JaxCheckpoint):
    policy = staticmethod(jax.checkpoint_policies.save_only_these_names("pre"))


class JaxScanClosedOver(NNXNet):
    def body(self, h):
        block = self.blocks[0]
        k, b = block.lin.kernel[...], block.lin.bias[...]
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ k + b), None), h, None, length=3)[0]


@jax.custom_jvp
def _softsign(x):
    return x / (1 + jnp.abs(x))


@_softsign.defjvp
def _softsign_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _softsign(x), t / (1 + jnp.abs(x)) ** 2


class JaxCustomJvp(NNXNet):
    def body(self, h):
        for block in self.blocks:
            h = _softsign(block.lin(h))
        return h


class JaxNamedScope(NNXNet):
    def body(self, h):
        for i, block in enumerate(self.blocks):
            with jax.named_scope(f"block{i}"):
                h = block(h)
        return h


class JaxDebugCallback(NNXNet):
    def body(self, h):
        kernel = self.blocks[0].lin.kernel[...]
        jax.debug.callback(lambda s: None, jnp.sum(kernel))
        jax.debug.print("kernel sum {s}", s=jnp.sum(kernel))
        for block in self.blocks:
            h = block(h)
        return h


# --- Linen models -----------------------------------------------------------------------------------------------


class LBlock(nn.Module):
    @nn.compact
    def __call__(self, h, train: bool = True):
        h = jnp.tanh(nn.Dense(D)(h))
        return h if train else h * 1.0


class LNet(nn.Module):
    """``Dense -> body -> Dense``; each construct is a ``body`` module."""

    body: Callable[..., nn.Module]

    @nn.compact
    def __call__(self, x):
        return nn.Dense(D_OUT)(self.body()(nn.Dense(D)(x)))


class LRemat(nn.Module):
    @nn.compact
    def __call__(self, h):
        block = nn.remat(LBlock, static_argnums=(2,))
        return block()(block()(h, True), True)


class LScanBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return jnp.tanh(nn.Dense(D)(h)), None


class LScan(nn.Module):
    @nn.compact
    def __call__(self, h):
        scan = nn.scan(LScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan()(h, None)[0]


class LScanStacked(nn.Module):  # planned with stacked=("LScanStacked_0",)
    @nn.compact
    def __call__(self, h):
        scan = nn.scan(nn.remat(LScanBlock), variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return scan()(h, None)[0]


class LScanBlockOutputs(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        h = jnp.tanh(nn.Dense(D)(h))
        return h, h


class LScanStackedOutputs(nn.Module):  # per-layer outputs, planned with stacked=("LScanStackedOutputs_0",)
    @nn.compact
    def __call__(self, h):
        scan = nn.scan(LScanBlockOutputs, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        h, ys = scan()(h, None)
        return h + ys.mean(0)


class LVmap(nn.Module):
    @nn.compact
    def __call__(self, h):
        ens = nn.vmap(LBlock, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=3)
        return ens()(h).mean(0)


class LJit(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.jit(LBlock)()(h)


class LCond(nn.Module):
    def setup(self):
        self.a, self.b = LBlock(), LBlock()
        self.gate = self.param("gate", nn.initializers.constant(0.3), ())

    def __call__(self, h):
        if self.is_initializing():
            return self.b(self.a(h))
        return nn.cond(self.gate > 0, lambda m, h: m.a(h), lambda m, h: m.b(h), self, h)


class LWhile(nn.Module):
    def setup(self):
        self.block = LBlock()

    def __call__(self, h):
        if self.is_initializing():
            return self.block(h)

        def cond(m, carry):
            return carry[1] < 3

        def body(m, carry):
            return m.block(carry[0]), carry[1] + 1

        return nn.while_loop(cond, body, self, (h, jnp.int32(0)))[0]


class LMapVariables(nn.Module):
    @nn.compact
    def __call__(self, h):
        halve = lambda tree: jax.tree.map(lambda w: w * 0.5, tree)
        dense = nn.map_variables(nn.Dense, "params", trans_in_fn=halve, init=True)
        return jnp.tanh(dense(D)(h))


class LDropout(nn.Module):
    @nn.compact
    def __call__(self, h):
        return nn.Dropout(0.25, deterministic=False)(LBlock()(h))


class LBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, h):
        # after the block's tanh: a bias right before the normalisation has a zero gradient (rounding noise only,
        # which Adam would scale up to learning-rate steps)
        return nn.BatchNorm(use_running_average=False, momentum=0.8)(LBlock()(h))


class LShared(nn.Module):
    def setup(self):
        self.block = LBlock()

    def __call__(self, h):
        return self.block(self.block(h))


# --- The matrix -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Construct:
    """One row of the matrix: a construct, its model, and whether it works under ``vj.fsdp``."""

    name: str
    family: str  # "NNX", "Linen", "JAX"
    model: Any  # an NNXNet subclass, or a Linen body module
    works: bool = True
    why: str = ""  # for a refused construct: why the per-device view cannot give the unsharded result
    differentiable: bool = True  # False: JAX itself has no gradient of it (the unsharded run fails alike)
    rngs: tuple[str, ...] = ()  # Linen rng streams the model draws from
    mutable: tuple[str, ...] = ()  # Linen collections the model updates
    stacked: tuple[str, ...] = ()  # units planned as stacked layer groups (vj.plan(stacked=...))


MATRIX: tuple[Construct, ...] = (
    Construct("nnx.remat (module argument)", "NNX", NNXRemat),
    Construct("nnx.remat(policy=...)", "NNX", NNXRematPolicy),
    Construct("nnx.scan over layers (nnx.split_rngs)", "NNX", NNXScan),
    Construct("nnx.scan over a stacked plan (nnx.remat)", "NNX", NNXScanStacked, stacked=("layers",)),
    Construct(
        "nnx.scan in reverse over a stacked plan",
        "NNX",
        NNXScanStackedReverse,
        works=False,
        stacked=("layers",),
        why="vj.scan_layers gathers the layers forward: loop forward, or plan the group without stacked=",
    ),
    Construct("nnx.vmap (an ensemble)", "NNX", NNXVmapEnsemble),
    Construct("nnx.jit inside the model", "NNX", NNXJit),
    Construct("nnx.cond", "NNX", NNXCond),
    Construct("nnx.switch", "NNX", NNXSwitch),
    Construct("nnx.fori_loop reusing a layer", "NNX", NNXForiLoop),
    Construct(
        "nnx.while_loop reusing a layer",
        "NNX",
        NNXWhileLoop,
        differentiable=False,
        why="a while_loop has dynamic bounds: JAX has no reverse-mode gradient of it (use nnx.fori_loop or nnx.scan)",
    ),
    Construct("nnx.value_and_grad inside the model", "NNX", NNXInnerGrad),
    Construct("nnx.custom_vjp", "NNX", NNXCustomVjp),
    Construct("nnx.Dropout with nnx.Rngs", "NNX", NNXDropout),
    Construct("nnx.BatchNorm with its state", "NNX", NNXBatchNorm),
    Construct("nnx.Sequential", "NNX", NNXSequential),
    Construct("nnx.List of layers", "NNX", NNXList),
    Construct("nn.remat(static_argnums=...)", "Linen", LRemat),
    Construct("nn.scan (unstacked plan)", "Linen", LScan),
    Construct("nn.scan over a stacked plan (nn.remat)", "Linen", LScanStacked, stacked=("LScanStacked_0",)),
    Construct(
        "nn.scan over a stacked plan, per-layer outputs",
        "Linen",
        LScanStackedOutputs,
        works=False,
        stacked=("LScanStackedOutputs_0",),
        why="vj.scan_layers has no per-layer float outputs: return them through the carry, or plan without stacked=",
    ),
    Construct("nn.vmap (an ensemble)", "Linen", LVmap),
    Construct("nn.jit", "Linen", LJit),
    Construct("nn.cond", "Linen", LCond),
    Construct(
        "nn.while_loop",
        "Linen",
        LWhile,
        differentiable=False,
        why="a while_loop has dynamic bounds: JAX has no reverse-mode gradient of it (use nn.scan)",
    ),
    Construct("nn.map_variables", "Linen", LMapVariables),
    Construct("nn.Dropout", "Linen", LDropout, rngs=("dropout",)),
    Construct('nn.BatchNorm, mutable=["batch_stats"]', "Linen", LBatchNorm, mutable=("batch_stats",)),
    Construct("a shared submodule called twice", "Linen", LShared),
    Construct("jax.checkpoint(policy=dots_saveable)", "JAX", JaxCheckpointDots),
    Construct("jax.checkpoint(policy=nothing_saveable)", "JAX", JaxCheckpointNothing),
    Construct("jax.checkpoint(policy=save_only_these_names)", "JAX", JaxCheckpointNames),
    Construct("jax.lax.scan with the params closed over", "JAX", JaxScanClosedOver),
    Construct("jax.custom_jvp", "JAX", JaxCustomJvp),
    Construct("jax.named_scope", "JAX", JaxNamedScope),
    Construct("jax.debug.print / jax.debug.callback of a param", "JAX", JaxDebugCallback),
)


def _train(step, params, opt_state, state, batches, keys):
    losses = []
    for batch, key in zip(batches, keys, strict=True):
        params, opt_state, state, loss = step(params, opt_state, batch, state, key)
        losses.append(float(loss))
    return params, state, losses


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda x: x, tree)


def _adamw_step(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``(p, opt, batch, st, key) -> (p, opt, st, loss)``: one AdamW step on the MSE of ``forward(p, st, batch,
    key) -> (outputs, new state)``."""

    def step(p, opt, batch, st, key):
        def loss(p):
            out, new = forward(p, st, batch, key)
            return mse(out, batch["y"]), new

        (value, st), grads = jax.value_and_grad(loss, has_aux=True)(p)
        updates, opt = TX.update(grads, opt, p)
        return optax.apply_updates(p, updates), opt, st, value

    return step


def _unsharded_and_sharded(
    unsharded: Callable[..., Any],
    sharded: Callable[..., Any],
    params: Any,
    state: Any,
    keys: list[Any],
    mesh: Any,
    stacked: tuple[str, ...] = (),
) -> tuple[Any, Any]:
    """(unsharded, sharded) results of 3 AdamW steps, (params, state, losses) each: ``unsharded`` under
    ``jax.jit``, ``sharded`` (the same model through ``vj.flax``, ``stacked`` units planned as stacked layer
    groups) under ``vj.fsdp``."""
    batches = data()
    want = _train(jax.jit(_adamw_step(unsharded)), params, TX.init(params), state, batches, keys)
    sp = vj.shard(params, vj.plan(params, mesh, stacked=stacked))
    got = _train(vj.fsdp(_adamw_step(sharded)), sp, vj.init_opt_state(TX, sp), state, batches, keys)
    return want, (vj.unshard(got[0]), got[1], got[2])


def run_nnx(cls: type[NNXNet], mesh: jax.sharding.Mesh, stacked: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """(unsharded, sharded) results of 3 AdamW steps: (params, state, losses) each."""
    graphdef, params, state = nnx.split(cls(nnx.Rngs(0)), nnx.Param, ...)
    if not jax.tree.leaves(state):  # a model of parameters only: no state= (nor an empty one) for nnx_apply
        state = None

    def unsharded(p, st, batch, key):
        model = nnx.merge(graphdef, p) if st is None else nnx.merge(graphdef, p, _copy(st))
        return model(batch["x"]), None if st is None else nnx.split(model, nnx.Param, ...)[2]

    def sharded(p, st, batch, key):
        if st is None:
            return vj.flax.nnx_apply(graphdef, p, batch["x"]), None
        return vj.flax.nnx_apply(graphdef, p, batch["x"], state=st)

    return _unsharded_and_sharded(unsharded, sharded, params, state, [None] * STEPS, mesh, stacked)


def run_linen(c: Construct, mesh: jax.sharding.Mesh) -> tuple[Any, Any]:
    model = LNet(c.model)
    init_rngs = {"params": jax.random.key(0), **{r: jax.random.key(1) for r in c.rngs}}
    variables = model.init(init_rngs, jnp.ones((2, D_IN)))
    params = {"params": variables["params"]}
    state = {k: v for k, v in variables.items() if k != "params"}
    keys = [jax.random.fold_in(jax.random.key(9), i) for i in range(STEPS)]
    mutable = list(c.mutable)

    def rngs_of(key):
        return {r: jax.random.fold_in(key, j) for j, r in enumerate(c.rngs)} or None

    def unsharded(p, st, batch, key):
        if mutable:
            out, new = model.apply({**p, **st}, batch["x"], rngs=rngs_of(key), mutable=mutable)
            return out, {**st, **new}
        return model.apply({**p, **st}, batch["x"], rngs=rngs_of(key)), st

    def sharded(p, st, batch, key):
        kw = {"rngs": rngs_of(key), "state": st or None}
        if mutable:
            out, new = vj.flax.linen_apply(model, p, batch["x"], mutable=mutable, **kw)
            return out, {**st, **new}
        return vj.flax.linen_apply(model, p, batch["x"], **kw), st

    return _unsharded_and_sharded(unsharded, sharded, params, state, keys, mesh, c.stacked)


def _id(c: Construct) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", c.name.replace("...", "")).strip("-")


@pytest.mark.parametrize("m", (1, 3, 8), ids=lambda m: f"m{m}")
@pytest.mark.parametrize("c", MATRIX, ids=_id)
def test_construct_trains_as_unsharded(c: Construct, m: int):
    mesh = make_mesh(m)
    run = (lambda: run_linen(c, mesh)) if c.family == "Linen" else (lambda: run_nnx(c.model, mesh, c.stacked))
    if not c.works:  # refused when the step is traced, naming the way out
        with pytest.raises(ValueError, match=r"stacked=.*vj\.scan_layers|vj\.scan_layers.*stacked="):
            run()
        return
    if not c.differentiable:  # the unsharded run fails first, with JAX's own error
        with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
            run()
        return
    (want_p, want_s, want_l), (got_p, got_s, got_l) = run()
    np.testing.assert_allclose(got_l, want_l, rtol=1e-5, atol=1e-6, err_msg=f"{c.name}: losses")
    assert_trees_close(got_p, want_p, rtol=1e-5, what=f"{c.name}: params")
    assert_trees_close(_key_data(got_s), _key_data(want_s), rtol=1e-5, what=f"{c.name}: state")


def _key_data(tree: Any) -> Any:
    """Typed PRNG keys (an ``nnx.Rngs`` in the state) as their raw data, to compare."""
    is_key = lambda x: hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x, tree)


def test_the_docs_table_is_this_matrix():
    text = (Path(__file__).resolve().parent.parent / "docs" / "devices.md").read_text()
    rows = re.findall(r"^\| `?([^|`]+?)`? \| (NNX|Linen|JAX) \| (works|refused|no gradient in JAX) \|", text, re.M)
    status = lambda c: "no gradient in JAX" if not c.differentiable else "works" if c.works else "refused"
    want = [(c.name, c.family, status(c)) for c in MATRIX]
    assert rows == want, "docs/devices.md's transform table differs from tests/test_transforms.py's MATRIX"


# --- A real update is still refused, inside any lifted transform -----------------------------------------------


class UpdatesInsideRemat(NNXNet):
    def body(self, h):
        def call(m, h):
            m.lin.bias[...] = m.lin.bias[...] + 1.0  # the model assigns a planned parameter
            return m(h)

        return nnx.remat(call)(self.blocks[0], h)


class SwapsInsideJit(NNXNet):
    def body(self, h):
        def call(a, b, h):  # each kernel handed back as the other's: both values changed
            a.lin.kernel[...], b.lin.kernel[...] = b.lin.kernel[...], a.lin.kernel[...]
            return b(a(h))

        return nnx.jit(call)(self.blocks[0], self.blocks[1], h)


@pytest.mark.parametrize(
    "cls, leaf", [(UpdatesInsideRemat, "blocks/0/lin/bias"), (SwapsInsideJit, "blocks/0/lin/kernel")]
)
def test_a_real_update_inside_a_lifted_transform_is_refused(cls, leaf):
    with pytest.raises(ValueError, match=f"the model updated {leaf}, a leaf of the planned params"):
        run_nnx(cls, make_mesh(3))
