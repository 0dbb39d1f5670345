"""``privacy.placement=distributed`` on the local engine (issue 51,
docs/algorithms.md#distributed-dp-under-secure-aggregation).

What the billboard's code receives is only masked shares; a neighbour without one user changes
the decoded integer sum by that user's own rounded vector and nothing else (every other user's
rounding and every noise share are keyed by public ids); simulated dropouts fail closed below
``train.min_owners`` and each released round is accounted at its survivors, with the ε
recomputed from the ledger's literal constants. Weakened twins: rounding streams keyed by the
row's position (the neighbour moves other users' rounding), an accountant that reads every
owner as a survivor, shares calibrated for every owner while some drop.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedudp import build
from fedudp.aggregators import DdgAggregator, Sampling, SkellamAggregator
from fedudp.config import ConfigError, config_from_overrides
from fedudp.engines.local import LocalTransport
from fedudp.owner import secure_reply as secure_reply_module
from fedudp.privacy.distributed import DistributedDpEvent, distributed_event
from fedudp.protocol.contributions import Contribution
from fedudp.run import execute
from fedudp.randomness import Purpose
from fedudp.secure.encoding import decode_sum, encode_owner
from fedudp.secure.masks import SecureSum, centered
from fedudp.secure.public import round_signs

BASE = {
    "progress": False,
    "method": "joint_dp",
    "privacy.placement": "distributed",
    "dataset.num_records": 120,
    "dataset.pool_train": 1000,
    "dataset.pool_test": 200,
    "dataset.features": 12,
    "partition.num_owners": 6,
    "partition.records_per_user": 5,
    "train.rounds": 2,
    "train.min_owners": 2,
    "train.batch_size": 5,
    "privacy.epsilon": 4.0,
    "seed": 3,
    "tracking.kind": "none",
}


def prepared(**over):
    return build.prepare(config_from_overrides({**BASE, **over}))


def unmasked_sum(c: Contribution, bits: int, padded: int) -> np.ndarray:
    """The decoded-domain integer sum of a contribution's shares (what the estimator decodes)."""
    s = SecureSum(bits, padded)
    for share in c.shares:
        s.add(share.owner, share.vector)
    seeds = {(r.survivor, r.dropped): r.seed for r in c.reveals}
    dropped = sorted(set(c.roster) - {x.owner for x in c.shares})
    total = s.unmask(dropped, [x.owner for x in c.shares], lambda a, b: seeds[(a, b)], c.round_)
    return centered(total, bits)


def one_round(p, fed, round_=1, dropout=0.0):
    t = LocalTransport(p.owners, fed, p.aggregator.constraint, dropout, p.cfg.seed)
    shared = p.billboard.shared_params()
    cohort = np.arange(fed.num_users)
    return t.train(shared, cohort, round_)


def test_the_billboard_receives_only_masked_shares_and_decodes_their_sum():
    p = prepared()
    got = one_round(p, p.fed)
    (rep,) = got.replies
    c = rep.contribution
    assert c.rows is None and c.total is None  # no vector in the clear
    assert c.count == c.clipped == rep.failed == 0 and not rep.raised  # and no count of users
    assert len(c.shares) == p.fed.num_owners and c.roster == tuple(range(p.fed.num_owners))
    enc = p.aggregator.encoding
    # each share alone is not the owner's encoded message: the masks do not cancel in one
    for share in c.shares:
        alone = SecureSum(enc.bits, enc.padded)
        alone.add(share.owner, share.vector)
        assert not np.array_equal(
            centered(alone.unmask([], [share.owner], None, 1), enc.bits),
            unmasked_sum(c, enc.bits, enc.padded),
        )
    # the decoded sum is the clipped users' sum plus noise: close to it at this noise
    dec = decode_sum(
        (unmasked_sum(c, enc.bits, enc.padded) % (1 << enc.bits)).astype(np.uint64),
        enc,
        round_signs(p.cfg.seed, 1, enc.padded),
    )
    assert dec.shape == (p.owners.shared_dim,) and np.isfinite(dec).all()


