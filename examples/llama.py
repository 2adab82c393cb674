"""A Llama in Flax NNX whose parameters are named exactly like Hugging Face's ``FlaxLlamaForCausalLM``.

RMSNorm computed in float32, rotary embeddings in Hugging Face's ``rotate_half`` convention, grouped-query
attention, a SwiGLU MLP, a tied or untied head; Qwen2-style q/k/v biases with ``attention_bias=True``. The
parameter tree (``nnx.state(model, nnx.Param)``) has the key paths and shapes of ``FlaxLlamaForCausalLM.params``
(``model/embed_tokens/embedding``, ``model/layers/{i}/self_attn/q_proj/kernel``, ..., ``lm_head/kernel``; no
``lm_head`` when the embedding is tied), so ``vj.checkpoint.llama_mapping`` loads Hugging Face files into either.

The layers are separate modules (``model/layers/0``, ``model/layers/1``, ...), looped in Python: under
``vj.fsdp`` each is its own unit, gathered at its point of use. Shapes in names: B batch, T time, D model width,
N query heads, G key/value heads, R query heads per key/value head, K head width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face ``LlamaConfig`` this model reads (``config.json``'s names and defaults)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: as many as the query heads (no grouping)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o biases (Qwen2 has them on q/k/v only: see qkv_bias_only)
    qkv_bias_only: bool = False  # with attention_bias: o_proj without bias (Qwen2)
    initializer_range: float = 0.02
    dtype: str | None = None  # compute dtype; None: the parameters' (or the gathered ones' under vj.fsdp)
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def kv_heads(self) -> int:
        """``num_key_value_heads`` as an int (resolved in ``__post_init__``)."""
        assert self.num_key_value_heads is not None
        return self.num_key_value_heads

    @property
    def head_width(self) -> int:
        """Width of one attention head."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: dict[str, Any], **overrides: Any) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (Llama, Mistral without sliding window, Qwen2).

        Keys this model does not read are ignored; a feature it does not implement (``rope_scaling``, an
        activation other than SiLU) raises rather than computing something else. ``overrides`` replace fields
        (e.g. ``param_dtype="bfloat16"``).
        """
        if config.get("rope_scaling"):
            raise ValueError(f"LlamaConfig.from_hf: rope_scaling={config['rope_scaling']!r} is not implemented")
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"LlamaConfig.from_hf: hidden_act={act!r} is not implemented (only SiLU)")
        qwen2 = config.get("model_type") == "qwen2"
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in config.items() if k in fields and k not in ("dtype", "param_dtype")}
        if qwen2:  # Qwen2: q/k/v biases, none on o_proj (its config.json does not say so)
            kw.update(attention_bias=True, qkv_bias_only=True)
        return cls(**{**kw, **overrides})

    @classmethod
    def from_json_file(cls, path: str, **overrides: Any) -> LlamaConfig:
        """From a ``config.json`` file, or the directory holding one."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_hf(json.load(f), **overrides)

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers.LlamaConfig`` (and this class) reads back."""
        out = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "torch_dtype": self.param_dtype,
        }
        skip = ("dtype", "param_dtype", "qkv_bias_only")
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip})
        if out["head_dim"] is None:
            out["head_dim"] = self.head_width
        return out


class RMSNorm(nnx.Module):
    """Root-mean-square norm, computed in float32 and cast back before the scale (as Hugging Face's Llama)."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any = jnp.float32):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x32 = x_BxTxD.astype(jnp.float32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 / jnp.sqrt(variance + self.eps)).astype(x_BxTxD.dtype)
        return self.weight[...].astype(x_BxTxD.dtype) * normed


@functools.lru_cache(maxsize=16)
def rope_table(max_positions: int, head_width: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``(sin, cos)``, each ``(max_positions, head_width)`` float32: the angles of position p in both halves,
    as Hugging Face computes them (frequencies in float64, angles rounded to float32)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_width, 2) / head_width))
    freqs = np.einsum("i,j->ij", np.arange(max_positions), inv_freq).astype(np.float32)
    angles = np.concatenate([freqs, freqs], axis=-1)
    return np.sin(angles), np.cos(angles)


def rotate_half(x: jax.Array) -> jax.Array:
    """``[x1, x2] -> [-x2, x1]`` over the last dim: Hugging Face's rotary convention (halves, not pairs)."""
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x_BxTxNxK: jax.Array, sin_BxTxK: jax.Array, cos_BxTxK: jax.Array) -> jax.Array:
    """Rotate queries or keys by their positions' angles."""
    sin, cos = (a[:, :, None, :].astype(x_BxTxNxK.dtype) for a in (sin_BxTxK, cos_BxTxK))
    return x_BxTxNxK * cos + rotate_half(x_BxTxNxK) * sin


