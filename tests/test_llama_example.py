"""examples/llama.py and examples/finetune_llama.py: the NNX Llama has exactly the parameter tree of transformers'
``FlaxLlamaForCausalLM`` and its logits; a Hugging Face-layout checkpoint loads with ``vj.checkpoint.load_safetensors``
and the sharded forward equals the unsharded one; ``--help`` imports no JAX; a short fine-tuning run learns and
its ``--save`` output reads back with ``safetensors``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from helpers import ROOT, assert_trees_close, assert_trees_equal, child_pythonpath, load_script

import vescale_jax as vj

transformers = pytest.importorskip("transformers")

EXAMPLE = os.path.join(ROOT, "examples", "finetune_llama.py")


@pytest.fixture(scope="module")
def llama():
    return load_script("examples/llama.py")


@pytest.fixture(scope="module")
def finetune():
    return load_script("examples/finetune_llama.py")


def hf_config(*, tied: bool, kv_heads: int = 2, bias: bool = False) -> dict:
    """A small random Llama config (no download); max positions at least the head width (transformers' Flax
    rotary table is cut to ``max_position_embeddings`` columns)."""
    return transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        attention_bias=bias,
    ).to_dict()


def paths_and_shapes(tree) -> dict[str, tuple[int, ...]]:
    return {vj.plan_path(p): tuple(leaf.shape) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def with_values(state: nnx.State, values: dict[str, np.ndarray]) -> nnx.State:
    """``state`` with each leaf replaced by ``values[plan path]``."""
    return jax.tree_util.tree_map_with_path(lambda p, _: jnp.asarray(values[vj.plan_path(p)]), state)


@pytest.mark.parametrize(
    "tied, kv_heads, bias",
    [
        pytest.param(False, 2, False, id="untied-gqa", marks=pytest.mark.slow),
        pytest.param(True, 2, False, id="tied-gqa"),
        pytest.param(False, 4, False, id="mha", marks=pytest.mark.slow),
        pytest.param(False, 1, True, id="mqa-bias"),
    ],
)
def test_params_and_logits_match_transformers(llama, tied, kv_heads, bias):
    config = hf_config(tied=tied, kv_heads=kv_heads, bias=bias)
    with jax.numpy_dtype_promotion("standard"):  # transformers' init is not written for strict promotion
        ref = transformers.FlaxLlamaForCausalLM(transformers.LlamaConfig(**config), seed=0, _do_init=True)
    ref_params = jax.tree.map(np.asarray, ref.params)
    theirs = paths_and_shapes(ref_params)

    cfg = llama.LlamaConfig.from_hf(config)
    graphdef, shapes = llama.abstract_model(cfg)
    mine = paths_and_shapes(shapes)
    # transformers' Flax Llama always has an lm_head and computes with it, even when the config says tied; ours
    # has none when tied and uses the embedding's transpose.
    expected = {k: v for k, v in theirs.items() if not (tied and k == "lm_head/kernel")}
    assert mine == expected
    assert f"model/layers/{cfg.num_hidden_layers - 1}/self_attn/q_proj/kernel" in mine

    values = {vj.plan_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(ref_params)[0]}
    if tied:  # the reference computes with lm_head/kernel: make it the tied one
        ref_params["lm_head"]["kernel"] = values["model/embed_tokens/embedding"].T
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 20)).astype(np.int32)
    with jax.numpy_dtype_promotion("standard"):
        want = np.asarray(jax.jit(lambda p, x: ref(x, params=p).logits)(ref_params, ids))
    got = np.asarray(nnx.merge(graphdef, with_values(shapes, values))(jnp.asarray(ids)))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.max(np.abs(want)) > 0.1  # not a vacuous comparison


@pytest.mark.slow
def test_explicit_positions_equal_default(llama):
    cfg = llama.LlamaConfig.from_hf(hf_config(tied=False), rope_theta=500000.0)
    graphdef, params = nnx.split(llama.LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    model = jax.jit(lambda x, pos=None: nnx.merge(graphdef, params)(x, pos))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    np.testing.assert_allclose(np.asarray(model(ids)), np.asarray(model(ids, pos)), atol=1e-6, rtol=0)
    shifted = model(ids, pos + 3)  # only relative positions matter: shifting them all changes little
    np.testing.assert_allclose(np.asarray(shifted), np.asarray(model(ids)), atol=1e-4)


def test_config_round_trip(llama):
    cfg = llama.LlamaConfig.from_hf(hf_config(tied=True, kv_heads=1))
    again = llama.LlamaConfig.from_hf(json.loads(json.dumps(cfg.to_hf())))
    assert again == cfg
    hf = transformers.LlamaConfig(**cfg.to_hf())
    assert (hf.num_key_value_heads, hf.head_dim, hf.tie_word_embeddings) == (1, 8, True)
    with pytest.raises(ValueError, match="rope_scaling"):
        llama.LlamaConfig.from_hf({**cfg.to_hf(), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_help_is_fast_and_imports_no_jax():
    probe = (
        "import runpy, sys\n"
        f"sys.argv = [{EXAMPLE!r}, '--help']\n"
        "try:\n"
        f"    runpy.run_path({EXAMPLE!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('JAX_IMPORTED' if 'jax' in sys.modules else 'NO_JAX')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=child_pythonpath(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("NO_JAX"), out.stdout[-2000:]
    for option in ("--safetensors", "--steps", "--batch-size", "--seq-len", "--lr", "--bf16", "--devices", "--save"):
        assert option in out.stdout
    assert "(default: 30)" in out.stdout  # ArgumentDefaultsHelpFormatter shows the defaults


def test_random_checkpoint_layout(finetune, tmp_path):
    from safetensors.numpy import load_file

    config = {**finetune.RANDOM_CONFIG, "num_hidden_layers": 2}
    written = finetune.write_random_checkpoint(str(tmp_path), config, seed=0, num_files=3)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    tensors = {}
    for name in files:
        part = load_file(str(tmp_path / name))
        assert {k for k, f in index["weight_map"].items() if f == name} == set(part)
        tensors.update(part)
    assert index["metadata"]["total_size"] == written == sum(t.nbytes for t in tensors.values())
    d, v, f = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    assert tensors["model.embed_tokens.weight"].shape == (v, d)
    assert tensors["lm_head.weight"].shape == (v, d)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 32, d)  # (out, in)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 32, d)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (d, f)
    np.testing.assert_array_equal(tensors["model.norm.weight"], np.ones(d, np.float32))
    assert json.loads((tmp_path / "config.json").read_text()) == config


SMALL = {
    "vocab_size": 300,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 12,
    "max_position_embeddings": 32,
}


def hf_to_leaf_values(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Hugging Face tensor names -> the NNX model's leaf paths, by hand (independent of ``llama_mapping``):
    ``a.b.weight`` of a linear layer is ``a/b/kernel`` transposed, of the embedding ``.../embedding``."""
    out = {}
    for name, t in tensors.items():
        path = name.removesuffix(".weight").replace(".", "/")
        if name.endswith("norm.weight"):
            out[path + "/weight"] = t
        elif name == "model.embed_tokens.weight":
            out[path + "/embedding"] = t
        else:
            out[path + "/kernel"] = t.T
    return out


