"""Orbax's replica slicing of replicated storage blocks, run ahead of a save so its executables are compiled.

When a stored array's storage blocks are replicated (a leaf with no dim the device count divides is stored split
over fewer devices than the mesh has, or whole on each), Orbax's ``ArrayHandler`` has each replica write a part of
its block: before the device-to-host copy it slices each device's shard with ``jax.lax.slice_in_dim``
(``ReplicaSlice.data``), one small executable per device, shape and slice, compiled on the first save.
:func:`precompile` runs that same slicing (Orbax's own ``get_replica_slices``, with the settings of the
``jax.Array`` handler a ``StandardCheckpointHandler`` uses) on arrays of the stored shapes and shardings, so the
first save finds them compiled.

The one Orbax internal the checkpoint layer relies on, pinned by ``tests/test_checkpoint_prepare.py``. Verified on
Orbax 0.12.8: ``orbax.checkpoint._src.serialization.replica_slices.get_replica_slices(arr, replica_id,
use_replica_parallel, min_slice_bytes_for_replica_parallel, max_replicas_for_replica_parallel)`` returns
``ReplicaSlices`` whose ``replica_slices[i].data()`` is the sliced device array, and the handler
``ocp.type_handlers.get_type_handler(jax.Array)`` keeps those settings as ``_replica_id``,
``_use_replica_parallel``, ``_min_slice_bytes_for_replica_parallel`` and ``_max_replicas_for_replica_parallel``
(``ArrayHandler.serialize`` passes them on). If either is gone this does nothing (the first save then compiles
the slices, as before); the test names what broke.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

__all__ = ["handler_settings", "precompile", "replica_count", "zeros"]

_SETTINGS = (
    "_replica_id",
    "_use_replica_parallel",
    "_min_slice_bytes_for_replica_parallel",
    "_max_replicas_for_replica_parallel",
)


def _get_replica_slices() -> Any | None:
    try:
        module = importlib.import_module("orbax.checkpoint._src.serialization.replica_slices")
    except ImportError:  # pragma: no cover - an Orbax that moved it
        return None
    return getattr(module, "get_replica_slices", None)


def handler_settings() -> tuple[Any, ...] | None:
    """``(replica_id, use_replica_parallel, min_slice_bytes, max_replicas)`` of the ``jax.Array`` handler Orbax
    saves with, or ``None`` where this Orbax keeps them otherwise."""
    try:
        handler = ocp.type_handlers.get_type_handler(jax.Array)
    except Exception:  # pragma: no cover - a registry without a jax.Array handler
        return None
    if not all(hasattr(handler, name) for name in _SETTINGS):
        return None
    return tuple(getattr(handler, name) for name in _SETTINGS)


def replica_count(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> int:
    """How many devices hold each storage block of an array of ``shape`` under ``sharding``."""
    indices = sharding.devices_indices_map(tuple(shape)).values()
    distinct = {tuple((s.start, s.stop, s.step) for s in index) for index in indices}
    return len(sharding.device_set) // max(len(distinct), 1)


def _may_slice(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> bool:
    """Whether Orbax may slice this array's shards: replicated blocks, non-empty, a dim the replicas divide."""
    count = replica_count(shape, sharding)
    local = sharding.shard_shape(tuple(shape))
    return count > 1 and 0 not in local and any(d % count == 0 for d in local)


def zeros(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> jax.Array:
    """An array of zeros placed shard by shard from the host (nothing compiled, unlike ``jnp.zeros``)."""
    local = sharding.shard_shape(tuple(shape))
    return jax.make_array_from_callback(tuple(shape), sharding, lambda _: np.zeros(local, dtype))


def precompile(leaves: Iterable[Any]) -> None:
    """Runs Orbax's replica slicing once per distinct (shape, dtype, sharding) among ``leaves``.

    Args:
      leaves: the arrays a save hands Orbax, or ``jax.ShapeDtypeStruct`` s with their shardings (an array of
        zeros stands in for those; one at a time). Leaves without a sharding, or whose blocks are not
        replicated, are skipped.
    """
    slices, settings = _get_replica_slices(), handler_settings()
    if slices is None or settings is None:
        return
    seen = set()
    for x in leaves:
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding) or not hasattr(x, "shape"):
            continue
        shape, dtype = tuple(x.shape), np.dtype(x.dtype)
        key = (shape, dtype, sharding)
        if key in seen or not _may_slice(shape, sharding):
            continue
        seen.add(key)
        arr = x if isinstance(x, jax.Array) else zeros(shape, dtype, sharding)
        rslices = slices(arr, *settings)
        jax.block_until_ready([r.data() for r in rslices.replica_slices if r.slice_args is not None])
        del arr
