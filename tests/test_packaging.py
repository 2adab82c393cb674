"""Dependencies match imports: every third-party package the code imports is declared in ``pyproject.toml``.

The package (``vescale_jax/``) may import only ``[project].dependencies``; the tests, benchmarks, examples and
the docs' scripts may also import the ``test`` and ``examples`` extras. Every declared dependency is imported by
the package. Imports are read with ``ast`` (module level and function level alike), not executed.
"""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Import names whose distribution is named otherwise (the installed metadata is asked for the rest).
DISTRIBUTIONS = {"orbax": ("orbax-checkpoint",), "yaml": ("pyyaml",), "PIL": ("pillow",)}
EXTRAS = ("test", "examples")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(requirements: list[str]) -> set[str]:
    """The distribution names of requirement strings (``"jax[cuda12]>=0.10"`` -> ``"jax"``)."""
    return {_normalise(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r.strip()).group(0)) for r in requirements}


def _imports(roots: list[str]) -> dict[str, list[str]]:
    """``{top-level module: [file:line, ...]}`` of every absolute import under ``roots``."""
    found: dict[str, list[str]] = {}
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def _local_modules(roots: list[str]) -> set[str]:
    """Modules of the repository itself: the package, and the scripts and helpers the scanned folders import
    from each other (``conftest``, ``helpers``, ``gpt``, ``model_configs``, ...)."""
    local = {"vescale_jax"}
    for root in roots:
        local |= {p.stem for p in (ROOT / root).rglob("*.py")}
    return local


def _undeclared(roots: list[str], declared: set[str]) -> list[str]:
    local = _local_modules(roots)
    installed = packages_distributions()
    missing = []
    for module, where in sorted(_imports(roots).items()):
        if module in sys.stdlib_module_names or module in local or module == "__future__":
            continue
        candidates = DISTRIBUTIONS.get(module) or tuple(installed.get(module, ())) or (module,)
        if not {_normalise(c) for c in candidates} & declared:
            missing.append(f"{module} (distribution {' or '.join(candidates)}; imported at {', '.join(where[:3])})")
    return missing


def test_the_package_imports_only_its_dependencies():
    missing = _undeclared(["vescale_jax"], _declared(PYPROJECT["project"]["dependencies"]))
    assert not missing, "vescale_jax imports packages not in [project].dependencies of pyproject.toml: " + (
        "; ".join(missing)
    )


def test_tests_benchmarks_and_examples_import_only_declared_packages():
    project = PYPROJECT["project"]
    requirements = project["dependencies"] + [r for e in EXTRAS for r in project["optional-dependencies"][e]]
    missing = _undeclared(["tests", "benchmarks", "examples", "docs"], _declared(requirements))
    assert not missing, f"imports not declared in [project].dependencies nor the {EXTRAS} extras: " + (
        "; ".join(missing)
    )


def test_every_dependency_is_imported_by_the_package():
    imported = _imports(["vescale_jax"])
    installed = packages_distributions()
    provided = {_normalise(d) for m in imported for d in (DISTRIBUTIONS.get(m) or tuple(installed.get(m, ())) or (m,))}
    unused = sorted(_declared(PYPROJECT["project"]["dependencies"]) - provided)
    assert not unused, f"[project].dependencies declares {unused}, which vescale_jax never imports; drop them"


def test_readme_tested_versions_are_the_pinned_ones():
    """The README's "Tested versions" names, for each JAX line, the JAX / Flax / Optax / Orbax that its constraints
    file pins (the file CI installs through PIP_CONSTRAINT)."""
    readme = (ROOT / "README.md").read_text()
    said = re.findall(
        r"JAX\s+([\d.]+)\s+\(Flax\s+([\d.]+),\s+Optax\s+([\d.]+),\s+Orbax\s+([\d.]+)(?::|,)[^`]*`constraints/(\w+)\.txt`",
        readme,
    )
    assert {line for *_, line in said} == {"py311", "newest"}, f"README names the pins of {said}"
    for jax_v, flax_v, optax_v, orbax_v, line in said:
        pins = {}
        for raw in (ROOT / "constraints" / f"{line}.txt").read_text().splitlines():
            name, sep, version = raw.partition("==")
            if sep and not raw.startswith("#"):
                pins[_normalise(name.strip())] = version.strip()
        assert (pins["jax"], pins["jaxlib"]) == (jax_v, jax_v), line
        assert (pins["flax"], pins["optax"], pins["orbax-checkpoint"]) == (flax_v, optax_v, orbax_v), line
