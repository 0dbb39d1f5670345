"""Natural federations through the config builder (docs/your-data.md): users of unequal sizes
read from NPZ / LEAF / CIFAR files or handed over in memory, grouped into owners of unequal
sizes, laid out for the rounds; the public numbers declared once, checked against the data and
written to the ledger; a neighbour without one user keeps every schedule and denominator."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fedudp
from fedudp import build
from fedudp.config import ConfigError, config_from_overrides
from fedudp.data import natural
from formats import natural_arrays, write_cifar10, write_femnist, write_npz, write_shakespeare

SIZES = [1, 3, 5, 20, 2, 8, 40, 1, 7, 12, 4, 9, 15, 2, 6, 30]  # 16 users, 1..40 records
OWNERS = [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3]  # 4 owners of 3..6 users


def cfg_for(**over):
    base = {"progress": False, "train.rounds": 2, "train.batch_size": 4, "seed": 3}
    return config_from_overrides({**base, **over})


def npz_cfg(path, **over):
    return cfg_for(
        **{
            "dataset.name": "npz",
            "dataset.path": str(path),
            "dataset.columns.owner": "owner",
            "partition.owner_rule": "given",
            "partition.num_owners": 4,
            "public.users": 16,
            "public.owner_capacity": 6,
            "public.records_per_user": 40,
            "dataset.test_fraction": 0.0,
            "dataset.classes": 4,
            "dataset.input_shape": [6],
            **over,
        }
    )


@pytest.fixture
def npz(tmp_path):
    return write_npz(tmp_path / "fed.npz", SIZES, OWNERS)


def test_layout_keeps_users_whole_and_owners_as_given(npz):
    fed = build.federation(npz_cfg(npz))
    assert (fed.num_owners, fed.num_users, fed.num_records) == (4, 16, sum(SIZES))
    assert np.diff(fed.owner_user_offsets).tolist() == [3, 6, 2, 5]
    arrays = natural_arrays(SIZES, OWNERS)
    # every user is one contiguous slice holding exactly its own records
    keys = natural.user_keys(np.array([f"u{i}" for i in range(16)]))
    for slot, key in enumerate(fed.user_ids):
        i = int(np.flatnonzero(keys == key)[0])
        lo, hi = fed.user_offsets[slot], fed.user_offsets[slot + 1]
        assert hi - lo == SIZES[i] and fed.user_owner[slot] == OWNERS[i]
        mine = arrays["x"][arrays["user"] == f"u{i}"]
        assert torch.equal(fed.x[lo:hi], torch.from_numpy(mine))


def test_public_numbers_are_declared_checked_and_in_the_ledger(npz, tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"^public\.users: .*public\.users=16, "
        r"public\.owner_capacity=6, public\.records_per_user=40$",
    ):
        build.prepare(npz_cfg(npz, **{"public.users": None}))
    # declared populations are upper bounds: only data exceeding one is refused
    for key, value, pattern in [
        ("public.users", 15, "15 declared, the data has 16 users"),
        ("public.owner_capacity", 5, "an owner of the data holds 6"),
        ("public.records_per_user", 39, "a user of the data holds 40"),
        ("partition.num_owners", 3, "grouped into 4 owners"),
        (
            "dataset.classes",
            3,
            "dataset.classes: 3 declared; .*fed.npz: label 3 of record .* outside \\[0, 3\\)",
        ),
        (
            "dataset.input_shape",
            [5],
            "dataset.input_shape: \\[5\\] declared, .* have shape \\[6\\]",
        ),
        ("dataset.tokens", True, "dataset.tokens: true declared"),
    ]:
        with pytest.raises(ConfigError, match=pattern):
            build.prepare(npz_cfg(npz, **{key: value}))
    s = fedudp.simulate(
        npz_cfg(npz, method="full_dp", **{"public.owner_capacity": 8}), out=tmp_path / "run"
    )
    ledger = json.loads((tmp_path / "run" / "ledger.json").read_text())
    pub = ledger["extra"]["public"]
    assert (pub["users"], pub["owners"], pub["owner_capacity"], pub["records_per_user"]) == (
        16,
        4,
        8,
        40,
    ) and pub["source"].startswith("declared")
    assert (pub["classes"], pub["input_shape"], pub["tokens"]) == (4, [6], False)
    assert s.summary["num_users"] == 16 and s.rounds_completed == 2


def test_schedules_and_denominators_come_from_the_declared_numbers(npz):
    cfg = npz_cfg(
        npz, method="full_dp", **{"privacy.placement": "local_dpsgd", "public.owner_capacity": 8}
    )
    p = build.prepare(cfg)
    assert p.owners.training.dpsgd_capacity == (8, 8, 8, 8)  # declared M for every owner
    assert p.aggregator.classes[0][0] == 8  # one capacity class
    q = build.prepare(npz_cfg(npz, method="full_dp", **{"train.sampling_rate": 0.5}))
    assert q.billboard.sampling.population == 16  # declared N
    assert q.billboard.sampling.expected_cohort == 8.0  # the denominator q N


def test_a_neighbour_without_one_user_keeps_every_schedule_and_denominator(npz):
    """Removing one user changes no public number, hence no sampling rate, step count, divisor
    or denominator; every other user's vector is bit for bit the same."""
    cfg = npz_cfg(npz, method="full_dp", **{"engine_opts.float64": True})
    p = build.prepare(cfg)
    fed, owners, shared = p.fed, p.owners, p.billboard.shared_params()
    gone = 4  # a user of owner 1
    neighbour = fed.without_user(gone)
    assert neighbour.num_users == 15 and neighbour.owner_ids.tolist() == [0, 1, 2, 3]
    personal = owners.initial_personal(4)

    def by_key(f, n):  # each user's vector by its stable key (chunks come sorted by size)
        return {
            int(f.user_ids[u]): g
            for us, G in owners.user_vectors(f, shared, personal, np.arange(n), 1)
            for u, g in zip(us, G)
        }

    full, less = by_key(fed, 16), by_key(neighbour, 15)
    assert set(full) - set(less) == {int(fed.user_ids[gone])}
    assert all(torch.equal(full[k], less[k]) for k in less)
    # the public numbers (and so the billboard's population, the owners' DP-SGD schedule) are
    # the declared ones, not the data's: the same for both neighbours
    assert p.billboard.sampling.population == 16
    assert build.planned_owner_users(cfg).tolist() == [6, 6, 6, 6]


