"""Runs every Python snippet of the README and the docs and checks the output shown under it.

Each fenced ``python`` block of ``README.md`` and ``docs/*.md`` runs on its own, in a fresh interpreter, from
the repository root, as a user would run it from a fresh shell (``XLA_FLAGS`` unset: a snippet that needs
simulated devices sets them itself; ``JAX_PLATFORMS=cpu``). If the next fenced block is a ``text`` block, the
snippet's stdout must equal it (trailing spaces on a line ignored). Run from the repository root::

    python docs/check_snippets.py               # all pages
    python docs/check_snippets.py README.md docs/planner.md

Exits non-zero if a snippet fails or prints something else than the page shows.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)


def pages() -> list[Path]:
    """The pages checked by default: the README, then every page of the docs."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """``(language, body, line)`` of every fenced block of a page, in order."""
    text = page.read_text()
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(text)]


def normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def check(page: Path) -> int:
    """Runs the page's snippets; returns the number of failures."""
    failures = 0
    found = blocks(page)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    for j, (lang, body, line) in enumerate(found):
        if lang != "python":
            continue
        run = subprocess.run([sys.executable, "-c", body], cwd=ROOT, env=env, capture_output=True, text=True)
        where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{line}"
        if run.returncode:
            print(f"FAIL {where}: exit {run.returncode}\n{run.stderr[-2000:]}")
            failures += 1
            continue
        expected = found[j + 1] if j + 1 < len(found) and found[j + 1][0] == "text" else None
        if expected is not None and normalise(run.stdout) != normalise(expected[1]):
            print(f"FAIL {where}: output differs\n--- page\n{expected[1]}--- actual\n{run.stdout}")
            failures += 1
            continue
        print(f"ok   {where}" + (" (output checked)" if expected is not None else ""))
    return failures


def main(argv: list[str]) -> int:
    failures = sum(check(p) for p in ([Path(a).resolve() for a in argv] or pages()))
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
