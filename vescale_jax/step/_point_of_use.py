"""Gathering each bucket at its point of use: the model's computation, cut into segments by parameter reads.

``vj.apply`` traces the model once with the gathered leaves as inputs, inlines nested ``jax.jit`` calls, and
finds for every non-stacked bucket the first and the last operation that reads one of its leaves. That range
is the bucket's *segment* (overlapping ranges merge into one segment over several buckets). Evaluating the
model, each segment runs through :func:`vescale_jax.step._wire_segment.gather_segment`: the bucket is gathered right
before the segment, tied to the values entering it, and dies with it; its gradient is reduce-scattered inside
the segment's backward. An embedding table is therefore gathered for the lookup and dropped, the head just
before the logits, in forward and in backward, whatever the model's structure (NNX, Linen or a plain
function), without the user restructuring it.

A segment is *affine* in its leaves when every operation that depends on them is linear in them given its
other inputs (matmuls, lookups, scales, biases, data movement): its backward then reduce-scatters the leaves'
gradient before gathering them again, so a gathered matrix and its full-size gradient are never alive together.
Which JAX primitives count as linear, and which nested calls are inlined, is written in :mod:`vescale_jax._compat`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from vescale_jax._compat import bind_equation, is_linear_in, is_literal, is_nested_call, nested_call_jaxpr
from vescale_jax.layout._plan import Plan
from vescale_jax.step import _wire as collectives
from vescale_jax.step._jaxpr import bucket_reads, evaluate, last_reads, read
from vescale_jax.step._wire import Gather, example_leaves, gather_leaves
from vescale_jax.step._wire_segment import gather_segment

__all__ = ["at_point_of_use"]


@dataclasses.dataclass(frozen=True)
class _Segment:
    start: int
    stop: int  # one past the last operation
    buckets: tuple[int, ...]
    affine: bool


def _inline(closed: Any, xs: Sequence[Any]) -> Any:
    """``closed`` with nested ``jit`` / ``closed_call`` equations inlined (their operations become visible),
    traced again on ``xs`` (which carry the varying-axes types)."""
    return jax.make_jaxpr(lambda *ys: _eval_inlined(closed, ys))(*xs)


def _eval_inlined(closed: Any, xs: Sequence[Any]) -> list[Any]:
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, xs, strict=True))
    for eqn in jaxpr.eqns:
        invals = [read(env, v) for v in eqn.invars]
        if is_nested_call(eqn):
            outs = _eval_inlined(nested_call_jaxpr(eqn), invals)
        else:
            outs = bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(env, v) for v in jaxpr.outvars]


def _segments(jaxpr: Any, leaf_vars: dict[Any, int]) -> tuple[list[_Segment], set[int]]:
    """Segments of ``jaxpr`` by the buckets whose leaf variables it reads (``leaf_vars``: var -> bucket), and
    the buckets that cannot have one (a leaf returned as an output: gathered up front)."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    # A copy or view of a leaf stands for the leaf: the segment reaches the matmul that reads a leaf's fp32 cast.
    reads, like = bucket_reads(jaxpr, leaf_vars)
    for k, bs in enumerate(reads):
        for b in bs:
            first.setdefault(b, k)
            last[b] = k
    upfront = {like[v] for v in jaxpr.outvars if not is_literal(v) and v in like}
    spans = sorted((first[b], last[b] + 1, b) for b in first if b not in upfront)
    merged: list[list[Any]] = []
    for lo, hi, b in spans:
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
            merged[-1][2].append(b)
        else:
            merged.append([lo, hi, [b]])
    out = []
    for lo, hi, bs in merged:
        dep = {v for v, b in leaf_vars.items() if b in bs}
        affine = True
        for eqn in jaxpr.eqns[lo:hi]:
            pos = [i for i, v in enumerate(eqn.invars) if not is_literal(v) and v in dep]
            if pos:
                affine = affine and is_linear_in(eqn, pos)
                dep.update(eqn.outvars)
        out.append(_Segment(lo, hi, tuple(bs), affine))
    return out, upfront


