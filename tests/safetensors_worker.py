"""One process of a multi-process safetensors job (launched by tests/test_safetensors_multihost.py).

    python tests/safetensors_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS CKPT OUT_PREFIX

Plans a small FlaxLlamaForCausalLM-shaped tree (sizes from CKPT's headers) over every process's devices, loads
CKPT with ``vj.checkpoint.load_safetensors`` (writing this process's read statistics to
``OUT_PREFIX.p<PROCESS_ID>.json``), writes the logical leaves to ``OUT_PREFIX.npz`` (process 0), then saves them
with ``vj.checkpoint.save_safetensors`` into the directory ``OUT_PREFIX.saved``.
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


def main() -> None:
    pid, n, port, devices, ckpt, out = sys.argv[1:7]
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
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import vescale_jax as vj

    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    plan = vj.plan(abstract_llama(ckpt), mesh)
    stats: dict = {}
    sp = vj.checkpoint.load_safetensors(ckpt, plan, mapping=vj.checkpoint.llama_mapping(), stats=stats)
    with open(f"{out}.p{pid}.json", "w") as f:
        json.dump(stats, f)
    gather = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))  # tests only
    flat, _ = jax.tree_util.tree_flatten_with_path(vj.unshard(sp))
    arrays = {jax.tree_util.keystr(path): np.asarray(gather(x)) for path, x in flat}
    if pid == 0:
        np.savez(f"{out}.npz", **arrays)
    vj.checkpoint.save_safetensors(sp, f"{out}.saved", mapping=vj.checkpoint.llama_mapping(), max_shard_size="40KB")
    print(f"[p{pid}] read {stats['bytes_read']} of {stats['data_bytes']} bytes on {jax.device_count()} devices")


if __name__ == "__main__":
    main()
