"""Hugging Face safetensors checkpoints in and out, each process reading or writing only its own byte ranges.

:func:`load_safetensors` builds a plan's :class:`~vescale_jax.ShardedParams` straight from the files: for a
row-major bucket each process fills its own devices' shards of the bucket buffer on the host (the leaf ranges
each device owns, read through the mapping's index arithmetic) and hands them to
``jax.make_array_from_single_device_arrays``; a bucket with tile-major leaves or TP/EP groups is built as its
logical leaves (``jax.make_array_from_callback``, each callback reading its box) and converted on the devices,
one bucket at a time. :func:`save_safetensors` lays the files out on every process alike, process 0 writes the
headers and the index and preallocates the files, then every process ``pwrite`` s the bytes of its own shards.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from vescale_jax.checkpoint._hf_index import (
    CHUNK,
    Bound,
    bind,
    check_cast,
    near,
    read_indices,
    read_range,
    write_indices,
    write_range,
)
from vescale_jax.checkpoint._hf_mapping import Mapping
from vescale_jax.checkpoint._safetensors_files import (
    Checkpoint,
    Reader,
    Writer,
    create_files,
    layout_files,
    open_checkpoint,
    parse_size,
)
from vescale_jax.layout._plan import Bucket, Plan
from vescale_jax.relayout._logical_leaves import bucket_from_logical, bucket_to_logical, leaf_sharding
from vescale_jax.state._containers import ShardedParams
from vescale_jax.state._sharded import bits_dtype

__all__ = ["load_safetensors", "save_safetensors"]


def _row_major(bucket: Bucket) -> bool:
    return not any(g is not None for g in bucket.storage) and bucket.num_groups == 1


def _check_files(bounds: Sequence[Bound], ckpt: Checkpoint, mapping: Mapping, ignore: Sequence[str], cast: str):
    """Every tensor the leaves need exists with the shape and a castable dtype; no tensor is left unused."""
    used = set()
    for bd in bounds:
        npat = len(bd.entry.tensors)
        for j, name in enumerate(bd.names):
            used.add(name)
            info = ckpt.tensors.get(name)
            where = f"load_safetensors: leaf {bd.path!r} {bd.shape} {bd.dtype.name} <- tensor {name!r}"
            if info is None:
                raise ValueError(
                    f"{where}: no file of the checkpoint has this tensor (near names: "
                    f"{near(name, list(ckpt.tensors))}); fix the mapping entry {bd.entry.leaf!r} -> "
                    f"{list(bd.entry.tensors)}, or load a checkpoint of this model."
                )
            want = bd.tensor_shape[j % npat]
            if info.shape != want:
                raise ValueError(
                    f"{where}: shape mismatch: the file holds {info.shape} {info.dtype.name}, the leaf needs {want} "
                    f"(after the entry's ops {list(bd.entry.ops)}); plan the model with the checkpoint's config, or "
                    "fix the entry's ops."
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


def _host_shard(
    plan: Plan, bucket: Bucket, start: int, bounds: Sequence[Bound], ckpt: Checkpoint, reader: Reader
) -> np.ndarray:
    """One device's shard ``[start, start + S)`` of a row-major bucket's buffer, read on the host (padding 0)."""
    layout, S = bucket.layout, bucket.layout.shard_size
    dtype = np.dtype(bucket.dtype)
    out = np.zeros(bucket.local_shape, dtype)
    rows = out.reshape(-1, S)
    for slot, i in enumerate(bucket.leaves):
        o, n = layout.offsets[slot], layout.sizes[slot]
        lo, hi = max(o, start), min(o + n, start + S)
        if hi <= lo:
            continue
        for layer in range(rows.shape[0]):
            dest = rows[layer, lo - start : hi - start]
            read_range(bounds[i], layer * n + lo - o, layer * n + hi - o, dest, ckpt, reader, _caster(dtype))
    return out


def _box_indices(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], Any]:
    """The box a shard index selects, and a function giving its elements' leaf flat indices in chunks."""
    box = tuple(len(range(*s.indices(d))) for s, d in zip(index, shape, strict=True))
    starts = [s.indices(d)[0] for s, d in zip(index, shape, strict=True)]

    def chunks():
        total = math.prod(box)
        for a in range(0, total, CHUNK):
            local = np.unravel_index(np.arange(a, min(total, a + CHUNK), dtype=np.int64), box) if box else ()
            flat = np.ravel_multi_index([c + s for c, s in zip(local, starts, strict=True)], shape) if box else None
            yield a, (np.asarray(flat, np.int64) if box else np.zeros(1, np.int64))

    return box, chunks


