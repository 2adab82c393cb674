"""vj.checkpoint.load_safetensors / save_safetensors across processes: 2 processes x 4 CPU devices on loopback against
1 process x 8 devices, on one Llama-format checkpoint (several files and an index), under an FSDP-only plan (an
8-device ``fsdp`` mesh) and a tensor-parallel one (a 2 x 4 ``("fsdp", "tensor")`` mesh, Megatron-style splits).

Under each plan, each process of the 2-process job reads about half of the file data (its own devices' ranges
only); both jobs load the same leaves bit for bit and save byte-identical files, equal to the checkpoint's tensors.
The checkpoint's dims give odd TP shards (15, 23, 31 and 7 rows or columns on 4 tensor ranks), whose ranges a
process must still read only once. Uses the fail-fast harness of tests/test_multihost.py.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from test_multihost import HARD_TIMEOUT_S, free_port, launch, run_workers
from test_safetensors import llama_tensors, read_all, write_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "safetensors_worker.py")


def job(n: int, devices: int, ckpt: str, out: str, start: float):
    port = free_port()
    args = lambda i: [str(i), str(n), str(port), str(devices), ckpt, out, "fsdp,tp"]
    return [launch(f"process {i} of {n}x{devices}", args(i), start, worker=WORKER) for i in range(n)]


def test_two_processes_read_their_half_and_match_one(tmp_path):
    tensors = llama_tensors(11, layers=2, h=60, i=92, v=124, kv=28)
    ckpt = write_checkpoint(tensors, tmp_path / "ckpt", num_files=3)
    start = time.monotonic()
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    run_workers(job(2, 4, ckpt, two, start) + job(1, 8, ckpt, one, start), start, HARD_TIMEOUT_S)
    total = sum(x.nbytes for x in tensors.values())
    for mode in ("fsdp", "tp"):
        got, want = np.load(f"{two}.{mode}.npz"), np.load(f"{one}.{mode}.npz")
        assert sorted(got.files) == sorted(want.files) and len(want.files) == 21, mode
        for k in want.files:
            assert got[k].tobytes() == want[k].tobytes(), (mode, k)
        for pid in (0, 1):
            stats = json.load(open(f"{two}.{mode}.p{pid}.json"))
            assert stats["data_bytes"] == total
            assert stats["bytes_read"] <= 0.55 * total, (mode, pid, stats)
        assert json.load(open(f"{one}.{mode}.p0.json"))["bytes_read"] >= total, mode
        saved_two, saved_one = sorted(os.listdir(f"{two}.{mode}.saved")), sorted(os.listdir(f"{one}.{mode}.saved"))
        assert saved_two == saved_one and len(saved_one) > 2, mode
        for name in saved_one:
            a = open(os.path.join(f"{two}.{mode}.saved", name), "rb").read()
            assert a == open(os.path.join(f"{one}.{mode}.saved", name), "rb").read(), (mode, name)
        saved = read_all(f"{one}.{mode}.saved")
        assert sorted(saved) == sorted(tensors), mode
        assert all(saved[k].tobytes() == x.tobytes() for k, x in tensors.items()), mode
