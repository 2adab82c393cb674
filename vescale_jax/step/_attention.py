"""``vj.attention``: dot-product attention that means the whole sequence, also under a context axis.

Outside a ``vj.fsdp`` step with a context axis it is ``jax.nn.dot_product_attention``. Inside one, each device
holds the queries, keys and values of its own tokens (:mod:`vescale_jax.step._context`), and attention over the
whole sequence needs the other devices' keys and values. Two ways are built:

* all-gather: the keys and values (and their positions and segment ids) are gathered over the context axis and
  ``jax.nn.dot_product_attention`` runs once on the local queries, with a mask built from the global positions.
  The gradient of the gather is a reduce-scatter of the keys' and values' gradients.
* ring (:mod:`vescale_jax.step._attention_ring`): keys and values travel round the context axis with ``cp - 1``
  ``ppermute`` steps; each step attends the local queries to the block it holds and merges the partial results by
  their log-sum-exp, skipping what a causal mask hides; the backward pass is a ring too.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.step._attention_ring import chunk_positions, ring_attention, visible
from vescale_jax.step._context import Context, enclosing_context, sequence_order
from vescale_jax.step._wire import varying_axes

__all__ = ["IMPLEMENTATIONS", "attention"]

IMPLEMENTATIONS = (None, "all_gather", "ring", "xla", "cudnn")
"""The values of ``vj.attention``'s ``implementation``."""


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
      the local queries' attention over all ``cp * T`` keys of the sequence, as the unsharded model computes it
      (up to rounding). ``implementation=None`` takes the all-gather unless the gathered keys and values
      (``2 * cp * T * K * H`` elements) would outgrow four times the local queries (``T * N * H``), i.e. the ring
      when ``cp * K > 2 * N``: full multi-head attention on more than 2 devices, grouped-query attention with
      ``N / K = 8`` from 17 devices on. The all-gather's gradient reduce-scatters the keys' and values'
      gradients; the ring's backward pass is a ring too. A query row with no key to attend to gives ``0`` in the
      ring (``jax.nn.dot_product_attention`` gives the mean of the values).
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
    ctx.check_length(S, "query sequence")
    for name, x in (("mask", mask), ("bias", bias)):
        _check_context_mask(name, x, B, N, T, S, ctx)
    if implementation is None:
        implementation = "ring" if ctx.size * K > 2 * N else "all_gather"
    scale = float(1.0 / np.sqrt(H)) if scale is None else float(scale)
    if implementation == "ring":
        return ring_attention(q, k, v, seg_q, seg_k, mask, bias, causal=causal, scale=scale, ctx=ctx)
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
    q_pos = chunk_positions(jax.lax.axis_index(ctx.axis), T, ctx)
    full = visible(q_pos, jnp.asarray(order, jnp.int32), seg_q, None if seg_k is None else gather(seg_k), causal)
    if mask is not None:
        mask = mask if mask.shape[-1] == 1 else mask[..., order]
        full = mask if full is None else jnp.logical_and(full, mask)
    if bias is not None and bias.shape[-1] != 1:
        bias = bias[..., order]
    full, bias = (_vary_like_query(x, q) for x in (full, bias))
    return jax.nn.dot_product_attention(q, k_all, v_all, bias, full, scale=scale, implementation=kernel)


def _vary_like_query(x: jax.Array | None, q: jax.Array) -> jax.Array | None:
    """``x`` (the mask or bias, built from positions that vary over the context axis only) typed as varying over
    every mesh axis the queries vary over: cuDNN's fused attention is a ``custom_vjp`` whose backward types the
    mask's and bias's cotangents like the queries, which ``shard_map``'s varying-axes check would refuse."""
    if x is None:
        return None
    missing = tuple(sorted(varying_axes(q) - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x
