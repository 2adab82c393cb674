"""The FSDP train-step transform: ``vj.fsdp`` and ``vj.apply``.

A ``vj.fsdp`` step is traced at the global level: parameters (:class:`ShardedParams`) and optimizer state are
flat buffers sharded over the plan's axis, so element-wise Optax transforms run on the shards unchanged and
reductions such as a global norm are global (the partitioner adds a scalar all-reduce). The model itself runs
through :func:`apply`, a ``shard_map`` over the mesh in which each device sees its batch shard and gathers the
parameters it needs. Every collective on parameters and gradients is in :mod:`vescale_jax.step._wire` (and its
companions ``_wire_segment``, ``_wire_copies``):

* every non-stacked bucket is all-gathered at its point of use (:mod:`._point_of_use`: the model's jaxpr cut
  into segments by parameter reads); with reshard-after-forward (the default) the backward gathers it again,
  after reduce-scattering its gradient where the segment is affine in it;
* stacked layer groups stay as :class:`vescale_jax.LayerShard` stand-ins that :func:`vescale_jax.scan_layers`
  gathers one layer per loop iteration (a cut layer's backward in two halves, :mod:`vescale_jax.step._layer_split`);
* the transpose of each gather is one reduce-scatter of the packed gradient into the local shard, so ``grads``
  come back as a :class:`ShardedParams` in the same layout, with exactly zero gradient in the padding.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from vescale_jax._cache import plan_cache
from vescale_jax._compat import is_tracer
from vescale_jax.kernels import KernelPolicy
from vescale_jax.layout._checks import int_grad_message, plan_difference
from vescale_jax.layout._plan import Plan
from vescale_jax.state._checks import check_sharded_params, check_state_not_logical, plan_states
from vescale_jax.state._containers import GatheredParams, ShardedParams
from vescale_jax.state._offloaded import Offload, has_offloaded, is_offloaded
from vescale_jax.state._padding import zero_padding
from vescale_jax.state._placement import constrain_outputs
from vescale_jax.step._batch import _check_batch, _check_placed, _data_size, place_batch
from vescale_jax.step._checks import check_kernel_policy, check_microbatches, check_precision_type, check_step_outputs
from vescale_jax.step._context import Context
from vescale_jax.step._context_batch import ContextBatch, context_batch
from vescale_jax.step._control_flow import checked_model
from vescale_jax.step._fp32_grads import widened
from vescale_jax.step._layer_loops import with_layer_loops
from vescale_jax.step._model_call import model_call
from vescale_jax.step._offload import stream_offloaded
from vescale_jax.step._outputs import split_or_whole
from vescale_jax.step._point_of_use import at_point_of_use
from vescale_jax.step._policy import StepPolicy, enclosing_policy, running
from vescale_jax.step._precision import MixedPrecision
from vescale_jax.step._random import split_draws
from vescale_jax.step._scan_layers import LayerShard
from vescale_jax.step._wire import Gather
from vescale_jax.step._wire_copies import unpack_copies

__all__ = ["apply", "fsdp"]


def _check_same_plan(got: Plan, plan: Plan, fn: str) -> None:
    """Raises, saying how they differ, when the params' plan is not ``plan=``."""
    if got != plan:
        raise ValueError(
            f"{fn}: params were sharded with another plan than plan= (fingerprint {got.fingerprint()[:12]}, "
            f"expected {plan.fingerprint()[:12]}: {plan_difference(got, plan)}); re-shard them with this "
            "plan (vj.shard(vj.unshard(params), plan)), or leave plan= out to run on the plan the params carry."
        )


def _check_params(params: Any, plan: Plan, what: str = "params", fn: str = "vj.fsdp") -> None:
    check_sharded_params(params, fn, what=what)
    _check_same_plan(params.plan, plan, fn)
    for bucket, buf in zip(plan.buckets, params.buffers, strict=True):
        if tuple(getattr(buf, "shape", ())) != bucket.shape or np.dtype(buf.dtype) != np.dtype(bucket.dtype):
            raise ValueError(
                f"{fn}: {what} buffer of bucket {bucket.name!r} has shape {tuple(buf.shape)} {buf.dtype}, the plan "
                f"expects {bucket.shape} {bucket.dtype}."
            )


