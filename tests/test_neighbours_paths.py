"""Neighbour invariance on the fault and lifecycle paths (issue 49, docs/your-data.md#public-numbers).

``tests/test_neighbours.py`` compares a federation with its neighbours (one user removed, one
added, a user with the only records of a label) on the happy path. Here the same comparison runs
where an adversary may choose the path: an owner failing (by owner index, the same in base and
neighbour), a user with non-finite data, a user whose training step raises, a run killed and
resumed (seeded and ``privacy.randomness=secure``), rounds withheld by ``train.min_owners`` /
``train.min_users``, and every ``partition.owner_rule``. Every public quantity and every release
decision (which rounds released, which withheld, whether the released model is finite, how the
run stopped) must be the same for a dataset and its neighbours. Each hole has a weakened twin,
a monkeypatch that brings the old behaviour back, and the same comparison catches it.
(The Flower per-user and fast paths are in tests/engines/.)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import fedudp
from fedudp import build
from fedudp.billboard import rounds as rounds_mod
from fedudp.config import config_from_overrides
from fedudp.errors import DataError
from test_neighbours import (
    BASE,
    COMMON,
    DECLARED,
    FAMILIES,
    FEATURES,
    NEIGHBOURS,
    CLASSES,
    arrays,
    fail_owners,
    npz_run,
    path_view,
)

ROUNDS = 3
# owners fail by index: owner 2 (whose only user the "removed" neighbour drops), then two owners
SCHEDULE = {1: {2}, 2: {1, 3}, 3: {0}}
PATH_FAMILIES = ("sum", "rows", "tree", "adaptive", "dpsgd")


def public(view: dict) -> dict:
    """The view without the test's own bookkeeping (keys starting with ``_``)."""
    return {k: v for k, v in view.items() if not k.startswith("_")}


def diff(a: dict, b: dict) -> list[str]:
    a, b = public(a), public(b)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def memory_cfg(users, over, *, poison=None, owner_col=True, meta=None):
    """An in-memory federation of ``users`` (test_neighbours' table) as ``(cfg, records)``;
    ``poison(arrays)`` may change the arrays first (a NaN feature, a marker)."""
    a = arrays(users)
    if poison is not None:
        poison(a)
    cfg = {
        **COMMON,
        **DECLARED,
        "train.rounds": ROUNDS,
        "privacy.epsilon": 50.0,  # every round within budget (the noise is given or calibrated)
        "dataset.name": "memory",
        "partition.owner_rule": "given",
        "dataset.classes": CLASSES,
        "dataset.input_shape": [FEATURES],
        **over,
    }
    records = fedudp.from_arrays(
        a["x"], a["y"], a["user"], a["owner"] if owner_col else None, meta=meta and meta(a)
    )
    return config_from_overrides(cfg), records


def first_record_of(a: dict, name: str) -> int:
    return int(np.flatnonzero(a["user"] == name)[0])


# -- an owner failing ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", PATH_FAMILIES)
def test_an_owner_failing_changes_nothing_public_between_neighbours(family, monkeypatch):
    """Owners 2, then 1 and 3, then 0 fail (by index, in base and neighbour alike); the default
    minimum (one owner, one user slot) releases every round."""
    seen = fail_owners(monkeypatch, SCHEDULE)
    over = FAMILIES[family]
    base = path_view(*memory_cfg(BASE, over))
    assert "refused" not in base and "raised" not in base, base
    assert [s["failed"] for s in seen] == [sorted(SCHEDULE[r]) for r in (1, 2, 3)]
    for name, users in NEIGHBOURS.items():
        assert diff(base, path_view(*memory_cfg(users, over))) == [], name
    assert base["rounds"] == ("completed", ROUNDS) and base["finite"]


