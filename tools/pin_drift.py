#!/usr/bin/env python3
"""What would change if the pins moved to the newest releases: a scratch environment, the fast tier, a report.

Moving the pins is one command. This script builds a scratch virtual environment with a Python 3.13 (the newest
line of ``constraints/newest.txt``), installs the project there with its test and examples extras (what the
constraints files cover) *without* the constraints file (so pip resolves the newest releases), runs the fast tier
(``python -m pytest -m fast``, with DeprecationWarnings raised from vescale_jax's own modules made errors, as CI
runs the newest line) and prints what changed:

- every package whose version differs from the constraints file (old -> new, added, removed), and a reminder when
  JAX / Flax / Optax / Orbax moved: README.md's "Tested versions" names them (tests/test_packaging.py checks it);
- the pass / fail counts;
- each test that failed, with its first error line (read from pytest's JUnit XML).

It exits 0 when every test passed and 1 otherwise. With ``--write``, and only when every test passed, it rewrites
the constraints file from the scratch environment's ``pip freeze`` (the project itself, editable installs and
pip / setuptools / wheel left out), under a header saying how and when it was generated.

    python3 tools/pin_drift.py                                    # report only
    python3 tools/pin_drift.py --write                            # report, and move the pins if all passes
    python3 tools/pin_drift.py --pytest-args=tests/test_planner.py   # a smaller selection (still -m fast)
    python3 tools/pin_drift.py --python python3 --constraints constraints/py311.txt   # the Python 3.11 line

The scratch environment is ``~/.cache/vescale_jax/pin-drift`` by default and is reused between runs (pip then only
upgrades what changed; packages the project no longer needs are uninstalled before the freeze); ``--fresh``
recreates it, ``--venv DIR`` puts it elsewhere. The machine's pip configuration (indexes, caches) is kept, except
that ``PIP_CONSTRAINT`` is removed from the install's environment. Standard library only.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "vescale_jax"
DEFAULT_CONSTRAINTS = "constraints/newest.txt"
DEFAULT_VENV = Path.home() / ".cache" / "vescale_jax" / "pin-drift"
# Never pinned: the installer's own tools (a venv brings its own) and the project itself.
UNPINNED = frozenset({"pip", "setuptools", "wheel", "distribute"})
# How .ci/run runs the fast tier of the newest line.
DEPRECATION_FILTER = "filterwarnings=error::DeprecationWarning:vescale_jax.*"
# The versions README.md's "Tested versions" names (tests/test_packaging.py checks them against the files).
HEADLINE = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint")
_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$")


def normalise(name: str) -> str:
    """The PEP 503 form of a distribution name: ``Orbax_Checkpoint`` -> ``orbax-checkpoint``."""
    return re.sub(r"[-_.]+", "-", name).lower()


# ---------------------------------------------------------------------------------------------------- pure parts


def parse_constraints(text: str) -> dict[str, str]:
    """``{name: version}`` of a constraints file's ``name==version`` lines.

    Comments (``#`` at the start of a line or after whitespace), blank lines and option lines (``-c``, ``-r``,
    ...) are skipped; a trailing environment marker (``; python_version < "3.12"``) is dropped. A line with
    another specifier (``name>=1.2``) keeps the specifier as its "version", so a diff shows it.
    """
    pins: dict[str, str] = {}
    for raw in text.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line or line.startswith("-"):
            continue
        line = line.split(";", 1)[0].strip()
        m = _NAME.match(line)
        if not m:
            continue
        spec = m.group(2).strip()
        pins[m.group(1)] = spec[2:].strip() if spec.startswith("==") and not spec.startswith("===") else spec
    return pins


def parse_freeze(text: str, exclude: Iterable[str] = (PROJECT,)) -> tuple[dict[str, str], list[str]]:
    """``({name: version}, unpinnable lines)`` of ``pip freeze`` output.

    Editable installs (``-e ...``) and their comment lines, the names in ``exclude`` and pip / setuptools / wheel
    are left out; a direct reference (``name @ file:///...``) cannot be written as ``name==version`` and is
    returned among the unpinnable lines instead.
    """
    skip = {normalise(n) for n in (*exclude, *UNPINNED)}
    pins: dict[str, str] = {}
    unpinnable: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = _NAME.match(line)
        if not m or normalise(m.group(1)) in skip:
            continue
        spec = m.group(2).strip()
        if spec.startswith("==") and not spec.startswith("==="):
            pins[m.group(1)] = spec[2:].strip()
        else:
            unpinnable.append(line)
    return pins, unpinnable


@dataclass(frozen=True)
class Change:
    """One package whose pin moves: ``old`` is None when added, ``new`` None when removed."""

    name: str
    old: str | None
    new: str | None

    @property
    def kind(self) -> str:
        return "added" if self.old is None else "removed" if self.new is None else "changed"


def diff_versions(old: Mapping[str, str], new: Mapping[str, str]) -> list[Change]:
    """Packages whose version differs between two ``{name: version}`` maps (names compared in PEP 503 form;
    the new name's spelling wins), sorted by name."""
    old_n = {normalise(k): (k, v) for k, v in old.items()}
    new_n = {normalise(k): (k, v) for k, v in new.items()}
    changes = []
    for key in sorted(old_n.keys() | new_n.keys()):
        o, n = old_n.get(key), new_n.get(key)
        if o is None or n is None or o[1] != n[1]:
            changes.append(Change((n or o)[0], o and o[1], n and n[1]))
    return changes


@dataclass(frozen=True)
class Failure:
    """A failed test (or a test whose setup / teardown failed, or a file that failed to collect)."""

    test: str
    kind: str  # "failure" or "error"
    first_line: str


@dataclass
class RunResults:
    """Counts and failures read from a JUnit XML file."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    failures: list[Failure] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.errors + self.skipped


def node_id(classname: str, name: str) -> str:
    """A pytest node id from a JUnit ``classname`` / ``name`` pair: ``tests.test_x.TestA`` + ``test_b[m3]`` ->
    ``tests/test_x.py::TestA::test_b[m3]`` (the module ends before the first capitalised part); a collection
    error's ``""`` / ``tests.test_x`` -> ``tests/test_x.py``."""
    parts = [p for p in classname.split(".") if p]
    if not parts:  # a collection error names the module: tests.test_x -> tests/test_x.py
        return name.replace(".", "/") + ".py" if re.fullmatch(r"\w+(\.\w+)*", name) else name
    split = next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts))
    module, classes = parts[:split], parts[split:]
    if not module:
        return "::".join([*classes, name])
    return "::".join(["/".join(module) + ".py", *classes, name])


