"""benchmarks/planner.py --quick: every layout valid and padding within its gate (timing is not asserted)."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "planner.py"


def test_planner_benchmark_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--no-time-gate"],
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard, not a speed limit
        check=False,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "| llama3-70b | 8 | rows(1) |" in proc.stdout
