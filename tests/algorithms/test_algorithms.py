"""The seeds' training algorithms (fedudp/algorithms/, docs/algorithms.md#training-algorithms):
each preset end to end on a tiny
synthetic convex problem, the disjoint-phase (parallel) and one-AboveThreshold accounting against
a direct dp-accounting computation, Huang Alg. 2's owner schedule accounting, Huang Alg. 1's
noise on the shared coordinates only (std measured), the halting path, config errors."""

from __future__ import annotations

import copy
import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from fedudp.config import ConfigError, RunConfig, register
from fedudp.privacy.accountant import ApproxDp, Parallel
from fedudp.cli import CONF_DIR
from fedudp.run import execute, prepare, run

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
SMALL = ["progress=false", "dataset.pool_test=1000"]
# tiny versions of each preset (a few seconds each)
TINY = {
    "levy_alg3": [
        "dataset.num_records=4000",
        "dataset.pool_train=4000",
        "partition.num_owners=8",
        "partition.records_per_user=10",
        "train.rounds=4",
        "privacy.epsilon=5",
    ],
    "levy_alg4": [
        "dataset.num_records=4000",
        "dataset.pool_train=4000",
        "partition.num_owners=8",
        "partition.records_per_user=10",
        "train.rounds=4",
        "privacy.epsilon=5",
        "algorithm.phases=2",
    ],
    "asi_alg3": [
        "dataset.num_records=2000",
        "dataset.pool_train=2000",
        "partition.num_owners=8",
        "partition.records_per_user=5",
        "train.rounds=3",
        "privacy.epsilon=20",
        "privacy.delta=1e-3",
        "estimator.tau=3.0",
    ],
    "asi_alg4": [
        "dataset.num_records=8000",
        "dataset.pool_train=8000",
        "partition.num_owners=8",
        "partition.records_per_user=5",
        "train.rounds=4",
        "privacy.epsilon=20",
        "privacy.delta=1e-3",
        "estimator.tau=3.0",
    ],
    "huang_alg1": [
        "dataset.num_records=200",
        "dataset.pool_train=1000",
        "partition.num_owners=4",
        "train.rounds=3",
        "privacy.epsilon=8",
        "privacy.delta=1e-3",
    ],
    "huang_alg2": [
        "dataset.num_records=4000",
        "dataset.pool_train=4000",
        "partition.num_owners=4",
        "partition.records_per_user=5",
        "train.rounds=8",
        "privacy.epsilon=5",
    ],
}


def preset(name: str, *extra: str) -> RunConfig:
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        dcfg = compose(
            config_name="config", overrides=[f"+experiment={name}", *SMALL, *TINY[name], *extra]
        )
    return OmegaConf.to_object(dcfg)


# -- 1. every preset end to end -------------------------------------------------------------------
@pytest.mark.parametrize(
    "name", ["levy_alg3", "levy_alg4", "asi_alg3", "asi_alg4", "huang_alg1", "huang_alg2"]
)
def test_preset_end_to_end(name, tmp_path):
    cfg = preset(name)
    s = run(cfg, tmp_path)
    assert s["stop_reason"] == "completed" and s["rounds_completed"] == cfg.train.rounds
    assert s["guarantee"] == "certified" and s["accounting"] == "certified"
    assert 0 < s["epsilon"] <= cfg.privacy.epsilon * (1 + 1e-6)
    assert math.isfinite(s["loss"]) and s["accuracy_mean"] > 0.4
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert len(ledger["entries"]) == cfg.train.rounds
    if name == "levy_alg3":  # the existing combination: no algorithm module
        assert "algorithm" not in s and s["aggregator"] == "winsorized"
        return
    algo = s["algorithm"]
    assert algo["name"] == name and algo["configured_T"] == cfg.train.rounds
    assert algo["paper_T"] > 0 and algo["seed"].split()[0].endswith(".txt")
    assert ledger["extra"]["algorithm"]["name"] == name
    if name in ("levy_alg4", "asi_alg4"):
        assert any("PARALLEL" in n for n in ledger["notes"])
        assert ledger["entries"][0]["event"].startswith("Parallel(")


@pytest.mark.parametrize("name", ["asi_alg3", "huang_alg1", "huang_alg2"])
def test_paper_mode_is_labelled_heuristic(name, tmp_path):
    s = run(preset(name, "privacy.accounting=paper"), tmp_path)
    assert s["stop_reason"] == "completed"
    assert s["guarantee"] == "heuristic" and s["accounting"] == "paper"