class Attention(nnx.Module):
    """Causal grouped-query self-attention with rotary embeddings; softmax in float32."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, n, g, k = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.head_width
        self.num_heads, self.num_kv_heads, self.head_width = n, g, k
        linear = functools.partial(
            nnx.Linear,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nnx.initializers.normal(cfg.initializer_range),
            rngs=rngs,
        )
        self.q_proj = linear(d, n * k, use_bias=cfg.attention_bias)
        self.k_proj = linear(d, g * k, use_bias=cfg.attention_bias)
        self.v_proj = linear(d, g * k, use_bias=cfg.attention_bias)
        self.o_proj = linear(n * k, d, use_bias=cfg.attention_bias and not cfg.qkv_bias_only)

    def __call__(self, x_BxTxD: jax.Array, sin_BxTxK: jax.Array, cos_BxTxK: jax.Array) -> jax.Array:
        b, t, _ = x_BxTxD.shape
        n, g, k = self.num_heads, self.num_kv_heads, self.head_width
        q_BxTxNxK = apply_rope(self.q_proj(x_BxTxD).reshape(b, t, n, k), sin_BxTxK, cos_BxTxK)
        k_BxTxGxK = apply_rope(self.k_proj(x_BxTxD).reshape(b, t, g, k), sin_BxTxK, cos_BxTxK)
        v_BxTxGxK = self.v_proj(x_BxTxD).reshape(b, t, g, k)
        # Query head h reads key/value head h // R (Hugging Face's repeat_kv), without repeating the keys.
        q_BxTxGxRxK = q_BxTxNxK.reshape(b, t, g, n // g, k) / jnp.sqrt(jnp.asarray(k, q_BxTxNxK.dtype))
        scores_BxGxRxTxT = jnp.einsum("bqgrk,bsgk->bgrqs", q_BxTxGxRxK, k_BxTxGxK).astype(jnp.float32)
        causal_TxT = jnp.tril(jnp.ones((t, t), bool))
        scores_BxGxRxTxT = jnp.where(causal_TxT, scores_BxGxRxTxT, jnp.finfo(jnp.float32).min)
        probs_BxGxRxTxT = jax.nn.softmax(scores_BxGxRxTxT, axis=-1).astype(v_BxTxGxK.dtype)
        out_BxTxGxRxK = jnp.einsum("bgrqs,bsgk->bqgrk", probs_BxGxRxTxT, v_BxTxGxK)
        return self.o_proj(out_BxTxGxRxK.reshape(b, t, n * k))


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        linear = functools.partial(
            nnx.Linear,
            use_bias=False,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            kernel_init=nnx.initializers.normal(cfg.initializer_range),
            rngs=rngs,
        )
        self.gate_proj = linear(d, f)
        self.up_proj = linear(d, f)
        self.down_proj = linear(f, d)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x_BxTxD)) * self.up_proj(x_BxTxD))


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array, sin_BxTxK: jax.Array, cos_BxTxK: jax.Array) -> jax.Array:
        x_BxTxD = x_BxTxD + self.self_attn(self.input_layernorm(x_BxTxD), sin_BxTxK, cos_BxTxK)
        return x_BxTxD + self.mlp(self.post_attention_layernorm(x_BxTxD))


class LlamaModel(nnx.Module):
    """Embedding, the decoder layers (``layers/0``, ``layers/1``, ...) and the final norm."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed_tokens = nnx.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            embedding_init=nnx.initializers.normal(cfg.initializer_range),
            rngs=rngs,
        )
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=cfg.param_dtype)

    def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        sin_PxK, cos_PxK = rope_table(cfg.max_position_embeddings, cfg.head_width, float(cfg.rope_theta))
        if positions_BxT is None:  # 0, 1, ..., T-1 for every row: a constant slice of the table
            t = tokens_BxT.shape[1]
            sin_BxTxK, cos_BxTxK = jnp.asarray(sin_PxK[None, :t]), jnp.asarray(cos_PxK[None, :t])
        else:
            sin_BxTxK, cos_BxTxK = jnp.asarray(sin_PxK)[positions_BxT], jnp.asarray(cos_PxK)[positions_BxT]
        x_BxTxD = self.embed_tokens(tokens_BxT)
        for layer in self.layers:
            x_BxTxD = layer(x_BxTxD, sin_BxTxK, cos_BxTxK)
        return self.norm(x_BxTxD)


class LlamaForCausalLM(nnx.Module):
    """``model`` (a :class:`LlamaModel`) and ``lm_head``, or the embedding's transpose when tied."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = LlamaModel(cfg, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                cfg.hidden_size,
                cfg.vocab_size,
                use_bias=False,
                dtype=cfg.dtype,
                param_dtype=cfg.param_dtype,
                kernel_init=nnx.initializers.normal(cfg.initializer_range),
                rngs=rngs,
            )

    def __call__(self, tokens_BxT: jax.Array, positions_BxT: jax.Array | None = None) -> jax.Array:
        """Logits ``(B, T, V)`` of the next token at every position."""
        h_BxTxD = self.model(tokens_BxT, positions_BxT)
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.attend(h_BxTxD)
        return self.lm_head(h_BxTxD)


def abstract_model(cfg: LlamaConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, param shapes)`` without allocating: the input of ``vj.plan``."""
    return nnx.split(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))))


def init_params(cfg: LlamaConfig, key: jax.Array) -> nnx.State:
    """The model's parameter state (a function of ``key``, so ``vj.init_sharded`` can run it sharded)."""
    return nnx.split(LlamaForCausalLM(cfg, rngs=nnx.Rngs(params=key)))[1]


def loss_fn(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, in float32."""
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1))
