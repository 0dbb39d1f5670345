"""scripts/tools/import_graph.py: it finds what tests/test_layers.py forbids (a cycle, an upward
import) in a checkout built for the test, draws it, and finds none in this checkout."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location(
        "import_graph", ROOT / "scripts" / "tools" / "import_graph.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_cycle_and_an_upward_import_are_found_and_drawn(tmp_path, capsys):
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "test_layers.py", tmp_path / "tests" / "test_layers.py")
    pkg = tmp_path / "fedudp"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "stopping.py": "def f():\n    from fedudp.run import x\n",  # layer 0 -> the runner
        "run.py": "x = 1\n",
        "tracking.py": "from fedudp.tuning import t\n",  # one layer, in a circle
        "tuning.py": "def t():\n    from fedudp.tracking import x\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    tool = _tool()
    a = tool.analyse(tmp_path)
    assert a["upward"] == [("fedudp.stopping", "fedudp.run")]
    assert a["unit_cycles"] == [["fedudp.tracking", "fedudp.tuning"]]
    assert a["module_cycles"] == [["fedudp.tracking", "fedudp.tuning"]]
    assert a["bad_edges"] == {
        ("fedudp.stopping", "fedudp.run"),
        ("fedudp.tracking", "fedudp.tuning"),
        ("fedudp.tuning", "fedudp.tracking"),
    }
    out = tmp_path / "graph.png"
    assert tool.main(["--root", str(tmp_path), "--out", str(out)]) == 1
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "upward: fedudp.stopping (layer 0) imports fedudp.run" in printed
    assert "cycle between units: fedudp.tracking <-> fedudp.tuning" in printed


def test_this_checkout_has_no_cycle_and_no_upward_import(capsys):
    assert _tool().main([]) == 0
    assert "no cycle, no upward import" in capsys.readouterr().out


def test_a_declaration_by_name_is_drawn_dashed_and_not_counted(tmp_path, capsys):
    """The engine registry names ``fedudp.flower.server_app`` (a layer above it) by name: the
    tool finds the declaration, draws it apart, and counts it neither as an import nor as an
    upward one; the same module imported instead is an upward import (the weakened twin)."""
    (tmp_path / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "test_layers.py", tmp_path / "tests" / "test_layers.py")
    pkg = tmp_path / "fedudp"
    (pkg / "engines").mkdir(parents=True)
    (pkg / "flower").mkdir()
    for name in ("__init__.py", "flower/__init__.py", "flower/server_app.py", "run.py"):
        (pkg / name).write_text("")
    (pkg / "engines" / "__init__.py").write_text(
        'ENGINES = {}\nENGINES["flower"] = dict(module="x")\n'
        'def Engine(module):\n    return module\nFLOWER = Engine("fedudp.flower.server_app")\n'
    )
    tool = _tool()
    a = tool.analyse(tmp_path)
    assert a["by_name"] == {("fedudp.engines", "fedudp.flower")}
    assert ("fedudp.engines", "fedudp.flower") not in a["edges"] and a["upward"] == []
    assert tool.main(["--root", str(tmp_path), "--out", str(tmp_path / "g.png")]) == 0
    assert "by name (not an import): fedudp.engines declares fedudp.flower" in (
        capsys.readouterr().out
    )
    (pkg / "engines" / "__init__.py").write_text("from fedudp.flower import server_app\n")
    twin = tool.analyse(tmp_path)
    assert twin["by_name"] == set()
    assert ("fedudp.engines", "fedudp.flower.server_app") in twin["upward"]
