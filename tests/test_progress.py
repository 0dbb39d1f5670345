"""Progress inside a round: the owners report each chunk of units done (``Owners.on_progress``)
and the run's bar shows it beside the last round's accuracy and ε; silent with progress=false."""

from __future__ import annotations

from conftest import tiny_cfg
from fedudp.build import prepare
from fedudp.run import execute, run


def _stages(cfg):
    p = prepare(cfg)
    seen: list[tuple[str, int, int]] = []
    p.owners.on_progress = lambda stage, done, total: seen.append((stage, done, total))
    execute(p)
    return seen


def test_owners_report_each_chunk_of_the_cohort_up_to_its_size():
    # 160 users of one record in chunks of 16 records: many chunks per stage
    seen = _stages(
        tiny_cfg("joint_dp", **{"engine_opts__chunk_records": 16, "train__sampling_rate": 0.5})
    )
    stages = {s for s, _, _ in seen}
    assert {"users", "personal", "evaluating"} <= stages
    for stage in stages:
        runs, cur = [], []
        for s, d, t in seen:
            if s != stage:
                continue
            if cur and d <= cur[-1][0]:  # a new round (or a new pass) starts
                runs.append(cur)
                cur = []
            cur.append((d, t))
        runs.append(cur)
        for r in runs:
            done = [d for d, _ in r]
            assert done == sorted(done) and len(set(t for _, t in r)) == 1
            assert done[-1] == r[0][1]  # every pass ends at its total
    users = [(d, t) for s, d, t in seen if s == "users"]
    assert len(users) > 3 * 3  # several chunks in each of the 3 rounds
    assert all(0 < t < 160 for _, t in users)  # the sampled cohort, not the population


def test_owner_updates_and_dpsgd_steps_are_reported():
    seen = _stages(tiny_cfg("fedavg", **{"engine_opts__chunk_records": 16}))
    assert [d for s, d, t in seen if s == "owners"][-1] == 4
    seen = _stages(
        tiny_cfg(
            "full_dp",
            **{
                "privacy__placement": "local_dpsgd",
                "privacy__noise_multiplier": 2.0,
                "privacy__epsilon": 50.0,
            },
        )
    )
    steps = [(d, t) for s, d, t in seen if s == "DP-SGD steps"]
    assert steps and steps[-1][0] == steps[-1][1] and steps[0][0] == 1


def test_the_bar_shows_the_stage_and_progress_false_is_silent(tmp_path, capsys):
    cfg = tiny_cfg("joint_dp", **{"engine_opts__chunk_records": 16})
    cfg.progress = True
    run(cfg, tmp_path / "shown")
    err = capsys.readouterr().err
    assert "users=" in err and "/" in err.split("users=")[1][:12]
    cfg.progress = False
    run(cfg, tmp_path / "silent")
    err = capsys.readouterr().err
    assert "users=" not in err and "evaluating=" not in err