def test_owner_rules_random_column_dirichlet(tmp_path):
    arrays = natural_arrays(SIZES, OWNERS)
    arrays["site"] = np.array(["s%d" % (o % 2) for o in arrays["owner"]])
    np.savez(tmp_path / "f.npz", **arrays)
    base = {
        "dataset.name": "npz",
        "dataset.path": str(tmp_path / "f.npz"),
        "public.users": 16,
        "public.records_per_user": 40,
        "dataset.test_fraction": 0.0,
        "dataset.classes": 4,
        "dataset.input_shape": [6],
    }
    for rule, extra in [
        ("random", {"partition.num_owners": 4}),
        ("dirichlet", {"partition.num_owners": 4, "partition.dirichlet_alpha": 0.3}),
        (
            "column",
            {
                "partition.num_owners": 2,
                "partition.owner_column": "site",
                "dataset.columns.meta": ["site"],
            },
        ),
    ]:
        cfg = cfg_for(
            **base, **extra, **{"partition.owner_rule": rule, "public.owner_capacity": 16}
        )
        train, _ = build.natural_records(cfg)
        for u in np.unique(train.user):
            assert len(np.unique(train.owner[train.user == u])) == 1  # users stay whole
        fed = build.federation(cfg)
        assert fed.num_users == 16 and fed.num_owners == cfg.partition.num_owners
        again = build.federation(cfg)
        assert np.array_equal(fed.user_owner, again.user_owner)  # seeded


