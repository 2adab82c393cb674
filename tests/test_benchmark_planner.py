"""benchmarks/planner.py --quick: every layout valid, padding within its gate, element() rows at the forced bound,
and a whole-model plan over its CPU-time limit fails the run (timing itself is not asserted)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "planner.py"


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *args],
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed limit
        check=False,
    )


def table_rows(stdout: str) -> list[list[str]]:
    """The cells of every data row of the printed table."""
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| model")
    ]


def test_planner_benchmark_quick() -> None:
    proc = run_benchmark("--no-time-gate")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = table_rows(proc.stdout)
    configs = {(r[0], r[1], r[2]) for r in rows}
    for model in ("llama3-70b", "deepseek-v3", "gpt-oss-120b"):
        for m in ("8", "256"):
            for gran in ("element()", "rows(1)", "rows(16)"):
                assert (model, m, gran) in configs
    assert len(rows) == len(configs) == 18
    assert "plan CPU time (ms)" in proc.stdout
    # element(): S = ceil(numel/m) rounded up to the alignment for every bucket, which is the forced bound itself
    element = [r for r in rows if r[2] == "element()"]
    assert element and all(r[4] == r[5] for r in element), element


def test_planner_benchmark_fails_over_its_cpu_time_limit() -> None:
    proc = run_benchmark("--models", "gpt-oss-120b", "--time-limit", "0")
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "FAIL: gpt-oss-120b m=8 element(): plan CPU time" in proc.stderr
    assert "FAIL CPU time > 0 s" in proc.stdout
    generous = run_benchmark("--models", "gpt-oss-120b", "--time-limit", "1000")
    assert generous.returncode == 0, f"stdout:\n{generous.stdout}\nstderr:\n{generous.stderr}"
