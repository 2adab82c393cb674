"""benchmarks/gpu_check.sh --dry-run and benchmarks/gpu_step.py on CPU: every part runs, nothing lands in
benchmarks/results/ (which holds GPU measurements only)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, load_script

from vescale_jax.kernels import MeasuredTable

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
RESULTS = Path(ROOT) / "benchmarks" / "results"


# What the script runs on this machine's PATH; the interpreter comes as `python3` only, as on the GPU image.
TOOLS = ("bash", "cat", "cp", "cut", "date", "dirname", "env", "head", "mkdir", "mktemp", "sed", "sh", "tail", "tee")
TOOLS += ("timeout", "xargs")


def bare_path(tmp: Path) -> str:
    """A PATH as on the GPU image: the shell tools, ``python3`` for an interpreter that imports jax, no
    ``python``."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} is not on this machine's PATH"
        (bin_dir / tool).symlink_to(found)
    wrapper = bin_dir / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    assert shutil.which("python", path=str(bin_dir)) is None
    return str(bin_dir)


def dry_run(out: Path, parts: str) -> str:
    """The dry run as the GPU machine would start it: XLA_FLAGS unset, no ``python`` on PATH; every part run to
    its end (GPU_CHECK_CAPS=0: no timeouts to race on a loaded machine)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER", "PYTHON")}
    env.update(OUT=str(out), PARTS=parts, PYTHONPATH=ROOT, PATH=bare_path(out), GPU_CHECK_CAPS="0")
    before = {p.name: p.stat().st_mtime for p in RESULTS.iterdir()}
    proc = subprocess.run(["bash", SCRIPT, "--dry-run"], env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p.name: p.stat().st_mtime for p in RESULTS.iterdir()} == before, "the dry run wrote benchmarks/results/"
    summary = (out / "gpu_check_summary.txt").read_text()
    assert "DRY RUN" in summary and "no timeout: GPU_CHECK_CAPS=0" in summary
    assert "python: " + str(out / "bin" / "python3") in summary and "XLA_FLAGS: (unset)" in summary, summary
    return summary


def test_dry_run_env_and_tests_parts(tmp_path):
    summary = dry_run(tmp_path, "env,tests")
    assert "== env" in summary and "== tests" in summary and "== bench" not in summary
    assert summary.count("rc=0") == 2, summary
    assert "would run on GPU: JAX_PLATFORMS=cuda " in summary and " -m pytest" in summary
    env_log = (tmp_path / "env.log").read_text()
    assert "jax " in env_log and "CpuDevice" in env_log, env_log
    tests_log = (tmp_path / "tests.log").read_text()
    assert re.search(r"\d+ passed", tests_log) and "failed" not in tests_log, tests_log


def test_a_blank_xla_flags_is_not_passed_on(tmp_path):
    """XLA aborts at start on a blank XLA_FLAGS; the script passes it on only when it holds flags."""
    script = Path(SCRIPT).read_text()
    assert 'XLA_FLAGS="$BASE_FLAGS $5"' not in script
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env.update(XLA_FLAGS="  ", OUT=str(tmp_path), PARTS="env", PYTHONPATH=ROOT, GPU_CHECK_CAPS="0")
    proc = subprocess.run(["bash", SCRIPT, "--dry-run"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (tmp_path / "gpu_check_summary.txt").read_text()
    assert "rc=0" in summary and "XLA_FLAGS: (unset)" not in summary, summary
    assert "Could not open file" not in (tmp_path / "env.log").read_text()


@pytest.mark.slow
def test_dry_run_every_part(tmp_path):
    summary = dry_run(tmp_path, "env,tests,bench,steps,triton")
    assert "rc=" in summary and all(f"rc={rc}" not in summary for rc in range(1, 256)), summary
    table = MeasuredTable.from_json(tmp_path / "kernels_measured.json")
    assert table.records and {r.device_kind for r in table.records} == {"cpu"}
    rows = [json.loads(line) for line in (tmp_path / "gpu_steps.jsonl").read_text().splitlines()]
    assert [(r["variant"], r["label"]) for r in rows] == [
        ("jit", ""),
        ("fsdp", ""),
        ("fsdp_fp8", ""),
        ("fsdp_adam8bit", ""),
        ("fsdp", "lhs"),
    ]
    assert "latency_hiding_scheduler=true" in rows[-1]["xla_flags"], rows
    md = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN on CPU" in md and md.count("| fsdp") == 4


def test_step_report_and_flops_formula(tmp_path):
    gs = load_script("benchmarks/gpu_step.py")
    cfg = gs.config("gpu")
    assert (cfg.d_model, cfg.num_layers, cfg.max_len, cfg.attention, cfg.remat) == (2048, 16, 2048, "dot_product", True)
    causal = gs.model_flops(cfg, n_matmul=10, tokens=4, seq=2048)
    assert causal == 6 * 10 * 4 + 6 * 16 * 2048 * 2048 * 4
    assert gs.model_flops(cfg, n_matmul=10, tokens=4, seq=2048, causal=False) == 6 * 10 * 4 + 12 * 16 * 2048 * 2048 * 4
    record = {
        "variant": "fsdp",
        "label": "",
        "platform": "cpu",
        "device_kind": "cpu",
        "devices": 2,
        "jax": "0",
        "config": "tiny",
        "params": 1e5,
        "matmul_params": 9e4,
        "batch": 4,
        "seq": 64,
        "timed_steps": 3,
        "peak_tflops": 989.0,
        "flops_formula": gs.FLOPS_FORMULA,
        "model_flops_per_step": 1e9,
        "step_ms": 10.0,
        "tokens_per_s": 25600.0,
        "mfu": 1e-4,
        "peak_bytes_in_use": None,
        "first_call_s": 1.0,
        "first_loss": 5.5,
        "last_loss": 5.4,
    }
    jit = dict(record, variant="jit", mfu=0.36, tokens_per_s=25000.0, peak_bytes_in_use=2**30)
    slow = dict(record, tokens_per_s=24000.0, peak_bytes_in_use=2**30)  # 0.96 x jit's tokens/s
    jsonl = tmp_path / "steps.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in (jit, record, slow)))
    gs.write_report(str(jsonl), str(tmp_path / "gpu.md"))
    md = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN on CPU" in md
    assert "jit (default): MFU 36.0 % (goal ≥ 35 %): met" in md
    assert "fsdp (default): 1.024 × jit's tokens/s (goal ≥ 0.97), - × its peak (goal ≤ 1.05): met" in md
    assert "fsdp (default): 0.960 × jit's tokens/s (goal ≥ 0.97), 1.000 × its peak (goal ≤ 1.05): NOT met" in md
    with pytest.raises(SystemExit, match="refusing to write CPU figures"):
        gs.write_report(str(jsonl), str(RESULTS / "gpu.md"))
    assert not (RESULTS / "gpu.md").exists() or "DRY RUN" not in (RESULTS / "gpu.md").read_text()