def first_error_line(message: str | None, text: str | None) -> str:
    """The line that says what went wrong: the first line of the failure's ``message`` (pytest puts the crash
    message there: ``AssertionError: assert 1 == 2``), else the first ``E   `` line of its traceback, else the
    traceback's last non-empty line."""
    generic = {"", "collection failure"}
    if message and message.strip() not in generic:
        return next(line.strip() for line in message.strip().splitlines() if line.strip())
    lines = (text or "").splitlines()
    for line in lines:
        if line.startswith("E ") and line[1:].strip():
            return line[1:].strip()
    rest = [line.strip() for line in lines if line.strip()]
    return rest[-1] if rest else (message or "").strip() or "(no message)"


def read_junit(xml_text: str) -> RunResults:
    """Counts and failures of a pytest ``--junitxml`` report (one or several ``testsuite`` elements)."""
    root = ET.fromstring(xml_text)
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    results = RunResults()
    for suite in suites:
        results.seconds += float(suite.get("time", 0) or 0)
        for case in suite.iter("testcase"):
            test = node_id(case.get("classname", ""), case.get("name", ""))
            bad = [child for child in case if child.tag in ("failure", "error")]
            if bad:
                first = bad[0]
                kind = "failure" if any(c.tag == "failure" for c in bad) else "error"
                if kind == "failure":
                    results.failed += 1
                else:
                    results.errors += 1
                results.failures.append(Failure(test, kind, first_error_line(first.get("message"), first.text)))
            elif case.find("skipped") is not None:
                results.skipped += 1
            else:
                results.passed += 1
    return results


