"""tools/pin_drift.py's pure parts: constraints and ``pip freeze`` parsing, the version diff, the JUnit reading and
the rendered constraints file and report. No venv, no network, no pytest run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_SPEC = importlib.util.spec_from_file_location("pin_drift", ROOT / "tools" / "pin_drift.py")
pin_drift = importlib.util.module_from_spec(_SPEC)
sys.modules["pin_drift"] = pin_drift  # dataclasses look their module up
_SPEC.loader.exec_module(pin_drift)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites name="pytest tests"><testsuite name="pytest" errors="2" failures="2" skipped="1" tests="7" time="12.5">
<testcase classname="tests.test_planner" name="test_ok" time="0.1" />
<testcase classname="tests.test_planner" name="test_param[m3-rows(4)]" time="0.1" />
<testcase classname="tests.test_plan" name="test_assert[m8]" time="0.2">
  <failure message="AssertionError: offsets differ&#10;assert 3 == 4">def test_assert():
&gt;       assert 3 == 4
E       AssertionError: offsets differ
E       assert 3 == 4</failure></testcase>
<testcase classname="tests.test_flax.TestNNX" name="test_raises" time="0.3">
  <failure message="">Traceback
E   TypeError: unhashable type: 'dict'
tests/test_flax.py:12: TypeError</failure></testcase>
<testcase classname="tests.test_ckpt" name="test_setup" time="0.0">
  <error message='failed on setup with "ValueError: no mesh"'>E   ValueError: no mesh</error></testcase>
<testcase classname="" name="tests.test_broken" time="0.0">
  <error message="collection failure">ImportError while importing test module
E   ModuleNotFoundError: No module named 'flax.linen.gone'</error></testcase>
<testcase classname="tests.test_gpu" name="test_cuda" time="0.0">
  <skipped type="pytest.skip" message="no GPU">skipped</skipped></testcase>
</testsuite></testsuites>
"""


def test_parse_constraints_reads_pins_and_skips_comments_options_and_markers():
    text = """# header
    # indented comment

-c other.txt
jax==0.12.1
Orbax_Checkpoint == 0.12.8   # a trailing comment
numpy==2.5.5 ; python_version >= "3.12"
flax[all]==0.12.12
ruff>=0.17.6
"""
    assert pin_drift.parse_constraints(text) == {
        "jax": "0.12.1",
        "Orbax_Checkpoint": "0.12.8",
        "numpy": "2.5.5",
        "flax": "0.12.12",
        "ruff": ">=0.17.6",
    }


def test_parse_freeze_leaves_out_the_project_editables_and_installer_tools():
    text = """absl-py==2.5.1
# Editable Git install with no remote (vescale_jax==0.1.0)
-e /work/main
vescale-jax==0.1.0
pip==26.3
setuptools==80.0
wheel==0.45
jax==0.12.1
mything @ file:///tmp/mything-1.0-py3-none-any.whl
"""
    pins, unpinnable = pin_drift.parse_freeze(text)
    assert pins == {"absl-py": "2.5.1", "jax": "0.12.1"}
    assert unpinnable == ["mything @ file:///tmp/mything-1.0-py3-none-any.whl"]


def test_diff_versions_names_changed_added_and_removed_packages_by_normalised_name():
    old = {"jax": "0.12.0", "Orbax_Checkpoint": "0.12.8", "gone": "1.0", "numpy": "2.5.5"}
    new = {"jax": "0.12.1", "orbax-checkpoint": "0.12.8", "numpy": "2.5.5", "new-dep": "0.3"}
    changes = pin_drift.diff_versions(old, new)
    assert [(c.name, c.old, c.new, c.kind) for c in changes] == [
        ("gone", "1.0", None, "removed"),
        ("jax", "0.12.0", "0.12.1", "changed"),
        ("new-dep", None, "0.3", "added"),
    ]
    assert pin_drift.diff_versions(new, new) == []


def test_node_id_rebuilds_pytest_ids_from_junit_classnames():
    assert pin_drift.node_id("tests.test_plan", "test_x[m3-*]") == "tests/test_plan.py::test_x[m3-*]"
    assert pin_drift.node_id("tests.test_flax.TestNNX", "test_y") == "tests/test_flax.py::TestNNX::test_y"
    assert pin_drift.node_id("", "tests.test_broken") == "tests/test_broken.py"
    assert pin_drift.node_id("", "weird name[x]") == "weird name[x]"


