"""Standard FedAvg and owner-side DP-SGD (``privacy.placement=local_dpsgd``;
docs/algorithms.md#owner-side-dp-sgd)."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from conftest import tiny_cfg
from fedudp.config import ConfigError
from fedudp.aggregators.local_dpsgd import owner_rates
from fedudp.owner.dpsgd import DpSgdSpec, clipped_sums, dpsgd_deltas
from fedudp.randomness import Purpose, numpy_rng
from fedudp.run import execute, prepare, run


def cfg_kw(method, **kw):
    return tiny_cfg(method, **{k.replace(".", "__"): v for k, v in kw.items()})


# -- accounting ----------------------------------------------------------------------------------
def test_worst_owner_epsilon_equals_a_direct_dp_accounting_computation(tmp_path):
    # 150 records over 4 owners: 38, 38, 37, 37 users; batch 8 -> two parts (q = 8/38, 8/37)
    kw = {
        "privacy.placement": "local_dpsgd",
        "dataset.num_records": 150,
        "train.rounds": 3,
        "train.local_epochs": 2,
    }
    s = run(cfg_kw("full_dp", **kw), tmp_path)
    z, eps, delta = s["noise_multiplier"], [], 1e-5
    for m in (37, 38):
        q, steps = 8 / m, 2 * math.ceil(m / 8) * 3
        acc = dp_accounting.pld.PLDAccountant(
            dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4
        )
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
        eps.append(acc.get_epsilon(delta))
    assert s["epsilon"] == pytest.approx(max(eps), rel=1e-3)
    assert max(eps) <= 1.0 + 1e-6 and max(eps) >= 0.99  # calibrated to the worst part
    led = json.loads((tmp_path / "ledger.json").read_text())
    assert (
        "M_j=37" in led["notes"][-1]
        and "M_j=38" in led["notes"][-1]
        and "PUBLIC" in led["notes"][-1]
    )
    assert [e["epsilon"] for e in led["entries"]] == sorted(e["epsilon"] for e in led["entries"])
    assert s["aggregator"] == "local_dpsgd" and s["placement"] == "local_dpsgd"


def test_owner_rates():
    q, steps = owner_rates(np.array([5, 32, 40, 100]), 32)
    np.testing.assert_allclose(q, [1.0, 1.0, 32 / 40, 0.32])
    np.testing.assert_array_equal(steps, [1, 1, 2, 4])


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"aggregator": "winsorized"}, "aggregator"),
        ({"privacy.unit": "owner"}, "privacy.unit"),
        ({"privacy.calibration": "closed_form"}, "privacy.calibration"),
    ],
)
def test_local_dpsgd_refuses_what_it_cannot_account(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        prepare(cfg_kw("joint_dp", **{"privacy.placement": "local_dpsgd", **kw}))


# -- sensitivity and noise ------------------------------------------------------------------------
finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=64)


@settings(max_examples=60, deadline=None)
@given(
    G=arrays(np.float64, st.tuples(st.integers(2, 10), st.integers(1, 5)), elements=finite),
    clip=st.floats(0.01, 20.0),
    i=st.integers(0, 99),
    batch=st.integers(1, 16),
)
def test_one_user_moves_an_owner_step_by_at_most_c_over_b(G, clip, i, batch):
    G = torch.from_numpy(G)
    rows = torch.zeros(G.shape[0], dtype=torch.int64)  # one owner
    i = i % G.shape[0]
    keep = torch.arange(G.shape[0]) != i
    a = clipped_sums(G, rows, 1, clip)[0] / batch
    b = clipped_sums(G[keep], rows[keep], 1, clip)[0] / batch
    assert float(torch.linalg.vector_norm(a - b)) <= clip / batch * (1 + 1e-9)


def test_clipped_sums_of_blocks_equal_those_of_the_concatenated_rows():
    g = torch.Generator().manual_seed(0)
    G = torch.randn(50, 30, generator=g, dtype=torch.float64) * 3
    rows = torch.randint(0, 4, (50,), generator=g)
    whole = clipped_sums(G, rows, 4, 2.0)
    parts = clipped_sums([G[:, :7], G[:, 7:20], G[:, 20:]], rows, 4, 2.0)
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)
    clipped = G * torch.clamp(2.0 / torch.linalg.vector_norm(G, dim=1), max=1.0).unsqueeze(1)
    # the clipped rows are shrunk by 4 float32 ulps (mechanisms.clip_factors): 2.4e-7 relative
    torch.testing.assert_close(
        whole,
        torch.zeros(4, 30, dtype=torch.float64).index_add_(0, rows, clipped),
        rtol=1e-6,
        atol=1e-9,
    )


def _linear_setup(owners=40, users=4, features=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Linear(features, classes).double()
    for p in model.parameters():
        p.requires_grad_(False)
    n = owners * users
    x = torch.randn(n, features, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (n,), generator=g)
    shared = {k: v.detach().clone() for k, v in model.named_parameters()}
    names = tuple(shared)
    return (
        model,
        shared,
        names,
        x,
        y,
        np.arange(n),
        np.ones(n, dtype=np.int64),
        np.arange(0, n, users),
        np.full(owners, users),
        np.arange(owners),
    )


def test_owner_noise_has_the_calibrated_std():
    # one step (users <= batch: q = 1, every user every step): the deltas with and without noise
    # differ by exactly lr * z * C * N(0, I) / B_j
    model, shared, names, x, y, starts, sizes, first, users, ids = _linear_setup()
    z, C, lr = 1.7, 0.3, 0.5
    base = DpSgdSpec(0.0, C, 8, 1, lr, 0)
    noisy = DpSgdSpec(z, C, 8, 1, lr, 0)
    args = (x, y, starts, sizes, first, users, users, ids)
    d0 = dpsgd_deltas(model, shared, {}, {}, *args, base, 1, names, 512)
    d1 = dpsgd_deltas(model, shared, {}, {}, *args, noisy, 1, names, 512)
    noise = ((d0 - d1) * 4 / lr).flatten()  # B_j = 4 users
    assert noise.numel() == 40 * 21
    assert float(noise.std()) == pytest.approx(z * C, rel=0.06)
    assert abs(float(noise.mean())) < 5 * z * C / math.sqrt(noise.numel())
    d2 = dpsgd_deltas(model, shared, {}, {}, *args, noisy, 2, names, 512)
    assert not torch.equal(d1, d2)  # fresh noise each round


def test_one_owner_alone_gets_the_same_delta_as_in_the_batch():
    # sampling and noise are keyed by owner id: the Flower view (one owner) equals the local one
    model, shared, names, x, y, starts, sizes, first, users, ids = _linear_setup(owners=5, users=9)
    spec = DpSgdSpec(1.1, 0.5, 4, 2, 0.3, 7)
    allo = dpsgd_deltas(
        model, shared, {}, {}, x, y, starts, sizes, first, users, users, ids, spec, 3, names, 6
    )
    for j in range(5):
        one = dpsgd_deltas(
            model,
            shared,
            {},
            {},
            x,
            y,
            starts,
            sizes,
            first[j : j + 1],
            users[j : j + 1],
            users[j : j + 1],
            ids[j : j + 1],
            spec,
            3,
            names,
            6,
        )
        torch.testing.assert_close(one[0], allo[j], rtol=0, atol=1e-12)


def test_secure_dpsgd_draws_its_noise_and_sample_from_os_entropy():
    """``privacy.randomness=secure`` (``DpSgdSpec.secure``): the noise keeps its calibrated std
    but is neither the seeded stream nor the same twice; the users' Poisson sample (9 users,
    batch 4: q = 4/9) is not the seeded one either. Seeded twice: bit for bit the same."""
    import dataclasses

    model, shared, names, x, y, starts, sizes, first, users, ids = _linear_setup()
    z, C, lr = 1.7, 0.3, 0.5
    args = (x, y, starts, sizes, first, users, users, ids)
    base = DpSgdSpec(0.0, C, 8, 1, lr, 0)
    seeded, secure = DpSgdSpec(z, C, 8, 1, lr, 0), DpSgdSpec(z, C, 8, 1, lr, 0, secure=True)
    d0 = dpsgd_deltas(model, shared, {}, {}, *args, base, 1, names, 512)
    d_seed = dpsgd_deltas(model, shared, {}, {}, *args, seeded, 1, names, 512)
    d_a = dpsgd_deltas(model, shared, {}, {}, *args, secure, 1, names, 512)
    d_b = dpsgd_deltas(model, shared, {}, {}, *args, secure, 1, names, 512)
    noise = ((d0 - d_a) * 4 / lr).flatten()
    assert float(noise.std()) == pytest.approx(z * C, rel=0.06)
    assert not torch.equal(d_a, d_seed) and not torch.equal(d_a, d_b)
    assert torch.equal(d_seed, dpsgd_deltas(model, shared, {}, {}, *args, seeded, 1, names, 512))
    # sampling alone (no noise): 5 owners x 9 users at q = 4/9, two epochs
    model, shared, names, x, y, starts, sizes, first, users, ids = _linear_setup(owners=5, users=9)
    args = (x, y, starts, sizes, first, users, users, ids)
    plain = DpSgdSpec(0.0, 0.5, 4, 2, 0.3, 7)
    s0 = dpsgd_deltas(model, shared, {}, {}, *args, plain, 3, names, 6)
    s1 = dpsgd_deltas(
        model, shared, {}, {}, *args, dataclasses.replace(plain, secure=True), 3, names, 6
    )
    assert not torch.equal(s0, s1)


# -- the schedule comes from public capacities ------------------------------------------------
def _one_owner(users, features=6, classes=3, seed=0):
    """One owner of ``users`` one-record users; user 0 is a canary whose gradient is clipped."""
    model, shared, names, x, y, starts, sizes, first, _, _ = _linear_setup(
        owners=1, users=users, features=features, classes=classes, seed=seed
    )
    x[0] *= 50.0
    shared = {k: torch.zeros_like(v) for k, v in shared.items()}  # uniform logits: a big gradient
    return model, shared, names, x, y, starts, sizes


def _deltas(setup, keep, capacity, spec, owner_id=3):
    model, shared, names, x, y, starts, sizes = setup
    return dpsgd_deltas(
        model,
        shared,
        {},
        {},
        x,
        y,
        starts[keep],
        sizes[keep],
        np.array([0]),
        np.array([len(keep)]),
        np.array([capacity]),
        np.array([owner_id]),
        spec,
        1,
        names,
        512,
    )[0]


def test_removing_a_user_changes_only_its_clipped_gradient_in_the_step():
    # capacity M = 10 <= B = 32: q = 1, one step, divisor min(B, M) = 10 on BOTH neighbours. With
    # the same randomness the noise cancels: D - D' = -lr * clip(g_canary) / 10, of norm lr*C/10
    setup = _one_owner(10)
    C, lr = 0.5, 0.3
    spec = DpSgdSpec(2.0, C, 32, 1, lr, 0)
    d = _deltas(setup, np.arange(10), 10, spec)
    d_prime = _deltas(setup, np.arange(1, 10), 10, spec)
    assert float(torch.linalg.vector_norm(d - d_prime)) == pytest.approx(lr * C / 10, rel=1e-6)
    # the weakened twin (a schedule read from the data: divisor from the 9 users D' holds) moves
    # more than one clipped gradient can: the other users' sum and the noise are rescaled
    twin = _deltas(setup, np.arange(1, 10), 9, spec)
    assert float(torch.linalg.vector_norm(d - twin)) > 1.3 * lr * C / 10


def test_the_step_count_does_not_follow_the_users_an_owner_holds(monkeypatch):
    # capacity M = 33 > B = 32: ceil(33/32) = 2 noisy steps per epoch, with 33 users or 32 held
    from fedudp.owner import dpsgd

    calls = []
    real = dpsgd._noisy_step
    monkeypatch.setattr(
        dpsgd,
        "_noisy_step",
        lambda row, total, spec, b, *k: (calls.append(b), real(row, total, spec, b, *k)),
    )
    setup = _one_owner(33)
    spec = DpSgdSpec(1.0, 0.5, 32, 2, 0.1, 0)
    for keep, cap in ((np.arange(33), 33), (np.arange(1, 33), 33), (np.arange(1, 33), 32)):
        calls.clear()
        _deltas(setup, keep, cap, spec)
        assert calls == [min(32, cap)] * (2 * -(-cap // 32)), (len(keep), cap, calls)


def test_owner_training_capacity_is_the_configured_plan_not_the_data():
    from fedudp.build import owner_training, planned_owner_records, planned_owner_users

    cfg = cfg_kw(
        "full_dp",
        **{
            "privacy.placement": "local_dpsgd",
            "dataset.num_records": 150,
            "partition.records_per_user": 2,
        },
    )
    t = owner_training(cfg)
    assert t.dpsgd_capacity == (19, 19, 19, 19)  # 38, 38, 37, 37 records in users of 2
    assert t.dpsgd_capacity == tuple(planned_owner_users(cfg))
    assert t.public_owner_records == tuple(planned_owner_records(cfg)) == (38, 38, 37, 37)
    with pytest.raises(ValueError, match="capacity"):
        setup = _one_owner(4)
        _deltas(setup, np.arange(4), 0, DpSgdSpec(1.0, 0.5, 32, 1, 0.1, 0))


# -- standard FedAvg ------------------------------------------------------------------------------
def test_standard_fedavg_equals_a_plain_per_owner_pytorch_loop():
    cfg = cfg_kw(
        "fedavg",
        **{
            "engine_opts.float64": True,
            "train.rounds": 2,
            "train.lr": 0.3,
            "train.local_epochs": 2,
            "partition.records_per_user": 3,
        },
    )
    p = prepare(cfg)
    res = execute(p)
    fed, model = p.fed, p.owners.model
    glob = {k: v.detach().clone() for k, v in model.named_parameters()}
    net = type(model)(fed.x.shape[1], fed.num_classes).double()
    for r in (1, 2):
        deltas = []
        for j in range(fed.num_owners):
            shard = fed.owner(j)
            net.load_state_dict(glob)
            opt = torch.optim.SGD(net.parameters(), lr=cfg.train.lr)
            m = shard.x.shape[0]
            for e in range(cfg.train.local_epochs):
                perm = np.argsort(
                    numpy_rng(cfg.seed, Purpose.OWNER_ORDER, r, e, j).random(m), kind="stable"
                )
                for s in range(0, m, cfg.train.batch_size):
                    idx = torch.from_numpy(perm[s : s + cfg.train.batch_size])
                    opt.zero_grad()
                    F.cross_entropy(net(shard.x[idx]), shard.y[idx]).backward()
                    opt.step()
            deltas.append({k: v.detach() - glob[k] for k, v in net.named_parameters()})
        glob = {k: glob[k] + sum(d[k] for d in deltas) / len(deltas) for k in glob}
    for k in glob:
        torch.testing.assert_close(res.shared[k], glob[k], rtol=0, atol=1e-10)


def test_owner_weights_size_weights_by_records(tmp_path):
    # 150 records over 4 owners (38, 38, 37, 37): size weights differ from uniform
    kw = {"dataset.num_records": 150, "train.rounds": 2, "engine_opts.float64": True}
    u = prepare(cfg_kw("fedavg", **kw))
    w = prepare(cfg_kw("fedavg", **kw, **{"train.owner_weights": "size"}))
    shared = u.billboard.shared_params()
    owners = np.arange(u.fed.num_owners)
    G = u.owners.owner_deltas(u.fed, shared, {}, owners, 1, u.aggregator.constraint)
    sizes = torch.from_numpy(np.diff(u.fed.owner_offsets)).double()
    ru = u.owners.reply(u.fed, shared, {}, owners, 1, u.aggregator.constraint)
    rw = w.owners.reply(w.fed, shared, {}, owners, 1, w.aggregator.constraint)
    torch.testing.assert_close(u.aggregator.release(ru.contribution).mean, G.mean(0))
    torch.testing.assert_close(
        w.aggregator.release(rw.contribution).mean, (G * sizes[:, None]).sum(0) / sizes.sum()
    )


# -- the preset through a sweep, a re-run and the report ------------------------------------------
def test_huang_preset_sweep_resumes_and_reports(tmp_path, monkeypatch):
    """The CLI's multirun (``fedudp.cli.main`` in this process: the process boundary is
    tests/billboard/test_stops.py's and tests/test_runs.py's), run twice: the second skips all
    four finished runs and rewrites none; then the Huang Table 1 report of the sweep."""
    import contextlib
    import io
    from pathlib import Path

    from conftest import tiny_mnist
    from fedudp import cli
    from fedudp.report import load_summaries, main as report_main

    root = tiny_mnist(tmp_path / "data", n_train=400, n_test=100)
    sweep = tmp_path / "sweep"
    args = [
        "fedudp",
        "-m",
        "+experiment=huang_table1",
        f"dataset.root={root}",
        "dataset.num_records=200",
        "partition.num_owners=4",
        "train.rounds=1",
        "train.local_epochs=1",
        "method=per_silo,fedavg,full_dp,joint_dp",
        f"hydra.sweep.dir={sweep}",
        "progress=false",
    ]
    monkeypatch.chdir(tmp_path)  # Hydra's multirun.yaml and any relative output stay here
    monkeypatch.setattr("sys.argv", list(args))
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main()
    summaries = load_summaries(sweep)
    assert sorted(s["method"] for s in summaries) == ["fedavg", "full_dp", "joint_dp", "per_silo"]
    dp = [s for s in summaries if s["method"] in ("full_dp", "joint_dp")]
    assert all(s["placement"] == "local_dpsgd" and s["aggregator"] == "local_dpsgd" for s in dp)
    assert all(s["epsilon"] <= 1.0 + 1e-6 and s["delta"] == 1e-4 for s in dp)
    mtimes = {s["_dir"]: (Path(s["_dir"]) / "summary.json").stat().st_mtime for s in summaries}
    monkeypatch.setattr("sys.argv", list(args))
    with contextlib.redirect_stdout(io.StringIO()) as printed:  # (Hydra's log handlers keep
        cli.main()  # the stream they were set up with: never one that pytest closes)
    second = printed.getvalue()
    assert second.count("skipped") == 4, second
    assert {d: (Path(d) / "summary.json").stat().st_mtime for d in mtimes} == mtimes
    out = tmp_path / "report"
    assert report_main([str(sweep), "--paper", "huang_table1", "--out", str(out)]) == 0
    import csv

    rows = list(csv.DictReader(open(out / "huang_table1.csv")))
    by_col = {r["column"]: float(r["ours_mean"]) for r in rows}
    want = {
        "per-silo": "per_silo",
        "FedAvg (no DP)": "fedavg",
        "full-DP": "full_dp",
        "joint-DP": "joint_dp",
    }
    for col, method in want.items():
        s = next(s for s in summaries if s["method"] == method)
        assert by_col[col] == pytest.approx(s["accuracy_mean"], abs=1e-12)
    assert (out / "huang_table1.png").stat().st_size > 10_000
    assert "/ 0.960 (" in (out / "huang_table1.md").read_text()  # the paper's n = 4 FedAvg


# -- group privacy (Huang et al. Table 4's reading, docs/algorithms.md#group-privacy) -------------
@pytest.mark.parametrize(
    "accounting,eps_target",
    [("certified", 1.0), ("paper", 1.0), ("certified", 3.0), ("paper", 8.0)],
)
def test_group_privacy_epsilon_is_k_times_a_direct_record_level_computation(
    tmp_path, accounting, eps_target
):
    """Also at user-level ε > 1 (Table 4's ε = 3, 8): the ledger accounts the record-level events
    on the calibration's PLD grid (that of ε/k), so the calibrated run spends its whole budget in
    exactly its T rounds instead of stopping a round early on a coarser grid's pessimism."""
    # 150 records, 3 per user, over 4 owners: 38/38/37/37 records -> record-level q = 8/38, 8/37
    k, delta = 3, 1e-5
    kw = {
        "privacy.placement": "local_dpsgd",
        "dataset.num_records": 150,
        "train.rounds": 2,
        "train.local_epochs": 25,
        "partition.records_per_user": k,
        "privacy.group_privacy": True,
        "privacy.accounting": accounting,
        "privacy.epsilon": eps_target,
    }
    s = run(cfg_kw("full_dp", **kw), tmp_path)
    assert (s["stop_reason"], s["rounds_completed"]) == ("completed", 2)
    record_delta = (
        delta / (k * math.exp((k - 1) * eps_target / k)) if accounting == "certified" else delta / k
    )
    rec = []
    # the owners' record counts as the run laid them out (owners.csv; preparing the run again
    # here would calibrate it a second time)
    owners = (tmp_path / "owners.csv").read_text().splitlines()[1:]
    for m in sorted({int(line.split(",")[1]) for line in owners}):
        acc = dp_accounting.pld.PLDAccountant(  # the grid of ε/k (<= 1: 1e-4)
            dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
            value_discretization_interval=1e-4 * max(1.0, eps_target / k),
        )
        acc.compose(
            dp_accounting.PoissonSampledDpEvent(
                8 / m, dp_accounting.GaussianDpEvent(s["noise_multiplier"])
            ),
            math.ceil(m / 8) * 25 * 2,
        )
        rec.append(acc.get_epsilon(record_delta))
    assert s["epsilon"] == pytest.approx(k * max(rec), rel=1e-3)
    assert (
        0.99 * eps_target <= s["epsilon"] <= eps_target * (1 + 1e-6)
    )  # calibrated at (eps/k, delta')
    user_delta = k * math.exp((k - 1) * max(rec)) * record_delta  # the standard group form
    led = json.loads((tmp_path / "ledger.json").read_text())
    assert "group_conversion" in led["extra"] and "records" in " ".join(led["notes"])
    if accounting == "certified":
        assert user_delta <= delta * (1 + 1e-9) and led["guarantee"] == "certified"
    else:  # the paper's form: user-level delta is e^eps times delta
        assert k * math.exp(k * max(rec)) * record_delta == pytest.approx(
            delta * math.exp(s["epsilon"]), rel=1e-3
        )
        assert led["guarantee"] == "heuristic"


def test_group_privacy_dpsgd_clips_records_not_users():
    """Noise-free, every unit in the batch (q = 1, one step): the owner's step is the mean of its
    records' clipped gradients with group privacy, of its users' clipped mean gradients without."""
    from fedudp.protocol.contributions import Constraint

    C, lr = 1e-3, 0.5  # every row is clipped
    kw = {
        "privacy.placement": "local_dpsgd",
        "dataset.num_records": 48,
        "train.rounds": 1,
        "partition.records_per_user": 3,
        "train.batch_size": 64,
        "train.lr": lr,
        "engine_opts.float64": True,
    }
    con = Constraint(rows=False, clip=None, dpsgd_noise=0.0, dpsgd_clip=C)
    for group in (True, False):
        p = prepare(cfg_kw("full_dp", **kw, **{"privacy.group_privacy": group}))
        fed, model = p.fed, p.owners.model
        shared = p.billboard.shared_params()
        G = p.owners.owner_deltas(fed, shared, {}, np.arange(fed.num_owners), 1, con)
        net = type(model)(fed.x.shape[1], fed.num_classes).double()
        net.load_state_dict(shared)
        for j in range(fed.num_owners):
            lo, hi = fed.owner_offsets[j], fed.owner_offsets[j + 1]
            if group:
                groups = [[r] for r in range(lo, hi)]
            else:
                u0, u1 = fed.owner_user_offsets[j], fed.owner_user_offsets[j + 1]
                groups = [
                    list(range(fed.user_offsets[u], fed.user_offsets[u + 1])) for u in range(u0, u1)
                ]
            total = 0
            for rows in groups:
                net.zero_grad()
                F.cross_entropy(net(fed.x[rows]), fed.y[rows]).backward()
                g = torch.cat([p_.grad.reshape(-1) for p_ in net.parameters()])
                total = total + g * min(1.0, C / float(g.norm()))
            want = -lr * total / len(groups)
            torch.testing.assert_close(G[j], want, rtol=1e-6, atol=1e-12)


def test_group_privacy_refuses_what_it_cannot_convert():
    with pytest.raises(ConfigError, match=r"privacy\.group_privacy"):
        prepare(cfg_kw("full_dp", **{"privacy.group_privacy": True}))  # server placement
    with pytest.raises(ConfigError, match=r"privacy\.group_privacy"):
        prepare(
            cfg_kw(
                "full_dp",
                **{
                    "privacy.group_privacy": True,
                    "privacy.placement": "local_dpsgd",
                    "privacy.noise_multiplier": 1.0,
                },
            )
        )


# -- adaptive clipping inside the owners (privacy.clip_policy=adaptive) ----------------------------
from fedudp.aggregators import Sampling  # noqa: E402
from fedudp.protocol.contributions import Contribution  # noqa: E402
from fedudp.aggregators.local_dpsgd import LocalDpSgdMean, default_count_noise  # noqa: E402
from fedudp.owner.dpsgd import noisy_unclipped_fraction  # noqa: E402


def _half_count_noise(unclipped, sampled, expected_batch, count_noise, generator):
    """A twin that draws half the count noise the ledger is told."""
    return noisy_unclipped_fraction(
        unclipped, sampled, expected_batch, 0.5 * count_noise, generator
    )


@pytest.mark.parametrize("fn,ok", [(noisy_unclipped_fraction, True), (_half_count_noise, False)])
def test_a_steps_released_count_carries_the_accounted_noise(fn, ok):
    """7 of 12 sampled users unclipped, B_j = 10, σ_b = 2: the released fraction is
    (7 - 6 + N(0, 4)) / 10 + 1/2, mean 0.6, std 0.2."""
    g = torch.Generator().manual_seed(0)
    got = np.array([fn(7, 12, 10.0, 2.0, g) for _ in range(20000)])
    assert got.mean() == pytest.approx(0.6, abs=0.01)
    assert bool(abs(got.std() / 0.2 - 1) < 0.03) is ok, got.std()


def test_owner_adaptive_split_and_event():
    """Effective z = 1 with the default count noise σ_b = sqrt(10)/2 = 1.5811388300841898: the
    update's share is z_Δ = 1/sqrt(0.9) = 1.0540925533894598, and the ledger accounts z, not z_Δ
    (a twin accounting z_Δ claims less)."""
    assert default_count_noise(1.0) == pytest.approx(1.5811388300841898, rel=1e-15)
    agg = LocalDpSgdMean(1.0, 0.5, 8, 1, np.array([40, 40]), Sampling(1.0, 2), adaptive=True)
    assert agg.update_multiplier == pytest.approx(1.0540925533894598, rel=1e-12)
    con = agg.constraint
    assert (con.dpsgd_noise, con.dpsgd_clip, con.dpsgd_count_noise) == (
        agg.update_multiplier,
        0.5,
        agg.count_noise,
    )
    step = dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(1.0))
    assert agg.dp_event().parts == (dp_accounting.SelfComposedDpEvent(step, 5),)

    def eps(z):
        acc = dp_accounting.pld.PLDAccountant()
        acc.compose(dp_accounting.PoissonSampledDpEvent(0.2, dp_accounting.GaussianDpEvent(z)), 50)
        return acc.get_epsilon(1e-5)

    assert eps(agg.update_multiplier) < eps(1.0) - 0.05


