"""vj.fsdp against an unsharded reference: NNX (stacked layers) and Linen (one unit per block), census, errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DEVICE_COUNTS, make_mesh
from flax import nnx
from helpers import (
    GPTConfig,
    abstract_model,
    assert_trees_close,
    batches,
    counting_compiles,
    init_params,
    loss_fn,
    reference_run,
)

import vescale_jax as vj
from vescale_jax import testing

# Widths that no device count divides: prime vocabulary, odd widths.
CFG = GPTConfig(vocab=257, max_len=16, d_model=20, num_heads=2, num_layers=3, d_ff=52)
SEQ = 16  # the length of helpers.batches' windows


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def make_tx():
    # clip_by_global_norm with a threshold that binds checks that global norms see every shard.
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3, weight_decay=0.1))


def fsdp_step(plan, apply_model, tx, **kw):
    @vj.fsdp(plan=plan, **kw)
    def step(params, opt_state, batch):
        def f(p):
            return loss_fn(apply_model(p, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def assert_padding_zero(sp):
    for bucket, buf in zip(sp.plan.buckets, sp.buffers, strict=True):
        used = np.zeros(bucket.layout.total_size, bool)
        for n, o in zip(bucket.layout.sizes, bucket.layout.offsets, strict=True):
            used[o : o + n] = True
        assert not np.any(np.asarray(buf)[..., ~used]), bucket.name


def run_fsdp(sp, step, tx, data):
    opt_state, losses = vj.init_opt_state(tx, sp), []
    for batch in data:
        sp, opt_state, metrics = step(sp, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return sp, opt_state, losses


# --- NNX: stacked layer group under vj.flax.nnx_scan_layers ----------------------------------------------------


@pytest.fixture(scope="module")
def nnx_reference():
    graphdef, _ = abstract_model(CFG)
    params = init_params(CFG, jax.random.key(0))
    ref, losses = reference_run(params, lambda p, x: nnx.merge(graphdef, p)(x), make_tx(), batches())
    return params, ref, losses


@pytest.mark.parametrize("split", ["auto", "leaves"])
@pytest.mark.parametrize("m", DEVICE_COUNTS, ids=lambda m: f"m{m}")
def test_nnx_matches_unsharded(m, split, nnx_reference):
    params, ref, ref_losses = nnx_reference
    mesh = make_mesh(m)
    graphdef, shapes = abstract_model(CFG)
    plan = vj.plan(shapes, mesh, stacked=("blocks",), split=split)
    if split == "leaves":  # every matrix of the stacked layer its own bucket, the norms and biases one more
        assert len([b for b in plan.buckets if b.layers]) > 1
    tx = make_tx()
    step = fsdp_step(plan, lambda p, x: vj.flax.nnx_apply(graphdef, p, x), tx)
    sp, opt_state, losses = run_fsdp(vj.shard(params, plan), step, tx, batches())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref)
    assert_padding_zero(sp)
    # Optimizer state lives sharded like the params, never replicated.
    mu = opt_state[1][0].mu
    assert isinstance(mu, vj.ShardedParams)
    for buf, sharding in zip(mu.buffers, plan.shardings(), strict=True):
        assert buf.sharding.is_equivalent_to(sharding, buf.ndim)


@pytest.mark.parametrize(
    "options",
    [{"reshard_after_forward": False}, {"prefetch": True}, {"reshard_after_forward": False, "prefetch": True}],
    ids=["keep", "prefetch", "keep-prefetch"],
)
def test_nnx_options_match(options, nnx_reference):
    params, ref, ref_losses = nnx_reference
    graphdef, shapes = abstract_model(CFG)
    plan = vj.plan(shapes, make_mesh(3), stacked=("blocks",))
    tx = make_tx()
    step = fsdp_step(plan, lambda p, x: vj.flax.nnx_apply(graphdef, p, x), tx, **options)
    sp, _, losses = run_fsdp(vj.shard(params, plan), step, tx, batches())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref)


def test_nnx_on_an_auto_mesh():
    # Auto axes (what with_sharding_constraint users have) instead of the default Explicit ones.
    graphdef, shapes = abstract_model(CFG)
    params = init_params(CFG, jax.random.key(0))
    ref, ref_losses = reference_run(params, lambda p, x: nnx.merge(graphdef, p)(x), make_tx(), batches(5))
    plan = vj.plan(shapes, make_mesh(3, auto=True), stacked=("blocks",))
    tx = make_tx()
    step = fsdp_step(plan, lambda p, x: vj.flax.nnx_apply(graphdef, p, x), tx)
    sp, opt_state, losses = run_fsdp(vj.shard(params, plan), step, tx, batches(5))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref)
    for buf, sharding in zip(opt_state[1][0].nu.buffers, plan.shardings(), strict=True):
        assert buf.sharding.is_equivalent_to(sharding, buf.ndim)


# --- Linen: unrolled blocks, one unit (bucket) per block ---------------------------------------------------------


class LinenBlock(nn.Module):
    d: int
    heads: int
    ff: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        q, k, v = jnp.split(nn.Dense(3 * d, use_bias=False, name="qkv")(nn.LayerNorm(name="ln1")(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        att = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((b, t))))
        x = x + nn.Dense(d, name="proj")(att.reshape(b, t, d))
        h = nn.Dense(self.ff, name="up")(nn.LayerNorm(name="ln2")(x))
        return x + nn.Dense(d, name="down")(jax.nn.gelu(h))


class LinenGPT(nn.Module):
    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.cfg
        x = nn.Embed(c.vocab, c.d_model, name="embed")(tokens)
        x = x + self.param("pos", nn.initializers.normal(0.02), (c.max_len, c.d_model))[: tokens.shape[1]]
        for i in range(c.num_layers):
            x = LinenBlock(c.d_model, c.num_heads, c.d_ff, name=f"block{i}")(x)
        return nn.Dense(c.vocab, use_bias=False, name="head")(nn.LayerNorm(name="ln_f")(x))


@pytest.fixture(scope="module")
def linen_reference():
    model = LinenGPT(CFG)
    params = model.init(jax.random.key(1), jnp.zeros((1, SEQ), jnp.int32))
    ref, losses = reference_run(params, model.apply, make_tx(), batches())
    return model, params, ref, losses


@pytest.mark.parametrize("m", DEVICE_COUNTS, ids=lambda m: f"m{m}")
def test_linen_matches_unsharded(m, linen_reference):
    model, params, ref, ref_losses = linen_reference
    plan = vj.plan(params, make_mesh(m), granularity=vj.rows(1))
    assert len(plan.buckets) == CFG.num_layers + 4  # embed, pos, each block, ln_f, head
    tx = make_tx()
    step = fsdp_step(plan, lambda p, x: vj.flax.linen_apply(model, p, x), tx)
    sp, _, losses = run_fsdp(vj.shard(params, plan), step, tx, batches())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref)
    assert_padding_zero(sp)


# --- Collective census -------------------------------------------------------------------------------------------


def compiled_step(m, **kw):
    cfg = GPTConfig(vocab=257, max_len=16, d_model=20, num_heads=2, num_layers=4, d_ff=52)
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, make_mesh(m), stacked=("blocks",))
    tx = make_tx()
    step = fsdp_step(plan, lambda p, x: vj.flax.nnx_apply(graphdef, p, x), tx, **kw)
    sp = vj.init_sharded(lambda k: init_params(cfg, k), plan, jax.random.key(0))
    batch = next(batches(1, batch=2 * m))
    compiled = step.lower(sp, vj.init_opt_state(tx, sp), batch).compile()
    return plan, testing.census(compiled), cfg


@pytest.mark.parametrize(
    ("reshard", "prefetch"), [(True, False), (False, False), (True, True)], ids=["reshard", "keep", "prefetch"]
)
def test_census(reshard, prefetch):
    m = 8
    plan, census, cfg = compiled_step(m, reshard_after_forward=reshard, prefetch=prefetch)
    by_size = {}
    for op in census.of("all-gather"):
        by_size.setdefault(op.result_bytes, []).append(op)
    stacked = next(b for b in plan.buckets if b.layers)
    layer_bytes = stacked.layout.total_size * 4
    # The layer group: one gather per layer in forward, inside the loop (with prefetch, layer 0 before it and the
    # rest one iteration ahead), and with reshard one more per layer in backward; one reduce-scatter per layer.
    loop_gathers = [op for op in by_size[layer_bytes] if op.in_loop]
    assert sum(op.multiplier for op in by_size[layer_bytes]) == cfg.num_layers * (2 if reshard else 1)
    per_loop = cfg.num_layers - 1 if prefetch else cfg.num_layers
    assert loop_gathers and all(op.multiplier == per_loop for op in loop_gathers)
    assert len(loop_gathers) == (2 if reshard else 1)
    rs = [op for op in census.of("reduce-scatter") if op.result_bytes == stacked.layout.shard_size * 4]
    assert sum(op.multiplier for op in rs) == cfg.num_layers and any(op.in_loop for op in rs)
    # Non-stacked buckets: one gather in forward, one reduce-scatter each; in backward a bucket is gathered again
    # only if the backward reads its values (the head and ln_f do; an embedding or additive position table not).
    expected = {}
    for bucket in plan.buckets:
        if not bucket.layers:
            again = reshard and bucket.unit in ("head", "ln_f")
            expected[bucket.nbytes] = expected.get(bucket.nbytes, 0) + (2 if again else 1)
    got = {n: sum(op.multiplier for op in ops) for n, ops in by_size.items() if n != layer_bytes}
    assert got == expected
    assert census.count("reduce-scatter") == len(plan.buckets) - 1 + cfg.num_layers
    # Wire bytes of the gathers against r·(m-1)/m·P·(1+padding), P the bytes of the gathered buckets.
    regathered = [b for b in plan.buckets if b.layers or (reshard and b.unit in ("head", "ln_f"))]
    ideal = sum(b.nbytes for b in plan.buckets) + sum(b.nbytes for b in regathered if reshard)
    ideal *= (m - 1) / m
    assert abs(census.wire_bytes("all-gather") / ideal - 1) < 0.02
    # No all-reduce of parameter-sized data: only scalars (loss, global norm).
    for op in census.of("all-reduce"):
        assert all(part.strip().endswith("[]") for part in op.shape.strip("()").split(",")), op


# --- Errors ------------------------------------------------------------------------------------------------------


def small_setup(m=8):
    graphdef, shapes = abstract_model(CFG)
    plan = vj.plan(shapes, make_mesh(m), stacked=("blocks",))
    tx = optax.sgd(0.1)
    return plan, tx, fsdp_step(plan, lambda p, x: vj.flax.nnx_apply(graphdef, p, x), tx)


def test_batch_not_divisible_by_data_parallel_size():
    plan, tx, step = small_setup(8)
    sp = vj.shard(init_params(CFG, jax.random.key(0)), plan)
    batch = next(batches(1, batch=12))
    with pytest.raises(ValueError, match=r"batch leaf \['x'\] has shape \(12, 16\).*divisible by the data-parallel"):
        step(sp, tx.init(sp), batch)


def test_params_not_matching_the_plan():
    _, _, step = small_setup(8)
    params = init_params(CFG, jax.random.key(0))
    with pytest.raises(TypeError, match=r"must be a vj\.ShardedParams"):
        step(params, None, next(batches(1)))
    other = vj.plan(abstract_model(CFG)[1], make_mesh(8), stacked=("blocks",), granularity=vj.rows(1))
    with pytest.raises(ValueError, match="another plan"):
        step(vj.shard(params, other), None, next(batches(1)))


def test_mesh_without_the_axis():
    _, shapes = abstract_model(CFG)
    with pytest.raises(ValueError, match="fsdp"):
        vj.plan(shapes, make_mesh(2, axis="data"), stacked=("blocks",))
    plan = vj.plan(shapes, make_mesh(2), stacked=("blocks",))
    with pytest.raises(ValueError, match=r"data axes \['data'\] are not axes of the mesh"):
        vj.fsdp(lambda *a: a, plan=plan, data_axes="data")


def test_second_step_does_not_recompile():
    plan, tx, step = small_setup(2)
    sp = vj.shard(init_params(CFG, jax.random.key(0)), plan)
    opt_state = vj.init_opt_state(tx, sp)
    data = batches(2, batch=4)
    sp, opt_state, _ = step(sp, opt_state, next(data))
    with jax.log_compiles(True):
        import logging

        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("jax").addHandler(handler)
        try:
            step(sp, opt_state, next(data))
        finally:
            logging.getLogger("jax").removeHandler(handler)
    assert not [r for r in records if "Compiling" in r.getMessage()]


# --- Pallas unpack / pack on the gather path ---------------------------------------------------------------------


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_pallas_kernels_on_the_gather_path_give_identical_gradients(monkeypatch, reshard):
    cfg = GPTConfig(vocab=67, max_len=8, d_model=12, num_heads=2, num_layers=2, d_ff=20)
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, make_mesh(3), stacked=("blocks",))
    sp = vj.shard(init_params(cfg, jax.random.key(0)), plan)
    batch = {"x": np.arange(48).reshape(6, 8) % cfg.vocab, "y": (np.arange(48).reshape(6, 8) + 1) % cfg.vocab}
    results, calls = {}, {"pack": [], "unpack": []}
    for name in calls:  # record the layouts each kernel is launched on
        real = getattr(vj.kernels, name)
        spy = lambda *a, _real=real, _name=name, **k: calls[_name].append(a[1]) or _real(*a, **k)
        monkeypatch.setattr(vj.kernels._ragged, name, spy)
    for mode in ("xla", "pallas"):
        for got in calls.values():
            got.clear()

        @vj.fsdp(plan=plan, donate=False, reshard_after_forward=reshard, kernels=vj.kernels.KernelPolicy(mode=mode))
        def grad_step(params, _, batch):
            return jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"]))(params)

        results[mode] = grad_step(sp, None, batch)
        for got in calls.values():
            # The kernels ran only when switched on, and then for every bucket, stacked or not, both ways.
            assert set(got) == ({b.layout for b in plan.buckets} if mode == "pallas" else set())
    (loss_x, g_x), (loss_p, g_p) = results["xla"], results["pallas"]
    assert float(loss_x) == float(loss_p)
    for a, b in zip(g_x.buffers, g_p.buffers, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_kernel_policy_comes_from_the_environment_when_the_step_is_built(monkeypatch):
    """VESCALE_JAX_KERNELS is read once, by vj.fsdp: changing it afterwards changes nothing."""
    cfg = GPTConfig(vocab=67, max_len=8, d_model=12, num_heads=2, num_layers=2, d_ff=20)
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, make_mesh(2), stacked=("blocks",))
    sp = vj.shard(init_params(cfg, jax.random.key(0)), plan)
    batch = {"x": np.arange(32).reshape(4, 8) % cfg.vocab, "y": (np.arange(32).reshape(4, 8) + 1) % cfg.vocab}
    calls = []
    real = vj.kernels.unpack
    monkeypatch.setattr(vj.kernels._ragged, "unpack", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv("VESCALE_JAX_KERNELS", "pallas")

    @vj.fsdp(plan=plan, donate=False)
    def loss_step(params, _, batch):
        return loss_fn(vj.flax.nnx_apply(graphdef, params, batch["x"]), batch["y"])

    monkeypatch.setenv("VESCALE_JAX_KERNELS", "xla")
    loss_step(sp, None, batch)
    assert calls  # built under "pallas"
    with pytest.raises(TypeError, match=r"kernels= must be a vj\.kernels\.KernelPolicy"):
        vj.fsdp(lambda *a: a, plan=plan, kernels="pallas")


def test_state_passed_from_the_host_is_placed_as_the_step_returns_it_no_second_compile():
    # A model state made on the host (or on one device) goes in; the step hands it back replicated on the mesh
    # (Auto axes). The next call, with that state, must run the first call's program, not compile another.
    tree = {"w": jnp.ones((8, 4), jnp.float32)}
    plan = vj.plan(tree, make_mesh(2, auto=True))

    @vj.fsdp
    def step(sp, opt, x, count):
        y = vj.apply(lambda p, x: x @ p["w"], sp, x)
        return sp, opt, jnp.sum(y), count + 1

    sp, x = vj.shard(tree, plan), np.ones((4, 8), np.float32)
    with counting_compiles() as compiles:
        sp, _, _, count = step(sp, None, x, np.zeros((), np.int32))  # a host value
        first = len(compiles)
        for _ in range(2):
            sp, _, _, count = step(sp, None, x, count)
    assert int(count) == 3
    assert first >= 1 and len(compiles) == first, compiles
