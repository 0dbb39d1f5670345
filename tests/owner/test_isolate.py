"""``engine=local`` drops a user whose training step raises alone (``fedudp.owner.isolate``,
issue 49, docs/architecture.md#failures).

The fault: ``Owners.reply`` raises whenever one of the marked users (by their stable
``user_ids``) is among the users it computes, as a model or hook failing on that user's data.
The reply with the marked users must equal the reply of the federation without them
(``Federation.without_user``, same seed), with the users counted as ``raised``; a failure not
tied to single users (every user raising, the code raising without users, users that raise only
together) and bad input or a stop must propagate as before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedudp import build
from fedudp.protocol.contributions import current_constraint
from fedudp.engines import local as local_mod
from fedudp.errors import DataError
from fedudp.owner import isolate
from fedudp.owner.isolate import isolated_reply, without_users
from fedudp.owner.owners import Owners
from fedudp.protocol.messages import OwnerFailure, Raised, raised_metrics
from fedudp.run import execute
from fedudp.stopping import RunInterrupted
from test_neighbours import BASE, FAMILIES, arrays
from test_neighbours_paths import diff, first_record_of, memory_cfg, path_view

REASON = "RuntimeError: injected: the user's training step raised"


def computed_users(owners: Owners, fed, units) -> np.ndarray:
    """The stable ids of the users a call of ``Owners.reply`` computes."""
    if owners.spec.cohort_is_owners:
        return fed.user_ids[np.isin(fed.user_owner, units)]
    return fed.user_ids[np.asarray(units, dtype=np.int64)]


def inject(monkeypatch, fails, error=RuntimeError):
    """``Owners.reply`` raises ``error`` when ``fails(ids)`` (``ids``: the stable ids of the users
    it computes); returns the list of the calls' ids."""
    honest, calls = Owners.reply, []

    def reply(self, fed, shared, personal, units, round_, constraint):
        ids = computed_users(self, fed, units)
        calls.append(ids)
        if fails(ids):
            raise error("injected: the user's training step raised")
        return honest(self, fed, shared, personal, units, round_, constraint)

    monkeypatch.setattr(Owners, "reply", reply)
    return calls


def prepared(family: str):
    cfg, records = memory_cfg(BASE, {**FAMILIES[family], "train.sampling_rate": 1.0})
    p = build.prepare(cfg, records=records)
    constraint = current_constraint(p.aggregator.constraint)
    shared = p.billboard.shared_params()
    personal = p.owners.initial_personal(p.fed.num_owners)
    units = np.arange(p.fed.num_owners if p.spec.cohort_is_owners else p.fed.num_users)
    return p, (shared, personal), units, constraint


def neighbour_reply(p, args, units, constraint, drop: list[int]):
    """The honest reply of the federation without the users ``drop`` (indices), one
    ``Federation.without_user`` at a time, on the same units (users shifted down)."""
    fed, left = p.fed, units
    for u in sorted(drop, reverse=True):
        fed = fed.without_user(u)
        if not p.spec.cohort_is_owners:
            left = np.array([v - (v > u) for v in left if v != u], dtype=np.int64)
    return Owners.reply(p.owners, fed, *args, left, 1, constraint)


# one user of owner 0 and one of owner 3 (BASE: u0-u1 owner 0, ..., u6-u9 owner 3)
DROP = [1, 7]


@pytest.mark.parametrize("family", ["sum", "dpsgd"])
def test_the_reply_with_raising_users_is_the_reply_without_them(family, monkeypatch):
    p, args, units, constraint = prepared(family)
    honest = Owners.reply
    marked = set(p.fed.user_ids[DROP].tolist())
    calls = inject(monkeypatch, lambda ids: bool(marked & set(ids.tolist())))
    got = isolated_reply(p.owners, p.fed, *args, units, 1, constraint)
    monkeypatch.setattr(Owners, "reply", honest)
    want = neighbour_reply(p, args, units, constraint, DROP)
    assert len(calls) > 2  # the failure path probed subsets
    # same seed, same users: the same contribution (a neighbour's users keep their identities)
    assert got.contribution.count == want.contribution.count
    torch.testing.assert_close(got.contribution.total, want.contribution.total)
    owners = sorted({int(p.fed.owner_ids[p.fed.user_owner[u]]) for u in DROP})
    assert got.raised == tuple(Raised(j, 1, (REASON,)) for j in owners)
    # user units: each dropped user is zero and uncounted, as a non-finite one; owner units:
    # every owner still answers
    assert got.failed == want.failed + (0 if p.spec.cohort_is_owners else len(DROP))
    assert raised_metrics([got]) == {
        "raised_users": 2,
        "raised": [{"owner": j, "raised_users": 1, "reasons": [REASON]} for j in owners],
    }


def test_the_happy_path_is_one_call(monkeypatch):
    p, args, units, constraint = prepared("sum")
    calls = inject(monkeypatch, lambda ids: False)
    rep = isolated_reply(p.owners, p.fed, *args, units, 1, constraint)
    assert len(calls) == 1 and rep.raised == () and raised_metrics([rep]) == {}