def test_owner_adaptive_deltas_and_reported_fraction():
    """The update is fixed-clip DP-SGD at z_Δ (the count's noise is its own stream), and each
    owner reports its steps' released fraction: with σ_b tiny, the share of its users whose
    mean gradient is within the clip (one step: users <= batch)."""
    model, shared, names, x, y, starts, sizes, first, users, ids = _linear_setup()
    norms = []  # each user's gradient norm, by plain autograd
    for u in range(len(x)):
        m = torch.nn.Linear(x.shape[1], 3).double()
        m.weight.data, m.bias.data = shared["weight"].clone(), shared["bias"].clone()
        F.cross_entropy(m(x[u : u + 1]), y[u : u + 1]).backward()
        norms.append(math.sqrt(float(m.weight.grad.square().sum() + m.bias.grad.square().sum())))
    norms = np.array(norms)
    C = float(np.median(norms))
    fixed = DpSgdSpec(1.2, C, 8, 1, 0.5, 0)
    adaptive = DpSgdSpec(1.2, C, 8, 1, 0.5, 0, count_noise=1e-9)
    args = (x, y, starts, sizes, first, users, users, ids)
    frac = np.zeros(len(users))
    d0 = dpsgd_deltas(model, shared, {}, {}, *args, fixed, 1, names, 512)
    d1 = dpsgd_deltas(model, shared, {}, {}, *args, adaptive, 1, names, 512, fractions=frac)
    assert torch.equal(d0, d1)
    want = [np.mean(norms[first[j] : first[j] + users[j]] <= C) for j in range(len(users))]
    np.testing.assert_allclose(frac, want, atol=1e-6)
    assert len(set(want)) > 1  # some owners' users clipped, others' not
    with pytest.raises(ValueError, match="fractions"):
        dpsgd_deltas(model, shared, {}, {}, *args, adaptive, 1, names, 512)


