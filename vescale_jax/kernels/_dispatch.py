"""Pack and unpack by policy: XLA's slices and concatenate (the kernels' reference) or the Pallas kernels.

:func:`pack` lays a bucket's leaves into its flat buffer (padding zero), :func:`unpack` reads them back by static
slices; :func:`unpack_differentiable` is an unpack whose transpose is a pack. A :class:`KernelPolicy` picks the
implementation per layout and dtype; the XLA path is :func:`pack_reference` / :func:`unpack_reference`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from vescale_jax.kernels import _ragged, _tiles
from vescale_jax.kernels._policy import KernelPolicy
from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout._blocks import BucketBlocks
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = ["DEFAULT_KERNELS", "kernel_choices", "pack", "per_platform", "unpack", "unpack_differentiable"]

DEFAULT_KERNELS = KernelPolicy()
"""XLA's slices and concatenate (the policy's defaults; immutable, so one shared instance)."""


def _how(impl: str) -> tuple[str, tuple[tuple[str, Any], ...]]:
    if impl == "xla":
        return "xla", ()
    if impl == "interpret":
        return "pallas", (("interpret", True),)
    return "pallas", (("interpret", False), ("backend", impl))


def _by_platform(
    policy: KernelPolicy, layout: BucketLayout, src: Any, dst: Any, name: str, run, *args: Any, direction: str
) -> Any:
    """``run(how, kw, *args)`` with the implementation of the platform the step is lowered for.

    One implementation for every platform the policy lowers for (:meth:`KernelPolicy.lowering_platforms`):
    called directly. Several (the interpreter on CPU, the compiled kernel for CUDA): a
    ``jax.lax.platform_dependent``, of which lowering keeps the target platform's branch only.
    """
    hows = {
        p: _how(policy.implementation(layout, src, dst, platform=p, direction=direction, name=name))
        for p in policy.lowering_platforms()
    }
    if len(set(hows.values())) == 1:
        how, kw = next(iter(hows.values()))
        return run(how, dict(kw), *args)
    branches = {p: (lambda *a, h=h: run(h[0], dict(h[1]), *a)) for p, h in hows.items()}
    return jax.lax.platform_dependent(*args, **branches)


def per_platform(choices: Mapping[str, Any], run: Callable[..., Any], *args: Any) -> Any:
    """``run(choice, *args)`` with the choice of the platform the step is lowered for.

    Args:
      choices: per lowering platform (:meth:`KernelPolicy.lowering_platforms`), a hashable choice (e.g. a
        kernel's options as a tuple of items, or None for the XLA path).
      run: ``(choice, *args) -> result``, the same result structure for every choice.
      *args: the arrays ``run`` takes.

    Returns:
      ``run``'s result: called directly when every platform makes the same choice, else a
      ``jax.lax.platform_dependent`` of which lowering keeps the target platform's branch only.
    """
    if len(set(choices.values())) == 1:
        return run(next(iter(choices.values())), *args)
    return jax.lax.platform_dependent(*args, **{p: functools.partial(run, c) for p, c in choices.items()})


def kernel_choices(
    policy: KernelPolicy,
    layout: BucketLayout,
    src: Any,
    dst: Any,
    *,
    direction: str | None = None,
    blocks: BucketBlocks | None = None,
) -> dict[str, tuple[tuple[str, Any], ...] | None] | None:
    """The fused kernels' options per lowering platform (None: the XLA path there), or None when no platform
    runs them: interpreted, or compiled (:meth:`KernelPolicy.fused_implementation`; ``blocks``: the FP8
    kernels' block index)."""
    if policy.mode != "pallas" or not layout.total_size:
        return None
    out: dict[str, tuple[tuple[str, Any], ...] | None] = {}
    for p in policy.lowering_platforms():
        impl = policy.fused_implementation(layout, src, dst, platform=p, direction=direction, blocks=blocks)
        out[p] = None if impl == "xla" else _how(impl)[1]
    return out if any(v is not None for v in out.values()) else None


_XLA = KernelPolicy(mode="xla")


def unpack(
    full: jax.Array,
    layout: BucketLayout,
    shapes: Sequence[tuple[int, ...]],
    *,
    kernels_policy: KernelPolicy,
    storage: Sequence[Any] = (),
    name: str = "",
) -> list[jax.Array]:
    """Slot ``i`` of a full ``(..., total_size)`` buffer: ``full[..., o:o+n].reshape(shapes[i])``.

    Leading dims (the layers of a stacked bucket) are mapped over; ``shapes`` then include them. ``storage``
    (a bucket's ``storage``) names the slots stored tile-major: they are sliced flat, then relaid out."""
    shapes = [tuple(s) for s in shapes]
    lead = full.shape[:-1]
    choices = (
        kernel_choices(kernels_policy, layout, full.dtype, full.dtype, direction="unpack") if any(storage) else None
    )
    if choices is not None:  # tile-major slots: the relayout fused into the kernel

        def run_tiled(c, f):
            if c is None:
                return unpack(f, layout, shapes, kernels_policy=_XLA, storage=storage)
            return list(_tiles.unpack_tiled_mapped(f, layout, shapes, storage=storage, **dict(c)))

        return list(per_platform(choices, run_tiled, full))
    if any(storage):
        flat = unpack(full, layout, [(*lead, n) for n in layout.sizes], kernels_policy=kernels_policy, name=name)
        return [
            jnp.reshape(x, s) if g is None else tiles.from_storage(x, s[len(lead) :], g, jnp)
            for x, s, g in zip(flat, shapes, storage, strict=True)
        ]
    if lead:
        per = [s[len(lead) :] for s in shapes]
        fn = lambda f: unpack(f, layout, per, kernels_policy=kernels_policy, name=name)
        for _ in lead:
            fn = jax.vmap(fn)
        return list(fn(full))

    def run(how, kw, f):
        if how == "xla":
            return _ragged.unpack_reference(f, layout, shapes)
        return _ragged.unpack(f, layout, shapes, **kw)

    return list(_by_platform(kernels_policy, layout, full.dtype, full.dtype, name, run, full, direction="unpack"))


def pack(
    leaves: Sequence[jax.Array],
    layout: BucketLayout,
    *,
    dtype: Any,
    kernels_policy: KernelPolicy,
    lead: tuple[int, ...] = (),
    storage: Sequence[Any] = (),
    name: str = "",
) -> jax.Array:
    """The ``(*lead, total_size)`` buffer of ``leaves`` (cast to ``dtype``), padding zero.

    Args:
      leaves: one array per slot with ``lead + (anything with layout.sizes[i] elements)`` shape (a slot
        stored tile-major: ``lead + its logical shape``).
      layout: the bucket layout.
      dtype: the buffer's dtype (the cast is fused into the kernel).
      kernels_policy: XLA's concatenate or the Pallas pack kernel.
      lead: leading dims mapped over (the layers of a stacked bucket).
      storage: a bucket's ``storage``: the slots laid out tile-major before packing.
      name: the bucket's name, for the errors of a policy that refuses it.
    """
    choices = None
    if leaves and any(storage):
        choices = kernel_choices(kernels_policy, layout, leaves[0].dtype, dtype, direction="pack")
    if choices is not None:  # tile-major slots: the relayout fused into the kernel

        def run_tiled(c, xs):
            if c is None:
                return pack(xs, layout, dtype=dtype, kernels_policy=_XLA, lead=lead, storage=storage)
            return _tiles.pack_tiled_mapped(xs, layout, storage=storage, dtype=dtype, lead=lead, **dict(c))

        return per_platform(choices, run_tiled, list(leaves))
    if any(storage):
        leaves = [
            x if g is None else tiles.to_storage(x, x.shape[len(lead) :], g, jnp)
            for x, g in zip(leaves, storage, strict=True)
        ]
    if lead:
        fn = lambda *xs: pack(xs, layout, dtype=dtype, kernels_policy=kernels_policy, lead=lead[1:], name=name)
        return jax.vmap(fn)(*leaves)

    def run(how, kw, xs):
        if how == "xla":
            return _ragged.pack_reference(list(xs), layout, dtype=dtype)
        return _ragged.pack(list(xs), layout, dtype=dtype, **kw)

    src = leaves[0].dtype if leaves else dtype
    return _by_platform(kernels_policy, layout, src, dtype, name, run, list(leaves), direction="pack")


def unpack_differentiable(
    full: jax.Array,
    layout: BucketLayout,
    shapes: Sequence[tuple[int, ...]],
    *,
    kernels_policy: KernelPolicy,
    storage: Sequence[Any] = (),
    name: str = "",
) -> list[jax.Array]:
    """:func:`unpack` whose transpose is :func:`pack` (one concatenate or one kernel), padding zero."""
    shapes = tuple(tuple(s) for s in shapes)
    lead = tuple(full.shape[:-1])

    @jax.custom_vjp
    def run(f):
        return unpack(f, layout, shapes, kernels_policy=kernels_policy, storage=storage, name=name)

    def fwd(f):
        return run(f), None

    def bwd(_, cts):
        return (
            pack(cts, layout, dtype=full.dtype, kernels_policy=kernels_policy, lead=lead, storage=storage, name=name),
        )

    run.defvjp(fwd, bwd)
    return list(run(full))
