"""``vj.attention``: dot-product attention that means the whole sequence, also under a context axis.

Outside a ``vj.fsdp`` step with a context axis it is ``jax.nn.dot_product_attention``. Inside one, each device
holds the queries, keys and values of its own tokens (:mod:`vescale_jax.step._context`), and attention over the
whole sequence needs the other devices' keys and values. Two ways are built:

* all-gather: the keys and values (and their positions and segment ids) are gathered over the context axis and
  ``jax.nn.dot_product_attention`` runs once on the local queries, with a mask built from the global positions.
  The gradient of the gather is a reduce-scatter of the keys' and values' gradients.
* ring: keys and values travel round the context axis with ``cp - 1`` ``ppermute`` steps; each step attends the
  local queries to the block it holds and merges the partial results by their log-sum-exp (online softmax). Under
  a causal mask the blocks that are wholly masked are skipped: with causal balancing every block but the
  device's own costs half a block. The per-block computation is written in ``jnp`` (not
  ``jax.nn.dot_product_attention``, whose log-sum-exp residual carries no gradient) and rematerialised in the
  backward pass.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax import _compat
from vescale_jax.step._context import Context, enclosing_context, sequence_order

__all__ = ["IMPLEMENTATIONS", "attention"]

IMPLEMENTATIONS = (None, "all_gather", "ring", "xla", "cudnn")
"""The values of ``vj.attention``'s ``implementation``."""

_F32 = jnp.float32
_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # jax.nn.dot_product_attention's masked logit


def attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    causal: bool = True,
    mask: Any = None,
    bias: Any = None,
    segment_ids: Any = None,
    scale: float | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """Scaled dot-product attention over the whole sequence, also when the sequence is split over a context axis.

    Args:
      query: ``(B, T, N, H)``.
      key: ``(B, S, K, H)``; ``N`` a multiple of ``K`` (grouped-query attention when ``K < N``).
      value: ``(B, S, K, H)``.
      causal: whether query position ``p`` attends only to key positions ``<= p`` (default True).
      mask: optional boolean mask broadcastable to ``(B, N, T, S)`` (True: attend). Under a context axis: of
        shape ``(B|1, N|1, T|1, S_global|1)``, its rows this device's local queries in their local order, its
        columns the global key positions ``0 .. S_global - 1`` in natural order (build it from
        ``vj.positions``).
      bias: optional additive logit bias, broadcastable like ``mask`` (same layout under a context axis).
      segment_ids: optional int ids of packed documents: a ``(B, T)`` array for self-attention, or a pair
        ``(query_ids (B, T), key_ids (B, S))``; a query attends only to keys of its own id. Under a context axis:
        the local ids, in the local order (split like the tokens).
      scale: the logit scale (default ``1 / sqrt(H)``).
      implementation: ``None`` (the rule below), ``"all_gather"`` or ``"ring"`` (forced under a context axis,
        ``jax.nn.dot_product_attention`` with its default outside one), or ``"xla"`` / ``"cudnn"`` (passed to
        ``jax.nn.dot_product_attention``'s ``implementation``; under a context axis with the all-gather).

    Returns:
      The attention output ``(B, T, N, H)`` in ``query``'s dtype (logits and softmax in fp32). Outside a context
      step it is ``jax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=causal, ...)`` with the
      segment mask ``ids_q[:, None, :, None] == ids_k[:, None, None, :]`` and-ed into ``mask``.

    Sharding:
      Inside a ``vj.fsdp`` step with a context axis of ``cp`` devices, ``query``, ``key`` and ``value`` are this
      device's ``T = S`` local tokens (cross-attention with a different key length is refused), the output is
      the local queries' attention over all ``cp * T`` keys of the sequence, exactly as the unsharded model
      computes it. ``implementation=None`` takes the all-gather unless the gathered keys and values would be
      larger than twice the local queries, i.e. the ring when ``cp * K > 2 * N`` (full multi-head attention on
      more than 2 devices; grouped-query attention with ``N / K = 8`` from 17 devices on). A query row with no
      key to attend to gives ``0`` in the ring (``jax.nn.dot_product_attention`` gives the mean of the values).
    """
    q, k, v = (jnp.asarray(a) for a in (query, key, value))
    _check_shapes(q, k, v)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"vj.attention: implementation={implementation!r} is not one of {IMPLEMENTATIONS}: use None (the rule "
            "in the docstring), 'all_gather' or 'ring' under a context axis, or 'xla' / 'cudnn' for "
            "jax.nn.dot_product_attention's kernel."
        )
    seg_q, seg_k = _segment_ids(segment_ids, q, k)
    mask = None if mask is None else jnp.asarray(mask)
    bias = None if bias is None else jnp.asarray(bias)
    if mask is not None and mask.dtype != jnp.bool_:
        raise ValueError(
            f"vj.attention: mask of dtype {mask.dtype} and shape {mask.shape}: pass a boolean mask (True: attend), "
            "e.g. mask.astype(bool), or an additive float mask as bias."
        )
    ctx = enclosing_context()
    kernel = implementation if implementation in ("xla", "cudnn") else None
    if ctx is None or ctx.size == 1:
        if seg_q is not None:
            same = (seg_q[:, :, None] == seg_k[:, None, :])[:, None]
            mask = same if mask is None else jnp.logical_and(mask, same)
        return jax.nn.dot_product_attention(q, k, v, bias, mask, scale=scale, is_causal=causal, implementation=kernel)

    B, T, N, H = q.shape
    K = k.shape[2]
    if k.shape[1] != T:
        raise ValueError(
            f"vj.attention: under context axis {ctx.axis!r} the key's sequence length {k.shape[1]} (key shape "
            f"{k.shape}) differs from the query's {T} (query shape {q.shape}): only self-attention over the split "
            "sequence is supported. For cross-attention gather the keys and values with "
            f"jax.lax.all_gather(key, {ctx.axis!r}, axis=1, tiled=True) and call jax.nn.dot_product_attention."
        )
    S = T * ctx.size
    for name, x in (("mask", mask), ("bias", bias)):
        _check_context_mask(name, x, B, N, T, S, ctx)
    if implementation is None:
        implementation = "ring" if ctx.size * K > 2 * N else "all_gather"
    scale = float(1.0 / np.sqrt(H)) if scale is None else float(scale)
    if implementation == "ring":
        return _ring(q, k, v, seg_q, seg_k, mask, bias, causal=causal, scale=scale, ctx=ctx)
    return _all_gather(q, k, v, seg_q, seg_k, mask, bias, causal=causal, scale=scale, ctx=ctx, kernel=kernel)


# ----------------------------------------------------------------------------------------------------------
# Arguments


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError(
            f"vj.attention: query of shape {q.shape} and key of shape {k.shape}: both must be 4-d, (batch, "
            "sequence, heads, head_dim); add the missing dims (e.g. x[:, :, None, :] for one head)."
        )
    if v.shape != k.shape:
        raise ValueError(
            f"vj.attention: value of shape {v.shape} differs from key of shape {k.shape}: pass them alike."
        )
    (B, _, N, H), (Bk, _, K, Hk) = q.shape, k.shape
    if Bk != B or Hk != H:
        raise ValueError(
            f"vj.attention: query of shape {q.shape} and key of shape {k.shape} differ in the batch or head dim: "
            "they must agree in dims 0 and 3."
        )
    if N % K:
        raise ValueError(
            f"vj.attention: query heads N={N} (shape {q.shape}) is not a multiple of key heads K={K} (shape "
            f"{k.shape}): grouped-query attention needs N % K == 0."
        )


