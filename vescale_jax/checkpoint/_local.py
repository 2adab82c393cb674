"""Per-process local copies of a training state, for fast restarts on the same plan and process layout.

Each process writes the shards its devices hold of every array of the state, as they are (its device layout,
no conversion), under ``LOCAL_DIR/process_<i>_of_<n>/<step>/``: one ``.npy`` file per distinct shard (the raw
words, no pickle) and a ``manifest.json`` with the step, a key (the plan's fingerprint and the optimizer state's
structure), the process index and count, its device ids, and per array its key path, shape, dtype, sharding
(mesh device ids, axis names, partition spec, memory kind) and, per shard, the device ids, the index and a
CRC-32 of the bytes. A step is written into ``<step>.tmp`` and renamed when complete, so an interrupted write is
never listed; the newest ``keep`` steps are kept.

Restore (:func:`agree_and_read`) is all or nothing: each process lists its complete local steps whose manifest
matches the target (plan fingerprint, process layout, key paths, shapes, dtypes); the processes agree through
JAX's coordination service on the newest step all of them hold; each reads and checks it (CRC-32); a second
round agrees that every process read it. Any miss on any process and every process restores from the global
checkpoint instead.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._compat import coordination_client
from vescale_jax.state._sharded import ShardedParams

__all__ = ["LocalCopies", "LocalRead", "agree_and_read", "key_of"]

FORMAT = "vescale_jax.checkpoint.local/1"
MANIFEST = "manifest.json"
_AGREE_TIMEOUT_MS = 300_000  # a hang guard: a live job answers in milliseconds; only a failed one waits this long
_rounds = itertools.count()  # every process calls restore the same number of times: the same round keys


def _spec_to_json(spec: jax.sharding.PartitionSpec) -> list[Any]:
    return [list(p) if isinstance(p, tuple) else p for p in spec]


def _describe_sharding(sharding: Any) -> dict[str, Any] | None:
    """A JSON description of a ``NamedSharding`` or ``SingleDeviceSharding`` (``None``: not describable)."""
    kind = getattr(sharding, "memory_kind", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(sharding.mesh, jax.sharding.Mesh):
        mesh = sharding.mesh
        types = getattr(mesh, "axis_types", None)
        return {
            "kind": "named",
            "devices": [int(d.id) for d in mesh.devices.reshape(-1)],
            "shape": [int(n) for n in mesh.devices.shape],
            "axis_names": list(mesh.axis_names),
            "axis_types": None if types is None else [str(t).rsplit(".", 1)[-1] for t in types],
            "spec": _spec_to_json(sharding.spec),
            "memory_kind": kind,
        }
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return {"kind": "single", "device": int(next(iter(sharding.device_set)).id), "memory_kind": kind}
    return None


def _build_sharding(desc: dict[str, Any]) -> Any:
    by_id = {d.id: d for d in jax.devices()}
    if desc["kind"] == "single":
        return jax.sharding.SingleDeviceSharding(by_id[desc["device"]], memory_kind=desc["memory_kind"])
    devices = np.array([by_id[i] for i in desc["devices"]], dtype=object).reshape(desc["shape"])
    kwargs = {}
    if desc["axis_types"] is not None:
        kwargs["axis_types"] = tuple(getattr(jax.sharding.AxisType, t) for t in desc["axis_types"])
    mesh = jax.sharding.Mesh(devices, tuple(desc["axis_names"]), **kwargs)
    spec = jax.sharding.PartitionSpec(*[tuple(p) if isinstance(p, list) else p for p in desc["spec"]])
    return jax.sharding.NamedSharding(mesh, spec, memory_kind=desc["memory_kind"])


def _index_to_json(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def _words(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"u{np.dtype(dtype).itemsize}")


def flatten(state: dict[str, Any]) -> tuple[list[str], list[Any]]:
    """The key paths and leaves of ``state`` (a dict of ``params`` / ``opt_state``)."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat]


