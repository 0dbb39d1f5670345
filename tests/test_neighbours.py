"""Neighbour invariance: nothing public is read from the data (issue 37, docs/your-data.md#public-numbers).

A user-level guarantee compares a federation with its neighbours, the same federation with one
user removed or added. Everything an observer of the run sees besides the noisy releases (the
model's and the releases' shapes, the sampling rate q and population N, the divisor q·N, the
noise multiplier z, owner-side DP-SGD's capacities and steps, every round's event in the ledger,
the ledger's head and whether the run starts at all) must then be the same on both sides, or the
public numbers alone tell whether a user took part.

For each data kind (a planned synthetic federation, natural users in memory through
``fedudp.from_arrays``, an NPZ file, a Parquet file where pyarrow is installed, LEAF FEMNIST
JSON), each noise placement (the billboard,
owner-side DP-SGD) and each estimator family (a clipped sum, rows, the tree / banded
factorizations, adaptive clipping), a base federation and its neighbours (one user removed,
leaving its owner empty; one user added within the declared bounds; a user holding the only
records of a label) are run for one round through ``build.prepare`` and ``run.execute``, and
their public views are compared. The weakened twins read a number from the data (the class
count, N) and the same comparison catches them.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import fedudp
from fedudp import build
from fedudp.config import config_from_overrides
from fedudp.run import execute
from formats import leaf_file

FEATURES, CLASSES = 6, 5  # the data's labels are 0..3; label 4 only in one neighbour
# (name, records, owner, label or None: a mix of 0..3); owner 2 has one user (u5)
BASE = [
    ("u0", 3, 0, None),
    ("u1", 7, 0, None),
    ("u2", 1, 1, None),
    ("u3", 12, 1, None),
    ("u4", 5, 1, None),
    ("u5", 4, 2, None),
    ("u6", 9, 3, None),
    ("u7", 4, 3, None),
    ("u8", 6, 3, None),
    ("u9", 8, 3, None),
]
NEIGHBOURS = {
    "removed": [u for u in BASE if u[0] != "u5"],  # owner 2 left without users
    "added": BASE + [("u10", 5, 2, None)],
    "unique_label": BASE + [("u11", 4, 0, 4)],  # the only records of label 4
}
DECLARED = {
    "public.users": 12,
    "public.owner_capacity": 4,
    "public.records_per_user": 12,
    "partition.num_owners": 4,
}
# each estimator family under each placement (owner-side DP-SGD takes only its own mean); sum
# and dpsgd with a given noise multiplier (calibrating a subsampled Gaussian takes seconds), their
# calibrated forms in the slow suite
FAMILIES = {
    "sum": {"aggregator": "gaussian", "train.sampling_rate": 0.5, "privacy.noise_multiplier": 1.5},
    "rows": {"aggregator": "winsorized", "estimator.bound": 3.0},
    "tree": {"aggregator": "dp_ftrl_tree"},
    "banded": {"aggregator": "dp_mf_banded"},
    "adaptive": {"privacy.clip_policy": "adaptive", "privacy.clip_count_noise": 5.0},
    "dpsgd": {"privacy.placement": "local_dpsgd", "privacy.noise_multiplier": 1.5},
    "dpsgd_adaptive": {"privacy.placement": "local_dpsgd", "privacy.clip_policy": "adaptive"},
    # integer noise shares from the owners under secure aggregation (issue 51)
    "distributed": {"privacy.placement": "distributed", "train.min_owners": 2},
    "sum_calibrated": {"aggregator": "gaussian", "train.sampling_rate": 0.5},
    "dpsgd_calibrated": {"privacy.placement": "local_dpsgd"},
}
COMMON = {
    "progress": False,
    "method": "full_dp",
    "train.rounds": 1,
    "train.batch_size": 4,
    "privacy.epsilon": 4.0,
    "seed": 1,
    "dataset.test_fraction": 0.0,
}


class Tiny(torch.nn.Module):
    """FEMNIST's images through one linear layer (the paper CNN is too slow for a default test)."""

    def __init__(self, input_shape, classes):
        super().__init__()
        self.fc = torch.nn.Linear(int(np.prod(input_shape)), classes)

    def forward(self, x):
        return self.fc(x.flatten(1))