def neighbour_difference(p) -> np.ndarray:
    """The integer sum of the federation's shares less that of its neighbour without user 5."""
    enc = p.aggregator.encoding
    a = unmasked_sum(one_round(p, p.fed).replies[0].contribution, enc.bits, enc.padded)
    b = unmasked_sum(
        one_round(p, p.fed.without_user(5)).replies[0].contribution, enc.bits, enc.padded
    )
    return a - b


def user5_alone(p) -> np.ndarray:
    """User 5's own rounded vector, on its own stream, without noise: what it adds."""
    enc = p.aggregator.encoding
    shared = p.billboard.shared_params()
    personal = p.owners.initial_personal(p.fed.num_owners)
    ((_, row),) = list(p.owners.user_vectors(p.fed, shared, personal, np.array([5]), 1))
    rand = secure_reply_module.owner_randomness(p.owners)
    uid = int(p.fed.user_ids[5])
    return encode_owner(
        row.to(torch.float64).numpy(),
        replace(enc, local_std=0.0),
        round_signs(p.cfg.seed, 1, enc.padded),
        [rand.numpy_rng(Purpose.ROUNDING, 1, uid)],
        rand.numpy_rng(Purpose.SHARE_NOISE, 1, 0),
        reduced=False,
    )


def test_a_neighbour_moves_the_sum_by_its_own_rounded_vector_only():
    """Every noise share and every other user's rounding are as they were: the neighbour's
    integer sum differs by user 5's own rounded vector exactly, within the accounted bound."""
    p = prepared()
    diff = neighbour_difference(p)
    np.testing.assert_array_equal(diff, user5_alone(p))
    assert 0 < np.linalg.norm(diff.astype(np.float64)) <= p.aggregator.encoding.rounded_bound


def test_twin_rounding_keyed_by_position_is_caught(monkeypatch):
    """A twin that keys each user's rounding stream by its row position: removing user 5
    re-deals the streams of the users after it, and the sums differ by more than user 5's own
    rounded vector."""
    p = prepared()
    expected = user5_alone(p)
    real = secure_reply_module.Randomness.numpy_rng
    calls = {"n": 0}

    def by_position(self, purpose, *keys):
        if purpose == Purpose.ROUNDING:
            calls["n"] += 1
            return real(self, purpose, keys[0], calls["n"] % 7)
        return real(self, purpose, *keys)

    monkeypatch.setattr(secure_reply_module.Randomness, "numpy_rng", by_position)
    assert not np.array_equal(neighbour_difference(p), expected)


def test_dropouts_fail_closed_and_rounds_are_accounted_at_their_survivors(tmp_path):
    p = prepared(**{"train.owner_dropout": 0.4, "train.min_owners": 4, "train.rounds": 6})
    res = execute(p)
    hist = res.history
    entries = p.ledger.entries
    released = [h for h in hist if "withheld" not in h]
    withheld = [h for h in hist if "withheld" in h]
    assert withheld and released  # some rounds fell below 4 survivors, some did not
    assert all(6 - h["failed_owners"] < 4 for h in withheld)
    assert [e.round for e in entries] == [h["round"] for h in released]
    # each release's event: its survivors, recomputed with literal constants
    agg = p.aggregator
    curves = []
    for e, h in zip(entries, released):
        ev = distributed_event(
            "ddgauss",
            clip=float(p.cfg.privacy.clip),
            local_std=agg.accounted_std,
            scale=agg.encoding.scale,
            beta=math.exp(-0.5),
            dim=agg.encoding.padded,
            owners=6 - h["failed_owners"],
            rate=1.0,
        )
        assert e.event == str(ev)
        curves.append(ev.rdp())
    from fedudp.privacy.distributed import RDP_ORDERS, rdp_epsilon

    eps = rdp_epsilon(RDP_ORDERS, np.sum(curves, axis=0), float(p.cfg.privacy.delta))
    assert entries[-1].epsilon == pytest.approx(eps, rel=1e-12)
    assert entries[-1].epsilon <= p.cfg.privacy.epsilon * (1 + 1e-9)