def render_constraints(pins: Mapping[str, str], header: Sequence[str]) -> str:
    """A constraints file: the header as ``#`` comments, then one ``name==version`` a line, sorted by name."""
    lines = [f"# {h}".rstrip() for h in header]
    lines += [f"{name}=={pins[name]}" for name in sorted(pins, key=normalise)]
    return "\n".join(lines) + "\n"


def format_report(
    *,
    python_version: str,
    constraints: str,
    pinned: Mapping[str, str],
    installed: Mapping[str, str],
    results: RunResults | None,
    pytest_status: int | None,
) -> str:
    """The printed report: the versions that moved, the counts, each failed test with its first error line."""
    out = [f"pin drift: Python {python_version}, newest releases against {constraints} ({len(pinned)} pins)"]
    changes = diff_versions(pinned, installed)
    if changes:
        width = max(len(c.name) for c in changes)
        vwidth = max(len(c.old or "-") for c in changes)
        unchanged = len(installed) - sum(c.new is not None for c in changes)
        out.append(f"versions ({len(changes)} moved, {unchanged} unchanged):")
        for c in changes:
            note = "" if c.kind == "changed" else f"  ({c.kind})"
            out.append(f"  {c.name:<{width}}  {c.old or '-':>{vwidth}} -> {c.new or '-'}{note}")
        headline = [c.name for c in changes if normalise(c.name) in HEADLINE]
        if headline:
            out.append(
                f'  moved: {", ".join(headline)}, which README.md\'s "Tested versions" names (tests/test_packaging.py '
                "checks them against the constraints files): update it with the pins"
            )
    else:
        out.append(f"versions: all {len(installed)} as pinned")
    if results is None:
        out.append(f"tests: no JUnit report (pytest exit status {pytest_status}): see pytest's output above")
    else:
        out.append(
            f"tests: {results.passed} passed, {results.failed} failed, {results.errors} errors, "
            f"{results.skipped} skipped in {results.seconds:.1f} s (pytest exit status {pytest_status})"
        )
        for f in results.failures:
            out.append(f"  {'FAILED' if f.kind == 'failure' else 'ERROR '} {f.test}: {f.first_line}")
    return "\n".join(out)


def passed(results: RunResults | None, pytest_status: int | None) -> bool:
    """Everything passed: pytest exited 0 (so at least one test ran) and the report holds no failure."""
    return pytest_status == 0 and results is not None and not results.failures


# ------------------------------------------------------------------------------------------- the environment


# Run inside the scratch venv: the installed distributions that the project with its extras needs (the
# transitive closure of its requirements, markers evaluated for each extra asked for). Uses `packaging`, which
# pytest depends on.
_CLOSURE = r"""
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as canon

project, extras = sys.argv[1], sys.argv[2:]
todo, seen = [(project, frozenset(extras))], set()
while todo:
    name, wanted = todo.pop()
    key = (canon(name), wanted)
    if key in seen:
        continue
    seen.add(key)
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
            todo.append((req.name, frozenset(req.extras)))
print(json.dumps(sorted({name for name, _ in seen})))
"""


def log(message: str) -> None:
    print(f"pin-drift: {message}", file=sys.stderr, flush=True)


def find_python313() -> str | None:
    """A usable Python 3.13, looked for as ``../shared/tools/newjax-env.sh`` does: ``$NEWJAX_PYTHON``,
    ``python3.13`` on PATH, a pyenv 3.13.x, then the one newjax-env.sh built under ``~/.cache/newjax``."""
    home = Path.home()
    candidates = [os.environ.get("NEWJAX_PYTHON"), shutil.which("python3.13")]
    candidates += sorted(glob.glob(str(home / ".pyenv/versions/3.13.*/bin/python3.13")), reverse=True)
    candidates.append(str(home / ".cache/newjax/py313/bin/python3.13"))
    for c in candidates:
        if c and os.access(c, os.X_OK):
            check = subprocess.run([c, "-c", "import ssl, sqlite3, lzma, bz2, zlib, ctypes, venv"], capture_output=True)
            if check.returncode == 0:
                return c
    return None


