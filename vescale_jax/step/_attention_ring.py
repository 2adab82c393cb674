"""Ring attention over a context axis: keys and values go round the devices, partial results merge by log-sum-exp.

``vj.attention``'s ``implementation="ring"`` (:mod:`vescale_jax.step._attention`). Each device holds the queries,
keys and values of its own tokens. In ``cp - 1`` ``ppermute`` steps every device sees every device's keys and
values; at each step it attends its queries to the block it holds and merges the partial result into its running
one by their log-sum-exp (online softmax). Under a causal mask the wholly masked parts of a block are skipped:
with causal balancing every block but the device's own costs half a block, with contiguous chunks a later
device's block costs nothing. The backward pass is a ring too (a ``custom_vjp``): the keys and values go round
again, each with the gradient accumulated for it so far, and one more hop brings those gradients home; only the
local queries, keys, values, output and log-sum-exp are kept from the forward pass.

The per-block computation is written in ``jnp`` (not ``jax.nn.dot_product_attention``, whose log-sum-exp
residual is returned without a gradient and in the inputs' dtype); logits and softmax are fp32.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from vescale_jax import _compat
from vescale_jax.step._context import Context

__all__ = ["chunk_positions", "ring_attention", "visible"]

_F32 = jnp.float32
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # jax.nn.dot_product_attention's masked logit


def chunk_positions(index: Any, local_len: int, ctx: Context) -> jax.Array:
    """Global positions of the ``local_len`` tokens device ``index`` of the context axis holds (int32)."""
    if ctx.balance is None:
        return index * local_len + jnp.arange(local_len, dtype=jnp.int32)
    c = local_len // 2
    head = index * c + jnp.arange(c, dtype=jnp.int32)
    tail = (2 * ctx.size - 1 - index) * c + jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([head, tail]).astype(jnp.int32)


def visible(q_pos, k_pos, seg_q, seg_k, causal: bool) -> jax.Array | None:
    """``(1|B, 1, T, S)`` boolean mask of the causal and segment conditions, or None when there are none.

    The query and key sides may vary over different mesh axes (inside ``vj.scan_layers`` a saved position varies
    over every axis of the step): each side is marked varying over the other's axes first."""
    out = None
    if causal:
        q_pos, k_pos = _varying((q_pos, k_pos), q_pos, k_pos)
        out = (q_pos[:, None] >= k_pos[None, :])[None, None]
    if seg_q is not None:
        seg_q, seg_k = _varying((seg_q, seg_k), seg_q, seg_k)
        out = _and(out, (seg_q[:, :, None] == seg_k[:, None, :])[:, None])
    return out


def _and(a, b):
    return b if a is None else (a if b is None else jnp.logical_and(a, b))


class _RingConfig(NamedTuple):
    axis: str
    size: int
    balance: str | None
    causal: bool
    scale: float


