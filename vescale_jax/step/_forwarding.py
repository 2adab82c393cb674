"""Which outputs of a traced function are its inputs, unchanged: read through every lifted transform.

A model's variable handed out of ``nnx.remat`` / ``nnx.scan`` / ``nnx.jit`` / ``nnx.cond`` ... and back is a new
traced value, though it holds the value that went in. :func:`forwarded_inputs` tells such a value from a real
update by following the jaxpr: through nested calls, ``jax.checkpoint``, the primal of ``custom_jvp`` /
``custom_vjp``, copies, ``cond`` branches that all hand the same operand back, a ``scan`` or ``while`` carry the
body hands back unchanged, and ``scan`` outputs stacked from the scanned inputs as they were.
"""

from __future__ import annotations

from typing import Any

from vescale_jax._compat import call_body, cond_parts, is_literal, passes_values_through, scan_parts, while_parts

__all__ = ["forwarded_inputs"]


def forwarded_inputs(jaxpr: Any) -> list[int | None]:
    """For each output of ``jaxpr``, the position of the input whose value it is, unchanged; ``None`` for an
    output computed from anything else (or that this analysis cannot follow).

    Args:
      jaxpr: an open jaxpr (``closed.jaxpr`` of :func:`jax.make_jaxpr`'s result). Its constants count as
        computed values: an output that is a closed-over value is not an input.

    Returns:
      One entry per ``jaxpr.outvars``.
    """
    return _forward(jaxpr, {})


def _forward(jaxpr: Any, memo: dict[int, list[int | None]]) -> list[int | None]:
    key = id(jaxpr)
    if key not in memo:
        src: dict[Any, int] = {v: i for i, v in enumerate(jaxpr.invars)}
        for eqn in jaxpr.eqns:
            for out, origin in zip(eqn.outvars, _equation(eqn, memo), strict=True):
                atom = None if origin is None else eqn.invars[origin]
                if atom is not None and not is_literal(atom) and atom in src:
                    src[out] = src[atom]
        memo[key] = [None if is_literal(v) else src.get(v) for v in jaxpr.outvars]
    return memo[key]


def _equation(eqn: Any, memo: dict[int, list[int | None]]) -> list[int | None]:
    """For each output of ``eqn``, the operand position whose value it is unchanged, or None."""
    if passes_values_through(eqn):
        return list(range(len(eqn.outvars)))
    body = call_body(eqn)
    if body is not None:
        return _forward(body.jaxpr, memo)
    none: list[int | None] = [None] * len(eqn.outvars)
    cond = cond_parts(eqn)
    if cond is not None:
        _, branches, _ = cond
        per_branch = [_forward(b, memo) for b in branches]
        return [1 + f[0] if f[0] is not None and len(set(f)) == 1 else None for f in zip(*per_branch, strict=True)]
    scan = scan_parts(eqn)
    if scan is not None:
        body_jaxpr, nc, nk = scan
        fwd = _forward(body_jaxpr, memo)
        out = list(none)
        for k, f in enumerate(fwd):
            if k < nk and f == nc + k:  # a carry handed back unchanged
                out[k] = nc + k
            elif k >= nk and f is not None and f >= nc + nk:  # ys stacked from the xs as they were scanned
                out[k] = f
        return out
    loop = while_parts(eqn)
    if loop is not None:
        _, body_jaxpr, cond_consts, body_consts, _ = loop
        nc, nb = len(cond_consts), len(body_consts)
        fwd = _forward(body_jaxpr, memo)
        return [nc + nb + k if f == nb + k else None for k, f in enumerate(fwd)]
    return none
