#!/usr/bin/env python3
"""Whether this interpreter's packages are the ones a constraints file pins: CI's proof that it tests what it pins.

    python3 tools/check_pins.py constraints/py311.txt
    ~/.cache/newjax/venv/bin/python tools/check_pins.py constraints/newest.txt

Prints the versions that matter to users (JAX, jaxlib, Flax, Optax, Orbax, NumPy, ...) as pinned and as installed,
then checks every pinned package that is installed: the exit status is 1, naming each one, when an installed
version differs from its pin (a pinned package that is not installed is fine: the file also covers extras this
environment did not ask for). Standard library only; the file is read by ``pin_drift.parse_constraints``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence
from pathlib import Path

from pin_drift import normalise, parse_constraints

SHOWN = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "tensorstore", "ml-dtypes", "pytest")


def installed_versions() -> dict[str, str]:
    """``{normalised name: version}`` of every distribution this interpreter sees."""
    return {normalise(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}


def mismatches(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """``"name: pinned X, installed Y"`` for each pinned package installed at another version."""
    return [
        f"{name}: pinned {version}, installed {installed[name]}"
        for name, version in sorted(pins.items())
        if name in installed and installed[name] != version
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("constraints", type=Path, help="the constraints file (name==version lines)")
    args = parser.parse_args(argv)
    pins = {normalise(k): v for k, v in parse_constraints(args.constraints.read_text()).items()}
    installed = installed_versions()
    print(f"Python {sys.version.split()[0]}, pins of {args.constraints}:")
    for name in SHOWN:
        if name in pins or name in installed:
            print(f"  {name:<18} pinned {pins.get(name, '-'):<12} installed {installed.get(name, '-')}")
    wrong = mismatches(pins, installed)
    checked = sum(name in installed for name in pins)
    if wrong:
        print(f"{len(wrong)} of {checked} installed pinned packages differ from their pins:", *wrong, sep="\n  ")
        return 1
    print(f"all {checked} installed pinned packages at their pins")
    return 0


if __name__ == "__main__":
    sys.exit(main())
