"""Replace the measuring machine's absolute paths in committed result files with placeholders.

A run folder records where its data and its checkout were (config.yaml, Hydra's files, logs).
Those paths mean nothing on another machine and must not point outside the repository, so the
result scripts scrub each finished run, and this script scrubs folders already written:

    .venv/bin/python scripts/tools/scrub_paths.py --replace /path/to/data=DATA --replace /x/FED.npz=FED.npz \
        docs/results/SOME_RESULT

The checkout's own root becomes ``.`` (repository-relative). Only text files are touched, and
only the exact strings given.
"""

from __future__ import annotations

import argparse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEXT = {".yaml", ".yml", ".json", ".jsonl", ".log", ".out", ".csv", ".md", ".txt"}


def scrub(folder: Path, replace: dict[str, str]) -> int:
    """Rewrite every text file under ``folder``: each key of ``replace`` becomes its value, the
    checkout's root becomes ``.``; the number of files changed."""
    pairs = sorted(
        {**replace, str(ROOT) + "/": "", str(ROOT): "."}.items(), key=lambda kv: -len(kv[0])
    )
    changed = 0
    for p in sorted(Path(folder).rglob("*")):
        if not p.is_file() or p.suffix not in TEXT:
            continue
        text = p.read_text(errors="surrogateescape")
        new = text
        for old, value in pairs:
            if old:
                new = new.replace(old, value)
        if new != text:
            p.write_text(new, errors="surrogateescape")
            changed += 1
    return changed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--replace", action="append", default=[], metavar="PATH=NAME", help="repeat for each path"
    )
    ap.add_argument("folders", nargs="+", type=Path)
    a = ap.parse_args()
    pairs = {}
    for item in a.replace:
        if "=" not in item:
            raise SystemExit(f"scrub_paths.py: error: --replace {item!r}: write PATH=NAME")
        old, new = item.split("=", 1)
        pairs[old.rstrip("/")] = new
    for f in a.folders:
        print(f"{f}: {scrub(f, pairs)} files changed")


if __name__ == "__main__":
    main()
