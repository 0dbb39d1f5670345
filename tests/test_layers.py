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
        "fedudp.registry",
        "fedudp.plugins",
        "fedudp.memory",
        "fedudp.notices",
        "fedudp.logs",
    ),
    ("fedudp.privacy",),  # privacy math: accountant, mechanisms, audit statistics
    # distributed DP's owner-side encoding and secure aggregation (simulated): rotation,
    # rounding, integer noise shares, pairwise masks; below the boundary types that carry them
    ("fedudp.secure",),
    ("fedudp.data", "fedudp.models"),
    # the boundary types both sides and every estimator share (Constraint, Contribution,
    # Sampling): below the estimators, which take and return them
    ("fedudp.protocol.contributions",),
    ("fedudp.aggregators",),  # the user-level mean estimators
    ("fedudp.protocol",),  # what passes between the two sides: messages, methods, checkpoints
    ("fedudp.owner", "fedudp.billboard"),  # the two sides of joint DP, side by side
    ("fedudp.algorithms",),  # the seeds' training algorithms
    # the configuration schema and its validation: just below the builder, so that nothing
    # below the builder imports it (its names come from the registries below)
    ("fedudp.config",),
    ("fedudp.build",),  # the config builder: the one reader of a RunConfig
    # the engine registry and the local engine (engine=flower: declared by name, in fedudp.flower)
    ("fedudp.engines",),
    ("fedudp.leak",),  # the joint-DP paper-mode leak pair
    ("fedudp.audit",),  # fedudp-audit: empirical privacy audits
    # run folders and MLflow (and the tracking files); the privacy cost of tuning
    ("fedudp.tracking", "fedudp.tracking_files", "fedudp.tuning"),
    ("fedudp.report.report",),  # the comparison table
    ("fedudp.report.paper_report", "fedudp.report.report_plots"),  # the paper's layouts, figures
    ("fedudp.report",),  # the package's names and fedudp-report's command (report.cli)
    ("fedudp.run", "fedudp.run_folder"),  # a prepared run on an engine, and its run folder
    # the Flower integration, one optional package (pip install 'fedudp[flower]'): the
    # user-level DP wrapper and mod for any Flower app, engine=flower's ServerApp and ClientApp,
    # and the `flwr run` entry (over the runner); the runner reaches it by name (fedudp.engines)
    ("fedudp.flower",),
    ("fedudp.api", "fedudp.cli", "fedudp.__main__"),  # the entry points
]
TOP = len(LAYERS)  # a module in no layer (test_every_module_has_a_layer fails)


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