# -- a user with non-finite data ----------------------------------------------------------------
# A NaN or infinite feature is outside the data's domain: refused when the records are read, in
# one line naming the record, before any work (as data beyond a declaration). A user's update is
# still non-finite when the model turns one of its finite records into NaN (here: a record
# whose first feature is MARK): that is the path the owners' finite-rows screen guards.
NAN_USER = ("u12", 5, 2, None)  # within the declared bounds (12 users, 4 per owner)
MARK = 777.0


class NanOnMarked(torch.nn.Module):
    """One linear layer whose output is NaN for a record whose first feature is ``MARK`` (per
    record: no record reaches another's output)."""

    def __init__(self, input_shape, classes):
        super().__init__()
        self.fc = torch.nn.Linear(int(np.prod(input_shape)), classes)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc(x * torch.where(x[:, :1] == MARK, float("nan"), 1.0))


def with_nan(a: dict) -> None:
    a["x"][first_record_of(a, "u12"), 0] = MARK


NAN_MODEL = {"model.target": "test_neighbours_paths.NanOnMarked"}


def test_a_nan_feature_is_refused_when_read_naming_the_record():
    def nan(a):
        a["x"][first_record_of(a, "u12"), 1] = np.nan

    with pytest.raises(DataError, match=r"features of record \d+ are NaN or infinite"):
        memory_cfg(BASE + [NAN_USER], FAMILIES["sum"], poison=nan)


@pytest.mark.parametrize("family", PATH_FAMILIES)
def test_a_user_whose_update_is_nan_changes_nothing_public(family):
    """One user whose record the model turns into NaN (sampled in every round: q = 1): its
    vector is dropped and counted, as ``make_reply`` does; the release stays finite, uses the
    very units the neighbour without that user uses, and every public quantity is the
    neighbour's."""
    over = {**FAMILIES[family], **NAN_MODEL, "train.sampling_rate": 1.0}
    with_user = BASE + [NAN_USER]
    base = path_view(*memory_cfg(with_user, over, poison=with_nan))
    without = path_view(*memory_cfg(BASE, over))
    assert "raised" not in base and "refused" not in base, base
    assert diff(base, without) == []
    assert base["finite"] and base["rounds"] == ("completed", ROUNDS)
    assert base["_used"] == without["_used"], (base["_used"], without["_used"])


def test_twin_a_reply_that_keeps_a_non_finite_user_is_caught(monkeypatch):
    """``make_reply`` without its finite-rows screen: the NaN user's vector reaches the sum, the
    release is non-finite (the billboard keeps its last finite value and stops: diverged),
    while the neighbour without the user releases."""
    from fedudp.owner import owners as owners_mod
    from fedudp.owner.kernels import Kernels
    from fedudp.protocol import messages
    from tests.owner.kernel_switch import owners_take

    honest = messages.make_reply

    def keeps(G, names, constraint, weights=None, owned=False):
        rep = honest(G[:0], names, constraint, weights, owned)  # an honest reply's shape
        c = constraint.apply(G, None)
        return type(rep)(names, c, 0)

    over = {**FAMILIES["sum"], **NAN_MODEL, "train.sampling_rate": 1.0}
    monkeypatch.setattr(owners_mod, "make_reply", keeps)
    owners_take(monkeypatch, Kernels(one_step=False))  # every user through make_reply
    base = path_view(*memory_cfg(BASE + [NAN_USER], over, poison=with_nan))
    without = path_view(*memory_cfg(BASE, over))
    d = diff(base, without)
    assert "rounds" in d or "finite" in d, d
    monkeypatch.undo()
    owners_take(monkeypatch, Kernels(one_step=False))  # the honest reply on the same path
    honest_base = path_view(*memory_cfg(BASE + [NAN_USER], over, poison=with_nan))
    assert diff(honest_base, path_view(*memory_cfg(BASE, over))) == []


