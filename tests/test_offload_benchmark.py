"""benchmarks/fsdp_step.py's offload row on a tiny GPT: the bytes the CUDA-lowered step moves (its
``annotate_device_placement`` custom calls), its host arguments and the streaming window, against ``step.streamed``."""

import types

import jax
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import load_script

import vescale_jax as vj

bench = load_script("benchmarks/fsdp_step.py")


def piece(bytes_in, bytes_out=None):
    return types.SimpleNamespace(bytes_in=bytes_in, bytes_out=bytes_in if bytes_out is None else bytes_out)


def test_streaming_window_formula():
    assert bench.streaming_window([]) == 0
    assert bench.streaming_window([piece(5, 3)]) == 8
    # max_k in[k] + out[k] + in[k+1]: k = 1 gives 4 + 4 + 7 = 15 (k = 0: 2 + 2 + 4 = 8; k = 2: 7 + 1 + 0 = 8)
    assert bench.streaming_window([piece(2), piece(4), piece(7, 1)]) == 15


def test_placement_bytes_parses_shardings():
    text = "\n".join(
        [
            'sdy.mesh @mesh = <["fsdp"=8, "tp"=2]>',
            "func.func public @main(%arg0: tensor<2x64xf32>) -> tensor<2x64xf32> {",
            '  %0 = sdy.sharding_constraint %arg0 <@mesh, [{}, {"fsdp", "tp"}]> : tensor<2x64xf32>',
            "  %1 = stablehlo.custom_call @annotate_device_placement(%0) {has_side_effect = true, "
            'mhlo.frontend_attributes = {_xla_buffer_placement = "device"}} : (tensor<2x64xf32>) -> tensor<2x64xf32>',
            "  %2 = stablehlo.custom_call @annotate_device_placement(%1) {has_side_effect = true, "
            'mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}, sdy.sharding = '
            '#sdy.sharding_per_value<[<@mesh, [{"tp"}, {}]>]>} : (tensor<2x64xbf16>) -> tensor<2x64xbf16>',
            "  %3 = stablehlo.custom_call @annotate_device_placement(%2) {has_side_effect = true, "
            'mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : (tensor<16xf32>) -> tensor<16xf32>',
        ]
    )
    # the constraint on the operand (split 16 ways); the op's own sharding (2 ways, bf16); no sharding: 8 ways
    assert bench.placement_bytes(text, 8) == {"device": [2 * 4 * 4], "pinned_host": [1 * 64 * 2, 2 * 4]}


@pytest.fixture(scope="module")
def tiny():
    """An offloaded vj.fsdp AdamW step of the benchmark's GPT, 2 layers, d_model 32, vocab 64, on 8 devices, as
    the benchmark's vj_step builds it, with zero parameters (the figures depend on shapes only; vj.init_sharded
    would compile the model's initialisation)."""
    mesh = make_mesh(8, auto=True)
    cfg = bench.GPTConfig(vocab=64, max_len=16, d_model=32, num_heads=4, num_layers=2, d_ff=128)
    graphdef, shapes = bench.abstract_model(cfg)
    plan = vj.plan(shapes, mesh, stacked=("blocks",))
    tx = optax.adamw(1e-3)

    @vj.fsdp(plan=plan, offload=vj.Offload())
    def step(params, opt_state, batch):
        def loss(p):
            return bench.loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    buffers = [
        jax.device_put(np.zeros(b.shape, b.dtype), s) for b, s in zip(plan.buckets, plan.shardings(), strict=True)
    ]
    params = vj.ShardedParams(buffers, plan)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab, (8, cfg.max_len + 1)).astype(np.int32)
    batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes a float with an int32 count
        opt_state = vj.init_opt_state(tx, params, offload=vj.Offload())
        text = step.lower(params, opt_state, batch, lowering_platforms=("cuda",)).as_text()
        pieces = step.streamed(params, opt_state, batch)
    return pieces, text, opt_state, plan


def test_lowered_transfers_match_streamed(tiny):
    pieces, text, opt_state, plan = tiny
    n_host, host = bench.host_resident_bytes(opt_state)
    # AdamW: mu and nu of every bucket, a layer group's buffer as one host array per layer row
    assert n_host == 2 * sum(b.layers or 1 for b in plan.buckets)
    moves = bench.placement_bytes(text, 8)
    assert set(moves) == {"device", "pinned_host"}
    moved_in, moved_out = sum(moves["device"]), sum(moves["pinned_host"])
    assert moved_in == sum(p.bytes_in for p in pieces) == host
    assert moved_out == sum(p.bytes_out for p in pieces) == host
    assert len(moves["device"]) == len(moves["pinned_host"]) == n_host  # each host array loaded and stored once
    assert bench.host_arguments(text, 8) == (n_host, n_host, host)
    # the window: two pieces' inputs and one output, at least the largest piece's traffic
    window = bench.streaming_window(pieces)
    assert max(p.bytes_in + p.bytes_out for p in pieces) <= window <= 3 * max(p.bytes_in for p in pieces)
    first = pieces[0]
    assert first.row == 0 and window >= first.bytes_in + first.bytes_out + pieces[1].bytes_in