def _walk(tree: ast.AST):
    """``ast.walk`` without the body of ``if __name__ == "__main__":`` (what ``python -m``
    runs, never an import of the module)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name)
            and node.test.left.id == "__name__"
            and any(
                isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators
            )
        ):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _walk(ast.parse(path.read_text())):
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


def test_every_module_has_a_layer():
    """No catch-all top layer: a new module is placed in ``LAYERS`` on purpose."""
    known = modules()
    assert not [name for name in sorted(known) if layer(name) == TOP]


def _graph(index_edges: bool = True) -> dict[str, set[str]]:
    """Module -> the fedudp modules it imports. ``index_edges=False`` leaves out a package's
    ``__init__`` importing its own submodules (the package's index of its members)."""
    known = modules()
    return {
        n: {
            m
            for m in imported(n, p, known)
            if m in known and (index_edges or p.name != "__init__.py" or not m.startswith(n + "."))
        }
        - {n}
        for n, p in known.items()
    }


def unit(module: str) -> str:
    """The entry of ``LAYERS`` a module belongs to (a package, or a module listed alone)."""
    best = ""
    for names in LAYERS:
        for n in names:
            within = module == n or (n != "fedudp" and module.startswith(n + "."))
            if within and len(n) > len(best):
                best = n
    return best or module


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    """No circle, imports inside functions included: none between the units of ``LAYERS``
    (a package, or a module listed alone: the three report modules each), and none between
    modules, a package's ``__init__`` importing its own members aside (its index; the members
    may import the package's names)."""
    graph = _graph()
    units: dict[str, set[str]] = {}
    for n, ms in graph.items():
        units.setdefault(unit(n), set()).update(unit(m) for m in ms)
    assert _cycles({u: ms - {u} for u, ms in units.items()}) == []
    assert _cycles(_graph(index_edges=False)) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert unit("fedudp.report.paper_report") != unit("fedudp.report.report")
    assert unit("fedudp.owner.dpsgd") == "fedudp.owner"


def _reach(start: set[str], graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return seen


def test_the_owner_and_the_billboard_never_import_each_other():
    """The two sides of joint DP are side by side (one layer) and neither reaches the other,
    directly or through any module it imports: personal parameters stay on the owner, and
    what crosses between them is ``fedudp.protocol``."""
    assert layer("fedudp.owner") == layer("fedudp.billboard") > layer("fedudp.protocol")
    graph = _graph()
    for side, other in (("fedudp.owner", "fedudp.billboard"), ("fedudp.billboard", "fedudp.owner")):
        mine = {n for n in graph if n == side or n.startswith(side + ".")}
        assert mine, side
        crossed = sorted(m for m in _reach(mine, graph) if m == other or m.startswith(other + "."))
        assert not crossed, (side, crossed)


# The Flower client side (``fedudp.flower.mod``, the client mod of any Flower app;
# ``fedudp.flower.client_app``, a SuperNode's ClientApp of engine=flower; and every module of
# ``fedudp.flower`` they import, such as the wire format they share with the server): the
# owner, the protocol, the data, the models, the privacy math, and the builder and config only
# to build this SuperNode's owner side from the run's config (``build.owners``,
# ``build.federation``, ``config_from_json``). Never the billboard, the round loop, the server
# engine, the strategy, the stop signals or a runner.
CLIENT_SIDE = ("fedudp.flower.mod", "fedudp.flower.client_app")
CLIENT_MAY_IMPORT = (
    "fedudp.owner",
    "fedudp.protocol",
    "fedudp.data",
    "fedudp.models",
    "fedudp.privacy",
    # a distributed mechanism's encoding and the owners' pairwise masks (the client's side of
    # the simulated secure aggregation)
    "fedudp.secure",
    "fedudp.randomness",
    "fedudp.errors",
    "fedudp.plain",
    "fedudp.flower.wire",
    "fedudp.flower.blocks",  # the public plan of owners per SuperNode and its records
    "fedudp.flower.actor_device",  # an actor's device check, its CPU replies and state
    "fedudp.flower.guard",
    "fedudp.flower.fast",
    "fedudp.flower.fast_data",
    "fedudp.flower.fast_checks",
    "fedudp.flower.secure_mod",
)
CLIENT_BUILDS_WITH = {
    "fedudp.build": {"owners", "federation"},
    "fedudp.config": {"config_from_json"},
}
FLOWER = "fedudp.flower"
# what imports fedudp.flower from outside it: the entry points only (the runner names
# fedudp.flower.server_app in the engine registry, by name: no import)
FLOWER_IMPORTERS = ("fedudp.api", "fedudp.cli", "fedudp.__main__")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _names_used(path: Path, module: str) -> set[str]:
    """What ``path`` takes from ``module``: names imported from it, attributes of its alias."""
    tree = ast.parse(path.read_text())
    names, aliases = set(), set()
    parent, _, leaf = module.rpartition(".")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == module:
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module == parent:
            aliases |= {a.asname or a.name for a in node.names if a.name == leaf}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == module and a.asname}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
        ):
            names.add(node.attr)
    return names


def _client_violations(name: str, path: Path, known: dict[str, Path]) -> list[str]:
    got = imported(name, path, known)
    bad = [
        m
        for m in sorted(got)
        if not any(_within(m, a) for a in CLIENT_MAY_IMPORT) and m not in CLIENT_BUILDS_WITH
    ]
    for module, allowed in CLIENT_BUILDS_WITH.items():
        bad += [f"{module}.{n}" for n in sorted(_names_used(path, module) - allowed)]
    return bad


def _inside(start: tuple[str, ...], graph: dict[str, set[str]]) -> set[str]:
    """``start`` and every module of ``fedudp.flower`` it imports, through such modules."""
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(x for x in graph.get(m, ()) if x.startswith(FLOWER + "."))
    return seen


def _imports_of(
    start: tuple[str, ...], graph: dict[str, set[str]], forbidden: str
) -> list[tuple[str, str]]:
    """(module, import) pairs: a module of ``_inside(start)`` importing ``forbidden``."""
    return sorted(
        (m, x) for m in _inside(start, graph) for x in graph.get(m, ()) if _within(x, forbidden)
    )


def _with_fake(graph: dict[str, set[str]], name: str, source: str, tmp_path: Path) -> dict:
    """``graph`` with module ``name`` as written in ``source`` (a weakened twin)."""
    fake = tmp_path / (name.rpartition(".")[2] + ".py")
    fake.write_text(source)
    known = modules()
    return {**graph, name: imported(name, fake, {**known, name: fake}) - {name}}


