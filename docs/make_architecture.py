"""Draws ``docs/architecture.md``'s figure and writes its generated parts, from the package's own imports.

The layer order and the import reader are those of ``tests/test_structure.py`` (imported by path, so the order is
written once, there). Every module's imports are read with :mod:`ast`; nothing of ``vescale_jax`` is imported.

* ``docs/figures/architecture.png``: the layers as horizontal bands, lowest at the bottom; each module a box in
  its layer's band; an arrow from a layer to each lower layer it imports, as wide as the number of
  (module, imported module) pairs it stands for.
* Between marker comments in ``docs/architecture.md``: the layer order (with the lower layers each one imports),
  the figure's caption with a fingerprint of the import graph it was drawn from, and the table of modules (one
  row per module: its path and the first sentence of its docstring).

Run from the repository root::

    python docs/make_architecture.py              # rewrite the generated parts and redraw the figure
    python docs/make_architecture.py --no-figure  # rewrite the tables only (no matplotlib needed)
    python docs/make_architecture.py --check      # exit 1 if the page differs from the code (no drawing)

``--check`` also fails when the figure was drawn from another import graph than the code's (its fingerprint in
the page differs) and when the page's prose names a file of the repository that does not exist.
"""

from __future__ import annotations

import argparse
import ast
import collections
import difflib
import hashlib
import importlib.util
import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
PAGE = DOCS / "architecture.md"
FIGURE = DOCS / "figures" / "architecture.png"
REGIONS = ("layers", "figure", "modules")
SCRIPT = "docs/make_architecture.py"


