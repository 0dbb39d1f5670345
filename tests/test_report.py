"""``fedudp-report --paper``: the paper's layouts carry our numbers and the paper's, unchanged."""
from __future__ import annotations

import csv

import pytest

from fedudp.paper_report import HUANG_TABLE2, HUANG_TABLE4, write_paper_report


def summary(method, n, acc, eps=1.0, placement="local_dpsgd", accounting="certified",
            personal=None, rpu=1):
    private = method in ("full_dp", "joint_dp")
    return {"method": method, "num_owners": n, "accuracy_mean": acc, "dataset": "mnist",
            "stop_reason": "completed", "placement": placement if private else None,
            "accounting": accounting if private else None,
            "target_epsilon": eps if private else None,
            "_config": {"model": {"personal": personal or []},
                        "partition": {"records_per_user": rpu}}}


def rows(path):
    return list(csv.DictReader(open(path)))


def test_table2_rows_are_personal_layer_sets(tmp_path):
    ss = [summary("full_dp", 256, 0.70), summary("joint_dp", 256, 0.80, personal=["fc1.*"]),
          summary("joint_dp", 256, 0.82, personal=["fc1.*"]),
          summary("joint_dp", 256, 0.20, personal=["conv1", "conv2"])]
    md = write_paper_report("huang_table2", ss, tmp_path)
    got = {r["row"]: r for r in rows(tmp_path / "huang_table2.csv")}
    assert float(got["fc1"]["ours_mean"]) == pytest.approx(0.81) and got["fc1"]["runs"] == "2"
    assert float(got["fc1"]["paper_mean"]) == HUANG_TABLE2[("fc1",)][0]
    assert float(got["none (full-DP)"]["paper_mean"]) == HUANG_TABLE2[()][0]
    assert float(got["conv1 + conv2"]["diff"]) == pytest.approx(0.20 - 0.1863)
    assert "0.810 ± 0.010 (2) / 0.783 (+0.027)" in md


def test_table4_and_fig1_layouts(tmp_path):
    ss = [summary("joint_dp", 4, 0.5, eps=3.0, rpu=2), summary("full_dp", 4, 0.3, rpu=2),
          summary("joint_dp", 256, 0.9, eps=8.0, rpu=1)]
    write_paper_report("huang_table4", ss, tmp_path)
    got = {(r["row"], r["column"]): r for r in rows(tmp_path / "huang_table4.csv")}
    assert float(got[("4/2", "joint-DP ε=3")]["paper_mean"]) == HUANG_TABLE4[(4, 2)][2]
    assert float(got[("4/2", "full-DP ε=1")]["paper_mean"]) == HUANG_TABLE4[(4, 2)][0]
    assert float(got[("256/1", "joint-DP ε=8")]["ours_mean"]) == 0.9
    assert (tmp_path / "huang_table4.png").stat().st_size > 10_000
    ss += [summary("joint_dp", 4, 0.6, eps=3.0), summary("full_dp", 4, 0.4)]
    write_paper_report("huang_fig1", ss, tmp_path)
    fig = {(r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / "huang_fig1.csv")}
    # Figure 1 is one record per user and the default split: the m/r = 2 runs stay out
    assert fig == {("4/3", "joint-DP"): 0.6, ("256/8", "joint-DP"): 0.9, ("4/1", "full-DP"): 0.4}


def test_one_run_folder_feeds_every_layout_without_mixing_them(tmp_path):
    """Table 1, Table 2 and Figure 1 runs share docs/results/huang_table1/runs: each layout
    takes only its own (a Table 2 subset or a Figure 1 ε never enters Table 1's cells)."""
    ss = [summary("joint_dp", 256, 0.54, personal=["fc1.*"]), summary("full_dp", 256, 0.13),
          summary("joint_dp", 256, 0.10, personal=["conv1.*", "conv2.*"]),
          summary("joint_dp", 256, 0.95, eps=100.0), summary("full_dp", 256, 0.90, eps=100.0),
          summary("joint_dp", 64, 0.50)]
    write_paper_report("huang_table1", ss, tmp_path)
    t1 = {(r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / "huang_table1.csv")}
    assert t1 == {("mnist/256/39.06", "joint-DP"): 0.54, ("mnist/256/39.06", "full-DP"): 0.13,
                  ("mnist/64/156.25", "joint-DP"): 0.50}
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
    assert f1 == {("256/1", "joint-DP"): 0.54, ("256/1", "full-DP"): 0.13, ("256/100", "joint-DP"): 0.95,
                  ("256/100", "full-DP"): 0.90, ("64/1", "joint-DP"): 0.50}


