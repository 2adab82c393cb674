"""Gathering each bucket at its point of use: the model's computation, cut into segments by parameter reads.

``vj.apply`` traces the model once with the gathered leaves as inputs, inlines nested ``jax.jit`` calls, and
finds for every non-stacked bucket the first and the last operation that reads one of its leaves. That range
is the bucket's *segment* (overlapping ranges merge into one segment over several buckets); a bucket read again
after other units ran (a tied embedding: the lookup, the layers, then the head) gets one segment per use. Evaluating the
model, each segment runs through :func:`vescale_jax.step._wire_segment.gather_segment`: the bucket is gathered right
before the segment, tied to the values entering it, and dies with it; its gradient is reduce-scattered inside
the segment's backward. An embedding table is therefore gathered for the lookup and dropped, the head just
before the logits (a tied table gathered again there), in forward and in backward, whatever the model's
structure (NNX, Linen or a plain function), without the user restructuring it.

A segment is *affine* in its leaves when every operation that depends on them is linear in them given its
other inputs (matmuls, lookups, scales, biases, data movement): its backward then reduce-scatters the leaves'
gradient before gathering them again, so a gathered matrix and its full-size gradient are never alive together.
Which JAX primitives count as linear, and which nested calls are inlined, is written in :mod:`vescale_jax._compat`.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

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


def _segments(
    jaxpr: Any,
    leaf_vars: dict[Any, int],
    unit: dict[int, str] | None = None,
    *,
    marks: dict[Any, tuple[str, int]] | None = None,
) -> tuple[list[_Segment], set[int]]:
    """Segments of ``jaxpr`` by the buckets whose leaf variables it reads, and the buckets that cannot have one
    (a leaf returned as an output: gathered up front).

    A bucket read again after other units have run in between, when what those units read is at least its own
    size (a tied embedding read by the lookup and again by the head, around the layers), gets one segment per
    use: it is gathered at each rather than held across them. Smaller interludes (a gate read between a matmul
    and its bias) stay inside one segment.

    Args:
      jaxpr: the model's (inlined) jaxpr.
      leaf_vars: leaf variable -> its bucket.
      unit: bucket -> its unit (default: each bucket its own).
      marks: other variables whose reads show where a unit runs (a stacked layer group's buffer) -> (unit,
        bytes); they get no segment.
    """
    # A copy or view of a leaf stands for the leaf: the segment reaches the matmul that reads a leaf's fp32 cast.
    reads, like = bucket_reads(jaxpr, leaf_vars)
    unit = {b: str(b) for b in set(leaf_vars.values())} if unit is None else unit
    key_unit: dict[Any, str] = {("b", b): u for b, u in unit.items()}
    key_bytes: dict[Any, int] = {}
    for v, b in leaf_vars.items():
        key_bytes[("b", b)] = key_bytes.get(("b", b), 0) + v.aval.size * np.dtype(v.aval.dtype).itemsize
    for v, (u, nbytes) in (marks or {}).items():
        key_unit[("v", id(v))], key_bytes[("v", id(v))] = u, nbytes
    keys: list[set[Any]] = []  # per equation, what it reads
    at: dict[int, list[int]] = {}
    for k, (bs, eqn) in enumerate(zip(reads, jaxpr.eqns, strict=True)):
        for b in bs:
            at.setdefault(b, []).append(k)
        extra = {("v", id(v)) for v in eqn.invars if not is_literal(v) and v in (marks or {})}
        keys.append({("b", b) for b in bs} | extra)
    every = [k for k, ks in enumerate(keys) for _ in {key_unit[x] for x in ks}]
    own: dict[str, list[int]] = {}
    for k, ks in enumerate(keys):
        for u in {key_unit[x] for x in ks}:
            own.setdefault(u, []).append(k)

    def worth_splitting(lo: int, hi: int, b: int) -> bool:
        """Other units read strictly inside ``(lo, hi)``, at least ``b``'s own bytes of them."""
        u = unit[b]
        count = lambda ks: bisect.bisect_left(ks, hi) - bisect.bisect_right(ks, lo)
        if count(every) == count(own[u]):
            return False
        between = {x for k in range(lo + 1, hi) for x in keys[k] if key_unit[x] != u}
        return sum(key_bytes[x] for x in between) >= key_bytes[("b", b)]

    upfront = {like[v] for v in jaxpr.outvars if not is_literal(v) and v in like}
    spans = []
    for b, ks in at.items():
        if b in upfront:
            continue
        lo = ks[0]
        for prev, k in itertools.pairwise(ks):
            if worth_splitting(prev, k, b):
                spans.append((lo, prev + 1, b))
                lo = k
        spans.append((lo, ks[-1] + 1, b))
    spans.sort()
    merged: list[list[Any]] = []
    for lo, hi, b in spans:
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
            if b not in merged[-1][2]:
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
        units = {b: plan.buckets[b].unit for b in flat}
        # a stacked group's buffer is read where its layers run: an interlude between a bucket's uses
        buffer_vars = jaxpr.invars[len(keys) : len(keys) + len(buffers)]
        marks = {
            v: (bucket.unit, bucket.nbytes // max(1, bucket.num_groups))
            for v, bucket in zip(buffer_vars, plan.buckets, strict=True)
            if bucket.layers is not None
        }
        segments, upfront = _segments(jaxpr, leaf_vars, units, marks=marks)

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
