"""A small GPT in Flax NNX whose layers are one stacked group, looped with ``vj.flax.nnx_scan_layers``.

The same model runs unsharded (the loop is an ordinary ``lax.scan``) and under ``vj.fsdp`` (each layer is
gathered inside the loop body, the next one prefetched). Shapes in names: B batch, T time, D model width,
H heads, F MLP width, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import vescale_jax as vj


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 128
    max_len: int = 128
    d_model: int = 128
    num_heads: int = 4
    num_layers: int = 4
    d_ff: int = 512
    scan_unroll: int | bool = 1  # passed to the layer scan (True unrolls it: used to count FLOPs)
    remat: bool = False  # each block call under nnx.remat: its activations recomputed in the backward pass
    # "einsum": the scores as one B x H x T x T tensor (two einsums and a softmax); "dot_product":
    # jax.nn.dot_product_attention (cuDNN's fused attention on a GPU where it applies, XLA's elsewhere);
    # "context": vj.attention and vj.positions, exact over the whole sequence also when a vj.fsdp step splits it
    # over a context axis (context parallelism; outside one the same as "dot_product")
    attention: str = "einsum"
    attention_implementation: str | None = None  # dot_product's implementation= (None: JAX picks)
    attention_dtype: str | None = None  # "context": q, k, v cast to it (cuDNN attends in bf16 / fp16)
    # how the position table is indexed: "vj" (vj.positions under the "context" attention, else pos[:T]) or
    # "arange" (pos[jnp.arange(T)], as written for one device: under a context axis vj.fsdp gives that iota the
    # tokens' global positions)
    positions: str = "vj"


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and a GELU MLP."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.num_heads = cfg.num_heads
        self.attention, self.implementation = cfg.attention, cfg.attention_implementation
        self.attention_dtype = cfg.attention_dtype
        if cfg.attention not in ("einsum", "dot_product", "context"):
            raise ValueError(f"GPTConfig(attention={cfg.attention!r}); use 'einsum', 'dot_product' or 'context'.")
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)  # a key bias has zero gradient
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, f, rngs=rngs)
        self.down = nnx.Linear(f, d, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, d = x_BxTxD.shape
        h = self.num_heads
        q, k, v = jnp.split(self.qkv(self.ln1(x_BxTxD)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
        if self.attention == "context":  # the whole sequence, wherever its tokens are
            qkv = (q, k, v) if self.attention_dtype is None else (a.astype(self.attention_dtype) for a in (q, k, v))
            att = vj.attention(*qkv, causal=True, implementation=self.implementation)
            att = att.astype(x_BxTxD.dtype).reshape(b, t, d)
        elif self.attention == "dot_product":
            att = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.implementation)
            att = att.reshape(b, t, d)
        else:
            logits_BxHxTxT = jnp.einsum("bqhc,bkhc->bhqk", q, k) / jnp.sqrt(jnp.asarray(d // h, q.dtype))
            mask = jnp.tril(jnp.ones((t, t), bool))
            logits_BxHxTxT = jnp.where(mask, logits_BxHxTxT, jnp.asarray(-1e9, q.dtype))
            att = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(logits_BxHxTxT, axis=-1), v).reshape(b, t, d)
        x_BxTxD = x_BxTxD + self.proj(att)
        return x_BxTxD + self.down(jax.nn.gelu(self.up(self.ln2(x_BxTxD))))


class GPT(nnx.Module):
    """Token + position embeddings, a stacked group of blocks (``blocks``), final norm and an untied head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.max_len, cfg.d_model)))

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        t = tokens_BxT.shape[1]
        # under a context axis the model holds only its tokens: their global positions index the table
        if self.cfg.positions == "arange":
            pos_TxD = self.pos[jnp.arange(t)]
        elif self.cfg.attention == "context":
            pos_TxD = self.pos[vj.positions(tokens_BxT)]
        else:
            pos_TxD = self.pos[:t]
        x_BxTxD = self.embed(tokens_BxT) + pos_TxD
        call = (lambda block, h: nnx.remat(lambda m, h: m(h))(block, h)) if self.cfg.remat else None
        x_BxTxD = vj.flax.nnx_scan_layers(self.blocks, x_BxTxD, call, unroll=self.cfg.scan_unroll)
        return self.head(self.ln_f(x_BxTxD))


def abstract_model(cfg: GPTConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, param shapes)`` without allocating: the input of ``vj.plan``."""
    return nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))


def init_params(cfg: GPTConfig, key: jax.Array) -> nnx.State:
    """The model's parameter state (a function of ``key``, so ``vj.init_sharded`` can run it sharded)."""
    return nnx.split(GPT(cfg, rngs=nnx.Rngs(params=key)))[1]


def loss_fn(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy."""
    logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1))


def muon_dimension_numbers(params: nnx.State) -> nnx.State:
    """Muon for the block kernels (each layer of a stacked ``(L, p, q)`` kernel is one matrix) and the head;
    None (AdamW) for the embeddings, norms and biases."""
    dims = optax.contrib.MuonDimensionNumbers

    def leaf(path, _):
        name = vj.plan_path(path)
        if name.startswith("blocks/") and name.endswith("kernel"):
            return dims(reduction_axis=1, output_axis=2)
        return dims() if name == "head/kernel" else None

    return jax.tree_util.tree_map_with_path(leaf, params)
