"""vj.checkpoint.load_safetensors / save_safetensors under tensor-parallel plans (TP-grouped buckets), and what the
loader holds and reads: bit for bit against ``vj.shard`` of the mapped arrays and the checkpoint's own bytes, each
shard's ranges read once, host memory bounded by one shard plus a chunk.
"""

from __future__ import annotations

import tracemalloc

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from safetensors_worker import llama_tp_rule
from test_safetensors import _flax_llama, assert_sharded_equal, llama_tensors, read_all, shapes_of, write_checkpoint

import vescale_jax as vj
from vescale_jax.checkpoint import Entry, Mapping, Transpose, _hf_index, llama_mapping


def tp_mesh(fsdp: int, tensor: int) -> jax.sharding.Mesh:
    if fsdp * tensor > len(jax.devices()):
        pytest.skip(f"needs {fsdp * tensor} devices")
    return jax.make_mesh((fsdp, tensor), ("fsdp", "tensor"), devices=jax.devices()[: fsdp * tensor])


def stacked_llama(tensors, layers=2):
    """The stacked-layers FlaxLlamaForCausalLM-shaped tree (``llama_mapping(stacked=True)``)."""
    flat = _flax_llama(tensors, layers)
    per = [flat["model"]["layers"][str(j)] for j in range(layers)]
    flat["model"]["layers"] = jax.tree.map(lambda *xs: np.stack(xs), *per)
    return flat


def stacked_tp_rule(path, leaf):
    """:func:`llama_tp_rule` with a leading (unsplit) layer dim on the stacked layers."""
    spec = llama_tp_rule(path, leaf)
    if spec is not None and vj.plan_path(path).startswith("model/layers"):
        return P(None, *spec)
    return spec


CASES = {
    # fsdp x tensor, granularity, tensor sizes (split dims divisible by the tensor size), stacked layers
    "2x4-element": ((2, 4), vj.element(), {}, False),
    "1x3-rows2": ((1, 3), vj.rows(2), dict(h=24, i=36, v=48, kv=12), False),
    "3x2-tiles": ((3, 2), vj.tiles(2, 2), {}, False),
    "2x4-stacked": ((2, 4), vj.rows(1), dict(layers=3, h=20, i=28, v=44, kv=12), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp_plan_loads_and_saves_bit_for_bit(tmp_path, case):
    shape, gran, sizes, stacked = CASES[case]
    tensors = llama_tensors(12, **sizes)
    path = write_checkpoint(tensors, tmp_path / "ckpt", num_files=3)
    tree = stacked_llama(tensors, sizes.get("layers", 2)) if stacked else _flax_llama(tensors)
    kw = dict(units=lambda p, x: "layers" if vj.plan_path(p).startswith("model/layers") else "rest")
    kw = dict(kw, stacked=("layers",)) if stacked else {}
    rule = stacked_tp_rule if stacked else llama_tp_rule
    plan = vj.plan(shapes_of(tree), tp_mesh(*shape), tp=rule, granularity=gran, **kw)
    assert any(b.groups for b in plan.buckets) and any(not b.groups for b in plan.buckets)
    assert stacked == any(b.layers for b in plan.buckets)
    mapping = llama_mapping(stacked=stacked)
    stats = {}
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=mapping, stats=stats)
    assert_sharded_equal(sp, vj.shard(tree, plan))
    written = vj.checkpoint.save_safetensors(sp, tmp_path / "out", mapping=mapping, max_shard_size="5KB")
    assert len(written) > 3
    got = read_all(tmp_path / "out")
    assert sorted(got) == sorted(tensors)
    for k, x in tensors.items():
        assert got[k].dtype == x.dtype and got[k].tobytes() == x.tobytes(), k


@pytest.mark.parametrize("gran", [vj.element(), vj.tiles(4, 4)], ids=["element", "tiles"])
def test_odd_tp_shards_are_read_once(tmp_path, gran):
    """TP shards whose dims the fsdp size does not divide (40 x 11, 3 x 9 x 5): every element is read once (the
    bucket's shards, not a leaf's storage blocks replicated over fsdp, which the first version read per replica).
    Runs of different devices lie over 8 elements apart here, so no read coalesces into another's range."""
    rng = np.random.default_rng(13)
    t = {
        "w.weight": rng.standard_normal((44, 40), np.float32),  # (out, in): the kernel (40, 44), columns split
        "v": rng.standard_normal((3, 9, 20), np.float32),
        "n": rng.standard_normal(35, np.float32),
    }
    path = write_checkpoint(t, tmp_path / "odd", num_files=2)
    mapping = Mapping((Entry("w", "w.weight", (Transpose(),)), Entry("v", "v"), Entry("n", "n")))
    tree = {"w": t["w.weight"].T, "v": t["v"], "n": t["n"]}
    tp = {"w": P(None, "tensor"), "v": P(None, None, "tensor"), "n": None}
    plan = vj.plan(shapes_of(tree), tp_mesh(2, 4), tp=tp, granularity=gran)
    stats = {}
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=mapping, stats=stats)
    assert stats["bytes_read"] == stats["data_bytes"] == sum(x.nbytes for x in t.values())
    assert_sharded_equal(sp, vj.shard(tree, plan))
    vj.checkpoint.save_safetensors(sp, tmp_path / "out", mapping=mapping)
    got = read_all(tmp_path / "out")
    assert sorted(got) == sorted(t) and all(got[k].tobytes() == x.tobytes() for k, x in t.items())


def test_host_memory_is_one_shard_plus_a_chunk(tmp_path, monkeypatch):
    """With chunks of 4096 elements, loading and saving a 2 MiB transposed, TP-split leaf on 2 devices holds one
    device's shard (0.5 MiB) on the host plus index arrays and buffers of a chunk, not the leaf or its TP shard."""
    monkeypatch.setattr(_hf_index, "CHUNK", 4096)
    rng = np.random.default_rng(14)
    t = {"w.weight": rng.standard_normal((1024, 512), np.float32)}
    path = write_checkpoint(t, tmp_path / "big", num_files=1)
    mapping = Mapping((Entry("w", "w.weight", (Transpose(),)),))
    tree = {"w": t["w.weight"].T}
    plan = vj.plan(shapes_of(tree), tp_mesh(2, 2), tp={"w": P(None, "tensor")})
    shard_bytes = plan.buckets[0].layout.shard_size * 4
    assert shard_bytes <= 2**19 + 64
    limit = shard_bytes + 64 * 4096 * 8  # one shard, and a chunk's index arrays and buffers many times over
    tracemalloc.start()
    try:
        sp = vj.checkpoint.load_safetensors(path, plan, mapping=mapping)
        _, load_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        vj.checkpoint.save_safetensors(sp, tmp_path / "out", mapping=mapping)
        _, save_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert load_peak < limit, (load_peak, limit)
    assert save_peak - before < limit, (save_peak - before, limit)
    assert read_all(tmp_path / "out")["w.weight"].tobytes() == t["w.weight"].tobytes()
    assert_sharded_equal(sp, vj.shard(tree, plan))
