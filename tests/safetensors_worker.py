"""One process of a multi-process safetensors job (launched by tests/test_safetensors_multihost.py).

    python tests/safetensors_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS CKPT OUT_PREFIX [MODES]

For each mode of ``MODES`` (comma-separated, default ``fsdp``): plans a small FlaxLlamaForCausalLM-shaped tree
(sizes from CKPT's headers) over every process's devices (``fsdp``: a 1-D ``fsdp`` mesh; ``tp``: a 2 x 4
``("fsdp", "tensor")`` mesh with Megatron-style splits, :func:`llama_tp_rule`), loads CKPT with
``vj.checkpoint.load_safetensors`` (writing this process's read statistics to ``OUT_PREFIX.MODE.p<PROCESS_ID>.json``),
writes the logical leaves to ``OUT_PREFIX.MODE.npz`` (process 0), then saves them with
``vj.checkpoint.save_safetensors`` into the directory ``OUT_PREFIX.MODE.saved``.
"""

from __future__ import annotations

import json
import sys

import jax

from vescale_jax import distributed

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py


def abstract_llama(ckpt: str):
    """The FlaxLlamaForCausalLM params tree of a Llama checkpoint, as ShapeDtypeStructs (kernels (in, out))."""
    import numpy as np

    from vescale_jax.checkpoint import _safetensors_files as files

    tree: dict = {}
    for name, info in files.open_checkpoint(ckpt).tensors.items():
        parts = name.split(".")
        if parts[-1] != "weight":
            continue
        if name == "model.embed_tokens.weight":
            path, shape = ["model", "embed_tokens", "embedding"], info.shape
        elif len(info.shape) == 2:
            path, shape = [*parts[:-1], "kernel"], info.shape[::-1]
        else:
            path, shape = parts, info.shape
        node = tree
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = jax.ShapeDtypeStruct(tuple(shape), np.dtype(info.dtype))
    return tree


def llama_tp_rule(path, leaf):
    """Megatron-style splits of a FlaxLlamaForCausalLM tree over ``"tensor"``: q/k/v/gate/up kernels and the head
    column-parallel, o/down kernels and the embedding row-parallel (vocab-parallel), norms replicated."""
    from jax.sharding import PartitionSpec as P

    import vescale_jax as vj

    name = vj.plan_path(path)
    if name.endswith(("q_proj/kernel", "k_proj/kernel", "v_proj/kernel", "gate_proj/kernel", "up_proj/kernel")):
        return P(None, "tensor")
    if name.startswith("lm_head"):
        return P(None, "tensor")
    if name.endswith(("o_proj/kernel", "down_proj/kernel", "embed_tokens/embedding")):
        return P("tensor", None)
    return None


def run_mode(mode: str, pid: int, ckpt: str, out: str) -> None:
    """One load and save under the plan of ``mode`` (``"fsdp"`` or ``"tp"``), its results under ``out.mode``."""
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import vescale_jax as vj

    if mode == "tp":
        mesh = jax.make_mesh((jax.device_count() // 4, 4), ("fsdp", "tensor"))
        plan = vj.plan(abstract_llama(ckpt), mesh, tp=llama_tp_rule)
        assert any(b.groups for b in plan.buckets)
    else:
        mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
        plan = vj.plan(abstract_llama(ckpt), mesh)
    prefix = f"{out}.{mode}"
    stats: dict = {}
    sp = vj.checkpoint.load_safetensors(ckpt, plan, mapping=vj.checkpoint.llama_mapping(), stats=stats)
    with open(f"{prefix}.p{pid}.json", "w") as f:
        json.dump(stats, f)
    gather = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))  # tests only
    flat, _ = jax.tree_util.tree_flatten_with_path(vj.unshard(sp))
    arrays = {jax.tree_util.keystr(path): np.asarray(gather(x)) for path, x in flat}
    if pid == 0:
        np.savez(f"{prefix}.npz", **arrays)
    vj.checkpoint.save_safetensors(sp, f"{prefix}.saved", mapping=vj.checkpoint.llama_mapping(), max_shard_size="40KB")
    print(f"[p{pid}] {mode}: read {stats['bytes_read']} of {stats['data_bytes']} bytes on {jax.device_count()} devices")


def main() -> None:
    pid, n, port, devices, ckpt, out = sys.argv[1:7]
    modes = sys.argv[7].split(",") if len(sys.argv) > 7 else ["fsdp"]
    pid, n, devices = int(pid), int(n), int(devices)
    if n > 1:
        assert distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=n,
            process_id=pid,
            local_device_count=devices,
            timeout_s=120,
            heartbeat_timeout_s=30,
        )
    else:
        jax.config.update("jax_num_cpu_devices", devices)
    for mode in modes:
        run_mode(mode, pid, ckpt, out)


if __name__ == "__main__":
    main()
