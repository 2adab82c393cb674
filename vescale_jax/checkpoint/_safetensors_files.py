"""The safetensors file format, read and written by byte range.

A safetensors file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON (``{name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, padded with spaces to a multiple of 8), then the
tensors' bytes, contiguous, offsets relative to the end of the header. A Hugging Face checkpoint is one
``model.safetensors`` or several ``model-0000i-of-0000n.safetensors`` beside ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``).

:func:`open_checkpoint` resolves a path (file, directory or index) into a :class:`Checkpoint` (every tensor's
file, dtype, shape and absolute byte offset); :class:`Reader` reads byte runs with ``os.preadv`` and counts the
bytes it read; :func:`layout_files` lays tensors out into files exactly as the ``safetensors`` library and
``save_pretrained`` do, :func:`create_files` writes their headers and index and preallocates them, and
:class:`Writer` writes byte runs with ``os.pwrite``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import struct
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = [
    "Checkpoint",
    "FileLayout",
    "Reader",
    "TensorInfo",
    "Writer",
    "create_files",
    "dtype_of",
    "layout_files",
    "open_checkpoint",
    "parse_size",
    "read_header",
    "st_dtype",
]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(jnp.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(jnp.float8_e4m3fn),
    "F8_E5M2": np.dtype(jnp.float8_e5m2),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# The safetensors library writes tensors sorted by this dtype order, descending, then by name.
_RANK = ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64")
_RANK = {name: r for r, name in enumerate((*_RANK, "U64"))}


def dtype_of(name: str, *, where: str = "") -> np.dtype:
    """The numpy dtype of a safetensors dtype name (``"BF16"`` -> ``jnp.bfloat16``'s dtype)."""
    if name not in _DTYPES:
        raise ValueError(f"{where}unsupported safetensors dtype {name!r}; supported: {sorted(_DTYPES)}.")
    return _DTYPES[name]


def st_dtype(dtype: Any) -> str:
    """The safetensors name of a numpy / JAX dtype (``float32`` -> ``"F32"``)."""
    dt = np.dtype(dtype)
    if dt not in _NAMES:
        raise ValueError(f"dtype {dt.name} has no safetensors name; supported: {sorted(d.name for d in _NAMES)}.")
    return _NAMES[dt]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint: its file, dtype, shape and absolute byte offset of its first element."""

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def read_header(file: str) -> tuple[dict[str, Any], int]:
    """The parsed JSON header of a safetensors file and the byte offset where its data starts.

    Raises:
      ValueError: the header is malformed (its length, its JSON, a tensor's fields or offsets).
    """
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{file}: not a safetensors file ({size} bytes, no 8-byte header length).")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise ValueError(f"{file}: malformed safetensors header: length {n} but the file has {size} bytes.")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: malformed safetensors header (not JSON: {e}).") from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: malformed safetensors header: a JSON {type(header).__name__}, not an object.")
    start, data = 8 + n, size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(info, dict) and {"dtype", "shape", "data_offsets"} <= set(info)
        if ok:
            dt = dtype_of(info["dtype"], where=f"{file}: tensor {name!r}: ")
            b, e = info["data_offsets"]
            ok = 0 <= b <= e <= data and e - b == math.prod(info["shape"]) * dt.itemsize
        if not ok:
            raise ValueError(
                f"{file}: malformed safetensors header entry for tensor {name!r}: {info!r} (expected dtype, shape "
                f"and data_offsets within the {data} data bytes, end - begin = size * itemsize); a truncated or "
                "partly copied file: copy it again from the checkpoint's source."
            )
    return header, start


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """Every tensor of a checkpoint by name, and its files.

    Attributes:
      tensors: every tensor the files' headers hold, by name.
      files: the files, in the index's order.
      index: the index json's path (``None`` for a single file).
      weight_map: the index's ``{tensor: file path}`` (empty for a single file); where it names a tensor its file
        does not hold, the index contradicts the file.
    """

    tensors: dict[str, TensorInfo]
    files: tuple[str, ...]
    index: str | None = None
    weight_map: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def _files_of(path: str) -> tuple[list[str], str | None, dict[str, str]]:
    """The checkpoint's files, its index's path (or ``None``) and the index's ``{tensor: file path}``."""
    if os.path.isdir(path):
        for name in (SINGLE, INDEX):
            if os.path.exists(os.path.join(path, name)):
                return _files_of(os.path.join(path, name))
        found = sorted(f for f in os.listdir(path) if f.endswith((".safetensors", ".json")))
        raise FileNotFoundError(
            f"{path}: no {SINGLE} or {INDEX} in this directory (it holds {found[:6]}); pass the directory "
            "save_pretrained / vj.checkpoint.save_safetensors wrote, or the path of a .safetensors file."
        )
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such safetensors file, index or directory.")
    if path.endswith(".json"):
        with open(path) as f:
            index = json.load(f)
        if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
            raise ValueError(f"{path}: not a safetensors index (expected {{'weight_map': {{name: file}}}}).")
        here = os.path.dirname(os.path.abspath(path))
        files = list(dict.fromkeys(index["weight_map"].values()))
        for name in files:
            if not os.path.exists(os.path.join(here, name)):
                tensor = next(t for t, f in index["weight_map"].items() if f == name)
                raise FileNotFoundError(
                    f"{path}: the index names file {name!r} (holding e.g. tensor {tensor!r}) but it is not in "
                    f"{here}; copy every file of the checkpoint, or fix the index."
                )
        weight_map = {t: os.path.join(here, f) for t, f in index["weight_map"].items()}
        return [os.path.join(here, name) for name in files], path, weight_map
    return [path], None, {}


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Reads the headers of a checkpoint: a ``.safetensors`` file, an index json, or a directory holding either.

    Raises:
      FileNotFoundError: the path, or a file its index names, does not exist.
      ValueError: a malformed header, or a tensor in two files.
    """
    files, index, weight_map = _files_of(os.fspath(path))
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        header, start = read_header(file)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in tensors:
                raise ValueError(f"tensor {name!r} is in both {tensors[name].file} and {file}; keep one.")
            dt = dtype_of(info["dtype"])
            tensors[name] = TensorInfo(name, file, dt, tuple(info["shape"]), start + info["data_offsets"][0])
    return Checkpoint(tensors, tuple(files), index, weight_map)


class Reader:
    """Reads byte runs of a checkpoint's files (``os.preadv`` into caller buffers) and counts them.

    Attributes:
      bytes_read: bytes read so far.
      reads: read calls so far.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self.bytes_read = 0
        self.reads = 0

    def read_into(self, file: str, offset: int, out: memoryview, what: str = "") -> None:
        """Fills ``out`` with the bytes of ``file`` at ``[offset, offset + len(out))`` (of tensor ``what``)."""
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_RDONLY)
        done, n = 0, len(out)
        while done < n:
            got = os.preadv(fd, [out[done:]], offset + done)
            if got <= 0:
                raise ValueError(
                    f"{file}: truncated: tensor {what!r} needs bytes [{offset}, {offset + n}) but the file has "
                    f"{os.fstat(fd).st_size}; copy the complete file (its header promises more data than it holds)."
                )
            done += got
        self.bytes_read += n
        self.reads += 1

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class Writer:
    """Writes byte runs into preallocated files (``os.pwrite``) and counts them."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self.bytes_written = 0

    def write(self, file: str, offset: int, data: memoryview) -> None:
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = os.open(file, os.O_WRONLY)
        done, n = 0, len(data)
        while done < n:
            done += os.pwrite(fd, data[done:], offset + done)
        self.bytes_written += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of ``max_shard_size``: an int, or a string in Hugging Face's units (``"5GB"`` = 5 * 10**9,
    ``"500MB"``, ``"2GiB"`` = 2 * 2**30)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"max_shard_size={size!r}: expected an int or a size like '5GB', '500MB' or '2GiB'.")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r}: must be positive.")
    return value


@dataclasses.dataclass(frozen=True)
class FileLayout:
    """One file to write: its name, header bytes (length prefix included) and each tensor's absolute offset."""

    name: str
    header: bytes
    offsets: dict[str, int]
    size: int


def _file_layout(name: str, tensors: Sequence[tuple[str, np.dtype, tuple[int, ...]]], metadata: dict) -> FileLayout:
    order = sorted(tensors, key=lambda t: (-_RANK[st_dtype(t[1])], t[0]))
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    pos, rel = 0, {}
    for tname, dt, shape in order:
        n = math.prod(shape) * np.dtype(dt).itemsize
        header[tname] = {"dtype": st_dtype(dt), "shape": list(shape), "data_offsets": [pos, pos + n]}
        rel[tname] = pos
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    return FileLayout(name, head, {t: len(head) + o for t, o in rel.items()}, len(head) + pos)


def _natural(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def layout_files(
    tensors: Sequence[tuple[str, Any, tuple[int, ...]]], *, max_shard_size: int, metadata: dict | None = None
) -> tuple[list[FileLayout], dict | None]:
    """Splits tensors into files as ``save_pretrained`` does and lays each file out as ``safetensors`` does.

    Tensors go in natural name order (``layers.2`` before ``layers.10``); a file is closed when the next tensor
    would take it past ``max_shard_size`` bytes (a larger tensor gets a file of its own). Inside a file, tensors
    are sorted by dtype then name, contiguous, the header padded with spaces to a multiple of 8.

    Args:
      tensors: ``(name, dtype, shape)`` of every tensor.
      max_shard_size: bytes per file at most (but for a single larger tensor).
      metadata: the header's ``__metadata__`` (default ``{"format": "pt"}``, which transformers requires).

    Returns:
      ``(files, index)``: the layouts, and the index json's content (``None`` for a single ``model.safetensors``).
    """
    metadata = {"format": "pt"} if metadata is None else metadata
    groups: list[list[tuple[str, np.dtype, tuple[int, ...]]]] = [[]]
    used = 0
    for name, dt, shape in sorted(tensors, key=lambda t: _natural(t[0])):
        n = math.prod(shape) * np.dtype(dt).itemsize
        if groups[-1] and used + n > max_shard_size:
            groups.append([])
            used = 0
        groups[-1].append((name, np.dtype(dt), tuple(shape)))
        used += n
    if len(groups) == 1:
        return [_file_layout(SINGLE, groups[0], metadata)], None
    k = len(groups)
    files = [_file_layout(f"model-{i + 1:05d}-of-{k:05d}.safetensors", g, metadata) for i, g in enumerate(groups)]
    total = sum(math.prod(s) * np.dtype(d).itemsize for _, d, s in tensors)
    weight_map = {t: f.name for f in files for t in f.offsets}
    return files, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def create_files(directory: str, files: Sequence[FileLayout], index: dict | None) -> None:
    """Writes each file's header, preallocates its data (zeros) and writes the index json (process 0's part of a
    save; every process then writes its own bytes with :class:`Writer`)."""
    os.makedirs(directory, exist_ok=True)
    for stale in (SINGLE, INDEX):  # a previous save's files must not shadow this one
        if os.path.exists(os.path.join(directory, stale)):
            os.remove(os.path.join(directory, stale))
    for f in files:
        path = os.path.join(directory, f.name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, f.header, 0)
            os.ftruncate(fd, f.size)
        finally:
            os.close(fd)
    if index is not None:
        with open(os.path.join(directory, INDEX), "w") as out:
            out.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