def structure():
    """``tests/test_structure.py`` as a module: ``LAYERS``, ``RANK``, ``PKG``, ``_modules``, ``_imports``."""
    spec = importlib.util.spec_from_file_location("_vescale_jax_structure", ROOT / "tests" / "test_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------------------------
# What the code says


class Graph:
    """The package's modules by layer and the imports between layers, read from the source."""

    def __init__(self) -> None:
        s = structure()
        self.layers: tuple[tuple[str, str], ...] = s.LAYERS
        self.rank: dict[str, int] = s.RANK
        self.pkg: Path = s.PKG
        self.layer_of = s._layer
        self.paths: dict[str, Path] = dict(s._modules())
        imports = s._imports()
        # (module, imported module) pairs, each counted once however many import statements spell it.
        self.pairs: set[tuple[str, str]] = {(m, t) for m, edges in imports.items() for t, _, _ in edges if t != m}
        # Modules of a top-level entry LAYERS does not name (tests/test_structure.py fails on them too).
        self.unplaced = sorted(m for m in self.paths if self.layer_of(m) not in self.rank)
        self.edges: collections.Counter[tuple[str, str]] = collections.Counter(
            (a, b)
            for a, b in ((self.layer_of(m), self.layer_of(t)) for m, t in self.pairs)
            if a != b and a in self.rank and b in self.rank
        )
        self.docs = {m: _docstring(p) for m, p in self.paths.items()}

    def shown(self, module: str) -> bool:
        """Whether a module gets a row and a box: everything but an empty package ``__init__``."""
        path = self.paths[module]
        return path.name != "__init__.py" or path.parent == self.pkg or bool(path.read_text().strip())

    def modules(self, layer: str) -> list[str]:
        """The layer's shown modules, in path order, each package's ``__init__`` before its modules."""
        mods = [m for m in self.paths if self.layer_of(m) == layer and self.shown(m)]

        def key(m: str) -> tuple[str, ...]:
            parts = self.paths[m].relative_to(self.pkg).parts
            return (*parts[:-1], "" if parts[-1] == "__init__.py" else parts[-1])

        return sorted(mods, key=key)

    def rel(self, module: str) -> str:
        """The module's file, relative to the package (``step/_wire.py``)."""
        return self.paths[module].relative_to(self.pkg).as_posix()

    def label(self, module: str) -> str:
        """The module's name inside its layer (``_wire``, ``_muon/_routing``; a one-file layer: ``quant.py``)."""
        rel = self.paths[module].relative_to(self.pkg)
        parts = list(rel.parts[1:]) if len(rel.parts) > 1 else [rel.name]
        if parts[-1] == "__init__.py" and len(parts) > 1:
            parts = parts[:-1]
        parts[-1] = parts[-1].removesuffix(".py") if len(rel.parts) > 1 else parts[-1]
        return "/".join(parts)

    def fingerprint(self) -> str:
        """A hash of what the figure draws: every shown module by layer and every import pair across layers."""
        text = "\n".join(
            [f"{self.layer_of(m)} {self.label(m)}" for layer, _ in self.layers for m in self.modules(layer)]
            + [f"{a} -> {b} {n}" for (a, b), n in sorted(self.edges.items())]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _docstring(path: Path) -> str | None:
    try:
        return ast.get_docstring(ast.parse(path.read_text(), filename=str(path)))
    except SyntaxError as e:
        return f"(does not parse: {e.msg}, line {e.lineno})"


_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.")


def first_sentence(doc: str | None) -> str:
    """The docstring's first sentence (up to the first ``.``, ``!`` or ``?`` followed by a space, outside
    backquotes and abbreviations), in Markdown: reST roles and double backquotes become single backquotes."""
    if not doc:
        return "(no module docstring)"
    para = " ".join(doc.strip().split("\n\n")[0].split())
    # :class:`~a.B` -> ``B`` (as Sphinx shows it), :class:`a.B` -> ``a.B``
    para = re.sub(
        r":[a-z]+:`(~?)([^`]+)`", lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``", para
    )
    code, end = False, len(para)
    for i, ch in enumerate(para):
        if ch == "`":
            code = not code
        elif ch in ".!?" and not code and (i + 1 == len(para) or para[i + 1] == " "):
            if not any(para[: i + 1].endswith(a) for a in _ABBREVIATIONS):
                end = i + 1
                break
    text = para[:end].rstrip(":")
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return text.replace("|", "\\|")


# ---------------------------------------------------------------------------------------------------------------
# The page's generated regions


def layers_region(g: Graph) -> str:
    lines = ["| # | layer | what it holds | imports (layers below) |", "|---|---|---|---|"]
    for i, (name, what) in enumerate(g.layers):
        below = sorted({b for (a, b) in g.edges if a == name}, key=g.rank.__getitem__)
        kind = "" if name == "__init__" else ("/" if (g.pkg / name).is_dir() else ".py")
        shown = "`vescale_jax/__init__.py`" if name == "__init__" else f"`{name}{kind}`"
        lines.append(f"| {i} | {shown} | {what} | {', '.join(f'`{b}`' for b in below) or '-'} |")
    return "\n".join(lines)


def figure_region(g: Graph) -> str:
    n_mods = sum(len(g.modules(name)) for name, _ in g.layers)
    return (
        f"<!-- import graph fingerprint: {g.fingerprint()} -->\n"
        "![The layers of vescale_jax, lowest at the bottom, with their modules and the imports between "
        "layers](figures/architecture.png)\n\n"
        f"*{len(g.layers)} layers, {n_mods} modules; {sum(g.edges.values())} imports from one layer into a lower "
        f"one, between {len(g.edges)} pairs of layers. An arrow points from the importing layer to the imported "
        "one; its width is the number of (module, imported module) pairs it stands for, its colour the importing "
        f"layer's. Drawn by `{SCRIPT}` from the modules' imports.*"
    )


def modules_region(g: Graph) -> str:
    lines = ["| layer | module | what it holds |", "|---|---|---|"]
    for name, _ in g.layers:
        for j, m in enumerate(g.modules(name)):
            rel = g.rel(m)
            layer = f"`{name}`" if j == 0 else ""
            lines.append(f"| {layer} | [`{rel}`](../vescale_jax/{rel}) | {first_sentence(g.docs[m])} |")
    return "\n".join(lines)


def generated(g: Graph) -> dict[str, str]:
    return {"layers": layers_region(g), "figure": figure_region(g), "modules": modules_region(g)}


def _markers(name: str) -> tuple[str, str]:
    return (
        f"<!-- begin generated: {name} (python {SCRIPT}; do not edit by hand) -->",
        f"<!-- end generated: {name} -->",
    )


def _span(text: str, name: str) -> tuple[int, int]:
    begin, end = _markers(name)
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(
            f"{PAGE.relative_to(ROOT)}: the markers of the generated {name!r} region are missing:\n  {begin}\n  {end}"
        )
    return i + len(begin), j


def rewrite(text: str, regions: dict[str, str]) -> str:
    for name, body in regions.items():
        i, j = _span(text, name)
        text = text[:i] + "\n" + body + "\n" + text[j:]
    return text


def stale_paths(text: str) -> list[str]:
    """Repository files the page's prose names (outside the generated regions) that do not exist."""
    for name in REGIONS:
        i, j = _span(text, name)
        text = text[:i] + text[j:]
    # A path followed by "<" is a pattern (vescale_jax/optim/_<name>/), not a file.
    named = re.findall(r"(?<![\w/.])((?:vescale_jax|tests|docs|examples|benchmarks)/[\w/.-]*\w)(?![<\w/])", text)
    return sorted({p for p in named if not (ROOT / p).exists() and not (DOCS / p).exists()})


def check(g: Graph) -> list[str]:
    """What differs between the page and the code (empty when they agree)."""
    text = PAGE.read_text()
    problems = []
    want = rewrite(text, generated(g))
    if want != text:
        diff = difflib.unified_diff(
            text.splitlines(), want.splitlines(), "docs/architecture.md", "from the code", lineterm="", n=1
        )
        problems.append("the generated regions differ from the code:\n" + "\n".join(diff))
    for p in stale_paths(text):
        problems.append(f"the page's prose names {p}, which does not exist: correct the prose")
    if not FIGURE.is_file():
        problems.append(f"{FIGURE.relative_to(ROOT)} is missing")
    for m in g.unplaced:
        problems.append(f"{g.paths[m].relative_to(ROOT)} is in no layer of LAYERS (tests/test_structure.py)")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# The figure

WIDTH_PX = 1200
DPI = 100
LEFT = 12  # layer names from here; the module boxes from right of the longest name ...
BOXES_END = 780  # ... to here; the arrows run right of it
ROW = 24  # one row of boxes
PAD = 7  # band padding above and below the rows
GAP = 6  # between boxes
BOX_FONT = 8.5
NAME_FONT = 10


def draw(g: Graph, path: Path = FIGURE) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
    from matplotlib.path import Path as MplPath

    fig = plt.figure(figsize=(WIDTH_PX / DPI, 1), dpi=DPI)
    renderer = fig.canvas.get_renderer()

    def text_width(s: str, size: float, **kw) -> float:
        t = fig.text(0, 0, s, fontsize=size, **kw)
        w = t.get_window_extent(renderer).width
        t.remove()
        return w

    def layer_name(i: int, name: str) -> str:
        return f"{i}  {'vescale_jax' if name == '__init__' else name}"

    boxes_x = (
        LEFT + 14 + max(text_width(layer_name(i, n), NAME_FONT, weight="bold") for i, (n, _) in enumerate(g.layers))
    )
    # Rows of boxes per layer (greedy), then the bands' heights, bottom (layer 0) to top.
    placed: dict[str, list[list[tuple[str, float]]]] = {}
    for name, _ in g.layers:
        rows: list[list[tuple[str, float]]] = [[]]
        used = 0.0
        for m in g.modules(name):
            w = text_width(g.label(m), BOX_FONT, family="monospace") + 14
            if rows[-1] and used + w > BOXES_END - boxes_x:
                rows.append([])
                used = 0.0
            rows[-1].append((m, w))
            used += w + GAP
        placed[name] = rows
    heights = {name: max(len(placed[name]), 1) * ROW + 2 * PAD for name, _ in g.layers}
    top_margin, bottom_margin = 46, 44
    height = top_margin + bottom_margin + sum(heights.values())
    fig.set_size_inches(WIDTH_PX / DPI, height / DPI)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH_PX)
    ax.set_ylim(0, height)
    ax.axis("off")

    # Distinct colours from the top down (the importing layers), the light ones for the layers that import least.
    tab20 = plt.get_cmap("tab20").colors
    palette = [c for c in tab20[0::2] if c != tab20[14]] + list(tab20[1::2])
    colour = {name: palette[k % len(palette)] for k, (name, _) in enumerate(reversed(g.layers[:-1]))}
    colour[g.layers[-1][0]] = tab20[14]  # the public names: grey, like their re-export arrows
    band: dict[str, tuple[float, float]] = {}
    y = bottom_margin
    texts = []
    for i, (name, _) in enumerate(g.layers):
        h = heights[name]
        band[name] = (y, y + h)
        ax.add_patch(Rectangle((0, y), WIDTH_PX, h, color="#f4f4f4" if i % 2 else "#ffffff", zorder=0, lw=0))
        ax.add_patch(Rectangle((0, y), 6, h, color=colour[name], zorder=1, lw=0))
        texts.append(ax.text(LEFT, y + h / 2, layer_name(i, name), fontsize=NAME_FONT, weight="bold", va="center"))
        rows = placed[name]
        for r, row in enumerate(rows):
            cy = y + h - PAD - ROW * r - ROW / 2
            x = boxes_x
            for m, w in row:
                ax.add_patch(
                    FancyBboxPatch(
                        (x, cy - ROW / 2 + 3),
                        w,
                        ROW - 6,
                        boxstyle="round,pad=0,rounding_size=4",
                        fc=(*colour[name][:3], 0.35),
                        ec=colour[name],
                        lw=1,
                        zorder=2,
                    )
                )
                texts.append(
                    ax.text(
                        x + w / 2,
                        cy,
                        g.label(m),
                        fontsize=BOX_FONT,
                        family="monospace",
                        ha="center",
                        va="center",
                        zorder=3,
                    )
                )
                x += w + GAP
        y += h

    # Arrows: out of the lower half of the importing band, into the upper half of the imported one, spread so
    # that no two share an end; each bulges right in proportion to its length.
    port_x = BOXES_END + 16
    outgoing = collections.defaultdict(list)
    incoming = collections.defaultdict(list)
    for a, b in g.edges:
        outgoing[a].append(b)
        incoming[b].append(a)

    def spread(lo: float, hi: float, k: int, j: int) -> float:
        return hi - (hi - lo) * (j + 1) / (k + 1)

    widest = max(g.edges.values(), default=1)
    step_px = (WIDTH_PX - port_x - 40) / (0.75 * max(len(g.layers) - 1, 1))

    def order(e):  # the public names' re-exports first (underneath), then the widest arrows first
        return (e[0] != "__init__", -g.edges[e], e)

    for a, b in sorted(g.edges, key=order):
        n = g.edges[a, b]
        outs = sorted(outgoing[a], key=g.rank.__getitem__, reverse=True)
        ins = sorted(incoming[b], key=g.rank.__getitem__)
        lo, hi = band[a]
        y0 = spread(lo + 2, (lo + hi) / 2, len(outs), outs.index(b))
        lo, hi = band[b]
        y1 = spread((lo + hi) / 2, hi - 2, len(ins), ins.index(a))
        up = g.rank[a] < g.rank[b]  # an import up a layer: tests/test_structure.py fails; drawn red and dashed
        bulge = 12 + step_px * abs(g.rank[a] - g.rank[b])  # longer arrows run further right: nested, not crossed
        curve = MplPath(
            [(port_x, y0), (port_x + bulge, y0), (port_x + bulge, y1), (port_x, y1)],
            [MplPath.MOVETO, MplPath.CURVE4, MplPath.CURVE4, MplPath.CURVE4],
        )
        reexport = a == "__init__"
        ax.add_patch(
            FancyArrowPatch(
                path=curve,
                arrowstyle="-|>,head_length=6,head_width=3.5",
                lw=0.6 + 4.4 * n / widest,
                color="#000000" if up else "#bbbbbb" if reexport else colour[a],
                alpha=1.0 if reexport or up else 0.9,
                linestyle="--" if up else "-",
                zorder=5 if up else 3 if reexport else 4,
            )
        )
    texts.append(
        ax.text(
            LEFT,
            height - 22,
            "vescale_jax: layers bottom to top; a layer imports only the layers below it",
            fontsize=12,
            weight="bold",
            va="center",
        )
    )
    legend = [1, max(widest // 2, 1), widest] if widest > 2 else [widest]
    x = LEFT + 110
    texts.append(ax.text(LEFT, 20, "arrow width:", fontsize=9, va="center"))
    for n in dict.fromkeys(legend):
        ax.add_patch(
            FancyArrowPatch(
                (x, 20),
                (x + 36, 20),
                arrowstyle="-|>,head_length=6,head_width=3.5",
                lw=0.6 + 4.4 * n / widest,
                color="#555555",
                shrinkA=0,
                shrinkB=0,
            )
        )
        texts.append(ax.text(x + 42, 20, f"{n} import{'s' if n > 1 else ''}", fontsize=9, va="center"))
        x += 130
    texts.append(
        ax.text(x + 10, 20, f"drawn by {SCRIPT} from the modules' imports", fontsize=9, va="center", color="#555555")
    )

    fig.canvas.draw()
    boxes = [t.get_window_extent(renderer) for t in texts]
    clash = [
        (texts[i].get_text(), texts[j].get_text())
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
        if boxes[i].overlaps(boxes[j])
    ]
    off = [t.get_text() for t, b in zip(texts, boxes, strict=True) if b.x0 < 0 or b.x1 > WIDTH_PX]
    if clash or off:
        raise SystemExit(f"figure labels overlap: {clash}; outside the figure: {off}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT)} ({WIDTH_PX} x {height} px)")


# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/architecture.md differs from the code")
    p.add_argument("--no-figure", action="store_true", help="rewrite the page's tables only")
    args = p.parse_args(argv)
    g = Graph()
    missing = [m for m in g.paths if g.shown(m) and not g.docs[m]]
    if args.check:
        problems = check(g)
        for problem in problems:
            print(f"FAIL {problem}")
        if problems:
            print(f"rerun: python {SCRIPT}  (pip install matplotlib for the figure)")
            return 1
        print(f"ok   docs/architecture.md agrees with the code ({sum(map(g.shown, g.paths))} modules)")
        return 0
    for m in missing:
        print(f"note: {g.rel(m)} has no module docstring", file=sys.stderr)
    text = PAGE.read_text()
    regions = generated(g)
    if args.no_figure:  # keep the figure's region (and its fingerprint) as drawn
        regions.pop("figure")
    else:
        draw(g)
    PAGE.write_text(rewrite(text, regions))
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
