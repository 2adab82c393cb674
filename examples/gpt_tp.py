"""A GPT in Flax NNX with Megatron-style tensor parallelism and an optional mixture of experts.

Attention and MLP are column-parallel in, row-parallel out: each device of the ``tensor`` axis holds ``1/T`` of
the heads and of the MLP width, and the block's two ``psum`` over ``tensor`` are the only tensor-parallel
collectives (autodiff adds their transposes). With ``num_experts``, the MLP is a top-k mixture whose experts are
stacked in one tensor split over the ``expert`` axis: each device computes its own experts for every token and
the outputs are summed over ``expert``. Embeddings, norms and the head are replicated over both axes.

The same code runs unsharded (``tensor=None, expert=None``: no collective, whole tensors) and under ``vj.fsdp``
with a plan made with ``tp=partition_spec(cfg)``: the model then sees its TP/EP-local parameters, gathered over
``fsdp`` only. Shapes in names: B batch, T time, D model width, H heads (local), C head width, F MLP width
(local), E experts (local), V vocabulary.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import vescale_jax as vj


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 128
    max_len: int = 64
    d_model: int = 64
    num_heads: int = 4
    num_layers: int = 2
    d_ff: int = 256
    num_experts: int = 0  # 0: a dense MLP
    top_k: int = 2
    tensor: str | None = None  # the mesh axis of tensor parallelism (None: unsplit, no collective)
    expert: str | None = None  # the mesh axis the experts are split over
    expert_data: bool = False  # the batch is split over ``expert`` too: tokens travel to the experts and back


def partition_spec(cfg: Config):
    """Where each parameter is split over ``cfg.tensor`` / ``cfg.expert``: ``vj.plan(..., tp=partition_spec(cfg))``.

    Column-parallel kernels (``q``, ``k``, ``v``, ``up``) and their biases split the output features,
    row-parallel kernels (``proj``, ``down``) the input features; experts split their stacked dim. A leaf of a
    stacked layer group has the layer dim first. Returns a callable ``(key_path, leaf) -> PartitionSpec | None``.
    """

    def spec(path, leaf) -> P | None:
        *_, module, name = ["", *vj.plan_path(path).split("/")]
        lead = (None,) if vj.plan_path(path).startswith("blocks/") else ()
        if cfg.tensor and module in ("q", "k", "v", "up"):
            return P(*lead, None, cfg.tensor) if name == "kernel" else P(*lead, cfg.tensor)
        if cfg.tensor and module in ("proj", "down") and name == "kernel":
            return P(*lead, cfg.tensor, None)
        if cfg.expert and module == "experts" and name in ("w_in", "w_out"):
            return P(*lead, cfg.expert)
        return None

    return spec


def _psum(x: jax.Array, axis: str | None) -> jax.Array:
    return x if axis is None else jax.lax.psum(x, axis)


class Linear(nnx.Module):
    """``x @ kernel (+ bias)``; a row-parallel layer sums over ``reduce`` before its bias."""

    def __init__(self, d_in: int, d_out: int, *, rngs: nnx.Rngs, bias: bool = True, reduce: str | None = None):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d_in, d_out)))
        self.bias = nnx.Param(jnp.zeros((d_out,))) if bias else None
        self.reduce = reduce

    def __call__(self, x: jax.Array) -> jax.Array:
        y = _psum(x @ self.kernel[...], self.reduce)
        return y if self.bias is None else y + self.bias[...]


class Experts(nnx.Module):
    """``E`` GELU MLPs stacked in ``w_in (E, D, F)`` and ``w_out (E, F, D)``, routed top-k by ``router``."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        e, d, f = cfg.num_experts, cfg.d_model, cfg.d_ff
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (d, e)))
        self.w_in = nnx.Param(init(rngs.params(), (e, d, f)))
        self.w_out = nnx.Param(init(rngs.params(), (e, f, d)))
        self.top_k, self.axis, self.data = cfg.top_k, cfg.expert, cfg.expert_data

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        if self.axis is not None and self.data:  # every expert group's tokens to every group, the outputs back
            x_all = jax.lax.all_gather(x_BxTxD, self.axis, axis=0, tiled=True)
            return jax.lax.psum_scatter(self._mix(x_all), self.axis, scatter_dimension=0, tiled=True)
        return self._mix(x_BxTxD)

    def _mix(self, x_BxTxD: jax.Array) -> jax.Array:
        probs_BxTxE = jax.nn.softmax(x_BxTxD @ self.router[...], axis=-1)
        kth = jax.lax.top_k(probs_BxTxE, self.top_k)[0][..., -1:]
        gates = jnp.where(probs_BxTxE >= kth, probs_BxTxE, 0.0)
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        w_in, w_out = self.w_in[...], self.w_out[...]  # this device's experts
        first = 0 if self.axis is None else jax.lax.axis_index(self.axis) * w_in.shape[0]
        local = jax.lax.dynamic_slice_in_dim(gates, first, w_in.shape[0], axis=-1)
        h = jax.nn.gelu(jnp.einsum("btd,edf->btef", x_BxTxD, w_in))
        out_BxTxD = jnp.einsum("btef,efd,bte->btd", h, w_out, local)
        return out_BxTxD if self.data else _psum(out_BxTxD, self.axis)


class Block(nnx.Module):
    """Pre-norm block: column-parallel ``q``/``k``/``v``, row-parallel ``proj``; a column/row MLP or experts."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.head_dim = d // cfg.num_heads
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.q, self.k, self.v = (Linear(d, d, rngs=rngs, bias=False) for _ in range(3))
        self.proj = Linear(d, d, rngs=rngs, reduce=cfg.tensor)
        if cfg.num_experts:
            self.experts = Experts(cfg, rngs=rngs)
        else:
            self.up, self.down = Linear(d, f, rngs=rngs), Linear(f, d, rngs=rngs, reduce=cfg.tensor)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        b, t, _ = x_BxTxD.shape
        h = self.ln1(x_BxTxD)
        q, k, v = (layer(h).reshape(b, t, -1, self.head_dim) for layer in (self.q, self.k, self.v))  # local heads
        att_BxTxHxC = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x_BxTxD = x_BxTxD + self.proj(att_BxTxHxC.reshape(b, t, -1))
        h = self.ln2(x_BxTxD)
        if hasattr(self, "experts"):
            return x_BxTxD + self.experts(h)
        return x_BxTxD + self.down(jax.nn.gelu(self.up(h)))


class GPT(nnx.Module):
    """Token and position embeddings, a stacked group of blocks (``blocks``), final norm, untied head."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.max_len, cfg.d_model)))

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = stack(rngs)
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = Linear(cfg.d_model, cfg.vocab, rngs=rngs, bias=False)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        x_BxTxD = self.embed(tokens_BxT) + self.pos[: tokens_BxT.shape[1]]
        return self.head(self.ln_f(vj.flax.nnx_scan_layers(self.blocks, x_BxTxD)))


def split_model(cfg: Config, key: jax.Array) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, params)`` of a model drawn from ``key`` (the parameters do not depend on the axes)."""
    return nnx.split(GPT(cfg, rngs=nnx.Rngs(params=key)))


def abstract_model(cfg: Config) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, parameter shapes)``, allocating nothing."""
    return nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))
