"""Imports run only downward: each module imports fedudp modules of its own layer or below.

Read from the import graph (every ``import`` / ``from ... import`` statement of every module,
those inside functions included, parsed with ``ast``), not from text patterns. The layers, bottom
first: what may import what is the whole rule."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fedudp"

# bottom first; a module's layer is that of the longest prefix listed (the rest: the top layer)
LAYERS = [
    # the package's __init__, errors, streams, the version and source commit (standard library)
    (
        "fedudp",
        "fedudp.errors",
        "fedudp.randomness",
        "fedudp.provenance",
        "fedudp.plain",
        "fedudp.stopping",
    ),
    ("fedudp.privacy",),  # privacy math: accountant, mechanisms, audit statistics
    ("fedudp.config",),  # the configuration schema and its validation
    ("fedudp.data", "fedudp.models"),
    ("fedudp.aggregators",),  # the user-level mean estimators
    ("fedudp.protocol",),  # what passes between the two sides: messages, methods, checkpoints
    ("fedudp.owner", "fedudp.billboard"),  # the two sides of joint DP, side by side
    ("fedudp.algorithms",),  # the seeds' training algorithms
    ("fedudp.build",),  # the config builder: the one reader of a RunConfig
    ("fedudp.engines",),  # local and Flower engines (owners build their side)
]
TOP = len(LAYERS)  # run, tracking, report, report_plots, paper_report, api, audit, leak,
# flwr_entry


def layer(module: str) -> int:
    best, depth = TOP, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            within = module == n or (n != "fedudp" and module.startswith(n + "."))
            if within and n.count(".") > depth:
                best, depth = i, n.count(".")
    return best


def modules() -> dict[str, Path]:
    out = {}
    for p in PACKAGE.rglob("*.py"):
        parts = p.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "fedudp"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "fedudp":
                continue
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
    return out - {"fedudp"}


def test_every_import_runs_downward():
    known = modules()
    assert len(known) > 40 and "fedudp.privacy.accountant" in known
    upward = [
        f"{name} (layer {layer(name)}) imports {m} (layer {layer(m)})"
        for name, path in sorted(known.items())
        for m in sorted(imported(name, path, known))
        if layer(m) > layer(name)
    ]
    assert not upward, "\n".join(upward)


def test_privacy_math_knows_no_estimator_round_runner_or_config():
    known = modules()
    for name, path in known.items():
        if layer(name) == 1:
            assert not {
                m
                for m in imported(name, path, known)
                if m.startswith(
                    (
                        "fedudp.config",
                        "fedudp.aggregators",
                        "fedudp.owner",
                        "fedudp.billboard",
                        "fedudp.protocol",
                        "fedudp.run",
                        "fedudp.engines",
                    )
                )
            }, name


def test_the_check_sees_imports_inside_functions(tmp_path):
    fake = tmp_path / "fedudp" / "privacy" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(
        "def f():\n    from fedudp.run import prepare\n    from ..owner import owners\n"
    )
    got = imported("fedudp.privacy.x", fake, {"fedudp.owner.owners": fake})
    assert got == {"fedudp.run", "fedudp.owner", "fedudp.owner.owners"}
    assert layer("fedudp.run") > layer("fedudp.owner.owners") > layer("fedudp.privacy.x")