# -- the data kinds ----------------------------------------------------------------------------
def user_records(name: str, n: int, label: int | None, dim: int, classes: int = 4):
    """A user's own records, drawn from its own seed: the same in every neighbour."""
    rng = np.random.default_rng(int(name[1:]) + 100)
    y = np.full(n, label) if label is not None else rng.integers(0, classes, n)
    return (rng.random((n, dim)) + 0.1 * y[:, None]).astype(np.float32), y.astype(np.int64)


def arrays(users, dim=FEATURES) -> dict:
    xs, ys, us, os_ = [], [], [], []
    for name, n, owner, label in users:
        x, y = user_records(name, n, label, dim)
        xs.append(x)
        ys.append(y)
        us += [name] * n
        os_ += [owner] * n
    return {
        "x": np.concatenate(xs),
        "y": np.concatenate(ys),
        "user": np.array(us),
        "owner": np.array(os_, dtype=np.int64),
    }


def memory_run(users, tmp_path, over):
    a = arrays(users)
    cfg = {
        **COMMON,
        **DECLARED,
        "dataset.name": "memory",
        "partition.owner_rule": "given",
        "dataset.classes": CLASSES,
        "dataset.input_shape": [FEATURES],
        **over,
    }
    return config_from_overrides(cfg), fedudp.from_arrays(a["x"], a["y"], a["user"], a["owner"])


def npz_run(users, tmp_path, over):
    path = tmp_path / f"fed{len(list(tmp_path.iterdir()))}.npz"
    np.savez(path, **arrays(users))
    cfg = {
        **COMMON,
        **DECLARED,
        "dataset.name": "npz",
        "dataset.path": str(path),
        "dataset.columns.owner": "owner",
        "partition.owner_rule": "given",
        "dataset.classes": CLASSES,
        "dataset.input_shape": [FEATURES],
        **over,
    }
    return config_from_overrides(cfg), None


def parquet_run(users, tmp_path, over):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    a = arrays(users)
    path = tmp_path / f"fed{len(list(tmp_path.iterdir()))}.parquet"
    pq.write_table(
        pa.table(
            {
                "x": pa.array(a["x"].tolist(), pa.list_(pa.float32())),
                "y": a["y"],
                "user": a["user"],
                "owner": a["owner"],
            }
        ),
        path,
    )
    cfg = {
        **COMMON,
        **DECLARED,
        "dataset.name": "parquet",
        "dataset.path": str(path),
        "dataset.columns.owner": "owner",
        "partition.owner_rule": "given",
        "dataset.classes": CLASSES,
        "dataset.input_shape": [FEATURES],
        **over,
    }
    return config_from_overrides(cfg), None


def leaf_run(users, tmp_path, over):
    """LEAF FEMNIST JSON (784 pixels, 62 classes declared by the data set itself); the owners
    are dealt at random (LEAF has no owner column), so only the counts are declared."""
    root = tmp_path / f"leaf{len(list(tmp_path.iterdir()))}"
    data = {}
    for name, n, _, label in users:
        x, y = user_records(name, n, 60 if label is not None else None, 784)
        data[f"f{name}"] = (np.clip(x, 0, 1).round(3).tolist(), y.tolist())
    leaf_file(root / "train" / "all_data_0_niid_train.json", data)
    leaf_file(
        root / "test" / "all_data_0_niid_test.json",
        {u: (x[:1], y[:1]) for u, (x, y) in data.items()},
    )
    cfg = {
        **COMMON,
        **DECLARED,
        "dataset.name": "femnist",
        "dataset.root": str(root),
        "partition.owner_rule": "random",
        "model.target": "test_neighbours.Tiny",
        **over,
    }
    return config_from_overrides(cfg), None


KINDS = {"memory": memory_run, "npz": npz_run, "parquet": parquet_run, "leaf": leaf_run}


