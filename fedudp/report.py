"""Results folders -> comparison tables (ARCHITECTURE.md §6).

``fedudp-report <sweep dir>`` reads every ``summary.json`` below a folder and prints a
markdown table grouped by configuration (mean ± std over seeds). The Hydra callback prints
the same table at the end of a multirun, so the quickstart ends with the comparison.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

try:
    from hydra.experimental.callback import Callback
except Exception:  # pragma: no cover - hydra is a hard dependency; keep report importable
    Callback = object  # type: ignore[misc,assignment]

KEY_FIELDS = ("method", "aggregator", "accounting", "unit", "target_epsilon", "num_owners",
              "placement", "dataset")


def load_summaries(folder: str | Path) -> list[dict]:
    """Every run's summary below ``folder``, with its folder (``_dir``) and, where the run wrote
    one, its resolved config (``_config``, a dict)."""
    out = []
    for p in sorted(Path(folder).rglob("summary.json")):
        try:
            s = json.loads(p.read_text())
        except json.JSONDecodeError:
            continue
        s["_dir"] = str(p.parent)
        cfg = p.parent / "config.yaml"
        if cfg.is_file():
            from omegaconf import OmegaConf
            s["_config"] = OmegaConf.to_container(OmegaConf.load(cfg))
        out.append(s)
    return out


def _fmt(vals: list[float | None], digits: int = 4) -> str:
    xs = [v for v in vals if v is not None]
    if not xs:
        return "n/a"
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{np.mean(xs):.{digits}f} ± {np.std(xs):.{digits}f}"


def comparison_table(summaries: list[dict]) -> str:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in summaries:
        groups[tuple(s.get(k) for k in KEY_FIELDS)].append(s)
    lines = ["| method | aggregator | accounting | unit | owners | accuracy (mean over owners) "
             "| weighted | epsilon (delta) | guarantee | rounds | seconds | runs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = {"per_silo": 0, "fedavg": 1, "full_dp": 2, "joint_dp": 3}
    for key in sorted(groups, key=lambda k: (order.get(k[0], 9), str(k))):
        ss = groups[key]
        eps = _fmt([s.get("epsilon") for s in ss], 3)
        delta = ss[0].get("delta")
        eps_s = f"{eps} ({delta:g})" if delta is not None else "n/a (no DP)"
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2] or '-'} | {key[3] or '-'} | {key[5]} | "
            f"{_fmt([s['accuracy_mean'] for s in ss])} | {_fmt([s['accuracy_weighted'] for s in ss])} | "
            f"{eps_s} | {ss[0].get('guarantee')} | {ss[0].get('rounds_completed')} | "
            f"{_fmt([s.get('seconds') for s in ss], 1)} | {len(ss)} |")
    return "\n".join(lines)


class ComparisonCallback(Callback):  # type: ignore[misc]
    """Prints the comparison table when a Hydra multirun ends."""

    def on_multirun_end(self, config, **kwargs) -> None:  # noqa: ANN001
        folder = Path(config.hydra.sweep.dir)
        summaries = load_summaries(folder)
        if summaries:
            table = comparison_table(summaries)
            (folder / "comparison.md").write_text(table + "\n")
            print("\n" + table + f"\n\n(results in {folder})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fedudp-report", description=__doc__)
    ap.add_argument("folder", help="a run or sweep folder (searched recursively for summary.json)")
    ap.add_argument("--paper", choices=sorted(PAPER_LAYOUTS),
                    help="the paper's layout beside its numbers (Markdown, CSV and PNG in --out)")
    ap.add_argument("--out", help="folder for the --paper table and plots (default: FOLDER)")
    a = ap.parse_args(argv)
    summaries = load_summaries(a.folder)
    if not summaries:
        print(f"fedudp-report: no summary.json under {a.folder}", file=sys.stderr)
        return 2
    if a.paper:
        from fedudp.paper_report import write_paper_report
        print(write_paper_report(a.paper, summaries, Path(a.out or a.folder)))
        return 0
    print(comparison_table(summaries))
    return 0


PAPER_LAYOUTS = {"huang_table1", "huang_table2", "huang_table4", "huang_fig1"}


if __name__ == "__main__":
    raise SystemExit(main())