def _check_not_donated(params: ShardedParams, opt_state: Any, *rest: Any) -> None:
    """Raises, naming the bucket or state leaf, on an input whose buffers were deleted (donated to an earlier
    step): executing a step on them crashes the process instead of raising."""
    names = [f"the buffer of bucket {b.name!r}" for b in params.plan.buckets]
    trees = [("params", "these params", list(zip(names, params.buffers, strict=True)))]
    for what, tree in (("opt_state", opt_state), ("batch", rest[0] if rest else None), ("extra argument", rest[1:])):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        trees.append(
            (what, f"this {what}", [(f"{what} leaf {jax.tree_util.keystr(p) or '<root>'}", x) for p, x in leaves])
        )
    for what, these, named in trees:
        for name, leaf in named:
            if isinstance(leaf, jax.Array) and not is_tracer(leaf) and leaf.is_deleted():
                one = "ones" if what == "params" else "one"
                raise ValueError(
                    f"vj.fsdp: {these} {'were' if what == 'params' else 'was'} donated to the last step; use the "
                    f"returned {one} ({name} is deleted). The step donates params and opt_state: write "
                    "`params, opt_state, ... = step(params, opt_state, batch)`, or compile with donate=False to "
                    "keep the inputs."
                )


def _check_opt_state(opt_state: Any, plan: Plan, offload: Offload | None = None) -> None:
    """Every ``ShardedParams`` / ``PerDevice`` (or offloaded one) in the optimizer state must belong to the step's
    plan, and be in host memory exactly when the step offloads the state."""
    offloaded = [
        (jax.tree_util.keystr(p) or "<root>", x)
        for p, x in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_offloaded)[0]
        if is_offloaded(x)
    ]
    active = offload is not None and offload.active
    if active and plan_states(opt_state):
        path = plan_states(opt_state)[0][0]
        raise ValueError(
            f"vj.fsdp: the step keeps the optimizer state in host memory (offload={offload}) but opt_state{path} "
            "is on the device; build the state with vj.init_opt_state(tx, params, offload=...) or move it with "
            "vj.offload(opt_state, offload)."
        )
    if offloaded and not active:
        raise ValueError(
            f"vj.fsdp: opt_state{offloaded[0][0]} is in host memory (vj.Offloaded) but the step was built without "
            "offload=; build it with vj.fsdp(..., offload=vj.Offload()) or bring the state back with "
            "vj.onload(opt_state)."
        )
    for path, node in [*plan_states(opt_state), *offloaded]:
        if node.plan != plan:
            raise ValueError(
                f"vj.fsdp: opt_state{path} is a {type(node).__name__} of another plan "
                f"({plan_difference(node.plan, plan)}); build the state from this step's params: "
                "opt_state = vj.init_opt_state(tx, params)."
            )


def _check_precision(precision: MixedPrecision | None, plan: Plan, fn: str = "vj.fsdp") -> None:
    check_precision_type(precision, fn)
    if precision is None or precision.master_dtype is None:
        return
    for bucket in plan.buckets:
        if jnp.issubdtype(np.dtype(bucket.dtype), jnp.floating) and bucket.dtype != precision.master_dtype:
            raise ValueError(
                f"vj.fsdp: bucket {bucket.name!r} holds {bucket.dtype} parameters but the policy's master dtype is "
                f"{precision.master_dtype}; plan and shard the parameters in {precision.master_dtype} "
                "(e.g. jax.tree.map(lambda x: x.astype(...), params) before vj.plan)."
            )


def _tree(plan: Plan, buffers: Sequence[jax.Array], gathered: dict[int, jax.Array], policy: StepPolicy) -> Any:
    """The logical tree the model sees: gathered leaves, and stand-ins for stacked layer groups."""
    leaves: list[Any] = [None] * len(plan.leaves)
    for bucket, local in zip(plan.buckets, buffers, strict=True):
        for i in bucket.leaves:
            leaves[i] = LayerShard(local, plan, i, policy) if bucket.layers is not None else gathered[i]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def _narrow_leaves(plan: Plan, how: Gather) -> list[Any]:
    """Per leaf: the dtype the model sees for a leaf gathered wide (:meth:`Gather.widens`), else None."""
    out: list[Any] = [None] * len(plan.leaves)
    for bucket in plan.buckets:
        if bucket.layers is None:
            for i in bucket.leaves:
                out[i] = how.model_dtype(bucket.dtype)
    return out