@pytest.mark.parametrize(
    "m, tied, dtype",
    [
        pytest.param(8, False, "float32", id="m8-untied", marks=pytest.mark.slow),
        pytest.param(3, False, "float32", id="m3-untied"),
        pytest.param(8, True, "float32", id="m8-tied"),
        pytest.param(3, True, "bfloat16", id="m3-tied-bf16", marks=pytest.mark.slow),
    ],
)
def test_checkpoint_loads_and_sharded_logits_match(finetune, llama, tmp_path, m, tied, dtype):
    from safetensors.numpy import load_file

    config = {**finetune.RANDOM_CONFIG, **SMALL, "tie_word_embeddings": tied, "torch_dtype": dtype}
    finetune.write_random_checkpoint(str(tmp_path), config, seed=m, num_files=3)
    cfg = llama.LlamaConfig.from_json_file(str(tmp_path))
    graphdef, shapes = llama.abstract_model(cfg)
    plan = vj.plan(shapes, make_mesh(m))
    stats: dict = {}
    mapping = vj.checkpoint.llama_mapping(tied=tied)
    sp = vj.checkpoint.load_safetensors(tmp_path, plan, mapping=mapping, stats=stats)  # bf16 files widen to f32
    assert stats["bytes_read"] >= stats["data_bytes"] > 0

    # The reference: the files read whole with the safetensors package, mapped by hand, run unsharded.
    tensors = {}
    for name in os.listdir(tmp_path):
        if name.endswith(".safetensors"):
            tensors.update(load_file(str(tmp_path / name)))
    values = {k: v.astype(np.float32) for k, v in hf_to_leaf_values(tensors).items()}
    ref_params = with_values(shapes, values)
    assert_trees_equal(vj.unshard(sp), ref_params, what="loaded")  # bit for bit

    ids = np.random.default_rng(m).integers(0, cfg.vocab_size, (24, 16)).astype(np.int32)
    want = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))(ref_params, jnp.asarray(ids))
    got = jax.jit(lambda p, x: vj.flax.nnx_apply(graphdef, p, x))(sp, vj.place_batch(ids, plan))
    assert_trees_close(got, want, rtol=1e-5, what="logits")


def test_finetune_end_to_end(finetune, tmp_path):
    from safetensors.numpy import load_file

    out, log, random_dir = tmp_path / "out", tmp_path / "log.json", tmp_path / "random"
    argv = ["--steps", "6", "--batch-size", "8", "--seq-len", "32", "--devices", "4", "--random-layers", "2"]
    argv += ["--random-dir", str(random_dir), "--save", str(out), "--log-json", str(log)]
    proc = subprocess.run([sys.executable, EXAMPLE, *argv], env=child_pythonpath(), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in ("wrote a random Llama checkpoint", "on 4 cpu devices", "loaded ", "compiling the train step…"):
        assert line in proc.stdout, proc.stdout[-3000:]
    assert "units: one per repeated layer of model/layers/0..1" in proc.stdout  # the plan summary

    result = json.loads(log.read_text())
    losses = [result["train"][str(i)] for i in range(1, 7)]
    assert losses[-1] < losses[0] - 0.3, losses
    assert result["bytes_read"] > 0 and result["devices"] == 4

    config = {**finetune.RANDOM_CONFIG, "num_hidden_layers": 2}
    assert json.loads((out / "config.json").read_text()) == config
    saved = {}
    for name in os.listdir(out):
        if name.endswith(".safetensors"):
            saved.update(load_file(str(out / name)))
    assert {k: v.shape for k, v in saved.items()} == finetune.hf_shapes(config)
    assert all(v.dtype == np.float32 for v in saved.values())
    start = load_file(str(random_dir / "model-00001-of-00003.safetensors"))["model.embed_tokens.weight"]
    assert not np.array_equal(saved["model.embed_tokens.weight"], start)  # fine-tuned, not copied
