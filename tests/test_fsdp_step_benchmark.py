"""benchmarks/fsdp_step.py's compile-time probe: a fresh process lowers and compiles one step and reports the
trace and compile seconds (wall and CPU) that the benchmark's ratio and bound are made of."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

BENCH = os.path.join(ROOT, "benchmarks", "fsdp_step.py")
TINY = ["--layers=2", "--d-model=32", "--heads=2", "--vocab=64", "--seq=8", "--batch=8"]


def probe(which):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    out = subprocess.run(
        [sys.executable, BENCH, *TINY, "--compile-probe", which], capture_output=True, text=True, env=env, check=True
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("COMPILE_PROBE "))
    return json.loads(line[len("COMPILE_PROBE ") :])


@pytest.mark.slow  # four fresh processes, each importing JAX and compiling a step
def test_compile_probe_reports_trace_and_compile_times_of_each_step():
    sys.path.insert(0, os.path.dirname(BENCH))
    import fsdp_step

    times = {which: probe(which) for which in ("vj.fsdp", "strong")}
    for t in times.values():
        assert set(t) == {"trace_s", "compile_s", "trace_cpu", "compile_cpu"}
        assert all(v > 0 for v in t.values()), t
    cpu, wall = fsdp_step.compile_ratios(times)
    want = (times["vj.fsdp"]["trace_cpu"] + times["vj.fsdp"]["compile_cpu"]) / (
        times["strong"]["trace_cpu"] + times["strong"]["compile_cpu"]
    )
    assert cpu == want and wall > 0
    text = "\n".join(fsdp_step.compile_lines(times, 1))
    assert f"{cpu:.2f} in CPU time" in text and "| vj.fsdp |" in text and "| strong |" in text
