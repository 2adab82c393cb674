"""vj.checkpoint.load_safetensors / save_safetensors: Hugging Face files in and out, checked against transformers.

Checkpoints are written with ``safetensors.numpy.save_file`` under the names and shapes transformers' PyTorch
``save_pretrained`` uses (read from its ``modeling_llama.py`` / ``modeling_gpt2.py``); the reference trees come
from transformers' own ``convert_pytorch_state_dict_to_flax`` and ``Flax*.from_pretrained`` (numpy, no torch).
"""

from __future__ import annotations

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from helpers import assert_trees_equal
from safetensors.numpy import load_file, save_file

import vescale_jax as vj
from vescale_jax.checkpoint import Entry, Mapping, MergeDims, Split, SplitDim, Transpose, gpt2_mapping, llama_mapping
from vescale_jax.checkpoint import _safetensors_files as files

LLAMA = dict(
    vocab_size=40,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
GPT2 = dict(vocab_size=40, n_embd=16, n_layer=2, n_head=4, n_positions=24)


def llama_tensors(seed=0, *, layers=2, h=16, i=24, v=40, kv=8, dtype=np.float32, bias=False):
    """A LlamaForCausalLM state dict as save_pretrained writes it (nn.Linear weights (out, in))."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s, np.float32).astype(dtype)
    t = {"model.embed_tokens.weight": r(v, h), "model.norm.weight": r(h), "lm_head.weight": r(v, h)}
    for j in range(layers):
        p = f"model.layers.{j}."
        for name, shape in (("q_proj", (h, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)), ("o_proj", (h, h))):
            t[p + f"self_attn.{name}.weight"] = r(*shape)
            if bias and name != "o_proj":  # Qwen2
                t[p + f"self_attn.{name}.bias"] = r(shape[0])
        t |= {
            p + "mlp.gate_proj.weight": r(i, h),
            p + "mlp.up_proj.weight": r(i, h),
            p + "mlp.down_proj.weight": r(h, i),
        }
        t |= {p + "input_layernorm.weight": r(h), p + "post_attention_layernorm.weight": r(h)}
    return t


def gpt2_tensors(seed=0, *, layers=2, h=16, v=40, n=24, prefix="transformer."):
    """A GPT2LMHeadModel state dict as save_pretrained writes it (Conv1D weights (in, out), lm_head tied)."""
    rng = np.random.default_rng(seed)
    r = lambda *s: rng.standard_normal(s, np.float32)
    t = {f"{prefix}wte.weight": r(v, h), f"{prefix}wpe.weight": r(n, h)}
    t |= {f"{prefix}ln_f.weight": r(h), f"{prefix}ln_f.bias": r(h)}
    for j in range(layers):
        p = f"{prefix}h.{j}."
        for ln in ("ln_1", "ln_2"):
            t |= {p + f"{ln}.weight": r(h), p + f"{ln}.bias": r(h)}
        for conv, (a, b) in (("attn.c_attn", (h, 3 * h)), ("attn.c_proj", (h, h)), ("mlp.c_fc", (h, 4 * h))):
            t |= {p + f"{conv}.weight": r(a, b), p + f"{conv}.bias": r(b)}
        t |= {p + "mlp.c_proj.weight": r(4 * h, h), p + "mlp.c_proj.bias": r(h)}
    return t


def write_checkpoint(tensors, directory, *, num_files=3):
    """Several files and an index, as save_pretrained shards them (safetensors.numpy writes each file)."""
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    if num_files == 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return str(directory)
    weight_map = {}
    for k in range(num_files):
        fname = f"model-{k + 1:05d}-of-{num_files:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::num_files]}
        save_file(part, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fname)
    total = sum(x.nbytes for x in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return str(directory)


def read_all(directory):
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out |= load_file(os.path.join(directory, name))
    return out


@pytest.fixture(scope="module")
def hf():
    from transformers import GPT2Config, LlamaConfig
    from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax
    from transformers.models.gpt2.modeling_flax_gpt2 import FlaxGPT2LMHeadModel
    from transformers.models.llama.modeling_flax_llama import FlaxLlamaForCausalLM

    llama_cfg, gpt2_cfg = LlamaConfig(**LLAMA), GPT2Config(**GPT2)
    # _do_init=False: the models' parameter shapes by jax.eval_shape, no init compiled (seconds saved per model)
    with jax.numpy_dtype_promotion("standard"):  # transformers' Flax models need implicit promotion
        llama = FlaxLlamaForCausalLM(llama_cfg, _do_init=False)
        gpt2 = FlaxGPT2LMHeadModel(gpt2_cfg, _do_init=False)

    def convert(tensors, model):
        # convert_pytorch_state_dict_to_flax reads only the model's prefix and its params' shapes
        shim = types.SimpleNamespace(base_model_prefix=model.base_model_prefix, params=model.params_shape_tree)
        return convert_pytorch_state_dict_to_flax({k: np.array(v) for k, v in tensors.items()}, shim)

    return dict(
        llama=llama,
        gpt2=gpt2,
        llama_cfg=llama_cfg,
        gpt2_cfg=gpt2_cfg,
        convert=convert,
        Llama=FlaxLlamaForCausalLM,
        GPT2=FlaxGPT2LMHeadModel,
    )


def shapes_of(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def assert_sharded_equal(got, want):
    for a, b, bucket in zip(got.buffers, want.buffers, got.plan.buckets, strict=True):
        assert a.sharding == b.sharding, bucket.name
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), bucket.name


# --- Llama ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,gran", [(8, "element"), (3, "rows4")])
def test_llama_loads_as_transformers_converts(tmp_path, hf, m, gran):
    tensors = llama_tensors()
    path = write_checkpoint(tensors, tmp_path / "ckpt", num_files=3)
    want = hf["convert"](tensors, hf["llama"])
    granularity = vj.element() if gran == "element" else vj.rows(4)
    plan = vj.plan(shapes_of(want), make_mesh(m), granularity=granularity)
    stats = {}
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping(), stats=stats)
    assert_trees_equal(vj.unshard(sp), want)
    assert_sharded_equal(sp, vj.shard(want, plan))
    assert stats["data_bytes"] == sum(x.nbytes for x in tensors.values())


def test_llama_save_round_trip_and_transformers_reads_it(tmp_path, hf):
    tensors = llama_tensors(1)
    want = hf["convert"](tensors, hf["llama"])
    plan = vj.plan(shapes_of(want), make_mesh(3), granularity=vj.rows(2))
    sp = vj.checkpoint.load_safetensors(write_checkpoint(tensors, tmp_path / "in"), plan, mapping=llama_mapping())
    # several files, as save_pretrained shards them
    written = vj.checkpoint.save_safetensors(sp, tmp_path / "out", mapping=llama_mapping(), max_shard_size="6KB")
    assert written[-1].endswith("model.safetensors.index.json") and len(written) > 3
    index = json.load(open(written[-1]))
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(x.nbytes for x in tensors.values())
    got = read_all(tmp_path / "out")
    assert sorted(got) == sorted(tensors)
    for k, x in tensors.items():
        assert got[k].dtype == x.dtype and got[k].tobytes() == x.tobytes(), k
    assert_sharded_equal(vj.checkpoint.load_safetensors(tmp_path / "out", plan, mapping=llama_mapping()), sp)
    # one file: transformers' own Flax loader reads it
    vj.checkpoint.save_safetensors(sp, tmp_path / "one", mapping=llama_mapping())
    assert sorted(os.listdir(tmp_path / "one")) == ["model.safetensors"]
    hf["llama_cfg"].save_pretrained(tmp_path / "one")
    with jax.numpy_dtype_promotion("standard"):
        model = hf["Llama"].from_pretrained(str(tmp_path / "one"))  # PT-format files need _do_init=True
    assert_trees_equal(model.params, want)


def test_llama_writer_matches_the_safetensors_library_byte_for_byte(tmp_path):
    tensors = llama_tensors(2) | {"extra.bf16": np.arange(6, dtype=np.float32).astype(jnp.bfloat16)}
    tensors |= {"extra.i8": np.arange(3, dtype=np.int8), "extra.empty": np.zeros((0, 3), np.float16)}
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    (layout,), index = files.layout_files([(n, x.dtype, x.shape) for n, x in tensors.items()], max_shard_size=10**9)
    assert index is None and layout.name == "model.safetensors"
    ours = bytearray(layout.size)
    ours[: len(layout.header)] = layout.header
    for n, x in tensors.items():
        ours[layout.offsets[n] : layout.offsets[n] + x.nbytes] = x.tobytes()
    assert bytes(ours) == (tmp_path / "ref.safetensors").read_bytes()


def test_qwen2_biases_and_bf16_files_widen_to_f32(tmp_path):
    tensors = {k: v.astype(jnp.bfloat16) for k, v in llama_tensors(3, bias=True).items()}
    tensors["model.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # a buffer old checkpoints hold: ignored
    path = write_checkpoint(tensors, tmp_path / "q", num_files=2)
    tree = {"lm_head": {"kernel": tensors["lm_head.weight"].T.astype(np.float32)}, "model": {}}
    for name, x in tensors.items():
        if name.startswith("model.layers.") or name in ("model.embed_tokens.weight", "model.norm.weight"):
            parts = name.split(".")[1:]
            leaf = {"weight": "kernel" if x.ndim == 2 and "embed" not in name else "weight", "bias": "bias"}[parts[-1]]
            leaf = "embedding" if "embed_tokens" in name else leaf
            node = tree["model"]
            for p in parts[:-1]:
                node = node.setdefault(p, {})
            node[leaf] = (x.T if leaf == "kernel" else x).astype(np.float32)
    plan = vj.plan(shapes_of(tree), make_mesh(3))
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())
    assert_trees_equal(vj.unshard(sp), tree)
    # narrowing back to bf16 on save needs cast="any"
    with pytest.raises(ValueError, match="cast='any'"):
        vj.checkpoint.save_safetensors(sp, tmp_path / "o", mapping=llama_mapping(), dtype=jnp.bfloat16)
    vj.checkpoint.save_safetensors(sp, tmp_path / "o", mapping=llama_mapping(), dtype=jnp.bfloat16, cast="any")
    got = read_all(tmp_path / "o")
    for k, x in tensors.items():
        if "inv_freq" not in k:
            assert got[k].dtype == x.dtype and got[k].tobytes() == x.tobytes(), k


def test_stacked_llama_layers(tmp_path):
    tensors = llama_tensors(4, layers=3)
    path = write_checkpoint(tensors, tmp_path / "s", num_files=2)
    stack = lambda name, tr=True: np.stack(
        [(tensors[name.format(j)].T if tr else tensors[name.format(j)]) for j in range(3)]
    )
    layers = {
        "self_attn": {
            k: {"kernel": stack(f"model.layers.{{}}.self_attn.{k}.weight")}
            for k in ("q_proj", "k_proj", "v_proj", "o_proj")
        },
        "mlp": {
            k: {"kernel": stack(f"model.layers.{{}}.mlp.{k}.weight")} for k in ("gate_proj", "up_proj", "down_proj")
        },
        "input_layernorm": {"weight": stack("model.layers.{}.input_layernorm.weight", False)},
        "post_attention_layernorm": {"weight": stack("model.layers.{}.post_attention_layernorm.weight", False)},
    }
    tree = {
        "lm_head": {"kernel": tensors["lm_head.weight"].T},
        "model": {
            "embed_tokens": {"embedding": tensors["model.embed_tokens.weight"]},
            "norm": {"weight": tensors["model.norm.weight"]},
            "layers": layers,
        },
    }
    units = lambda path, leaf: "layers" if vj.plan_path(path).startswith("model/layers") else "rest"
    plan = vj.plan(shapes_of(tree), make_mesh(3), units=units, stacked=("layers",), granularity=vj.rows(1))
    assert any(b.layers == 3 for b in plan.buckets)
    mapping = llama_mapping(stacked=True)
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=mapping)
    assert_trees_equal(vj.unshard(sp), tree)
    assert_sharded_equal(sp, vj.shard(tree, plan))
    vj.checkpoint.save_safetensors(sp, tmp_path / "o", mapping=mapping)
    got = read_all(tmp_path / "o")
    assert sorted(got) == sorted(tensors) and all(got[k].tobytes() == x.tobytes() for k, x in tensors.items())


def test_hsdp_mesh_loads_and_saves(tmp_path):
    tensors = llama_tensors(5)
    path = write_checkpoint(tensors, tmp_path / "h", num_files=1)
    mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])
    ref = vj.plan(shapes_of(_flax_llama(tensors)), make_mesh(4))
    plan = vj.plan(shapes_of(_flax_llama(tensors)), mesh)
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=llama_mapping())
    assert_trees_equal(vj.unshard(sp), vj.unshard(vj.checkpoint.load_safetensors(path, ref, mapping=llama_mapping())))
    assert_sharded_equal(sp, vj.shard(_flax_llama(tensors), plan))
    vj.checkpoint.save_safetensors(sp, tmp_path / "o", mapping=llama_mapping())
    assert (tmp_path / "o" / "model.safetensors").read_bytes() == (tmp_path / "h" / "model.safetensors").read_bytes()


def _flax_llama(tensors, layers=2):
    """The FlaxLlamaForCausalLM tree of a Llama state dict, by hand (a reference independent of the mapping)."""
    lay = {}
    for j in range(layers):
        p = f"model.layers.{j}."
        lay[str(j)] = {
            "self_attn": {
                k: {"kernel": tensors[p + f"self_attn.{k}.weight"].T} for k in ("q_proj", "k_proj", "v_proj", "o_proj")
            },
            "mlp": {k: {"kernel": tensors[p + f"mlp.{k}.weight"].T} for k in ("gate_proj", "up_proj", "down_proj")},
            "input_layernorm": {"weight": tensors[p + "input_layernorm.weight"]},
            "post_attention_layernorm": {"weight": tensors[p + "post_attention_layernorm.weight"]},
        }
    return {
        "lm_head": {"kernel": tensors["lm_head.weight"].T},
        "model": {
            "embed_tokens": {"embedding": tensors["model.embed_tokens.weight"]},
            "norm": {"weight": tensors["model.norm.weight"]},
            "layers": lay,
        },
    }


def test_tile_major_buckets_load_and_save_bit_for_bit(tmp_path):
    rng = np.random.default_rng(6)
    t = {"w.weight": rng.standard_normal((10, 6), np.float32), "w.bias": rng.standard_normal(5, np.float32)}
    t["e.weight"] = rng.standard_normal((7, 9), np.float32).astype(jnp.bfloat16)
    path = write_checkpoint(t, tmp_path / "t", num_files=2)
    mapping = Mapping(
        (Entry("w/kernel", "w.weight", (Transpose(),)), Entry("w/bias", "w.bias"), Entry("e", "e.weight"))
    )
    tree = {"w": {"kernel": t["w.weight"].T, "bias": t["w.bias"]}, "e": t["e.weight"]}
    plan = vj.plan(shapes_of(tree), make_mesh(3), granularity=vj.tiles(4, 4))
    assert all(any(g is not None for g in b.storage) for b in plan.buckets)
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=mapping)
    assert_sharded_equal(sp, vj.shard(tree, plan))
    vj.checkpoint.save_safetensors(sp, tmp_path / "o", mapping=mapping)
    got = read_all(tmp_path / "o")
    assert sorted(got) == sorted(t) and all(got[k].tobytes() == x.tobytes() for k, x in t.items())


# --- GPT-2 ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,gran", [(8, "element"), (3, "rows4")])
def test_gpt2_loads_as_transformers_converts(tmp_path, hf, m, gran):
    tensors = gpt2_tensors()
    path = write_checkpoint(tensors, tmp_path / "g", num_files=2)
    want = hf["convert"](tensors, hf["gpt2"])
    plan = vj.plan(shapes_of(want), make_mesh(m), granularity=vj.element() if gran == "element" else vj.rows(4))
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=gpt2_mapping())
    assert_trees_equal(vj.unshard(sp), want)
    assert_sharded_equal(sp, vj.shard(want, plan))


def test_gpt2_save_round_trip_and_transformers_reads_it(tmp_path, hf):
    tensors = gpt2_tensors(1)
    want = hf["convert"](tensors, hf["gpt2"])
    plan = vj.plan(shapes_of(want), make_mesh(3))
    sp = vj.shard(want, plan)
    vj.checkpoint.save_safetensors(sp, tmp_path / "many", mapping=gpt2_mapping(), max_shard_size=4000)
    got = read_all(tmp_path / "many")
    assert sorted(got) == sorted(tensors)  # the tied lm_head is not written
    assert all(got[k].tobytes() == x.tobytes() for k, x in tensors.items())
    assert_sharded_equal(vj.checkpoint.load_safetensors(tmp_path / "many", plan, mapping=gpt2_mapping()), sp)
    vj.checkpoint.save_safetensors(sp, tmp_path / "one", mapping=gpt2_mapping())
    hf["gpt2_cfg"].save_pretrained(tmp_path / "one")
    with jax.numpy_dtype_promotion("standard"):
        model = hf["GPT2"].from_pretrained(str(tmp_path / "one"))  # PT-format files need _do_init=True
    assert_trees_equal(model.params, want)


def test_gpt2_bare_model_prefix_and_old_buffers(tmp_path, hf):
    tensors = gpt2_tensors(2, prefix="")
    buffers = {"h.0.attn.bias": np.ones((1, 1, 4, 4), np.float32), "h.0.attn.masked_bias": np.ones((), np.float32)}
    path = write_checkpoint(tensors | buffers, tmp_path / "b", num_files=1)
    want = hf["convert"](gpt2_tensors(2), hf["gpt2"])
    plan = vj.plan(shapes_of(want), make_mesh(2))
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=gpt2_mapping(prefix=""))
    assert_trees_equal(vj.unshard(sp), want)


# --- Writing your own mapping -----------------------------------------------------------------------------------


def test_custom_ops_fused_qkv_heads_and_concat(tmp_path):
    """GPT-2-style fused qkv split into q / k / v leaves shaped (heads, head_dim, in); an up/gate pair concatenated
    into one leaf; a transpose of a 3-D tensor."""
    rng = np.random.default_rng(7)
    H, nh, hd = 8, 2, 4
    t = {
        "qkv.weight": rng.standard_normal((3 * H, H), np.float32),  # (3 * heads * head_dim, in)
        "up.weight": rng.standard_normal((6, H), np.float32),
        "gate.weight": rng.standard_normal((6, H), np.float32),
        "cube": rng.standard_normal((2, 3, 5), np.float32),
    }
    path = write_checkpoint(t, tmp_path / "c", num_files=1)
    mapping = Mapping(
        (
            *(Entry(f"attn/{x}", "qkv.weight", (Split(0, j, 3), SplitDim(0, (nh, -1)))) for j, x in enumerate("qkv")),
            Entry("mlp/wi", ("gate.weight", "up.weight"), (Transpose(),), axis=0),
            Entry("cube", "cube", (Transpose((2, 0, 1)), MergeDims(1, (2, 3)))),
        )
    )
    qkv = t["qkv.weight"].reshape(3, nh, hd, H)
    tree = {
        "attn": {x: qkv[j] for j, x in enumerate("qkv")},
        "mlp": {"wi": np.concatenate([t["gate.weight"], t["up.weight"]]).T},
        "cube": t["cube"].transpose(2, 0, 1).reshape(5, 6),
    }
    plan = vj.plan(shapes_of(tree), make_mesh(3))
    sp = vj.checkpoint.load_safetensors(path, plan, mapping=mapping)
    assert_trees_equal(vj.unshard(sp), tree)
    vj.checkpoint.save_safetensors(sp, tmp_path / "o", mapping=mapping)
    got = read_all(tmp_path / "o")
    assert sorted(got) == sorted(t) and all(got[k].tobytes() == x.tobytes() for k, x in t.items())


def test_max_shard_size_units():
    assert files.parse_size("5GB") == 5 * 10**9 and files.parse_size("500MB") == 500 * 10**6
    assert files.parse_size("2GiB") == 2 * 2**30 and files.parse_size(1234) == 1234
    with pytest.raises(ValueError, match="max_shard_size"):
        files.parse_size("5 parsecs")