def apply(
    fn: Callable[..., Any],
    params: ShardedParams,
    *args: Any,
    data_axes: str | Sequence[str] | None = None,
    reshard_after_forward: bool | None = None,
    prefetch: bool | None = None,
    precision: MixedPrecision | None = None,
    in_specs: Any = None,
    out_specs: Any = None,
    kernels: KernelPolicy | None = None,
    plan: Plan | None = None,
    state: Any = None,
    **kwargs: Any,
) -> Any:
    """Runs ``fn(logical_params, *args, **kwargs)`` on every device's batch shard with gathered parameters.

    Args:
      fn: the model: ``(params_tree, *args, **kwargs) -> outputs``. It sees the plan's logical tree: non-stacked
        leaves as full arrays, stacked layer groups as stand-ins to pass to :func:`vj.scan_layers`.
      params: the sharded parameters (global buffers; under ``vj.fsdp`` these are the step's params).
      *args: batch-like inputs whose dim 0 is split over the data axes.
      **kwargs: keyword arguments of ``fn``, batch inputs like ``args``. The batch size ``B`` is the leading dim
        of ``args`` (of the first keyword argument holding an array when ``args`` has none). An array leaf
        (``jax.Array`` / ``numpy``) with leading dim ``B`` is split over the data axes; any other array is passed
        whole (the same on every device); Python values (``bool``, ``int``, ``float``, ``None``, ...) are static.
        To pass an array of leading dim ``B`` whole, close over it instead. ``in_specs`` covers ``args`` only.
      state: model state other than the parameters (e.g. BatchNorm statistics), passed whole to every device:
        ``fn`` is then called as ``fn(params_tree, *args, state=state, **kwargs)`` and returns ``(outputs,
        new_state)``. Every leaf of ``new_state`` must be the same on every device (computed from global-batch
        quantities, e.g. through a ``jax.lax.pmean`` over the data axes); a leaf that varies over the data axes
        raises, naming it.
      data_axes: mesh axes the batch is split over (default: the enclosing ``vj.fsdp``'s, else the plan's axis).
      reshard_after_forward: drop gathered parameters after the forward and gather them again in backward
        (default: the enclosing ``vj.fsdp``'s, else True).
      prefetch: in :func:`vj.scan_layers`, gather the next layer while computing the current one (default: the
        enclosing ``vj.fsdp``'s, else False).
      precision: a :class:`vj.MixedPrecision` policy (default: the enclosing ``vj.fsdp``'s, else none).
      in_specs: ``PartitionSpec`` prefix for ``args`` (default: dim 0 over the data axes).
      out_specs: ``PartitionSpec`` prefix for the outputs. Default: an output that varies over the data axes is
        per-example, dim 0 split over them (a scalar computed per device raises: compute it with
        :func:`vj.batch_mean` or return per-example values); one that does not (a statistic computed with
        :func:`vj.batch_mean` / :func:`vj.batch_sum`, or from the parameters alone) is returned whole, as the
        unsharded model returns it.
      kernels: a :class:`vj.kernels.KernelPolicy`: XLA or the Pallas kernels for unpack and pack (default: the
        enclosing ``vj.fsdp``'s, else ``KernelPolicy.from_env()``).
      plan: optional: the model runs on the plan ``params`` carry; given, it must be that plan (another one
        raises, saying how they differ).

    Returns:
      ``fn``'s outputs as global arrays; with ``state``: ``(outputs, new_state)``, ``new_state`` replicated.

    Sharding:
      A ``shard_map`` over the plan's mesh. Each non-stacked bucket is all-gathered once, right before the first
      operation that reads it, and dropped after the last (gathered again in backward with
      reshard-after-forward, where the backward reads its values); its gradient is reduce-scattered back into the
      bucket's layout.
    """
    if plan is not None and isinstance(params, ShardedParams | GatheredParams):
        _check_same_plan(params.plan, plan, "vj.apply")
    if isinstance(params, GatheredParams):
        return _apply_gathered(fn, params, args, kwargs, state, data_axes, in_specs, out_specs, kernels)
    if not callable(fn):
        raise TypeError(
            f"vj.apply: the first argument must be the model function (params_tree, *args) -> outputs, got "
            f"{type(fn).__name__}; call vj.apply(fn, params, *batch)."
        )
    check_sharded_params(params, "vj.apply")
    check_precision_type(precision, "vj.apply")
    plan = params.plan
    policy = _policy_of_apply(
        plan, data_axes, kernels, reshard_after_forward=reshard_after_forward, prefetch=prefetch, precision=precision
    )
    fn, args, in_specs, out_specs, finish = _model_specs(
        with_layer_loops(fn),  # the model's own scan over a stacked group runs as vj.scan_layers
        args,
        kwargs,
        state,
        plan,
        policy.data_axes,
        in_specs,
        out_specs,
        typed=policy.kernels.check_vma,
        context=policy.context,
    )

    how = policy.wire()
    fn = widened(fn, _narrow_leaves(plan, how), is_leaf=lambda x: isinstance(x, LayerShard))
    build = lambda buffers, gathered: _tree(plan, buffers, gathered, policy)
    local = at_point_of_use(fn, plan, how, build, keep=not policy.reshard_after_forward)

    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    # The Pallas interpreter's loops do not track varying mesh axes: the policy turns the check off then.
    mapped = jax.shard_map(
        local, mesh=plan.mesh, in_specs=(specs, *in_specs), out_specs=out_specs, check_vma=policy.kernels.check_vma
    )
    return finish(mapped(params.buffers, *args))


