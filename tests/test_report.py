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
    write_paper_report("huang_fig1", ss, tmp_path)
    fig = {(r["row"], r["column"]) for r in rows(tmp_path / "huang_fig1.csv")}
    assert ("4/3", "joint-DP") in fig and ("256/8", "joint-DP") in fig and ("4/1", "full-DP") in fig