def ring_attention(q, k, v, seg_q, seg_k, mask, bias, *, causal: bool, scale: float, ctx: Context) -> jax.Array:
    """Attention of the local queries ``(B, T, N, H)`` over the whole sequence's keys, by the ring.

    ``seg_q`` / ``seg_k``: local segment ids ``(B, T)`` or None; ``mask`` / ``bias``: ``(B|1, N|1, T|1, S|1)``,
    their columns the global key positions in natural order, or None. Inside ``shard_map`` over ``ctx.axis``.
    """
    cfg = _RingConfig(ctx.axis, ctx.size, ctx.balance, causal, scale)
    q_pos = _varying(chunk_positions(jax.lax.axis_index(ctx.axis), q.shape[1], ctx), q)  # typed like q throughout
    return _ring_attention(cfg, q, k, v, q_pos, seg_q, seg_k, mask, bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(cfg, q, k, v, q_pos, seg_q, seg_k, mask, bias):
    return _ring_forward(cfg, q, k, v, q_pos, seg_q, seg_k, mask, bias)[0]


def _ring_forward(cfg: _RingConfig, q, k, v, q_pos, seg_q, seg_k, mask, bias):
    """The output ``(B, T, N, H)`` and the log-sum-exp ``(B, N, T)`` (``+inf`` on a row with no key)."""
    T = q.shape[1]
    block = functools.partial(_block, causal=cfg.causal, scale=cfg.scale)
    stats = None
    for s, (kb, vb, seg_b), k_pos in _ring_steps(cfg, (k, v, seg_k), T):
        a = (q, q_pos, seg_q, kb, vb, k_pos, seg_b, _cols(mask, k_pos), _cols(bias, k_pos))
        new = _forward_step(cfg, s, a, block)
        stats = new if stats is None else _merge(stats, new)
    o, m, total = stats
    rows = jnp.swapaxes(total, 1, 2)[..., None]  # (B, T, N, 1)
    out = jnp.where(rows > 0, o / jnp.where(rows > 0, rows, 1.0), 0.0).astype(q.dtype)
    lse = jnp.where(total > 0, m + jnp.log(jnp.where(total > 0, total, 1.0)), jnp.inf)
    return out, lse


def _ring_fwd(cfg, q, k, v, q_pos, seg_q, seg_k, mask, bias):
    out, lse = _ring_forward(cfg, q, k, v, q_pos, seg_q, seg_k, mask, bias)
    return out, (q, k, v, q_pos, seg_q, seg_k, mask, bias, out, lse)


def _ring_bwd(cfg, res, d_out):
    """The keys and values go round the ring again, each with the gradient accumulated for it so far; after the
    last step one more hop brings the gradients home."""
    q, k, v, q_pos, seg_q, seg_k, mask, bias, out, lse = res
    T = q.shape[1]
    delta = jnp.swapaxes(jnp.sum(d_out.astype(_F32) * out.astype(_F32), axis=-1), 1, 2)  # (B, N, T)
    grads = functools.partial(_block_grads, causal=cfg.causal, scale=cfg.scale)
    dq = jnp.zeros(q.shape, _F32)
    d_bias = None if bias is None else jnp.zeros(bias.shape, _F32)
    carry = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    perm = [(j, (j + 1) % cfg.size) for j in range(cfg.size)]
    for s, (kb, vb, seg_b), k_pos in _ring_steps(cfg, (k, v, seg_k), T):
        if s:
            carry = jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis, perm), carry)
        a = (q, q_pos, seg_q, kb, vb, k_pos, seg_b, _cols(mask, k_pos), _cols(bias, k_pos), d_out, lse, delta)
        g = _backward_step(cfg, s, a, grads, bias)
        dq = dq + g[0]
        carry = (carry[0] + g[1], carry[1] + g[2])
        if bias is not None:
            d_bias = _add_cols(d_bias, g[3], k_pos)
    dk, dv = jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis, perm), carry) if cfg.size > 1 else carry
    no_grad = (None, None, None, None)  # positions, segment ids and the boolean mask
    d_bias = None if bias is None else _like(d_bias, bias)
    return (_like(dq, q), _like(dk, k), _like(dv, v), *no_grad, d_bias)


_ring_attention.defvjp(_ring_fwd, _ring_bwd)