def _model_specs(
    fn, args, kwargs, state, plan: Plan, axes: tuple[str, ...], in_specs: Any, out_specs: Any, *, typed, context=None
):
    """``(fn, args, in_specs, out_specs, finish)`` over flat inputs: the positional batch (split on dim 0 over
    ``axes`` by default: checked and, on Explicit axes, required to be placed so), then the keyword arrays (split
    or whole, :mod:`vescale_jax.step._model_call`) and the state (whole, returned whole).

    The model is wrapped, innermost first: draws from keys that are the same on every device become this
    device's part of the unsharded draw (:mod:`vescale_jax.step._random`); its control flow is checked and
    ``vj.batch_mean`` reduces over ``axes`` while it is traced (:mod:`vescale_jax.step._control_flow`); by default
    its outputs are per-example or, for those that do not depend on the batch, whole
    (:mod:`vescale_jax.step._outputs`; ``finish`` maps the ``shard_map``'s outputs to the model's).

    With a ``context`` axis the batch leaves of two or more dims also have dim 1 split over it, in the balanced
    order, and per-token outputs come back in the global order (:mod:`vescale_jax.step._context_batch`)."""
    default_specs = in_specs is None
    if in_specs is None:
        _check_batch(args, _data_size(plan.mesh, axes), axes, what="vj.apply argument")
        _check_placed(args, plan, axes)
        in_specs = tuple(P(axes) for _ in args)
    call = model_call(fn, args, kwargs, state, axes=axes)
    if call.split:
        what = "vj.apply keyword argument"
        _check_batch(call.split, _data_size(plan.mesh, axes), axes, what=what)
        _check_placed(call.split, plan, axes, what=what)
    in_specs = (*in_specs, *call.extra_specs)
    flat_args = (*args, *call.extra)
    size = _data_size(plan.mesh, axes)
    # The model at the global arguments' shapes (known when each argument is split on dim 0 or passed whole).
    known = all(spec == P(axes) or spec == P() for spec in in_specs)
    shapes = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in jax.tree.leaves(flat_args)] if known else None
    seq = None
    if context is not None:
        if not default_specs:
            raise ValueError(
                f"vj.apply: in_specs= with a context axis ({context.axis!r}): the step splits the batch's dim 0 "
                "over the data axes and its dim 1 over the context axis itself; leave in_specs out."
            )
        seq = context_batch(context, args, call.split)
    if seq is not None:
        flat_args, in_specs = _sequence_split(flat_args, in_specs, axes, seq, plan.mesh)
    model_axes = axes if seq is None else (*axes, context.axis)

    def global_outputs(tree, *local_args):
        if shapes is None:
            return None
        global_args = jax.tree.unflatten(jax.tree.structure(local_args), shapes)
        out = jax.eval_shape(call.fn, tree, *global_args)
        return jax.tree.leaves(out[0] if state is not None else out)

    fn = split_draws(
        call.fn,
        axes=axes,
        size=size,
        check_vma=typed,
        global_args=_global_args(shapes),
        context=None if seq is None else context,
    )
    dependence: list[bool] = []
    whole = [spec == P() for spec in in_specs]
    fn = checked_model(fn, model_axes, typed=typed, dependence=dependence, whole=whole, sequence=seq)
    finish = lambda out: out
    if out_specs is None:
        out_specs = P(axes) if seq is None else seq.spec(axes)
        batch = None if call.batch is None else call.batch // size
        fn, finish = split_or_whole(
            fn,
            axes,
            plan.mesh,
            dependence,
            state=state is not None,
            batch=batch,
            global_outputs=global_outputs,
            sequence=seq,
        )
    elif seq is not None:
        raise ValueError(
            f"vj.apply: out_specs= with a context axis ({context.axis!r}): per-token outputs come back in the "
            "global order, which needs the default outputs; leave out_specs out."
        )
    if state is not None:
        out_specs = (out_specs, P())
    return fn, flat_args, in_specs, out_specs, finish


