"""Draw fedudp's import graph and report its cycles and upward imports.

    .venv/bin/python scripts/tools/import_graph.py --out docs/architecture/import_graph_after.png

reads every ``import`` / ``from ... import`` of every module of a checkout's ``fedudp/`` (those
inside functions included, parsed with ``ast``) with the same functions, and the same layers,
as that checkout's ``tests/test_layers.py`` (``--root``: another checkout, e.g. a worktree of
an older commit, is drawn with its own rules). One box per unit of the layers (a package, with
its modules listed inside, or a module listed alone), one row per layer, bottom first; an arrow
from a box to a box it imports from, its width growing with the number of module-to-module
imports. Red: an import that runs upward or closes a cycle. Dashed grey, labelled "by name": a
module declared by its name (the first argument of a call, such as the engine registry's
``Engine("fedudp.flower.server_app", ...)``, imported with ``importlib`` on first use), not an
import: it is neither counted nor checked. Prints the cycles (between units,
and between modules, a package's ``__init__`` importing its own members aside) and the upward
imports, and exits 1 where there is either (``--no-fail`` draws and exits 0).

Standard library and matplotlib only (no graphviz needed).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_rules(root: Path):
    """The checkout's tests/test_layers.py as a module (its LAYERS, layer, modules, imported)."""
    path = root / "tests" / "test_layers.py"
    spec = importlib.util.spec_from_file_location(f"_layers_{abs(hash(root))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def unit_of(rules, module: str) -> str:
    """The entry of LAYERS a module falls in; a module in no entry: its top-level name."""
    best = ""
    for names in rules.LAYERS:
        for n in names:
            within = module == n or (n != "fedudp" and module.startswith(n + "."))
            if within and len(n) > len(best):
                best = n
    return best or ".".join(module.split(".")[:2])


def tarjan(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def by_name(rules, known: dict[str, Path], graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(unit, unit) pairs: a module naming another, not imported by it, as the first argument
    of a call (a declaration by name: ``Engine("fedudp.flower.server_app")``)."""
    out = set()
    for n, p in known.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            arg = node.args[0]
            if not isinstance(arg, ast.Constant) or arg.value not in known or arg.value == "fedudp":
                continue
            if arg.value != n and arg.value not in graph[n]:
                a, b = unit_of(rules, n), unit_of(rules, arg.value)
                if a != b:
                    out.add((a, b))
    return out


def analyse(root: Path) -> dict:
    rules = load_rules(root)
    known = rules.modules()
    mod_graph = {
        n: {m for m in rules.imported(n, p, known) if m in known} - {n} for n, p in known.items()
    }
    no_index = {
        n: {m for m in ms if not (known[n].name == "__init__.py" and m.startswith(n + "."))}
        for n, ms in mod_graph.items()
    }
    units: dict[str, list[str]] = defaultdict(list)
    for n in sorted(known):
        units[unit_of(rules, n)].append(n)
    edges: dict[tuple[str, str], int] = defaultdict(int)
    for n, ms in mod_graph.items():
        for m in ms:
            a, b = unit_of(rules, n), unit_of(rules, m)
            if a != b:
                edges[a, b] += 1
    unit_graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        unit_graph[a].add(b)
    unit_cycles = tarjan(unit_graph)
    in_cycle = {u: i for i, c in enumerate(unit_cycles) for u in c}
    upward = sorted(
        (n, m) for n, ms in mod_graph.items() for m in ms if rules.layer(m) > rules.layer(n)
    )
    layer_of = {u: rules.layer(ms[0]) for u, ms in units.items()}
    bad_edges = {
        (a, b)
        for a, b in edges
        if layer_of[b] > layer_of[a] or (a in in_cycle and in_cycle.get(b) == in_cycle[a])
    }
    return {
        "rules": rules,
        "modules": known,
        "units": dict(units),
        "layer_of": layer_of,
        "edges": dict(edges),
        "by_name": by_name(rules, known, mod_graph),
        "bad_edges": bad_edges,
        "unit_cycles": unit_cycles,
        "module_cycles": tarjan(no_index),
        "upward": upward,
        "top": rules.TOP,
    }


SAME_ROW_RAD = 0.3


def _footer(a: dict) -> list[str]:
    """Red lines under the drawing: every cycle and upward import (also inside a box)."""
    lines = [f"cycle between units: {' <-> '.join(map(_short, c))}" for c in a["unit_cycles"]]
    lines += [f"cycle between modules: {' <-> '.join(map(_short, c))}" for c in a["module_cycles"]]
    lines += [f"upward: {_short(n)} imports {_short(m)}" for n, m in a["upward"]]
    return lines


def _short(name: str) -> str:
    return name.removeprefix("fedudp.") if name != "fedudp" else "fedudp (__init__)"


def layout(a: dict):
    """Rows (bottom first) of units; each row ordered to keep arrows short (barycentres)."""
    rows: dict[int, list[str]] = defaultdict(list)
    order = [n for names in a["rules"].LAYERS for n in names]
    for u in sorted(a["units"], key=lambda u: (order.index(u) if u in order else len(order), u)):
        rows[a["layer_of"][u]].append(u)
    levels = sorted(rows)
    nbrs: dict[str, set[str]] = defaultdict(set)
    for x, y in a["edges"]:
        nbrs[x].add(y)
        nbrs[y].add(x)
    for _ in range(4):
        for sweep in (levels, levels[::-1]):
            pos = {
                u: i / max(1, len(rows[lv]) - 1) for lv in levels for i, u in enumerate(rows[lv])
            }
            for lv in sweep:

                def bary(u: str, lv: int = lv) -> float:
                    near = [pos[v] for v in nbrs[u] if a["layer_of"][v] != lv]
                    near += [pos[v] for v in nbrs[u] if a["layer_of"][v] == lv] * 3
                    return sum(near) / len(near) if near else pos[u]

                rows[lv].sort(key=bary)
    return [rows[lv] for lv in levels], levels


def box_text(a: dict, u: str) -> tuple[str, str]:
    members = [m for m in a["units"][u] if m != u]
    names = [m.removeprefix(u + ".") for m in members]
    if not names:
        return _short(u), ""
    body = textwrap.fill(", ".join(names), width=max(26, min(44, 6 + len(", ".join(names)) // 3)))
    return _short(u), body


def draw(a: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    rows, levels = layout(a)
    cw, lh, pad, gap = 0.085, 0.2, 0.12, 0.45  # inches: char width, line height, padding, gaps
    sizes = {}
    for row in rows:
        for u in row:
            head, body = box_text(a, u)
            lines = body.splitlines()
            w = max(len(head) * 1.1, *(len(s) for s in lines), 8) * cw + 2 * pad
            sizes[u] = (w, (1 + len(lines)) * lh + 2 * pad)
    row_w = [sum(sizes[u][0] for u in row) + gap * (len(row) - 1) for row in rows]
    row_h = [max(sizes[u][1] for u in row) for row in rows]
    vgap = 0.75
    width = max(row_w) + 1.0
    # room above a row for its arcs between neighbours of that row (peak ~ rad * distance / 2)
    xs = {}
    for row, rw in zip(rows, row_w):
        x = (width - rw) / 2
        for u in row:
            xs[u] = x + sizes[u][0] / 2
            x += sizes[u][0] + gap
    arc = [
        max(
            [0.0]
            + [
                SAME_ROW_RAD * abs(xs[s] - xs[t]) / 2
                for s, t in a["edges"]
                if s in row and t in row
            ]
        )
        for row in rows
    ]
    foot = _footer(a)
    height = sum(row_h) + vgap * (len(rows) - 1) + sum(arc) + 1.4 + 0.22 * len(foot)
    fig = plt.figure(figsize=(width, height), dpi=110)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.axis("off")
    centre: dict[str, tuple[float, float, float, float]] = {}  # x, y (centre), w, h
    y = 0.5 + 0.22 * len(foot)
    for i, line in enumerate(foot):
        ax.text(0.3, 0.3 + 0.22 * i, line, fontsize=8, color="#d62728", va="center")
    for row, rw, rh, lv, up in zip(rows, row_w, row_h, levels, arc):
        x = (width - rw) / 2
        label = f"layer {lv}" + ("\n(no rule:\nmay import\nanything)" if lv == a["top"] else "")
        ax.text(0.12, y + rh / 2, label, fontsize=7, color="0.45", va="center")
        for u in row:
            w, h = sizes[u]
            centre[u] = (x + w / 2, y + rh / 2, w, h)
            x += w + gap
        y += rh + vgap + up
    side = {"fedudp.owner": "#dcefd9", "fedudp.billboard": "#d9e4f5", "fedudp.protocol": "#f5ecd6"}
    for u, (cx, cy, w, h) in centre.items():
        ax.add_patch(
            FancyBboxPatch(
                (cx - w / 2, cy - h / 2),
                w,
                h,
                boxstyle="round,pad=0.02,rounding_size=0.08",
                fc=side.get(u, "#f2f2f2"),
                ec="0.3",
                lw=0.9,
                zorder=3,
            )
        )
        head, body = box_text(a, u)
        ax.text(
            cx, cy + h / 2 - pad, head, ha="center", va="top", fontsize=9, weight="bold", zorder=4
        )
        if body:
            ax.text(
                cx,
                cy + h / 2 - pad - lh * 1.05,
                body,
                ha="center",
                va="top",
                fontsize=7,
                zorder=4,
                family="monospace",
                linespacing=1.25,
            )
    for (s, t), n in sorted(a["edges"].items(), key=lambda e: (e[0] in a["bad_edges"], e[0])):
        sx, sy, sw, sh = centre[s]
        tx, ty, tw, th = centre[t]
        bad = (s, t) in a["bad_edges"]
        if abs(sy - ty) < 1e-6:  # same row: over the top
            p0, p1 = (sx, sy + sh / 2), (tx, ty + th / 2)
            rad = -SAME_ROW_RAD if tx > sx else SAME_ROW_RAD
        elif sy > ty:  # importer above: bottom edge to top edge
            off = max(-0.35, min(0.35, (tx - sx) / width)) * sw
            p0, p1, rad = (sx + off, sy - sh / 2), (tx - off * tw / sw / 2, ty + th / 2), 0.0
        else:  # upward
            p0, p1, rad = (sx, sy + sh / 2), (tx, ty - th / 2), 0.25
        ax.add_patch(
            FancyArrowPatch(
                p0,
                p1,
                connectionstyle=f"arc3,rad={rad}",
                arrowstyle="-|>",
                mutation_scale=9,
                lw=min(0.5 + 0.25 * n, 2.5) if not bad else 1.8,
                color="#d62728" if bad else "0.35",
                alpha=0.9 if bad else 0.35,
                zorder=5 if bad else 2,
            )
        )
    for s, t in sorted(a.get("by_name", ())):  # declared by name: dashed grey, not an import
        sx, sy, sw, sh = centre[s]
        tx, ty, tw, th = centre[t]
        up = ty > sy
        p0 = (sx + 0.25 * sw, sy + (sh if up else -sh) / 2)
        p1 = (tx - 0.25 * tw, ty - (th if up else -th) / 2)
        ax.add_patch(
            FancyArrowPatch(
                p0,
                p1,
                connectionstyle="arc3,rad=-0.2",
                arrowstyle="-|>",
                mutation_scale=9,
                lw=1.2,
                linestyle=(0, (4, 3)),
                color="0.5",
                alpha=0.9,
                zorder=2,
            )
        )
        # the label at the arc's middle (arc3: control point off the chord by rad x its length)
        dx, dy = p1[0] - p0[0], p1[1] - p0[1]
        cx, cy = (p0[0] + p1[0]) / 2 - 0.2 * dy, (p0[1] + p1[1]) / 2 + 0.2 * dx
        ax.text(
            0.25 * p0[0] + 0.5 * cx + 0.25 * p1[0],
            0.25 * p0[1] + 0.5 * cy + 0.25 * p1[1],
            "by name",
            fontsize=7,
            color="0.35",
            style="italic",
            ha="center",
            va="center",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.9},
            zorder=6,
        )
    n_up, n_cyc = len(a["upward"]), len(a["unit_cycles"]) + len(a["module_cycles"])
    ax.text(
        width / 2,
        height - 0.35,
        f"{title}: {len(a['modules'])} modules in {len(centre)} units, {len(rows)} layers; "
        f"arrows: imports (importer -> imported); red: {n_up} upward import(s), {n_cyc} cycle(s); "
        "dashed: declared by name (no import)",
        ha="center",
        va="center",
        fontsize=10,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    ap.add_argument("--out", type=Path, help="the PNG to write (default: only report)")
    ap.add_argument("--title", default="fedudp import graph")
    ap.add_argument(
        "--no-fail", action="store_true", help="exit 0 even with cycles or upward imports"
    )
    args = ap.parse_args(argv)
    a = analyse(args.root.resolve())
    print(f"{len(a['modules'])} modules, {len(a['units'])} units, {len(a['edges'])} unit imports")
    for s, t in sorted(a["by_name"]):
        print(f"by name (not an import): {s} declares {t}")
    for kind, cycles in (("unit", a["unit_cycles"]), ("module", a["module_cycles"])):
        for c in cycles:
            print(f"cycle between {kind}s: {' <-> '.join(c)}")
    for n, m in a["upward"]:
        print(
            f"upward: {n} (layer {a['rules'].layer(n)}) imports {m} (layer {a['rules'].layer(m)})"
        )
    if not (a["unit_cycles"] or a["module_cycles"] or a["upward"]):
        print("no cycle, no upward import")
    if args.out:
        draw(a, args.out, args.title)
        print(f"wrote {args.out}")
    bad = a["unit_cycles"] or a["module_cycles"] or a["upward"]
    return 1 if bad and not args.no_fail else 0


if __name__ == "__main__":
    raise SystemExit(main())