# -- 2. accounting against a direct dp-accounting computation ------------------------------------
def _rdp_eps(event, count: int, delta: float) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_REMOVE)
    acc.compose(dp_accounting.SelfComposedDpEvent(event, count))
    return acc.get_epsilon(delta)


def _pld_eps(event, count: int, delta: float, interval: float) -> float:
    acc = pld_privacy_accountant.PLDAccountant(ADD_REMOVE, value_discretization_interval=interval)
    acc.compose(dp_accounting.SelfComposedDpEvent(event, count))
    return acc.get_epsilon(delta)


def test_levy_alg4_phases_compose_in_parallel():
    """Disjoint phases: the run's ε is the worst phase's ε over its own rounds only (RDP of the
    phase's WinsorizedMeanHighD event), not the sum over phases."""
    cfg = preset("levy_alg4", "algorithm.phases=2", "train.rounds=5")
    p = prepare(cfg)
    execute(p)
    phases = p.algorithm.plan.phases
    assert [ph.rounds for ph in phases] == [2, 3]
    assert len(set(map(int, np.concatenate([ph.units for ph in phases])))) == sum(
        len(ph.units) for ph in phases
    )
    direct = [_rdp_eps(ph.aggregator.dp_event(), ph.rounds, cfg.privacy.delta) for ph in phases]
    parts = p.billboard.accountant.part_epsilons(cfg.privacy.delta)
    np.testing.assert_allclose(parts, direct, rtol=1e-9)
    assert p.ledger.epsilon == pytest.approx(max(direct), rel=1e-9)
    sequential = _rdp_eps(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(ph.aggregator.dp_event(), ph.rounds)
                for ph in phases
            ]
        ),
        1,
        cfg.privacy.delta,
    )
    assert p.ledger.epsilon < sequential
    assert all(e.event.startswith("Parallel(") for e in p.ledger.entries)


def test_asi_alg4_phases_each_spend_one_above_threshold():
    cfg = preset("asi_alg4")
    p = prepare(cfg)
    execute(p)
    phases = p.algorithm.plan.phases
    eps, delta = cfg.privacy.epsilon, cfg.privacy.delta
    direct = []
    for ph in phases:
        a = ph.aggregator
        assert a.at is not None and a.at.queries == ph.rounds  # its own single instance
        direct.append(
            a.eps_at
            + _pld_eps(
                dp_accounting.GaussianDpEvent(a.noise_multiplier),
                ph.rounds,
                delta - a.delta_reserved,
                1e-4 * eps,
            )
        )
    assert p.ledger.epsilon == pytest.approx(max(direct), rel=1e-6)
    assert isinstance(p.billboard.one_off, Parallel)


def test_asi_alg3_one_above_threshold_for_all_queries():
    """ONE AboveThreshold (ε/2, charged once) across all T queries + T Gaussian releases at δ/2."""
    cfg = preset("asi_alg3", "train.rounds=4")
    p = prepare(cfg)
    execute(p)
    a = p.aggregator
    assert a.at is not None and a.at.queries == 4 and not a.at.halted
    assert p.billboard.one_off == ApproxDp(cfg.privacy.epsilon / 2, cfg.privacy.delta / 2)
    assert p.ledger.extra["one_off_event"] == str(p.billboard.one_off)
    gauss = _pld_eps(
        dp_accounting.GaussianDpEvent(a.noise_multiplier),
        4,
        cfg.privacy.delta / 2,
        1e-4 * cfg.privacy.epsilon,
    )
    assert p.ledger.epsilon == pytest.approx(cfg.privacy.epsilon / 2 + gauss, rel=1e-6)
    # a per-query AboveThreshold would have charged ε/2 four times
    assert p.ledger.epsilon < 4 * cfg.privacy.epsilon / 2


def test_asi_alg3_halt_returns_theta0(tmp_path):
    cfg = preset("asi_alg3", "estimator.tau=1e-9")  # nobody within τ: the score test fails
    p = prepare(cfg)
    u0 = p.billboard.u.clone()
    res = execute(p)
    assert res.stop_reason == "halted" and res.rounds_completed == 1
    assert torch.equal(p.billboard.u, u0)


