"""vj.Offload: optimizer state in host memory between steps, streamed through the update.

Every run is compared with the same step without offload (the reference), bit for bit.
"""

import jax
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import (
    GPTConfig,
    abstract_model,
    assert_trees_close,
    assert_trees_equal,
    batches,
    init_params,
    load_script,
    loss_fn,
    muon_dimension_numbers,
)

import vescale_jax as vj

CFG = GPTConfig(vocab=257, max_len=8, d_model=20, num_heads=2, num_layers=3, d_ff=52)
GRAPHDEF, SHAPES = abstract_model(CFG)


def _plan(mesh, **kw):
    return vj.plan(SHAPES, mesh, stacked=("blocks",), **kw)


def _step(tx, offload, **options):
    @vj.fsdp(offload=offload, **options)
    def step(params, opt_state, batch):
        def loss_of(p, b):
            return loss_fn(vj.flax.nnx_apply(GRAPHDEF, p, b["x"]), b["y"])

        if options.get("microbatches"):
            loss, grads = vj.accumulate(loss_of, params, batch)
        else:
            loss, grads = jax.value_and_grad(loss_of)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def _train(plan, tx, offload, steps, *, microbatches=None, **options):
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes a float with an int32 count
        return _run(plan, tx, offload, steps, microbatches=microbatches, **options)


def _run(plan, tx, offload, steps, *, microbatches=None, **options):
    params = vj.init_sharded(lambda k: init_params(CFG, k), plan, jax.random.key(0))
    opt_state = vj.init_opt_state(tx, params, offload=offload)
    step = _step(tx, offload, microbatches=microbatches, **options)
    losses = []
    for batch in batches(steps, batch=24, seq=CFG.max_len):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, opt_state, losses, step, batch


def _compare(plan, tx, offload, steps=10, **options):
    want = _train(plan, tx, None, steps, **options)
    got = _train(plan, tx, offload, steps, **options)
    np.testing.assert_array_equal(got[2], want[2])
    assert_trees_equal(vj.unshard(got[0]), vj.unshard(want[0]), what="params")
    assert_trees_equal(vj.onload(got[1]), want[1], what="opt_state")
    return got


@pytest.mark.parametrize("m", [1, 3, 8], ids=lambda m: f"m{m}")
def test_adamw_ten_steps_bitwise(m):
    """Whole-bucket pieces: the update runs as the reference compiles it; state lives in pinned host memory."""
    plan = _plan(make_mesh(m, auto=True))
    params, opt_state, _, step, batch = _compare(plan, optax.adamw(1e-2, weight_decay=0.1), vj.Offload(pieces="bucket"))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(opt_state) if x.ndim}
    assert kinds == {"pinned_host"}
    with jax.numpy_dtype_promotion("standard"):
        pieces = step.streamed(params, opt_state, batch)
    assert [p.group for p in pieces] == list(range(len(plan.buckets)))
    host = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(opt_state) if x.ndim)
    assert sum(p.bytes_in for p in pieces) == sum(p.bytes_out for p in pieces) == host


def test_layer_pieces_stream_one_layer_at_a_time():
    """With the default pieces, a stacked group's element-wise update is streamed row by row (L pieces of one
    layer's state each) and a large flat bucket's in column pieces, every byte of state in and out once. The values
    are the same operations on the same numbers; XLA:CPU's fusion emitters may round a fused
    ``x / (sqrt(y) + eps)`` on a piece differently from the whole buffer by one ulp, so after 10 steps they agree
    to float32 rounding."""
    plan = _plan(make_mesh(3, auto=True))
    tx = optax.adamw(1e-2, weight_decay=0.1)
    params, opt_state, losses, step, batch = _train(plan, tx, vj.Offload(piece_bytes=2048), 10)
    with jax.numpy_dtype_promotion("standard"):
        pieces = step.streamed(params, opt_state, batch)
    stacked = [b for b, bucket in enumerate(plan.buckets) if bucket.layers]
    assert stacked
    for b in stacked:
        rows = [p.row for p in pieces if p.group == b]
        assert rows == list(range(CFG.num_layers))
    # the flat buckets larger than 2048 bytes per device (embedding, head) come in column pieces of at most that
    for b, bucket in enumerate(plan.buckets):
        local = bucket.shape[-1] // 3 * 4
        if not bucket.layers and local > 2048:
            cut = [p for p in pieces if p.group == b]
            assert [p.row for p in cut] == list(range(len(cut))) and len(cut) == -(-local // 2048)
            assert all(p.bytes_in <= 2 * 2048 + 8 for p in cut)  # two moments per piece
    host = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(opt_state) if x.ndim)
    assert sum(p.bytes_in for p in pieces) == sum(p.bytes_out for p in pieces) == host
    assert max(p.bytes_in for p in pieces) < host / 2  # no piece is the whole state
    want = _train(plan, tx, None, 10)
    np.testing.assert_allclose(losses, want[2], rtol=1e-6)
    assert_trees_close(vj.unshard(params), vj.unshard(want[0]), rtol=1e-5, what="params")
    assert_trees_close(vj.onload(opt_state), want[1], rtol=1e-4, what="opt_state")


def _muon(plan):
    return vj.optim.muon(
        1e-2, plan=plan, adam_learning_rate=1e-2, muon_weight_dimension_numbers=muon_dimension_numbers(SHAPES)
    )