# -- a user whose training step raises ----------------------------------------------------------
def raise_for_marked(monkeypatch) -> None:
    """The owners' step raises whenever a marked user (a record whose first feature is
    ``MARK``) is among the units it computes: a model or hook failing on one user's data."""
    from fedudp.owner.owners import Owners

    honest = Owners.reply

    def reply(self, fed, shared, personal, units, round_, constraint):
        offs = fed.user_offsets
        users = units if not self.spec.cohort_is_owners else np.arange(fed.num_users)
        if any(bool((fed.x[offs[u] : offs[u + 1], 0] == MARK).any()) for u in users):
            raise RuntimeError("injected: the user's training step raised")
        return honest(self, fed, shared, personal, units, round_, constraint)

    monkeypatch.setattr(Owners, "reply", reply)


@pytest.mark.parametrize("family", ["sum", "dpsgd"])
def test_a_user_whose_step_raises_changes_nothing_public(family, monkeypatch):
    raise_for_marked(monkeypatch)
    over = {**FAMILIES[family], "train.sampling_rate": 1.0}
    base = path_view(*memory_cfg(BASE + [NAN_USER], over, poison=with_nan))
    assert diff(base, path_view(*memory_cfg(BASE, over))) == [], base.get("raised")


# -- withheld rounds ----------------------------------------------------------------------------
# round 1: owner 3 fails (3 answer, 12 declared user slots); round 2: owners 0, 1, 3 fail (one
# answers, 4 slots); round 3: none fails. train.min_users=5: released, withheld, released, from
# the answering owners' declared capacities alone (owner-side DP-SGD samples owners, each one
# slot: min_users=2, released with 3 owners answering, withheld with one)
WITHHOLD = {1: {3}, 2: {0, 1, 3}}
MINIMUM = {
    "min_users": {"sum": {"train.min_users": 5}, "dpsgd": {"train.min_users": 2}},
    "min_owners": {"sum": {"train.min_owners": 3}, "dpsgd": {"train.min_owners": 3}},
}
SEEDS = (1, 2, 3, 4)


def withhold_views(monkeypatch, family: str, key: str = "min_users") -> dict:
    """(seed, side) -> the public view, for every seed of the sample, base and neighbours."""
    fail_owners(monkeypatch, WITHHOLD)
    over = {**FAMILIES[family], "train.rounds": 3, **MINIMUM[key][family]}
    out = {}
    for seed in SEEDS:
        for name, users in (("base", BASE), *NEIGHBOURS.items()):
            out[seed, name] = path_view(*memory_cfg(users, {**over, "seed": seed}))
    return out


def withhold_differences(views: dict[tuple[int, str], dict]) -> list[str]:
    """What differs between a dataset and its neighbours (per seed), and the release decisions
    across the seeds of the sample."""
    found = []
    for (seed, name), v in views.items():
        found += [f"seed {seed} {name}: {k}" for k in diff(views[seed, "base"], v)]
    decisions = {(tuple(v["withheld"]), v["rounds"]) for v in views.values()}
    if len(decisions) > 1:
        found.append(f"decisions across seeds: {sorted(map(str, decisions))}")
    return found


@pytest.mark.parametrize("key", list(MINIMUM))
@pytest.mark.parametrize("family", ["sum", "dpsgd"])
def test_withheld_rounds_are_decided_from_public_numbers(family, key, monkeypatch):
    views = withhold_views(monkeypatch, family, key)
    assert withhold_differences(views) == []
    base = views[SEEDS[0], "base"]
    assert base["withheld"] == [2] and base["rounds"] == ("completed", ROUNDS), base
    assert [e[0] for e in base["ledger_events"]] == [1, 3]


def old_withhold_rule(monkeypatch) -> None:
    """The rule before issue 49: ``train.min_users`` compared with the sampled units held by
    the owners that answered (``len(cohort) - lost``), a secret of the Poisson sample."""
    from fedudp.billboard.server import Billboard

    honest = rounds_mod._release_round

    def release_round(bb, r, got, cohort, info, withheld):
        lost = sum(f.units for f in got.failures)
        answered, sampled, failed = len(got.replies), len(cohort) - lost, len(got.failures)

        def withhold(round_, *a, **k):
            if failed and not (answered >= bb.min_owners and sampled >= bb.min_users):
                bb.next_round = round_ + 1
                bb.withheld.append(int(round_))
                return f"{failed} owner(s) failed; {answered} answered with {sampled} sampled"
            return None

        bb.withhold = withhold  # this billboard only, this round
        try:
            return honest(bb, r, got, cohort, info, withheld)
        finally:
            bb.withhold = Billboard.withhold.__get__(bb)

    monkeypatch.setattr(rounds_mod, "_release_round", release_round)


