"""``fedudp-report SWEEP --plots``: accuracy and ε per round, and the privacy–utility frontier,
one line per group of the comparison table; a heuristic ε marked in both. The sweep behind the
tests is real (five tiny runs of two rounds on the embedded synthetic data)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

import fedudp
from conftest import tiny_cfg
from fedudp.privacy.labels import metric_epsilon
from fedudp.report import comparison_table, load_summaries, main as report_main
from fedudp.report.report_plots import frontier_lines, group_series, write_report

# five real runs build the sweep (~10 s): in the slow suite, the default one is at its budget
pytestmark = pytest.mark.slow

RUNS = {  # folder: (method, overrides)
    "joint_eps1_seed0": ("joint_dp", {"privacy.epsilon": 1.0, "seed": 0}),
    "joint_eps1_seed1": ("joint_dp", {"privacy.epsilon": 1.0, "seed": 1}),
    "joint_eps8_seed0": ("joint_dp", {"privacy.epsilon": 8.0, "seed": 0}),
    "joint_eps1_paper": ("joint_dp", {"privacy.epsilon": 1.0, "privacy.accounting": "paper"}),
    "fedavg": ("fedavg", {}),
}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot_sweep")
    for name, (method, kw) in RUNS.items():
        fedudp.simulate(
            tiny_cfg(method, train__rounds=2, **{k.replace(".", "__"): v for k, v in kw.items()}),
            out=root / "sweep" / name,
        )
    return root / "sweep"


def metrics(folder):
    return [json.loads(x) for x in (Path(folder) / "metrics.jsonl").read_text().splitlines()]


def by_label(series):
    return {g.label: g for g in series}


def png_size(path):
    blob = Path(path).read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and blob[12:16] == b"IHDR"
    return struct.unpack(">II", blob[16:24])


def test_one_series_per_table_row_with_the_runs_metrics(sweep):
    summaries = load_summaries(sweep)
    series = group_series(summaries)
    rows = [ln for ln in comparison_table(summaries).splitlines() if ln.startswith("| ")][1:]
    assert len(series) == len(rows) == 4
    g = by_label(series)
    assert set(g) == {
        "method=fedavg, privacy.epsilon=1.0, privacy.accounting=certified",
        "method=joint_dp, privacy.epsilon=1.0, privacy.accounting=certified",
        "method=joint_dp, privacy.epsilon=1.0, privacy.accounting=paper",
        "method=joint_dp, privacy.epsilon=8.0, privacy.accounting=certified",
    }
    two = g["method=joint_dp, privacy.epsilon=1.0, privacy.accounting=certified"]
    assert sorted(Path(r.folder).name for r in two.runs) == ["joint_eps1_seed0", "joint_eps1_seed1"]
    for s in series:
        for r in s.runs:  # each run: its metrics.jsonl, round by round
            lines = metrics(r.folder)
            assert r.accuracy == {m["round"]: m["accuracy_mean"] for m in lines}
            # a heuristic run's lines name it epsilon_heuristic (issue 49): read both
            assert r.epsilon == {
                m["round"]: metric_epsilon(m) for m in lines if metric_epsilon(m) is not None
            }
            if s.heuristic:
                assert all("epsilon" not in m for m in lines)
            assert list(r.accuracy) == [1, 2]
        for rnd in (1, 2):  # the thick line: the mean over the seeds
            assert s.accuracy[rnd] == pytest.approx(np.mean([r.accuracy[rnd] for r in s.runs]))
        finals = [json.loads((Path(r.folder) / "summary.json").read_text()) for r in s.runs]
        assert s.final_accuracy == pytest.approx(np.mean([f["accuracy_mean"] for f in finals]))
    assert two.runs[0].accuracy != two.runs[1].accuracy  # two seeds, two curves
    assert two.final_accuracy_std > 0
    assert [s.heuristic for s in series] == [False, False, True, False]
    assert g[
        "method=joint_dp, privacy.epsilon=1.0, privacy.accounting=paper"
    ].display_label.endswith("[1 seed] (heuristic)")
    fedavg = g["method=fedavg, privacy.epsilon=1.0, privacy.accounting=certified"]
    assert not fedavg.private and fedavg.epsilon == {} and fedavg.epsilon_kind is None
    eps8 = g["method=joint_dp, privacy.epsilon=8.0, privacy.accounting=certified"]
    assert eps8.epsilon[2] == pytest.approx(eps8.final_epsilon) and eps8.final_epsilon <= 8.0
    assert eps8.deltas == (1e-5,)


def test_frontier_has_a_line_per_method_and_kind_and_no_dp_as_reference(sweep):
    lines, refs = frontier_lines(group_series(load_summaries(sweep)))
    got = {label: [g.final_epsilon for g in gs] for label, gs in lines}
    assert list(got) == [
        "method=joint_dp, privacy.accounting=certified",
        "method=joint_dp, privacy.accounting=paper (heuristic)",
    ]
    eps = got["method=joint_dp, privacy.accounting=certified"]
    assert len(eps) == 2 and eps == sorted(eps) and eps[1] > 7
    assert [g.method for g in refs] == ["fedavg"]


@pytest.fixture(scope="module")
def drawn(sweep, tmp_path_factory):
    """``fedudp-report SWEEP --plots --out OUT`` once: (OUT, what it printed, its figures)."""
    from matplotlib.figure import Figure

    out = tmp_path_factory.mktemp("plots") / "report"
    figures = {}
    save = Figure.savefig

    def keep(self, path, *a, **kw):
        figures[Path(path).name] = self
        return save(self, path, *a, **kw)

    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        mp.setattr(Figure, "savefig", keep)
        assert report_main([str(sweep), "--plots", "--out", str(out)]) == 0
    return out, printed.getvalue(), figures


def test_plots_draw_the_series_and_mark_the_heuristic_one(sweep, drawn):
    _, _, figures = drawn
    series = group_series(load_summaries(sweep))
    acc_ax, eps_ax = figures["curves.png"].axes
    lines = {ln.get_label(): ln for ln in acc_ax.get_lines() if not ln.get_label().startswith("_")}
    for s in series:  # the thick lines: the series, round by round
        ln = lines[s.display_label + ("" if s.private else " (no DP: no ε)")]
        assert list(ln.get_xdata()) == list(s.accuracy)
        assert list(ln.get_ydata()) == pytest.approx(list(s.accuracy.values()))
        assert (ln.get_linestyle(), ln.get_markerfacecolor() == "none") == (
            ("--", True) if s.heuristic else ("-", False)
        )
    assert len(lines) == len(series)
    eps_lines = [ln for ln in eps_ax.get_lines() if ln.get_linewidth() == 2]
    assert sorted(tuple(ln.get_ydata()) for ln in eps_lines) == sorted(
        tuple(s.epsilon.values()) for s in series if s.private
    )
    thin = [ln for ln in acc_ax.get_lines() if ln.get_linewidth() < 1]
    assert len(thin) == 2  # the two-seed group's seeds, drawn thinly
    two = next(s for s in series if len(s.runs) == 2)
    assert sorted(tuple(ln.get_ydata()) for ln in thin) == sorted(
        tuple(r.accuracy.values()) for r in two.runs
    )
    assert (
        acc_ax.get_xlabel() == "round" and acc_ax.get_ylabel() == "test accuracy (mean over owners)"
    )
    assert eps_ax.get_ylabel() == "ε spent at δ=1e-05 (cumulative)"
    legend = [t.get_text() for t in figures["curves.png"].legends[0].get_texts()]
    assert sum(t.endswith("(heuristic)") for t in legend) == 1
    [fax] = figures["frontier.png"].axes
    texts = [t.get_text() for t in fax.get_legend().get_texts()]
    assert "method=joint_dp, privacy.accounting=paper (heuristic)" in texts
    assert any(t.startswith("method=fedavg") and "(no DP, ε = ∞)" in t for t in texts)
    assert fax.get_xlabel().startswith("ε spent at δ=1e-05")
    assert fax.get_ylabel().startswith("final test accuracy (mean over owners)")
    assert fax.get_title().startswith("Privacy–utility frontier — sweep")


def test_cli_writes_the_table_and_two_pngs_beside_it(sweep, drawn, tmp_path, monkeypatch):
    out, printed, _ = drawn
    table = comparison_table(load_summaries(sweep))
    assert printed.startswith(table) and "wrote report.md, curves.png, frontier.png" in printed
    md = (out / "report.md").read_text()
    assert table in md and "![accuracy and ε per round](curves.png)" in md
    assert "![privacy–utility frontier](frontier.png)" in md and "(heuristic)" in md
    for name, (w_min, h_min) in (("curves.png", (1000, 450)), ("frontier.png", (700, 400))):
        w, h = png_size(out / name)
        assert w_min <= w <= 4000 and h_min <= h <= 3000, (name, w, h)
    # --out alone implies --plots; without --out the files go into the sweep folder
    import fedudp.report.report_plots

    calls = []
    monkeypatch.setattr(
        fedudp.report.report_plots,
        "write_report",
        lambda ss, folder, name="": (
            calls.append(Path(folder)) or {"report": Path(folder) / "report.md"}
        ),
    )
    assert report_main([str(sweep), "--out", str(tmp_path / "b")]) == 0
    assert report_main([str(sweep), "--plots"]) == 0
    assert report_main([str(sweep)]) == 0
    assert calls == [tmp_path / "b", sweep]
    with pytest.raises(SystemExit):
        report_main([str(sweep), "--plots", "--paper", "huang_table1"])


def test_no_dp_only_and_runs_without_config(sweep, tmp_path):
    only = tmp_path / "fedavg_only"
    shutil.copytree(sweep / "fedavg", only / "fedavg")
    paths = write_report(load_summaries(only), tmp_path / "a")
    assert all(png_size(paths[k])[0] > 500 for k in ("curves", "frontier"))
    bare = tmp_path / "bare"
    shutil.copytree(sweep / "joint_eps1_paper", bare / "run")
    (bare / "run" / "config.yaml").unlink()
    [s] = group_series(load_summaries(bare))
    assert s.label.startswith("(no config.yaml) method=joint_dp") and s.heuristic
    assert list(s.accuracy) == [1, 2]
    write_report(load_summaries(bare), tmp_path / "b")
    assert (tmp_path / "b" / "curves.png").is_file()