def test_huang_alg2_owner_schedule_accounting():
    """Certified: one owner per step; each owner's users are composed over its own steps only
    (parallel over owners), the estimator calibrated for the busiest owner's count."""
    cfg = preset("huang_alg2")
    p = prepare(cfg)
    execute(p)
    plan, n = p.algorithm.plan, cfg.partition.num_owners
    offs = np.concatenate([[0], np.cumsum(np.diff(p.fed.owner_user_offsets))])
    counts = np.zeros(n, dtype=int)
    for r in range(1, cfg.train.rounds + 1):
        units = plan.cohort(r)
        owners = np.unique(p.fed.user_owner[units])
        assert len(owners) == 1 and len(units) == offs[owners[0] + 1] - offs[owners[0]]
        counts[owners[0]] += 1
    ev = p.aggregator.dp_event()
    direct = [_rdp_eps(ev, int(c), cfg.privacy.delta) if c else 0.0 for c in counts]
    np.testing.assert_allclose(
        p.billboard.accountant.part_epsilons(cfg.privacy.delta), direct, rtol=1e-9
    )
    assert p.ledger.epsilon == pytest.approx(max(direct), rel=1e-9)
    assert p.ledger.epsilon <= cfg.privacy.epsilon * (1 + 1e-6)


def test_huang_alg2_paper_amplification_by_basic_composition():
    cfg = preset("huang_alg2", "privacy.accounting=paper")
    p = prepare(cfg)
    execute(p)
    T, n, eps = cfg.train.rounds, cfg.partition.num_owners, cfg.privacy.epsilon
    eps_call = math.log1p(n * math.expm1(eps / T))
    assert p.ledger.epsilon == pytest.approx(T * math.log1p(math.expm1(eps_call) / n), rel=1e-9)
    assert p.ledger.epsilon == pytest.approx(eps, rel=1e-9)
    assert p.ledger.guarantee == "heuristic"


# -- 3. Huang Alg. 1: noise on the shared coordinates only ------------------------------------------
def test_huang_alg1_noise_on_shared_only():
    """Over many draws of the round's noise with one fixed sampled record: the shared step's noise
    has the calibrated std σ per coordinate, the personal block's update is noise-free (the same
    every draw, exactly -η times the record's personal gradient, and only for its owner)."""
    cfg = preset("huang_alg1", "algorithm.step_size=0.01")  # small: no projection on ||u|| <= R
    p = prepare(cfg)
    bb, owners, fed, agg = p.billboard, p.owners, p.fed, p.aggregator
    bb.accountant = None  # accounting is not under test here (and is slow)
    eta = p.algorithm.plan.phases[0].step_size
    unit = np.array([5])
    owners.hooks.cohort = lambda r: unit  # the owner hook's cohort, fixed for the test
    shared0 = bb.shared_params()
    personal0 = owners.initial_personal(fed.num_owners)
    personal0 = {k: v + 0.3 for k, v in personal0.items()}  # a non-trivial starting point
    u0 = bb.u.clone()
    noise, personal_moves = [], []
    for r in range(10, 1010):
        pers = owners.personal_round(fed, shared0, personal0, r)
        personal_moves.append(torch.cat([v.reshape(-1) for v in pers.values()]))
        reply = owners.reply(fed, shared0, personal0, unit, r, agg.constraint)
        g = reply.contribution.total.to(torch.float64)
        bb.u = u0.clone()
        bb.release([reply], r)
        step = (u0.to(torch.float64) - bb.u.to(torch.float64)) / eta  # = g + noise (q N = 1)
        noise.append(step - g)
    noise = torch.stack(noise)
    sigma = agg.noise_std / agg.sampling.expected_cohort
    assert sigma == pytest.approx(agg.noise_multiplier * cfg.privacy.clip)
    assert noise.shape[1] == p.billboard.dim and p.spec.personal  # shared block only here
    std = noise.std(dim=0)
    assert float(std.mean()) == pytest.approx(sigma, rel=0.03)
    assert float(std.min()) > 0.85 * sigma and float(std.max()) < 1.15 * sigma
    moves = torch.stack(personal_moves)
    assert torch.equal(moves, moves[:1].expand_as(moves))  # no noise: identical draws
    before = torch.cat([v.reshape(-1) for v in personal0.values()])
    delta = (moves[0] - before).reshape(fed.num_owners, -1)
    j = int(fed.user_owner[unit[0]])
    assert float(delta[j].abs().max()) > 0
    assert float(delta[np.arange(fed.num_owners) != j].abs().max()) == 0.0
    # exactly -η times the record's gradient with respect to the personal block
    from fedudp.owner import local_sgd
    from fedudp.owner.owners import user_units

    grads = local_sgd.mean_gradients(
        owners.model,
        local_sgd.select(personal0, np.array([j])),
        {},
        shared0,
        fed.x,
        fed.y,
        user_units(fed, unit),
    )
    want = torch.cat([g.reshape(-1) for g in grads.values()])
    torch.testing.assert_close(delta[j], -eta * want.to(delta.dtype))


