"""The privacy cost of choosing among runs (fedudp.tuning, fedudp.privacy.events).

Every expected ε is recomputed here with dp-accounting from literal constants."""
from __future__ import annotations

import json

import dp_accounting
import pytest
from dp_accounting import dp_event as dpe
from dp_accounting.rdp import rdp_privacy_accountant

from fedudp import report
from fedudp.privacy.events import event_from_json, event_to_json
from fedudp.tuning import SelectionError, select_best

RUN = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(3.0)), 5)
OTHER = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(6.0), 5)


@pytest.mark.parametrize("event", [
    RUN, OTHER, dp_accounting.ComposedDpEvent([RUN, OTHER]),
    dp_accounting.LaplaceDpEvent(0.5), dp_accounting.ZCDpEvent(0.1),
    dpe.RepeatAndSelectDpEvent(RUN, 4.0, float("inf")),
])
def test_events_round_trip_through_json(event):
    assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event


@pytest.mark.parametrize("bad", [
    {"dp_event": "OrderedDict"}, {"dp_event": "GaussianDpEvent", "noise_multiplier": 1, "x": 2},
    {"event": "GaussianDpEvent"}, {"dp_event": ["GaussianDpEvent"]}])
def test_only_dp_accounting_events_are_read(bad):
    with pytest.raises(ValueError):
        event_from_json(bad)


def _summary(event, acc, lr, seed=0, delta=1e-5, eps=1.0, **more):
    return {"method": "full_dp", "accuracy_mean": acc, "epsilon": eps, "delta": delta,
            "guarantee": "certified", "dp_event": event_to_json(event), "_dir": f"run{lr}_{seed}",
            "_config": {"method": "full_dp", "seed": seed, "train": {"lr": lr}}, **more}


def _groups(summaries):
    a, b = report.groups_of(summaries)
    return {**a, **b}


def _pld(event, delta=1e-5):
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


def test_fixed_sweep_costs_the_composition_of_every_run():
    runs = [_summary(RUN, 0.7, 0.1), _summary(RUN, 0.8, 0.1, seed=1), _summary(RUN, 0.9, 0.5),
            _summary(RUN, 0.5, 0.5, seed=1)]
    sel = select_best(_groups(runs), "accuracy_mean")
    assert sel["settings"]["train.lr"] == 0.1 and sel["score"] == pytest.approx(0.75)
    assert sel["runs"] == 4 and sel["configurations"] == 2
    direct = _pld(dp_accounting.ComposedDpEvent([RUN] * 4))
    assert sel["fixed_epsilon"] == pytest.approx(direct, rel=1e-9)
    one = _pld(RUN)
    assert sel["fixed_epsilon"] > one + 0.5          # the choice is not free
    low = select_best(_groups(runs), "accuracy_mean", lower=True)
    assert low["settings"]["train.lr"] == 0.5


@pytest.mark.parametrize("dist,shape", [("poisson", float("inf")), ("geometric", 1.0),
                                        ("logarithmic", 0.0)])
def test_random_sweep_size_is_repeat_and_select(dist, shape):
    runs = [_summary(RUN, 0.7 + i / 100, lr) for i, lr in enumerate((0.1, 0.2, 0.3, 0.4))]
    sel = select_best(_groups(runs), "accuracy_mean", sweep_size=dist)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dpe.RepeatAndSelectDpEvent(RUN, 4.0, shape))
    assert sel["random_epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    assert sel["random_epsilon"] < sel["fixed_epsilon"] or dist == "poisson"


def test_random_sweep_size_needs_one_mechanism():
    runs = [_summary(RUN, 0.7, 0.1), _summary(OTHER, 0.8, 0.2)]
    sel = select_best(_groups(runs), "accuracy_mean", sweep_size="poisson")
    assert sel["random_epsilon"] is None and "not one mechanism" in sel["random_refused"]
    direct = _pld(dp_accounting.ComposedDpEvent([RUN, OTHER]))
    assert sel["fixed_epsilon"] == pytest.approx(direct, rel=1e-9)


@pytest.mark.parametrize("change,msg", [
    ({"epsilon": None}, "not private"), ({"dp_event": None}, "no dp_event"),
    ({"delta": 1e-6}, "different privacy.delta"), ({"accuracy_mean": None}, "no finite"),
])
def test_refusals_are_one_line_naming_the_run(change, msg):
    runs = [_summary(RUN, 0.7, 0.1), {**_summary(RUN, 0.8, 0.2), **change}]
    with pytest.raises(SelectionError, match=msg) as e:
        select_best(_groups(runs), "accuracy_mean")
    assert "\n" not in str(e.value)


def test_cli_on_a_real_sweep(tmp_path, capsys):
    """Two learning rates, the same privacy event: the report's Poisson row is dp-accounting's."""
    from fedudp.run import run
    from tests.conftest import tiny_cfg
    for lr in (0.1, 0.5):
        run(tiny_cfg("full_dp", **{"train__lr": lr, "privacy__noise_multiplier": 2.0,
                                   "privacy__epsilon": 50.0}), tmp_path / f"lr{lr}")
    assert report.main([str(tmp_path), "--select-best", "accuracy_mean",
                        "--sweep-size", "poisson"]) == 0
    out = capsys.readouterr().out
    s = json.loads((tmp_path / "lr0.1" / "summary.json").read_text())
    ev = event_from_json(s["dp_event"])
    assert ev == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 3)
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(dpe.RepeatAndSelectDpEvent(ev, 2.0, float("inf")))
    assert f"{acc.get_epsilon(1e-5):.3f}" in out
    assert f"{_pld(dp_accounting.ComposedDpEvent([ev, ev])):.3f}" in out
    assert report.main([str(tmp_path), "--select-best", "nope"]) == 2
