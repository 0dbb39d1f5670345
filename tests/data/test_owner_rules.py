"""Owner rules stable under neighbours (issue 49, docs/your-data.md#grouping-users-into-owners).

Owner-side DP-SGD accounts every owner on its own: a user-level neighbour (one user removed or
added) must leave every other user with the owner it had, or the neighbour changes the owners'
releases by far more than one user's clipped contribution. Every rule places a user by its own
key, its own records and public numbers: checked here for ``random``, ``dirichlet`` and
``column`` on drawn federations (hypothesis) and fixed grids of seeds and sizes, for ``given``
and the other two end to end through ``build.prepare`` under ``privacy.placement=local_dpsgd``
(with the held-out test records and test-only users, which follow the same rule). The weakened
twins are the rules this replaced (a seeded permutation of all users dealt round-robin; the
capacity-filling Dirichlet deal; a held-out split drawn from one stream over all users) and the
same checks catch them.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.stats import binom

import fedudp
from fedudp import build
from fedudp.config import config_from_overrides
from fedudp.data import natural as nat
from fedudp.data import owner_rules
from fedudp.data.records import Records, group_users

CLASSES = 4


def users_records(names: list, seed: int = 0, per_user: int = 3) -> Records:
    """Each user's records from its own name: the same in every neighbour."""
    xs, ys, us = [], [], []
    for name in names:
        rng = np.random.default_rng(
            list(hashlib.blake2b(str(name).encode(), digest_size=8).digest())
        )
        n = 1 + int(rng.integers(per_user))
        xs.append(rng.random((n, 3)).astype(np.float32))
        ys.append(rng.integers(0, CLASSES, n))
        us += [name] * n
    return fedudp.from_arrays(
        np.concatenate(xs), np.concatenate(ys), np.array(us), classes=CLASSES, meta=None
    )


def owners_of(records: Records) -> dict:
    return nat.owner_of_users(records)


def moved(rule: str, names: list, gone: list, extra: list, k: int, seed: int) -> int:
    """Users (other than those removed or added) whose owner differs between the federation of
    ``names`` and its neighbour without ``gone`` and with ``extra``."""
    kw = {"num_owners": k, "seed": seed, "alpha": 0.3 if rule == "dirichlet" else None}
    base = owners_of(group_users(users_records(names), rule, **kw))
    rest = [u for u in names if u not in gone] + extra
    other = owners_of(group_users(users_records(rest), rule, **kw))
    return sum(base[u] != other[u] for u in names if u not in gone)


# -- the twins: the rules this replaced ------------------------------------------------------
def permutation_deal(keys: np.ndarray, num_owners: int, seed: int) -> np.ndarray:
    """The old ``random``: sorted users permuted with the seed, dealt round-robin."""
    owner = np.empty(len(keys), dtype=np.int64)
    owner[np.random.default_rng(seed).permutation(len(keys))] = np.arange(len(keys)) % num_owners
    return owner


def capacity_dirichlet(keys, major, num_owners, classes, alpha, seed) -> np.ndarray:
    """The old ``dirichlet``: users visited in a seeded order, each to the owner (not yet full)
    with the largest deficit for its label."""
    rng = np.random.default_rng(seed)
    mix = rng.dirichlet(np.full(classes, float(alpha)), size=num_owners)
    cap = np.full(num_owners, len(major) // num_owners)
    cap[: len(major) % num_owners] += 1
    target, taken = cap[:, None] * mix, np.zeros((num_owners, classes))
    size, owner = np.zeros(num_owners, dtype=np.int64), np.empty(len(major), dtype=np.int64)
    for u in rng.permutation(len(major)):
        c = major[u]
        j = int(np.argmax(np.where(size < cap, target[:, c] - taken[:, c], -np.inf)))
        owner[u], taken[j, c], size[j] = j, taken[j, c] + 1, size[j] + 1
    return owner


def stream_holdout(records: Records, fraction: float, seed: int):
    """The old ``holdout``: one stream over the users in sorted order."""
    rng = np.random.default_rng(seed)
    users, inv = np.unique(records.user, return_inverse=True)
    order, counts = np.argsort(inv, kind="stable"), np.bincount(inv)
    is_test, start = np.zeros(len(records), dtype=bool), 0
    for c in counts:
        k = int(np.floor(fraction * c))
        if k and c > 1:
            is_test[order[start + rng.choice(c, size=min(k, c - 1), replace=False)]] = True
        start += c
    return nat._subset(records, ~is_test), nat._subset(records, is_test)


TWINS = {
    "random": ("random_owners", permutation_deal),
    "dirichlet": ("dirichlet_owners", capacity_dirichlet),
}


# -- the property, rule by rule ----------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rule=st.sampled_from(["random", "dirichlet"]),
    users=st.integers(2, 60),
    k=st.integers(1, 13),
    seed=st.integers(-(2**40), 2**40),
    data=st.data(),
)
def test_a_neighbour_moves_no_other_user(rule, users, k, seed, data):
    names = [f"w{i}" for i in range(users)]
    gone = data.draw(st.lists(st.sampled_from(names), max_size=min(2, users - 1), unique=True))
    extra = data.draw(st.sampled_from([[], ["new"], [10**6 + 7]]))
    if not gone and not extra:
        gone = [names[0]]
    assert moved(rule, names, gone, extra, k, seed) == 0


