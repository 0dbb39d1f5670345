"""scripts/reproductions/reproduce_huang.py: the grid's order and the claims that let workers share it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "reproduce_huang", ROOT / "scripts" / "reproductions" / "reproduce_huang.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_claimed_run_is_skipped_by_other_workers_and_a_dead_claim_is_taken_over(tmp_path):
    rh = _script()
    held = rh.claim(tmp_path, "mnist/n4/per_silo_s0")
    assert held is not None and held.read_text() == str(os.getpid())
    assert rh.claim(tmp_path, "mnist/n4/per_silo_s0") is None  # a live worker holds it
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    held.write_text(dead)  # its worker is gone
    again = rh.claim(tmp_path, "mnist/n4/per_silo_s0")
    assert again is not None and again.read_text() == str(os.getpid())


def test_grid_names_and_overrides_are_unique_and_cover_the_tables():
    g = _script().grid(["mnist", "fashion_mnist"])
    names = [n for n, _ in g]
    assert len(names) == len(set(names))
    over = dict(g)
    assert {
        f"mnist/n{n}/{m}_s0" for n in (4, 16, 64, 128, 256, 512) for m in ("per_silo", "fedavg")
    } <= set(names)
    assert (
        over["mnist/n256/joint_dp_personal-conv1+conv2_local_dpsgd_certified_s0"]["model.personal"]
        == "[conv1.*,conv2.*]"
    )
    t4 = over["mnist/n256/joint_dp_rpu5_group_local_dpsgd_paper_s0"]
    assert t4["partition.records_per_user"] == 5 and t4["privacy.group_privacy"] == "true"
    assert t4["privacy.accounting"] == "paper"
    assert over["mnist/n64/full_dp_eps100_local_dpsgd_certified_s0"]["privacy.epsilon"] == 100.0
    t4e = over["mnist/n256/joint_dp_eps8_rpu5_group_local_dpsgd_paper_s0"]  # Table 4's ε = 8 column
    assert (
        t4e["privacy.epsilon"],
        t4e["partition.records_per_user"],
        t4e["privacy.group_privacy"],
    ) == (8.0, 5, "true")
    assert (
        "privacy.epsilon" not in over["mnist/n256/full_dp_rpu10_group_local_dpsgd_paper_s0"]
    )  # ε = 1 preset
    assert not any("full_dp_eps3_rpu" in n for n in names)  # the paper has full-DP at ε = 1 only


def test_run_state_tells_finished_from_interrupted_runs(tmp_path):
    rh = _script()
    assert rh.run_state(tmp_path / "absent") == "todo"
    for stop, state in (("completed", "done"), ("budget", "done"), ("interrupted", "part")):
        folder = tmp_path / stop
        folder.mkdir()
        (folder / "summary.json").write_text('{"stop_reason": "%s"}' % stop)
        assert rh.run_state(folder) == state
    ckpt_only = tmp_path / "ckpt_only"
    ckpt_only.mkdir()
    (ckpt_only / "ckpt-000001.pt").write_bytes(b"")
    assert rh.run_state(ckpt_only) == "part"


def test_dp_collapse_noise_prediction_is_the_random_walk_of_the_owner_steps():
    spec = importlib.util.spec_from_file_location(
        "diagnose_dp_collapse", ROOT / "scripts" / "tools" / "diagnose_dp_collapse.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import numpy as np

    # 4 owners of 2500 users, B = 32: 79 steps/epoch of lr*z*C/32 each, averaged over 4 walks
    got = mod.predicted_noise_std(np.full(4, 2500), 32, 0.05, 5.0, 15.0, epochs=20, rounds=3)
    assert abs(got - 0.05 * 5.0 * 15.0 / 32 * (3 * 20 * 79 / 4) ** 0.5) < 1e-12
    # an owner smaller than B: its expected batch is m_j, one step per epoch
    one = mod.predicted_noise_std(np.array([10]), 32, 0.1, 2.0, 1.0, epochs=1, rounds=1)
    assert abs(one - 0.1 * 2.0 / 10) < 1e-12


def test_clip_ablation_is_named_and_overridden():
    over = dict(_script().grid(["mnist"]))
    ab = over["mnist/n64/joint_dp_clip1_local_dpsgd_certified_s0"]
    assert ab["privacy.clip"] == 1.0 and ab["partition.num_owners"] == 64
    assert "privacy.clip" not in over["mnist/n64/joint_dp_local_dpsgd_certified_s0"]