def _segment_ids(segment_ids: Any, q: jax.Array, k: jax.Array) -> tuple[Any, Any]:
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                f"vj.attention: segment_ids is a sequence of {len(segment_ids)} arrays: pass one (B, T) array or "
                "a pair (query_ids, key_ids)."
            )
        seg_q, seg_k = (jnp.asarray(s) for s in segment_ids)
    else:
        seg_q = seg_k = jnp.asarray(segment_ids)
    for name, s, x in (("query", seg_q, q), ("key", seg_k, k)):
        if s.shape != x.shape[:2]:
            raise ValueError(
                f"vj.attention: {name} segment_ids of shape {s.shape} do not match the {name}'s (batch, sequence) "
                f"dims {x.shape[:2]}: pass one id per token ((query_ids, key_ids) for keys of another length)."
            )
    return seg_q, seg_k


def _check_context_mask(name: str, x: Any, B: int, N: int, T: int, S: int, ctx: Context) -> None:
    if x is None:
        return
    ok = x.ndim == 4 and all(d in (1, want) for d, want in zip(x.shape, (B, N, T, S), strict=True))
    if not ok:
        raise ValueError(
            f"vj.attention: {name} of shape {x.shape} under context axis {ctx.axis!r} of size {ctx.size}: it must "
            f"have shape (B|1, N|1, T|1, S|1) = ({B}|1, {N}|1, {T}|1, {S}|1): rows the {T} local queries in their "
            f"local order, columns the {S} global key positions in natural order (build it from vj.positions)."
        )


# ----------------------------------------------------------------------------------------------------------
# All-gather


def _all_gather(q, k, v, seg_q, seg_k, mask, bias, *, causal, scale, ctx: Context, kernel) -> jax.Array:
    T = q.shape[1]
    S = T * ctx.size
    order = sequence_order(S, ctx)  # the global position of each gathered key
    gather = functools.partial(jax.lax.all_gather, axis_name=ctx.axis, axis=1, tiled=True)
    k_all, v_all = gather(k), gather(v)
    q_pos = _chunk_positions(jax.lax.axis_index(ctx.axis), T, ctx)
    full = _mask(q_pos, jnp.asarray(order, jnp.int32), seg_q, None if seg_k is None else gather(seg_k), causal)
    if mask is not None:
        full = _and(full, mask if mask.shape[-1] == 1 else mask[..., order])
    if bias is not None and bias.shape[-1] != 1:
        bias = bias[..., order]
    return jax.nn.dot_product_attention(q, k_all, v_all, bias, full, scale=scale, implementation=kernel)


def _chunk_positions(index: Any, local_len: int, ctx: Context) -> jax.Array:
    """Global positions of the ``local_len`` tokens device ``index`` of the context axis holds (int32)."""
    if ctx.balance is None:
        return index * local_len + jnp.arange(local_len, dtype=jnp.int32)
    c = local_len // 2
    head = index * c + jnp.arange(c, dtype=jnp.int32)
    tail = (2 * ctx.size - 1 - index) * c + jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([head, tail]).astype(jnp.int32)


def _mask(q_pos, k_pos, seg_q, seg_k, causal: bool) -> jax.Array | None:
    """``(1|B, 1, T, S)`` boolean mask of the causal and segment conditions, or None when there are none."""
    out = (q_pos[:, None] >= k_pos[None, :])[None, None] if causal else None
    if seg_q is not None:
        out = _and(out, (seg_q[:, :, None] == seg_k[:, None, :])[:, None])
    return out


def _and(a, b):
    return b if a is None else (a if b is None else jnp.logical_and(a, b))


# ----------------------------------------------------------------------------------------------------------
# Ring


