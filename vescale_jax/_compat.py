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
  (:func:`is_convert`, :func:`convert_dtype`), :data:`PVARY` (:func:`is_pvary`, :func:`pvary_axes`).
* the process's JAX runtime: :func:`backends_are_initialized`, :func:`cluster_types`,
  :func:`distributed_job`.
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

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from optax.contrib import _muon as _optax_muon
from optax.tree_utils import _state_utils as _optax_state_utils

__all__ = [
    "BILINEAR_PRIMITIVES",
    "CONVERT_ELEMENT_TYPE",
    "LINEAR_OPERANDS",
    "MUON_DEFAULT_NS_COEFFS",
    "MUON_NS_COEFFS_PRESETS",
    "MUON_PRECONDITIONINGS",
    "NESTED_CALL_PRIMITIVES",
    "OPTAX_MASKING_MODULE",
    "OPTAX_MUON_MODULE",
    "OPTAX_PARTITION_MODULE",
    "OPTAX_PER_LEAF_CODES",
    "PVARY",
    "SELECT_N",
    "TRACER_TYPES",
    "VIEW_PRIMITIVES",
    "ClosedJaxpr",
    "Literal",
    "as_closed",
    "backends_are_initialized",
    "bind_equation",
    "cluster_types",
    "convert_dtype",
    "distributed_job",
    "is_convert",
    "is_linear_in",
    "is_literal",
    "is_nested_call",
    "is_params_placeholder",
    "is_pvary",
    "is_tracer",
    "is_view",
    "muon_normalize_axes",
    "muon_orthogonalize",
    "nested_call_jaxpr",
    "primitive_name",
    "pvary_axes",
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

    Verified on JAX 0.10.2. Assumes ``eqn.ctx.manager`` (the equation's context: name stack, remat policy,
    ...), ``eqn.primitive.bind``, ``eqn.primitive.get_bind_params(eqn.params)`` (turns stored parameters, e.g.
    a custom_vjp's jaxprs, back into bind arguments) and ``eqn.primitive.multiple_results``, so that re-binding
    every equation of a traced function reproduces it, nested ``jit`` / ``scan`` / ``while`` / ``cond`` /
    ``checkpoint`` / ``custom_jvp`` / ``custom_vjp`` / ``shard_map`` equations included. Used by ``step/_jaxpr``
    (and through it ``step/_point_of_use``, ``step/_layer_split``, ``step/_fp32_grads``, ``step/_wire_segment``).
    """
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
