"""Hugging Face safetensors checkpoints in and out, each process reading or writing only its own byte ranges.

:func:`load_safetensors` builds a plan's :class:`~vescale_jax.ShardedParams` straight from the files: each process
fills each of its own devices' shards of a bucket on the host (the leaf elements that shard holds, TP/EP groups
and tile-major leaves included, read through the mapping's index arithmetic: :mod:`._hf_shards`), one shard at a
time, and hands them to ``jax.make_array_from_single_device_arrays``. :func:`save_safetensors` lays the files out
on every process alike, process 0 writes the headers and the index and preallocates the files, then every process
``pwrite`` s the bytes of its own shards (one replica of each).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from vescale_jax.checkpoint._hf_index import Bound, bind, check_cast, near
from vescale_jax.checkpoint._hf_mapping import Mapping
from vescale_jax.checkpoint._hf_shards import fill_shard, write_shard
from vescale_jax.checkpoint._safetensors_files import (
    Checkpoint,
    Reader,
    Writer,
    create_files,
    layout_files,
    open_checkpoint,
    parse_size,
)
from vescale_jax.layout._plan import Plan
from vescale_jax.state._containers import ShardedParams

__all__ = ["load_safetensors", "save_safetensors"]


def _check_files(bounds: Sequence[Bound], ckpt: Checkpoint, mapping: Mapping, ignore: Sequence[str], cast: str):
    """Every tensor the leaves need exists with the shape and a castable dtype; no tensor is left unused."""
    used = set()
    for bd in bounds:
        npat = len(bd.entry.tensors)
        for j, name in enumerate(bd.names):
            used.add(name)
            info = ckpt.tensors.get(name)
            where = f"load_safetensors: leaf {bd.path!r} {bd.shape} {bd.dtype.name} <- tensor {name!r}"
            want = bd.tensor_shape[j % npat]
            if info is None and name in ckpt.weight_map:
                file = ckpt.weight_map[name]
                held = [n for n, t in ckpt.tensors.items() if t.file == file]
                raise ValueError(
                    f"{where}: the index {ckpt.index} names this tensor (the leaf needs it as {want}) in file {file} "
                    f"but that file does not hold it: the index and the file disagree (the file holds {len(held)} "
                    f"tensor(s), near names: "
                    f"{near(name, held)}); copy the checkpoint's files and index again from one source, or fix "
                    "the index."
                )
            if info is None:
                raise ValueError(
                    f"{where}: no file of the checkpoint has this tensor (near names: "
                    f"{near(name, list(ckpt.tensors))}); fix the mapping entry {bd.entry.leaf!r} -> "
                    f"{list(bd.entry.tensors)}, or load a checkpoint of this model."
                )
            if info.shape != want:
                raise ValueError(
                    f"{where}: shape mismatch: file {info.file} holds {info.shape} {info.dtype.name}, the leaf needs "
                    f"{want} (after the entry's ops {list(bd.entry.ops)}); plan the model with the checkpoint's "
                    "config, or fix the entry's ops."
                )
            check_cast(info.dtype, bd.dtype, cast, where)
    extra = [n for n in ckpt.tensors if n not in used and not mapping.ignored(n, ignore)]
    if extra:
        raise ValueError(
            f"load_safetensors: {len(extra)} tensor(s) of the checkpoint are used by no leaf, e.g. {extra[:4]} "
            f"(shapes {[ckpt.tensors[n].shape for n in extra[:4]]}); add mapping entries for them, or pass "
            f"ignore={extra[:2]!r} (fnmatch patterns) to skip them."
        )


def _caster(dtype: np.dtype) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: x if x.dtype == dtype else x.astype(dtype)


def load_safetensors(
    path: str | os.PathLike,
    plan: Plan,
    *,
    mapping: Mapping,
    ignore: Sequence[str] = (),
    cast: str = "widen",
    stats: dict | None = None,
) -> ShardedParams:
    """Loads a Hugging Face safetensors checkpoint straight into a plan's shards.

    Args:
      path: a ``.safetensors`` file, a ``model.safetensors.index.json``, or a directory holding either.
      plan: the plan to load into (from ``vj.plan`` on the model's abstract params).
      mapping: how leaves map to tensors (:func:`llama_mapping`, :func:`gpt2_mapping` or your own
        :class:`Mapping`).
      ignore: ``fnmatch`` patterns of tensors no leaf uses that are skipped (besides the mapping's own
        ``ignore``); any other unused tensor is an error.
      cast: ``"widen"`` (default: the file's dtype may widen to the leaf's, bf16 -> f32), ``"any"`` (any cast,
        narrowing included) or ``"none"`` (dtypes must match).
      stats: a dict to fill with this process's ``bytes_read`` and ``reads``, and the checkpoint's
        ``data_bytes``.

    Returns:
      :class:`~vescale_jax.ShardedParams` equal, bit for bit, to ``vj.shard`` of the mapped tensors.

    Raises:
      ValueError: a leaf without entry, an entry without leaf (not optional), a missing or unused tensor (one the
        index names in a file that does not hold it: named as such, with that file), a shape (with the file) or
        dtype mismatch, a malformed header. FileNotFoundError: the path, or a file the index names.

    Sharding:
      Each process reads only the element ranges its own devices own (a replicated device's shard is read once
      per process), into host buffers of one device's shard of one bucket plus chunks of a few MiB; no process
      holds the model. Every bucket (TP/EP-grouped and tile-major ones too) is built from its devices' shards
      with ``jax.make_array_from_single_device_arrays``.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"load_safetensors: plan must be a vj.Plan (from vj.plan), got {type(plan).__name__}.")
    ckpt = open_checkpoint(path)
    # tensors the index names but no file holds count as present, so that the check below names the contradiction
    available = list(dict.fromkeys([*ckpt.tensors, *ckpt.weight_map]))
    bounds = bind(plan, mapping, available=available, what="load_safetensors")
    _check_files(bounds, ckpt, mapping, ignore, cast)
    reader = Reader()
    buffers = []
    try:
        for b, (bucket, sharding) in enumerate(zip(plan.buckets, plan.shardings(), strict=True)):
            by_start: dict[int, list[Any]] = {}  # replicas of one shard on this process: read once
            for dev, index in sharding.addressable_devices_indices_map(bucket.shape).items():
                by_start.setdefault(index[-1].start or 0, []).append(dev)
            arrays = []
            for start, devices in sorted(by_start.items()):
                host = fill_shard(plan, b, start, bounds, ckpt, reader, _caster(np.dtype(bucket.dtype)))
                arrays += [jax.device_put(host, d) for d in devices]
                del host
            buffers.append(jax.make_array_from_single_device_arrays(bucket.shape, sharding, arrays))
            del arrays
    finally:
        reader.close()
    if stats is not None:
        stats.update(bytes_read=reader.bytes_read, reads=reader.reads, data_bytes=ckpt.data_bytes)
    return ShardedParams(buffers, plan)