def _sequence_split(flat_args, in_specs, axes: tuple[str, ...], seq: ContextBatch, mesh: jax.sharding.Mesh):
    """The batch arguments with each sequence leaf in the devices' order and its spec splitting dim 1 over the
    context axis (arguments passed whole keep ``P()``); on Explicit axes resharded so (``shard_map`` does not
    move an input)."""
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def place(x):
        x = seq.to_devices(x)
        return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, seq.spec(axes))) if explicit else x

    args, specs = [], []
    for arg, spec in zip(flat_args, in_specs, strict=True):
        if spec != P(axes):
            args.append(arg)
            specs.append(spec)
            continue
        args.append(jax.tree.map(lambda x: place(x) if seq.carries(x) else x, arg))
        specs.append(jax.tree.map(lambda x: seq.spec(axes) if seq.carries(x) else P(axes), arg))
    return tuple(args), tuple(specs)


def _global_args(shapes: list[Any] | None) -> Callable[[Any], Any] | None:
    """For :func:`vescale_jax.step._random.split_draws`: the local argument leaves' global shapes."""
    if shapes is None:
        return None
    return lambda leaves: shapes if len(leaves) == len(shapes) else None


def _policy_of_apply(plan: Plan, data_axes: Any, kernels: KernelPolicy | None, **options: Any) -> StepPolicy:
    """``vj.apply``'s policy: the enclosing step's (outside one: the defaults, kernels from the environment)
    with ``vj.apply``'s own arguments over it."""
    outer = enclosing_policy() or StepPolicy.for_plan(plan, kernels=KernelPolicy.from_env())
    kernels = None if kernels is None else check_kernel_policy(kernels, "vj.apply")
    return outer.refined(plan, data_axes=data_axes, kernels=kernels, **options)


def _apply_gathered(fn, params, args, kwargs, state, data_axes, in_specs, out_specs, kernels):
    """``vj.apply`` on full per-device copies (``vj.accumulate(..., reduce="once")``): no collective at all."""
    plan = params.plan
    policy = _policy_of_apply(plan, data_axes, kernels)
    fn, args, in_specs, out_specs, finish = _model_specs(
        fn, args, kwargs, state, plan, policy.data_axes, in_specs, out_specs, typed=policy.kernels.check_vma
    )
    how = policy.wire()
    # widened buckets' copies are fp32 upcasts (gather_copies): the model sees their leaves in the bucket's dtype
    fn = widened(fn, [how.model_dtype(plan.buckets[plan.leaves[i].bucket].dtype) for i in range(len(plan.leaves))])

    def local(copies, *local_args):
        return fn(jax.tree_util.tree_unflatten(plan.treedef, unpack_copies(copies, plan, how)), *local_args)

    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    mapped = jax.shard_map(
        local, mesh=plan.mesh, in_specs=(specs, *in_specs), out_specs=out_specs, check_vma=how.kernels.check_vma
    )
    return finish(mapped(params.buffers, *args))


