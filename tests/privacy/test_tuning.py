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
    dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(3.0)), 5
)
OTHER = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(6.0), 5)


@pytest.mark.parametrize(
    "event",
    [
        RUN,
        OTHER,
        dp_accounting.ComposedDpEvent([RUN, OTHER]),
        dp_accounting.LaplaceDpEvent(0.5),
        dp_accounting.ZCDpEvent(0.1),
        dpe.RepeatAndSelectDpEvent(RUN, 4.0, float("inf")),
    ],
)
def test_events_round_trip_through_json(event):
    assert event_from_json(json.loads(json.dumps(event_to_json(event)))) == event


@pytest.mark.parametrize(
    "bad",
    [
        {"dp_event": "OrderedDict"},
        {"dp_event": "GaussianDpEvent", "noise_multiplier": 1, "x": 2},
        {"event": "GaussianDpEvent"},
        {"dp_event": ["GaussianDpEvent"]},
    ],
)
def test_only_dp_accounting_events_are_read(bad):
    with pytest.raises(ValueError):
        event_from_json(bad)


def _summary(event, acc, lr, seed=0, delta=1e-5, eps=1.0, **more):
    return {
        "method": "full_dp",
        "accuracy_mean": acc,
        "epsilon": eps,
        "delta": delta,
        "guarantee": "certified",
        "dp_event": event_to_json(event),
        "_dir": f"run{lr}_{seed}",
        "_config": {"method": "full_dp", "seed": seed, "train": {"lr": lr}},
        **more,
    }


def _groups(summaries):
    a, b = report.groups_of(summaries)
    return {**a, **b}


def _pld(event, delta=1e-5):
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


def _rdp(event, delta=1e-5):
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(delta)


# The issue's sweep: each run is 100 rounds of Poisson-sampled (q = 0.1) Gaussian, z = 1.0
ISSUE_RUN = dp_accounting.SelfComposedDpEvent(
    dp_accounting.PoissonSampledDpEvent(0.1, dp_accounting.GaussianDpEvent(1.0)), 100
)


def _sweep(event, configs, seeds):
    return [
        _summary(event, 0.5 + c / 10 + s / 100, 0.1 * (c + 1), seed=s)
        for c in range(configs)
        for s in range(seeds)
    ]


def test_issue_poisson10_recomputed_with_literal_constants():
    """Poisson(10) declared, 6 candidates of one run present: the theorem's 15.88 (RDP of
    RepeatAndSelect(run, 10, inf)), not the 12.87 of the count present used as the mean."""
    runs = _sweep(ISSUE_RUN, 6, 1)
    sel = select_best(_groups(runs), "accuracy_mean", sweep_size="poisson", sweep_mean=10)
    direct = _rdp(dpe.RepeatAndSelectDpEvent(ISSUE_RUN, 10.0, float("inf")))

    def check(eps):
        assert eps == pytest.approx(direct, rel=1e-9) and round(eps, 2) == 15.88

    check(sel["tuning_epsilon"])
    assert sel["rule"] == (
        "RepeatAndSelect, Poisson(mean 10, declared), per-candidate event = one run"
    )
    # the weakened twin (the number of runs present as the mean) is caught
    twin = select_best(_groups(runs), "accuracy_mean", sweep_size="poisson", sweep_mean=len(runs))
    assert round(twin["tuning_epsilon"], 2) == 12.87
    with pytest.raises(AssertionError):
        check(twin["tuning_epsilon"])


def test_issue_seed_aware_candidate_is_its_seeds_composed():
    """3 configurations x 2 seeds: a candidate is one configuration, its event the 2-fold
    composition of the run's. At the issue's mean 3: 14.59 (seed-aware), not the 12.87 of one
    run's event with a per-run count."""
    runs = _sweep(ISSUE_RUN, 3, 2)
    pair = dp_accounting.SelfComposedDpEvent(ISSUE_RUN, 2)
    sel = select_best(_groups(runs), "accuracy_mean", sweep_size="poisson", sweep_mean=3)

    def check(eps):
        assert (
            eps
            == pytest.approx(_rdp(dpe.RepeatAndSelectDpEvent(pair, 3.0, float("inf"))), rel=1e-9)
            and round(eps, 2) == 14.59
        )

    check(sel["tuning_epsilon"])
    assert sel["rule"].endswith("per-candidate event = 2 seeds composed")
    assert sel["settings"]["train.lr"] == pytest.approx(0.3) and len(sel["chosen_runs"]) == 2
    assert sel["candidate_epsilon"] == pytest.approx(_pld(pair), rel=1e-9)
    # the weakened twin: one run's event paired with the per-run count (6)
    twin = _rdp(dpe.RepeatAndSelectDpEvent(ISSUE_RUN, 6.0, float("inf")))
    assert round(twin, 2) == 12.87
    with pytest.raises(AssertionError):
        check(twin)