def at_point_of_use(
    fn: Callable[..., Any],
    plan: Plan,
    how: Gather,
    build: Callable[[Sequence[jax.Array], dict[int, jax.Array]], Any],
    *,
    keep: bool,
) -> Callable[..., Any]:
    """``(local_buffers, *args) -> fn(build(buffers, gathered), *args)`` with every non-stacked bucket gathered
    at its point of use (see the module docstring); call inside ``shard_map``.

    Args:
      fn: the model ``(tree, *args) -> outputs``.
      plan: the plan.
      how: the gather options.
      build: ``(buffers, {leaf index: gathered leaf}) -> tree`` (stacked buckets become stand-ins there).
      keep: keep the gathered leaves for the backward instead of gathering them again.
    """
    flat = [b for b, bucket in enumerate(plan.buckets) if bucket.layers is None and bucket.layout.total_size]
    empty = [b for b, bucket in enumerate(plan.buckets) if bucket.layers is None and not bucket.layout.total_size]

    def local(buffers, *args):
        buffers = list(buffers)
        gathered_empty = {}
        for b in empty:
            leaves = gather_leaves(buffers[b], plan.buckets[b], plan, how)
            gathered_empty.update(zip(plan.buckets[b].leaves, leaves, strict=True))
        keys = [i for b in flat for i in plan.buckets[b].leaves]
        examples = [x for b in flat for x in example_leaves(buffers[b], plan.buckets[b], plan, how)]

        def model(leaves, buffers_, args_):
            return fn(build(buffers_, {**gathered_empty, **dict(zip(keys, leaves, strict=True))}), *args_)

        in_flat, in_tree = jax.tree.flatten((examples, buffers, args))
        closed, out_shape = jax.make_jaxpr(lambda *xs: model(*jax.tree.unflatten(in_tree, xs)), return_shape=True)(
            *in_flat
        )
        closed = _inline(closed, in_flat)
        jaxpr = closed.jaxpr
        bucket_of = {i: b for b in flat for i in plan.buckets[b].leaves}
        leaf_vars = {v: bucket_of[i] for v, i in zip(jaxpr.invars[: len(keys)], keys, strict=True)}
        var_of = dict(zip(keys, jaxpr.invars[: len(keys)], strict=True))
        segments, upfront = _segments(jaxpr, leaf_vars)

        env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(jaxpr.invars[len(keys) :], in_flat[len(keys) :], strict=True))
        for b in sorted(upfront):  # a leaf the model returns: gathered up front (differentiable)
            leaves = collectives._gather_bucket(buffers[b], plan.buckets[b], plan, how)
            env.update((var_of[i], x) for i, x in zip(plan.buckets[b].leaves, leaves, strict=True))
        last_read = last_reads(jaxpr)
        k = 0
        by_start = {s.start: s for s in segments}
        while k < len(jaxpr.eqns):
            seg = by_start.get(k)
            if seg is None:
                evaluate([jaxpr.eqns[k]], env)
                k += 1
                continue
            eqns = jaxpr.eqns[seg.start : seg.stop]
            leaf_set = {var_of[i] for b in seg.buckets for i in plan.buckets[b].leaves}
            defined = {v for e in eqns for v in e.outvars}
            inputs = list(
                dict.fromkeys(
                    v for e in eqns for v in e.invars if not is_literal(v) and v not in defined and v not in leaf_set
                )
            )
            outputs = [v for v in dict.fromkeys(v for e in eqns for v in e.outvars) if last_read.get(v, -1) >= seg.stop]

            def seg_fn(ws, others, eqns=eqns, inputs=inputs, outputs=outputs, seg=seg):
                e = dict(zip(inputs, others, strict=True))
                for b, leaves in zip(seg.buckets, ws, strict=True):
                    e.update((var_of[i], x) for i, x in zip(plan.buckets[b].leaves, leaves, strict=True))
                evaluate(eqns, e)
                return [e[v] for v in outputs]

            outs = gather_segment(
                seg_fn,
                [buffers[b] for b in seg.buckets],
                [plan.buckets[b] for b in seg.buckets],
                plan,
                how,
                [env[v] for v in inputs],
                keep=keep,
                affine=seg.affine,
            )
            env.update(zip(outputs, outs, strict=True))
            k = seg.stop
        return jax.tree.unflatten(jax.tree.structure(out_shape), [read(env, v) for v in jaxpr.outvars])

    return local
