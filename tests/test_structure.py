"""The package's shape: sub-packages along the data flow, each importing only the layers below it.

The layer order is written once, here (``LAYERS``), and drawn in ``docs/architecture.md``. The test reads every
module's imports with :mod:`ast` (no import is executed) and fails on an import from a lower layer up to a higher
one, on an import cycle between modules, and on a function-level import of the package's own modules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "vescale_jax"

# Lowest first. A module of layer i may import modules of layers < i, and modules of its own layer.
LAYERS: tuple[tuple[str, str], ...] = (
    ("_compat", "every use of JAX / optax internals, each pinned by a test"),
    ("_cache", "bounded caches keyed by a plan"),
    ("testing", "HLO census, memory figures, peak account: reads compiled text"),
    ("layout", "RaggedShard, granularity, tiles, TP specs, the integer planner, Plan, block index: pure index math"),
    ("quant", "block-wise quantization numerics"),
    ("kernels", "Pallas pack / unpack beside their jnp references, the kernel policy"),
    ("state", "ShardedParams, PerDevice, shard / unshard / init, the padding invariant, placement by type"),
    ("relayout", "one engine: plan the moves of ragged ranges between two placements, then run them"),
    ("redistribute", "public namespace of relayout's one-tensor moves"),
    ("step", "the step policy, the wire, point-of-use segments, layer scan, accumulation, vj.fsdp / vj.apply"),
    ("optim", "Optax transformations over the shards: Muon, Shampoo, 8-bit AdamW, masks, per-leaf reductions"),
    ("checkpoint", "Orbax save / restore in the logical layout, integrity"),
    ("flax", "NNX / Linen adapters"),
    ("distributed", "joining a cluster, process-local batches"),
    ("__init__", "the public names"),
)
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(["vescale_jax", *parts]) if parts != ["__init__"] else "vescale_jax"] = path
    return out


def _layer(module: str) -> str:
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def _resolve(module: str, node: ast.ImportFrom, is_package: bool, known: set[str]) -> list[str]:
    if node.level:
        base = module.split(".")
        base = base if is_package else base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not target.startswith("vescale_jax"):
        return []
    out = []
    for alias in node.names:
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in known else target)
    return out


def _imports() -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported vescale_jax module, line, at module level)]."""
    mods = _modules()
    known = set(mods)
    graph: dict[str, list[tuple[str, int, bool]]] = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        top = {id(n) for n in tree.body}
        # imports under `if TYPE_CHECKING:` / try at module level count as module level
        for n in tree.body:
            if isinstance(n, ast.If | ast.Try):
                top |= {id(c) for c in ast.walk(n)}
        edges = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("vescale_jax")]
            elif isinstance(node, ast.ImportFrom):
                targets = _resolve(module, node, path.name == "__init__.py", known)
            else:
                continue
            for t in targets:
                while t not in known and "." in t:
                    t = t.rsplit(".", 1)[0]
                edges.append((t, node.lineno, id(node) in top))
        graph[module] = edges
    return graph


def _name(module: str) -> str:
    return str(_modules()[module].relative_to(PKG.parent))


def test_every_module_has_a_layer():
    unknown = sorted({_layer(m) for m in _modules()} - set(RANK))
    assert not unknown, f"top-level entries without a layer in LAYERS: {unknown}; add them to the order"


def test_no_import_goes_up_a_layer():
    bad = []
    for module, edges in _imports().items():
        for target, line, _ in edges:
            if target == "vescale_jax" and module != "vescale_jax":
                bad.append(f"{_name(module)}:{line} imports the top-level package (import the module that defines it)")
                continue
            a, b = _layer(module), _layer(target)
            if RANK[b] > RANK[a]:
                bad.append(f"{_name(module)}:{line} ({a}) imports {target} ({b}), a higher layer")
    assert not bad, "\n".join(bad)


def test_no_function_level_import_of_the_package():
    bad = [
        f"{_name(module)}:{line} imports {target} inside a function"
        for module, edges in _imports().items()
        for target, line, top in edges
        if not top
    ]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    graph = {m: sorted({t for t, _, _ in edges if t != m}) for m, edges in _imports().items()}
    # A package's __init__ re-exports its modules; an import of a sibling's package is an import of that module's
    # package __init__, which is fine unless the __init__ leads back.
    color: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        color[node] = 1
        stack.append(node)
        for nxt in graph.get(node, []):
            if color.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in color:
                visit(nxt, stack)
        stack.pop()
        color[node] = 2

    for node in sorted(graph):
        if node not in color:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_layer_exists(layer):
    assert (PKG / layer).is_dir() or (PKG / f"{layer}.py").is_file(), (
        f"LAYERS names {layer!r}, which is not in the package"
    )


def test_no_private_name_crosses_a_sub_package():
    """A sub-package uses another one through names without a leading underscore (its modules may share
    private helpers among themselves)."""
    mods = _modules()
    known = set(mods)
    bad = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("vescale_jax"):
                continue
            for alias in node.names:
                if not alias.name.startswith("_") or f"{node.module}.{alias.name}" in known:
                    continue  # a public name, or a module imported by name
                if _layer(node.module) != _layer(module):
                    bad.append(f"{_name(module)}:{node.lineno} imports private {alias.name} from {node.module}")
    assert not bad, "\n".join(bad)