# -- what an observer sees besides the noisy values ----------------------------------------------
def plan_view(p) -> dict:
    """Every public quantity of a prepared run, before its first round."""
    agg, bb, led = p.aggregator, p.billboard, p.ledger
    return {
        "model": {k: tuple(v.shape) for k, v in p.owners.model.named_parameters()},
        "split": (p.spec.shared, p.spec.personal),
        "owners": p.fed.num_owners,
        "dpsgd_capacity": p.owners.training.dpsgd_capacity,
        "public_owner_records": p.owners.training.public_owner_records,
        "estimator": (agg.name, agg.sampling.rate, agg.sampling.population),
        "divisor": agg.sampling.expected_cohort,
        "z": agg.noise_multiplier,
        "noise_std": agg.noise_std,
        "constraint": (agg.constraint.rows, agg.constraint.clip),
        "dpsgd_steps": getattr(agg, "classes", None),  # owner-side DP-SGD: (M, count, q, steps)
        "schedule": [str(bb.round_event(r)) for r in range(1, p.settings.rounds + 1)],
        "ledger_head": (
            led.unit,
            led.adjacency,
            led.accounting,
            led.guarantee,
            led.mechanism,
            led.accountant,
            led.delta,
            led.target_epsilon,
            tuple(led.notes),
            repr(sorted(led.extra.items())),
            led.randomness,
        ),
    }


def release_view(p, res) -> dict:
    """What the finished rounds add: each release's ledger event and the releases' shapes. An
    adaptive clip is itself a noisy release, so its noise std (z times the released clip) is
    left out of the comparison there; every other field of the event is public."""
    adaptive = p.cfg.privacy.clip_policy.value == "adaptive"
    return {
        "ledger_events": [
            (
                e.round,
                e.event,
                e.noise_multiplier,
                None if adaptive else e.noise_std,
                e.sampling_rate,
                e.epsilon,
            )
            for e in p.ledger.entries
        ],
        "released": {k: tuple(v.shape) for k, v in res.shared.items()},
        "rounds": (res.stop_reason, res.rounds_completed),
    }


def run_view(cfg, records, replace_fed=None) -> dict:
    """The public view of one run, or how it was refused (whether it starts is public too)."""
    try:
        p = build.prepare(cfg, records=records)
    except Exception as e:  # noqa: BLE001  (compared, not hidden)
        return {"refused": f"{type(e).__name__}: {e}"}
    if replace_fed is not None:
        p.fed = replace_fed(p.fed)
    plan = plan_view(p)
    return {**plan, **release_view(p, execute(p))}


def differences(a: dict, b: dict) -> list[str]:
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def neighbour_views(kind, family, tmp_path, which=tuple(NEIGHBOURS)):
    make = KINDS[kind]
    base = run_view(*make(BASE, tmp_path, FAMILIES[family]))
    assert "refused" not in base, base
    return base, {n: run_view(*make(NEIGHBOURS[n], tmp_path, FAMILIES[family])) for n in which}


# the default suite: every family on in-memory users, the two placements' plain forms on the
# files; the full matrix in the slow suite
FAST = (
    [("memory", f) for f in FAMILIES if not f.endswith("calibrated")]
    + [(k, f) for k in ("npz", "leaf") for f in ("sum", "dpsgd")]
    + [("parquet", "sum")]
)
SLOW = [(k, f) for k in KINDS for f in FAMILIES if (k, f) not in FAST]


@pytest.mark.parametrize(
    "kind,family", FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW]
)
def test_neighbours_share_every_public_quantity(kind, family, tmp_path):
    base, views = neighbour_views(kind, family, tmp_path)
    for name, view in views.items():
        assert differences(base, view) == [], (name, view.get("refused"))
    assert base["rounds"] == ("completed", 1) and base["owners"] == 4
    assert base["estimator"][2] == (4 if family.startswith("dpsgd") else 12)  # declared n


@pytest.mark.parametrize("family", ["sum", "dpsgd"])
def test_a_planned_federation_and_its_neighbour_without_one_user(family):
    """Planned data (synthetic): every number comes from the config; the neighbour without one
    user (``Federation.without_user``) runs with the same public view."""
    over = {
        **COMMON,
        "dataset.num_records": 48,
        "dataset.pool_train": 200,
        "dataset.pool_test": 40,
        "dataset.features": FEATURES,
        "partition.num_owners": 4,
        "partition.records_per_user": 2,
        **FAMILIES[family],
    }
    cfg = config_from_overrides(over)
    base = run_view(cfg, None)
    less = run_view(cfg, None, replace_fed=lambda f: f.without_user(3))
    assert "refused" not in base and differences(base, less) == []
    assert base["rounds"] == ("completed", 1) and base["estimator"][2] == (
        4 if family == "dpsgd" else 24
    )
    pub = build.public_numbers(cfg)  # the ledger's extra.public: the model's shape too
    assert (pub["classes"], pub["input_shape"], pub["users"]) == (10, [FEATURES], 24)