@pytest.mark.parametrize(
    "fails, why",
    [
        (lambda ids: len(ids) > 0, "every user raises alone"),
        (lambda ids: True, "the code raises without any user"),
        (lambda ids: len(ids) > 1, "users raise only together (a cohort too large)"),
    ],
)
@pytest.mark.parametrize("family", ["sum", "dpsgd"])
def test_a_failure_not_tied_to_single_users_propagates(family, fails, why, monkeypatch):
    p, args, units, constraint = prepared(family)
    calls = inject(monkeypatch, fails)
    with pytest.raises(RuntimeError, match="injected") as e:
        isolated_reply(p.owners, p.fed, *args, units, 1, constraint)
    assert len(calls[0]) == len(BASE), why  # the original exception: the cohort's own call
    assert e.value.__traceback__ is not None


def test_every_user_raising_still_stops_the_run(monkeypatch):
    """A step that raises for every user is the code's failure: the run stops as before."""
    inject(monkeypatch, lambda ids: len(ids) > 0)
    over = {**FAMILIES["sum"], "train.sampling_rate": 1.0}
    assert path_view(*memory_cfg(BASE, over))["raised"] == "RuntimeError"


@pytest.mark.parametrize(
    "error", [DataError, RunInterrupted, OwnerFailure, KeyboardInterrupt], ids=lambda e: e.__name__
)
def test_bad_input_a_stop_or_an_owner_failure_is_never_isolated(error, monkeypatch):
    p, args, units, constraint = prepared("sum")
    if error is RunInterrupted:
        error = lambda msg: RunInterrupted(2)  # noqa: E731  (its signature: the signal)
    marked = int(p.fed.user_ids[DROP[0]])
    calls = inject(monkeypatch, lambda ids: marked in ids.tolist(), error)
    with pytest.raises((DataError, RunInterrupted, OwnerFailure, KeyboardInterrupt)):
        isolated_reply(p.owners, p.fed, *args, units, 1, constraint)
    assert len(calls) == 1  # no probe


def test_a_run_names_the_raising_user_per_owner_in_its_metrics(monkeypatch):
    cfg, records = memory_cfg(BASE, {**FAMILIES["sum"], "train.sampling_rate": 1.0})
    p = build.prepare(cfg, records=records)
    marked = int(p.fed.user_ids[DROP[0]])
    inject(monkeypatch, lambda ids: marked in ids.tolist())
    res = execute(p)
    assert res.stop_reason == "completed"
    for h in res.history:
        assert h["raised_users"] == 1
        assert h["raised"] == [{"owner": 0, "raised_users": 1, "reasons": [REASON]}]
        assert h["users_used"] == len(BASE) - 1


def test_twin_without_isolation_is_caught(monkeypatch):
    """The local engine calling ``Owners.reply`` bare (no isolation): the marked user's raise
    stops the run while the neighbour without the user completes; the harness's comparison
    (tests/test_neighbours_paths.py) tells them apart."""
    over = {**FAMILIES["sum"], "train.sampling_rate": 1.0}
    cfg, records = memory_cfg(BASE, over)
    fed = build.prepare(cfg, records=records).fed
    first = torch.as_tensor(arrays(BASE)["x"][first_record_of(arrays(BASE), "u1")])
    (at,) = [u for u in range(fed.num_users) if torch.equal(fed.x[fed.user_offsets[u]], first)]
    marked = int(fed.user_ids[at])  # u1's stable id
    inject(monkeypatch, lambda ids: marked in ids.tolist())
    monkeypatch.setattr(local_mod, "isolated_reply", lambda owners, *a: Owners.reply(owners, *a))
    others = [u for u in BASE if u[0] != "u1"]
    base, without = path_view(cfg, records), path_view(*memory_cfg(others, over))
    assert base["raised"] == "RuntimeError" and "raised" in diff(base, without)
    monkeypatch.setattr(local_mod, "isolated_reply", isolate.isolated_reply)  # the honest one
    assert diff(path_view(*memory_cfg(BASE, over)), without) == []


def test_without_users_is_without_user_repeated():
    p, _, _, _ = prepared("sum")
    drop = [0, 5, 6, 9]  # owner 2's only user (u5) among them: an owner left without users
    one = p.fed
    for u in sorted(drop, reverse=True):
        one = one.without_user(u)
    many = without_users(p.fed, np.array(drop))
    for k in vars(one):
        a, b = getattr(one, k), getattr(many, k)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), k
        elif isinstance(a, np.ndarray):
            assert np.array_equal(a, b) and a.dtype == b.dtype, k
        elif k == "owner_classes" and a is not None:
            assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True)), k
        else:
            assert a == b, k
    assert many.num_users == p.fed.num_users - len(drop)
    assert many.num_owners == p.fed.num_owners and np.diff(many.owner_user_offsets)[2] == 0