def _ring(q, k, v, seg_q, seg_k, mask, bias, *, causal, scale, ctx: Context) -> jax.Array:
    cp, T = ctx.size, q.shape[1]
    i = jax.lax.axis_index(ctx.axis)
    q_pos = _chunk_positions(i, T, ctx)
    block = jax.checkpoint(functools.partial(_block, causal=causal, scale=scale))
    perm = [(j, (j + 1) % cp) for j in range(cp)]
    half = T // 2
    kv = (k, v, seg_k)
    stats = None
    for s in range(cp):
        if s:
            kv = jax.tree.map(lambda x: jax.lax.ppermute(x, ctx.axis, perm), kv)
        kb, vb, segb = kv
        src = (i - s) % cp  # the device whose keys this step holds
        k_pos = _chunk_positions(src, T, ctx)
        m_b = None if mask is None or mask.shape[-1] == 1 else jnp.take(mask, k_pos, axis=-1)
        b_b = None if bias is None or bias.shape[-1] == 1 else jnp.take(bias, k_pos, axis=-1)
        m_b = mask if m_b is None else m_b
        b_b = bias if b_b is None else b_b
        args = (q, q_pos, seg_q, kb, vb, k_pos, segb, m_b, b_b)
        if not causal or s == 0:
            new = block(*args)
        elif ctx.balance is None:
            # Contiguous chunks: keys of an earlier device are all visible, of a later one all masked.
            new = jax.lax.cond(s <= i, lambda a: block(*a), lambda a: _empty(a[0], a[3]), args)
        else:
            # Balanced chunks: from an earlier device only its head chunk is visible (to all local queries); from a
            # later one both its chunks are visible, to the local tail chunk only.
            new = jax.lax.cond(
                s <= i,
                lambda a: block(*_keys_slice(a, slice(0, half))),
                lambda a: _join_rows(_empty(a[0][:, :half], a[3]), block(*_queries_slice(a, slice(half, T)))),
                args,
            )
        stats = new if stats is None else _merge(stats, new)
    o, _, total = stats
    total = jnp.swapaxes(total, 1, 2)[..., None]  # (B, T, N, 1)
    return jnp.where(total > 0, o / jnp.where(total > 0, total, 1.0), 0.0).astype(q.dtype)


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


def _block(q, q_pos, seg_q, k, v, k_pos, seg_k, mask, bias, *, causal: bool, scale: float):
    """One block's unnormalised attention: ``(o (B, T, N, H), max (B, N, T), total (B, N, T))``, fp32."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    logits = jnp.einsum("btkgh,bskh->bkgts", q.reshape(B, T, K, G, H), k, preferred_element_type=_F32).reshape(
        B, N, T, S
    )
    logits = logits * scale
    if bias is not None:
        logits = logits + bias.astype(_F32)
    keep = _and(_mask(q_pos, k_pos, seg_q, seg_k, causal), mask)
    if keep is not None:
        logits = jnp.where(keep, logits, _NEG)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1))
    p = jnp.exp(logits - m[..., None])
    if keep is not None:
        p = jnp.where(keep, p, 0.0)
    total = jnp.sum(p, axis=-1)
    o = jnp.einsum(
        "bkgts,bskh->btkgh", p.reshape(B, K, G, T, S).astype(v.dtype), v, preferred_element_type=_F32
    ).reshape(B, T, N, H)
    return o, m, total


def _empty(q, k):
    """The statistics of a block with every key masked, varying over the same mesh axes as ``q`` and ``k``."""
    B, T, N, H = q.shape
    o = jnp.zeros((B, T, N, H), _F32)
    m = jnp.full((B, N, T), _NEG, _F32)
    total = jnp.zeros((B, N, T), _F32)
    axes = tuple(sorted(_compat.varying_axes(q) | _compat.varying_axes(k)))
    if axes:
        o, m, total = (jax.lax.pcast(x, axes, to="varying") for x in (o, m, total))
    return o, m, total


def _join_rows(a, b):
    o = jnp.concatenate([a[0], b[0]], axis=1)
    return o, jnp.concatenate([a[1], b[1]], axis=2), jnp.concatenate([a[2], b[2]], axis=2)


def _merge(a, b):
    (oa, ma, sa), (ob, mb, sb) = a, b
    m = jnp.maximum(ma, mb)
    wa, wb = jnp.exp(ma - m), jnp.exp(mb - m)
    rows = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # (B, N, T) -> (B, T, N, 1)
    return oa * rows(wa) + ob * rows(wb), m, sa * wa + sb * wb