@pytest.mark.parametrize(
    "method,over",
    [
        ("joint_dp", {}),
        ("joint_dp", {"privacy.placement": "local_dpsgd"}),
        ("fedavg", {}),
        ("per_silo", {}),
        ("full_dp", {"privacy.unit": "owner", "train.sampling_rate": 1.0}),
    ],
)
def test_an_owner_without_users_takes_part_in_every_method(method, over, tmp_path):
    """The declared owner count is kept when an owner's only user leaves: the empty owner trains
    its personal layers on nothing, sends nothing (or a zero delta) and evaluates to NaN."""
    cfg, records = memory_run(
        NEIGHBOURS["removed"],
        tmp_path,
        {"method": method, "train.rounds": 2, "dataset.test_fraction": 0.3, **over},
    )
    p = build.prepare(cfg, records=records)
    assert p.fed.num_owners == 4 and np.diff(p.fed.owner_user_offsets).tolist()[3] == 0
    res = execute(p)
    assert res.stop_reason == "completed" and res.rounds_completed == 2
    acc = np.asarray(res.owner_accuracy)
    assert np.isnan(acc[3]) and np.isfinite(acc[:3]).all()


def test_data_beyond_a_declaration_is_refused_naming_the_key(tmp_path):
    """Upper bounds: only data exceeding a declaration is refused, with one line naming it."""
    for over, key in [
        ({"public.users": 9}, "public.users: 9 declared, the data has 10 users"),
        ({"partition.num_owners": 3}, "partition.num_owners: 3 declared"),
        ({"dataset.classes": 3}, "dataset.classes: 3 declared; records: label 3"),
        ({"public.owner_capacity": 3}, "public.owner_capacity: 3 declared"),
    ]:
        view = run_view(*memory_run(BASE, tmp_path, {**FAMILIES["sum"], **over}))
        assert key in view.get("refused", ""), view
        assert "\n" not in view["refused"]


def test_a_missing_declaration_gives_the_datas_values(tmp_path):
    cfg, records = memory_run(BASE, tmp_path, {"dataset.classes": None})
    view = run_view(cfg, records)
    assert view["refused"] == (
        "ConfigError: dataset.classes: a federation read from memory needs its model's shape "
        "declared (docs/your-data.md#public-numbers); this data has dataset.input_shape=[6], "
        "dataset.classes>=4 (labels 0..3)"
    )


# -- the weakened twins: a number read from the data is caught ----------------------------------
def twin_views(tmp_path, monkeypatch, name, patch, neighbour):
    """Base and ``neighbour`` (in memory) with ``build.<name>`` replaced by ``patch(honest,
    records)``, a version that reads a number from the records the run is given."""
    honest, given = getattr(build, name), {}

    def fake(cfg, *a, **k):
        return patch(honest, given["records"], cfg, *a, **k)

    # in every phase module of the builder that calls it (fedudp.build is a package)
    for n, module in list(sys.modules.items()):
        within = n == "fedudp.build" or n.startswith("fedudp.build.")
        if within and getattr(module, name, None) is honest:
            monkeypatch.setattr(module, name, fake)
    views = {}
    for side, users in (("base", BASE), (neighbour, NEIGHBOURS[neighbour])):
        cfg, given["records"] = memory_run(users, tmp_path, FAMILIES["sum"])
        views[side] = run_view(cfg, given["records"])
    return views["base"], views[neighbour]


