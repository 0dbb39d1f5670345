"""``fedudp-report``: the comparison table has one row per whole resolved configuration and marks
a heuristic ε; ``--paper``: the paper's layouts carry our numbers and the paper's,
unchanged. The runs behind the comparison-table tests are real (tiny) runs."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_cfg
from fedudp.report.paper_report import HUANG_TABLE2, HUANG_TABLE4, write_paper_report
from fedudp.report import ComparisonCallback, comparison_table, load_summaries, main as report_main
from fedudp.run import run


def summary(
    method, n, acc, eps=1.0, placement="local_dpsgd", accounting="certified", personal=None, rpu=1
):
    private = method in ("full_dp", "joint_dp")
    return {
        "method": method,
        "num_owners": n,
        "accuracy_mean": acc,
        "dataset": "mnist",
        "stop_reason": "completed",
        "placement": placement if private else None,
        "accounting": accounting if private else None,
        "target_epsilon": eps if private else None,
        "_config": {"model": {"personal": personal or []}, "partition": {"records_per_user": rpu}},
    }


def rows(path):
    return list(csv.DictReader(open(path)))


def test_table2_rows_are_personal_layer_sets(tmp_path):
    ss = [
        summary("full_dp", 256, 0.70),
        summary("joint_dp", 256, 0.80, personal=["fc1.*"]),
        summary("joint_dp", 256, 0.82, personal=["fc1.*"]),
        summary("joint_dp", 256, 0.20, personal=["conv1", "conv2"]),
    ]
    md = write_paper_report("huang_table2", ss, tmp_path)
    got = {r["row"]: r for r in rows(tmp_path / "huang_table2.csv")}
    assert float(got["fc1"]["ours_mean"]) == pytest.approx(0.81) and got["fc1"]["runs"] == "2"
    assert float(got["fc1"]["paper_mean"]) == HUANG_TABLE2[("fc1",)][0]
    assert float(got["none (full-DP)"]["paper_mean"]) == HUANG_TABLE2[()][0]
    assert float(got["conv1 + conv2"]["diff"]) == pytest.approx(0.20 - 0.1863)
    assert "0.810 ± 0.010 (2) / 0.783 (+0.027)" in md


def test_table4_and_fig1_layouts(tmp_path):
    ss = [
        summary("joint_dp", 4, 0.5, eps=3.0, rpu=2),
        summary("full_dp", 4, 0.3, rpu=2),
        summary("joint_dp", 256, 0.9, eps=8.0, rpu=1),
    ]
    write_paper_report("huang_table4", ss, tmp_path)
    got = {(r["row"], r["column"]): r for r in rows(tmp_path / "huang_table4.csv")}
    assert float(got[("4/2", "joint-DP ε=3")]["paper_mean"]) == HUANG_TABLE4[(4, 2)][2]
    assert float(got[("4/2", "full-DP ε=1")]["paper_mean"]) == HUANG_TABLE4[(4, 2)][0]
    assert float(got[("256/1", "joint-DP ε=8")]["ours_mean"]) == 0.9
    assert (tmp_path / "huang_table4.png").stat().st_size > 10_000
    ss += [summary("joint_dp", 4, 0.6, eps=3.0), summary("full_dp", 4, 0.4)]
    write_paper_report("huang_fig1", ss, tmp_path)
    fig = {
        (r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / "huang_fig1.csv")
    }
    # Figure 1 is one record per user and the default split: the m/r = 2 runs stay out
    assert fig == {("4/3", "joint-DP"): 0.6, ("256/8", "joint-DP"): 0.9, ("4/1", "full-DP"): 0.4}


def test_one_run_folder_feeds_every_layout_without_mixing_them(tmp_path):
    """Table 1, Table 2 and Figure 1 runs share docs/results/huang_table1/runs: each layout
    takes only its own (a Table 2 subset or a Figure 1 ε never enters Table 1's cells)."""
    ss = [
        summary("joint_dp", 256, 0.54, personal=["fc1.*"]),
        summary("full_dp", 256, 0.13),
        summary("joint_dp", 256, 0.10, personal=["conv1.*", "conv2.*"]),
        summary("joint_dp", 256, 0.95, eps=100.0),
        summary("full_dp", 256, 0.90, eps=100.0),
        summary("joint_dp", 64, 0.50),
    ]
    write_paper_report("huang_table1", ss, tmp_path)
    t1 = {
        (r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / "huang_table1.csv")
    }
    assert t1 == {
        ("mnist/256/39.06", "joint-DP"): 0.54,
        ("mnist/256/39.06", "full-DP"): 0.13,
        ("mnist/64/156.25", "joint-DP"): 0.50,
    }
    write_paper_report("huang_table2", ss, tmp_path)
    t2 = {r["row"]: float(r["ours_mean"]) for r in rows(tmp_path / "huang_table2.csv")}
    assert t2 == {"fc1": 0.54, "none (full-DP)": 0.13, "conv1 + conv2": 0.10}
    write_paper_report("huang_fig1", ss, tmp_path)
    f1 = {(r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / "huang_fig1.csv")}
    assert "n=256: per-silo (no DP)" not in (tmp_path / "huang_fig1.md").read_text()
    ss.append(summary("per_silo", 256, 0.77))
    md = write_paper_report("huang_fig1", ss, tmp_path)
    assert "Reference lines: n=256: per-silo (no DP) 0.770 (1)" in md
    f1 = {(r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / "huang_fig1.csv")}
    assert f1 == {
        ("256/1", "joint-DP"): 0.54,
        ("256/1", "full-DP"): 0.13,
        ("256/100", "joint-DP"): 0.95,
        ("256/100", "full-DP"): 0.90,
        ("64/1", "joint-DP"): 0.50,
    }


def test_table2_keeps_certified_and_paper_mode_apart(tmp_path):
    """Table 2's paper-mode runs (shared gradients at the owners' own personal layers, heuristic)
    get their own column and their own verdict; they never average with the certified runs."""
    ss = [
        summary("joint_dp", 256, 0.54, personal=["fc1.*"]),
        summary("joint_dp", 256, 0.10, personal=["conv1.*"]),
        summary("joint_dp", 256, 0.80, personal=["fc1.*"], accounting="paper"),
        summary("joint_dp", 256, 0.70, personal=["conv1.*"], accounting="paper"),
        summary("joint_dp", 256, 0.99, personal=["conv1.*"], accounting="paper", eps=3.0),
    ]
    md = write_paper_report("huang_table2", ss, tmp_path)
    got = {
        (r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / "huang_table2.csv")
    }
    assert got == {
        ("fc1", "certified"): 0.54,
        ("conv1", "certified"): 0.10,
        ("fc1", "paper mode (heuristic)"): 0.80,
        ("conv1", "paper mode (heuristic)"): 0.70,
    }
    assert "hurts (certified): holds (FC1 alone 0.540; conv1 0.100)" in md
    assert "hurts (paper mode (heuristic)): holds (FC1 alone 0.800; conv1 0.700)" in md
    ss.append(summary("joint_dp", 256, 0.85, personal=["conv1.*", "conv2.*"], accounting="paper"))
    md = write_paper_report("huang_table2", ss, tmp_path)
    assert (
        "hurts (paper mode (heuristic)): does not hold (FC1 alone 0.800; conv1 0.700, conv1 + conv2 0.850)"
        in md
    )


def test_table2_and_fig1_claims_are_judged_on_the_numbers(tmp_path):
    ss = [
        summary("joint_dp", 256, 0.54, personal=["fc1.*"]),
        summary("joint_dp", 256, 0.30, personal=["conv1.*"]),
        summary("joint_dp", 256, 0.60, personal=["conv2.*", "fc1.*"]),
    ]
    md = write_paper_report("huang_table2", ss, tmp_path)
    assert (
        "personalising layers below shared ones hurts (certified): does not hold (FC1 alone 0.540; conv1 0.300, conv2 + fc1 0.600)"
        in md
    )
    assert "(paper mode (heuristic))" not in md  # no paper-mode runs: no verdict
    ss = [
        summary("joint_dp", 64, 0.50),
        summary("full_dp", 64, 0.12),
        summary("joint_dp", 64, 0.90, eps=100.0),
        summary("full_dp", 64, 0.88, eps=100.0),
    ]
    md = write_paper_report("huang_fig1", ss, tmp_path)
    assert (
        "n=64: joint-DP's advantage over full-DP shrinks as ε grows: holds (joint − full: ε=1: +0.380, ε=100: +0.020)"
        in md
    )


def test_runs_off_the_presets_hyperparameters_stay_out_of_every_layout(tmp_path):
    """An ablation (here clip 1 or lr 0.01) shares the run folder but not the paper's cells."""
    import yaml
    from fedudp.report.paper_report import PRESET_HYPER
    from fedudp.cli import CONF_DIR

    conf = Path(CONF_DIR) / "experiment" / "huang_table1.yaml"
    preset = yaml.safe_load(conf.read_text())
    for key, value in PRESET_HYPER.items():  # the filter is the preset's own values
        section, name = key.split(".")
        assert preset[section][name] == value
    base = summary("joint_dp", 64, 0.50)
    clip1 = summary("joint_dp", 64, 0.90)
    clip1["_config"]["privacy"] = {"clip": 1.0}
    lr = summary("full_dp", 64, 0.80)
    lr["_config"]["train"] = {"lr": 0.01, "batch_size": 32}
    for name in ("huang_table1", "huang_fig1"):
        write_paper_report(name, [base, clip1, lr], tmp_path)
        got = {
            (r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / f"{name}.csv")
        }
        assert list(got.values()) == [0.50]


# -- fedudp-report's comparison table: one row per whole resolved configuration -------------------


def tables(text):
    """The Markdown tables in ``text``: each a list of {header: cell} rows."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("| ") and lines[i + 1].startswith("|---"):
            head = [c.strip() for c in line.strip("|").split("|")]
            body = []
            for row in lines[i + 2 :]:
                if not row.startswith("| "):
                    break
                body.append(dict(zip(head, (c.strip() for c in row.strip("|").split("|")))))
            out.append(body)
    return out


def report(folder, capsys):
    assert report_main([str(folder)]) == 0
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def lr_runs(tmp_path_factory):
    """Real FedAvg runs: one_seed/ holds lr 0.1 and 0.5 (seed 0), two_seeds/ lr 0.5 seeds 0 and 1."""
    root = tmp_path_factory.mktemp("lr_runs")
    for sub, lr, seed in (
        ("one_seed", 0.1, 0),
        ("one_seed", 0.5, 0),
        ("two_seeds", 0.5, 0),
        ("two_seeds", 0.5, 1),
    ):
        run(tiny_cfg("fedavg", train__lr=lr, seed=seed), root / sub / f"lr{lr}_seed{seed}")
    return root


def test_two_learning_rates_are_two_rows_with_a_train_lr_column(lr_runs, capsys):
    out = report(lr_runs / "one_seed", capsys)
    [rows] = tables(out)
    assert sorted(r["train.lr"] for r in rows) == ["0.1", "0.5"]
    assert [r["runs"] for r in rows] == ["1", "1"]
    acc = {
        s["_config"]["train"]["lr"]: s["accuracy_mean"]
        for s in load_summaries(lr_runs / "one_seed")
    }
    assert acc[0.1] != acc[0.5]  # the runs differ, and each row shows its own
    for r in rows:
        assert r["accuracy (mean over owners)"] == f"{acc[float(r['train.lr'])]:.4f}"
    common = out.splitlines()[0]
    assert common.startswith("Common settings: method=fedavg") and "train.lr" not in common
    assert "seed=" not in common


def test_two_seeds_of_one_configuration_are_one_row_over_two_runs(lr_runs, capsys):
    [rows] = tables(report(lr_runs / "two_seeds", capsys))
    assert len(rows) == 1 and rows[0]["runs"] == "2"
    assert "train.lr" not in rows[0] and "seed" not in rows[0]  # nothing differs: no column
    accs = [s["accuracy_mean"] for s in load_summaries(lr_runs / "two_seeds")]
    assert accs[0] != accs[1]
    assert rows[0]["accuracy (mean over owners)"] == f"{np.mean(accs):.4f} ± {np.std(accs):.4f}"
    # all four runs: lr 0.5 seed 0 is there twice (one_seed/ and two_seeds/): the count says so
    [rows] = tables(report(lr_runs, capsys))
    assert {r["train.lr"]: r["runs"] for r in rows} == {"0.1": "1", "0.5": "3 (seeds 0, 0, 1)"}


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """joint-DP, certified and paper accounting (heuristic), otherwise the same, real runs."""
    root = tmp_path_factory.mktemp("dp_runs")
    for acc in ("certified", "paper"):
        run(tiny_cfg("joint_dp", privacy__accounting=acc), root / "sweep" / acc)
    return root


def test_summary_marks_a_heuristic_epsilon_beside_the_number(dp_runs):
    cert = json.loads((dp_runs / "sweep" / "certified" / "summary.json").read_text())
    paper = json.loads((dp_runs / "sweep" / "paper" / "summary.json").read_text())
    assert (cert["guarantee"], cert["epsilon_kind"]) == ("certified", "certified")
    assert (paper["guarantee"], paper["epsilon_kind"]) == ("heuristic", "heuristic")
    assert isinstance(paper["epsilon"], float)  # the number stays, for programs
    assert paper["epsilon_display"] == f"{paper['epsilon']:.3f} (heuristic)"
    assert cert["epsilon_display"] == f"{cert['epsilon']:.3f}"
    keys = list(paper)
    assert keys.index("epsilon_kind") == keys.index("epsilon") + 1  # next to the number
    fedavg = run(tiny_cfg("fedavg", train__rounds=1), dp_runs / "fedavg")
    assert (fedavg["epsilon"], fedavg["epsilon_kind"], fedavg["epsilon_display"]) == (
        None,
        None,
        "n/a (no DP)",
    )


def test_heuristic_epsilon_is_marked_and_never_shares_a_row_with_a_certified_one(dp_runs, capsys):
    out = report(dp_runs / "sweep", capsys)
    [rows] = tables(out)
    by = {r["privacy.accounting"]: r for r in rows}
    assert set(by) == {"certified", "paper"} and all(r["runs"] == "1" for r in rows)
    assert (
        by["paper"]["epsilon"].endswith(" (heuristic)") and by["paper"]["guarantee"] == "heuristic"
    )
    assert (
        "heuristic" not in by["certified"]["epsilon"]
        and by["certified"]["guarantee"] == "certified"
    )
    assert "not a proven (ε, δ) guarantee" in out
    # the guarantee is a grouping key of its own: the same config with another guarantee (as the
    # certified and the paper forms of group privacy could be) is another row
    twin = dp_runs / "twin"
    shutil.copytree(dp_runs / "sweep" / "certified", twin / "a")
    shutil.copytree(dp_runs / "sweep" / "certified", twin / "b")
    s = json.loads((twin / "b" / "summary.json").read_text())
    s.update(guarantee="heuristic", epsilon_kind="heuristic")
    (twin / "b" / "summary.json").write_text(json.dumps(s))
    [rows] = tables(report(twin, capsys))
    assert len(rows) == 2 and [r["runs"] for r in rows] == ["1", "1"]
    assert sorted("(heuristic)" in r["epsilon"] for r in rows) == [False, True]


def test_group_privacy_certified_and_paper_forms_are_two_rows(tmp_path, capsys):
    kw = {
        "privacy__placement": "local_dpsgd",
        "dataset__num_records": 150,
        "train__rounds": 1,
        "partition__records_per_user": 3,
        "privacy__group_privacy": True,
    }
    for acc in ("certified", "paper"):
        run(tiny_cfg("full_dp", privacy__accounting=acc, **kw), tmp_path / acc)
    [rows] = tables(report(tmp_path, capsys))
    by = {r["privacy.accounting"]: r for r in rows}
    assert by["paper"]["guarantee"] == "heuristic" and by["paper"]["epsilon"].endswith(
        "(heuristic)"
    )
    assert (
        by["certified"]["guarantee"] == "certified"
        and "heuristic" not in by["certified"]["epsilon"]
    )


def test_runs_without_config_are_grouped_apart_by_their_summary_fields(dp_runs, tmp_path, capsys):
    shutil.copytree(dp_runs / "sweep" / "certified", tmp_path / "with")
    shutil.copytree(dp_runs / "sweep" / "certified", tmp_path / "without")
    (tmp_path / "without" / "config.yaml").unlink()
    out = report(tmp_path, capsys)
    with_cfg, without = tables(out)
    assert [r["runs"] for r in with_cfg] == ["1"] and [r["runs"] for r in without] == ["1"]
    assert "Runs without config.yaml, grouped by their summary fields only" in out
    text = comparison_table(load_summaries(tmp_path))
    assert text == out.rstrip("\n")


def test_sweep_prints_heuristic_epsilon_at_each_run_end_and_in_its_table(tmp_path, monkeypatch):
    """The CLI end to end (``fedudp.cli.main`` in this process): each run's last line and the
    callback's table (and comparison.md)."""
    import contextlib
    import io

    from fedudp import cli

    sweep = tmp_path / "sweep"
    args = [
        "fedudp",
        "-m",
        "method=joint_dp",
        "privacy.accounting=certified,paper",
        "dataset.num_records=200",
        "partition.num_owners=4",
        "train.rounds=1",
        "progress=false",
        f"hydra.sweep.dir={sweep}",
    ]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", args)
    # (Hydra's log handlers keep the stream they were set up with: never one pytest closes)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        cli.main()
    out = printed.getvalue()
    ends = [ln for ln in out.splitlines() if ln.startswith("[joint_dp] accuracy")]
    assert (
        len(ends) == 2
        and sum(
            ln.split("epsilon ")[1].split("  rounds")[0].endswith(" (heuristic)") for ln in ends
        )
        == 1
    )
    [rows] = tables(out)
    assert {r["privacy.accounting"]: "(heuristic)" in r["epsilon"] for r in rows} == {
        "certified": False,
        "paper": True,
    }
    assert (sweep / "comparison.md").read_text() == comparison_table(load_summaries(sweep)) + "\n"


def test_callback_writes_the_table(dp_runs, capsys):
    from omegaconf import OmegaConf

    ComparisonCallback().on_multirun_end(
        OmegaConf.create({"hydra": {"sweep": {"dir": str(dp_runs / "sweep")}}})
    )
    out = capsys.readouterr().out
    assert (
        "(heuristic)" in (dp_runs / "sweep" / "comparison.md").read_text() and "(heuristic)" in out
    )


def test_table4_marks_the_paper_form_heuristic_and_keeps_guarantees_apart(tmp_path):
    paper = summary("joint_dp", 256, 0.66, eps=3.0, accounting="paper", rpu=5)
    paper["_config"]["privacy"] = {"group_privacy": True}
    cert = summary("joint_dp", 256, 0.50, eps=3.0, rpu=5)
    odd = summary("joint_dp", 256, 0.99, eps=3.0, rpu=5)  # certified accounting, heuristic ε
    odd["guarantee"] = "heuristic"
    md = write_paper_report("huang_table4", [paper, cert, odd], tmp_path)
    got = {r["column"]: float(r["ours_mean"]) for r in rows(tmp_path / "huang_table4.csv")}
    assert got == {"joint-DP ε=3 (heuristic), paper group privacy": 0.66, "joint-DP ε=3": 0.50}
    assert "(heuristic): ε from privacy.accounting=paper" in md
