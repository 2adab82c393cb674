"""Every use of JAX and optax internals, in one place, each pinned by a test (``tests/test_compat.py``).

The rest of the package reads jaxprs, asks JAX about its backends and its cluster, and reuses a few optax
internals only through the names below. Each entry says which versions it was verified on, what it assumes,
and which modules rely on it; when a JAX or optax upgrade breaks an assumption, ``tests/test_compat.py``
fails on that entry with a message naming it. Where a public API exists it is tried first.

Verified on JAX 0.10.2 and optax 0.2.8 (written to run on JAX 0.11.x as well: public names first, the private
module only as the fallback).

Sections:

* jaxpr types and equations: :data:`Literal`, :data:`ClosedJaxpr`, :func:`is_literal`, :func:`as_closed`,
  :func:`primitive_name`, :func:`bind_equation`; tracers: :data:`TRACER_TYPES`, :func:`is_tracer`.
* primitive names, by what the callers need to know about them: :data:`NESTED_CALL_PRIMITIVES`
  (:func:`is_nested_call`, :func:`nested_call_jaxpr`), :data:`VIEW_PRIMITIVES` (:func:`is_view`),
  :data:`LINEAR_OPERANDS` / :data:`BILINEAR_PRIMITIVES` / :data:`SELECT_N` (:func:`is_linear_in`),
  :data:`CONVERT_ELEMENT_TYPE`
  (:func:`is_convert`, :func:`convert_dtype`), :data:`PVARY` (:func:`is_pvary`, :func:`pvary_axes`),
  :data:`SELECTION_PRIMITIVES` (:func:`is_selection`), :data:`SCAN` (:func:`scan_params`),
  :data:`CHECKPOINT_PRIMITIVES` (:func:`checkpoint_params`), :data:`COND` (:func:`cond_branches`).
* random draws: :data:`RANDOM_DRAW_PRIMITIVES` (:func:`is_random_draw`, :func:`draw_shape`,
  :func:`draw_bit_width`, :func:`is_random_split`), :func:`key_impl_name`, :func:`threefry_partitionable`,
  :func:`threefry2x32`; re-running nested jaxprs: :func:`nested_jaxprs`, :func:`rerun_nested`;
  the axes a value varies over: :func:`aval_varying_axes`, :func:`varying_axes`.
* control flow: :data:`WHILE` (:func:`while_parts`), :func:`cond_parts`, :func:`scan_parts`, :func:`body_name`,
  :data:`PSUM_PRIMITIVES` (:func:`summed_axes`), :data:`AXIS_INDEX` (:func:`indexed_axes`),
  :data:`OPAQUE_BODY_PRIMITIVES` (left out by :func:`nested_jaxprs`), :func:`equation_source`.
* the process's JAX runtime: :func:`backends_are_initialized`, :func:`cluster_types`,
  :func:`distributed_job`, :func:`coordination_client`.
* optax: :func:`is_params_placeholder`, the Muon internals (:data:`MUON_NS_COEFFS_PRESETS`,
  :data:`MUON_DEFAULT_NS_COEFFS`, :data:`MUON_PRECONDITIONINGS`, :func:`muon_orthogonalize`,
  :func:`muon_normalize_axes`), and the modules that define optax's per-leaf mapping transformations
  (:data:`OPTAX_MUON_MODULE`, :data:`OPTAX_MASKING_MODULE`, :data:`OPTAX_PARTITION_MODULE`), and the code of
  optax's per-leaf norm / shape transformations (:data:`OPTAX_PER_LEAF_CODES`).

The callers read a jaxpr's structure directly (``jaxpr.eqns`` / ``constvars`` / ``invars`` / ``outvars``,
``eqn.invars`` / ``outvars`` / ``effects``): those are the fields of JAX's public ``jax.extend.core.Jaxpr`` and
``JaxprEqn``. What an equation *is* (its primitive's name, its parameters, how to bind it) is read only here.

This module is the package's lowest layer: it imports only JAX, optax, NumPy and the standard library.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.extend import random as _jex_random
from optax.contrib import _muon as _optax_muon
from optax.tree_utils import _state_utils as _optax_state_utils

__all__ = [
    "AXIS_INDEX",
    "BILINEAR_PRIMITIVES",
    "CALL_LIKE_PRIMITIVES",
    "CHECKPOINT_PRIMITIVES",
    "COND",
    "CONVERT_ELEMENT_TYPE",
    "LINEAR_OPERANDS",
    "MUON_DEFAULT_NS_COEFFS",
    "MUON_NS_COEFFS_PRESETS",
    "MUON_PRECONDITIONINGS",
    "NESTED_CALL_PRIMITIVES",
    "OPAQUE_BODY_PRIMITIVES",
    "OPTAX_MASKING_MODULE",
    "OPTAX_MUON_MODULE",
    "OPTAX_NORM_CODES",
    "OPTAX_PARTITION_MODULE",
    "OPTAX_PER_LEAF_CODES",
    "PSUM_PRIMITIVES",
    "PVARY",
    "RANDOM_DRAW_PRIMITIVES",
    "SCAN",
    "SELECTION_PRIMITIVES",
    "SELECT_N",
    "THREEFRY_IMPL",
    "TRACER_TYPES",
    "VALUE_PRESERVING_PRIMITIVES",
    "VIEW_PRIMITIVES",
    "CheckpointParams",
    "ClosedJaxpr",
    "Literal",
    "ScanParams",
    "as_closed",
    "aval_varying_axes",
    "backends_are_initialized",
    "bind_equation",
    "call_body",
    "checkpoint_params",
    "cluster_types",
    "cond_branches",
    "convert_dtype",
    "coordination_client",
    "distributed_job",
    "draw_bit_width",
    "draw_shape",
    "indexed_axes",
    "is_convert",
    "is_linear_in",
    "is_literal",
    "is_nested_call",
    "is_params_placeholder",
    "is_pvary",
    "is_random_draw",
    "is_random_split",
    "is_selection",
    "is_tracer",
    "is_view",
    "key_impl_name",
    "muon_normalize_axes",
    "muon_orthogonalize",
    "nested_call_jaxpr",
    "nested_jaxprs",
    "passes_values_through",
    "primitive_name",
    "pvary_axes",
    "rerun_nested",
    "scan_params",
    "threefry2x32",
    "threefry_partitionable",
]

# ----------------------------------------------------------------------------------------------------------
# jaxpr types and equations

# Literal: a constant atom of a jaxpr (``.val``). ClosedJaxpr: a jaxpr with its constants; ``ClosedJaxpr(jaxpr,
# consts)`` closes an open one, with ``.jaxpr`` and ``.consts``. Public in ``jax.extend.core`` (verified on JAX
# 0.10.2), the private module only as the fallback. Used through is_literal / as_closed below.
try:
    from jax.extend.core import ClosedJaxpr, Literal
except ImportError:  # pragma: no cover - a JAX that moved them out of jax.extend
    from jax._src.core import ClosedJaxpr, Literal


def is_literal(v: Any) -> bool:
    """Whether jaxpr atom ``v`` is a literal (a constant written into the equation, read as ``v.val``) rather
    than a variable.

    Verified on JAX 0.10.2 (``jax.extend.core.Literal``). Assumes every non-literal atom of ``eqn.invars`` /
    ``jaxpr.outvars`` is a hashable variable. Used by ``step/_jaxpr``, ``step/_point_of_use``,
    ``step/_fp32_grads``, ``step/_wire_segment``.
    """
    return isinstance(v, Literal)


def as_closed(jaxpr: Any) -> Any:
    """``jaxpr`` as a closed jaxpr: returned as is when it has constants (``.consts``), else closed over none.

    Verified on JAX 0.10.2, where a nested ``jit`` equation holds a ``ClosedJaxpr`` and ``closed_call`` /
    ``core_call`` an open ``Jaxpr``. Used by ``step/_point_of_use`` (through :func:`nested_call_jaxpr`).
    """
    return jaxpr if hasattr(jaxpr, "consts") else ClosedJaxpr(jaxpr, ())


def primitive_name(eqn: Any) -> str:
    """The name of the primitive equation ``eqn`` applies (``eqn.primitive.name``), e.g. ``"dot_general"``.

    Verified on JAX 0.10.2. Assumes a ``JaxprEqn`` has ``.primitive`` with a string ``.name``. Used by every
    predicate below (the callers ask the predicates, never the name).
    """
    return eqn.primitive.name


def bind_equation(eqn: Any, invals: Sequence[Any]) -> list[Any]:
    """Binds one jaxpr equation on ``invals``, as JAX's own ``eval_jaxpr`` does; always a list of outputs.

    Verified on JAX 0.10.2. Assumes ``jax._src.source_info_util.user_context(traceback, name_stack=...)`` with
    ``eqn.source_info.traceback`` / ``.name_stack`` (as ``jax.core.eval_jaxpr`` re-binds), ``eqn.ctx.manager``
    (the equation's context: name stack, remat policy,
    ...), ``eqn.primitive.bind``, ``eqn.primitive.get_bind_params(eqn.params)`` (turns stored parameters, e.g.
    a custom_vjp's jaxprs, back into bind arguments) and ``eqn.primitive.multiple_results``, so that re-binding
    every equation of a traced function reproduces it, nested ``jit`` / ``scan`` / ``while`` / ``cond`` /
    ``checkpoint`` / ``custom_jvp`` / ``custom_vjp`` / ``shard_map`` equations included. Used by ``step/_jaxpr``
    (and through it ``step/_point_of_use``, ``step/_layer_split``, ``step/_fp32_grads``, ``step/_wire_segment``).
    """
    from jax._src import source_info_util

    # the equation keeps its user source line (JAX's eval_jaxpr does the same), so errors that name the line
    # of an equation re-bound by vescale_jax still point at the model's code
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack):
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


# TRACER_TYPES: the types of traced values, ``jax.core.Tracer`` (public), fallback ``jax._src.core.Tracer``; empty
# if neither exists, and then nothing counts as traced. Verified on JAX 0.10.2. Assumes every value seen while
# tracing (``jit``, ``grad``, ``vmap``, ``shard_map``) is an instance. Used through is_tracer below.
try:
    TRACER_TYPES: tuple[type, ...] = (jax.core.Tracer,)
except AttributeError:  # pragma: no cover - a JAX without jax.core.Tracer
    try:
        from jax._src.core import Tracer as _Tracer

        TRACER_TYPES = (_Tracer,)
    except ImportError:
        TRACER_TYPES = ()


def is_tracer(x: Any) -> bool:
    """Whether ``x`` is a traced value (abstract inside ``jit`` / ``grad`` / ...), not a concrete one.

    Verified on JAX 0.10.2 (see :data:`TRACER_TYPES`). Used by ``state/_checks``, ``optim/_leaf_tables``,
    ``optim/_rows_to_logical``, ``optim/_shampoo/_transform``.
    """
    return isinstance(x, TRACER_TYPES)


# ----------------------------------------------------------------------------------------------------------
# Primitive names

NESTED_CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call"})
"""Primitives that call a nested jaxpr held in ``eqn.params["jaxpr"]`` with the equation's inputs as its
inputs, and nothing else: inlining one gives the same values. ``jax.jit`` inside a traced function is
``"jit"`` on JAX 0.10.2 (``"pjit"`` before 0.7). ``scan`` / ``while`` / ``cond`` / ``checkpoint`` /
``custom_jvp_call`` / ``custom_vjp_call`` / ``shard_map`` are deliberately not in the set: they stay whole
equations. Verified on JAX 0.10.2. Used by ``step/_point_of_use`` (and ``step/_layer_split`` through it)."""


def is_nested_call(eqn: Any) -> bool:
    """Whether ``eqn`` is a nested ``jit`` / ``closed_call`` that may be inlined (see
    :data:`NESTED_CALL_PRIMITIVES`).

    Verified on JAX 0.10.2. Used by ``step/_point_of_use``.
    """
    return primitive_name(eqn) in NESTED_CALL_PRIMITIVES and "jaxpr" in eqn.params


def nested_call_jaxpr(eqn: Any) -> Any:
    """The closed jaxpr a nested call (:func:`is_nested_call`) runs, from ``eqn.params["jaxpr"]``.

    Verified on JAX 0.10.2. Used by ``step/_point_of_use``.
    """
    return as_closed(eqn.params["jaxpr"])


VIEW_PRIMITIVES = frozenset(
    {
        "broadcast_in_dim",
        "convert_element_type",
        "copy",
        "copy_p",
        "dynamic_slice",
        "expand_dims",
        "pcast",
        "pvary",
        "reduce_precision",
        "reshape",
        "rev",
        "slice",
        "squeeze",
        "transpose",
    }
)
"""Primitives whose output is a copy or a view of operand 0 (a cast, reshape, transpose, broadcast, slice): a
view of a parameter leaf stands for the leaf. A name JAX no longer emits is harmless (never matched); a view
JAX renames is only missed. Verified on JAX 0.10.2 (``astype``, ``reshape``, ``.T``, ``jnp.broadcast_to``,
``x[1:]``, ``lax.pcast(to="varying")``). Used by ``step/_jaxpr`` (``bucket_reads``: ``step/_point_of_use``,
``step/_layer_split``)."""


def is_view(eqn: Any) -> bool:
    """Whether ``eqn``'s output is a copy or view of its operand 0 (see :data:`VIEW_PRIMITIVES`).

    Verified on JAX 0.10.2. Used by ``step/_jaxpr``.
    """
    return primitive_name(eqn) in VIEW_PRIMITIVES


LINEAR_OPERANDS: Mapping[str, tuple[int, ...] | None] = {
    "add": None,
    "add_any": None,
    "sub": None,
    "neg": None,
    "reduce_sum": None,
    "broadcast_in_dim": None,
    "reshape": None,
    "transpose": None,
    "squeeze": None,
    "expand_dims": None,
    "slice": None,
    "rev": None,
    "copy": None,
    "copy_p": None,
    "concatenate": None,
    "convert_element_type": None,
    "reduce_precision": None,
    "pvary": None,
    "pcast": None,
    "cumsum": None,
    "real": None,
    "imag": None,
    "complex": None,
    "conj": None,
    "dynamic_slice": (0,),
    "gather": (0,),
    "pad": (0,),
    "select_n": None,  # the predicate (operand 0) is checked by is_linear_in
    "div": (0,),
}
"""Primitives linear in an operand given the others: which operand positions may carry the parameters
(``None``: any). Verified on JAX 0.10.2. Used by ``step/_point_of_use`` (through :func:`is_linear_in`)."""

BILINEAR_PRIMITIVES = frozenset({"mul", "dot_general", "conv_general_dilated"})
"""Primitives linear in each operand separately (at most one operand may depend on the parameters).
Verified on JAX 0.10.2 (``*``, ``@``, ``lax.conv``). Used by ``step/_point_of_use``."""

SELECT_N = "select_n"
"""``jnp.where`` / ``lax.select``: linear in the chosen operands, not in its predicate (operand 0). Verified on
JAX 0.10.2. Used by ``step/_point_of_use`` (through :func:`is_linear_in`)."""


def is_linear_in(eqn: Any, positions: Sequence[int]) -> bool:
    """Whether ``eqn`` is linear in its operands at ``positions`` given the others (:data:`LINEAR_OPERANDS`,
    :data:`BILINEAR_PRIMITIVES`, :data:`SELECT_N`); an unknown primitive is not.

    Verified on JAX 0.10.2. Used by ``step/_point_of_use`` (an affine segment reduce-scatters its gradient
    before gathering its parameters again).
    """
    name = primitive_name(eqn)
    if name in BILINEAR_PRIMITIVES:
        return len(positions) == 1
    if name not in LINEAR_OPERANDS:
        return False
    allowed = LINEAR_OPERANDS[name]
    if name == SELECT_N and 0 in positions:
        return False
    return allowed is None or all(p in allowed for p in positions)


CONVERT_ELEMENT_TYPE = "convert_element_type"
"""The primitive of ``x.astype(dtype)`` / ``lax.convert_element_type``, its target in ``params["new_dtype"]``.
Verified on JAX 0.10.2. Used by ``step/_fp32_grads``."""


def is_convert(eqn: Any) -> bool:
    """Whether ``eqn`` is a dtype conversion (``astype``); see :data:`CONVERT_ELEMENT_TYPE`.

    Verified on JAX 0.10.2. Used by ``step/_fp32_grads``.
    """
    return primitive_name(eqn) == CONVERT_ELEMENT_TYPE


def convert_dtype(eqn: Any) -> np.dtype:
    """The dtype a conversion equation (:func:`is_convert`) converts to.

    Verified on JAX 0.10.2 (``eqn.params["new_dtype"]``). Used by ``step/_fp32_grads``.
    """
    return np.dtype(eqn.params["new_dtype"])


PVARY = "pvary"
"""The primitive ``lax.pcast(x, axes, to="varying")`` (``lax.pvary``) emits inside ``shard_map``, its axes in
``params["axes"]``; binding it on a value that already varies over those axes is an error. Verified on JAX
0.10.2. Used by ``step/_wire_segment`` (``anchored``)."""


def is_pvary(eqn: Any) -> bool:
    """Whether ``eqn`` marks a value as varying over mesh axes (see :data:`PVARY`).

    Verified on JAX 0.10.2. Used by ``step/_wire_segment``.
    """
    return primitive_name(eqn) == PVARY


def pvary_axes(eqn: Any) -> tuple[str, ...]:
    """The mesh axes a :func:`is_pvary` equation marks its operands varying over.

    Verified on JAX 0.10.2 (``eqn.params["axes"]``). Used by ``step/_wire_segment``.
    """
    return tuple(eqn.params["axes"])


SELECTION_PRIMITIVES = frozenset(
    {
        "concatenate",
        "copy",
        "copy_p",
        "dynamic_slice",
        "expand_dims",
        "pcast",
        "pvary",
        "reshape",
        "rev",
        "slice",
        "squeeze",
        "transpose",
    }
)
"""Primitives whose output elements are elements of their floating operands, each used at most once, with no
parameter naming a dtype: applied to an fp32 copy of a bf16 value they give the fp32 copy of their bf16 result,
and their transpose only moves cotangents (never sums them). Operands of another dtype (``dynamic_slice``'s
indices) are read as they are. ``broadcast_in_dim`` and ``gather`` are left out on purpose: their transposes
sum. Verified on JAX 0.10.2 (``x[1:]``, ``x[i]``, ``.reshape``, ``.T``, ``jnp.concatenate``, ``x[::-1]``).
Used by ``step/_interpret`` (a widened value stays wide through them)."""


def is_selection(eqn: Any) -> bool:
    """Whether ``eqn`` only selects, moves or joins elements (see :data:`SELECTION_PRIMITIVES`).

    Verified on JAX 0.10.2. Used by ``step/_interpret``.
    """
    return primitive_name(eqn) in SELECTION_PRIMITIVES


SCAN = "scan"
"""The primitive of ``jax.lax.scan`` (and of ``nnx.scan``, ``fori_loop`` with static bounds): operands ``consts +
carry + xs``, outputs ``carry + ys``, the body in ``params["jaxpr"]`` (consts, carry, xs -> carry, ys), with
``length``, ``reverse`` and ``unroll``. How the operands split into those groups comes in one of two forms
(:func:`scan_counts` reads both):

* counts (JAX <= 0.10, verified on 0.10.2): ``num_consts`` and ``num_carry``; the body a ``ClosedJaxpr``.
* flat trees (JAX >= 0.11, verified on 0.12.0.1): ``ft_in`` and ``ft_out``, ``jax._src.flattree`` trees whose
  ``unpack()`` gives the groups ``(consts, carry, xs)`` and ``(carry, ys)``; the body a ``Jaxpr`` (which holds its
  own constants there).

Nothing here binds a scan from stored parameters: a scan is re-expressed through ``jax.lax.scan``, which writes
the equation in the running JAX's form. Used by ``step/_interpret`` (through :func:`scan_params`),
``step/_control_flow`` (through :func:`scan_parts`) and ``step/_random`` (through :func:`rerun_nested`)."""

_SCAN_COUNT_PARAMS = frozenset({"jaxpr", "num_consts", "num_carry", "length", "reverse", "unroll"})
_SCAN_TREE_PARAMS = frozenset({"jaxpr", "ft_in", "ft_out", "length", "reverse", "unroll"})


def scan_counts(params: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(num_consts, num_carry)`` of a scan equation's ``params`` in either form of :data:`SCAN` (chosen by the
    parameters present, not by JAX's version), or None when they are in neither.

    Verified on JAX 0.10.2 (``num_consts`` / ``num_carry``) and 0.12.0.1 (``len`` of each group of
    ``ft_in.unpack()``; ``ft_out.unpack()``'s first group has as many carries). Used by :func:`scan_params`,
    :func:`scan_parts` and :func:`rerun_nested`.
    """
    if "num_consts" in params and "num_carry" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    ft_in, ft_out = params.get("ft_in"), params.get("ft_out")
    if not (hasattr(ft_in, "unpack") and hasattr(ft_out, "unpack")):
        return None
    groups, out_groups = ft_in.unpack(), ft_out.unpack()
    if len(groups) != 3 or len(out_groups) != 2:
        return None
    consts, carry, _ = (len(g) for g in groups)
    return (consts, carry) if len(out_groups[0]) == carry else None


class ScanParams(NamedTuple):
    """What ``jax.lax.scan`` needs to re-express a scan equation (see :data:`SCAN`)."""

    jaxpr: Any  # closed: (*consts, *carry, *x) -> (*carry, *y)
    num_consts: int
    num_carry: int
    length: int
    reverse: bool
    unroll: int | bool


def scan_params(eqn: Any) -> ScanParams | None:
    """The parameters of a scan equation, in either form of :data:`SCAN`, or None when ``eqn`` is not one (or
    has parameters this reading does not know, so that re-expressing it could change it).

    Verified on JAX 0.10.2 and 0.12.0.1: exactly the parameters of one of the two forms. Used by
    ``step/_interpret`` and :func:`rerun_nested`.
    """
    if primitive_name(eqn) != SCAN or frozenset(eqn.params) not in (_SCAN_COUNT_PARAMS, _SCAN_TREE_PARAMS):
        return None
    counts = scan_counts(eqn.params)
    if counts is None:
        return None
    p = eqn.params
    return ScanParams(as_closed(p["jaxpr"]), *counts, p["length"], p["reverse"], p["unroll"])


CHECKPOINT_PRIMITIVES = frozenset({"checkpoint", "remat2"})
"""The primitive of ``jax.checkpoint`` / ``jax.remat`` / ``nnx.remat`` (``"remat2"`` on JAX 0.10.2; the name
``"checkpoint"`` is accepted too, should a later JAX rename it). Its parameters: ``jaxpr`` (open), ``policy``,
``prevent_cse``, ``differentiated`` (True once the equation is inside a differentiated function). Verified on
JAX 0.10.2. Used by ``step/_interpret`` (through :func:`checkpoint_params`)."""


class CheckpointParams(NamedTuple):
    """What ``jax.checkpoint`` needs to re-express a checkpoint equation (see :data:`CHECKPOINT_PRIMITIVES`)."""

    jaxpr: Any  # closed
    policy: Any
    prevent_cse: bool


def checkpoint_params(eqn: Any) -> CheckpointParams | None:
    """The parameters of a ``jax.checkpoint`` equation not yet differentiated, else None.

    Verified on JAX 0.10.2. Used by ``step/_interpret``.
    """
    if primitive_name(eqn) not in CHECKPOINT_PRIMITIVES or eqn.params.get("differentiated", False):
        return None
    if set(eqn.params) != {"jaxpr", "policy", "prevent_cse", "differentiated"}:
        return None
    p = eqn.params
    return CheckpointParams(as_closed(p["jaxpr"]), p["policy"], p["prevent_cse"])


CALL_LIKE_PRIMITIVES = NESTED_CALL_PRIMITIVES | CHECKPOINT_PRIMITIVES | {"custom_jvp_call", "custom_vjp_call"}
"""Primitives whose outputs are those of one nested jaxpr run on the equation's own operands: nested calls,
``jax.checkpoint`` (``params["jaxpr"]``, differentiated or not) and the primal of ``jax.custom_jvp`` /
``jax.custom_vjp`` (``params["call_jaxpr"]``). Verified on JAX 0.10.2 and 0.12.0.1. Used by ``step/_forwarding``
(through :func:`call_body`)."""


def call_body(eqn: Any) -> Any | None:
    """The closed jaxpr a call-like equation (:data:`CALL_LIKE_PRIMITIVES`) runs on its operands to give its
    outputs, or None for another equation (or one whose body does not take and give as many values).

    Verified on JAX 0.10.2 and 0.12.0.1. Used by ``step/_forwarding``.
    """
    if primitive_name(eqn) not in CALL_LIKE_PRIMITIVES:
        return None
    body = eqn.params.get("call_jaxpr", eqn.params.get("jaxpr"))
    if body is None:
        return None
    body = as_closed(body)
    if len(body.jaxpr.invars) != len(eqn.invars) or len(body.jaxpr.outvars) != len(eqn.outvars):
        return None
    return body


VALUE_PRESERVING_PRIMITIVES = frozenset({"copy", "copy_p", "optimization_barrier", "pvary"})
"""Primitives whose output ``i`` holds the value of operand ``i`` (a copy, ``lax.optimization_barrier``, the
varying-axes mark ``pvary`` inside ``shard_map``). Verified on JAX 0.10.2 and 0.12.0.1. Used by
``step/_forwarding`` (through :func:`passes_values_through`)."""


def passes_values_through(eqn: Any) -> bool:
    """Whether each output of ``eqn`` is the value of the operand at the same position: a primitive of
    :data:`VALUE_PRESERVING_PRIMITIVES`, or a ``convert_element_type`` to the operand's own dtype.

    Verified on JAX 0.10.2 and 0.12.0.1. Used by ``step/_forwarding``.
    """
    if len(eqn.invars) != len(eqn.outvars):
        return False
    if primitive_name(eqn) in VALUE_PRESERVING_PRIMITIVES:
        return True
    if is_convert(eqn) and not is_literal(eqn.invars[0]):
        return np.dtype(eqn.invars[0].aval.dtype) == convert_dtype(eqn)
    return False


COND = "cond"
"""The primitive of ``jax.lax.cond`` / ``jax.lax.switch``: operand 0 the (clamped) branch index, the rest the
branches' operands (a bool predicate is converted to an int32 index first); ``params["branches"]`` the closed
jaxprs. Verified on JAX 0.10.2. Used by ``step/_interpret`` (through :func:`cond_branches`) and
``step/_control_flow`` (through :func:`cond_parts`)."""


def cond_branches(eqn: Any) -> tuple[Any, ...] | None:
    """The closed branch jaxprs of a cond equation, or None when ``eqn`` is not one.

    Verified on JAX 0.10.2 (``params == {"branches"}``). Used by ``step/_interpret``.
    """
    if primitive_name(eqn) != COND or set(eqn.params) != {"branches"}:
        return None
    return tuple(as_closed(b) for b in eqn.params["branches"])


# ----------------------------------------------------------------------------------------------------------
# Random draws

RANDOM_DRAW_PRIMITIVES = frozenset({"random_bits", "random_split"})
"""The primitives that draw from a typed PRNG key: ``random_bits`` (``params["bit_width"]``,
``params["shape"]``; every ``jax.random`` sampler, ``bernoulli`` / ``uniform`` / ``normal`` / ``randint`` ...)
and ``random_split`` (``params["shape"]``). Their output is ``key.shape + shape`` (``+ (bits,)`` for none:
a split's output is keys). ``random_fold_in`` / ``random_wrap`` / ``random_unwrap`` / ``random_seed`` draw no
array. A raw ``jax.random.PRNGKey`` reaches them through ``random_wrap``, as a typed key. Verified on JAX 0.10.2
(``jax.random.key`` and ``jax.random.PRNGKey``, impls ``threefry2x32``, ``rbg``, ``unsafe_rbg``). Used by
``step/_random``."""

THREEFRY_IMPL = "threefry2x32"
"""The name :func:`key_impl_name` gives for the default key implementation. Verified on JAX 0.10.2."""


def is_random_draw(eqn: Any) -> bool:
    """Whether ``eqn`` draws from a key (see :data:`RANDOM_DRAW_PRIMITIVES`).

    Verified on JAX 0.10.2. Used by ``step/_random``.
    """
    return primitive_name(eqn) in RANDOM_DRAW_PRIMITIVES


def is_random_split(eqn: Any) -> bool:
    """Whether a draw (:func:`is_random_draw`) is a ``random_split`` (its output is keys, not bits).

    Verified on JAX 0.10.2. Used by ``step/_random``.
    """
    return primitive_name(eqn) == "random_split"


def draw_shape(eqn: Any) -> tuple[int, ...]:
    """The shape a draw asks for per key (``params["shape"]``; the output is ``key.shape + shape``).

    Verified on JAX 0.10.2. Used by ``step/_random``.
    """
    return tuple(eqn.params["shape"])


def draw_bit_width(eqn: Any) -> int:
    """The bit width of a ``random_bits`` draw (``params["bit_width"]``: 8, 16, 32 or 64).

    Verified on JAX 0.10.2. Used by ``step/_random``.
    """
    return int(eqn.params["bit_width"])


def key_impl_name(key: Any) -> str:
    """The implementation of typed key ``key`` by name (``"threefry2x32"``, ``"rbg"``, ``"unsafe_rbg"``).

    Verified on JAX 0.10.2: ``jax.random.key_impl`` returns the name (a ``PRNGSpec`` whose ``str`` is the
    name on later versions). Used by ``step/_random``.
    """
    impl = jax.random.key_impl(key)
    return str(getattr(impl, "name", impl))


def threefry_partitionable() -> bool:
    """Whether threefry draws are partitionable: the bits of element ``i`` of a draw depend only on the key and
    ``i``'s flat index (``jax_threefry_partitionable``, True by default since JAX 0.5).

    Verified on JAX 0.10.2 (``jax._src.random.threefry2x32._threefry_random_bits_partitionable``: ``bits1,
    bits2 = threefry2x32(k1, k2, hi(i), lo(i))``; 32 bits ``bits1 ^ bits2``, 8 / 16 bits that truncated, 64
    bits ``bits1 << 32 | bits2``; ``_threefry_split_foldlike``: key data ``(bits1, bits2)``). Used by
    ``step/_random``.
    """
    return bool(jax.config.jax_threefry_partitionable)


def threefry2x32(k1: Any, k2: Any, x1: Any, x2: Any) -> list[Any]:
    """The Threefry-2x32 hash of count words ``(x1, x2)`` (uint32 arrays of one shape) under key words
    ``(k1, k2)`` (uint32 scalars): two uint32 arrays, as the partitionable draws compute them.

    Verified on JAX 0.10.2 (``jax.extend.random.threefry2x32_p``). Used by ``step/_random``.
    """
    return list(_jex_random.threefry2x32_p.bind(k1, k2, x1, x2))


def aval_varying_axes(aval: Any) -> frozenset[str]:
    """The mesh axes a jaxpr variable's abstract value varies over inside ``shard_map`` (empty when the check is
    off or outside ``shard_map``).

    Verified on JAX 0.10.2 (``aval.manual_axis_type.varying``; ``aval.vma`` on later versions). Used by
    ``step/_random``.
    """
    vma = getattr(aval, "vma", None)
    if vma:
        return frozenset(vma)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def nested_jaxprs(eqn: Any) -> list[Any]:
    """Every jaxpr an equation holds in its parameters (a ``jit`` / ``scan`` / ``remat`` body, ``cond``
    branches, a ``while``'s condition and body, a ``custom_jvp`` / ``custom_vjp`` primal), as closed jaxprs, in
    parameter-name order; none for :data:`OPAQUE_BODY_PRIMITIVES` (a Pallas kernel's body). Callables (a
    ``custom_vjp``'s ``bwd``) are not entered.

    Verified on JAX 0.10.2. Used by ``step/_random`` (to find draws wherever they sit) and ``step/_control_flow``
    (``.jaxpr`` of each: the bodies a predicate may sit in).
    """
    if primitive_name(eqn) in OPAQUE_BODY_PRIMITIVES:
        return []
    out = []
    for name in sorted(eqn.params):
        value = eqn.params[name]
        for v in value if isinstance(value, tuple | list) else (value,):
            if hasattr(v, "eqns") or (hasattr(v, "jaxpr") and hasattr(v, "consts")):
                out.append(as_closed(v))
    return out


def rerun_nested(eqn: Any, invals: Sequence[Any], run: Any) -> list[Any] | None:
    """``eqn`` on ``invals`` with each nested jaxpr evaluated by ``run(closed_jaxpr, args) -> outputs``, through
    JAX's public API (so types are recomputed), or None for a primitive not covered here (bind it as it is).

    Covered, verified on JAX 0.10.2 and 0.12.0.1: nested calls (:data:`NESTED_CALL_PRIMITIVES`: inlined),
    ``scan`` (:func:`scan_params`, either form: ``lax.scan``), ``while``
    (``cond_nconsts``, ``body_nconsts``: ``lax.while_loop``), ``cond`` (``branches``, operand 0 the index:
    ``lax.switch``) and ``remat2`` / ``checkpoint`` (``prevent_cse``, ``policy``: ``jax.checkpoint``).
    ``custom_jvp_call`` / ``custom_vjp_call`` / ``shard_map`` are not (their derivative rules are opaque
    functions). Used by ``step/_random``.
    """
    name = primitive_name(eqn)
    p = eqn.params
    if is_nested_call(eqn):
        return list(run(nested_call_jaxpr(eqn), list(invals)))
    scan = scan_params(eqn)
    if scan is not None:
        nc, nk = scan.num_consts, scan.num_carry
        consts, init, xs = list(invals[:nc]), list(invals[nc : nc + nk]), list(invals[nc + nk :])

        def body(carry, x):
            outs = run(scan.jaxpr, [*consts, *carry, *x])
            return list(outs[:nk]), list(outs[nk:])

        carry, ys = jax.lax.scan(body, init, xs, length=scan.length, reverse=scan.reverse, unroll=scan.unroll)
        return [*carry, *ys]
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, init = list(invals[:cn]), list(invals[cn : cn + bn]), list(invals[cn + bn :])
        out = jax.lax.while_loop(
            lambda c: run(p["cond_jaxpr"], [*cc, *c])[0], lambda c: list(run(p["body_jaxpr"], [*bc, *c])), init
        )
        return list(out)
    if name == "cond":
        branches = [lambda *a, b=b: list(run(b, list(a))) for b in p["branches"]]
        return list(jax.lax.switch(invals[0], branches, *invals[1:]))
    if name in ("remat2", "checkpoint"):
        body = as_closed(p["jaxpr"])
        f = jax.checkpoint(lambda *a: list(run(body, list(a))), prevent_cse=p["prevent_cse"], policy=p["policy"])
        return list(f(*invals))
    return None


def varying_axes(x: Any) -> frozenset[str]:
    """The mesh axes a value inside ``shard_map`` varies over (empty outside one, or where ``check_vma`` is off):
    :func:`aval_varying_axes` of ``jax.typeof(x)``.

    Verified on JAX 0.10.2. Used by ``step/_model_call`` (new model state must not vary over the data axes).
    """
    return aval_varying_axes(jax.typeof(x))


# ----------------------------------------------------------------------------------------------------------
# Control flow: predicates, nested bodies, varying axes and source lines of equations

WHILE = "while"
"""``lax.while_loop`` / ``fori_loop`` with a traced bound: operands ``cond_consts + body_consts + carry``
(``params["cond_nconsts"]``, ``params["body_nconsts"]``), the condition in ``params["cond_jaxpr"]`` (one output,
the predicate) and the body in ``params["body_jaxpr"]``. Verified on JAX 0.10.2. Used by ``step/_control_flow``."""

PSUM_PRIMITIVES = frozenset({"psum", "psum_invariant", "psum2"})
"""``lax.psum`` (and ``pmean``'s sum) inside ``shard_map``: ``"psum_invariant"`` with the varying-axes check on,
``"psum"`` with it off (JAX 0.10.2; ``"psum2"`` on older versions), the mesh axes in ``params["axes"]``. Used by
``step/_control_flow`` (a sum over the data axes is the same on every device)."""

ALL_GATHER = "all_gather"
"""``lax.all_gather`` inside ``shard_map``: params ``axis_name`` (a tuple of mesh axes), ``all_gather_dimension``,
``tiled``, ``axis_size`` and ``axis_index_groups``; the result varies over the same axes as the operand. Verified on
JAX 0.10.2 and 0.12.0.1. Used by ``step/_context_kv``."""


def tiled_gather_over(eqn: Any, axis: str) -> int | None:
    """The gathered dimension of ``eqn`` when it is a tiled ``lax.all_gather`` over mesh axis ``axis`` alone
    (no index groups), else ``None`` (see :data:`ALL_GATHER`)."""
    if primitive_name(eqn) != ALL_GATHER:
        return None
    p = eqn.params
    names = p.get("axis_name")
    names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
    if names != (axis,) or not p.get("tiled") or p.get("axis_index_groups") is not None:
        return None
    return int(p["all_gather_dimension"])


AXIS_INDEX = "axis_index"
"""``lax.axis_index`` inside ``shard_map``: the device's index along ``params["axis_name"]`` (one axis name; a
tuple of axes is traced as one equation per axis, verified on JAX 0.10.2). Used by ``step/_control_flow`` (a
value computed from the index over a data axis differs between devices, like the batch slice; the draws
``step/_random`` splits are such values)."""


def indexed_axes(eqn: Any) -> tuple[str, ...]:
    """The mesh axes an ``axis_index`` equation (:data:`AXIS_INDEX`) indexes; ``()`` for another equation.

    Verified on JAX 0.10.2 (``params["axis_name"]``, a string; a tuple accepted too). Used by
    ``step/_control_flow``.
    """
    if primitive_name(eqn) != AXIS_INDEX:
        return ()
    names = eqn.params.get("axis_name", ())
    return tuple(a for a in (names if isinstance(names, tuple | list) else (names,)) if isinstance(a, str))


OPAQUE_BODY_PRIMITIVES = frozenset({"pallas_call", "mpmd_map", "core_map"})
"""Primitives whose nested jaxpr is not a JAX-level computation over the same values (a Pallas kernel body sees
refs and program ids, not the operands' varying axes): :func:`nested_jaxprs` does not enter them. Verified on
JAX 0.10.2 and 0.12.0.1 (``pallas_call``; ``plgpu.kernel`` traces an ``mpmd_map``, inside a
``custom_vmap_call``). Used by ``step/_control_flow`` and ``step/_random``."""


def _open(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def cond_parts(eqn: Any) -> tuple[Any, list[Any], list[Any]] | None:
    """``(index, branches, operands)`` of a cond / switch equation (:data:`COND`): the index atom, the branches
    as open jaxprs, the atoms they read; ``None`` for another equation.

    Verified on JAX 0.10.2. Used by ``step/_control_flow``.
    """
    if primitive_name(eqn) != COND:
        return None
    return eqn.invars[0], [_open(b) for b in eqn.params["branches"]], list(eqn.invars[1:])


def while_parts(eqn: Any) -> tuple[Any, Any, list[Any], list[Any], list[Any]] | None:
    """``(cond, body, cond_consts, body_consts, carry)`` of a while equation (:data:`WHILE`): the condition and
    body as open jaxprs (the condition reads ``cond_consts + carry``, the body ``body_consts + carry`` and returns
    the carry), and the operand atoms; ``None`` for another equation.

    Verified on JAX 0.10.2. Used by ``step/_control_flow``.
    """
    if primitive_name(eqn) != WHILE:
        return None
    nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    ins = list(eqn.invars)
    return _open(eqn.params["cond_jaxpr"]), _open(eqn.params["body_jaxpr"]), ins[:nc], ins[nc : nc + nb], ins[nc + nb :]


def scan_parts(eqn: Any) -> tuple[Any, int, int] | None:
    """``(body, num_consts, num_carry)`` of a scan equation (:data:`SCAN`, either form): the body as an open
    jaxpr over the equation's operands (``consts + carry + xs``) returning ``carry + ys``; ``None`` for another
    equation.

    Verified on JAX 0.10.2 and 0.12.0.1. Used by ``step/_control_flow``.
    """
    if primitive_name(eqn) != SCAN:
        return None
    counts = scan_counts(eqn.params)
    if counts is None:
        raise NotImplementedError(
            f"vescale_jax cannot read this JAX's scan equation (parameters {sorted(eqn.params)}): neither "
            "num_consts / num_carry nor ft_in / ft_out; see vescale_jax/_compat.py (SCAN)"
        )
    return (_open(eqn.params["jaxpr"]), *counts)


_BODY_NAMES = {"remat2": "jax.checkpoint", "checkpoint": "jax.checkpoint", "pjit": "jit", "closed_call": "call"}


def body_name(eqn: Any) -> str:
    """How a user wrote the equation whose nested jaxpr a message points into: ``"scan"``, ``"jax.checkpoint"``
    (``remat2``), ``"jit"``, ``"cond"``, ``"while"``, ``"custom_vjp_call"``; the primitive's name otherwise.

    Verified on JAX 0.10.2. Used by ``step/_control_flow`` (errors say where a refused branch is).
    """
    name = primitive_name(eqn)
    return _BODY_NAMES.get(name, name)


def summed_axes(eqn: Any) -> tuple[str, ...]:
    """The mesh axes a ``psum`` equation (:data:`PSUM_PRIMITIVES`) sums over; ``()`` for another equation.

    Verified on JAX 0.10.2 (``params["axes"]``; positional axes of ``pmap`` are left out). Used by
    ``step/_control_flow``.
    """
    if primitive_name(eqn) not in PSUM_PRIMITIVES:
        return ()
    return tuple(a for a in eqn.params.get("axes", ()) if isinstance(a, str))


def equation_source(eqn: Any) -> str | None:
    """Where the user's code created ``eqn``: ``"file.py:12:8 (function)"`` (JAX's own frames skipped), or
    ``None`` when JAX keeps no source information.

    Verified on JAX 0.10.2 (``jax._src.source_info_util.summarize(eqn.source_info)``). Used by
    ``step/_control_flow`` (errors name the line).
    """
    try:
        from jax._src import source_info_util

        where = source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - a JAX that moved or changed it: the message goes without the line
        return None
    return where if where and "unknown" not in where else None


# ----------------------------------------------------------------------------------------------------------
# Pallas

TRITON_CROSS_TARGET = "NVIDIA H100"
"""The GPU a compiled Triton kernel is lowered for in a process with no GPU (a step lowered for ``cuda`` on a CPU
machine, ``jax.export``) by default: compute capability 9.0, the H100's and the H200's. JAX <= 0.10 falls back to
9.0 by itself; JAX >= 0.11 needs :func:`triton_lowering_target`."""


# Where this JAX keeps the GPU table its Triton lowering reads: moved out of Pallas in JAX 0.12.1.
_GPU_INFO_MODULES = ("jax._src.gpu_info", "jax._src.pallas.triton.gpu_info")


def _triton_gpu_info() -> Any:
    """The module whose ``get_gpu_info()`` this JAX's Triton lowering asks for the target GPU (JAX >= 0.11:
    ``jax._src.pallas.triton.gpu_info`` up to 0.12.0.1, ``jax._src.gpu_info`` from 0.12.1), or None (JAX <= 0.10,
    which asks ``jax.local_devices`` itself). Looked up when asked, so that importing the package does not import
    Pallas."""
    for name in _GPU_INFO_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return importlib.import_module(name)
        except ImportError:  # a parent package this JAX does not have
            continue
    return None


def _triton_reads_gpu_info() -> bool:
    """Whether this JAX's Triton lowering reads the target GPU from the abstract mesh's device (JAX >= 0.11)."""
    return _triton_gpu_info() is not None


def _has_gpu() -> bool:
    try:
        return bool(jax.local_devices(backend="gpu"))
    except RuntimeError:
        return False


@contextlib.contextmanager
def triton_lowering_target(device_kind: str = TRITON_CROSS_TARGET) -> Iterator[None]:
    """A context in which compiled Triton kernels lower for CUDA as for a GPU of ``device_kind`` (e.g. ``"NVIDIA
    H100"``, ``"NVIDIA H200"``, ``"NVIDIA B200"``) where the process has no GPU; a no-op where it has one.

    Two forms, chosen by what the running JAX has (a feature test: :func:`_triton_gpu_info`):

    * JAX <= 0.10 (verified on 0.10.2): the Triton lowering asks ``jax.local_devices(backend="gpu")`` and, with
      none, lowers for compute capability 9.0: only 9.0 can be had (another ``device_kind`` raises ``ValueError``).
    * JAX >= 0.11 (verified on 0.11.2's source, 0.12.0.1 and 0.12.1): it calls ``gpu_info.get_gpu_info()``, which
      reads the device kind of the *abstract mesh's abstract device*, the route JAX's error names ("please specify
      an abstract GPU device using AbstractDevice"), and on CPU devices without one raises ``RuntimeError: No
      supported GPU devices found``. A step whose mesh is a GPU topology's (``jax.experimental.topologies``) has
      that device already. A step traced on CPU devices cannot be traced under a GPU abstract mesh instead: inside
      ``shard_map`` every value's type carries the mesh, and a kernel traced under another mesh is refused ("context
      mesh ... should match the aval mesh"). So for the context's duration the Triton lowering's ``get_gpu_info()``
      runs under ``jax.sharding.use_abstract_mesh`` of the mesh it lowers in with ``AbstractDevice(device_kind,
      platform="gpu")``: the types are left alone, and only the lowering sees the GPU.

    Only lowering reads it: wrap ``.lower(..., lowering_platforms=("cuda",))`` or ``jax.export`` in it. Used by
    ``kernels`` (``vj.kernels.gpu_lowering_target``).
    """
    if _has_gpu():
        yield
        return
    gpu_info = _triton_gpu_info()
    if gpu_info is None:
        if device_kind != TRITON_CROSS_TARGET:
            raise ValueError(
                f"this JAX ({jax.__version__}) lowers Triton kernels without a GPU for compute capability 9.0 only "
                f"({TRITON_CROSS_TARGET}); got device_kind={device_kind!r}"
            )
        yield
        return
    if gpu_info.gpu_version_from_device_kind(device_kind) is None:
        known = ", ".join(repr(v.value) for v in gpu_info.GpuVersion)
        raise ValueError(f"unknown GPU device_kind {device_kind!r}; this JAX's Triton lowering knows {known}")
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    original = gpu_info.get_gpu_info

    def gpu_info_of_device() -> Any:
        mesh = jax.sharding.get_abstract_mesh().update(abstract_device=device)
        with jax.sharding.use_abstract_mesh(mesh):
            return original()

    gpu_info.get_gpu_info = gpu_info_of_device
    try:
        yield
    finally:
        gpu_info.get_gpu_info = original


@functools.cache  # the answer is the installed JAX's: asked once per process, not per bucket
def mosaic_gpu_kernel() -> bool:
    """Whether this JAX has Mosaic GPU's ``plgpu.kernel`` with strided register layouts (the ``mosaic_gpu``
    kernels of ``kernels/_ragged``: ``plgpu.kernel``, ``plgpu.load(..., layout=Layout.WG_STRIDED(...))``,
    ``plgpu.layout_cast``).

    Verified on JAX 0.10.2 and 0.12.0.1 (both True; both lower the kernels for CUDA without a GPU, to a
    ``mosaic_gpu_v2`` custom call). Used by ``kernels/_ragged`` (``refusal``, ``default_gpu_backend``).
    """
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu

        return all(hasattr(plgpu, n) for n in ("kernel", "load", "layout_cast", "Layout")) and hasattr(
            plgpu.Layout, "WG_STRIDED"
        )
    except ImportError:
        return False


def pallas_triton_deprecated() -> bool:
    """Whether Pallas's Triton backend is deprecated in this JAX (it warns at every lowering from JAX 0.11:
    "The Pallas Triton backend is deprecated ... migrate to the Mosaic GPU backend").

    Verified on JAX 0.10.2 (False: no warning) and 0.11.2 / 0.12.0.1 (True). Read off the version: the warning
    is raised at lowering time only. Used by ``kernels/_ragged`` (``default_gpu_backend``).
    """
    return _jax_version() >= (0, 11)


def _jax_version() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", jax.__version__).groups()
    return int(major), int(minor)


def mosaic_gpu_load(ref: Any, start: Any, width: int, layout: Any) -> Any:
    """``plgpu.load`` of ``ref[start : start + width]`` into registers with ``layout``.

    Verified on JAX 0.10.2 (``load(ref, idx, *, layout)``) and 0.12.0.1 (``load(ref, *, layout)``: the window is
    taken by ``ref.at[...]``). Used by ``kernels/_ragged`` (the Mosaic GPU body).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, pl.ds(start, width), layout=layout)
    return plgpu.load(ref.at[pl.ds(start, width)], layout=layout)


def mosaic_gpu_interpret_params() -> Any:
    """``plgpu.InterpretGPUParams()``: Mosaic GPU's own interpreter (runs a ``plgpu.kernel`` on CPU, every
    warpgroup's registers and layouts included), or None where this JAX has none.

    Verified on JAX 0.10.2 (None: no interpreter) and 0.12.0.1 (``plgpu.InterpretGPUParams``). Used by
    ``kernels/_ragged`` (``pack`` / ``unpack`` with ``interpret=True, backend="mosaic_gpu"``).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = getattr(plgpu, "InterpretGPUParams", None)
    return None if params is None else params()


# ----------------------------------------------------------------------------------------------------------
# The process's JAX runtime (no public API answers these without starting the backends)


def backends_are_initialized() -> bool:
    """Whether JAX's backends have started in this process (without starting them).

    Verified on JAX 0.10.2: ``jax._src.xla_bridge.backends_are_initialized()``; JAX publishes no equivalent
    (``jax.devices()`` and ``jax.process_count()`` would start the backends). False in a fresh process after
    ``import jax``, True once ``jax.devices()`` ran. Used by ``distributed`` (``initialize`` refuses to join a
    job after the backends started).
    """
    from jax._src import xla_bridge

    return bool(xla_bridge.backends_are_initialized())


def cluster_types() -> list[Any]:
    """JAX's cluster detectors (SLURM, Open MPI, Kubernetes, Cloud TPU, ...), or ``[]`` if the private API
    moved (then ``jax.distributed.initialize()`` still detects; only ``vj.distributed.detect_cluster`` is
    blind).

    Verified on JAX 0.10.2: ``jax._src.clusters.ClusterEnv._cluster_types``, classes with ``__name__``,
    ``is_env_present()``, ``get_process_count()`` and ``opt_in_only_method``; JAX publishes no detection that
    does not also initialise. Used by ``distributed`` (``detect_cluster``).
    """
    try:
        from jax._src import clusters

        return list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError):
        return []


def distributed_job() -> tuple[str | None, int, int]:
    """``(coordinator_address, num_processes, process_id)`` of the job ``jax.distributed`` was initialised with
    (however it was called); ``(None, 1, 0)`` before it was.

    Verified on JAX 0.10.2: ``jax._src.distributed.global_state`` (``coordinator_address``, ``num_processes``,
    ``process_id``, None until initialised); JAX publishes no coordinator address, and ``jax.process_count()``
    would start the backends. Used by ``distributed`` (``initialize``, ``is_multiprocess``).
    """
    from jax._src.distributed import global_state

    return global_state.coordinator_address, int(global_state.num_processes or 1), int(global_state.process_id or 0)


def coordination_client() -> Any | None:
    """This process's client of JAX's coordination service (its key-value store), or ``None`` before
    ``jax.distributed.initialize`` (and in a job that never called it).

    Verified on JAX 0.10.2: ``jax._src.distributed.global_state.client``, a ``DistributedRuntimeClient`` with
    ``key_value_set(key, value, allow_overwrite=...)`` and ``key_value_dir_get(prefix)`` (a list of
    ``(key, value)`` string pairs, keys in full); its calls are RPCs to process 0, which hang while process 0 is
    stopped and raise once it is gone. JAX publishes no key-value store. Used by ``distributed`` (the step
    watchdog publishes each process's progress and reads its peers').
    """
    from jax._src.distributed import global_state

    return getattr(global_state, "client", None)


# ----------------------------------------------------------------------------------------------------------
# optax

_PARAMS_PLACEHOLDER = _optax_state_utils._ParamsPlaceholder


def is_params_placeholder(params: Any) -> bool:
    """Whether ``params`` is the stand-in ``optax.tree.map_params`` passes to ``tx.init`` (to find the
    parameter-shaped parts of a state), rather than parameters.

    Verified on optax 0.2.8: ``optax.tree_utils._state_utils._ParamsPlaceholder``, a leafless pytree node;
    optax exports no type to test for it. Used by ``optim/_masks`` (``masked`` / ``partition`` hand it on to
    the inner transformations).
    """
    return isinstance(params, _PARAMS_PLACEHOLDER)


MUON_NS_COEFFS_PRESETS: Mapping[str, Any] = _optax_muon._NS_COEFFS_PRESET_DICT
"""The Newton–Schulz coefficient presets ``optax.contrib.muon(ns_coeffs="standard" / "dion")`` accepts, by
name. Verified on optax 0.2.8 (``optax.contrib._muon._NS_COEFFS_PRESET_DICT``; optax publishes no table).
Used by ``optim/_muon/_transform``, so that ``vj.optim.muon``'s string presets are optax's."""

MUON_DEFAULT_NS_COEFFS: Any = _optax_muon._DEFAULT_NS_COEFFS
"""``optax.contrib.scale_by_muon``'s default Newton–Schulz coefficients. Verified on optax 0.2.8
(``optax.contrib._muon._DEFAULT_NS_COEFFS``). Used by ``optim/_muon/_transform`` (the same default)."""

MUON_PRECONDITIONINGS: tuple[str, ...] = tuple(_optax_muon._PRECONDITIONINGS)
"""The ``preconditioning=`` values ``optax.contrib.muon`` accepts (``"frobenius"``, ``"spectral"``, ``"aol"``,
``"schatten"`` on optax 0.2.8; ``optax.contrib._muon._PRECONDITIONINGS``). Used by ``optim/_muon/_transform``."""


def muon_orthogonalize(x: jax.Array, coeffs: jax.Array, ns_steps: int, preconditioning: str, eps: Any) -> jax.Array:
    """Orthogonalises one ``(p, q)`` matrix by optax's Newton–Schulz iteration (what ``optax.contrib.muon``
    applies to a 2-D leaf), with ``preconditioning`` one of :data:`MUON_PRECONDITIONINGS`.

    Verified on optax 0.2.8: ``optax.contrib._muon.orthogonalize_via_newton_schulz(x, ns_coeffs, ns_steps,
    preconditioning, eps)``, not exported by ``optax.contrib``. Used by ``optim/_muon/_transform`` (the
    non-Frobenius preconditionings).
    """
    return _optax_muon.orthogonalize_via_newton_schulz(x, coeffs, ns_steps, preconditioning, eps)


def muon_normalize_axes(shape: Sequence[int], dims: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(reduction_axes, output_axes)`` of a leaf of ``shape`` under ``MuonDimensionNumbers`` ``dims``, as
    non-negative tuples, as ``optax.contrib.muon`` reads them (an int axis becomes a 1-tuple).

    Verified on optax 0.2.8: ``optax.contrib._muon._normalize_axes(x, dims)``, which reads only ``x.ndim``.
    Used by ``optim/_muon/_transform`` (the fan-in / fan-out of the shape scaling).
    """
    return _optax_muon._normalize_axes(np.broadcast_to(np.empty((), np.float32), tuple(shape)), dims)


OPTAX_MUON_MODULE: str = optax.contrib.muon.__module__
"""The module defining ``optax.contrib.muon`` (``"optax.contrib._muon"`` on optax 0.2.8), read off the public
function. Assumes its ``'muon'`` / ``'adam'`` labelling of leaves runs in a frame of that module. Used by
``state/_guards`` (names the optax code that mapped a per-leaf function over bucket buffers)."""

OPTAX_MASKING_MODULE: str = optax.masked.__module__
"""The module defining ``optax.masked`` (``"optax.transforms._masking"`` on optax 0.2.8); assumes a callable
mask is called in a frame of it. Used by ``state/_guards``."""

OPTAX_PARTITION_MODULE: str = optax.partition.__module__
"""The module defining ``optax.partition`` / ``optax.multi_transform`` (``"optax.transforms._combining"`` on
optax 0.2.8); assumes callable labels are called in a frame of it. Used by ``state/_guards``."""


def _per_leaf_codes() -> dict[Any, str]:
    factories = {
        "scale_by_trust_ratio": optax.scale_by_trust_ratio,
        "scale_by_param_block_norm": optax.scale_by_param_block_norm,
        "scale_by_param_block_rms": optax.scale_by_param_block_rms,
        "clip_by_block_rms": lambda: optax.clip_by_block_rms(1.0),
        "scale_by_factored_rms": optax.scale_by_factored_rms,
        "scale_by_sm3": optax.scale_by_sm3,
        "scale_by_novograd": optax.scale_by_novograd,
    }
    empty = getattr(optax.init_empty_state, "__code__", None)
    codes = {}
    for name, factory in factories.items():
        tx = factory()
        for fn in (tx.init, tx.update):
            code = getattr(fn, "__code__", None)
            if code is not None and code is not empty:
                codes[code] = name
    return codes


OPTAX_PER_LEAF_CODES: Mapping[Any, str] = _per_leaf_codes()
"""The code objects of the ``init`` / ``update`` functions of optax's per-leaf norm and shape transformations,
to their public names (``scale_by_trust_ratio``, which ``optax.lamb``, ``lars`` and ``fromage`` chain;
``scale_by_param_block_norm`` / ``_rms``; ``clip_by_block_rms``; ``scale_by_factored_rms`` of ``adafactor``;
``scale_by_sm3``; ``scale_by_novograd``). Assumes (verified on optax 0.2.8) each returns a transformation whose
``init`` / ``update`` is a plain function that maps its per-leaf computation over the tree in its own frame.
Used by ``state/_guards`` (a per-leaf transformation that reaches the bucket buffers of a ``ShardedParams``)."""


def _norm_codes() -> dict[Any, str]:
    named = {"global_norm": optax.global_norm, "tree.norm": optax.tree.norm}
    return {fn.__code__: name for name, fn in named.items() if hasattr(fn, "__code__")}


OPTAX_NORM_CODES: Mapping[Any, str] = _norm_codes()
"""The code objects of ``optax.global_norm`` and ``optax.tree.norm`` (which it calls) to their public names.
Assumes (verified on optax 0.2.8) both are plain functions that map over the tree in their own frame. Used by
``state/_guards`` (an eager norm of a ``ShardedParams`` outside ``jax.set_mesh``)."""


ELEMENTWISE_PRIMITIVES = frozenset(
    {
        "abs",
        "acos",
        "acosh",
        "add",
        "and",
        "asin",
        "asinh",
        "atan",
        "atan2",
        "atanh",
        "cbrt",
        "ceil",
        "clamp",
        "convert_element_type",
        "copy",
        "copy_p",
        "cos",
        "cosh",
        "div",
        "eq",
        "erf",
        "erf_inv",
        "erfc",
        "exp",
        "exp2",
        "expm1",
        "floor",
        "ge",
        "gt",
        "integer_pow",
        "is_finite",
        "le",
        "log",
        "log1p",
        "logistic",
        "lt",
        "max",
        "min",
        "mul",
        "ne",
        "neg",
        "nextafter",
        "not",
        "or",
        "pow",
        "reduce_precision",
        "rem",
        "round",
        "rsqrt",
        "select_n",
        "sign",
        "sin",
        "sinh",
        "sqrt",
        "square",
        "sub",
        "tan",
        "tanh",
        "xor",
    }
)
"""Primitives that compute each output element from the operand elements at the same index (operands of one
shape, scalars broadcast explicitly): evaluating one on a slice of every operand gives that slice of the output,
bit for bit. Verified on JAX 0.10.2 (Optax's Adam, AdamW, SGD with momentum, Lion and the ``vj.optim`` masks
trace to these plus ``broadcast_in_dim`` of scalars). Used by ``step/_offload`` (a bucket's optimizer update is
streamed one layer at a time when every operation of it is one of these)."""


def is_elementwise(eqn: Any) -> bool:
    """Whether ``eqn`` applies an element-wise primitive (:data:`ELEMENTWISE_PRIMITIVES`).

    Verified on JAX 0.10.2. Used by ``step/_offload``.
    """
    return primitive_name(eqn) in ELEMENTWISE_PRIMITIVES


def is_broadcast(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``broadcast_in_dim`` (its output shape in ``eqn.params["shape"]``).

    Verified on JAX 0.10.2. Used by ``step/_offload``.
    """
    return primitive_name(eqn) == "broadcast_in_dim" and "shape" in eqn.params


def with_shape(eqn: Any, shape: tuple[int, ...]) -> Any:
    """A ``broadcast_in_dim`` equation (:func:`is_broadcast`) that broadcasts to ``shape`` instead.

    Verified on JAX 0.10.2 (``JaxprEqn.replace``). Used by ``step/_offload``.
    """
    return eqn.replace(params={**eqn.params, "shape": tuple(shape)})


def is_row_constraint(eqn: Any) -> bool:
    """Whether ``eqn`` is a ``sharding_constraint`` whose sharding leaves dim 0 whole (a stacked bucket's
    ``P(None, axis)``): it constrains a slice of rows as it does the whole array.

    Verified on JAX 0.10.2 (``eqn.params["sharding"]`` a ``NamedSharding``). Used by ``step/_offload``.
    """
    spec = constraint_spec(eqn)
    return spec is not None and (len(spec) == 0 or spec[0] is None)


def constraint_spec(eqn: Any) -> Any:
    """The ``PartitionSpec`` of a ``sharding_constraint`` equation, else ``None``.

    Verified on JAX 0.10.2 (``eqn.params["sharding"]`` a ``NamedSharding``). Used by ``step/_offload``.
    """
    if primitive_name(eqn) != "sharding_constraint":
        return None
    return getattr(eqn.params.get("sharding"), "spec", None)