def test_huang_alg1_full_dp_baseline_noises_every_personal_block():
    """algorithm.noise_personal (the paper's full-DP baseline): each step EVERY owner's personal
    block gets -η b_j on top of its noise-free move (the gradient only for the sampled record's
    owner), b_j ~ N(0, σ_eff² I_k) with σ_eff the shared step's per-coordinate noise std,
    drawn per (round, owner) from the keyed randomness; measured over many steps."""
    cfg = preset(
        "huang_alg1",
        "algorithm.step_size=0.01",
        "privacy.noise_multiplier=0.5",
        "algorithm.noise_personal=true",
    )
    p = prepare(cfg)
    owners, fed, agg = p.owners, p.fed, p.aggregator
    sigma = owners.hooks.noise_std
    assert sigma == pytest.approx(agg.noise_std / agg.sampling.expected_cohort)  # "same σ"
    assert sigma == pytest.approx(0.5 * cfg.privacy.clip)
    eta = owners.hooks.step
    assert eta == p.algorithm.plan.phases[0].step_size == 0.01
    assert p.algorithm.summary["noise_personal"] and any(
        "personal noise is extra" in n for n in p.ledger.notes
    )
    clean = copy.copy(owners)
    clean.hooks = copy.copy(owners.hooks)
    clean.hooks.noise_std = None
    unit = np.array([5])
    j = int(fed.user_owner[unit[0]])
    shared0 = p.billboard.shared_params()
    personal0 = {k: v + 0.3 for k, v in owners.initial_personal(fed.num_owners).items()}
    flat = lambda d: torch.cat([v.reshape(len(v), -1) for v in d.values()], 1).to(torch.float64)  # noqa: E731
    draws = []
    for r in range(1, 801):
        units = unit if r % 2 else np.zeros(0, np.int64)  # rounds with and without a sample
        owners.hooks.cohort = clean.hooks.cohort = lambda _r, u=units: u
        noisy = flat(owners.personal_round(fed, shared0, personal0, r))
        free = flat(clean.personal_round(fed, shared0, personal0, r))
        if not r % 2:
            assert torch.equal(free, flat(personal0))  # nobody sampled: no gradient move
        draws.append((free - noisy) / eta)  # = b_t for every owner
    b = torch.stack(draws)  # [steps, owners, k]
    assert b.shape[1] == fed.num_owners
    std = b.std(dim=0)
    assert float(std.mean()) == pytest.approx(sigma, rel=0.05)
    assert float(std.min()) > 0.85 * sigma and float(std.max()) < 1.15 * sigma
    assert float(b.mean(dim=0).abs().max()) < 4 * sigma / math.sqrt(len(b))
    # fresh per owner: uncorrelated across owners
    c = np.corrcoef(b[:, :, 0].T.numpy())
    assert np.abs(c[~np.eye(len(c), dtype=bool)]).max() < 0.15
    # exactly the keyed draw of (seed, PERSONAL_NOISE, round, owner id), in float64
    from fedudp.randomness import Purpose, numpy_rng

    want = sigma * numpy_rng(cfg.seed, Purpose.PERSONAL_NOISE, 1, j).standard_normal(b.shape[2])
    np.testing.assert_allclose(b[0, j].numpy(), want, rtol=1e-4, atol=1e-5)


def test_huang_alg1_noise_personal_end_to_end():
    """Same σ, T and step: the shared release and the accounting are unchanged (certified joint
    DP: shared gradients at the public personal copy), every owner's personal block differs.
    Without algorithm.step_size, η is the paper's formula at the noised dimension nk + ℓ."""
    from fedudp.algorithms.huang_alg1 import paper_step_size

    base = ["algorithm.step_size=0.5", "privacy.noise_multiplier=0.5"]
    runs = {}
    for noise in (False, True):
        p = prepare(preset("huang_alg1", *base, f"algorithm.noise_personal={str(noise).lower()}"))
        runs[noise] = (p, execute(p))
    (pj, rj), (pf, rf) = runs[False], runs[True]
    assert torch.equal(pj.billboard.u, pf.billboard.u)
    assert pj.ledger.epsilon == pf.ledger.epsilon > 0
    for k in rj.personal:
        d = (rj.personal[k] - rf.personal[k]).reshape(len(rj.personal[k]), -1).abs().amax(1)
        assert bool((d > 0).all())
    assert pj.owners.hooks.noise_std is None and pf.owners.hooks.noise_std > 0
    cfg = preset("huang_alg1", "privacy.noise_multiplier=0.5", "algorithm.noise_personal=true")
    s = prepare(cfg).algorithm.summary
    nk = cfg.partition.num_owners * cfg.dataset.classes  # the personal logit offsets
    assert s["personal_dim_total"] == nk and s["noised_dim"] == s["shared_dim"] + nk
    assert s["step_size"] == pytest.approx(
        paper_step_size(
            s["R"],
            s["L"],
            cfg.train.rounds,
            s["records"],
            s["shared_dim"] + nk,
            cfg.privacy.epsilon,
            cfg.privacy.delta,
        )
    )