def test_grid_costs_the_composition_of_every_run_of_every_configuration():
    runs = _sweep(RUN, 3, 2)
    sel = select_best(_groups(runs), "accuracy_mean")
    assert sel["sweep_size"] == "grid" and sel["configurations"] == 3 and sel["runs"] == 6
    direct = _pld(dp_accounting.ComposedDpEvent([RUN] * 6))
    assert sel["tuning_epsilon"] == pytest.approx(direct, rel=1e-6)
    assert sel["rule"] == "grid: composition of 6 runs (3 configurations × 2 seeds)"
    assert sel["tuning_accountant"] == "pld"
    # the weakened twin (one candidate's seeds only) is caught
    assert sel["candidate_epsilon"] == pytest.approx(
        _pld(dp_accounting.SelfComposedDpEvent(RUN, 2)), rel=1e-9
    )
    assert sel["candidate_epsilon"] < sel["tuning_epsilon"] - 1
    low = select_best(_groups(runs), "accuracy_mean", lower=True)
    assert low["settings"]["train.lr"] == pytest.approx(0.1)


def test_grid_of_different_mechanisms_composes_them_all():
    runs = [_summary(RUN, 0.7, 0.1), _summary(RUN, 0.8, 0.1, seed=1), _summary(OTHER, 0.9, 0.5)]
    sel = select_best(_groups(runs), "accuracy_mean")
    assert sel["tuning_epsilon"] == pytest.approx(
        _pld(dp_accounting.ComposedDpEvent([RUN, RUN, OTHER])), rel=1e-9
    )
    assert sel["rule"] == "grid: composition of 3 runs (2 configurations of 1-2 seeds)"


@pytest.mark.parametrize(
    "dist,shape,extra",
    [
        ("geometric", 1.0, {}),
        ("logarithmic", 0.0, {}),
        ("negative_binomial", 0.5, {"sweep_shape": 0.5}),
    ],
)
def test_truncated_negative_binomial_sizes(dist, shape, extra):
    runs = _sweep(RUN, 4, 1)
    sel = select_best(_groups(runs), "accuracy_mean", sweep_size=dist, sweep_mean=8, **extra)
    assert sel["tuning_epsilon"] == pytest.approx(
        _rdp(dpe.RepeatAndSelectDpEvent(RUN, 8.0, shape)), rel=1e-9
    )
    assert sel["sweep_shape"] == shape and "mean 8, declared" in sel["rule"]
    # the count present (4) would give less: the declared mean is what is used
    assert sel["tuning_epsilon"] > _rdp(dpe.RepeatAndSelectDpEvent(RUN, 4.0, shape))