def _file_dtype(dtype: Any, path: str) -> np.dtype:
    """``dtype`` (a dtype, or a callable ``path -> dtype``) for the leaf at ``path``."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return np.dtype(dtype(path))


def _tensors_to_write(bounds: Sequence[Bound], dtype: Any, cast: str) -> tuple[dict, dict[int, set[str]]]:
    """``{name: (shape, file dtype)}`` and, per leaf, the tensors it writes (a tied tensor by its first leaf)."""
    tensors: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    owner: dict[tuple[str, Any], int] = {}
    parts: dict[str, dict[Any, int]] = {}
    writes: dict[int, set[str]] = {}
    for bd in bounds:
        npat = len(bd.entry.tensors)
        target = bd.dtype if dtype is None else _file_dtype(dtype, bd.path)
        check_cast(bd.dtype, target, cast, f"save_safetensors: leaf {bd.path!r} {bd.shape}")
        mine = writes.setdefault(bd.leaf, set())
        for j, name in enumerate(bd.names):
            shape = bd.tensor_shape[j % npat]
            if name in tensors and tensors[name] != (shape, target):
                raise ValueError(
                    f"save_safetensors: tensor {name!r} gets shape {shape} {target.name} from leaf {bd.path!r} but "
                    f"{tensors[name][0]} {tensors[name][1].name} from another leaf; fix the mapping's ops."
                )
            tensors[name] = (shape, target)
            if (name, bd.split_key) not in owner:  # the same part again: a tied weight, written once
                owner[(name, bd.split_key)] = bd.leaf
                mine.add(name)
                parts.setdefault(name, {})[bd.split_key] = bd.leaf
    for bd in bounds:  # a fused tensor must get every part
        for op in (o for o in bd.entry.ops if type(o).__name__ == "Split"):
            want = op.sections if isinstance(op.sections, int) else len(op.sections)
            for name in bd.names:
                if len(parts[name]) < want:
                    raise ValueError(
                        f"save_safetensors: tensor {name!r} {tensors[name][0]} is fused from {want} parts but leaves "
                        f"give only {len(parts[name])} (from leaf {bd.path!r} {bd.shape}); map every part (one entry "
                        "per Split index)."
                    )
    return tensors, writes


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def save_safetensors(
    params: ShardedParams,
    directory: str | os.PathLike,
    *,
    mapping: Mapping,
    max_shard_size: int | str = "5GB",
    dtype: Any = None,
    cast: str = "widen",
) -> list[str]:
    """Saves sharded params as a Hugging Face checkpoint (``save_pretrained``'s file names, layout and index).

    Args:
      params: the :class:`~vescale_jax.ShardedParams` to save (their plan travels with them).
      directory: where to write ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` and
        ``model.safetensors.index.json`` when the tensors exceed ``max_shard_size``.
      mapping: how leaves map to tensors (run backwards: transposes undone, fused tensors assembled from their
        parts, stacked leaves written as one tensor per layer; a tied tensor written once).
      max_shard_size: bytes per file: an int or ``"5GB"``, ``"500MB"`` (decimal units, as Hugging Face), ``"2GiB"``.
      dtype: the files' dtype (default: each leaf's); a dtype, or a callable ``path -> dtype``.
      cast: ``"widen"`` (default), or ``"any"`` to allow a narrowing ``dtype`` (f32 params saved as bf16).

    Returns:
      The paths of the files written (the index last, when there is one).

    Sharding:
      Every process computes the same layout; process 0 writes the headers and the index and preallocates the
      files; after a barrier every process writes only the bytes of its own devices' shards (one replica of
      each), through host buffers of one device's shard of one bucket and chunks of a few MiB. No process
      gathers the model.
    """
    if not isinstance(params, ShardedParams):
        raise TypeError(
            f"save_safetensors: params must be vj.ShardedParams (from vj.shard / load), got {type(params).__name__}."
        )
    plan = params.plan
    directory = os.fspath(directory)
    bounds = bind(plan, mapping, available=None, what="save_safetensors")
    tensors, writes = _tensors_to_write(bounds, dtype, cast)
    files, index = layout_files([(n, d, s) for n, (s, d) in tensors.items()], max_shard_size=parse_size(max_shard_size))
    where = {t: (os.path.join(directory, f.name), off) for f in files for t, off in f.offsets.items()}
    dtypes = {n: d for n, (_, d) in tensors.items()}
    if jax.process_index() == 0:
        create_files(directory, files, index)
    _barrier("vj_save_safetensors_created")
    writer = Writer()
    try:
        for b, buffer in enumerate(params.buffers):
            for shard in buffer.addressable_shards:
                if shard.replica_id == 0:  # one replica of each shard writes
                    start = shard.index[-1].start or 0
                    write_shard(plan, b, start, np.asarray(shard.data), bounds, writes, where, dtypes, writer)
    finally:
        writer.close()
    _barrier("vj_save_safetensors_written")
    paths = [os.path.join(directory, f.name) for f in files]
    return paths + ([os.path.join(directory, "model.safetensors.index.json")] if index is not None else [])
