"""Checkpoint benchmarks: save and restore time against plain Orbax, and peak host memory per process.

    python benchmarks/checkpoint.py time [--mib 600] [--repeats 3] [--bound 1.25] [--model all|stacked|gpt|llama|moe]
    python benchmarks/checkpoint.py temp [--mib 64] [--model stacked|gpt|llama|moe]
    python benchmarks/checkpoint.py memory [--processes 4] [--devices 2] [--mib 256]

``time`` (8 simulated CPU devices, one process): a params + Adam state of about ``--mib`` MiB saved with
``vj.checkpoint.Manager`` (bucket -> logical conversion, checksums, Orbax write) and restored into its plan
(Orbax read, logical -> bucket conversion, checksums), against plain ``ocp.StandardCheckpointer`` saving the
same state as an unsharded tree on one device and restoring it onto that device; each round runs the four side
by side; medians after a compiling round, and per direction the median of the rounds' ratios vj / plain.
``--model stacked`` (default): one stacked ``(1024, 1024)`` group (its leaves line up with the shards), its biases
and a ragged embedding; ``--model gpt``: GPT-like layers whose leaves straddle the shards (:func:`gpt_shapes`);
``--model llama``: Llama-shaped layers with grouped-query attention and an untied head (:func:`llama_shapes`);
``--model moe``: stacked mixture-of-experts layers (:func:`moe_shapes`); ``--model all``: the four, one after
another, then a summary table. ``--bound B`` (default 1.25) exits non-zero if any model's save or restore ratio
exceeds ``B`` (``--bound 0``: no bound).

``temp``: the per-device XLA figures (``compiled.memory_analysis()``) of every conversion executable of a
``--mib`` MiB parameter tree on 8 simulated devices, beside the one-layer bound.

``memory`` (``--processes`` processes x ``--devices`` CPU devices on loopback): every process samples its own
resident set size every 2 ms while the job saves a ``--mib`` MiB parameter tree and restores it into another
plan (``rows(1)`` instead of ``element()``), and reports the peak increase over its RSS before the call, next to
the model size and its own share (model / processes).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples this process's RSS in a thread; ``peak - base`` is the increase during the ``with`` block."""

    def __enter__(self):
        self.base = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def increase_mib(self) -> float:
        return (self.peak - self.base) / MIB


def layers_for(mib: float, per_layer: int, fixed: int) -> int:
    """How many stacked layers of ``per_layer`` float32 elements make, beside ``fixed`` other elements, about
    ``mib`` MiB (at least one)."""
    return max(1, int((mib * MIB / 4 - fixed) / per_layer))


