"""``vj.apply``'s outputs under the default ``out_specs``: per-example values split, batch statistics whole.

``shard_map`` needs its ``out_specs`` before the model is traced, but whether an output is per-example (rows of
the batch, one slice per device) or a value of the whole batch (the same on every device) is known only once the
model is traced: whether the output depends on the device's slice of the batch
(:func:`vescale_jax.step._control_flow.batch_dependence`). Every output therefore leaves the ``shard_map`` split
on dim 0 over the data axes, and the decision is made while tracing:

* an output that depends on the batch slice is per-example: its dim 0 is the device's rows (a scalar cannot be,
  and is refused, naming the output and the fix);
* an output that does not (computed with ``vj.batch_mean``, or from the parameters alone) gets a leading
  length-1 dim inside, and the copy of device 0 is taken outside: the model's value, as the unsharded model
  returns it. Its cotangent reaches the one copy taken (zero on the other devices), and the backward sums it
  over the devices (the ``shard_map``'s transpose for a value typed as not varying, the gradient's
  reduce-scatter for the parameters), so it differentiates as the unsharded output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["split_or_whole"]


def split_or_whole(
    fn: Callable[..., Any],
    axes: tuple[str, ...],
    mesh: jax.sharding.Mesh,
    dependence: list[bool],
    *,
    state: bool = False,
) -> tuple[Callable[..., Any], Callable[[Any], Any]]:
    """``(wrapped fn, finish)`` for outputs with ``out_specs=P(axes)``: ``finish`` turns the ``shard_map``'s
    results into the model's outputs (see the module docstring).

    Args:
      fn: the model, called inside the ``shard_map``.
      axes: the data axes.
      mesh: the ``shard_map``'s mesh.
      dependence: per output leaf, whether it depends on the batch slice; filled while ``fn`` is traced
        (:func:`vescale_jax.step._control_flow.checked_model`).
      state: ``fn`` returns ``(outputs, new_state)``: only ``outputs`` are split or whole, ``new_state`` passes
        as it is (its own ``out_specs``).

    Returns:
      The wrapped model and the function to apply to the ``shard_map``'s outputs (after the wrapped model was
      traced).

    Sharding:
      Per-example outputs: dim 0 split over ``axes``. Whole outputs: replicated.
    """
    whole: list[bool] = []

    @functools.wraps(fn)
    def wrapped(*a: Any) -> Any:
        result = fn(*a)
        out = result[0] if state else result
        flat, tree = jax.tree_util.tree_flatten_with_path(out)
        kinds = [not d for d in dependence[: len(flat)]]  # the outputs' leaves come first (before the state's)
        for (path, leaf), is_whole in zip(flat, kinds, strict=True):
            if not is_whole and not np.shape(leaf):
                raise _scalar(jax.tree_util.keystr(path) or "<root>", axes)
        whole[:] = kinds
        out = jax.tree_util.tree_unflatten(tree, [x[None] if w else x for (_, x), w in zip(flat, kinds, strict=True)])
        return (out, result[1]) if state else out

    replicated = NamedSharding(mesh, P())

    def finish_outputs(out: Any) -> Any:
        leaves, tree = jax.tree.flatten(out)
        if len(whole) != len(leaves):  # not traced by this call (cannot happen: each call wraps afresh)
            raise RuntimeError("vj.apply: the model's outputs were not traced")
        return jax.tree.unflatten(
            tree, [jax.sharding.reshard(x, replicated)[0] if w else x for x, w in zip(leaves, whole, strict=True)]
        )

    def finish(result: Any) -> Any:
        return (finish_outputs(result[0]), result[1]) if state else finish_outputs(result)

    return wrapped, finish


def _scalar(name: str, axes: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"vj.apply: output {name} of the model is a scalar computed from each device's slice of the batch (the data "
        f"axes are {axes}): it differs between devices and is not the unsharded model's value, and averaging it "
        "over the devices afterwards is not either for anything but a plain mean (a product of means, a ratio). "
        "Compute it over the global batch with vj.batch_mean / vj.batch_sum (it is then returned whole, as "
        "unsharded), or return per-example values (dim 0 the batch) and reduce outside: jnp.mean(vj.apply(...))."
    )