def fsdp(
    step: Callable[..., Any] | None = None,
    *,
    plan: Plan | None = None,
    data_axes: str | Sequence[str] | None = None,
    reshard_after_forward: bool = True,
    prefetch: bool = False,
    precision: MixedPrecision | None = None,
    microbatches: int | None = None,
    donate: bool = True,
    kernels: KernelPolicy | None = None,
    offload: Offload | None = None,
    context_axis: str | None = None,
    balance: str | None = "causal",
    context_kv: str = "keep",
) -> Callable[..., Any]:
    """Compiles a train step ``step(params, opt_state, batch, *rest) -> (params, opt_state, ...)`` for FSDP.

    Usable as ``@vj.fsdp``, ``@vj.fsdp(microbatches=4)`` or ``vj.fsdp(step)``. Inside the step, ``params`` is a
    :class:`ShardedParams` of global flat buffers: compute the loss with :func:`vj.apply` (or an adapter in
    ``vj.flax``), then use ``jax.value_and_grad``, ``tx.update`` and ``optax.apply_updates`` as usual.

    Args:
      step: the train step.
      plan: optional: the step runs on the plan its params carry (``params.plan``); given, the params must have
        been sharded with it (a params of another plan raises, saying how the two differ), and the options
        are checked against it when the step is built rather than at its first call.
      data_axes: mesh axes the batch's dim 0 is split over (default: the plan's axis).
      reshard_after_forward: drop gathered parameters after the forward and gather again in backward (default)
        or keep them for the backward (fewer all-gathers, more memory).
      prefetch: in stacked layer groups, gather layer ``j + 1`` while layer ``j`` computes, so the collective can
        overlap compute. It costs one to two more gathered layers of memory (XLA double-buffers the loop-carried
        copy), so the default gathers each layer right before its use and leaves overlap to XLA's scheduler
        (on GPU, ``--xla_gpu_enable_pipelined_all_gather`` pipelines the loop's gathers itself).
      precision: a :class:`vj.MixedPrecision` policy: gather and compute in ``compute_dtype`` (the local shard
        is cast before the all-gather), reduce-scatter gradients in ``reduce_dtype``; the master shards,
        gradients and optimizer state keep the plan's dtype.
      microbatches: hand the step the batch as ``k`` micro-batches (leaves ``(k, B/k, ...)``, dim 1 split over
        the data axes) for :func:`vj.accumulate`.
      donate: donate ``params`` and ``opt_state`` buffers to the outputs. The step must then return
        ``(params, opt_state, *rest)`` (checked when it is first traced); with ``donate=False`` (an evaluation
        step) it may return anything.
      kernels: a :class:`vj.kernels.KernelPolicy`: how gathered buckets are unpacked and gradients packed
        (XLA or the Pallas kernels). Default: ``KernelPolicy.from_env()``, read once, here.
      offload: a :class:`vj.Offload`: keep the optimizer state in host memory between steps (build it with
        ``vj.init_opt_state(tx, params, offload=...)``). The step runs the forward and backward with no optimizer
        state on the device, then brings each bucket's state to the device, updates it and sends it back, one
        piece at a time (a layer of a stacked group when the update is element-wise, else the whole bucket);
        the results are bit for bit those of the step without offload. The step must return
        ``(params, opt_state, *rest)``.
      context_axis: a mesh axis (not the plan's axis nor a data axis) to split the batch's sequence over: context
        parallelism. Inside :func:`vj.apply` every batch leaf of two or more dims has its dim 1 (the sequence)
        split over it; the model must then attend with :func:`vj.attention`, take positions from
        :func:`vj.positions` and reduce over tokens with :func:`vj.batch_mean` (a hand-written mix of tokens is
        refused when the step is traced, naming its line). Parameters stay sharded over the plan's axis only,
        gathered once per point of use on every device; gradients are summed over the context axis.
        See ``docs/context.md``.
      balance: with ``context_axis``: ``"causal"`` (the default) gives each device chunks ``i`` and
        ``2·cp − 1 − i`` of ``2·cp`` equal chunks, so causal attention costs every device the same; ``None``
        gives device ``i`` the ``i``-th contiguous chunk.
      context_kv: with ``context_axis``, what the backward of a :func:`vj.scan_layers` layer does for the keys
        and values the layer's ``vj.attention`` gathered over the context axis: ``"keep"`` (the default) keeps
        them from the forward (per layer, the gathered K and V of this device's sequences stay in memory until
        the layer's backward; K/V traffic: one all-gather and one reduce-scatter per layer), ``"regather"``
        gathers them again when the layer is recomputed (no such memory, 1.5x the K/V traffic).

    Returns:
      The compiled step. It checks its inputs (params and every ``ShardedParams`` / ``PerDevice`` of the
      optimizer state against the plan, the batch against the data-parallel size), places the batch with
      :func:`data_sharding` and keeps the outputs' ``ShardedParams`` sharded like their buckets and their
      ``PerDevice`` values split on dim 0 (any other output keeps the sharding its computation gives it).
      ``.lower(...)`` gives the lowered computation for inspection (``lowering_platforms=("cuda",)`` lowers
      it for GPU on a CPU machine), ``.trace(...)`` the traced one. The step composes: it can be called under
      an outer ``jax.jit`` or ``jax.export`` (the checks read shapes, and the jitted step nests). One
      :class:`StepPolicy` and one compilation per plan the step meets.

    Sharding:
      Params and optimizer state stay sharded over the plan's axis; the batch (argument 2 and any further
      arguments) is split on dim 0 over ``data_axes`` (and, inside :func:`vj.apply`, on dim 1 over
      ``context_axis``); other outputs (loss, metrics) are global values.
    """
    if isinstance(step, Plan):
        raise TypeError(
            "vj.fsdp: the plan is keyword-only (and optional: the step reads it from its params): write @vj.fsdp, "
            "@vj.fsdp(plan=plan) or vj.fsdp(step, plan=plan)."
        )
    if step is not None and not callable(step):
        raise TypeError(f"vj.fsdp: step must be the train-step function, got {type(step).__name__}.")
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(
            f"vj.fsdp: plan= must be a vj.Plan (from vj.plan(params, mesh)), got {type(plan).__name__}; leave it "
            "out (the step uses the plan its params carry) or write vj.fsdp(step, plan=plan)."
        )
    microbatches = check_microbatches(microbatches, "vj.fsdp")
    if step is None:
        return functools.partial(
            fsdp,
            plan=plan,
            data_axes=data_axes,
            reshard_after_forward=reshard_after_forward,
            prefetch=prefetch,
            precision=precision,
            microbatches=microbatches,
            donate=donate,
            kernels=kernels,
            offload=offload,
            context_axis=context_axis,
            balance=balance,
            context_kv=context_kv,
        )
    check_precision_type(precision, "vj.fsdp")
    if context_axis is not None and not isinstance(context_axis, str):
        raise TypeError(f"vj.fsdp: context_axis= must be a mesh axis name, got {context_axis!r}.")
    Context("context", 1, balance, context_kv)  # checks balance= and context_kv=
    if offload is not None and not isinstance(offload, Offload):
        raise TypeError(f"vj.fsdp: offload= must be a vj.Offload, got {type(offload).__name__}.")
    kernels = KernelPolicy.from_env() if kernels is None else check_kernel_policy(kernels, "vj.fsdp")
    options = dict(
        data_axes=data_axes,
        reshard_after_forward=reshard_after_forward,
        prefetch=prefetch,
        precision=precision,
        microbatches=microbatches,
        kernels=kernels,
        context_axis=context_axis,
        balance=balance,
        context_kv=context_kv,
    )

    @plan_cache
    def compiled_for(plan: Plan) -> _Compiled:
        return _compile(step, plan, donate, options, offload)

    if plan is not None:
        compiled_for(plan)  # the options checked against the plan now

    def prepare(params, opt_state, batch, *rest):
        check_sharded_params(params, "vj.fsdp")
        on = params.plan if plan is None else plan
        _check_params(params, on)
        _check_not_donated(params, opt_state, batch, *rest)
        _check_opt_state(opt_state, on, offload)
        compiled = compiled_for(on)
        batch = place_batch(batch, on, compiled.policy.data_axes, microbatches=microbatches)
        return compiled, (params, opt_state, batch, *_replicated(rest, on.mesh))

    @functools.wraps(step)
    def run(params, opt_state, batch, *rest):
        compiled, args = prepare(params, opt_state, batch, *rest)
        if any(is_tracer(x) for x in jax.tree.leaves(args)):  # under an outer jit / export: nest the jitted step
            # the step's mesh as the context mesh, as jit gives it at top level (set_mesh is refused inside jit);
            # exported for a GPU, offloaded state's transfers are ordered
            with jax.sharding.use_abstract_mesh(compiled.plan.mesh.abstract_mesh):
                return compiled.ordered(*args)
        kernels.check_platform(jax.default_backend())
        with jax.set_mesh(compiled.plan.mesh):
            return compiled.jitted(*args)

    def trace(params, opt_state, batch, *rest):
        """The step traced for these arguments (``jax.stages.Traced``): ``.lower(lowering_platforms=...)``,
        ``.jaxpr``."""
        compiled, args = prepare(params, opt_state, batch, *rest)
        with jax.set_mesh(compiled.plan.mesh):
            return compiled.jitted.trace(*args)

    def lower(params, opt_state, batch, *rest, lowering_platforms: Sequence[str] | None = None):
        """The step lowered for these arguments, for the devices' platform or for ``lowering_platforms``
        (e.g. ``("cuda",)`` on a CPU machine: the Pallas kernels compiled for CUDA, see
        :class:`vj.kernels.KernelPolicy`)."""
        for platform in lowering_platforms or (jax.default_backend(),):
            kernels.check_platform(platform)
        compiled, args = prepare(params, opt_state, batch, *rest)
        to_cpu = all(p == "cpu" for p in (lowering_platforms or (jax.default_backend(),)))
        jitted = compiled.jitted if to_cpu else compiled.ordered
        with jax.set_mesh(compiled.plan.mesh):
            traced = jitted.trace(*args)
            if lowering_platforms is None:
                return traced.lower()
            return traced.lower(lowering_platforms=tuple(lowering_platforms))

    def streamed(params, opt_state, batch, *rest) -> list[Any]:
        """The pieces of optimizer state an offloaded step streams, in order (``Piece``: bucket, row, bytes per
        device in and out); empty without offload."""
        compiled, args = prepare(params, opt_state, batch, *rest)
        record: list[Any] = []
        if offload is not None and offload.active:
            with jax.set_mesh(compiled.plan.mesh):
                jax.make_jaxpr(functools.partial(compiled.traced, record=record))(*args)
        return record

    run.lower = lower
    run.trace = trace
    run.streamed = streamed
    run.plan = plan
    return run