def test_twin_withholding_on_the_sampled_count_is_caught(monkeypatch):
    old_withhold_rule(monkeypatch)
    found = withhold_differences(withhold_views(monkeypatch, "sum"))
    assert any(f.startswith("decisions across seeds") for f in found), found


# -- kill and resume ----------------------------------------------------------------------------
class Killed(BaseException):
    """The process dying mid-run (SIGKILL in tests/test_faults.py): nothing after it runs."""


KILL_ROUND, RESUME_ROUNDS = 5, 6
RESUME_OVER = {
    **FAMILIES["sum"],
    "train.rounds": RESUME_ROUNDS,
    "train.sampling_rate": 0.5,
    "privacy.noise_multiplier": 2.0,
    "privacy.epsilon": 50.0,
    "checkpoint.every": 3,
    "checkpoint.keep_after_finish": "all",
}


def releases_observed(monkeypatch) -> list[tuple[int, bytes]]:
    """Every release as an observer of the billboard sees it: (round, the shared parameters
    after it), across the killed and the resumed process."""
    from fedudp.billboard.server import Billboard

    honest, seen = Billboard.release, []

    def release(self, replies, round_, answered=None):
        agg = honest(self, replies, round_, answered)
        seen.append((int(round_), self.u.detach().cpu().numpy().tobytes()))
        return agg

    monkeypatch.setattr(Billboard, "release", release)
    return seen


def killed_and_resumed(users, tmp_path: Path, monkeypatch, randomness: str) -> dict:
    """The run killed right after round 5's metrics and ledger lines were written (its last
    checkpoint: round 3), then resumed to the end. Returns its public view."""
    from fedudp import run as run_mod

    seen = releases_observed(monkeypatch)
    cfg, _ = npz_run(users, tmp_path, {**RESUME_OVER, "privacy.randomness": randomness})
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    write = run_mod._RoundWriter.__call__

    def dies(self, info):
        write(self, info)
        if info["round"] == KILL_ROUND:
            raise Killed

    with monkeypatch.context() as m:
        m.setattr(run_mod._RoundWriter, "__call__", dies)
        with pytest.raises(Killed):
            run_mod.run(cfg, out)
    cfg.resume = str(out)
    summary = run_mod.run(cfg, "ignored")
    lines = [json.loads(x) for x in (out / "ledger.jsonl").read_text().splitlines() if x.strip()]
    entries = lines[1:]
    return {
        "ledger_head": lines[0],
        "ledger_events": [
            (
                e["round"],
                e["event"],
                e["noise_multiplier"],
                e["sampling_rate"],
                e["epsilon"],
                e.get("superseded"),
            )
            for e in entries
        ],
        "composed": len(entries),
        "releases_made": summary.get("releases_made"),
        "epsilon": summary["epsilon"],
        "rounds": (summary["stop_reason"], summary["rounds_completed"]),
        "_distinct_releases": len(set(seen)),
    }


@pytest.mark.parametrize("randomness", ["seeded", "secure"])
def test_a_killed_and_resumed_run_composes_alike_for_neighbours(randomness, tmp_path, monkeypatch):
    """Seeded: the resumed rounds re-release the same values; secure: fresh ones. Either way
    base and neighbour show the same ledger, count of composed releases and ε, and the ledger
    composes every distinct release an observer saw."""
    base = killed_and_resumed(BASE, tmp_path, monkeypatch, randomness)
    other = killed_and_resumed(NEIGHBOURS["removed"], tmp_path, monkeypatch, randomness)
    assert diff(base, other) == []
    assert base["rounds"] == ("completed", RESUME_ROUNDS)
    assert base["_distinct_releases"] == (
        RESUME_ROUNDS if randomness == "seeded" else RESUME_ROUNDS + KILL_ROUND - 3
    )
    # every distinct release composed once, and the summary counts them
    assert base["composed"] == base["_distinct_releases"] == base["releases_made"], base


