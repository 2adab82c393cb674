"""A layer's computation cut in two where that halves the parameters its backward holds gathered.

Recomputing a whole layer in backward gathers all of its buckets first and holds them until the layer's
backward reaches their reads: at the turn from recompute to backward, every matrix of the layer is gathered
at once. Cut after the attention block, the backward of the MLP runs first from the saved cut values, with only
the MLP's buckets gathered; the attention's are gathered after the MLP's gradients are reduce-scattered. Each
bucket is still gathered once in forward and once in backward; the cost is the cut values saved per layer
(for a pre-norm transformer block, one residual-stream activation).

:func:`split_layer` finds the cut from the layer's jaxpr: over every position between two operations, the
one minimising the larger half's gathered bytes plus the saved bytes of all layers, taken only if that
beats the uncut layer by an eighth of its gathered bytes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax.step._jaxpr import bucket_reads, evaluate, last_reads, read
from vescale_jax.step._point_of_use import _inline

__all__ = ["Phases", "split_layer"]


@dataclasses.dataclass(frozen=True)
class Phases:
    """The two halves of a layer ``out = fn(gathered, carry, x, *consts)``.

    Attributes:
      first: ``(flat inputs) -> cut values``.
      second: ``(flat inputs, cut values) -> flat outputs``.
      first_buckets: positions (in the layer's bucket list) of the buckets the first half reads.
      second_buckets: those the second half reads.
      saved_bytes: bytes of the cut values of one layer.
    """

    first: Callable[[Sequence[Any]], list[Any]]
    second: Callable[[Sequence[Any], Sequence[Any]], list[Any]]
    first_buckets: frozenset[int]
    second_buckets: frozenset[int]
    saved_bytes: int


def _nbytes(v: Any) -> int:
    aval = v.aval
    if not hasattr(aval, "shape"):
        return 0
    itemsize = getattr(aval.dtype, "itemsize", None)  # a PRNG key's dtype is not a NumPy one (8 bytes: threefry)
    return int(math.prod(aval.shape)) * (np.dtype(aval.dtype).itemsize if itemsize is None else int(itemsize))


def split_layer(
    fn: Callable[..., Any],
    flat_inputs: Sequence[Any],
    leaf_bucket: Sequence[int | None],
    bucket_bytes: Sequence[int],
    num_layers: int,
) -> tuple[Phases, Any] | None:
    """Cuts ``fn(*flat_inputs) -> flat outputs`` in two (see the module docstring), or None.

    Args:
      fn: the layer as a function of flat inputs.
      flat_inputs: example inputs (they carry the varying-axes types).
      leaf_bucket: per flat input, the position of the bucket it is a gathered leaf of, else None.
      bucket_bytes: gathered bytes of each bucket.
      num_layers: how many layers save the cut values.

    Returns:
      ``(Phases, output treedef-free avals)`` or None when no cut pays.
    """
    closed = _inline(jax.make_jaxpr(fn)(*flat_inputs), flat_inputs)
    jaxpr = closed.jaxpr
    n = len(jaxpr.eqns)
    if n < 2:
        return None
    invars = list(jaxpr.invars)
    bucket_of = {v: b for v, b in zip(invars, leaf_bucket, strict=True) if b is not None}
    reads, _ = bucket_reads(jaxpr, bucket_of)  # a cast, reshape or slice of a leaf stands for the leaf
    defined_at = {v: k for k, e in enumerate(jaxpr.eqns) for v in e.outvars}
    last_read = last_reads(jaxpr)
    prefix = [set()]
    for r in reads:
        prefix.append(prefix[-1] | r)
    suffix = [set() for _ in range(n + 1)]
    for k in range(n - 1, -1, -1):
        suffix[k] = suffix[k + 1] | reads[k]
    total = sum(bucket_bytes[b] for b in prefix[n])
    size = lambda bs: sum(bucket_bytes[b] for b in bs)
    # Saved bytes of a cut at k: values defined before k and read at or after k.
    crossing = [0] * (n + 1)
    for v, d in defined_at.items():
        r = last_read.get(v, -1)
        for k in range(d + 1, min(r, n) + 1):
            crossing[k] += _nbytes(v)
    best, best_k = total, None
    for k in range(1, n):
        if not prefix[k] or not suffix[k] or prefix[k] == suffix[k]:
            continue
        cost = max(size(prefix[k]), size(suffix[k])) + num_layers * crossing[k]
        if cost < best:
            best, best_k = cost, k
    if best_k is None or best > total - total // 8:
        return None
    k = best_k
    cut = [v for v, d in defined_at.items() if d < k and last_read.get(v, -1) >= k]

    def env_of(xs):
        env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(invars, xs, strict=True))
        return env

    def first(xs):
        env = evaluate(jaxpr.eqns[:k], env_of(xs))
        return [env[v] for v in cut]

    def second(xs, cut_values):
        env = env_of(xs)
        env.update(zip(cut, cut_values, strict=True))
        env = evaluate(jaxpr.eqns[k:], env)
        return [read(env, v) for v in jaxpr.outvars]

    phases = Phases(first, second, frozenset(prefix[k]), frozenset(suffix[k]), sum(_nbytes(v) for v in cut))
    return phases, [v.aval for v in cut]
