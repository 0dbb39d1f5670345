"""Tool: are two run folders the same run, bit for bit? Compares metrics.jsonl and ledger.jsonl
row by row (every field but wall-clock times) and summary.json's accuracies and ε; prints the
first differing field of each file. Answers "did this change move any number?" (a refactor,
an upgrade): run the same command on both trees into two folders, then

    python scripts/tools/compare_runs.py BEFORE_RUN_DIR AFTER_RUN_DIR

Exit status 0 when identical, 1 when anything differs, 2 when a folder is not a finished run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TIMES = ("seconds", "time", "wall")  # wall-clock fields: never equal between two runs


def rows(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out.append({k: v for k, v in r.items() if not any(t in k for t in TIMES)})
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("before", type=Path, help="the first run folder (metrics.jsonl, ledger.jsonl)")
    ap.add_argument("after", type=Path, help="the second run folder")
    args = ap.parse_args(argv)
    a, b = args.before, args.after
    for d in (a, b):
        missing = [
            n for n in ("metrics.jsonl", "ledger.jsonl", "summary.json") if not (d / n).is_file()
        ]
        if missing:
            ap.error(f"{d} is not a finished run folder (no {', '.join(missing)})")
    same = True
    for name in ("metrics.jsonl", "ledger.jsonl"):
        ra, rb = rows(a / name), rows(b / name)
        ok = ra == rb
        same &= ok
        print(f"{name}: {len(ra)} vs {len(rb)} rows, {'identical' if ok else 'DIFFERENT'}")
        for x, y in zip(ra, rb):
            if x != y:
                diff = {
                    k: (x.get(k), y.get(k)) for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)
                }
                print(f"  first difference: {diff}")
                break
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for key in ("accuracy_mean", "accuracy_weighted", "loss", "epsilon"):
        ok = sa.get(key) == sb.get(key)
        same &= ok
        print(f"summary {key}: {sa.get(key)!r} vs {sb.get(key)!r}{'' if ok else '  DIFFERENT'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