def _forward_step(cfg: _RingConfig, s: int, a, block):
    """Step ``s``'s statistics, of the part of the block a causal mask leaves visible (:func:`_dispatch`)."""
    q, k, T = a[0], a[3], a[0].shape[1]
    head, tail = slice(0, T // 2), slice(T // 2, T)
    return _dispatch(
        cfg,
        s,
        full=lambda: block(*a),
        keys_head=lambda: block(*_keys_slice(a, head)),
        queries_tail=lambda: _join_rows(_empty(q[:, head], k), block(*_queries_slice(a, tail))),
        none=lambda: _empty(q, k),
    )


def _backward_step(cfg: _RingConfig, s: int, a, grads, bias):
    """Step ``s``'s ``(d_query, d_key, d_value, d_bias columns)``, full-shaped, of the visible part of the block."""
    q, k, v, T = a[0], a[3], a[4], a[0].shape[1]
    half = T // 2
    head, tail = slice(0, half), slice(half, T)
    pad_cols = bias is not None and bias.shape[-1] != 1
    pad_rows = bias is not None and bias.shape[-2] != 1

    def keys_head():
        dq, dk, dv, db = grads(*_keys_slice(a[:9], head), *a[9:])
        return dq, _pad(dk, 1, 0, half), _pad(dv, 1, 0, half), _pad(db, -1, 0, half) if pad_cols else db

    def queries_tail():
        dq, dk, dv, db = grads(*_queries_slice(a[:9], tail), a[9][:, tail], a[10][..., tail], a[11][..., tail])
        return _pad(dq, 1, half, 0), dk, dv, _pad(db, -2, half, 0) if pad_rows else db

    def none():
        zeros = (jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
        zeros += (None if bias is None else jnp.zeros(a[8].shape, _F32),)
        return _varying(zeros, q, k)

    return _dispatch(cfg, s, full=lambda: grads(*a), keys_head=keys_head, queries_tail=queries_tail, none=none)


def _ring_steps(cfg: _RingConfig, kv, local_len: int):
    """Yields ``(step, kv block, its key positions)`` for the ``cp`` steps: at step ``s`` device ``i`` holds the
    block of device ``(i - s) % cp``, passed on by one ``ppermute`` hop per step."""
    ctx = Context(cfg.axis, cfg.size, cfg.balance)
    i = jax.lax.axis_index(cfg.axis)
    perm = [(j, (j + 1) % cfg.size) for j in range(cfg.size)]
    for s in range(cfg.size):
        if s:
            kv = jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis, perm), kv)
        yield s, kv, _varying(chunk_positions((i - s) % cfg.size, local_len, ctx), kv[0])


def _dispatch(cfg: _RingConfig, s: int, *, full, keys_head, queries_tail, none):
    """Runs the part of step ``s``'s block that a causal mask leaves visible (all of it when not causal).

    At step ``s > 0`` device ``i`` holds the keys of device ``i - s``: an earlier device when ``s <= i``. With
    contiguous chunks an earlier device's keys are all visible and a later one's all masked; with balanced chunks
    only an earlier device's head chunk is visible (to all local queries), and a later device's keys are visible
    to the local tail chunk only.
    """
    if not cfg.causal or s == 0:
        return full()
    earlier = s <= jax.lax.axis_index(cfg.axis)
    if cfg.balance is None:
        return jax.lax.cond(earlier, full, none)
    return jax.lax.cond(earlier, keys_head, queries_tail)


def _cols(x, k_pos):
    """The columns of a natural-order ``(..., S_global|1)`` mask or bias for keys at ``k_pos``."""
    return x if x is None or x.shape[-1] == 1 else jnp.take(x, k_pos, axis=-1)


def _add_cols(acc, g, k_pos):
    return acc + g if acc.shape[-1] == 1 else acc.at[..., k_pos].add(g)


def _pad(x, dim, before, after):
    if x is None:
        return None
    widths = [(0, 0)] * x.ndim
    widths[dim] = (before, after)
    return jnp.pad(x, widths)


def _keys_slice(a, sl):
    q, q_pos, seg_q, k, v, k_pos, seg_k, m, b = a
    cols = lambda x: x if x is None or x.shape[-1] == 1 else x[..., sl]
    seg_k = None if seg_k is None else seg_k[:, sl]
    return q, q_pos, seg_q, k[:, sl], v[:, sl], k_pos[sl], seg_k, cols(m), cols(b)


def _queries_slice(a, sl):
    q, q_pos, seg_q, k, v, k_pos, seg_k, m, b = a
    rows = lambda x: x if x is None or x.shape[-2] == 1 else x[..., sl, :]
    seg_q = None if seg_q is None else seg_q[:, sl]
    return q[:, sl], q_pos[sl], seg_q, k, v, k_pos, seg_k, rows(m), rows(b)


