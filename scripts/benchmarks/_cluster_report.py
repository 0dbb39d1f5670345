"""The Markdown tables and the plot of ``bench_cluster.py``'s rows (``--report``).

Grid rows are grouped by their configuration (``KEY`` without the repetition); a group's
numbers are the minimum and the median over its repetitions.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

__all__ = ["table", "sections", "report", "plot"]

KEY = ("owners", "engine", "per", "nodes", "features", "rpu", "npz", "variant")
MIB = 2**20


def table(rows: list[dict]) -> str:
    """One line per run: owners, engine, owners a node, nodes, s/round, connect, peak RSS.

    Parameters
    ----------
    rows : list[dict]
        ``results.json``'s rows.

    Returns
    -------
    str
    """
    head = (
        "| owners | engine | owners/node | nodes | s/round | connect s | actor peak RSS MiB "
        "| driver peak RSS MiB | wall s |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    body = ""
    for r in rows:
        body += (
            f"| {r['owners']} | {r['engine']} | {r['per'] if r['engine'] == 'flower' else '-'} "
            f"| {r.get('flower_nodes') or '-'} | {r['s_per_round']} | {r['connect_s'] or '-'} "
            f"| {', '.join(map(str, r['actor_peak_rss_mib'])) or '-'} "
            f"| {r['driver_peak_rss_mib']} | {r['wall_s']} |\n"
        )
    return head + body


def _groups(rows: list[dict], grid: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("grid") == grid and "error" not in r and r.get("s_per_round") is not None:
            out.setdefault(tuple(r.get(k) for k in KEY), []).append(r)
    return out


def _mm(xs: list[float], nd: int = 3) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{round(xs[0], nd)}"
    return f"{round(min(xs), nd)} / {round(statistics.median(xs), nd)}"


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _label(r: dict) -> str:
    if r["engine"] == "local":
        return "local"
    return f"flower, {r['nodes']} node{'s' if r['nodes'] > 1 else ''}"


def _rss(g: list[dict], field: str = "actor_peak_rss_mib") -> str:
    per_actor = list(zip(*(r[field] for r in g if r[field])))
    return ", ".join(str(round(_med(list(a)))) for a in per_actor) or "-"


def _scale(rows: list[dict], grid: str) -> str:
    groups = _groups(rows, grid)
    local = {
        (k[0], k[4], k[5]): _med([r["s_per_round"] for r in g])
        for k, g in groups.items()
        if k[1] == "local"
    }
    out = (
        "| owners | features × records/user | engine | owners/node | s/round min / median "
        "| × local (medians) | connect s min / median | actor peak RSS MiB (median) "
        "| driver peak RSS MiB | wall s (median) | reps |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    for k, g in sorted(
        groups.items(),
        key=lambda kv: (
            kv[0][0],
            kv[0][4],
            kv[0][6] or "",
            kv[0][3],
            kv[0][1] != "local",
            kv[0][7],
        ),
    ):
        r0, s = g[0], [r["s_per_round"] for r in g]
        base = local.get((k[0], k[4], k[5]))
        ratio = "-" if k[1] == "local" or not base else f"{_med(s) / base:.2f}"
        variant = f" ({r0['variant']})" if r0.get("variant") else ""
        out += (
            f"| {k[0]} | {k[4]} × {k[5]} | {_label(r0)}{variant} "
            f"| {k[2] if k[1] == 'flower' else '-'} | {_mm(s)} | {ratio} "
            f"| {_mm([r['connect_s'] for r in g], 2)} | {_rss(g)} "
            f"| {round(_med([r['driver_peak_rss_mib'] for r in g]))} "
            f"| {_med([r['wall_s'] for r in g]):.0f} | {len(g)} |\n"
        )
    return out


def _memory(rows: list[dict], baseline: float) -> str:
    out = (
        "| owners | engine | owners/node | block's features MiB | actor peak RSS MiB "
        "| actor peak anon RSS MiB | RSS − baseline MiB | (RSS − baseline) / block "
        "| driver peak RSS MiB | s/round |\n|---|---|---|---|---|---|---|---|---|---|\n"
    )
    for k, g in sorted(
        _groups(rows, "memory").items(), key=lambda kv: (kv[0][0], kv[0][1] != "local", kv[0][3])
    ):
        r0 = g[0]
        whole = k[0] * 10 * k[5] * k[4] * 4 / MIB
        block = whole / 2 if k[1] == "flower" else whole
        rss = [_med(list(a)) for a in zip(*(r["actor_peak_rss_mib"] for r in g))]
        extra = ", ".join(f"{x - baseline:.0f}" for x in rss) or "-"
        ratio = ", ".join(f"{(x - baseline) / block:.2f}" for x in rss) or "-"
        out += (
            f"| {k[0]} | {_label(r0)} | {k[2] if k[1] == 'flower' else '-'} "
            f"| {block:.0f}{' (all)' if k[1] == 'local' else ''} | {_rss(g)} "
            f"| {_rss(g, 'actor_peak_anon_mib')} | {extra} | {ratio} "
            f"| {round(_med([r['driver_peak_rss_mib'] for r in g]))} "
            f"| {_mm([r['s_per_round'] for r in g])} |\n"
        )
    return out


def _points(rows: list[dict]) -> str:
    out = (
        "| owners | nodes | run called | actor processes started | first seen as actors "
        "| `_connect` start | nodes listed | first query answered | connect s |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    for k, g in sorted(_groups(rows, "scale").items()):
        if k[1] != "flower":
            continue
        for r in g:
            p = r["connect_points"]
            out += (
                f"| {k[0]} | {k[3]} | {p['run_called']} "
                f"| {', '.join(map(str, p['actor_process_started']))} "
                f"| {', '.join(map(str, p['actor_first_seen']))} | {p['connect_start']} "
                f"| {p['nodes_listed']} | {p['connect_end']} | {r['connect_s']} |\n"
            )
    return out


def _trace(rows: list[dict]) -> str:
    out = (
        "| owners | nodes | rep | actor (node) | blocks read (first owner, in order) "
        "| block_side calls | actor peak RSS MiB | actor peak anon MiB | rounds 1–3 s |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    for r in rows:
        if r.get("grid") != "trace" or "actor_blocks" not in r:
            continue
        for i, served in enumerate(r["actor_blocks"]):
            read = ", ".join(str(b[0]) for b in served if b[1]) or "-"
            out += (
                f"| {r['owners']} | {r['nodes']} | {r['rep']} | {i} ({r['actor_node'][i]}) "
                f"| {read} | {len(served)} | {r['actor_peak_rss_mib'][i]} "
                f"| {r['actor_peak_anon_mib'][i]} "
                f"| {', '.join(str(x) for x in r['round_s'][:3])} |\n"
            )
    return out


def sections(path: Path) -> dict[str, str]:
    """The grids' tables of ``results.json``, by grid (``POINTS``: the scale grid's connect
    time points).

    Parameters
    ----------
    path : pathlib.Path
        ``results.json``.

    Returns
    -------
    dict[str, str]
        ``SCALE``, ``POINTS``, ``OVERHEAD``, ``POLL``, ``HEAVY``, ``MEMORY``, ``TRACE``:
        Markdown tables.
    """
    rows = json.loads(path.read_text())
    base = [
        a
        for r in rows
        if r.get("grid") == "scale" and r["engine"] == "flower" and r["owners"] == 1000
        for a in r["actor_peak_rss_mib"]
    ]
    out = {g.upper(): _scale(rows, g) for g in ("scale", "overhead", "poll", "heavy")}
    out["POINTS"] = _points(rows)
    out["MEMORY"] = _memory(rows, _med(base) if base else 0.0)
    out["TRACE"] = _trace(rows)
    return out


def report(path: Path) -> str:
    """The grids' tables (``sections``), one after the other.

    Parameters
    ----------
    path : pathlib.Path
        ``results.json``.

    Returns
    -------
    str
    """
    return "\n".join(f"## {k.lower()}\n\n{v}" for k, v in sections(path).items())


def plot(path: Path, png: Path) -> None:
    """s/round against owners (scale grid) and actor peak RSS against the block's features
    (memory grid), one PNG.

    Parameters
    ----------
    path, png : pathlib.Path
        ``results.json`` and the figure written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(path.read_text())
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    groups = _groups(rows, "scale")
    for lab in ("local", "flower, 1 node", "flower, 2 nodes"):
        pts = sorted(
            (k[0], _med([r["s_per_round"] for r in g]), min(r["s_per_round"] for r in g))
            for k, g in groups.items()
            if _label(g[0]) == lab
        )
        if pts:
            a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{lab} (median)")
    a.set(
        xscale="log",
        yscale="log",
        xlabel="owners",
        ylabel="s / round (rounds 2..3)",
        title="joint_dp, 20 features, n/2 owners a node (before 3772818)",
    )
    a.legend()
    series = (
        ("memory", "flower, 1 node", "o", ""),
        ("memory", "flower, 2 nodes", "s", ""),
        ("pinned_memory", "flower, 1 node", "^", " (3772818: nodes pinned)"),
        ("pinned_memory", "flower, 2 nodes", "v", " (3772818: nodes pinned)"),
    )
    for grid, lab, mark, note in series:
        xs, ys = [], []
        for k, g in _groups(rows, grid).items():
            if _label(g[0]) == lab:
                for r in g:
                    for x in r["actor_peak_rss_mib"]:
                        xs.append(k[0] / 2 * 10 * k[5] * k[4] * 4 / MIB)
                        ys.append(x)
        if xs:
            b.plot(xs, ys, mark, label=lab + note, alpha=0.7)
    base = [
        a
        for r in rows
        if r.get("grid") == "scale" and r["engine"] == "flower" and r["owners"] == 1000
        for a in r["actor_peak_rss_mib"]
    ]
    if base:
        xs = [0.0, 400.0]
        b.plot(xs, [_med(base) + 4 * x for x in xs], "k--", lw=0.8, label="baseline + 4 × block")
        b.plot(xs, [_med(base) + 2.7 * x for x in xs], "k:", lw=0.8, label="baseline + 2.7 × block")
    b.set(
        xlabel="block's features (MiB)",
        ylabel="actor peak RSS (MiB)",
        title="npz read by row, 1000 float32 features",
    )
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