def test_twin_accounting_every_owner_as_a_survivor_is_caught(monkeypatch):
    p = prepared(**{"train.owner_dropout": 0.4, "train.min_owners": 2, "train.rounds": 3})
    real = DdgAggregator.dp_event_for
    monkeypatch.setattr(DdgAggregator, "dp_event_for", lambda self, n: real(self, self.owners))
    res = execute(p)
    released = [h for h in res.history if "withheld" not in h]
    dropped = [h for h in released if h["failed_owners"]]
    assert dropped  # a round with a dropout was released
    owners_in_ledger = [int(e.event.split("owners=")[1].split(",")[0]) for e in p.ledger.entries]
    assert owners_in_ledger != [6 - h["failed_owners"] for h in released]


@pytest.mark.parametrize("cls", [DdgAggregator, SkellamAggregator])
def test_shares_are_calibrated_for_the_declared_minimum_of_survivors(cls):
    """Every round at the minimum of survivors meets the target; a twin calibrated for every
    owner (while only the minimum survive) exceeds it."""
    kw = dict(
        clip=1.0,
        epsilon=2.0,
        delta=1e-5,
        rounds=5,
        sampling=Sampling(0.5, 40),
        dim=300,
        owner_units=[10, 10, 10, 10],
        seed=0,
        bits=18,
    )
    real = cls.calibrated(min_owners=2, **kw)
    twin = cls.calibrated(min_owners=4, **kw)

    def eps(agg):
        return agg.dp_event_for(2).epsilon(1e-5, count=5)

    assert eps(real) <= 2.0 * (1 + 1e-6)
    assert eps(twin) > 2.0 * 1.05


def test_bad_settings_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="train.min_owners"):
        prepared(**{"train.min_owners": 1})
    with pytest.raises(ConfigError, match="aggregator"):
        prepared(**{"privacy.placement": "server", "aggregator": "ddgauss"})
    with pytest.raises(ConfigError, match="estimator.bits"):
        prepared(**{"estimator.bits": 3})
    with pytest.raises(ConfigError, match="train.owner_dropout"):
        prepared(**{"train.owner_dropout": 1.0})
    with pytest.raises(ConfigError, match=r"^estimator.scale: .*2\^52"):
        prepared(**{"estimator.scale": 1e20})
    with pytest.raises(ConfigError, match="^estimator.rounding_beta"):
        prepared(**{"estimator.rounding_beta": 1.5})
    with pytest.raises(ConfigError, match="privacy.randomness"):
        prepared(**{"engine": "flower", "privacy.randomness": "secure"})


def test_a_user_whose_step_raises_is_dropped_alone(monkeypatch):
    """The shares with a raising user 5 equal the neighbour's without it (its step contributes
    nothing, every other user and share as they were), and it is counted as raised."""
    from fedudp.owner.owners import Owners

    p = prepared()
    enc = p.aggregator.encoding
    uid = int(p.fed.user_ids[5])
    without = one_round(p, p.fed.without_user(5)).replies[0].contribution
    honest = Owners.user_vectors

    def user_vectors(self, fed, shared, personal, users, round_, *rest):
        if uid in set(int(u) for u in fed.user_ids[np.asarray(users, dtype=np.int64)]):
            raise RuntimeError("injected: the user's training step raised")
        return honest(self, fed, shared, personal, users, round_, *rest)

    monkeypatch.setattr(Owners, "user_vectors", user_vectors)
    got = one_round(p, p.fed)
    (rep,) = got.replies
    np.testing.assert_array_equal(
        unmasked_sum(rep.contribution, enc.bits, enc.padded),
        unmasked_sum(without, enc.bits, enc.padded),
    )
    # counted by the simulator, never told the billboard (a count of users is data to it)
    assert got.observed["sim_raised_users"] == 1 and rep.failed == 0 and not rep.raised


