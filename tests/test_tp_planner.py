"""benchmarks/tp_planner.py: its gates on GPT-OSS-120B with 8 expert groups x fsdp 32 against FSDP2's even split
computed here, and its integer bucket grouping against vj.plan on real ("fsdp", "expert") meshes."""

import math

import jax
import pytest
from helpers import load_script

import vescale_jax as vj

bench = load_script("benchmarks/tp_planner.py")
model_configs = load_script("benchmarks/model_configs.py")
P = jax.sharding.PartitionSpec


def fsdp2_expert_padding(model: str, expert: int, fsdp: int) -> float:
    """Padding of even dim-0 sharding of the stacked experts: each EP group's ``num_experts / expert`` experts
    over ``fsdp`` devices (dim 0 padded up to a multiple of ``fsdp``), all groups together."""
    used = padded = 0
    for _, params in model_configs.buckets(model):
        for name, shape in params:
            if ".mlp.experts." not in name:
                continue
            local0, rest = shape[0] // expert, math.prod(shape[1:])
            used += shape[0] * rest
            padded += expert * (-(-local0 // fsdp) * fsdp) * rest
    return (padded - used) / padded


@pytest.mark.parametrize("gran", ["element()", "rows(1)"])
def test_gates_gpt_oss_ep8_fsdp32(gran):
    cfg = next(c for c in bench.configs() if c.model == "gpt-oss-120b" and c.kind == "EP" and c.fsdp == 32)
    r = bench.measure(cfg, gran, "auto", check_plan=False)
    assert r.failures(time_gate=False) == []

    fsdp2 = fsdp2_expert_padding("gpt-oss-120b", 8, 32)
    assert r.fsdp2_split_padding == pytest.approx(fsdp2, rel=1e-12)
    assert fsdp2 > 0.45  # 16 experts over 32 devices: FSDP2 doubles the experts' buffer
    assert r.split_padding < bench.EXPERT_LIMIT
    assert r.split_padding < fsdp2 / 100

    # The grouped buckets hold exactly the experts (each group its 16), and their padding is the reported one.
    experts = sum(
        math.prod(s) for _, ps in model_configs.buckets("gpt-oss-120b") for n, s in ps if ".mlp.experts." in n
    )
    leaves = bench.leaves_of(bench.abstract_tree(cfg.model), cfg)
    grouped = [b for b in bench.group_buckets(leaves, cfg, dict(bench.GRANULARITIES)[gran], "auto") if b.groups]
    assert all(".mlp.experts." in leaves[i].path for b in grouped for i in b.leaves)
    assert sum(b.num_groups * sum(b.layout.sizes) for b in grouped) == experts
    buffer = sum(b.num_groups * b.layout.total_size for b in grouped)
    assert (buffer - experts) / buffer == pytest.approx(r.split_padding, abs=1e-15)

    # The gate can fail: FSDP2's figure in place of the ragged one is flagged.
    bad = bench.dataclasses.replace(r, split_padding=fsdp2)
    assert any("experts pad" in f for f in bad.failures(time_gate=False))


def small_ep_tree() -> dict:
    """Two GPT-OSS-like layers with 8 stacked experts (odd inner dims), embed and head; big enough that
    split="auto" cuts the expert group of a layer into per-leaf buckets."""
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, bench.DTYPE)  # bf16, as the benchmark
    tree = {"embed": {"model.embed_tokens.weight": sds(1001, 96)}, "lm_head": {"lm_head.weight": sds(1001, 96)}}
    for i, (d, f) in enumerate(((96, 1027), (72, 2050))):
        p = f"model.layers.{i}"
        tree[f"layers.{i}"] = {
            f"{p}.input_layernorm.weight": sds(d),
            f"{p}.self_attn.q_proj.weight": sds(5 * d, d),
            f"{p}.self_attn.q_proj.bias": sds(5 * d),
            f"{p}.mlp.router.weight": sds(8, d),
            f"{p}.mlp.experts.gate_up_proj": sds(8, 8 * d, 2 * f),
            f"{p}.mlp.experts.gate_up_proj_bias": sds(8, 2 * f),
            f"{p}.mlp.experts.down_proj": sds(8, 8 * f, d),
            f"{p}.mlp.experts.down_proj_bias": sds(8, d),
        }
    return tree


@pytest.mark.parametrize("fsdp,expert", [(2, 4), (4, 2), (1, 2), (3, 2)])
@pytest.mark.parametrize("split", ["auto", "none"])
@pytest.mark.parametrize("gran", ["element()", "rows(1)"])
def test_grouping_matches_vj_plan(fsdp, expert, split, gran):
    if fsdp * expert > jax.device_count():
        pytest.skip(f"needs {fsdp * expert} devices, {jax.device_count()} available")
    mesh = jax.make_mesh((fsdp, expert), ("fsdp", "expert"), devices=jax.devices()[: fsdp * expert])
    tree = small_ep_tree()
    granularity = dict(bench.GRANULARITIES)[gran]
    plan = vj.plan(
        tree,
        mesh,
        tp=lambda path, leaf: P("expert") if ".mlp.experts." in path[-1].key else None,
        granularity=granularity,
        split=split,
    )

    cfg = bench.Config("small", "EP", fsdp, "expert", expert, bench.gpt_oss_spec)
    leaves = bench.leaves_of(tree, cfg)
    mine = bench.group_buckets(leaves, cfg, granularity, split)
    assert [b.name for b in mine] == [b.name for b in plan.buckets]
    if split == "auto":  # the expert groups were cut into per-leaf buckets
        assert any("/model.layers.0.mlp.experts.gate_up_proj@expert" in b.name for b in plan.buckets)
    for b, ref in zip(mine, plan.buckets, strict=True):
        assert [leaves[i].path for i in b.leaves] == [plan.leaves[i].path for i in ref.leaves]
        assert (b.groups, b.num_groups) == (ref.groups, ref.num_groups)
        assert b.layout.sizes == ref.layout.sizes
        assert (b.layout.shard_size, b.layout.offsets) == (ref.layout.shard_size, ref.layout.offsets)
        # never mixed: a grouped bucket holds expert leaves only, an ungrouped one none
        assert all((".mlp.experts." in leaves[i].path) == bool(b.groups) for i in b.leaves)
    assert bench.ragged_padding(leaves, mine) == pytest.approx(plan.padding_fraction, rel=1e-12)