def _logical_bucket(plan: Plan, b: int, bounds: Sequence[Bound], ckpt: Checkpoint, reader: Reader) -> jax.Array:
    """A tile-major or grouped bucket: its leaves built with their storage sharding (each callback reads its
    box), then converted on the devices (low-precision floats as their bits, so every bit is kept)."""
    bucket = plan.buckets[b]
    dtype = np.dtype(bucket.dtype)
    bits = bits_dtype(dtype)
    leaves = []
    for i in bucket.leaves:
        spec, bound = plan.leaves[i], bounds[i]

        def read_box(index, spec=spec, bound=bound):
            box, chunks = _box_indices(index, spec.shape)
            out = np.empty(math.prod(box), dtype)
            for a, t in chunks():
                out[a : a + t.size] = read_indices(bound, t, ckpt, reader, _caster(dtype))
            out = out.reshape(box)
            return out if bits is None else out.view(bits)

        leaves.append(jax.make_array_from_callback(spec.shape, leaf_sharding(plan, i), read_box))
    buf = bucket_from_logical(leaves, plan, b)
    del leaves
    if bits is not None:
        buf = jax.jit(lambda x: jax.lax.bitcast_convert_type(x, jnp.dtype(dtype)), out_shardings=buf.sharding)(buf)
    return buf


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
      ValueError: a leaf without entry, an entry without leaf (not optional), a missing or unused tensor, a shape
        or dtype mismatch, a malformed header. FileNotFoundError: the path, or a file the index names.

    Sharding:
      Each process reads only the element ranges its own devices own (a replicated device's shard is read once
      per process), into host buffers of one device's shard of one bucket plus chunks of a few MiB; no process
      holds the model. Row-major buckets go to ``jax.make_array_from_single_device_arrays``; a bucket with
      tile-major leaves or TP/EP groups is built as leaves in their storage sharding and converted on the devices.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"load_safetensors: plan must be a vj.Plan (from vj.plan), got {type(plan).__name__}.")
    ckpt = open_checkpoint(path)
    bounds = bind(plan, mapping, available=list(ckpt.tensors), what="load_safetensors")
    _check_files(bounds, ckpt, mapping, ignore, cast)
    reader = Reader()
    buffers = []
    try:
        for b, (bucket, sharding) in enumerate(zip(plan.buckets, plan.shardings(), strict=True)):
            if not _row_major(bucket):
                buffers.append(_logical_bucket(plan, b, bounds, ckpt, reader))
                continue
            by_start: dict[int, list[Any]] = {}
            for dev, index in sharding.addressable_devices_indices_map(bucket.shape).items():
                by_start.setdefault(index[-1].start or 0, []).append(dev)
            arrays = []
            for start, devices in sorted(by_start.items()):
                host = _host_shard(plan, bucket, start, bounds, ckpt, reader)
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
                        f"save_safetensors: tensor {name!r} is fused from {want} parts but leaves give only "
                        f"{len(parts[name])} (from leaf {bd.path!r}); map every part."
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
        for b, bucket in enumerate(plan.buckets):
            if _row_major(bucket):
                _write_bucket(params.buffers[b], bucket, bounds, writes, where, dtypes, writer)
            else:
                _write_logical(params.buffers[b], plan, b, bounds, writes, where, dtypes, writer)
    finally:
        writer.close()
    _barrier("vj_save_safetensors_written")
    paths = [os.path.join(directory, f.name) for f in files]
    return paths + ([os.path.join(directory, "model.safetensors.index.json")] if index is not None else [])


def _write_bucket(buffer, bucket: Bucket, bounds, writes, where, dtypes, writer: Writer) -> None:
    layout, S = bucket.layout, bucket.layout.shard_size
    for shard in buffer.addressable_shards:
        if shard.replica_id != 0:
            continue
        start = shard.index[-1].start or 0
        rows = np.asarray(shard.data).reshape(-1, S)
        for slot, i in enumerate(bucket.leaves):
            files = {n: where[n] for n in writes[i]}
            o, n = layout.offsets[slot], layout.sizes[slot]
            lo, hi = max(o, start), min(o + n, start + S)
            if hi <= lo or not files:
                continue
            for layer in range(rows.shape[0]):
                write_range(bounds[i], layer * n + lo - o, rows[layer, lo - start : hi - start], files, dtypes, writer)
        del rows


def _write_logical(buffer, plan: Plan, b: int, bounds, writes, where, dtypes, writer: Writer) -> None:
    bucket = plan.buckets[b]
    dtype = np.dtype(bucket.dtype)
    bits = bits_dtype(dtype)
    if bits is not None:
        buffer = jax.jit(lambda x: jax.lax.bitcast_convert_type(x, bits), out_shardings=buffer.sharding)(buffer)
    for i, leaf in zip(bucket.leaves, bucket_to_logical(buffer, plan, b), strict=True):
        files = {n: where[n] for n in writes[i]}
        if not files:
            continue
        for shard in leaf.addressable_shards:
            if shard.replica_id != 0:
                continue
            values = np.asarray(shard.data).reshape(-1)
            values = values if bits is None else values.view(dtype)
            _, chunks = _box_indices(shard.index, plan.leaves[i].shape)
            for a, t in chunks():
                write_indices(bounds[i], t, values[a : a + t.size], files, dtypes, writer)