def test_owner_adaptive_clip_follows_the_quantile():
    """Users' gradient norms uniform on [0, 10], 20 owners of 30 users, each owner reporting one
    step's released fraction at the current clip: the clip settles at the 0.3-quantile, 3.0."""
    rng = np.random.default_rng(0)
    agg = LocalDpSgdMean(
        1.0,
        0.5,
        30,
        1,
        np.full(20, 30),
        Sampling(1.0, 20),
        adaptive=True,
        quantile=0.3,
        clip_lr=0.2,
    )
    g = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(400):
        total = 0.0
        for _ in range(20):
            norms = rng.uniform(0, 10, 30)
            total += noisy_unclipped_fraction(
                float((norms <= agg.clip).sum()), 30, 30.0, agg.count_noise, g
            )
        agg.release(Contribution(None, torch.zeros(2), 20, fraction_sum=total, fraction_reports=20))
        seen.append(agg.clip)
    assert np.mean(seen[-100:]) == pytest.approx(3.0, rel=0.05)
    b = LocalDpSgdMean(1.0, 0.5, 30, 1, np.full(20, 30), Sampling(1.0, 20), adaptive=True)
    b.restore_checkpoint_state(agg.checkpoint_state())
    assert b.clip == agg.clip


def test_owner_adaptive_run_moves_the_clip_and_names_it_in_the_ledger(tmp_path):
    s = run(
        cfg_kw(
            "full_dp",
            **{
                "privacy.placement": "local_dpsgd",
                "privacy.clip_policy": "adaptive",
                "privacy.clip": 0.01,
                "privacy.clip_lr": 1.0,
            },
        ),
        tmp_path,
    )
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    clips = [r["agg_clip"] for r in rows if "agg_clip" in r]
    assert len(clips) == 3 and clips[0] == 0.01 and clips[-1] > clips[0]  # all clipped: grows
    led = json.loads((tmp_path / "ledger.json").read_text())
    assert any("adaptive clip" in n and "per DP-SGD step" in n for n in led["notes"])
    assert s["epsilon"] <= 1.0 + 1e-6