def test_read_junit_counts_and_gives_each_failure_its_first_error_line():
    r = pin_drift.read_junit(JUNIT)
    assert (r.passed, r.failed, r.errors, r.skipped, r.total) == (2, 2, 2, 1, 7)
    assert r.seconds == 12.5
    assert [(f.test, f.kind, f.first_line) for f in r.failures] == [
        ("tests/test_plan.py::test_assert[m8]", "failure", "AssertionError: offsets differ"),
        ("tests/test_flax.py::TestNNX::test_raises", "failure", "TypeError: unhashable type: 'dict'"),
        ("tests/test_ckpt.py::test_setup", "error", 'failed on setup with "ValueError: no mesh"'),
        ("tests/test_broken.py", "error", "ModuleNotFoundError: No module named 'flax.linen.gone'"),
    ]


def test_read_junit_accepts_a_bare_testsuite_root():
    xml = '<testsuite time="1.0"><testcase classname="tests.test_a" name="test_b"/></testsuite>'
    r = pin_drift.read_junit(xml)
    assert (r.passed, r.total, r.failures) == (1, 1, [])


def test_first_error_line_falls_back_to_the_traceback():
    assert pin_drift.first_error_line(None, "line 1\nsomething broke\n\n") == "something broke"
    assert pin_drift.first_error_line("", "") == "(no message)"


def test_render_constraints_round_trips_through_parse_constraints():
    pins = {"numpy": "2.5.5", "Jax": "0.12.1", "absl-py": "2.5.1"}
    text = pin_drift.render_constraints(pins, ["Generated by `python3 tools/pin_drift.py --write`", ""])
    assert text.splitlines() == [
        "# Generated by `python3 tools/pin_drift.py --write`",
        "#",
        "absl-py==2.5.1",
        "Jax==0.12.1",
        "numpy==2.5.5",
    ]
    assert pin_drift.parse_constraints(text) == pins


def test_report_lists_the_moved_versions_the_counts_and_each_failure():
    report = pin_drift.format_report(
        python_version="3.13.0",
        constraints="constraints/newest.txt",
        pinned={"jax": "0.12.0", "gone": "1.0", "numpy": "2.5.5"},
        installed={"jax": "0.12.1", "numpy": "2.5.5", "new-dep": "0.3"},
        results=pin_drift.read_junit(JUNIT),
        pytest_status=1,
    )
    lines = report.splitlines()
    assert lines[0] == "pin drift: Python 3.13.0, newest releases against constraints/newest.txt (3 pins)"
    assert lines[1] == "versions (3 moved, 1 unchanged):"
    assert lines[2:5] == [
        "  gone        1.0 -> -  (removed)",
        "  jax      0.12.0 -> 0.12.1",
        "  new-dep       - -> 0.3  (added)",
    ]
    assert lines[5].startswith('  moved: jax, which README.md\'s "Tested versions" names')
    assert lines[6] == "tests: 2 passed, 2 failed, 2 errors, 1 skipped in 12.5 s (pytest exit status 1)"
    assert "  FAILED tests/test_plan.py::test_assert[m8]: AssertionError: offsets differ" in lines
    assert "  ERROR  tests/test_broken.py: ModuleNotFoundError: No module named 'flax.linen.gone'" in lines


def test_passed_needs_status_zero_and_no_failure():
    clean = pin_drift.read_junit('<testsuite><testcase classname="tests.t" name="test_a"/></testsuite>')
    assert pin_drift.passed(clean, 0)
    assert not pin_drift.passed(clean, 5)  # no tests collected
    assert not pin_drift.passed(None, 0)
    assert not pin_drift.passed(pin_drift.read_junit(JUNIT), 0)
    report = pin_drift.format_report(
        python_version="3.13.0",
        constraints="c.txt",
        pinned={"a": "1"},
        installed={"a": "1"},
        results=None,
        pytest_status=4,
    )
    assert "versions: all 1 as pinned" in report and "no JUnit report (pytest exit status 4)" in report


def test_help_answers_without_building_anything():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "pin_drift.py"), "--help"], capture_output=True, text=True, check=True
    )
    assert "--write" in out.stdout and "--pytest-args" in out.stdout and "constraints/newest.txt" in out.stdout