OPTIMIZERS = {
    "adamw_8bit": (
        dict(granularity=lambda path, leaf: vj.tiles(4, 4) if leaf.ndim >= 2 else vj.rows(1)),
        lambda plan: vj.optim.adamw_8bit(1e-2, plan=plan, block=(4, 4), min_size=64),
    ),
    "muon": ({}, _muon),
    "shampoo": (
        dict(granularity=lambda path, leaf: vj.rows(4) if leaf.ndim >= 2 else vj.rows(1)),
        lambda plan: vj.optim.shampoo(1e-2, plan=plan, block_size=4),
    ),
    "masks_and_segment_norms": (
        {},
        lambda plan: vj.optim.lamb(1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)),
    ),
    "clipped_chain": (
        {},
        lambda plan: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1)),
    ),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizers_bitwise(name):
    kw, make = OPTIMIZERS[name]
    plan = _plan(make_mesh(3, auto=True), **kw)
    _compare(plan, make(plan), vj.Offload(pieces="bucket"), steps=3)


def test_accumulation_bitwise():
    _compare(_plan(make_mesh(3, auto=True)), optax.adamw(1e-2), vj.Offload(pieces="bucket"), steps=3, microbatches=2)


def test_hsdp_bitwise():
    mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])
    plan = _plan(mesh)
    _compare(plan, optax.adamw(1e-2), vj.Offload(pieces="bucket"), steps=3, data_axes=("replica", "fsdp"))


def test_offload_and_onload_round_trip():
    plan = _plan(make_mesh(3, auto=True))
    params = vj.init_sharded(lambda k: init_params(CFG, k), plan, jax.random.key(0))
    state = vj.init_opt_state(optax.adamw(1e-2), params)
    state = jax.tree.map(lambda x: x + 1 if x.ndim else x, state)
    off = vj.offload(state)
    assert any(isinstance(x, vj.Offloaded) for x in jax.tree.leaves(off, is_leaf=lambda x: isinstance(x, vj.Offloaded)))
    assert_trees_equal(vj.onload(off), state)
    assert vj.offload(off) is not None  # already offloaded nodes stay


def test_errors_name_the_fix():
    plan = _plan(make_mesh(3, auto=True))
    tx = optax.adamw(1e-2)
    params = vj.init_sharded(lambda k: init_params(CFG, k), plan, jax.random.key(0))
    batch = next(batches(1, batch=24, seq=CFG.max_len))
    on_device = vj.init_opt_state(tx, params)
    with pytest.raises(ValueError, match=r"offload=.*on the device.*vj.init_opt_state\(tx, params, offload="):
        _step(tx, vj.Offload())(params, on_device, batch)
    with pytest.raises(ValueError, match=r"host memory.*without offload=.*vj.onload"):
        _step(tx, None)(params, vj.offload(on_device), batch)
    with pytest.raises(ValueError, match=r"params=True\) is not supported"):
        vj.Offload(params=True)
    with pytest.raises(ValueError, match="pieces"):
        vj.Offload(pieces="row")
    with pytest.raises(TypeError, match=r"offload= must be a vj\.Offload"):
        vj.fsdp(lambda *a: a, offload=True)
    with pytest.raises(TypeError, match=r"offload= must be a vj\.Offload"):
        vj.init_opt_state(tx, params, offload="host")


def test_lowered_for_cuda_moves_only_the_state():
    """Lowered for CUDA, the step's transfers are the state pieces: in and out once each."""
    plan = _plan(make_mesh(8, auto=True))
    tx = optax.adamw(1e-2)
    params = vj.init_sharded(lambda k: init_params(CFG, k), plan, jax.random.key(0))
    opt_state = vj.init_opt_state(tx, params, offload=vj.Offload())
    batch = next(batches(1, batch=16, seq=CFG.max_len))
    step = _step(tx, vj.Offload())
    with jax.numpy_dtype_promotion("standard"):
        text = step.lower(params, opt_state, batch, lowering_platforms=("cuda",)).as_text()
    loads = text.count('_xla_buffer_placement = "device"')
    stores = text.count('_xla_buffer_placement = "pinned_host"')
    pieces = len(jax.tree.leaves(opt_state)) - 1  # every leaf but the count
    assert loads == stores == pieces
    assert text.count('mhlo.memory_kind = "pinned_host"') >= 2 * pieces  # arguments and results
    # each piece's load waits on a barrier: the first two on the gradients, the others on the store two before
    assert text.count("stablehlo.optimization_barrier") == pieces


@pytest.mark.parametrize("pieces", ["bucket", "layer"])
def test_tensor_parallel_plan(pieces):
    """FSDP x TP (a 2 x 4 mesh, the example's tensor-parallel GPT): offloaded state, the same training."""
    gpt_tp = load_script("examples/gpt_tp.py")
    cfg = gpt_tp.Config(vocab=64, max_len=8, d_model=32, num_heads=4, num_layers=2, d_ff=64, tensor="tensor")
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=jax.devices()[:8])
    graphdef, shapes = gpt_tp.abstract_model(cfg)
    plan = vj.plan(shapes, mesh, stacked=("blocks",), tp=gpt_tp.partition_spec(cfg))
    tx = optax.adamw(1e-2)
    x = np.random.default_rng(0).integers(0, cfg.vocab, (8, cfg.max_len)).astype(np.int32)

    def run(offload):
        params = vj.shard(gpt_tp.split_model(cfg, jax.random.key(0))[1], plan)
        opt_state = vj.init_opt_state(tx, params, offload=offload)

        @vj.fsdp(offload=offload)
        def step(params, opt_state, batch):
            def loss_of(p, x):
                logits = vj.flax.nnx_apply(graphdef, p, x[:, :-1])
                return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

            loss, grads = jax.value_and_grad(loss_of)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        with jax.numpy_dtype_promotion("standard"):
            for _ in range(3):
                params, opt_state, _loss = step(params, opt_state, x)
        return vj.unshard(params), vj.onload(opt_state)

    want, got = run(None), run(vj.Offload(pieces=pieces))
    if pieces == "bucket":
        assert_trees_equal(got, want)
    else:
        assert_trees_close(got, want, rtol=1e-5)