def test_holdout_keeps_a_fraction_of_each_user(npz):
    cfg = npz_cfg(npz, **{"dataset.test_fraction": 0.25, "public.records_per_user": 40})
    fed = build.federation(cfg)
    kept = np.diff(fed.user_offsets)
    assert sum(kept) + len(fed.y_test) == sum(SIZES)
    assert sorted(kept.tolist()) == sorted(s - int(0.25 * s) if s > 1 else 1 for s in SIZES)


def test_in_memory_records_run(tmp_path):
    a = natural_arrays(SIZES)
    records = fedudp.from_arrays(a["x"], a["y"], a["user"])
    res = fedudp.simulate(
        {
            "method": "joint_dp",
            "partition.num_owners": 3,
            "train.rounds": 2,
            "train.batch_size": 4,
            "public.users": 16,
            # random owners are Binomial(16, 1/3) in size: a bound that holds for any deal
            "public.owner_capacity": 16,
            "public.records_per_user": 32,
            "dataset.classes": 4,
            "dataset.input_shape": [6],
        },
        records=records,
    )
    assert res.summary["num_users"] == 16 and res.rounds_completed == 2
    assert res.ledger.extra["public"]["users"] == 16 and 0 < res.epsilon <= 1.0 + 1e-9
    with pytest.raises(ConfigError, match="^dataset.name: memory"):
        fedudp.simulate({"dataset.name": "memory"})


def test_leaf_femnist_shakespeare_and_cifar_through_the_builder(tmp_path):
    fem = write_femnist(tmp_path / "femnist", [3, 9, 1, 14, 6, 2])
    cfg = cfg_for(
        **{
            "dataset.name": "femnist",
            "dataset.root": str(fem),
            "model.name": "cnn",
            "partition.num_owners": 2,
            "public.users": 6,
            "public.owner_capacity": 6,  # random owners: Binomial(6, 1/2) in size
            "public.records_per_user": 14,
        }
    )
    p = build.prepare(cfg)
    assert p.fed.input_shape == (1, 28, 28) and p.fed.num_classes == 62
    assert p.fed.num_users == 6 and len(p.fed.y_test) == 1 + 4 + 1 + 7 + 3 + 1
    shk = write_shakespeare(tmp_path / "shk", [5, 2, 9])
    cfg = cfg_for(
        **{
            "dataset.name": "shakespeare",
            "dataset.root": str(shk),
            "partition.num_owners": 2,
            "public.users": 3,
            "public.owner_capacity": 3,
            "public.records_per_user": 9,
        }
    )
    p = build.prepare(cfg)
    assert p.fed.x.dtype == torch.int64 and p.fed.input_shape == (80,) and p.fed.num_classes == 80
    assert type(p.owners.model).__name__ == "CharGRU"  # auto: tokens -> char_gru
    cif = write_cifar10(tmp_path / "cifar")
    cfg = cfg_for(
        **{
            "dataset.name": "cifar10",
            "dataset.root": str(cif),
            "partition.records_per_user": 7,
            "partition.num_owners": 3,
            "public.users": 29,
            "public.owner_capacity": 29,
            "public.records_per_user": 7,
        }
    )
    p = build.prepare(cfg)
    assert p.fed.input_shape == (3, 32, 32) and p.fed.num_users == 29  # ceil(200 / 7)
    assert len(p.fed.y_test) == 50 and np.diff(p.fed.test_offsets).tolist() == [17, 17, 16]


def test_missing_folder_says_where_to_get_the_data(tmp_path):
    cfg = cfg_for(
        **{
            "dataset.name": "femnist",
            "dataset.root": str(tmp_path / "nope"),
            "public.users": 1,
            "public.owner_capacity": 1,
            "public.records_per_user": 1,
        }
    )
    with pytest.raises(ConfigError) as e:
        build.prepare(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "leaf" in msg.lower() and "train" in msg


# -- every method and estimator, your own model, resume ----------------------------------------
class BNNet(torch.nn.Module):
    """A model with a BatchNorm: refused before any work."""

    def __init__(self, input_shape, classes):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(input_shape[0], 8), torch.nn.BatchNorm1d(8))
        self.head = torch.nn.Linear(8, classes)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


