"""benchmarks/gpu_check.sh --dry-run and benchmarks/gpu_step.py on CPU: every part runs, nothing lands in
benchmarks/results/ (which holds GPU measurements only)."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT, load_script

from vescale_jax.kernels import MeasuredTable

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")
RESULTS = Path(ROOT) / "benchmarks" / "results"


def dry_run(out: Path, parts: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER")}
    env.update(OUT=str(out), PARTS=parts, PYTHONPATH=ROOT)
    before = {p.name: p.stat().st_mtime for p in RESULTS.iterdir()}
    proc = subprocess.run(["bash", SCRIPT, "--dry-run"], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p.name: p.stat().st_mtime for p in RESULTS.iterdir()} == before, "the dry run wrote benchmarks/results/"
    summary = (out / "gpu_check_summary.txt").read_text()
    assert "DRY RUN" in summary
    assert "TIMED OUT" not in summary, summary
    return summary


def test_dry_run_env_and_tests_parts(tmp_path):
    summary = dry_run(tmp_path, "env,tests")
    assert "== env" in summary and "== tests" in summary and "== bench" not in summary
    assert summary.count("rc=0") == 2, summary
    assert "would run on GPU: JAX_PLATFORMS=cuda python -m pytest" in summary


@pytest.mark.slow
def test_dry_run_every_part(tmp_path):
    summary = dry_run(tmp_path, "env,tests,bench,steps,mosaic")
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
    assert "latency_hiding_scheduler=true" in rows[-1]["xla_flags"]
    md = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN on CPU" in md and md.count("| fsdp") == 4


def test_step_report_and_flops_formula(tmp_path):
    gs = load_script("benchmarks/gpu_step.py")
    cfg = gs.config("gpu")
    assert (cfg.d_model, cfg.num_layers, cfg.max_len) == (1024, 24, 1024)
    assert gs.model_flops(cfg, n_matmul=10, tokens=4, seq=1024) == 6 * 10 * 4 + 12 * 24 * 1024 * 1024 * 4
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
    jsonl = tmp_path / "steps.jsonl"
    jsonl.write_text(json.dumps(record) + "\n")
    gs.write_report(str(jsonl), str(tmp_path / "gpu.md"))
    assert "DRY RUN on CPU" in (tmp_path / "gpu.md").read_text()
    with pytest.raises(SystemExit, match="refusing to write CPU figures"):
        gs.write_report(str(jsonl), str(RESULTS / "gpu.md"))
    assert not (RESULTS / "gpu.md").exists() or "DRY RUN" not in (RESULTS / "gpu.md").read_text()