def run(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, quiet: bool = True) -> None:
    """Runs a setup command; on failure prints its output and exits 1."""
    proc = subprocess.run(list(cmd), env=dict(env) if env else None, capture_output=quiet, text=True)
    if proc.returncode:
        if quiet:
            sys.stderr.write((proc.stdout or "")[-4000:] + (proc.stderr or "")[-4000:])
        log(f"failed (exit status {proc.returncode}): {shlex.join(cmd)}")
        sys.exit(1)


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def version_of(python: str | Path) -> str:
    out = subprocess.run([str(python), "-c", "import platform; print(platform.python_version())"], capture_output=True)
    return out.stdout.decode().strip()


def make_venv(python: str, venv: Path, fresh: bool) -> None:
    """Creates the scratch venv, or reuses it when it runs the same Python version."""
    if python_of(venv).exists() and not fresh and version_of(python_of(venv)) == version_of(python):
        log(f"reusing the venv {venv}")
        return
    log(f"creating the venv {venv} with {python}")
    venv.parent.mkdir(parents=True, exist_ok=True)
    run([python, "-m", "venv", "--clear", str(venv)])


def install_newest(venv: Path, project: Path, extras: str) -> None:
    """``pip install --upgrade --upgrade-strategy eager -e PROJECT[EXTRAS]`` with no constraints file from the
    environment (the machine's pip configuration stays), so every dependency resolves to its newest release."""
    env = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    target = f"{project}[{extras}]" if extras else str(project)
    cmd = [str(python_of(venv)), "-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", "eager", "-e", target]
    log(f"installing {target} with the newest releases (PIP_CONSTRAINT unset)")
    run(cmd, env=env)