class SmallMLP(torch.nn.Module):
    """A researcher's own module: two layers, the second personal under joint DP."""

    def __init__(self, input_shape, num_classes, hidden=16):
        super().__init__()
        self.trunk = torch.nn.Linear(input_shape[0], hidden)
        self.head = torch.nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.head(torch.tanh(self.trunk(x)))


@pytest.mark.parametrize(
    "method,over",
    [
        ("per_silo", {}),
        ("fedavg", {}),
        ("full_dp", {}),
        ("joint_dp", {}),
        ("full_dp", {"privacy.placement": "local_dpsgd"}),
        ("joint_dp", {"privacy.placement": "local_dpsgd", "privacy.group_privacy": True}),
        ("full_dp", {"aggregator": "winsorized", "estimator.bound": 3.0}),
        ("full_dp", {"privacy.unit": "owner", "train.sampling_rate": 1.0}),
    ],
)
def test_every_method_runs_on_a_natural_federation(npz, method, over):
    res = fedudp.simulate(
        npz_cfg(
            npz, method=method, **{"privacy.epsilon": 8.0, "dataset.test_fraction": 0.25, **over}
        )
    )
    assert res.rounds_completed == 2 and res.summary["num_users"] == 16
    assert np.isfinite(res.summary["accuracy_mean"])
    if method in ("full_dp", "joint_dp"):
        assert 0 < res.epsilon <= 8.0 * (1 + 1e-6)
        assert res.ledger.extra["public"]["records_per_user"] == 40


def test_batchnorm_refused_with_the_layers_name(npz):
    cfg = npz_cfg(npz, **{"model.target": "test_natural_federation.BNNet"})
    with pytest.raises(ConfigError, match=r"^model\.target: .*body\.1 \(BatchNorm1d\).*GroupNorm"):
        build.prepare(cfg)


def test_your_own_model_by_import_path_and_as_an_object(npz):
    cfg = npz_cfg(
        npz,
        method="joint_dp",
        **{
            "model.target": "test_natural_federation.SmallMLP",
            "model.kwargs": {"hidden": 12},
            "model.personal": ["head.*"],
            "train.rounds": 3,
            "train.lr": 0.2,
        },
    )
    p = build.prepare(cfg)
    assert type(p.owners.model).__name__ == "SmallMLP" and p.spec.personal == (
        "head.weight",
        "head.bias",
    )
    assert p.owners.model.trunk.out_features == 12
    start = p.billboard.u.clone()
    res = fedudp.run.execute(p)
    assert res.rounds_completed == 3 and not torch.equal(start, p.billboard.u)  # trained
    torch.manual_seed(cfg.seed)
    mine = SmallMLP((6,), 4, hidden=12)
    before = {k: v.clone() for k, v in mine.state_dict().items()}
    by_object = fedudp.simulate(
        npz_cfg(
            npz,
            method="joint_dp",
            **{"model.personal": ["head.*"], "train.rounds": 3, "train.lr": 0.2},
        ),
        model=mine,
    )
    for k, v in by_object.shared.items():  # the same seeded init: the same run
        torch.testing.assert_close(v, res.shared[k], rtol=0, atol=1e-6)
    assert all(torch.equal(v, before[k]) for k, v in mine.state_dict().items())  # not modified
    with pytest.raises(ConfigError, match="^engine: a model object"):
        fedudp.simulate(npz_cfg(npz, engine="flower"), model=mine)


