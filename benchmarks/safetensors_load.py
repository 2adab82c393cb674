"""Peak host memory of ``vj.checkpoint.load_safetensors`` per process, against each process's share of the bytes.

    python benchmarks/safetensors_load.py [--layers 20] [--processes 4] [--devices 2] [--max-shard-size 300MB]
                                          [--margin-mib 256] [--dir DIR]

Writes a random Llama-format checkpoint (f32, names and shapes as transformers' ``save_pretrained`` writes them;
hidden 1024, intermediate 2816, 8 KV heads of 128, vocab 32000: 20 layers are about 1.16 GB, in several files and
an index) into a temporary directory, then loads it with ``--processes`` processes x ``--devices`` CPU devices on
loopback (gloo) into the ``FlaxLlamaForCausalLM`` tree, ``vj.element()`` granularity. Each process resets its
peak resident set (``/proc/self/clear_refs`` "5") just before the load and reads ``VmHWM`` after it (arrays
ready); the increase over ``VmRSS`` before the load is its peak for the load, the loaded shards included. Prints a
table and exits non-zero when a process exceeds its share (the bytes it read) + ``--margin-mib``.
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
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIB = 2**20
H, FF, KV, V = 1024, 2816, 8 * 128, 32000


def tensor_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """A LlamaForCausalLM state dict's names and shapes (nn.Linear weights are (out, in))."""
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for j in range(layers):
        p = f"model.layers.{j}."
        shapes |= {
            p + "self_attn.q_proj.weight": (H, H),
            p + "self_attn.k_proj.weight": (KV, H),
            p + "self_attn.v_proj.weight": (KV, H),
            p + "self_attn.o_proj.weight": (H, H),
            p + "mlp.gate_proj.weight": (FF, H),
            p + "mlp.up_proj.weight": (FF, H),
            p + "mlp.down_proj.weight": (H, FF),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
    return shapes


def write_checkpoint(directory: str, layers: int, max_bytes: int) -> int:
    """Random f32 tensors in files of at most ``max_bytes`` and an index, with ``safetensors.numpy.save_file``."""
    import numpy as np
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    shapes = tensor_shapes(layers)
    groups, used = [[]], 0
    for name, shape in shapes.items():
        n = 4 * int(np.prod(shape))
        if groups[-1] and used + n > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += n
    weight_map, total = {}, 0
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        part = {name: rng.standard_normal(shapes[name], np.float32) for name in names}
        save_file(part, os.path.join(directory, fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, fname)
        total += sum(x.nbytes for x in part.values())
        del part
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(pid: int, n: int, port: int, devices: int, layers: int, directory: str) -> None:
    from vescale_jax import distributed

    distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=n, process_id=pid, local_device_count=devices
    )
    import jax
    import numpy as np

    import vescale_jax as vj

    tree = {"lm_head": {"kernel": (H, V)}, "model": {"embed_tokens": {"embedding": (V, H)}, "norm": {"weight": (H,)}}}
    for name, shape in tensor_shapes(layers).items():
        parts = name.split(".")
        if parts[1] != "layers":
            continue
        node = tree["model"].setdefault("layers", {}).setdefault(parts[2], {})
        for p in parts[3:-2]:
            node = node.setdefault(p, {})
        node[parts[-2]] = {"kernel": shape[::-1]} if len(shape) == 2 else {"weight": shape}
    tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32), tree, is_leaf=lambda x: isinstance(x, tuple))
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    plan = vj.plan(tree, mesh)
    stats: dict = {}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    sp = vj.checkpoint.load_safetensors(directory, plan, mapping=vj.checkpoint.llama_mapping(), stats=stats)
    jax.block_until_ready(sp.buffers)
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    local = sum(s.data.nbytes for b in sp.buffers for s in b.addressable_shards)
    result = {
        "process": pid,
        "rss_before_mib": before / MIB,
        "peak_increase_mib": (peak - before) / MIB,
        "read_mib": stats["bytes_read"] / MIB,
        "data_mib": stats["data_bytes"] / MIB,
        "shards_mib": local / MIB,
        "reads": stats["reads"],
        "seconds": seconds,
    }
    print("RESULT " + json.dumps(result), flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        pid, n, port, devices, layers = (int(x) for x in sys.argv[2:7])
        worker(pid, n, port, devices, layers, sys.argv[7])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--max-shard-size", type=int, default=300 * 10**6)
    ap.add_argument("--margin-mib", type=float, default=256)
    ap.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temporary directory)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="vj_st_", dir=args.dir)
    try:
        t0 = time.perf_counter()
        total = write_checkpoint(root, args.layers, args.max_shard_size)
        files = sorted(f for f in os.listdir(root) if f.endswith(".safetensors"))
        print(
            f"checkpoint: {total / 2**30:.2f} GiB in {len(files)} files + index ({args.layers} layers, f32), "
            f"written in {time.perf_counter() - t0:.0f} s"
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, JAX_PLATFORMS="cpu", OPENBLAS_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        env.pop("XLA_FLAGS", None)
        cmd = lambda i: [
            sys.executable,
            __file__,
            "_worker",
            *map(str, (i, args.processes, port, args.devices, args.layers)),
            root,
        ]
        procs = [subprocess.Popen(cmd(i), env=env, stdout=subprocess.PIPE, text=True) for i in range(args.processes)]
        results = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=1800)
                results += [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
                if p.returncode:
                    raise SystemExit(f"a worker exited with status {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results.sort(key=lambda r: r["process"])
    print(
        f"{args.processes} processes x {args.devices} CPU devices, vj.element(), limit: share (bytes read) + "
        f"{args.margin_mib:.0f} MiB\n"
    )
    print("| process | RSS before | bytes read (share) | its shards | peak RSS increase | over share | reads | time |")
    print("|---|---|---|---|---|---|---|---|")
    failed = []
    for r in results:
        over = r["peak_increase_mib"] - r["read_mib"]
        print(
            f"| {r['process']} | {r['rss_before_mib']:.0f} MiB | {r['read_mib']:.1f} MiB "
            f"({r['read_mib'] / r['data_mib']:.1%}) | {r['shards_mib']:.1f} MiB | {r['peak_increase_mib']:.1f} MiB "
            f"| {over:+.1f} MiB | {r['reads']:,} | {r['seconds']:.1f} s |"
        )
        if over > args.margin_mib:
            failed.append(r["process"])
    if len(results) != args.processes:
        raise SystemExit(f"only {len(results)} of {args.processes} processes reported")
    if failed:
        raise SystemExit(f"processes {failed} exceeded their share + {args.margin_mib:.0f} MiB")


if __name__ == "__main__":
    main()