def test_table2_keeps_certified_and_paper_mode_apart(tmp_path):
    """Table 2's paper-mode runs (shared gradients at the owners' own personal layers, heuristic)
    get their own column and their own verdict; they never average with the certified runs."""
    ss = [summary("joint_dp", 256, 0.54, personal=["fc1.*"]),
          summary("joint_dp", 256, 0.10, personal=["conv1.*"]),
          summary("joint_dp", 256, 0.80, personal=["fc1.*"], accounting="paper"),
          summary("joint_dp", 256, 0.70, personal=["conv1.*"], accounting="paper"),
          summary("joint_dp", 256, 0.99, personal=["conv1.*"], accounting="paper", eps=3.0)]
    md = write_paper_report("huang_table2", ss, tmp_path)
    got = {(r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / "huang_table2.csv")}
    assert got == {("fc1", "certified"): 0.54, ("conv1", "certified"): 0.10,
                   ("fc1", "paper mode (heuristic)"): 0.80, ("conv1", "paper mode (heuristic)"): 0.70}
    assert "hurts (certified): holds (FC1 alone 0.540; conv1 0.100)" in md
    assert "hurts (paper mode (heuristic)): holds (FC1 alone 0.800; conv1 0.700)" in md
    ss.append(summary("joint_dp", 256, 0.85, personal=["conv1.*", "conv2.*"], accounting="paper"))
    md = write_paper_report("huang_table2", ss, tmp_path)
    assert "hurts (paper mode (heuristic)): does not hold (FC1 alone 0.800; conv1 0.700, conv1 + conv2 0.850)" in md


def test_table2_and_fig1_claims_are_judged_on_the_numbers(tmp_path):
    ss = [summary("joint_dp", 256, 0.54, personal=["fc1.*"]),
          summary("joint_dp", 256, 0.30, personal=["conv1.*"]),
          summary("joint_dp", 256, 0.60, personal=["conv2.*", "fc1.*"])]
    md = write_paper_report("huang_table2", ss, tmp_path)
    assert "personalising layers below shared ones hurts (certified): does not hold (FC1 alone 0.540; conv1 0.300, conv2 + fc1 0.600)" in md
    assert "(paper mode (heuristic))" not in md            # no paper-mode runs: no verdict
    ss = [summary("joint_dp", 64, 0.50), summary("full_dp", 64, 0.12),
          summary("joint_dp", 64, 0.90, eps=100.0), summary("full_dp", 64, 0.88, eps=100.0)]
    md = write_paper_report("huang_fig1", ss, tmp_path)
    assert "n=64: joint-DP's advantage over full-DP shrinks as ε grows: holds (joint − full: ε=1: +0.380, ε=100: +0.020)" in md


def test_runs_off_the_presets_hyperparameters_stay_out_of_every_layout(tmp_path):
    """An ablation (here clip 1 or lr 0.01) shares the run folder but not the paper's cells."""
    import yaml
    from fedudp.paper_report import PRESET_HYPER
    from pathlib import Path
    conf = Path(__file__).resolve().parents[1] / "conf" / "experiment" / "huang_table1.yaml"
    preset = yaml.safe_load(conf.read_text())
    for key, value in PRESET_HYPER.items():             # the filter is the preset's own values
        section, name = key.split(".")
        assert preset[section][name] == value
    base = summary("joint_dp", 64, 0.50)
    clip1 = summary("joint_dp", 64, 0.90)
    clip1["_config"]["privacy"] = {"clip": 1.0}
    lr = summary("full_dp", 64, 0.80)
    lr["_config"]["train"] = {"lr": 0.01, "batch_size": 32}
    for name in ("huang_table1", "huang_fig1"):
        write_paper_report(name, [base, clip1, lr], tmp_path)
        got = {(r["row"], r["column"]): float(r["ours_mean"]) for r in rows(tmp_path / f"{name}.csv")}
        assert list(got.values()) == [0.50]