def prune(venv: Path, extras: str) -> None:
    """Uninstalls what the project no longer needs (left over in a reused venv), so the freeze is its closure."""
    py = str(python_of(venv))
    closure = subprocess.run(
        [py, "-c", _CLOSURE, PROJECT, *[e for e in extras.split(",") if e]], capture_output=True, text=True
    )
    if closure.returncode:
        log(f"could not compute the dependency closure; nothing pruned:\n{closure.stderr[-2000:]}")
        return
    needed = {normalise(n) for n in json.loads(closure.stdout)}
    listed = subprocess.run([py, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    stale = sorted(d["name"] for d in json.loads(listed.stdout) if normalise(d["name"]) not in needed | UNPINNED)
    if stale:
        log(f"uninstalling what {PROJECT}[{extras}] no longer needs: {', '.join(stale)}")
        run([py, "-m", "pip", "uninstall", "-q", "-y", *stale])


def freeze(venv: Path) -> tuple[dict[str, str], list[str]]:
    out = subprocess.run([str(python_of(venv)), "-m", "pip", "freeze"], capture_output=True, text=True, check=True)
    return parse_freeze(out.stdout)


def run_tests(venv: Path, project: Path, deprecations: bool, extra_args: Sequence[str]) -> tuple[int, str | None]:
    """Runs the fast tier in the venv; returns pytest's exit status and its JUnit XML (None if it wrote none)."""
    with tempfile.TemporaryDirectory(prefix="pin-drift-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [str(python_of(venv)), "-m", "pytest", "-m", "fast", "-q", "-rf", "-p", "no:cacheprovider"]
        if deprecations:
            cmd += ["-o", DEPRECATION_FILTER]
        cmd += [f"--junitxml={xml}", *extra_args]
        log(f"running {shlex.join(cmd)}")
        status = subprocess.run(cmd, cwd=project).returncode
        return status, xml.read_text() if xml.exists() else None


def header(python_version: str, argv: Sequence[str], results: RunResults, extras: str) -> list[str]:
    """The comment lines at the top of a written constraints file: how, when and where it was generated."""
    command = shlex.join(["python3", "tools/pin_drift.py", *argv])
    where = f"Python {python_version} ({platform.system().lower()} {platform.machine()})"
    return [
        f"Generated by `{command}` on {datetime.date.today().isoformat()}:",
        f"`pip freeze` of `pip install -e .[{extras}]` resolved to the newest releases on {where},",
        f"after the fast tier passed there ({results.passed} passed, {results.skipped} skipped).",
        "Used through pip's PIP_CONSTRAINT; regenerate with the same command.",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="tools/pin_drift.py",
        description=__doc__,
        epilog="Exit status: 0 when every selected test passed, 1 otherwise (or when the environment cannot be "
        "built). Options whose value starts with '-' take it after '=': --pytest-args='-x -k planner'.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--python",
        help="the interpreter for the scratch venv (default: a Python 3.13, found as "
        "newjax-env.sh finds it: $NEWJAX_PYTHON, python3.13 on PATH, ~/.pyenv/versions/3.13.*)",
    )
    p.add_argument(
        "--constraints",
        default=DEFAULT_CONSTRAINTS,
        help="the constraints file to compare with "
        "(and rewrite with --write); relative paths are from the repository root (default: %(default)s)",
    )
    p.add_argument(
        "--venv", type=Path, default=DEFAULT_VENV, help="the scratch venv, reused between runs (default: %(default)s)"
    )
    p.add_argument("--fresh", action="store_true", help="recreate the venv instead of reusing it")
    p.add_argument(
        "--extras",
        default="test,examples",
        help="the project's extras to install, comma-separated (default: %(default)s)",
    )
    p.add_argument("--write", action="store_true", help="rewrite the constraints file when every test passed")
    p.add_argument(
        "--deprecation-errors",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"run pytest with -o '{DEPRECATION_FILTER}' (as CI runs the newest line; on by default)",
    )
    p.add_argument(
        "--pytest-args",
        default="",
        help="more pytest arguments, one shell-quoted string, appended "
        "after '-m fast -q -rf' (e.g. a test file, or -m to select another tier)",
    )
    p.add_argument("--project", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    t0 = time.monotonic()
    project = args.project.resolve()
    constraints = Path(args.constraints)
    constraints = constraints if constraints.is_absolute() else project / constraints
    python = args.python or find_python313()
    if python is None:
        log("no Python 3.13 found (python3.13 on PATH, ~/.pyenv/versions/3.13.*): pass --python")
        return 1
    pinned = parse_constraints(constraints.read_text()) if constraints.exists() else {}
    if not constraints.exists():
        log(f"{constraints} does not exist: every package counts as added")

    venv = args.venv.expanduser().resolve()
    make_venv(python, venv, args.fresh)
    install_newest(venv, project, args.extras)
    prune(venv, args.extras)
    installed, unpinnable = freeze(venv)
    log(f"environment ready after {time.monotonic() - t0:.0f} s")
    status, xml = run_tests(venv, project, args.deprecation_errors, shlex.split(args.pytest_args))
    results = read_junit(xml) if xml else None

    py_version = version_of(python_of(venv))
    rel = constraints.relative_to(project) if constraints.is_relative_to(project) else constraints
    print()
    print(
        format_report(
            python_version=py_version,
            constraints=str(rel),
            pinned=pinned,
            installed=installed,
            results=results,
            pytest_status=status,
        )
    )
    for line in unpinnable:
        print(f"  not pinnable (a direct reference, left out of the constraints): {line}")
    ok = passed(results, status)
    if args.write:
        if not ok:
            print(f"constraints: {rel} not written (not every test passed)")
        elif not diff_versions(pinned, installed) and constraints.exists():
            print(f"constraints: {rel} already pins these versions; left as it is")
        else:
            constraints.parent.mkdir(parents=True, exist_ok=True)
            constraints.write_text(render_constraints(installed, header(py_version, argv, results, args.extras)))
            print(f"constraints: {rel} rewritten ({len(installed)} pins)")
    print(f"result: {'PASS' if ok else 'FAIL'} after {time.monotonic() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