def test_random_count_needs_one_mechanism():
    runs = [_summary(RUN, 0.7, 0.1), _summary(OTHER, 0.8, 0.2)]
    sel = select_best(_groups(runs), "accuracy_mean", sweep_size="poisson", sweep_mean=10)
    assert sel["tuning_epsilon"] is None and "not one mechanism" in sel["refused"]
    uneven = _sweep(RUN, 2, 2)[:3]  # one configuration with 2 seeds, one with 1
    sel = select_best(_groups(uneven), "accuracy_mean", sweep_size="poisson", sweep_mean=10)
    assert sel["tuning_epsilon"] is None and "different seed counts" in sel["refused"]


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"sweep_size": "poisson"}, "--sweep-mean"),
        ({"sweep_size": "geometric"}, "--sweep-mean"),
        ({"sweep_size": "grid", "sweep_mean": 10}, "--sweep-mean: a grid"),
        ({"sweep_mean": 10}, "--sweep-mean: a grid"),
        ({"sweep_size": "grid", "sweep_shape": 1.0}, "--sweep-shape: a grid"),
        ({"sweep_size": "poisson", "sweep_mean": 0.5}, "--sweep-mean must be"),
        ({"sweep_size": "poisson", "sweep_mean": float("nan")}, "--sweep-mean must be"),
        ({"sweep_size": "poisson", "sweep_mean": 10, "sweep_shape": 2.0}, "--sweep-shape"),
        ({"sweep_size": "negative_binomial", "sweep_mean": 10}, "--sweep-shape ETA"),
        (
            {"sweep_size": "negative_binomial", "sweep_mean": 10, "sweep_shape": 0.0},
            "--sweep-shape",
        ),
        ({"sweep_size": "fixed"}, "--sweep-size must be one of"),
    ],
)
def test_undeclared_or_inconsistent_rules_are_refused_in_one_line(kw, msg):
    with pytest.raises(SelectionError, match=msg) as e:
        select_best(_groups(_sweep(RUN, 2, 1)), "accuracy_mean", **kw)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--sweep-size", "poisson"], "--sweep-mean M"),
        (["--sweep-mean", "10"], "--sweep-mean: a grid"),
    ],
)
def test_cli_refuses_the_rule_before_reading_any_run(tmp_path, capsys, argv, msg):
    assert report.main([str(tmp_path / "missing"), "--select-best", "accuracy_mean", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and "no summary.json" not in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"epsilon": None}, "not private"),
        ({"dp_event": None}, "no dp_event"),
        ({"delta": 1e-6}, "different privacy.delta"),
        ({"accuracy_mean": None}, "no finite"),
    ],
)
def test_refusals_are_one_line_naming_the_run(change, msg):
    runs = [_summary(RUN, 0.7, 0.1), {**_summary(RUN, 0.8, 0.2), **change}]
    with pytest.raises(SelectionError, match=msg) as e:
        select_best(_groups(runs), "accuracy_mean")
    assert "\n" not in str(e.value)


def test_cli_on_a_real_sweep(tmp_path, capsys):
    """Two learning rates x two seeds, the same privacy event: the report's rows are
    dp-accounting's, with the rule and the single-run ε beside them."""
    from fedudp.run import run
    from tests.conftest import tiny_cfg

    for lr in (0.1, 0.5):
        for seed in (0, 1):
            run(
                tiny_cfg(
                    "full_dp",
                    **{
                        "train__lr": lr,
                        "seed": seed,
                        "train__rounds": 1,
                        "privacy__noise_multiplier": 2.0,
                        "privacy__epsilon": 50.0,
                    },
                ),
                tmp_path / f"lr{lr}_{seed}",
            )
    s = json.loads((tmp_path / "lr0.1_0" / "summary.json").read_text())
    ev = event_from_json(s["dp_event"])
    assert ev == dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 1)
    pair = dp_accounting.SelfComposedDpEvent(ev, 2)
    assert (
        report.main(
            [
                str(tmp_path),
                "--select-best",
                "accuracy_mean",
                "--sweep-size",
                "poisson",
                "--sweep-mean",
                "10",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    ras = _rdp(dpe.RepeatAndSelectDpEvent(pair, 10.0, float("inf")))
    assert (
        f"| the choice (tuning-inclusive) | {ras:.3f} | dp-accounting RDP | RepeatAndSelect, "
        "Poisson(mean 10, declared), per-candidate event = 2 seeds composed |"
    ) in out
    assert f"| {s['epsilon']:.3f} | the run's ledger |" in out
    assert f"| {_pld(pair):.3f} | dp-accounting PLD |" in out
    assert report.main([str(tmp_path), "--select-best", "accuracy_mean"]) == 0
    out = capsys.readouterr().out
    assert (
        f"| the choice (tuning-inclusive) | {_pld(dp_accounting.ComposedDpEvent([ev] * 4)):.3f}"
        " | dp-accounting PLD | grid: composition of 4 runs (2 configurations × 2 seeds) |"
    ) in out
    assert report.main([str(tmp_path), "--select-best", "nope"]) == 2
