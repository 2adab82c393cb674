"""Parameter shapes of four public LLMs, bucketed per transformer layer.

Shapes are derived from the numbers in each model's public Hugging Face ``config.json`` and follow
the PyTorch/HF checkpoint orientation: a Linear weight is ``(out_features, in_features)``. Parameters
that HF stores stacked (GPT-OSS experts) keep their stacked checkpoint shape.

Each model yields a list of buckets ``(name, [(param_name, shape), ...])``: ``"embed"``, one
``"layers.{i}"`` per transformer layer (listed separately even when shapes repeat), ``"final_norm"``
and ``"lm_head"``.

Run ``python benchmarks/model_configs.py`` to print bucket counts and parameter totals.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Shape = tuple[int, ...]
Param = tuple[str, Shape]
Bucket = tuple[str, list[Param]]

# meta-llama/Meta-Llama-3-8B config.json
LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,  # hidden_size // num_attention_heads (not an explicit config key)
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}

# meta-llama/Meta-Llama-3-70B config.json
LLAMA3_70B = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,  # hidden_size // num_attention_heads (not an explicit config key)
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}

# deepseek-ai/DeepSeek-V3 config.json
DEEPSEEK_V3 = {
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 3,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "num_nextn_predict_layers": 1,  # MTP module: excluded below (not part of the 671B figure)
    "tie_word_embeddings": False,
}

# openai/gpt-oss-120b config.json
GPT_OSS_120B = {
    "hidden_size": 2880,
    "intermediate_size": 2880,  # per-expert FFN width
    "num_hidden_layers": 36,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "tie_word_embeddings": False,
}


def _numel(shape: Shape) -> int:
    return math.prod(shape)


def _mlp(prefix: str, hidden: int, inter: int) -> list[Param]:
    """SwiGLU MLP with separate gate/up/down projections (Llama / DeepSeek layout)."""
    return [
        (f"{prefix}.gate_proj.weight", (inter, hidden)),
        (f"{prefix}.up_proj.weight", (inter, hidden)),
        (f"{prefix}.down_proj.weight", (hidden, inter)),
    ]


def _edge_buckets(vocab: int, hidden: int, layers: list[Bucket]) -> list[Bucket]:
    """Wrap per-layer buckets with embedding, final norm and (untied) output head buckets."""
    return [
        ("embed", [("model.embed_tokens.weight", (vocab, hidden))]),
        *layers,
        ("final_norm", [("model.norm.weight", (hidden,))]),
        ("lm_head", [("lm_head.weight", (vocab, hidden))]),
    ]


def llama3_8b() -> list[Bucket]:
    return _llama3(LLAMA3_8B)


def llama3_70b() -> list[Bucket]:
    return _llama3(LLAMA3_70B)


def _llama3(c: dict) -> list[Bucket]:
    h, hd = c["hidden_size"], c["head_dim"]
    q_dim, kv_dim = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layers: list[Bucket] = []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        params: list[Param] = [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (q_dim, h)),
            (f"{p}.self_attn.k_proj.weight", (kv_dim, h)),
            (f"{p}.self_attn.v_proj.weight", (kv_dim, h)),
            (f"{p}.self_attn.o_proj.weight", (h, q_dim)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            *_mlp(f"{p}.mlp", h, c["intermediate_size"]),
        ]
        layers.append((f"layers.{i}", params))
    return _edge_buckets(c["vocab_size"], h, layers)


def deepseek_v3() -> list[Bucket]:
    # The MTP layer (num_nextn_predict_layers=1, checkpoint layer 61, ~14B params) is excluded.
    c = DEEPSEEK_V3
    h, nh = c["hidden_size"], c["num_attention_heads"]
    q_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    kv_lora, rope = c["kv_lora_rank"], c["qk_rope_head_dim"]
    moe_inter, n_exp = c["moe_intermediate_size"], c["n_routed_experts"]
    layers: list[Bucket] = []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        params: list[Param] = [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{a}.q_a_proj.weight", (c["q_lora_rank"], h)),
            (f"{a}.q_a_layernorm.weight", (c["q_lora_rank"],)),
            (f"{a}.q_b_proj.weight", (nh * q_head, c["q_lora_rank"])),
            (f"{a}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h)),
            (f"{a}.kv_a_layernorm.weight", (kv_lora,)),
            (f"{a}.kv_b_proj.weight", (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), kv_lora)),
            (f"{a}.o_proj.weight", (h, nh * c["v_head_dim"])),
            (f"{p}.post_attention_layernorm.weight", (h,)),
        ]
        if i < c["first_k_dense_replace"]:
            params += _mlp(f"{p}.mlp", h, c["intermediate_size"])
        else:
            params += [
                (f"{p}.mlp.gate.weight", (n_exp, h)),
                (f"{p}.mlp.gate.e_score_correction_bias", (n_exp,)),
            ]
            for e in range(n_exp):
                params += _mlp(f"{p}.mlp.experts.{e}", h, moe_inter)
            params += _mlp(f"{p}.mlp.shared_experts", h, moe_inter * c["n_shared_experts"])
        layers.append((f"layers.{i}", params))
    return _edge_buckets(c["vocab_size"], h, layers)


def gpt_oss_120b() -> list[Bucket]:
    c = GPT_OSS_120B
    h, hd, ne, inter = c["hidden_size"], c["head_dim"], c["num_local_experts"], c["intermediate_size"]
    nh = c["num_attention_heads"]
    q_dim, kv_dim = nh * hd, c["num_key_value_heads"] * hd
    layers: list[Bucket] = []
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a, m = f"{p}.self_attn", f"{p}.mlp"
        params: list[Param] = [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{a}.q_proj.weight", (q_dim, h)),
            (f"{a}.q_proj.bias", (q_dim,)),
            (f"{a}.k_proj.weight", (kv_dim, h)),
            (f"{a}.k_proj.bias", (kv_dim,)),
            (f"{a}.v_proj.weight", (kv_dim, h)),
            (f"{a}.v_proj.bias", (kv_dim,)),
            (f"{a}.o_proj.weight", (h, q_dim)),
            (f"{a}.o_proj.bias", (h,)),
            (f"{a}.sinks", (nh,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{m}.router.weight", (ne, h)),
            (f"{m}.router.bias", (ne,)),
            # Stacked experts, HF layout (num_experts, in, out): not the Linear (out, in) convention.
            (f"{m}.experts.gate_up_proj", (ne, h, 2 * inter)),
            (f"{m}.experts.gate_up_proj_bias", (ne, 2 * inter)),
            (f"{m}.experts.down_proj", (ne, inter, h)),
            (f"{m}.experts.down_proj_bias", (ne, h)),
        ]
        layers.append((f"layers.{i}", params))
    return _edge_buckets(c["vocab_size"], h, layers)


MODELS: dict[str, Callable[[], list[Bucket]]] = {
    "llama3-8b": llama3_8b,
    "llama3-70b": llama3_70b,
    "deepseek-v3": deepseek_v3,
    "gpt-oss-120b": gpt_oss_120b,
}


def buckets(model: str) -> list[Bucket]:
    """Return the parameter buckets of ``model`` (a key of :data:`MODELS`)."""
    if model not in MODELS:
        raise KeyError(f"unknown model {model!r}; choose from {sorted(MODELS)}")
    return MODELS[model]()


def bucket_numel(bucket: Bucket) -> int:
    """Total number of elements in one bucket."""
    return sum(_numel(shape) for _, shape in bucket[1])


def num_params(model: str) -> int:
    """Total parameter count of ``model``."""
    return sum(bucket_numel(b) for b in buckets(model))


if __name__ == "__main__":
    for name in MODELS:
        bs = buckets(name)
        total = sum(bucket_numel(b) for b in bs)
        largest = max(bs, key=bucket_numel)
        print(
            f"{name:>14}: {len(bs):3d} buckets, {total / 1e9:8.3f}B params, "
            f"largest bucket {largest[0]!r} = {bucket_numel(largest) / 1e9:.3f}B "
            f"({len(largest[1])} tensors)"
        )