def _logits(q, q_pos, seg_q, k, k_pos, seg_k, mask, bias, *, causal: bool, scale: float):
    """The block's masked fp32 logits ``(B, N, T, S)`` and its mask (None: every key visible)."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    q = q.reshape(B, T, K, N // K, H)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=_F32).reshape(B, N, T, S) * scale
    if bias is not None:
        logits = logits + bias.astype(_F32)
    keep = _and(visible(q_pos, k_pos, seg_q, seg_k, causal), mask)
    if keep is not None:
        logits = jnp.where(keep, logits, _NEG)
    return logits, keep


def _block(q, q_pos, seg_q, k, v, k_pos, seg_k, mask, bias, *, causal: bool, scale: float):
    """One block's unnormalised attention: ``(o (B, T, N, H), max (B, N, T), total (B, N, T))``, fp32."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    logits, keep = _logits(q, q_pos, seg_q, k, k_pos, seg_k, mask, bias, causal=causal, scale=scale)
    m = jnp.max(logits, axis=-1)
    p = jnp.exp(logits - m[..., None])
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    total = jnp.sum(p, axis=-1)
    p = p.reshape(B, K, N // K, T, S).astype(v.dtype)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v, preferred_element_type=_F32).reshape(B, T, N, H)
    return o, m, total


def _block_grads(q, q_pos, seg_q, k, v, k_pos, seg_k, mask, bias, d_out, lse, delta, *, causal: bool, scale: float):
    """One block's ``(d_query, d_key, d_value, d_bias)`` (fp32; ``d_bias`` reduced to the bias's shape) given the
    final log-sum-exp ``lse`` and ``delta = sum(d_out * out, -1)``, both ``(B, N, T)``."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    logits, keep = _logits(q, q_pos, seg_q, k, k_pos, seg_k, mask, bias, causal=causal, scale=scale)
    p = jnp.exp(logits - lse[..., None])
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    do = d_out.reshape(B, T, K, G, H)
    dv = jnp.einsum("bkgts,btkgh->bskh", p.reshape(B, K, G, T, S).astype(do.dtype), do, preferred_element_type=_F32)
    dp = jnp.einsum("btkgh,bskh->bkgts", do, v, preferred_element_type=_F32).reshape(B, N, T, S)
    ds = p * (dp - delta[..., None])  # d logits
    dsg = (ds * scale).reshape(B, K, G, T, S)
    dq = jnp.einsum("bkgts,bskh->btkgh", dsg.astype(k.dtype), k, preferred_element_type=_F32).reshape(B, T, N, H)
    qg = q.reshape(B, T, K, G, H)
    dk = jnp.einsum("bkgts,btkgh->bskh", dsg.astype(q.dtype), qg, preferred_element_type=_F32)
    d_bias = None
    if bias is not None:
        dims = tuple(d for d in range(4) if bias.shape[d] == 1)
        d_bias = jnp.sum(ds, axis=dims, keepdims=True) if dims else ds
    return dq, dk, dv, d_bias


def _empty(q, k):
    """The statistics of a block with every key masked, varying over the same mesh axes as ``q`` and ``k``."""
    B, T, N, H = q.shape
    stats = (jnp.zeros((B, T, N, H), _F32), jnp.full((B, N, T), _NEG, _F32), jnp.zeros((B, N, T), _F32))
    return _varying(stats, q, k)


def _varying(tree, *like):
    """``tree`` marked varying over the mesh axes ``like`` vary over (the branches of a ``cond`` must agree)."""
    axes = frozenset().union(*(_compat.varying_axes(x) for x in like))

    def cast(x):
        missing = tuple(sorted(axes - _compat.varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _like(g, x):
    """Cotangent ``g`` in ``x``'s dtype and varying axes: summed over the mesh axes ``x`` does not vary over (the
    transpose of using an invariant value in varying code), marked varying over those it does."""
    extra = tuple(sorted(_compat.varying_axes(g) - _compat.varying_axes(x)))
    if extra:
        g = jax.lax.psum(g, extra)
    return _varying(g, x).astype(x.dtype)


def _join_rows(a, b):
    o = jnp.concatenate([a[0], b[0]], axis=1)
    return o, jnp.concatenate([a[1], b[1]], axis=2), jnp.concatenate([a[2], b[2]], axis=2)


def _merge(a, b):
    (oa, ma, sa), (ob, mb, sb) = a, b
    m = jnp.maximum(ma, mb)
    wa, wb = jnp.exp(ma - m), jnp.exp(mb - m)
    rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # (B, N, T) -> (B, T, N, 1)
    return oa * rows(wa) + ob * rows(wb), m, sa * wa + sb * wb
