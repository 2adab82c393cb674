"""Newton–Schulz on the owners: the device side of Muon's owner routing.

:func:`route_newton_schulz` is one ``shard_map`` with at most two padded all-to-alls (there and back) around batched
Newton–Schulz on the owners, driven by the static tables of a :class:`~vescale_jax.optim._muon._routing.Routing`:
the messages are packed from the routing's element run tables with the relayout engine's lookup for many runs
(:mod:`vescale_jax.relayout._run_lookup`) and moved by its :func:`~vescale_jax.relayout._execute.exchange_messages`.

Memory: every gather (the outgoing messages, the work arrays of each shape class, each bucket's result) is a loop over
chunks reading the pieces where they lie (:func:`~vescale_jax.relayout._run_lookup.run_gather`): no index array, no
concatenation of the local vector and what arrived, no copy of the all-to-all's operands. At its peak a device holds
about three arrays of its owned work's size (e.g. the local vector, what arrived and the work arrays).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.layout._plan import Plan
from vescale_jax.optim._muon._routing import Routing
from vescale_jax.relayout._execute import exchange_messages
from vescale_jax.relayout._run_lookup import run_gather

__all__ = ["route_newton_schulz"]


def route_newton_schulz(
    buffers: Sequence[jax.Array],
    plan: Plan,
    routing: Routing,
    orthogonalize: Callable[[jax.Array], jax.Array],
    *,
    orthogonalize_split: Callable[[jax.Array, Any], jax.Array] | None = None,
    leaf_scale: np.ndarray | None = None,
    adaptive: bool = False,
    dtype: Any = None,
    operands: Sequence[Any] = (),
) -> list[jax.Array]:
    """Orthogonalises every Muon matrix of ``buffers`` (global bucket buffers) on its owner.

    Args:
      buffers: one global buffer per bucket of ``plan`` (e.g. the momentum).
      plan: the plan.
      routing: from :func:`build_routing`.
      orthogonalize: ``(K, p, q) -> (K, p, q)`` batched Newton–Schulz, ``p <= q``.
      orthogonalize_split: ``(x, axis) -> x`` for split classes: ``x`` is ``(r, p, q_local)``, this device's
        columns of ``r`` matrices; sums over columns need ``psum`` over ``axis`` (the routing's axes, a tuple
        with TP/EP-split buckets). Required if the routing has split classes.
      leaf_scale: optional ``(num_leaves,)`` factor per leaf applied on the owner.
      adaptive: multiply each leaf's result by ``sum(input * result)`` over the leaf (``optax``'s adaptive).
      dtype: working dtype (default: the promoted dtype of the routed buckets).
      operands: replicated values (e.g. traced hyperparameters) passed on as trailing arguments of
        ``orthogonalize`` and ``orthogonalize_split`` (``shard_map`` cannot close over traced values).

    Returns:
      One global buffer per bucket: the orthogonalised matrices in place, zero elsewhere (buckets without
      Muon leaves are all zero).
    """
    rt = routing
    axis = rt.axes  # the plan's axis, or with TP/EP-split buckets their group axes and the plan's axis
    m = len(rt.loads)  # devices the routing runs over
    if rt.splits and orthogonalize_split is None:
        raise ValueError("route_newton_schulz: the routing splits matrices; pass orthogonalize_split")
    if dtype is None:
        dtypes = [jnp.dtype(plan.buckets[b].dtype) for b in rt.buckets] or [jnp.dtype(jnp.float32)]
        dtype = functools.reduce(jnp.promote_types, dtypes)
    scale = np.ones(rt.num_leaves + 1, np.float32) if leaf_scale is None else np.append(leaf_scale, 0.0)
    scale[-1] = 0.0
    lookups = rt.lookups

    n_ops = len(operands)

    trivial = leaf_scale is None and not adaptive  # every factor is 1 (padding slots are never read back)
    sizes = [math.prod(plan.buckets[b].local_shape) for b in rt.buckets]
    bases = np.cumsum([0, *sizes]).tolist()

    def exchange(name, k, sources, first):
        """Each owner's message ``(m, W)`` gathered from ``sources``, through one all-to-all: what arrived,
        one ``(W,)`` array per source device (the messages are never copied into one buffer). Message ``d``
        is seeded from message ``d - 1`` (a loop's result), the first from ``first`` (see ``run_gather``)."""
        if not rt.width:
            return []
        w = rt.width
        rows = []
        for d in range(m):
            rows.append(run_gather(lookups[name], k, d * w, w, sources, dtype, after=rows[-1] if rows else first))
        return exchange_messages(rows, axis=axis)

    def local(*args):
        shards, ops = args[: len(args) - n_ops], args[len(args) - n_ops :]
        k = jax.lax.axis_index(axis)
        # X in pieces (one per routed bucket), then what arrives: every gather reads them where they lie.
        x = [jnp.ravel(shards[b]).astype(dtype) for b in rt.buckets]
        # The first message starts from zeros: X is an element-wise expression (e.g. Nesterov momentum) that XLA
        # would fuse into a read of its element, keeping that expression's inputs alive next to X.
        src = x + exchange("send", k, x, False)
        outs, base = [], 0
        for p, q, kc in rt.classes:
            w_in = jnp.reshape(run_gather(lookups["gather"], k, base, kc * p * q, src, dtype), (kc, p, q))
            outs.append((w_in, orthogonalize(w_in, *ops)))
            base += kc * p * q
        for p, q, r in rt.splits:
            qs = -(-q // m)
            w_in = jnp.reshape(run_gather(lookups["gather"], k, base, r * p * qs, src, dtype), (r, p, qs))
            outs.append((w_in, orthogonalize_split(w_in, axis, *ops)))
            base += r * p * qs
        del src, x
        if trivial:
            results = [b for _, b in outs]
        else:
            leaf_of = jnp.asarray(rt.matrix_leaf)[k]
            factor = jnp.take(jnp.asarray(scale).astype(dtype), leaf_of)
            if adaptive:
                dots = [jnp.sum(jnp.conj(a) * b, axis=(1, 2)) for a, b in outs]  # <input, result>, conj for complex
                dots = jnp.concatenate(dots) if outs else jnp.zeros((0,), dtype)
                once = jnp.where(jnp.asarray(rt.matrix_copy)[k], rt.num_leaves, leaf_of)  # replicas count once
                per_leaf = jax.ops.segment_sum(dots, once, num_segments=rt.num_leaves + 1)
                per_leaf = jax.lax.psum(per_leaf, axis)
                factor = factor * jnp.take(per_leaf, leaf_of)
            results, n0 = [], 0
            for (_, _, kc), (_, b) in zip(rt.classes + rt.splits, outs, strict=True):
                results.append(b * factor[n0 : n0 + kc, None, None])
                n0 += kc
        results = [jnp.ravel(b) for b in results]
        src = results + exchange("back_send", k, results, None)
        out = [jnp.zeros_like(s) for s in shards]
        for i, b in enumerate(rt.buckets):
            back = run_gather(lookups["back_gather"], k, bases[i], sizes[i], src, dtype)
            out[b] = jnp.reshape(back, shards[b].shape).astype(shards[b].dtype)
        return tuple(out)

    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    ops_specs = (jax.sharding.PartitionSpec(),) * n_ops
    mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=(*specs, *ops_specs), out_specs=specs, check_vma=False)
    return list(mapped(*buffers, *operands))
