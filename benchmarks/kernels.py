"""Ragged pack / unpack kernels vs XLA's own version and a plain device copy.

On a GPU: for a GPT-style bucket (a few big matrices, >= 1 GB) and a bucket of hundreds of small tensors,
every kernel backend (triton, mosaic_gpu) is first checked bit-for-bit against the plain-jnp reference, then
timed (median of >= 20 runs after warm-up, ``block_until_ready``, random non-zero data) next to the jitted
reference (XLA: concatenate / slices) and a device-to-device copy ``x + 1`` of the bucket buffer (the
measured ceiling). Bandwidth counts bytes read + written; "vs copy" is the kernel's bandwidth ÷ the copy's
(goal ≥ 0.85), "% of 4.3 TB/s" is against the copy figure of DESIGN.md §5. A backend that fails to lower or
to match is reported in the table, never fatal. ``--json`` writes the measured table that
``KernelPolicy(mode="auto")`` reads (``vescale_jax/kernels/_measured.json``): one record per bit-identical
kernel row at the default window, keyed by device kind, backend, direction, dtypes and size class.

On CPU (no accelerator) it runs the correctness check only, small sizes, interpreted; ``--dry-run`` instead
runs the timing path on tiny buckets with the interpreter (figures meaningless, printed as such).

  python benchmarks/kernels.py [--out benchmarks/results/kernels_gpu.md] [--json vescale_jax/kernels/_measured.json]
      [--runs 20] [--backends mosaic_gpu,triton] [--small-backends mosaic_gpu] [--srcs float32,bfloat16] [--dry-run]

Goals printed at the end (each row's status says whether it compiled and matched): on the gpt bucket every pack
and unpack row of a backend at its default window >= 0.85 x the copy, and >= 1.0 x XLA wherever
``KernelPolicy(mode="auto")`` would pick it (the table it writes decides); the small bucket (256 tensors by
default) compiles in <= 2 s per op.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import vescale_jax as vj
from vescale_jax import kernels as K
from vescale_jax._compat import mosaic_gpu_interpret_params
from vescale_jax.kernels import MeasuredTable, Record, size_class

CEILING_GBS = 4300.0
JAXLIB = importlib.metadata.version("jaxlib")  # installed with jax; read from its metadata, not imported
F32, BF16 = jnp.float32, jnp.bfloat16


def gpt_bucket(scale: int = 1) -> list[tuple[int, ...]]:
    """A few big matrices plus vectors: 4 x 8192^2 fp32 = 1.07 GB at scale 1 (sizes multiples of 4)."""
    d = 8192 // scale
    return [(d, d), (3 * d,), (d, d), (d,), (4 * d, d), (d,), (d, d // 4), (4 * d,)]


def small_bucket(n: int = 400, seed: int = 0, *, max_last: int = 128, max_rows: int = 64) -> list[tuple[int, ...]]:
    """Hundreds of small tensors (last dims multiples of 8: mosaic_gpu's 16-byte rule holds in fp32)."""
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(n):
        last = 8 * int(rng.integers(1, max_last))
        shapes.append((last,) if rng.random() < 0.4 else (int(rng.integers(1, max_rows)), last))
    return shapes


def layout_for(shapes: list[tuple[int, ...]], m: int = 8) -> vj.BucketLayout:
    sizes = [math.prod(s) for s in shapes]
    blocks = [s[-1] if len(s) > 1 else 1 for s in shapes]  # rows(1)
    return vj.plan_bucket(sizes, blocks, m, align=4)


def random_leaves(shapes, dtype, seed=0) -> list[jax.Array]:
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [(jax.random.uniform(k, s, F32, 0.5, 2.0)).astype(dtype) for k, s in zip(keys, shapes, strict=True)]


def median_ms(fn: Callable, *args, runs: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def same(a, b) -> bool:
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and bool(jnp.array_equal(x, y, equal_nan=True))
        for x, y in zip(a, b, strict=True)
    )


def ops(layout, shapes, src_dtype):
    """(name, input, reference fn, kernel fn(**kw), bytes moved, record key or None).

    The key ``(direction, src, dst, buffer bytes)`` is what a :class:`Record` of the row is filed under;
    the scaled pack has none (the gather path's policy does not fuse a scale)."""
    n = sum(layout.sizes)
    isz = np.dtype(src_dtype).itemsize
    leaves = random_leaves(shapes, src_dtype)
    buffer = K.pack_reference(leaves, layout)
    out = []
    for dt, scale in ((src_dtype, None), (BF16, 0.125)):
        name = f"pack {np.dtype(src_dtype).name}->{np.dtype(dt).name}" + (" *s" if scale else "")
        moved = n * isz + layout.total_size * np.dtype(dt).itemsize
        key = None if scale else ("pack", np.dtype(src_dtype).name, np.dtype(dt).name, buffer_bytes(layout, dt))
        out.append(
            (
                name,
                leaves,
                lambda xs, dt=dt, scale=scale: K.pack_reference(xs, layout, dtype=dt, scale=scale),
                lambda xs, dt=dt, scale=scale, **kw: K.pack(xs, layout, dtype=dt, scale=scale, **kw),
                moved,
                key,
            )
        )
    for dt in dict.fromkeys((np.dtype(src_dtype), np.dtype(BF16))):
        name = f"unpack {np.dtype(src_dtype).name}->{np.dtype(dt).name}"
        moved = n * (isz + np.dtype(dt).itemsize)
        key = ("unpack", np.dtype(src_dtype).name, np.dtype(dt).name, buffer_bytes(layout, src_dtype))
        out.append(
            (
                name,
                buffer,
                lambda b, dt=dt: K.unpack_reference(b, layout, shapes, dtype=dt),
                lambda b, dt=dt, **kw: K.unpack(b, layout, shapes, dtype=dt, **kw),
                moved,
                key,
            )
        )
    return leaves, buffer, out


def buffer_bytes(layout, dtype) -> int:
    """Bytes of the bucket buffer (what the size class of a record is taken from, as the policy does)."""
    return layout.total_size * np.dtype(dtype).itemsize


def fmt_err(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".splitlines()[0]
    return msg[:110].replace("|", "/")


def run_timed(args, rows: list[str], flush: Callable[[], None], records: list[Record], results: list) -> None:
    """Time every op and backend against XLA and a copy of the buffer; append rows, auto-table records and
    ``(case, op, backend, ok, vs copy, vs XLA, compile s, record key)`` per kernel at its default window."""
    dev = jax.devices()[0]
    interpret = args.dry_run
    if args.dry_run:
        cases = [("gpt-mini", gpt_bucket(256)), ("small", small_bucket(4, max_last=8, max_rows=4))]
    else:
        cases = [("gpt", gpt_bucket(args.gpt_scale)), ("small", small_bucket(args.small_n))]
    for case, shapes in cases:
        layout = layout_for(shapes)
        for src in args.srcs:
            _, buffer, case_ops = ops(layout, shapes, src)
            total_mb = buffer.nbytes / 1e6
            print(
                f"[{case} {np.dtype(src).name}] {len(shapes)} tensors, buffer {total_mb:.1f} MB "
                f"({size_class(buffer.nbytes)}), padding {layout.padding_fraction:.2%}"
            )
            copy = jax.jit(lambda x: x + jnp.ones((), x.dtype))
            ms = median_ms(copy, buffer, runs=args.runs)
            copy_gbs = 2 * buffer.nbytes / ms / 1e6
            rows.append(row(case, f"copy x+1 {np.dtype(src).name}", "xla", 2 * buffer.nbytes, ms, copy_gbs, None, 1.0))
            flush()
            for name, inp, ref, kern, moved, key in case_ops:
                ref_jit = jax.jit(ref)
                want = ref_jit(inp)
                xla_ms = median_ms(ref_jit, inp, runs=args.runs)
                xla_gbs = moved / xla_ms / 1e6
                rows.append(row(case, name, "xla (reference)", moved, xla_ms, xla_gbs, 1.0, xla_gbs / copy_gbs))
                for backend in args.small_backends if case == "small" else args.backends:
                    chunks = [None] + (args.chunks if (case == "gpt" and backend == "triton") else [])
                    for chunk in chunks:
                        label = ("interpret as " if interpret else "") + backend + (f" c{chunk}" if chunk else "")
                        fn = jax.jit(
                            lambda x, backend=backend, chunk=chunk, kern=kern: kern(
                                x, backend=backend, chunk=chunk, interpret=interpret
                            )
                        )
                        try:
                            t = time.perf_counter()
                            got = fn(inp)
                            jax.block_until_ready(got)
                            compile_s = time.perf_counter() - t
                            ok = same(got, want)
                            del got
                            ms = median_ms(fn, inp, runs=args.runs)
                            gbs = moved / ms / 1e6
                            status = ("ok" if ok else "MISMATCH") + f" (compile {compile_s:.1f}s)"
                            rows.append(row(case, name, label, moved, ms, gbs, xla_ms / ms, gbs / copy_gbs, status))
                            if chunk is None:
                                results.append((case, name, backend, ok, gbs / copy_gbs, xla_ms / ms, compile_s, key))
                            if ok and chunk is None and key is not None:
                                direction, s_name, d_name, nbytes = key
                                records.append(
                                    Record(
                                        device_kind=dev.device_kind,
                                        backend=backend,
                                        direction=direction,
                                        src=s_name,
                                        dst=d_name,
                                        size_class=size_class(nbytes),
                                        xla_ms=round(xla_ms, 4),
                                        pallas_ms=round(ms, 4),
                                        jax=jax.__version__,
                                    )
                                )
                        except NotImplementedError as e:
                            rows.append(row(case, name, label, moved, None, None, None, None, "n/a: " + fmt_err(e)))
                        except Exception as e:  # a lowering failure is a result, not a crash
                            traceback.print_exc()
                            rows.append(row(case, name, label, moved, None, None, None, None, "FAILED: " + fmt_err(e)))
                        print(rows[-1], flush=True)
                        flush()
            print(f"[{case} {np.dtype(src).name}] measured copy {copy_gbs:.0f} GB/s")


COPY_GOAL, XLA_GOAL, COMPILE_GOAL_S = 0.85, 1.0, 2.0


def goal_lines(results: list, table: MeasuredTable) -> list[str]:
    """The goals, per backend: gpt rows against the copy (and XLA where auto picks the kernel), small compiles."""
    out = []
    for backend in dict.fromkeys(r[2] for r in results):
        mine = [r for r in results if r[2] == backend]
        gpt = [r for r in mine if r[0] != "small" and "*s" not in r[1]]
        if gpt:
            worst = min(gpt, key=lambda r: r[4])
            ok = all(r[3] and r[4] >= COPY_GOAL for r in gpt)
            out.append(
                f"{backend}: gpt bucket, worst vs copy {worst[4]:.2f} ({worst[1]}; goal >= {COPY_GOAL}): "
                f"{'met' if ok else 'NOT met'}"
            )
            picked = [r for r in gpt if r[7] is not None and _auto_picks(table, backend, r[7])]
            if picked:
                ok = all(r[5] >= XLA_GOAL for r in picked)
                out.append(
                    f"{backend}: where auto picks it, worst vs XLA {min(r[5] for r in picked):.2f}: "
                    f"{'met' if ok else 'NOT met'}"
                )
        small = [r for r in mine if r[0] == "small"]
        if small:
            slowest = max(r[6] for r in small)
            out.append(
                f"{backend}: small bucket, slowest compile + first run {slowest:.1f} s (goal <= {COMPILE_GOAL_S}): "
                f"{'met' if slowest <= COMPILE_GOAL_S else 'NOT met'}"
            )
    return out


def _auto_picks(table: MeasuredTable, backend: str, key) -> bool:
    direction, src, dst, nbytes = key
    dev = jax.devices()[0]
    return table.faster(
        backend=backend, direction=direction, src_dtype=src, dst_dtype=dst, nbytes=nbytes, device_kind=dev.device_kind
    )


def row(case, op, impl, moved, ms, gbs, vs_xla, vs_copy, status="-") -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)
    pct = None if gbs is None else 100 * gbs / CEILING_GBS
    return (
        f"| {case} | {op} | {impl} | {moved / 1e6:.3f} | {f(ms, '.3f')} | {f(gbs, '.0f')} | {f(pct, '.1f')} "
        f"| {f(vs_copy, '.2f')} | {f(vs_xla, '.2f')} | {status} |"
    )


def run_cpu(rows: list[str], flush: Callable[[], None]) -> None:
    for case, shapes in (("gpt-mini", gpt_bucket(256)), ("small", small_bucket(16, max_last=8, max_rows=4))):
        layout = layout_for(shapes)
        for src in (F32, BF16):
            _, _, case_ops = ops(layout, shapes, src)
            for name, inp, ref, kern, moved, _ in case_ops:
                t = time.perf_counter()
                ok = same(kern(inp, interpret=True), ref(inp))
                status = ("ok" if ok else "MISMATCH") + f" ({time.perf_counter() - t:.1f}s)"
                rows.append(row(case, name, "interpret", moved, None, None, None, None, status))
                print(rows[-1], flush=True)
                flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="markdown file to write")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--backends", default="mosaic_gpu,triton")
    p.add_argument("--small-backends", default=None, help="backends timed on the small bucket (default: --backends)")
    p.add_argument("--chunks", default="4096,8192,16384", help="triton window sizes tried on the gpt bucket")
    p.add_argument("--gpt-scale", type=int, default=1, help="divide the gpt matrices' dims by this")
    p.add_argument("--small-n", type=int, default=256)
    p.add_argument("--srcs", default="float32,bfloat16", help="source dtypes of the timed buckets")
    p.add_argument("--json", default=None, help="write the measured table for KernelPolicy(mode='auto') here")
    p.add_argument("--dry-run", action="store_true", help="the timing path on tiny buckets, interpreted (CPU)")
    args = p.parse_args(argv)
    args.srcs = [np.dtype(jnp.dtype(d)) for d in args.srcs.split(",") if d]
    args.backends = [b for b in args.backends.split(",") if b]
    args.small_backends = args.backends if args.small_backends is None else args.small_backends.split(",")
    if args.dry_run:  # each path once, tiny: one source dtype, one backend, 2 runs
        args.runs, args.srcs = min(args.runs, 2), args.srcs[:1]
        # the interpreter of each backend: Mosaic GPU's own where JAX has one, else the Pallas interpreter
        interpretable = [b for b in args.backends if b != "mosaic_gpu" or mosaic_gpu_interpret_params() is not None]
        args.backends = args.small_backends = (interpretable or ["triton"])[:1]
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    print(
        f"JAX {jax.__version__}, {dev.device_kind} ({dev.platform}), backends importable: {K.gpu_backends_available()}"
    )
    head = [
        "# Ragged pack / unpack kernels",
        "",
        f"JAX {jax.__version__}, jaxlib {JAXLIB}, device: {dev.device_kind} ({dev.platform}). "
        + (
            f"Median of {args.runs} runs after warm-up; bytes = read + written; % of the {CEILING_GBS:.0f} GB/s "
            "copy figure (DESIGN.md §5); 'vs copy' = GB/s ÷ the GB/s of a device copy (x + 1) of the same "
            "buffer (goal ≥ 0.85); 'vs XLA' = XLA time / kernel time (> 1: kernel faster). "
            "Buckets: gpt = fp32 8192x8192, 32768x8192, 8192x2048 matrices + vectors (1.7 GB; rows(1) blocks, "
            "8 devices, align 4); "
            f"small = {args.small_n} small tensors; source dtypes {', '.join(d.name for d in args.srcs)}."
            if gpu
            else (
                "DRY RUN on CPU: the timing path on tiny buckets, interpreted; the figures mean nothing."
                if args.dry_run
                else "CPU: correctness only (interpret=True, small sizes); no timings."
            )
        ),
        "",
        "| bucket | op | impl | MB moved | median ms | GB/s | % of 4.3 TB/s | vs copy | vs XLA | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    rows: list[str] = []
    records: list[Record] = []
    results: list = []

    def flush() -> None:  # rewritten after every row: a timeout still leaves the rows measured so far
        if args.out:
            with open(args.out, "w") as f:
                f.write("\n".join(head + rows) + "\n")
        if args.json and (gpu or args.dry_run):
            MeasuredTable(records=tuple(records)).to_json(args.json)

    if gpu or args.dry_run:
        run_timed(args, rows, flush, records, results)
    else:
        run_cpu(rows, flush)
    flush()
    print("\n".join(head + rows))
    if gpu or args.dry_run:
        faster = MeasuredTable(records=tuple(records)).cases()
        print(f"{len(records)} records; Pallas measured faster than XLA (auto would pick it) in {len(faster)}:")
        for r in faster:
            print(f"  {r.backend} {r.direction} {r.src}->{r.dst} {r.size_class}: {r.speedup:.2f}x")
        goals = goal_lines(results, MeasuredTable(records=tuple(records)))
        print("goals" + (" (DRY RUN: meaningless)" if args.dry_run else "") + ":")
        for line in goals:
            print("  " + line)
        if args.out:
            with open(args.out, "a") as f:
                f.write("\n" + "\n".join(f"- {line}" for line in goals) + "\n")
    bad = [r for r in rows if "MISMATCH" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