class LocalRead:
    """What :func:`agree_and_read` found: the step and this process's host copies of each leaf's shards."""

    def __init__(self, step: int, manifest: dict[str, Any], data: list[dict[tuple, np.ndarray]]):
        self.step, self.manifest, self.data = step, manifest, data

    def state(self, plan: Any, opt_state: Any) -> tuple[Any, Any]:
        """``(params, opt_state)``: the saved buffers as ``ShardedParams`` under ``plan`` (``None``: none) and the
        optimizer state in the form of the template ``opt_state`` (``None``: none)."""
        leaves = self.arrays()
        ours = [e["path"].startswith("['params']") for e in self.manifest["leaves"]]
        buffers = [x for x, mine in zip(leaves, ours, strict=True) if mine]
        rest = [x for x, mine in zip(leaves, ours, strict=True) if not mine]
        sp = ShardedParams(buffers, plan) if plan is not None else None
        state = (
            jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(opt_state), rest)
            if opt_state is not None
            else None
        )
        return sp, state

    def arrays(self) -> list[Any]:
        """The leaves, placed back on their devices in their saved shardings."""
        out = []
        for entry, shards in zip(self.manifest["leaves"], self.data, strict=True):
            dtype = jnp.dtype(entry["dtype"])
            if entry["sharding"] is None:  # a host value (no sharding), stored whole
                out.append(jnp.asarray(next(iter(shards.values())).view(dtype).reshape(entry["shape"])))
                continue
            sharding = _build_sharding(entry["sharding"])
            shape = tuple(entry["shape"])
            pieces = []
            for device, index in sharding.addressable_devices_indices_map(shape).items():
                host = shards[tuple(map(tuple, _index_to_json(index, shape)))]
                pieces.append(
                    jax.device_put(
                        host.view(dtype), jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
                    )
                )
            out.append(jax.make_array_from_single_device_arrays(shape, sharding, pieces))
        return out


class LocalCopies:
    """One process's directory of local copies: ``root/process_<i>_of_<n>/<step>/``.

    Args:
      root: the local directory (each process's own disk; the processes of one machine may share it).
      keep: how many of the newest local steps to keep.
    """

    def __init__(self, root: str | os.PathLike, *, keep: int):
        self.pid, self.count = jax.process_index(), jax.process_count()
        self.root = os.path.abspath(os.fspath(root))
        self.dir = os.path.join(self.root, f"process_{self.pid}_of_{self.count}")
        self.keep = int(keep)
        if self.keep < 1:
            raise ValueError(f"Manager: local_keep must be >= 1, got {keep!r}.")

    def steps(self) -> list[int]:
        """The complete local steps (a ``manifest.json`` present), oldest first."""
        if not os.path.isdir(self.dir):
            return []
        out = [
            int(n) for n in os.listdir(self.dir) if n.isdigit() and os.path.isfile(os.path.join(self.dir, n, MANIFEST))
        ]
        return sorted(out)

    # -- save
    def save(self, step: int, state: dict[str, Any], key: str, metadata: dict[str, Any]) -> None:
        """Writes this process's shards of ``state``'s leaves for ``step``, then drops all but the newest ``keep``."""
        paths, leaves = flatten(state)
        final = os.path.join(self.dir, str(int(step)))
        tmp = final + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        entries = []
        for i, (path, x) in enumerate(zip(paths, leaves, strict=True)):
            if not isinstance(x, jax.Array):
                host = np.asarray(x)
                name = f"{i}.npy"
                words = np.asarray(host, order="C").view(_words(host.dtype))
                np.save(os.path.join(tmp, name), words, allow_pickle=False)
                crc = zlib.crc32(words.tobytes())
                entries.append(
                    {
                        "path": path,
                        "shape": list(host.shape),
                        "dtype": host.dtype.name,
                        "sharding": None,
                        "shards": [{"index": [[0, n] for n in host.shape], "file": name, "crc32": crc}],
                    }
                )
                continue
            desc = _describe_sharding(x.sharding)
            if desc is None:
                raise ValueError(
                    f"vj.checkpoint.Manager(local_dir=...): leaf {path} has sharding {x.sharding}, which a local copy "
                    "cannot describe (NamedSharding over a concrete mesh, or SingleDeviceSharding, only)."
                )
            shards: dict[tuple, dict[str, Any]] = {}
            for shard in x.addressable_shards:
                index = _index_to_json(shard.index, x.shape)
                at = tuple(map(tuple, index))
                if at in shards:
                    shards[at]["devices"].append(int(shard.device.id))
                    continue
                words = np.asarray(shard.data, order="C").view(_words(x.dtype))
                name = f"{i}.{len(shards)}.npy"
                np.save(os.path.join(tmp, name), words, allow_pickle=False)
                shards[at] = {
                    "index": index,
                    "devices": [int(shard.device.id)],
                    "file": name,
                    "crc32": zlib.crc32(words.tobytes()),
                }
            entries.append(
                {
                    "path": path,
                    "shape": list(x.shape),
                    "dtype": jnp.dtype(x.dtype).name,
                    "sharding": desc,
                    "shards": list(shards.values()),
                }
            )
        manifest = {
            "format": FORMAT,
            "step": int(step),
            "key": key,
            "process_index": self.pid,
            "process_count": self.count,
            "devices": sorted(int(d.id) for d in jax.local_devices()),
            "leaves": entries,
            "metadata": metadata,
        }
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump(manifest, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(os.path.join(self.dir, str(old)), ignore_errors=True)

    # -- restore
    def _manifest(self, step: int) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.dir, str(step), MANIFEST)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def matching(self, key: str) -> list[int]:
        """The complete local steps saved under this plan, process layout and state structure."""
        devices = sorted(int(d.id) for d in jax.local_devices())
        out = []
        for step in self.steps():
            m = self._manifest(step)
            if (
                m is not None
                and m.get("format") == FORMAT
                and m.get("key") == key
                and m.get("process_index") == self.pid
                and m.get("process_count") == self.count
                and m.get("devices") == devices
            ):
                out.append(step)
        return out

    def read(self, step: int) -> LocalRead | None:
        """This process's shards of ``step`` in host memory, each checked against its CRC-32 (``None``: a file is
        missing, short or changed)."""
        m = self._manifest(step)
        if m is None:
            return None
        data = []
        try:
            for entry in m["leaves"]:
                words = _words(jnp.dtype(entry["dtype"]))
                shards = {}
                for s in entry["shards"]:
                    host = np.load(os.path.join(self.dir, str(step), s["file"]), allow_pickle=False)
                    want = tuple(b - a for a, b in s["index"])
                    if host.dtype != words or host.shape != want or zlib.crc32(host.tobytes()) != s["crc32"]:
                        return None
                    shards[tuple(map(tuple, s["index"]))] = host
                data.append(shards)
        except (OSError, ValueError, KeyError):
            return None
        return LocalRead(step, m, data)


