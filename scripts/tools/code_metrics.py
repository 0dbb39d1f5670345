"""The repository's size figures: big modules, long functions, modules without ``__all__``.

    .venv/bin/python scripts/tools/code_metrics.py            # this checkout
    .venv/bin/python scripts/tools/code_metrics.py --root /tmp/before --json

Counts, for a checkout's ``fedudp/`` package: modules over ``--module-lines`` lines (600),
functions and methods over ``--function-lines`` lines (80, from ``def`` to the last line of the
body, decorators aside, read with ``ast``), public modules without ``__all__`` (a module whose
name and whose packages' names do not start with ``_``; ``__init__``/``__main__`` count as
their package), and, from ``git ls-files``, the tracked files under ``docs/results/`` and the
lines of the ``.py`` files under ``scripts/``; the package's lines, and how many of them are
docstrings (module, class and function docstrings). Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _public(rel: Path) -> bool:
    parts = rel.with_suffix("").parts
    return not any(p.startswith("_") and p not in ("__init__", "__main__") for p in parts)


def metrics(root: Path, module_lines: int = 600, function_lines: int = 80) -> dict:
    """The figures of the checkout at ``root`` (a dict of counts and the offending names)."""
    pkg = root / "fedudp"
    big, long_fns, no_all, n_modules, doc_lines = [], [], [], 0, 0
    for path in sorted(pkg.rglob("*.py")):
        rel = path.relative_to(root)
        n_modules += 1
        text = path.read_text()
        lines = text.count("\n") + (not text.endswith("\n") and bool(text))
        if lines > module_lines:
            big.append((str(rel), lines))
        tree = ast.parse(text)
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (
                isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                doc_lines += body[0].end_lineno - body[0].lineno + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > function_lines:
                    long_fns.append((f"{rel}:{node.name}", n))
        has_all = any(
            isinstance(n, (ast.Assign, ast.AnnAssign))
            and any(
                isinstance(t, ast.Name) and t.id == "__all__"
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            )
            for n in tree.body
        )
        if _public(rel.relative_to("fedudp")) and not has_all and rel.name != "__main__.py":
            no_all.append(str(rel))

    def git(*args: str) -> list[str]:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return [x for x in out.stdout.splitlines() if x]

    results = git("ls-files", "docs/results")
    scripts = [f for f in git("ls-files", "scripts") if f.endswith(".py")]
    script_lines = sum((root / f).read_text().count("\n") for f in scripts if (root / f).exists())
    return {
        "modules": n_modules,
        "package_lines": sum(p.read_text().count("\n") for p in pkg.rglob("*.py")),
        "docstring_lines": doc_lines,
        f"modules_over_{module_lines}": sorted(big, key=lambda x: -x[1]),
        f"functions_over_{function_lines}": sorted(long_fns, key=lambda x: -x[1]),
        "public_modules_without_all": no_all,
        "docs_results_files": len(results),
        "scripts_py_files": len(scripts),
        "scripts_lines": script_lines,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="a checkout (default: this one)")
    ap.add_argument("--module-lines", type=int, default=600)
    ap.add_argument("--function-lines", type=int, default=80)
    ap.add_argument("--json", action="store_true", help="print every name, as JSON")
    a = ap.parse_args()
    m = metrics(a.root.resolve(), a.module_lines, a.function_lines)
    if a.json:
        print(json.dumps(m, indent=1))
        return
    for k, v in m.items():
        if isinstance(v, list):
            print(f"{k}: {len(v)}")
            for item in v:
                print("   ", *item) if isinstance(item, tuple) else print("   ", item)
        else:
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