def model_shapes(mib: float):
    """A stacked block group plus an embedding whose rows do not divide the device count (ragged), ~mib MiB."""
    import jax
    import jax.numpy as jnp

    layers = max(1, int(mib * MIB / 4 / (1024 * 1024 + 4096)) - 1)
    return {
        "embed": jax.ShapeDtypeStruct((50257 // 8, 160), jnp.float32),  # 6282 rows: 8 does not divide it
        "blocks": {
            "w": jax.ShapeDtypeStruct((layers, 1024, 1024), jnp.float32),
            "b": jax.ShapeDtypeStruct((layers, 4096), jnp.float32),
        },
    }


def gpt_shapes(mib: float):
    """A GPT-like tree of ~mib MiB: per layer qkv, proj, up, down, two norms and a bias in one stacked group (leaves
    that straddle the shards, most stored split on their last dim), a 16001-row embedding and a final norm."""
    import jax
    import jax.numpy as jnp

    d, f = 512, 2048
    per_layer = d * 3 * d + d * d + 2 * d * f + 2 * d + f
    layers = layers_for(mib, per_layer, 16001 * d)
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return {
        "embed": sds(16001, d),
        "lnf": sds(d),
        "blocks": {
            "qkv": sds(layers, d, 3 * d),
            "proj": sds(layers, d, d),
            "up": sds(layers, d, f),
            "down": sds(layers, f, d),
            "ln": sds(layers, 2, d),
            "b_up": sds(layers, f),
        },
    }


def llama_shapes(mib: float):
    """A Llama-shaped tree of ~mib MiB: per layer grouped-query attention (8 query heads, 2 key / value heads of 64),
    a SwiGLU MLP and two RMSNorm scales in one stacked group; a 32000-row embedding, an untied ``(d, vocab)`` head
    and a final norm."""
    import jax
    import jax.numpy as jnp

    d, heads, kv, hd, f, vocab = 512, 8, 2, 64, 1408, 32000
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * f + 2 * d
    layers = layers_for(mib, per_layer, 2 * vocab * d + d)
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return {
        "embed": sds(vocab, d),
        "norm": sds(d),
        "lm_head": sds(d, vocab),
        "blocks": {
            "q": sds(layers, d, heads * hd),
            "k": sds(layers, d, kv * hd),
            "v": sds(layers, d, kv * hd),
            "o": sds(layers, heads * hd, d),
            "gate": sds(layers, d, f),
            "up": sds(layers, d, f),
            "down": sds(layers, f, d),
            "attn_norm": sds(layers, d),
            "mlp_norm": sds(layers, d),
        },
    }


def moe_shapes(mib: float):
    """A stacked mixture-of-experts tree of ~mib MiB: per layer attention (fused qkv, out), a router, 8 experts'
    ``(d, f)`` / ``(f, d)`` matrices stacked on an expert dim and two norms in one stacked group; a ragged
    16001-row embedding and a final norm."""
    import jax
    import jax.numpy as jnp

    d, f, experts = 512, 1024, 8
    per_layer = 4 * d * d + d * experts + 2 * experts * d * f + 2 * d
    layers = layers_for(mib, per_layer, 16001 * d)
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return {
        "embed": sds(16001, d),
        "norm": sds(d),
        "blocks": {
            "qkv": sds(layers, d, 3 * d),
            "o": sds(layers, d, d),
            "router": sds(layers, d, experts),
            "w_in": sds(layers, experts, d, f),
            "w_out": sds(layers, experts, f, d),
            "ln": sds(layers, 2, d),
        },
    }


MODELS = {"stacked": model_shapes, "gpt": gpt_shapes, "llama": llama_shapes, "moe": moe_shapes}


def shapes_of(model: str, mib: float):
    return MODELS[model](mib)


def init_fn(shapes):
    import jax

    def init(key):
        leaves, treedef = jax.tree.flatten(shapes)
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(
            treedef, [jax.random.normal(k, s.shape, s.dtype) for k, s in zip(keys, leaves, strict=True)]
        )

    return init


# ------------------------------------------------------------------------------------------------------ time
def bench_time(args) -> int:
    """Every model of ``--model`` (``all``: each in turn), then a summary; returns the exit status (1 if any
    model's save or restore ratio exceeds ``--bound``)."""
    models = list(MODELS) if args.model == "all" else [args.model]
    results = {}
    for model in models:
        print(f"## --model {model}", flush=True)
        results[model] = bench_model(model, args)
        print(flush=True)
    bound = args.bound or None
    print(
        "| model | state MiB | vj save s | plain save s | save ratio | vj restore s | plain restore s | restore ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for model, (total, med, ratios) in results.items():
        print(
            f"| {model} | {total:.0f} | {med['vj save']:.2f} | {med['plain save']:.2f} | {ratios['save']:.2f} "
            f"| {med['vj restore']:.2f} | {med['plain restore']:.2f} | {ratios['restore']:.2f} |"
        )
    if bound is None:
        return 0
    over = [f"{m} {k} {v:.2f}" for m, (_, _, r) in results.items() for k, v in r.items() if v > bound]
    if over:
        print(f"FAIL: ratio vj / plain above the bound {bound}: {', '.join(over)}")
        return 1
    print(f"ok: every ratio within the bound {bound} ({len(results)} model(s), save and restore)")
    return 0


def bench_model(model: str, args):
    """Save and restore of one model, vj against plain Orbax, side by side in each round: ``(state MiB, median
    seconds per timing, median ratio per direction)``."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import numpy as np
    import optax
    import orbax.checkpoint as ocp

    import vescale_jax as vj

    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    shapes = shapes_of(model, args.mib / 3)  # params + mu + nu
    plan = vj.plan(shapes, mesh, stacked=("blocks",))
    params = vj.init_sharded(init_fn(shapes), plan, jax.random.key(0))
    adam, *rest = vj.init_opt_state(optax.adam(1e-3), params)
    state = (adam._replace(mu=jax.tree.map(lambda x: x * 0.5, params), nu=jax.tree.map(lambda x: x * x, params)), *rest)
    template = jax.eval_shape(lambda: state)
    total = 3 * sum(b.nbytes for b in plan.buckets) / MIB
    # The unsharded tree a plain Flax job would hold, on one device (built through the host, leaf by leaf).
    one = jax.devices()[0]
    plain_tree = {
        name: jax.tree.map(lambda x: jax.device_put(np.asarray(x), one), vj.checkpoint.logical_tree(sp))
        for name, sp in (("params", params), ("mu", state[0].mu), ("nu", state[0].nu))
    }
    plain_tree["count"] = jax.device_put(np.asarray(state[0].count), one)
    on_one = jax.sharding.SingleDeviceSharding(one)
    plain_target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_one), plain_tree)
    jax.block_until_ready((params, state, plain_tree))
    root = tempfile.mkdtemp(prefix="vj_ckpt_bench_")
    times: dict[str, list[float]] = {"vj save": [], "plain save": [], "vj restore": [], "plain restore": []}

    def timed(key, fn):
        t = time.perf_counter()
        out = fn()
        jax.block_until_ready(out)
        times[key].append(time.perf_counter() - t)
        return out

    def vj_save(directory):
        with vj.checkpoint.Manager(directory) as mngr:
            mngr.save(1, params=params, opt_state=state)
            mngr.wait()

    def vj_restore(directory):
        with vj.checkpoint.Manager(directory) as mngr:
            r = mngr.restore(params=plan, opt_state=template)
        return r.params, r.opt_state

    def plain_save(directory):
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(directory, plain_tree)
        ckptr.wait_until_finished()

    try:
        for r in range(args.repeats + 1):  # the first round compiles the conversions
            vj_dir, plain_dir = os.path.join(root, f"vj{r}"), os.path.join(root, f"plain{r}")
            timed("vj save", lambda d=vj_dir: vj_save(d))
            timed("plain save", lambda d=plain_dir: plain_save(d))
            restored = timed("vj restore", lambda d=vj_dir: vj_restore(d))
            del restored
            restored = timed("plain restore", lambda d=plain_dir: ocp.StandardCheckpointer().restore(d, plain_target))
            del restored
            shutil.rmtree(vj_dir)
            shutil.rmtree(plain_dir)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: float(np.median(v[1:])) for k, v in times.items()}
    # Per round vj / plain (the two ran back to back, so a slow spell of the shared machine hits both), median.
    ratios = {
        what: float(np.median(np.divide(times[f"vj {what}"][1:], times[f"plain {what}"][1:])))
        for what in ("save", "restore")
    }
    print(
        f"state {total:.0f} MiB (params + Adam mu, nu) on {jax.device_count()} {jax.devices()[0].platform} "
        f"devices, {len(plan.leaves)} leaves in {len(plan.buckets)} buckets; median of {args.repeats}"
    )
    print("| | save s | save MiB/s | restore s | restore MiB/s |\n|---|---|---|---|---|")
    for who, label in (("vj", "vj.checkpoint.Manager (sharded, logical)"), ("plain", "plain Orbax, unsharded tree")):
        sv, rs = med[f"{who} save"], med[f"{who} restore"]
        print(f"| {label} | {sv:.2f} | {total / sv:.0f} | {rs:.2f} | {total / rs:.0f} |")
    first = ", ".join(f"{k} {v[0]:.2f} s" for k, v in times.items())
    print(
        f"ratio vj / plain (median of the rounds' ratios): save {ratios['save']:.2f}, restore {ratios['restore']:.2f}"
    )
    print(f"first, compiling round: {first}")
    return total, med, ratios


# ------------------------------------------------------------------------------------------------------ temp
def bench_temp(args) -> None:
    """Per-device XLA figures of every conversion executable (``compiled.memory_analysis()``), static."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    import numpy as np

    import vescale_jax as vj
    from vescale_jax.relayout import _logical_leaves as logical

    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    plan = vj.plan(shapes_of(args.model, args.mib), mesh, stacked=("blocks",))
    m = plan.num_devices
    share = sum(b.nbytes for b in plan.buckets) / m / MIB
    rows = [b.num_groups * m * b.layout.shard_size * np.dtype(b.dtype).itemsize for b in plan.buckets]
    print(
        f"model {share * m:.1f} MiB on {m} devices (share {share:.2f} MiB per device); bound: one layer of a "
        f"stacked bucket across all devices (a whole unstacked bucket), the largest: {max(rows) / MIB:.2f} MiB"
    )
    print("| bucket | layers | direction | calls | argument MiB | output MiB | alias MiB | temp MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for b, bucket in enumerate(plan.buckets):
        for name, build in (
            ("bucket -> logical", logical._out_executables),
            ("logical -> bucket", logical._in_executables),
        ):
            start, step = build(plan, b, bucket.dtype)[:2]
            calls = 1 if start is None else bucket.layers
            a = step.memory_analysis()
            print(
                f"| {bucket.name} | {bucket.layers or '-'} | {name} | {calls} | {a.argument_size_in_bytes / MIB:.2f} "
                f"| {a.output_size_in_bytes / MIB:.2f} | {a.alias_size_in_bytes / MIB:.2f} "
                f"| {a.temp_size_in_bytes / MIB:.3f} |"
            )


# ---------------------------------------------------------------------------------------------------- memory
def memory_worker(pid: int, n: int, port: int, devices: int, mib: float, directory: str) -> None:
    from vescale_jax import distributed

    distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=n,
        process_id=pid,
        local_device_count=devices,
        timeout_s=60,
    )
    import jax

    import vescale_jax as vj

    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    shapes = model_shapes(mib)
    plan = vj.plan(shapes, mesh, stacked=("blocks",))
    other = vj.plan(shapes, mesh, stacked=("blocks",), granularity=vj.rows(1))
    params = vj.init_sharded(init_fn(shapes), plan, jax.random.key(0))
    jax.block_until_ready(params)
    model = sum(b.nbytes for b in plan.buckets) / MIB
    mngr = vj.checkpoint.Manager(directory)
    # The first save includes compiling the conversion (as in a real job's first checkpoint).
    with PeakRSS() as save:
        mngr.save(1, params=params)
        mngr.wait()
    with PeakRSS() as convert:  # the bucket -> logical conversion alone (its output is one share)
        logical = vj.checkpoint.logical_tree(params)
        jax.block_until_ready(logical)
    with PeakRSS() as plain:  # baseline: plain Orbax writing the same, already evenly sharded, tree
        import orbax.checkpoint as ocp

        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(directory, "plain"), logical)
        ckptr.wait_until_finished()
    del params, logical
    with PeakRSS() as restore:
        restored = mngr.restore(params=other)
        jax.block_until_ready(restored.params)
    mngr.close()
    print(
        "RESULT "
        + json.dumps(
            {
                "process": pid,
                "model_mib": model,
                "share_mib": model / n,
                "save_increase_mib": save.increase_mib,
                "convert_increase_mib": convert.increase_mib,
                "plain_orbax_increase_mib": plain.increase_mib,
                "restore_increase_mib": restore.increase_mib,
                "rss_before_save_mib": save.base / MIB,
            }
        ),
        flush=True,
    )


def bench_memory(args) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = tempfile.mkdtemp(prefix="vj_ckpt_mem_")
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
    )
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "_memory_worker",
                str(i),
                str(args.processes),
                str(port),
                str(args.devices),
                str(args.mib),
                os.path.join(root, "ckpt"),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(args.processes)
    ]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=1200)
            results += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(root, ignore_errors=True)
    results.sort(key=lambda r: r["process"])
    m = results[0]
    print(
        f"model {m['model_mib']:.0f} MiB over {args.processes} processes x {args.devices} CPU devices: "
        f"share {m['share_mib']:.0f} MiB per process"
    )
    print(
        "| process | RSS before | vj save | of which: conversion alone | plain Orbax save of the converted tree "
        "| vj restore into rows(1) |\n|---|---|---|---|---|---|"
    )
    for r in results:
        cells = [
            f"{r[k]:.0f} MiB ({r[k] / r['share_mib']:.2f} x share)"
            for k in ("save_increase_mib", "convert_increase_mib", "plain_orbax_increase_mib", "restore_increase_mib")
        ]
        print(f"| {r['process']} | {r['rss_before_save_mib']:.0f} MiB | " + " | ".join(cells) + " |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_memory_worker":
        pid, n, port, devices, mib, directory = sys.argv[2:8]
        memory_worker(int(pid), int(n), int(port), int(devices), float(mib), directory)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    t = sub.add_parser("time")
    t.add_argument("--mib", type=float, default=600)
    t.add_argument("--repeats", type=int, default=3)
    t.add_argument("--bound", type=float, default=1.25, help="exit non-zero if vj / plain exceeds this (0: none)")
    t.add_argument("--model", choices=("all", *MODELS), default="stacked")
    tmp = sub.add_parser("temp")
    tmp.add_argument("--mib", type=float, default=64)
    tmp.add_argument("--model", choices=tuple(MODELS), default="stacked")
    mem = sub.add_parser("memory")
    mem.add_argument("--processes", type=int, default=4)
    mem.add_argument("--devices", type=int, default=2)
    mem.add_argument("--mib", type=float, default=256)
    args = p.parse_args()
    if args.what == "time":
        sys.exit(bench_time(args))
    bench_temp(args) if args.what == "temp" else bench_memory(args)


if __name__ == "__main__":
    main()