def test_twin_reading_the_class_count_from_the_labels_is_caught(tmp_path, monkeypatch):
    """max(label) + 1, as the readers did before: the head's shape differs with the user who
    holds the only records of label 4."""

    def from_labels(honest, records, cfg, *a, **k):
        shape, _, tokens = honest(cfg)
        return shape, int(records.y.max()) + 1, tokens

    base, other = twin_views(tmp_path, monkeypatch, "input_spec", from_labels, "unique_label")
    diff = differences(base, other)
    assert "model" in diff and "released" in diff, diff
    assert 4 in {s[0] for s in base["model"].values()}
    assert 5 in {s[0] for s in other["model"].values()}
    monkeypatch.undo()  # the honest build: no difference
    honest = neighbour_views("memory", "sum", tmp_path, which=("unique_label",))
    assert differences(honest[0], honest[1]["unique_label"]) == []


def test_twin_reading_n_from_the_data_is_caught(tmp_path, monkeypatch):
    """N = the data's user count: the divisor q·N and the estimator's population differ with
    one user removed."""

    def counted(honest, records, cfg):
        return honest(cfg)[0], int(len(np.unique(records.user)))

    base, other = twin_views(tmp_path, monkeypatch, "planned_units", counted, "removed")
    diff = differences(base, other)
    assert {"divisor", "estimator"} <= set(diff), diff
    assert (base["divisor"], other["divisor"]) == (0.5 * 10, 0.5 * 9)


# -- the fault and lifecycle paths (tests/test_neighbours_paths.py, test_neighbours_property.py) -
def fail_owners(monkeypatch, schedule: dict[int, set[int]] | None = None) -> list[dict]:
    """Owners failing by index on ``engine=local``: in round r the owners ``schedule[r]`` do not
    answer (as a Flower owner that times out: ``Failure(j, its sampled units)``), every other
    owner replies on its own (one reply per owner, as over Flower). An owner fails whatever its
    sample holds: the failure is the infrastructure's, never the data's. Returns the rounds'
    (answered, failed) owners as the billboard saw them. ``schedule`` None or empty for a
    round: the honest transport (one reply for all owners)."""
    from fedudp.protocol.contributions import current_constraint
    from fedudp.billboard.rounds import Collected
    from fedudp.engines.local import LocalTransport
    from fedudp.protocol.messages import Failure

    honest, seen = LocalTransport.train, []
    schedule = schedule or {}

    def train(self, shared, cohort, round_):
        down = set(schedule.get(round_, ()))
        if cohort is None or not down:
            return honest(self, shared, cohort, round_)
        shared = self._here(shared)
        self.personal_params = self.owners.personal_round(
            self.fed, shared, self.personal_params, round_
        )
        by_owner = self.owners.spec.cohort_is_owners
        units = self.fed.present(cohort, by_owner)
        of = units if by_owner else self.fed.user_owner[units]
        constraint = current_constraint(self.constraint)
        replies, failures = [], []
        for j in range(self.fed.num_owners):
            mine = units[of == j]
            if j in down:
                failures.append(Failure(j, int(len(mine)), "injected: owner unreachable"))
            else:
                replies.append(
                    self.owners.reply(
                        self.fed, shared, self.personal_params, mine, round_, constraint
                    )
                )
        seen.append({"round": round_, "answered": len(replies), "failed": sorted(down)})
        return Collected(replies, failures)

    monkeypatch.setattr(LocalTransport, "train", train)
    return seen


def path_view(cfg, records) -> dict:
    """``run_view`` on a fault or lifecycle path: also every release decision (the rounds
    withheld), whether the released model is finite, the stop message, and how a run that
    raised mid-way ended (a raise is public too)."""
    try:
        p = build.prepare(cfg, records=records)
    except Exception as e:  # noqa: BLE001  (compared, not hidden)
        return {"refused": f"{type(e).__name__}: {e}"}
    plan = plan_view(p)
    try:
        res = execute(p)
    except Exception as e:  # noqa: BLE001  (compared, not hidden)
        return {**plan, "raised": type(e).__name__}
    bb = p.billboard
    return {
        **plan,
        **release_view(p, res),
        "withheld": list(bb.withheld) if bb is not None else None,
        "finite": all(bool(torch.isfinite(v).all()) for v in res.shared.values()),
        "message": res.message,
        # the units each release used (a diagnostic, not compared by default: a neighbour
        # with one user fewer uses one fewer; a dropped non-finite user must use as many as
        # its absence does)
        "_used": [h.get("users_used") for h in res.history],
    }