def test_a_user_with_a_non_finite_vector_contributes_nothing(monkeypatch):
    from fedudp.owner.owners import Owners

    p = prepared()
    enc = p.aggregator.encoding
    uid = int(p.fed.user_ids[5])
    without = one_round(p, p.fed.without_user(5)).replies[0].contribution
    honest = Owners.user_vectors

    def user_vectors(self, fed, shared, personal, users, round_, *rest):
        for us, G in honest(self, fed, shared, personal, users, round_, *rest):
            G = G.clone()
            G[torch.from_numpy(fed.user_ids[us] == uid)] = float("nan")
            yield us, G

    monkeypatch.setattr(Owners, "user_vectors", user_vectors)
    got = one_round(p, p.fed)
    (rep,) = got.replies
    np.testing.assert_array_equal(
        unmasked_sum(rep.contribution, enc.bits, enc.padded),
        unmasked_sum(without, enc.bits, enc.padded),
    )
    assert got.observed["sim_nonfinite_users"] == 1 and rep.failed == 0


def test_the_ledger_file_recomputes_the_runs_epsilon(tmp_path):
    """``ledger.jsonl``'s events read back (``parse_event``) compose to the run's ε exactly."""
    from fedudp.privacy.ledger_epsilon import epsilon_of_ledger, parse_event
    from fedudp.protocol import ledger_file
    from fedudp.run import run

    cfg = config_from_overrides({**BASE, "train.owner_dropout": 0.3, "train.rounds": 3})
    s = run(cfg, tmp_path)
    head, entries = ledger_file.read(tmp_path / "ledger.jsonl")
    assert entries and all(isinstance(parse_event(e.event), DistributedDpEvent) for e in entries)
    assert epsilon_of_ledger(head, entries) == s["epsilon"]


def test_the_owners_sample_their_users_not_the_billboard(monkeypatch):
    """At q = 1/2 the billboard asks every user (it learns nobody's coin), each user's coin is
    its own (a neighbour still moves the sum by its own rounded vector or by nothing), and
    about half the users enter; a twin that samples on the billboard is caught."""
    from fedudp.secure.public import owner_sample

    p = prepared(**{"train.sampling_rate": 0.5})

    def billboard_asks_everyone(bb) -> bool:
        return bool(bb.sample(1).all()) and bool(bb.sample(2).all())

    assert billboard_asks_everyone(p.billboard)
    rand = secure_reply_module.owner_randomness(p.owners)
    coins = owner_sample(p.fed.user_ids, 0.5, rand, 1)
    assert 0 < coins.sum() < len(coins)
    got = one_round(p, p.fed)
    assert got.observed["sim_sampled_users"] == int(coins.sum())
    assert got.replies[0].contribution.count == 0  # the billboard is told no count
    expected = user5_alone(p) if coins[5] else 0
    np.testing.assert_array_equal(neighbour_difference(p), expected)
    monkeypatch.setattr(DdgAggregator, "samples_on_owners", False)
    assert not billboard_asks_everyone(prepared(**{"train.sampling_rate": 0.5}).billboard)


def test_owners_encode_one_step_users_from_the_batched_kernel_as_the_loop_would():
    """The owners' users of one SGD step take the batched one-step kernel (as the server
    placement's clipped sum does): their vectors equal the per-user path's up to float
    rounding, and the distributed round calls it."""
    from fedudp.owner.owners import Owners

    p = prepared()
    shared = p.billboard.shared_params()
    personal = p.owners.initial_personal(p.fed.num_owners)
    users = np.arange(p.fed.num_users)
    fast = p.owners._one_step_users(p.fed, users, vectors=True)
    assert fast is not None and fast.all()  # 5 records, batch 5, one epoch
    got = dict(
        (int(u), g)
        for us, G in p.owners.user_vectors(p.fed, shared, personal, users, 1, one_step=True)
        for u, g in zip(us, G)
    )
    want = dict(
        (int(u), g)
        for us, G in p.owners.user_vectors(p.fed, shared, personal, users, 1)
        for u, g in zip(us, G)
    )
    assert set(got) == set(want) == set(users.tolist())
    for u in want:
        torch.testing.assert_close(got[u], want[u], rtol=1e-5, atol=1e-6)
    calls = []
    chunks = Owners._one_step_chunks

    def spy(self, *a, **k):
        calls.append(1)
        return chunks(self, *a, **k)

    orig = Owners._one_step_chunks
    Owners._one_step_chunks = spy  # type: ignore[method-assign]
    try:
        one_round(p, p.fed)
    finally:
        Owners._one_step_chunks = orig  # type: ignore[method-assign]
    assert calls