def key_of(plan: Any, opt_state: Any) -> str:
    """What a local copy must have been saved under: the plan's fingerprint and the optimizer state's key paths,
    shapes and dtypes (``None`` for either that is absent)."""
    opt = None if opt_state is None else structure_digest(*flatten({"opt_state": opt_state}))
    return f"{plan.fingerprint() if plan is not None else None}/{opt}"


def structure_digest(paths: list[str], leaves: list[Any]) -> str:
    """SHA-256 of every leaf's key path, shape and dtype."""
    rows = [
        [p, list(np.shape(x)), jnp.dtype(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).name]
        for p, x in zip(paths, leaves, strict=True)
    ]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _agree(tag: str, value: str, count: int, pid: int) -> list[str]:
    """Every process's ``value`` for this round, through the coordination service's key-value store."""
    if count == 1:
        return [value]
    client = coordination_client()
    key = f"vescale_jax/checkpoint/local/{tag}"
    client.key_value_set(f"{key}/{pid}", value)
    return [client.blocking_key_value_get(f"{key}/{i}", _AGREE_TIMEOUT_MS) for i in range(count)]


def agree_and_read(
    copies: LocalCopies | None, key: str, *, newest_global: int | None, step: int | None
) -> tuple[LocalRead | None, str]:
    """Collective: the local copy every process restores from, or ``None`` and why (then all read the global one).

    Args:
      copies: this process's local copies (``None``: the Manager has none; every process passes ``None`` alike).
      key: what the copy must have been saved under: the target plan's fingerprint and the optimizer state's
        :func:`structure_digest` (:func:`key_of`).
      newest_global: the newest finished global step (a local step older than it is not used).
      step: the step asked for (``None``: the newest).
    """
    count, pid = jax.process_count(), jax.process_index()
    round_ = next(_rounds)
    mine = copies.matching(key) if copies is not None else []
    if step is not None:
        mine = [s for s in mine if s == step]
    everyone = [set(json.loads(v)) for v in _agree(f"{round_}/steps", json.dumps(mine), count, pid)]
    common = set.intersection(*everyone)
    if not common:
        missing = [i for i, s in enumerate(everyone) if not s]
        why = f"process(es) {missing} hold no matching local copy" if missing else "no local step is on every process"
        return None, why
    chosen = max(common)
    if newest_global is not None and chosen < newest_global and step is None:
        return None, f"the newest local step on every process ({chosen}) is older than the global step {newest_global}"
    got = copies.read(chosen)
    oks = _agree(f"{round_}/read", "1" if got is not None else "0", count, pid)
    bad = [i for i, v in enumerate(oks) if v != "1"]
    if bad:
        return None, f"process(es) {bad} could not read local step {chosen} (a file missing or changed)"
    return got, f"local step {chosen} on every process"