def test_a_natural_run_resumes_bit_for_bit(npz, tmp_path, monkeypatch):
    from conftest import interrupt_after
    from fedudp.run import run

    cfg = npz_cfg(npz, method="full_dp", **{"train.rounds": 4, "train.sampling_rate": 0.5})
    whole = run(cfg, tmp_path / "whole")
    interrupt_after(monkeypatch, 2)
    part = run(cfg, tmp_path / "part")
    assert part["stop_reason"] == "interrupted" and part["rounds_completed"] == 2
    monkeypatch.undo()
    done = run(
        npz_cfg(
            npz,
            method="full_dp",
            **{"train.rounds": 4, "train.sampling_rate": 0.5, "resume": str(tmp_path / "part")},
        ),
        tmp_path / "x",
    )
    assert done["rounds_completed"] == 4
    for name in ("metrics.jsonl", "ledger.json"):
        a = (tmp_path / "whole" / name).read_text().splitlines()
        b = (tmp_path / "part" / name).read_text().splitlines()
        strip = [
            lambda s: json.dumps(
                {k: v for k, v in json.loads(s).items() if k not in ("seconds", "time")},
                sort_keys=True,
            )
        ]
        if name == "metrics.jsonl":
            a, b = [strip[0](x) for x in a], [strip[0](x) for x in b]
            assert a == b
    assert done["accuracy_mean"] == whole["accuracy_mean"] and done["epsilon"] == whole["epsilon"]


@pytest.mark.parametrize("rows", [False, True])
def test_users_sorted_by_size_give_the_same_reply(npz, rows):
    """Natural federations vmap users in chunks sorted by record count (less padding, see
    docs/results/natural_speed): the rows reach the estimator in the cohort's order, the same
    as unsorted, and the clipped sum is the same up to summation order (float64)."""
    import dataclasses
    from fedudp.protocol.contributions import Constraint

    cfg = npz_cfg(
        npz, method="full_dp", **{"engine_opts.float64": True, "engine_opts.chunk_records": 40}
    )
    p = build.prepare(cfg)
    assert p.owners.training.sort_users
    unsorted = build.owners(cfg)
    unsorted.training = dataclasses.replace(unsorted.training, sort_users=False)
    shared, personal = p.billboard.shared_params(), p.owners.initial_personal(4)
    cohort = np.array([9, 3, 0, 15, 6, 12, 1])
    c = Constraint(rows=rows, clip=0.5)
    a = p.owners.reply(p.fed, shared, personal, cohort, 2, c).contribution
    b = unsorted.reply(p.fed, shared, personal, cohort, 2, c).contribution
    assert a.count == b.count == 7
    if rows:
        assert torch.equal(a.rows, b.rows)
    else:
        torch.testing.assert_close(a.total, b.total, rtol=0, atol=1e-12)
        assert a.clipped == b.clipped


@pytest.mark.parametrize(
    "aggregator,extra",
    [("outlier_removal", {}), ("friendlycore", {}), ("few_users", {"estimator.tries": 20.0})],
)
def test_every_row_estimator_runs_on_a_natural_federation(tmp_path, aggregator, extra):
    """The seed estimators need thousands of users for their proofs: 3,000 users of 1-4
    records in 12 owners of unequal sizes, one round, every user."""
    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 5, size=3000).tolist()
    owners = np.sort(rng.integers(0, 12, size=3000)).tolist()
    path = write_npz(tmp_path / "many.npz", sizes, owners)
    first = np.unique(np.asarray(owners), return_counts=True)[1]
    cfg = npz_cfg(
        path,
        method="full_dp",
        aggregator=aggregator,
        **{
            "partition.num_owners": 12,
            "public.users": 3000,
            "public.owner_capacity": int(first.max()),
            "public.records_per_user": 4,
            "privacy.epsilon": 8.0,
            "train.rounds": 1,
            "dataset.test_fraction": 0.0,
            **extra,
        },
    )
    res = fedudp.simulate(cfg)
    assert res.rounds_completed == 1 and res.summary["aggregator"] == aggregator
    assert 0 < res.epsilon <= 8.0 * (1 + 1e-6) and res.summary["num_users"] == 3000
