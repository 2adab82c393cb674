"""Model state and keyword inputs through ``vj.flax`` and ``vj.apply``, against the same model run unsharded on
one device over the global batch: BatchNorm (NNX and Linen) trained with AdamW (parameters and running statistics),
keyword arguments as transformers' Flax models take them, and the refusals (a stacked group under a reverse
Linen ``nn.scan``, RNG state in the planned params, state updates that differ per device, missing or planned state)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx
from helpers import assert_trees_close, load_script

import vescale_jax as vj

COUNTS = (1, 3, 8)


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


TX = optax.adamw(1e-2, weight_decay=0.1)
# For the language model: some of its gradient entries are ~1e-8, rounding noise that Adam's normalisation would
# turn into O(lr) updates; SGD keeps the comparison one of the model's numbers.
SGD = optax.sgd(0.5)


def regression_data(steps: int = 5, batch: int = 24, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Inputs far from zero mean and unit variance (so batch statistics matter) and targets."""
    rng = np.random.default_rng(seed)
    return [
        {
            "x": (3 * rng.standard_normal((batch, 5)) + 1).astype(np.float32),
            "y": rng.standard_normal((batch, 3)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def train(step, params, opt_state, state, data):
    for batch in data:
        params, opt_state, state, _ = step(params, opt_state, batch, state)
    return params, state


# --- NNX BatchNorm ----------------------------------------------------------------------------------------------


class NNXBatchNormNet(nnx.Module):
    """Linear (no bias: BatchNorm removes it) -> BatchNorm -> ReLU -> Linear."""

    def __init__(self, *, axis_name=None, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(5, 7, use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(7, momentum=0.8, axis_name=axis_name, rngs=rngs)
        self.l2 = nnx.Linear(7, 3, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))


def nnx_reference(graphdef, params, state, data):
    """Unsharded: the model merged from params and state, AdamW on the params, the state it leaves behind."""

    @jax.jit
    def step(params, opt_state, batch, state):
        def loss(p):
            model = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, state))  # Variables of this trace
            out = model(batch["x"])
            return jnp.mean((out - batch["y"]) ** 2), nnx.split(model, nnx.Param, ...)[2]

        (loss_value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, loss_value

    return train(step, params, TX.init(params), state, data)


def nnx_fsdp(graphdef, params, state, data, mesh):
    sp = vj.shard(params, vj.plan(params, mesh))

    @vj.fsdp
    def step(params, opt_state, batch, state):
        def loss(p):
            out, new_state = vj.flax.nnx_apply(graphdef, p, batch["x"], state=state)
            return jnp.mean((out - batch["y"]) ** 2), new_state

        (loss_value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, loss_value

    sp, state = train(step, sp, vj.init_opt_state(TX, sp), state, data)
    return vj.unshard(sp), state


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
@pytest.mark.parametrize("axis_name", [None, "fsdp"], ids=["plain", "own_axis_name"])
def test_nnx_batch_norm_matches_unsharded(m, axis_name):
    mesh = make_mesh(m)
    graphdef, params, state = nnx.split(NNXBatchNormNet(axis_name=axis_name, rngs=nnx.Rngs(0)), nnx.Param, ...)
    ref_graphdef, _, _ = nnx.split(NNXBatchNormNet(rngs=nnx.Rngs(0)), nnx.Param, ...)
    data = regression_data()
    want_params, want_state = nnx_reference(ref_graphdef, params, state, data)
    got_params, got_state = nnx_fsdp(graphdef, params, state, data, mesh)
    assert_trees_close(got_params, want_params, rtol=1e-5, what="params")
    assert_trees_close(got_state, want_state, rtol=1e-5, what="batch statistics")
    assert nnx.merge(graphdef, params, state).bn.axis_name == axis_name  # the model itself is untouched


# --- Linen BatchNorm --------------------------------------------------------------------------------------------


class LinenBatchNormNet(nn.Module):
    axis_name: str | None = None

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(7, use_bias=False)(x)
        h = nn.BatchNorm(use_running_average=not train, momentum=0.8, axis_name=self.axis_name)(h)
        return nn.Dense(3)(jax.nn.relu(h))


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_linen_batch_norm_matches_unsharded(m):
    mesh = make_mesh(m)
    model = LinenBatchNormNet()
    variables = model.init(jax.random.key(0), jnp.ones((2, 5)), train=False)
    params, state = {"params": variables["params"]}, {"batch_stats": variables["batch_stats"]}
    data = regression_data()

    @jax.jit
    def ref_step(params, opt_state, batch, state):
        def loss(p):
            out, new = model.apply({**p, **state}, batch["x"], train=True, mutable=["batch_stats"])
            return jnp.mean((out - batch["y"]) ** 2), new

        (loss_value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, loss_value

    @vj.fsdp
    def step(params, opt_state, batch, state):
        def loss(p):
            out, new = vj.flax.linen_apply(model, p, batch["x"], state=state, mutable=["batch_stats"], train=True)
            return jnp.mean((out - batch["y"]) ** 2), new

        (loss_value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, loss_value

    want_params, want_state = train(ref_step, params, TX.init(params), state, data)
    sp = vj.shard(params, vj.plan(params, mesh))
    got, got_state = train(step, sp, vj.init_opt_state(TX, sp), state, data)
    assert_trees_close(vj.unshard(got), want_params, rtol=1e-5, what="params")
    assert_trees_close(got_state, want_state, rtol=1e-5, what="batch statistics")

    # Evaluation with the running statistics (no mutable collection): the plain output, as model.apply gives it.
    x = vj.place_batch(data[0]["x"], sp.plan)
    evaluated = vj.flax.linen_apply(model, got, x, state=got_state, train=False)
    want = model.apply({**want_params, **want_state}, data[0]["x"], train=False)
    assert_trees_close(evaluated, want, rtol=1e-5, what="evaluation")


# --- Keyword arguments ------------------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Called as transformers' Flax models are: ``model(input_ids, attention_mask=, position_ids=,
    deterministic=)``; ``logit_bias`` is a keyword array without the batch dim (passed whole)."""

    vocab: int = 41
    d: int = 12

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, deterministic: bool = True, logit_bias=None):
        b, t = input_ids.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(t), (b, t))
        h = nn.Embed(self.vocab, self.d)(input_ids) + nn.Embed(16, self.d)(position_ids)
        # No key bias: softmax ignores it, so its gradient is zero up to rounding (noise that Adam would amplify).
        q, k, v = nn.Dense(self.d)(h), nn.Dense(self.d, use_bias=False)(h), nn.Dense(self.d)(h)
        allowed = jnp.tril(jnp.ones((t, t), bool))[None] & attention_mask[:, None, :].astype(bool)
        scores = jnp.where(allowed, q @ k.swapaxes(-1, -2) / np.sqrt(self.d), -1e9)
        h = h + jax.nn.softmax(scores, axis=-1) @ v
        h = nn.Dropout(0.5)(h, deterministic=deterministic)
        logits = nn.Dense(self.vocab)(h)
        return logits if logit_bias is None else logits + logit_bias


def lm_batches(steps: int = 3, batch: int = 24, t: int = 10, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        lengths = rng.integers(3, t + 1, batch)
        mask = (np.arange(t)[None] < lengths[:, None]).astype(np.int32)
        out.append(
            {
                "ids": rng.integers(0, 41, (batch, t)).astype(np.int32),
                "mask": mask,
                "pos": np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32),
            }
        )
    return out


def lm_loss(logits, batch):
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], batch["ids"][:, 1:])
    weights = batch["mask"][:, 1:].astype(jnp.float32)
    return jnp.sum(per_token * weights) / jnp.sum(weights)


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_keyword_batch_inputs_match_unsharded(m):
    mesh = make_mesh(m)
    model = TinyLM()
    data = lm_batches()
    params = model.init(jax.random.key(0), data[0]["ids"], attention_mask=data[0]["mask"])
    bias = jnp.linspace(-0.5, 0.5, 41, dtype=jnp.float32)  # leading dim 41, not the batch's 24: passed whole

    def call(apply_model, p, batch):
        return apply_model(
            p, batch["ids"], attention_mask=batch["mask"], position_ids=batch["pos"], deterministic=True,
            logit_bias=bias,
        )  # fmt: skip

    @jax.jit
    def ref_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(call(model.apply, p, batch), batch))(params)
        updates, opt_state = SGD.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @vj.fsdp
    def step(params, opt_state, batch):
        sharded_apply = lambda p, *a, **kw: vj.flax.linen_apply(model, p, *a, **kw)
        loss, grads = jax.value_and_grad(lambda p: lm_loss(call(sharded_apply, p, batch), batch))(params)
        updates, opt_state = SGD.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    sp = vj.shard(params, vj.plan(params, mesh))
    opt_state, ref_opt = vj.init_opt_state(SGD, sp), SGD.init(params)
    for batch in data:
        sp, opt_state, loss = step(sp, opt_state, batch)
        params, ref_opt, ref_loss = ref_step(params, ref_opt, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(vj.unshard(sp), params, rtol=1e-5, what="params")


def test_keyword_inputs_of_vj_apply_and_nnx_apply():
    """vj.apply and nnx_apply: a keyword array with the batch dim is split, another passed whole, a Python value
    static; the same numbers as the model called unsharded."""
    mesh = make_mesh(3)
    model = nnx.Linear(4, 6, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    plan = vj.plan(params, mesh)
    sp = vj.shard(params, plan)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    weight = rng.standard_normal((6,)).astype(np.float32)
    shift = rng.standard_normal((6,)).astype(np.float32)  # leading dim 6 = the batch's: split, like weight
    table = rng.standard_normal((5, 6)).astype(np.float32)  # whole

    def fn(p, x, *, weight, table, scale, shift=None):
        out = nnx.merge(graphdef, p)(x) * scale + table.sum(0)
        return out * weight[:, None] + (0 if shift is None else shift[:, None])

    want = fn(params, x, weight=weight, table=table, scale=2.0, shift=shift)
    xs, ws, ss = (vj.place_batch(a, plan) for a in (x, weight, shift))
    got = vj.apply(fn, sp, xs, weight=ws, table=jnp.asarray(table), scale=2.0, shift=ss)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    got = vj.flax.nnx_apply(graphdef, sp, xs, method=lambda mdl, x, k: mdl(x) * k[:, None], k=ws)
    np.testing.assert_allclose(np.asarray(got), model(x) * weight[:, None], rtol=1e-5, atol=1e-6)


# --- Linen nn.scan over a stacked group ---------------------------------------------------------------------------


class ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + jnp.tanh(nn.Dense(20)(h)), None


class ScannedNet(nn.Module):
    remat: bool = False
    reverse: bool = False

    @nn.compact
    def __call__(self, x):
        block = nn.remat(ScanBlock) if self.remat else ScanBlock
        layers = nn.scan(
            block, variable_axes={"params": 0}, split_rngs={"params": True}, length=3, reverse=self.reverse
        )
        h, _ = layers(name="layers")(nn.Dense(20)(x), None)
        return nn.Dense(2)(h)


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "remat_scan"])
def test_linen_scan_over_stacked_group_is_refused(remat):
    """Planned with stacked=, a reverse nn.scan is refused when traced, naming the leaf, its shapes and the fix (a
    forward one runs as vj.scan_layers: tests/test_flax_layer_loops.py)."""
    mesh = make_mesh(3)
    model = ScannedNet(remat=remat, reverse=True)
    variables = model.init(jax.random.key(0), jnp.ones((2, 5)))
    stacked = vj.plan(variables, mesh, stacked=("layers",))
    xs = vj.place_batch(np.ones((6, 5), np.float32), stacked)
    with pytest.raises(
        ValueError, match=r"params/layers/Dense_0/\w+ \(shape \(3, 20(, 20)?\)\).*vj\.scan_layers.*stacked="
    ):
        vj.flax.linen_apply(model, vj.shard(variables, stacked), xs)


@pytest.mark.slow
def test_linen_scan_over_unstacked_group_matches_unsharded():
    """The fix the refusal names: planned without stacked=, the same gradients as unsharded."""
    mesh = make_mesh(3)
    model = ScannedNet(remat=True)
    variables = model.init(jax.random.key(0), jnp.ones((2, 5)))
    x = np.random.default_rng(0).standard_normal((6, 5)).astype(np.float32)
    plan = vj.plan(variables, mesh)
    sp, xs = vj.shard(variables, plan), vj.place_batch(x, plan)
    loss = lambda out: jnp.sum(out**2)
    with jax.set_mesh(mesh):
        got = jax.grad(lambda p: loss(vj.flax.linen_apply(model, p, xs)))(sp)
    want = jax.grad(lambda v: loss(model.apply(v, x)))(variables)
    assert_trees_close(vj.unshard(got), want, rtol=1e-5, what="gradients")


# --- Refusals ---------------------------------------------------------------------------------------------------


class Dropper(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(dropout=1))

    def __call__(self, x):
        return self.drop(self.lin(x))


def test_rng_state_in_planned_params_points_at_state():
    mesh = make_mesh(3)
    model = Dropper(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"PRNG keys.*nnx.split\(model, nnx.Param, \.\.\.\).*nnx_apply\(.*state=state"):
        vj.plan(nnx.split(model)[1], mesh)
    # What it points at works: the RNG state carried as the model's state, its counter advanced as unsharded.
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    plan = vj.plan(params, mesh)
    x = np.ones((6, 4), np.float32)
    out, new_state = vj.flax.nnx_apply(graphdef, vj.shard(params, plan), vj.place_batch(x, plan), state=state)
    reference = nnx.merge(graphdef, params, state)
    reference(x)
    want = nnx.split(reference, nnx.Param, ...)[2]
    assert out.shape == (6, 4)
    assert jax.tree.structure(new_state) == jax.tree.structure(want)
    assert int(new_state["drop"]["rngs"]["count"][...]) == 1 == int(want["drop"]["rngs"]["count"][...])


class PerDeviceStat(nnx.Module):
    """Stores the mean of its input: a statistic of the device's own batch shard under vj.apply."""

    def __init__(self, rngs: nnx.Rngs):
        self.lin = nnx.Linear(4, 4, rngs=rngs)
        self.seen = nnx.BatchStat(jnp.zeros(4))

    def __call__(self, x):
        h = self.lin(x)
        self.seen[...] = h.mean(0)
        return h


def test_state_update_that_differs_per_device_is_refused():
    mesh = make_mesh(3)
    graphdef, params, state = nnx.split(PerDeviceStat(nnx.Rngs(0)), nnx.Param, ...)
    plan = vj.plan(params, mesh)
    x = vj.place_batch(np.ones((6, 4), np.float32), plan)
    with pytest.raises(ValueError, match=r"state leaf \['seen'\].*varies over the data axes \('fsdp',\).*pmean") as e:
        vj.flax.nnx_apply(graphdef, vj.shard(params, plan), x, state=state)
    assert "vj.batch_mean" in str(e.value) and "one for the whole batch" in str(e.value)  # the way out


def test_missing_or_planned_state_is_named():
    mesh = make_mesh(3)
    model = NNXBatchNormNet(rngs=nnx.Rngs(0))
    x = np.ones((6, 5), np.float32)
    graphdef, params, _ = nnx.split(model, nnx.Param, ...)
    plan = vj.plan(params, mesh)
    with pytest.raises(ValueError, match=r"other variables.*state=state"):
        vj.flax.nnx_apply(graphdef, vj.shard(params, plan), vj.place_batch(x, plan))
    graphdef, everything = nnx.split(model)  # BatchNorm statistics planned as if they were parameters
    plan = vj.plan(everything, mesh)
    with pytest.raises(ValueError, match=r"updated bn/mean, a leaf of the planned params.*state=state"):
        vj.flax.nnx_apply(graphdef, vj.shard(everything, plan), vj.place_batch(x, plan))


def test_linen_refusals_name_the_collection():
    mesh = make_mesh(3)
    model = LinenBatchNormNet()
    variables = model.init(jax.random.key(0), jnp.ones((2, 5)), train=False)
    params = {"params": variables["params"]}
    plan = vj.plan(params, mesh)
    sp, x = vj.shard(params, plan), vj.place_batch(np.ones((6, 5), np.float32), plan)
    with pytest.raises(ValueError, match=r"mutable=\['params'\] names planned collection"):
        vj.flax.linen_apply(
            model, sp, x, state={"batch_stats": variables["batch_stats"]}, mutable=["params"], train=True
        )

    class Sower(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(3)(x)
            self.sow("intermediates", "h_mean", h.mean(0))
            return h

    sower = Sower()
    params = sower.init(jax.random.key(0), jnp.ones((2, 5)))
    plan = vj.plan(params, mesh)
    with pytest.raises(ValueError, match=r"state leaf \['intermediates'\]\['h_mean'\].*varies over the data axes"):
        vj.flax.linen_apply(sower, vj.shard(params, plan), x, mutable=["intermediates"])


def test_batch_norm_index_groups_are_refused():
    mesh = make_mesh(2)
    model = NNXBatchNormNet(rngs=nnx.Rngs(0))
    model.bn.axis_index_groups = [[0, 1]]
    graphdef, params, state = nnx.split(model, nnx.Param, ...)
    plan = vj.plan(params, mesh)
    with pytest.raises(ValueError, match=r"BatchNorm bn has axis_index_groups"):
        vj.flax.nnx_apply(
            graphdef, vj.shard(params, plan), vj.place_batch(np.ones((4, 5), np.float32), plan), state=state
        )


def test_dropout_batchnorm_example_matches_its_unsharded_run():
    """examples/train_dropout_batchnorm.py: dropout from nnx.Rngs state, BatchNorm and a vj.batch_mean term under
    vj.fsdp on every device of the test process, against the same model trained on one device."""
    example = load_script("examples/train_dropout_batchnorm.py")
    params_diff, stats_diff = example.main(["--steps", "4", "--batch", "48", "--width", "32"])
    assert params_diff <= 1e-5 and stats_diff <= 1e-5, (params_diff, stats_diff)