@pytest.mark.parametrize("rule", ["random", "dirichlet"])
@pytest.mark.parametrize("users,k", [(5, 2), (40, 4), (40, 13), (200, 7)])
def test_removing_or_adding_each_user_moves_no_other_on_a_grid(rule, users, k):
    names = list(range(users))
    for seed in (0, 1, 7):
        for u in names[:: max(1, users // 6)]:
            assert moved(rule, names, [u], [], k, seed) == 0
        assert moved(rule, names, [], [users + 5], k, seed) == 0


def test_column_rule_is_the_users_own_value():
    names = [f"w{i}" for i in range(30)]

    def grouped(keep):
        r = users_records(keep)
        site = np.array([f"site{int(u[1:]) % 4}" for u in r.user])
        return owners_of(group_users(replace(r, meta={"site": site}), "column", column="site"))

    base = grouped(names)
    for gone in names[::5]:
        other = grouped([u for u in names if u != gone])
        assert all(other[u] == base[u] for u in other)


@pytest.mark.parametrize("rule", ["random", "dirichlet"])
def test_the_old_deals_are_caught(rule, monkeypatch):
    """Weakened twins: the replaced deals move most other users when one leaves."""
    names = list(range(40))
    assert moved(rule, names, [3], [], 4, 0) == 0
    monkeypatch.setattr(owner_rules, TWINS[rule][0], TWINS[rule][1])
    assert moved(rule, names, [3], [], 4, 0) > 5


# -- balance and skew --------------------------------------------------------------------------
@pytest.mark.parametrize("users,k", [(100, 4), (1000, 10), (5000, 50), (3550, 16)])
def test_random_owners_are_binomially_balanced(users, k):
    """Owner sizes are Binomial(U, 1/K): on every seed tried each owner lies within the two-sided
    1e-6 (union over the owners) quantiles, and ``capacity_bound`` covers the largest."""
    lo = binom.ppf(1e-6 / k, users, 1 / k)
    keys = np.arange(users, dtype=np.int64) * 7919 + 13
    for seed in range(5):
        sizes = np.bincount(owner_rules.random_owners(keys, k, seed), minlength=k)
        assert sizes.sum() == users
        assert sizes.max() <= owner_rules.capacity_bound(users, k) and sizes.min() >= lo, sizes
    # the stated bound is a real binomial tail, not a loose one: P(size > bound) <= 1e-6 / K
    bound = owner_rules.capacity_bound(users, k)
    assert binom.sf(bound, users, 1 / k) <= 1e-6 / k < binom.sf(bound - 1, users, 1 / k)


def test_dirichlet_table_is_public_balanced_and_skewed():
    t = owner_rules.dirichlet_table(8, CLASSES, 0.05, 3)
    assert np.allclose(t.sum(0), 1) and np.allclose(t.sum(1), CLASSES / 8, atol=1e-6)
    assert np.array_equal(t, owner_rules.dirichlet_table(8, CLASSES, 0.05, 3))
    # small alpha: most owners take most of their users from one class; large alpha: none does
    share = lambda a: (t_ := owner_rules.dirichlet_table(8, CLASSES, a, 3)).max(1) / t_.sum(1)  # noqa: E731
    assert (share(0.05) >= 0.5).mean() >= 0.7 and (share(100.0) < 0.5).all()


# -- the held-out split and test-only users ----------------------------------------------------
def held_out(records: Records, seed: int) -> dict:
    _, test = nat.holdout(records, 0.3, seed)
    return {u: sorted(test.x[test.user == u, 0].tolist()) for u in np.unique(records.user)}


def test_holdout_keeps_every_other_users_split(monkeypatch):
    names = [f"w{i}" for i in range(30)]
    r = users_records(names, per_user=9)
    rest = users_records(names[1:], per_user=9)

    def same() -> bool:
        a, b = held_out(r, 5), held_out(rest, 5)
        return all(a[u] == b[u] for u in names[1:])

    assert same()
    # held-out counts as before: floor(0.3 n) per user, a one-record user keeps its record
    _, test = nat.holdout(r, 0.3, 5)
    n = {u: int((r.user == u).sum()) for u in names}
    assert {u: int((test.user == u).sum()) for u in names} == {
        u: min(int(np.floor(0.3 * c)), c - 1) if c > 1 else 0 for u, c in n.items()
    }
    monkeypatch.setattr(nat, "holdout", stream_holdout)
    assert not same()


def test_test_only_users_follow_their_own_key():
    names = [f"w{i}" for i in range(20)]
    train = group_users(users_records(names), "random", num_owners=3, seed=2)
    test_only = [f"t{i}" for i in range(12)]
    test = users_records(names + test_only)
    owners = np.arange(3, dtype=np.int64)
    a = owners_of(nat.deal_test_users(test, train, owners, 2))
    b = owners_of(nat.deal_test_users(users_records(names + test_only[1:]), train, owners, 2))
    assert all(a[u] == b[u] for u in names + test_only[1:])
    assert all(a[u] == owners_of(train)[u] for u in names)


# -- end to end: build.prepare under owner-side DP-SGD --------------------------------------------
DECLARED = {
    "public.users": 40,
    "public.owner_capacity": 40,
    "public.records_per_user": 9,
    "partition.num_owners": 4,
    "dataset.name": "memory",
    "dataset.classes": CLASSES,
    "dataset.input_shape": [3],
    "dataset.test_fraction": 0.3,
    "method": "full_dp",
    "privacy.placement": "local_dpsgd",
    "privacy.noise_multiplier": 1.5,
    "train.rounds": 1,
    "train.batch_size": 4,
    "privacy.epsilon": 4.0,
    "progress": False,
    "seed": 11,
}


def prepared_users(names: list, over: dict) -> dict:
    """Each user's (owner id, training records) in the prepared federation, by user key."""
    r = users_records(names, per_user=9)
    if over.get("partition.owner_rule") == "given":
        r = r.with_owner(np.array([int(u[1:]) % 4 for u in r.user], dtype=np.int64))
    p = build.prepare(config_from_overrides({**DECLARED, **over}), records=r)
    f = p.fed
    owner = f.owner_ids[f.user_owner]
    return {
        int(k): (int(owner[i]), f.x[f.user_offsets[i] : f.user_offsets[i + 1]].tolist())
        for i, k in enumerate(f.user_ids)
    }


@pytest.mark.parametrize("rule", ["random", "dirichlet", "given"])
def test_prepared_neighbours_keep_every_other_users_owner_and_records(rule, monkeypatch):
    names = [f"w{i}" for i in range(30)]
    over = {"partition.owner_rule": rule}
    base = prepared_users(names, over)
    keys = dict(zip(names, owner_rules.user_keys(np.array(names)).tolist()))
    for nb in (names[1:], [u for u in names if u != "w17"], names + ["w31"]):
        other = prepared_users(nb, over)
        common = [keys[u] for u in names if u in nb]
        assert len(common) == len(other) - (len(nb) > len(names))
        assert all(other[k] == base[k] for k in common)
    if rule in TWINS:
        monkeypatch.setattr(owner_rules, TWINS[rule][0], TWINS[rule][1])
        twin, other = prepared_users(names, over), prepared_users(names[1:], over)
        assert sum(other[k][0] != twin[k][0] for k in (keys[u] for u in names[1:])) > 3


def test_a_planned_federations_neighbour_keeps_every_owner():
    """The planned federation (``partition_pool``) draws its users from public numbers and the
    seed, before any neighbour exists; its neighbour is ``Federation.without_user``, which keeps
    every other user's owner and identity (nothing is dealt again)."""
    from fedudp.data import federation as federation_mod

    pool = federation_mod.synthetic(4, CLASSES, 400, 40, 1.0, 0)
    fed = federation_mod.partition_pool(
        pool, num_owners=4, num_records=120, records_per_user=3, scheme="iid", seed=0
    )
    for u in (0, 5, fed.num_users - 1):
        less = fed.without_user(u)
        keep = np.delete(np.arange(fed.num_users), u)
        assert np.array_equal(less.user_ids, fed.user_ids[keep])
        assert np.array_equal(less.owner_ids[less.user_owner], fed.owner_ids[fed.user_owner][keep])