def _replicated(rest: Sequence[Any], mesh: jax.sharding.Mesh) -> list[Any]:
    """The step's other arguments (model state, keys) with every host array and every array on one device placed
    replicated on ``mesh``, as the step returns them: the second call then runs the first call's program instead
    of compiling another for the new input placement. Arrays already on the mesh (or any ``NamedSharding``) and
    tracers are left alone; so is everything in a multi-process job, whose host values may differ by process, and
    on a mesh with ``Explicit`` axes, where a replicated array is typed over the axes and the model could no longer
    close over it inside ``shard_map``."""
    auto = all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    if jax.process_count() > 1 or not auto:
        return list(rest)
    sharding = jax.sharding.NamedSharding(mesh, P())

    def place(x: Any) -> Any:
        if isinstance(x, np.ndarray) and x.dtype != object:
            return jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and not is_tracer(x) and isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
            return jax.device_put(x, sharding)
        return x

    return [jax.tree.map(place, r) for r in rest]


@dataclasses.dataclass(frozen=True)
class _Compiled:
    """A ``vj.fsdp`` step for one plan: its policy and the jitted function."""

    plan: Plan
    policy: StepPolicy
    jitted: Callable[..., Any]
    traced: Callable[..., Any]
    ordered: Callable[..., Any]  # ``jitted`` with the offloaded state's transfers ordered (for lowering to a GPU)