def test_the_flower_client_side_imports_only_the_owner_side(tmp_path):
    known, graph = modules(), _graph()
    client = _inside(CLIENT_SIDE, graph)
    assert {"fedudp.flower.wire", "fedudp.flower.guard", "fedudp.flower.fast"} <= client
    for name in sorted(client):
        assert not _client_violations(name, known[name], known), name
    # the check sees a billboard import and a builder function beyond the owner side's
    fake = tmp_path / "client.py"
    fake.write_text(
        "from fedudp import build\nfrom fedudp.billboard.rounds import run_rounds\n"
        "build.owners(cfg)\nbuild.prepare(cfg)\nfrom fedudp.flower import UserLevelDP\n"
    )
    assert _client_violations("fedudp.flower.x", fake, known) == [
        "fedudp.billboard.rounds",
        "fedudp.flower",
        "fedudp.build.prepare",
    ]


def test_the_flower_mod_and_client_app_never_import_the_billboard(tmp_path):
    """Neither the mod nor the engine's ClientApp, nor any module of the package they import,
    imports ``fedudp.billboard``; the mod reaches nothing of it even through the modules below
    (the ClientApp builds its owner side with the builder, which knows both sides)."""
    graph = _graph()
    assert _imports_of(CLIENT_SIDE, graph, "fedudp.billboard") == []
    assert not [m for m in _reach({"fedudp.flower.mod"}, graph) if _within(m, "fedudp.billboard")]
    # weakened twin: the wire format (imported by both) reaching for the release gate, caught
    twin = _with_fake(
        graph,
        "fedudp.flower.wire",
        "from fedudp.protocol.messages import OwnerReply\n"
        "def f():\n    from fedudp.billboard.release import ReleaseGate\n",
        tmp_path,
    )
    assert _imports_of(CLIENT_SIDE, twin, "fedudp.billboard") == [
        ("fedudp.flower.wire", "fedudp.billboard.release")
    ]


def test_the_flower_strategy_never_imports_the_owner_side(tmp_path):
    """The server-side wrapper (and what it imports of the package) imports nothing of
    ``fedudp.owner``: it sees the clients' replies, never their training (the builder it
    calibrates the estimator with is the one place that knows both sides)."""
    graph = _graph()
    server = _inside(("fedudp.flower.strategy",), graph)
    assert {"fedudp.flower.collect", "fedudp.flower.wire", "fedudp.flower.outcome"} <= server
    assert _imports_of(("fedudp.flower.strategy",), graph, "fedudp.owner") == []
    # weakened twin: the replies' reader importing the owner's isolation rule, caught
    twin = _with_fake(
        graph,
        "fedudp.flower.collect",
        "from fedudp.owner.isolate import isolated_reply\n",
        tmp_path,
    )
    assert _imports_of(("fedudp.flower.strategy",), twin, "fedudp.owner") == [
        ("fedudp.flower.collect", "fedudp.owner.isolate")
    ]


def _flower_importers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, import): a module outside ``fedudp.flower`` importing it, not an entry point."""
    return sorted(
        (m, x)
        for m, xs in graph.items()
        if not _within(m, FLOWER) and not any(_within(m, e) for e in FLOWER_IMPORTERS)
        for x in xs
        if _within(x, FLOWER)
    )


def test_only_the_entry_points_import_fedudp_flower(tmp_path):
    """``fedudp.flower`` is one box of the import graph: nothing outside it imports it except
    the entry points; the runner reaches engine=flower through the registry, by name."""
    from fedudp.engines import ENGINES

    graph = _graph()
    assert _flower_importers(graph) == []
    assert layer(FLOWER) == layer("fedudp.run") + 1 == layer("fedudp.api") - 1
    assert unit("fedudp.flower.strategy") == unit("fedudp.flower.server_app") == FLOWER
    declared = ENGINES.get("flower").module
    assert declared in modules() and _within(declared, FLOWER)
    # weakened twin: the runner importing the Flower engine again, caught
    twin = _with_fake(
        graph,
        "fedudp.run",
        "def execute(p):\n    from fedudp.flower.server_app import execute as on_engine\n",
        tmp_path,
    )
    assert _flower_importers(twin) == [("fedudp.run", "fedudp.flower.server_app")]


def test_nothing_below_the_builder_imports_the_config():
    """The configuration sits right below the builder: every module under it takes plain
    values (the choices they share live in ``fedudp.protocol.choices``, errors in
    ``fedudp.errors``, ``jsonable`` in ``fedudp.plain``)."""
    known = modules()
    below = [
        name
        for name, path in sorted(known.items())
        if layer(name) < layer("fedudp.config")
        and any(m.startswith("fedudp.config") for m in imported(name, path, known))
    ]
    assert not below, below
    assert layer("fedudp.config") == layer("fedudp.build") - 1
