"""A mapping bound to a plan's leaves: which tensor element each leaf element is, read and written by byte run.

:func:`bind` matches each leaf of a plan to its :class:`~vescale_jax.checkpoint._hf_mapping.Entry` and infers,
from the leaf's shape and the entry's ops run backwards, the shapes of the tensors it comes from; a
:class:`Bound` leaf then maps any chunk of its flat (row-major) element indices to ``(tensor, flat index in that
tensor)`` by index arithmetic (numpy), the ops inverted. :func:`read_indices` and :func:`write_indices` move one
chunk of at most :data:`CHUNK` of a leaf's elements (:func:`chunks` cuts a range into them) from or to the files:
the source indices of a chunk are sorted, grouped into contiguous runs (reads coalesce gaps of a few elements) and
read with ``preadv`` / written with ``pwrite``, so host memory never scales with a tensor.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from vescale_jax.checkpoint._hf_mapping import Entry, Mapping, MergeDims, Split, SplitDim, Transpose, compile_pattern
from vescale_jax.checkpoint._safetensors_files import Checkpoint, Reader, Writer
from vescale_jax.layout._plan import Plan

__all__ = ["CHUNK", "Bound", "bind", "check_cast", "chunks", "near", "read_indices", "write_indices"]

CHUNK = 1 << 18  # leaf elements per chunk: index arrays of a few MiB
GAP = 8  # a read merges runs at most this many elements apart
FIX = "fix the entry's ops (load direction, tensor -> leaf), or plan the leaf with the checkpoint's shape."


def leaf_name(path: str) -> str:
    """A plan path as matched by mapping entries: a leading Linen ``params/`` dropped."""
    return path[len("params/") :] if path.startswith("params/") else path


def near(name: str, names: Sequence[str], n: int = 4) -> list[str]:
    return difflib.get_close_matches(name, list(names), n=n, cutoff=0.5)


def _axis(axis: int, ndim: int, what: str) -> int:
    if not -ndim <= axis < max(ndim, 1):
        raise ValueError(f"{what}: axis {axis} out of range for {ndim} dims; {FIX}")
    return axis % max(ndim, 1)


def _resolve(sizes: Sequence[int], total: int, what: str, op: Any) -> tuple[int, ...]:
    known = math.prod(s for s in sizes if s != -1)
    if (
        list(sizes).count(-1) > 1
        or (-1 in sizes and (known == 0 or total % known))
        or (-1 not in sizes and known != total)
    ):
        raise ValueError(f"{what}: {op}: sizes {tuple(sizes)} do not fit a dim of {total}; {FIX}")
    return tuple(total // known if s == -1 else s for s in sizes)


def _back_shape(op: Any, out: tuple[int, ...], what: str) -> tuple[tuple[int, ...], Any]:
    """``(in_shape, resolved op)`` of an op (load direction) whose output has shape ``out``."""
    if isinstance(op, Transpose):
        perm = tuple(reversed(range(len(out)))) if op.perm is None else tuple(op.perm)
        if sorted(perm) != list(range(len(out))):
            raise ValueError(f"{what}: Transpose{perm} does not permute the {len(out)} dims of {out}; {FIX}")
        shape = [0] * len(out)
        for j, p in enumerate(perm):
            shape[p] = out[j]
        return tuple(shape), ("T", perm)
    if isinstance(op, SplitDim):
        k = len(op.sizes)
        a = _axis(op.axis, len(out) - k + 1, what)
        sizes = _resolve(op.sizes, math.prod(out[a : a + k]), what, op)
        if sizes != tuple(out[a : a + k]):
            raise ValueError(
                f"{what}: SplitDim({op.axis}, {op.sizes}) gives dims {sizes}, the leaf has {out[a : a + k]}; {FIX}"
            )
        return (*out[:a], math.prod(sizes), *out[a + k :]), ("S", a, sizes)
    if isinstance(op, MergeDims):
        a = _axis(op.axis, len(out), what)
        sizes = _resolve(op.sizes, out[a], what, op)
        return (*out[:a], *sizes, *out[a + 1 :]), ("M", a, sizes)
    if isinstance(op, Split):
        a = _axis(op.axis, len(out), what)
        if isinstance(op.sections, int):
            parts = [out[a]] * op.sections
        else:
            parts = list(op.sections)
            if out[a] != parts[op.index]:
                raise ValueError(
                    f"{what}: Split sections {op.sections} give part {op.index} {parts[op.index]} rows on dim {a}, "
                    f"the leaf has {out[a]}; {FIX}"
                )
        if not 0 <= op.index < len(parts):
            raise ValueError(f"{what}: Split index {op.index} out of {len(parts)} parts; {FIX}")
        return (*out[:a], sum(parts), *out[a + 1 :]), ("P", a, sum(parts[: op.index]))
    raise TypeError(f"{what}: unknown op {op!r}")


@dataclasses.dataclass
class Bound:
    """One leaf bound to its tensors.

    Attributes:
      leaf: its index in the plan's leaves.
      path: its key path.
      entry: the mapping entry.
      shape: its logical shape.
      dtype: its dtype.
      names: its tensors' names, layer-major then pattern (``names[layer * patterns + p]``).
      tensor_shape: per pattern, the tensor's shape.
      layers: the stack placeholder's values (``None``: not stacked).
      chain: the resolved ops with their output shapes, in load order.
      v0: the concatenated tensors' shape (per layer).
      split_key: the entry's ``Split`` ops (a save writes one leaf per distinct key into a tensor).
    """

    leaf: int
    path: str
    entry: Entry
    shape: tuple[int, ...]
    dtype: np.dtype
    names: tuple[str, ...]
    tensor_shape: tuple[tuple[int, ...], ...]
    layers: tuple[str, ...] | None
    chain: tuple[tuple[Any, tuple[int, ...]], ...]
    v0: tuple[int, ...]
    split_key: tuple[Any, ...]

    @property
    def per_layer(self) -> tuple[int, ...]:
        return self.shape[1:] if self.layers is not None else self.shape

    def sources(self, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(tensor id, flat index in that tensor)`` of leaf flat indices ``t`` (int64)."""
        shape = self.per_layer
        n = max(math.prod(shape), 1)
        layer, r = (t // n, t % n) if self.layers is not None else (None, t)
        coords = list(np.unravel_index(r, shape)) if shape else []
        for op, _ in reversed(self.chain):
            kind = op[0]
            if kind == "T":
                back = [None] * len(coords)
                for j, p in enumerate(op[1]):
                    back[p] = coords[j]
                coords = back
            elif kind == "S":
                a, sizes = op[1], op[2]
                c = coords[a]
                for d in range(1, len(sizes)):
                    c = c * sizes[d] + coords[a + d]
                coords = [*coords[:a], c, *coords[a + len(sizes) :]]
            elif kind == "M":
                a, sizes = op[1], op[2]
                parts = list(np.unravel_index(coords[a], sizes))
                coords = [*coords[:a], *parts, *coords[a + 1 :]]
            else:
                coords = list(coords)
                coords[op[1]] = coords[op[1]] + op[2]
        npat = len(self.tensor_shape)
        if npat == 1:
            pid = np.zeros(t.shape, np.int64)
            flat = np.ravel_multi_index(coords, self.v0) if self.v0 else np.zeros(t.shape, np.int64)
        else:
            a = self.entry.axis % len(self.v0)
            sizes = np.asarray([s[a] for s in self.tensor_shape], np.int64)
            starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            pid = np.searchsorted(starts, coords[a], side="right") - 1
            coords[a] = coords[a] - starts[pid]
            flat = np.zeros(t.shape, np.int64)
            for d, c in enumerate(coords):
                flat = flat * (sizes[pid] if d == a else self.v0[d]) + c
        tid = pid if layer is None else layer * npat + pid
        return tid.astype(np.int64), np.asarray(flat, np.int64)


def _bind_entry(mapping: Mapping, path: str) -> tuple[Entry, dict[str, str]] | None:
    name = leaf_name(path)
    for entry in mapping.entries:
        m = compile_pattern(entry.leaf, "/").fullmatch(name)
        if m:
            return entry, m.groupdict()
    return None


def _stack_values(entry: Entry, binding: dict[str, str], names: Sequence[str]) -> list[str]:
    """The stack placeholder's values present in ``names`` for every tensor pattern, numerically sorted."""
    found = None
    for pattern in entry.tensors:
        partial = pattern
        for k, v in binding.items():
            partial = partial.replace(f"{{{k}}}", v)
        rx = compile_pattern(partial, ".")
        vals = {m.group(entry.stack) for n in names if (m := rx.fullmatch(n))}
        found = vals if found is None else found & vals
    return sorted(found or (), key=lambda v: (0, int(v), "") if v.isdigit() else (1, 0, v))


def bind(
    plan: Plan,
    mapping: Mapping,
    *,
    available: Sequence[str] | None = None,
    what: str = "load_safetensors",
) -> list[Bound]:
    """Binds every leaf of ``plan`` to its tensors.

    Args:
      plan: the plan.
      mapping: the mapping.
      available: the checkpoint's tensor names (a load: stacked layers are those present); ``None`` for a save
        (layers ``0 .. L-1``).
      what: the caller's name, for errors.

    Returns:
      One :class:`Bound` per leaf, in the plan's order.

    Raises:
      ValueError: a leaf no entry matches; a non-optional entry no leaf matches; shapes the ops cannot produce.
    """
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"{what}: mapping must be a vj.checkpoint.Mapping (e.g. llama_mapping()), got {type(mapping).__name__}."
        )
    out, used = [], set()
    for i, spec in enumerate(plan.leaves):
        hit = _bind_entry(mapping, spec.path)
        if hit is None:
            raise ValueError(
                f"{what}: leaf {spec.path!r} {spec.shape} {spec.dtype} has no mapping entry; add "
                f"Entry({leaf_name(spec.path)!r}, 'tensor.name', ops) to the mapping (entries that come close: "
                f"{near(leaf_name(spec.path), [e.leaf for e in mapping.entries])})."
            )
        entry, binding = hit
        used.add(id(entry))
        where = f"{what}: leaf {spec.path!r} {spec.shape} (entry {entry.leaf!r} -> {list(entry.tensors)})"
        shape = tuple(spec.shape)
        if entry.stack is not None:
            if not shape:
                raise ValueError(
                    f"{where}: a stacked entry needs a leading layer dim, the leaf is a scalar; map it with an entry "
                    "whose tensor pattern has no placeholder the leaf pattern lacks."
                )
            if available is None:
                layers = tuple(str(j) for j in range(shape[0]))
            else:
                layers = tuple(_stack_values(entry, binding, available))
                if len(layers) != shape[0]:
                    raise ValueError(
                        f"{where}: shape mismatch: the leaf stacks {shape[0]} layers but the files hold "
                        f"{len(layers)} tensors matching {entry.tensors[0]!r} (indices {list(layers)[:8]}); plan the "
                        "model with the checkpoint's layer count."
                    )
            per_layer = shape[1:]
        else:
            layers, per_layer = None, shape
        chain, out_shape = [], per_layer
        for op in reversed(entry.ops):
            in_shape, resolved = _back_shape(op, out_shape, where)
            chain.append((resolved, out_shape))
            out_shape = in_shape
        chain.reverse()
        v0 = out_shape
        npat = len(entry.tensors)
        if npat == 1:
            tshapes = (v0,)
        else:
            a = _axis(entry.axis, len(v0), where)
            secs = entry.sections or (v0[a] // npat,) * npat
            if sum(secs) != v0[a] or len(secs) != npat:
                raise ValueError(
                    f"{where}: {npat} tensors of sizes {secs} along axis {a} do not make dim {v0[a]} of {v0}; fix the "
                    "entry's sections, or plan the leaf with the checkpoint's shape."
                )
            tshapes = tuple((*v0[:a], s, *v0[a + 1 :]) for s in secs)
        fmt = []
        for lay in layers if layers is not None else (None,):
            for pattern in entry.tensors:
                name = pattern
                for k, v in {**binding, **({entry.stack: lay} if lay is not None else {})}.items():
                    name = name.replace(f"{{{k}}}", v)
                fmt.append(name)
        split_key = tuple((op.axis, op.index) for op in entry.ops if isinstance(op, Split))
        out.append(
            Bound(
                i,
                spec.path,
                entry,
                shape,
                np.dtype(spec.dtype),
                tuple(fmt),
                tshapes,
                layers,
                tuple(chain),
                v0,
                split_key,
            )
        )
    for entry in mapping.entries:
        if id(entry) not in used and not entry.optional:
            raise ValueError(
                f"{what}: mapping entry {entry.leaf!r} -> {list(entry.tensors)} matches no leaf of the plan "
                f"(leaves are e.g. {[s.path for s in plan.leaves][:4]}); fix its pattern, or mark it "
                "Entry(..., optional=True)."
            )
    return out


def _widening(src: np.dtype, dst: np.dtype) -> bool:
    if src == dst:
        return True
    floating = lambda d: jnp.issubdtype(d, jnp.floating)
    if floating(src) and floating(dst):
        # a float widens to one with at least its mantissa and exponent range (bf16 -> f32, f16 -> f32, f32 -> f64)
        a, b = jnp.finfo(src), jnp.finfo(dst)
        return b.nmant >= a.nmant and b.maxexp >= a.maxexp and b.minexp <= a.minexp
    if src.kind in "iu" and dst.kind in "iu":
        return np.can_cast(src, dst, "safe")
    return src.kind == "b" and dst.kind in "iub"


def check_cast(src: np.dtype, dst: np.dtype, cast: str, where: str) -> None:
    """Raises unless a cast from ``src`` to ``dst`` is allowed: widening by default, any with ``cast="any"``."""
    if cast not in ("widen", "any", "none"):
        raise ValueError(f"cast={cast!r}: expected 'widen' (default), 'any' or 'none'.")
    if src == dst or cast == "any" or (cast == "widen" and _widening(src, dst)):
        return
    raise ValueError(
        f"{where}: dtype mismatch: the file holds {src.name} but the leaf is {dst.name}, a "
        f"{'narrowing or kind-changing' if cast == 'widen' else ''} cast{' not allowed with cast=' + repr(cast)}; "
        f"plan the leaf as {src.name}, or pass cast='any' to allow it."
    )


def _runs(s: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Sorted unique indices ``s`` as runs ``(lo, length, base)`` (gaps up to ``gap`` merged) and each index's
    position in the runs laid end to end."""
    brk = np.flatnonzero(np.diff(s) > gap + 1) + 1
    first = np.concatenate([[0], brk])
    last = np.concatenate([brk, [s.size]]) - 1
    lo, hi = s[first], s[last] + 1
    lengths = hi - lo
    base = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    run = np.repeat(np.arange(lo.size), last - first + 1)
    return lo, lengths, base, base[run] + (s - lo[run])


def read_indices(
    bound: Bound, t: np.ndarray, ckpt: Checkpoint, reader: Reader, cast: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """The leaf's elements at flat indices ``t`` (one chunk), read from the files and cast by ``cast``."""
    tid, src = bound.sources(t)
    out = None
    ids = np.unique(tid) if tid.size and tid[0] != tid[-1] else tid[:1]
    for j in ids:
        mask = None if ids.size == 1 else tid == j
        s = src if mask is None else src[mask]
        info = ckpt.tensors[bound.names[int(j)]]
        order = None if s.size < 2 or np.all(s[1:] > s[:-1]) else np.argsort(s, kind="stable")
        ss = s if order is None else s[order]
        lo, lengths, base, pos = _runs(ss, GAP)
        buf = np.empty(int(lengths.sum()), info.dtype)
        raw = memoryview(buf.view(np.uint8))
        item = info.dtype.itemsize
        for a, n, b in zip(lo.tolist(), lengths.tolist(), base.tolist(), strict=True):
            reader.read_into(info.file, info.offset + a * item, raw[b * item : (b + n) * item], what=info.name)
        vals = cast(buf[pos])
        if out is None:
            out = np.empty(t.shape, vals.dtype)
        if order is not None:
            tmp = np.empty_like(vals)
            tmp[order] = vals
            vals = tmp
        if mask is None:
            out[...] = vals
        else:
            out[mask] = vals
    return out if out is not None else np.empty(t.shape, bound.dtype)


def chunks(bound: Bound, lo: int, hi: int, cols: int | None = None):
    """The leaf's flat indices ``[lo, hi)`` in chunks of at most :data:`CHUNK` (int64 arrays).

    ``cols`` is the length of the rows the indices count in (default the leaf's last dim; a TP/EP shard's own last
    dim when ``lo``, ``hi`` count in the shard).

    A leaf whose ops keep the tensor's element order (no :class:`Transpose`) goes in flat order: each chunk is one
    run of the tensor. A transposed leaf goes in column bands (the range viewed as rows of its last dim, a band
    of columns over all its rows at a time): a band's columns are rows of the tensor, so each of them is one long
    run, as long as the range has rows, instead of runs of ``CHUNK / row length`` elements.
    """
    if cols is None:
        cols = bound.shape[-1] if bound.shape else 1
    transposed = any(op[0] == "T" and list(op[1]) != sorted(op[1]) for op, _ in bound.chain)
    if not transposed or cols <= 1 or hi - lo <= CHUNK:
        for a in range(lo, hi, CHUNK):
            yield np.arange(a, min(hi, a + CHUNK), dtype=np.int64)
        return
    r0, r1 = lo // cols, (hi - 1) // cols + 1  # rows the range touches
    rb = min(r1 - r0, CHUNK)
    w = max(1, CHUNK // rb)
    for ra in range(r0, r1, rb):
        rows = np.arange(ra, min(r1, ra + rb), dtype=np.int64)[:, None] * cols
        for j in range(0, cols, w):
            # column-major inside the band: a plain 2-D transpose's tensor indices come out sorted
            t = (rows.T + np.arange(j, min(cols, j + w), dtype=np.int64)[:, None]).reshape(-1)
            t = t[(t >= lo) & (t < hi)]
            if t.size:
                yield t


def write_indices(
    bound: Bound, t: np.ndarray, values: np.ndarray, files: dict[str, tuple[str, int]], dtypes: dict, writer: Writer
) -> None:
    """Writes ``values`` (the leaf's elements at flat indices ``t``) at their tensors' places in the files.

    ``files`` maps a tensor name to ``(file, absolute offset)``; ``dtypes`` a tensor name to its file dtype."""
    tid, src = bound.sources(t)
    ids = np.unique(tid) if tid.size and tid[0] != tid[-1] else tid[:1]
    for j in ids:
        name = bound.names[int(j)]
        if name not in files:  # a tied tensor another leaf writes
            continue
        mask = None if ids.size == 1 else tid == j
        s = src if mask is None else src[mask]
        v = values if mask is None else values[mask]
        order = None if s.size < 2 or np.all(s[1:] > s[:-1]) else np.argsort(s, kind="stable")
        if order is not None:
            s, v = s[order], v[order]
        v = np.ascontiguousarray(v.astype(dtypes[name], copy=False))
        lo, lengths, base, _ = _runs(s, 0)
        raw = memoryview(v.view(np.uint8))
        file, offset = files[name]
        item = v.dtype.itemsize
        for a, n, b in zip(lo.tolist(), lengths.tolist(), base.tolist(), strict=True):
            writer.write(file, offset + a * item, raw[b * item : (b + n) * item])