def _context(plan: Plan, axis: str | None, balance: str | None, kv: str = "keep") -> Context | None:
    """The step's context axis on ``plan``'s mesh (``None`` without one), checked."""
    if axis is None:
        return None
    mesh = dict(plan.mesh.shape)
    if axis not in mesh:
        raise ValueError(
            f"vj.fsdp: context_axis={axis!r} is not an axis of the plan's mesh {mesh}; make a mesh with a context "
            f"axis, e.g. jax.make_mesh((fsdp, cp), ('{plan.axis}', '{axis}')), and plan the parameters on it."
        )
    if axis == plan.axis or (not isinstance(plan.axis, str) and axis in plan.axis):
        raise ValueError(
            f"vj.fsdp: context_axis={axis!r} is the plan's axis: the parameters are sharded over it. The context "
            "axis is another mesh axis, over which the parameters are replicated; plan over the fsdp axis alone."
        )
    return Context(axis, mesh[axis], balance, kv)


def _compile(
    step: Callable[..., Any], plan: Plan, donate: bool, options: dict[str, Any], offload: Offload | None = None
) -> _Compiled:
    """The step over ``plan``: the options checked against it, gathered into one :class:`StepPolicy`, and the
    step jitted with that policy enclosing its trace."""
    _check_precision(options["precision"], plan)
    options = dict(options)
    context = _context(plan, options.pop("context_axis"), options.pop("balance"), options.pop("context_kv"))
    policy = StepPolicy.for_plan(plan, **options, context=context)
    auto = all(t == jax.sharding.AxisType.Auto for t in plan.mesh.axis_types)

    def inner(params, opt_state, batch, *rest, streamed=False):
        check_state_not_logical(opt_state, plan)  # at trace time: jit retraces for another state structure
        with running(policy):
            try:
                out = step(params, opt_state, batch, *rest)
            except TypeError as e:
                hint = int_grad_message(plan) if "grad requires real- or complex-valued inputs" in str(e) else None
                if hint is None:
                    raise
                raise TypeError(f"vj.fsdp: {hint}") from e
        if donate or streamed:  # the inputs are gone after the call: the step must hand back their successors
            check_step_outputs(out, plan, opt_state)
        if streamed:  # the offloaded state's padding is zeroed piece by piece as it goes back to host memory
            keep = out[1]
            out = zero_padding((out[0], *out[2:]))
            out = (out[0], keep, *out[1:])
        else:  # the padding invariant: params and optimizer moments keep exactly zero padding
            out = zero_padding(out)
        if auto:  # Explicit axes carry shardings in the types; Auto ones need a hint on the outputs.
            if streamed:  # the offloaded state is placed piece by piece
                kept = constrain_outputs((out[0], *out[2:]), plan)
                out = (kept[0], out[1], *kept[1:])
            else:
                out = constrain_outputs(out, plan)
        return out

    on_cpu = plan.mesh.devices.flat[0].platform == "cpu"

    def traced(params, opt_state, batch, *rest, record=None, ordered=not on_cpu):
        if not has_offloaded(opt_state):
            return inner(params, opt_state, batch, *rest)
        run = functools.partial(inner, streamed=True)
        return stream_offloaded(run, (params, opt_state, batch, *rest), ordered=ordered, record=record)

    donated = (0, 1) if donate else ()
    jitted = jax.jit(traced, donate_argnums=donated)
    # lowered for a GPU from CPU devices: the transfers exist there, so they are ordered
    ordered = jitted if not on_cpu else jax.jit(functools.partial(traced, ordered=True), donate_argnums=donated)
    return _Compiled(plan, policy, jitted, traced, ordered)
