"""Turning a failed Orbax read (a missing, truncated or unreadable file) into an error naming the leaf and file.

TensorStore reports a bad chunk as ``Error reading "<param>/<chunk>" in OCDBT database at local file "<item
dir>/"``, wrapped by Orbax in a message that prints a bound method's repr. The Orbax name ``<param>`` is the
leaf's key path joined by ``.``; the data file holding the chunk is found by walking the OCDBT B+tree
(``tensorstore.ocdbt.dump``) to the chunk's value reference. Only the error path runs any of this.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import tensorstore as ts

from vescale_jax.layout._paths import key_name

__all__ = ["describe", "missing_item", "read_error", "unreadable_item"]

_OCDBT = re.compile(r'(?:Error reading|Metadata at) "([^"]*)" in OCDBT database at local file "([^"]*)"')
_FILE = re.compile(r'local file "([^"]*)"')
_MOST_NODES = 256  # B+tree nodes visited looking for a chunk (the error path: bounded, whatever the tree)


def _messages(e: BaseException) -> list[str]:
    out, seen = [], set()
    while e is not None and id(e) not in seen and len(out) < 16:
        seen.add(id(e))
        out.append(str(e))
        e = e.__cause__ or e.__context__
    return out


def _orbax_names(tree: Any) -> dict[str, str]:
    """``{Orbax parameter name: key path}``: Orbax joins a leaf's keys with ``.``, this library with ``/``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
    return {".".join(key_name(k) for k in p): "/".join(key_name(k) for k in p) for p, _ in flat}


def _data_file(item_dir: str, key: str) -> tuple[str, int, int] | None:
    """``(file, offset, length)`` of the value stored under ``key`` in the OCDBT database at ``item_dir``."""
    try:
        base = ts.KvStore.open({"driver": "file", "path": item_dir.rstrip("/") + "/"}).result()
        versions = ts.ocdbt.dump(base).result().get("versions") or []
        todo = [versions[-1]["root"]["location"]] if versions and "location" in versions[-1]["root"] else []
        want, visited = key.encode(), 0
        while todo and visited < _MOST_NODES:
            node = ts.ocdbt.dump(base, todo.pop()).result()
            visited += 1
            for entry in node.get("entries", ()):
                if "location" in entry:
                    todo.append(entry["location"])
                elif entry.get("key") == want and "indirect_value" in entry:
                    _, prefix, path, offset, length = entry["indirect_value"].rsplit(":", 4)
                    return os.path.join(item_dir, prefix, path), int(offset), int(length)
    except Exception:  # a damaged manifest or tree: name the directory only
        return None
    return None


def describe(e: BaseException, trees: Mapping[str, Any]) -> str | None:
    """What failed, as ``"<item> leaf '<key path>' (chunk c) in file F (why)"``, if the error names a chunk.

    Args:
      e: the exception Orbax raised.
      trees: ``{item name: restore target}`` of the items read (``"params"``, ``"opt_state"``).
    """
    for text in _messages(e):
        found = _OCDBT.search(text)
        if found is None:
            plain = _FILE.search(text)
            if plain is not None:
                return f"file {plain.group(1)} ({text.splitlines()[0][:200]})"
            continue
        key, item_dir = found.groups()
        param, _, chunk = key.rpartition("/")
        item = os.path.basename(item_dir.rstrip("/"))
        # a leaf of a tree not at hand: Orbax's dotted name with this library's separator
        path = (_orbax_names(trees[item]) if item in trees else {}).get(param, param.replace(".", "/"))
        detail = text.split(" [tensorstore_spec=")[0]
        why = detail.split(": ", 1)[0] + ": " + detail.rsplit(": ", 1)[-1][:160]
        part = "its array metadata" if chunk == ".zarray" else f"chunk {chunk or '-'}"
        where = _data_file(item_dir, key)
        manifest = os.path.join(item_dir, "manifest.ocdbt")
        if where is None and not os.path.exists(manifest):
            file = f"file {manifest} (missing: the item's index of its data files)"
        elif where is None:
            file = f"its data in {item_dir}"
        else:
            file_path, offset, length = where
            size = os.path.getsize(file_path) if os.path.exists(file_path) else None
            state = (
                "missing"
                if size is None
                else f"{size} bytes, needs {offset + length}"
                if size < offset + length
                else f"{size} bytes"
            )
            file = f"file {file_path} (bytes {offset}..{offset + length}; {state})"
        return f"{item} leaf {path!r} ({part}) in {file}: {why}"
    return None


def read_error(e: BaseException, *, where: str, trees: Mapping[str, Any]) -> ValueError:
    """The ``ValueError`` raised for a failed read: the leaf, the file, and what to do.

    Args:
      e: the exception Orbax raised.
      where: the step (or checkpoint) directory.
      trees: ``{item name: restore target}`` of the items read.
    """
    what = describe(e, trees)
    if what is None:
        first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        what = f"a file of {where} ({first.split(' See full TensorStore details')[0]})"
    return ValueError(
        f"vj.checkpoint: reading {where} failed: {what}. The file is missing, truncated or corrupt: restore "
        "another step (Manager.all_steps()), or re-copy the checkpoint directory from where it was written, or "
        "re-save it from a process that still holds the state."
    )


def unreadable_item(item_dir: str) -> bool:
    """Whether an item's directory or its Orbax metadata file (``_METADATA``) is missing or empty (then
    :func:`missing_item` says which)."""
    meta = os.path.join(item_dir, "_METADATA")
    return not os.path.isdir(item_dir) or not os.path.isfile(meta) or os.path.getsize(meta) == 0


def missing_item(item_dir: str, item: str) -> ValueError:
    """The ``ValueError`` for an item whose directory or Orbax metadata (``_METADATA``) is missing or empty."""
    meta, manifest = os.path.join(item_dir, "_METADATA"), os.path.join(item_dir, "manifest.ocdbt")
    if not os.path.isdir(item_dir):
        what = f"its directory {item_dir} is missing"
    elif not os.path.exists(meta):
        what = f"its metadata file {meta} is missing"
    elif not os.path.exists(manifest):
        what = f"its file {manifest} (the index of its data files) is missing"
    else:
        what = f"its metadata file {meta} is empty or unreadable"
    return ValueError(
        f"vj.checkpoint: the checkpoint's {item} item cannot be read: {what}, so no leaf of it can be found. "
        "Restore another step (Manager.all_steps()), or re-copy the checkpoint directory from where it was "
        "written, or re-save it from a process that still holds the state."
    )