def test_huang_alg1_samples_records_at_one_over_mn():
    cfg = preset("huang_alg1")
    p = prepare(cfg)
    N = p.fed.num_records
    assert p.aggregator.sampling.rate == pytest.approx(1 / N) and p.fed.num_users == N
    sizes = [len(p.algorithm.plan.cohort(r)) for r in range(1, 4001)]
    assert np.mean(sizes) == pytest.approx(1.0, abs=0.06)  # Poisson(1) cohorts
    assert min(sizes) == 0 and max(sizes) >= 3
    paper = prepare(preset("huang_alg1", "privacy.accounting=paper"))
    assert {len(paper.algorithm.plan.cohort(r)) for r in range(1, 500)} == {1}  # one record


# -- 4. config errors before any work ----------------------------------------------------------------
@pytest.mark.parametrize(
    "name,override,key",
    [
        ("huang_alg1", "partition.records_per_user=2", "partition.records_per_user"),
        ("levy_alg4", "aggregator=gaussian", "aggregator"),
        ("asi_alg3", "train.shared_update=delta", "train.shared_update"),
        ("huang_alg2", "engine=flower", "engine"),
        ("levy_alg4", "algorithm.radius=-1", "algorithm.radius"),
        ("huang_alg2", "partition.records_per_user=7", "partition.records_per_user"),
        ("asi_alg3", "method=fedavg", "aggregator"),
    ],
)
def test_bad_algorithm_config_names_the_key(name, override, key, tmp_path):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        run(preset(name, override), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "name,extra",
    [
        ("huang_alg1", ["method=full_dp"]),  # full_dp has no personal blocks
        ("huang_alg2", []),  # Huang Alg. 1's baseline only
        ("levy_alg3", []),  # algorithm.name=none
    ],
)
def test_noise_personal_refused_outside_huang_alg1_joint_dp(name, extra, tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.noise_personal"):
        run(preset(name, *extra, "algorithm.noise_personal=true"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


# -- checkpoints: the plan's state (averaged iterate, phase starts, AboveThreshold) ----------------
def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize(
    "name,rounds,stop",
    [("levy_alg4", 6, 4), ("asi_alg3", 5, 2), ("huang_alg1", 3, 1), ("huang_alg2", 8, 5)],
)
def test_interrupted_algorithm_resumes_to_the_uninterrupted_run(
    name, rounds, stop, tmp_path, monkeypatch
):
    from conftest import interrupt_after
    from fedudp.protocol import checkpoint as ck

    extra = (
        "checkpoint.every=1",
        "checkpoint.keep=20",
        "checkpoint.keep_after_finish=all",
        f"train.rounds={rounds}",
    )
    ref = run(preset(name, *extra), tmp_path / "ref")
    interrupt_after(monkeypatch, stop)
    out = tmp_path / "cut"
    assert run(preset(name, *extra), out)["stop_reason"] == "interrupted"
    monkeypatch.undo()
    res = run(preset(name, *extra, f"resume={out}"), "ignored")
    assert res["stop_reason"] == "completed" and res["rounds_completed"] == rounds
    a, b = (
        ck.load_file(ck.ckpt_path(tmp_path / "ref", rounds)),
        ck.load_file(ck.ckpt_path(out, rounds)),
    )
    assert torch.equal(a["billboard"]["u"], b["billboard"]["u"])
    assert a["billboard"]["entries"] == b["billboard"]["entries"]
    pa, pb = a["billboard"]["plan"], b["billboard"]["plan"]
    assert _same(pa, pb)  # averaged iterate, phase start, AboveThreshold state
    assert res["accuracy_mean"] == ref["accuracy_mean"] and res["loss"] == ref["loss"]