def test_twin_a_resume_that_cuts_the_ledger_back_is_caught(tmp_path, monkeypatch):
    """The resume before issue 49: ledger.jsonl cut back to the checkpoint, the secure run's
    releases of rounds 4-5 made before the kill forgotten. Base and neighbour still agree
    (both forget alike), but the ledger composes fewer releases than an observer saw."""
    from fedudp.protocol import ledger_file

    monkeypatch.setattr(
        ledger_file, "after_checkpoint", lambda *a, **k: ledger_file.Resumed([], [], None)
    )
    base = killed_and_resumed(BASE, tmp_path, monkeypatch, "secure")
    assert base["composed"] == RESUME_ROUNDS < base["_distinct_releases"], base


# -- owner rules ---------------------------------------------------------------------------------
RULES = {
    "random": {"partition.owner_rule": "random"},
    "dirichlet": {"partition.owner_rule": "dirichlet", "partition.dirichlet_alpha": 0.5},
    "column": {
        "partition.owner_rule": "column",
        "partition.owner_column": "site",
        "dataset.columns.meta": ["site"],
    },
    "given": {"partition.owner_rule": "given"},
}
# a keyed hash fills owners unevenly: the capacity declared large enough for every deal
RULE_DECLARED = {"public.owner_capacity": 12}


def rule_run(users, rule: str, family: str = "sum"):
    over = {**FAMILIES[family], **RULE_DECLARED, **RULES[rule]}
    return memory_cfg(
        users,
        over,
        owner_col=rule == "given",
        meta=(lambda a: {"site": a["owner"]}) if rule == "column" else None,
    )


def owner_of_each_user(cfg, records) -> dict[str, int]:
    train, _ = build.natural_records(cfg, records)
    return dict(zip(train.user.tolist(), np.asarray(train.owner).tolist()))


def rule_differences(rule: str, family: str = "sum") -> list[str]:
    base_cfg = rule_run(BASE, rule, family)
    base_owner, base = owner_of_each_user(*base_cfg), path_view(*base_cfg)
    assert "refused" not in base, base
    found = []
    for name in ("removed", "added"):
        cfg = rule_run(NEIGHBOURS[name], rule, family)
        owner = owner_of_each_user(*cfg)
        moved = sorted(u for u in set(owner) & set(base_owner) if owner[u] != base_owner[u])
        found += [f"{name}: {u} moved" for u in moved]
        found += [f"{name}: {k}" for k in diff(base, path_view(*cfg))]
    return found


@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("family", ["sum", "dpsgd"])
def test_each_owner_rule_keeps_every_other_users_owner(rule, family):
    assert rule_differences(rule, family) == []


def test_twin_a_permutation_deal_is_caught(monkeypatch):
    """Owners dealt round-robin from a seeded permutation of the sorted user ids (the random rule
    before issue 49): removing one user re-deals the others."""
    from fedudp.data import records as records_mod

    def permutation_deal(records, rule, *, num_owners=None, seed=0, column=None, alpha=None):
        users, inv = np.unique(records.user, return_inverse=True)
        owner = np.empty(len(users), dtype=np.int64)
        owner[np.random.default_rng(seed).permutation(len(users))] = np.arange(len(users)) % int(
            num_owners
        )
        return records.with_owner(owner[inv])

    monkeypatch.setattr(build.data, "group_users", permutation_deal)
    monkeypatch.setattr(records_mod, "group_users", permutation_deal)
    found = rule_differences("random")
    assert any("moved" in f for f in found), found
