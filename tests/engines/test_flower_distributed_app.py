"""Distributed DP inside a user's own Flower app (issue 51): ``UserLevelDP`` around a
``DdgAggregator`` and ``user_level_mod`` carry the same integer vectors as fedudp's own engines,
in this process over ``test_flower_secure``'s ``LocalGrid`` (Flower's own ``Strategy.start``).

* The strategy receives only uint64 masked shares of the padded length (twin: the central
  wrapper's float sums, flagged by the same check).
* The released mean is the estimator's release on the shares the strategy received, and it is
  the decoding of the survivors' *unmasked* messages, re-derived here from the users' known
  updates with ``encode_owner`` on the streams keyed by (round, user) and (round, position):
  the masks cancel, a dropped client's masks removed by the survivors' reveals (twin: a
  strategy that skips the reveal and sums the survivors as if the roster were theirs: garbage,
  caught).
* A dropped client: the round is accounted at its survivors, the ledger's event says so (twin:
  every asked client accounted as a survivor, caught); unmasking impossible (a survivor that
  does not reveal, or no reveals at all) withholds the round and spends nothing.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg
from test_flower_secure import App, LocalGrid, arrays_of, server_identity  # noqa: F401

import fedudp.flower.distributed as distributed_module
from fedudp.aggregators import DdgAggregator, GaussianAggregator, Sampling
from fedudp.flower import K_CONTRIB, K_DP, UserLevelDP, sampled_users, user_level_mod
from fedudp.flower.secure_mod import K_REVEAL_ASK
from fedudp.flower.wire import K_SECURE, records_to_reveals
from fedudp.privacy.distributed import rounded_l2_bound
from fedudp.protocol.contributions import Contribution, MaskedShare
from fedudp.randomness import Purpose, Randomness
from fedudp.secure.encoding import SecureEncoding, decode_sum, encode_owner, reduce_mod
from fedudp.secure.public import round_signs
from fedudp.secure.rotation import padded_dim

CLIENTS, PER = 3, 4  # LocalGrid's: node 100 + p holds users 4p .. 4p + 3
N, RATE, CLIP, SEED, DIM, BITS = CLIENTS * PER, 0.5, 0.5, 11, 48, 20
SCALE, STD = 2000.0, 0.05  # declared (the test's numbers: no calibration, fast)


def aggregator(cls=DdgAggregator, min_owners: int = 2) -> DdgAggregator:
    enc = SecureEncoding(
        noise="ddgauss",
        clip=CLIP,
        scale=SCALE,
        bits=BITS,
        beta=float(np.exp(-0.5)),
        local_std=STD,
        dim=DIM,
        rounded_bound=rounded_l2_bound(CLIP * SCALE, float(np.exp(-0.5)), padded_dim(DIM)),
    )
    return cls(enc, Sampling(RATE, N), min_owners, CLIENTS, SEED, STD)


def dropping(node: int, in_round: int, reveal_fails: int | None = None):
    """The mod, with client ``node`` failing round ``in_round``'s training (and client
    ``reveal_fails`` refusing to reveal)."""
    mod = user_level_mod(users_per_client=PER)

    def chain(msg, context, call_next):
        if K_REVEAL_ASK in msg.content and context.node_id == reveal_fails:
            return Message(RecordDict(), reply_to=msg)  # no seeds
        if (
            "config" in msg.content
            and context.node_id == node
            and int(msg.content["config"]["server-round"]) == in_round
        ):
            return Message(RecordDict(), reply_to=msg)  # dropped: nothing sent
        return mod(msg, context, call_next)

    return chain


def run(agg=None, mod=None, rounds: int = 2, **kw):
    """``rounds`` rounds; (strategy, grid, {round: the released mean})."""
    agg = aggregator() if agg is None else agg
    grid = LocalGrid(mod or user_level_mod(users_per_client=PER), App(), {})
    s = UserLevelDP(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
        agg,
        delta=1e-5,
        seed=SEED,
        randomness=kw.pop("randomness", "seeded"),
        min_owners=kw.pop("min_owners", 2),
        **kw,
    )
    released: dict[int, np.ndarray] = {}
    inner = agg.release

    def recording(c, *, rng=None):
        out = inner(c, rng=rng)
        released[int(c.round_) if c.round_ is not None else len(released) + 1] = (
            out.mean.numpy().copy()
        )
        return out

    agg.release = recording  # type: ignore[method-assign]
    init = arrays_of({"w": np.zeros(DIM, np.float32)})
    s.start(grid=grid, initial_arrays=init, num_rounds=rounds, train_config=ConfigRecord({}))
    return s, grid, released


def train_replies(grid: LocalGrid, round_: int) -> list[Message]:
    return [
        r
        for m, r in zip(grid.sent, grid.replies)
        if K_DP in m.content and int(m.content[K_DP]["round"]) == round_
    ]


def only_masked_shares(grid: LocalGrid, padded: int) -> bool:
    """Every array the strategy received in a training reply is a uint64 share of ``padded``
    values, in ``K_CONTRIB['share']``."""
    for m, r in zip(grid.sent, grid.replies):
        if m.metadata.message_type != "train" or r.has_error() or not r.content.array_records:
            continue
        for key, rec in r.content.array_records.items():
            for name, arr in rec.items():
                a = arr.numpy()
                if (key, name) != (K_CONTRIB, "share") or a.dtype != np.uint64:
                    return False
                if a.shape != (padded,):
                    return False
    return True


def test_the_strategy_receives_only_masked_uint64_shares():
    agg = aggregator()
    _, grid, released = run(agg, rounds=1)
    assert len(released) == 1 and len(train_replies(grid, 1)) == CLIENTS
    assert only_masked_shares(grid, agg.encoding.padded)
    # twin: the central wrapper (clip + Gaussian) sends float sums; the same check flags it
    central = GaussianAggregator(CLIP, 1.0, Sampling(RATE, N))
    _, grid_c, _ = run(central, rounds=1, randomness="seeded", min_owners=1)
    assert not only_masked_shares(grid_c, agg.encoding.padded)


def the_survivors_unmasked_decoding(
    grid: LocalGrid, round_: int, enc: SecureEncoding, without: set[int] = frozenset()
):
    """The release re-derived without any mask: each surviving client's users' updates (App's
    rule, at the broadcast this round sent) encoded by ``encode_owner`` on the streams keyed
    by (round, user) and (round, its position), summed mod 2^bits, decoded, divided by q N."""
    rand = Randomness.seeded(SEED)
    roster = sorted(grid.contexts)
    live = {
        int(r.metadata.src_node_id) for r in train_replies(grid, round_) if K_SECURE in r.content
    }
    sent = next(
        m for m in grid.sent if K_DP in m.content and int(m.content[K_DP]["round"]) == round_
    )
    w = next(iter(sent.content.array_records.values()))["w"].numpy()
    total = np.zeros(enc.padded, dtype=np.int64)
    for j, node in enumerate(roster):
        if node not in live or node in without:
            continue
        p = node - 100
        users = sampled_users(range(p * PER, (p + 1) * PER), SEED, round_, RATE, N)
        rows = (
            np.stack(
                [
                    (w + np.float32((u + 1) / 100)).astype(np.float64) - w.astype(np.float64)
                    for u in users
                ]
            )
            if users
            else np.zeros((0, DIM))
        )
        total += encode_owner(
            rows,
            enc,
            round_signs(SEED, round_, enc.padded),
            [rand.numpy_rng(Purpose.ROUNDING, round_, u) for u in users],
            rand.numpy_rng(Purpose.SHARE_NOISE, round_, j),
            reduced=False,
        )
    return decode_sum(reduce_mod(total, enc.bits), enc, round_signs(SEED, round_, enc.padded)) / (
        RATE * N
    )


def the_estimators_release_on_the_received_shares(grid: LocalGrid, round_: int) -> np.ndarray:
    """A fresh estimator's release of the shares (and reveals) the strategy received."""
    roster = sorted(grid.contexts)
    shares = tuple(
        MaskedShare(
            roster.index(int(r.metadata.src_node_id)), r.content[K_CONTRIB]["share"].numpy()
        )
        for r in train_replies(grid, round_)
        if K_SECURE in r.content
    )
    reveals = tuple(
        rv
        for m, r in zip(grid.sent, grid.replies)
        if K_REVEAL_ASK in m.content and m.metadata.group_id == str(round_)
        for rv in records_to_reveals(r.content)
    )
    c = Contribution(
        None, None, 0, shares=shares, roster=tuple(range(CLIENTS)), reveals=reveals, round_=round_
    )
    return aggregator().release(c).mean.numpy()


def matches(released: dict, grid: LocalGrid) -> bool:
    enc = aggregator().encoding
    return all(
        np.array_equal(mean, the_estimators_release_on_the_received_shares(grid, r))
        and np.array_equal(mean, the_survivors_unmasked_decoding(grid, r, enc))
        for r, mean in released.items()
    )


def test_a_dropped_client_is_unmasked_by_the_survivors_reveals_exactly():
    s, grid, released = run(mod=dropping(node=101, in_round=2))
    assert sorted(released) == [1, 2]
    asks = [m for m in grid.sent if K_REVEAL_ASK in m.content]
    assert sorted(m.metadata.dst_node_id for m in asks) == [100, 102]  # round 2's survivors
    assert all(m.metadata.group_id == "2" for m in asks)
    assert matches(released, grid)
    assert np.abs(released[2]).max() < 1.0  # the clipped mean plus small noise


def test_a_flower_client_app_routes_the_reveal_through_its_mods():
    """The same dropout through Flower's own ``ClientApp(mods=[user_level_mod(...)])`` with a
    registered ``train`` function only: the reveal reaches the mod."""
    from flwr.clientapp import ClientApp

    fake = App()
    client_app = ClientApp(mods=[dropping(node=101, in_round=2)])
    client_app.train()(fake)
    s, grid, released = run(mod=lambda msg, ctx, _app: client_app(msg, ctx))
    assert sorted(released) == [1, 2] and accounted_events(s) == [3, 2]
    assert matches(released, grid)


class SkipsTheReveal(DdgAggregator):
    """Weakened twin: the dropped client's masks are never removed; the survivors' shares are
    summed as if the roster were theirs alone."""

    def release(self, c, *, rng=None):
        mine = tuple(sorted(x.owner for x in c.shares))
        return super().release(
            Contribution(None, None, c.count, shares=c.shares, roster=mine, round_=c.round_),
            rng=rng,
        )


def test_twin_skipping_the_reveal_releases_garbage_and_is_caught():
    s, grid, released = run(aggregator(SkipsTheReveal), mod=dropping(node=101, in_round=2))
    assert sorted(released) == [1, 2]
    assert not matches(released, grid)
    assert matches({1: released[1]}, grid)  # round 1 (nobody dropped) is still right


def accounted_events(s: UserLevelDP) -> list[int]:
    return [int(re.search(r"owners=(\d+)", e.event).group(1)) for e in s.ledger.entries]


def test_a_dropped_round_is_accounted_at_its_survivors(monkeypatch):
    s, _, _ = run(mod=dropping(node=101, in_round=2))
    assert accounted_events(s) == [3, 2]
    assert s.ledger.to_dict()["trust"] == "server: untrusted (secure aggregation)"
    agg = s.aggregator
    assert [e.event for e in s.ledger.entries] == [
        str(agg.dp_event_for(3)),
        str(agg.dp_event_for(2)),
    ]
    # twin: every asked client accounted as a survivor (a smaller, wrong epsilon)
    monkeypatch.setattr(distributed_module, "survivor_count", lambda survivors, roster: len(roster))
    twin, _, _ = run(mod=dropping(node=101, in_round=2))
    assert accounted_events(twin) == [3, 3] != accounted_events(s)
    assert twin.epsilon < s.epsilon


def test_unmasking_impossible_withholds_the_round_and_spends_nothing(monkeypatch):
    # client 100 drops in round 2 and client 102 refuses to reveal: one survivor < min_owners
    s, grid, released = run(mod=dropping(node=100, in_round=2, reveal_fails=102))
    assert sorted(released) == [1] and [r for r, _ in s.withheld] == [2]
    assert len(s.ledger.entries) == 1
    # no reveals at all: the estimator cannot unmask, the round is withheld (fail closed)
    monkeypatch.setattr(distributed_module.SecureRounds, "reveal", lambda self, *a: [])
    s2, _, released2 = run(mod=dropping(node=101, in_round=2))
    assert sorted(released2) == [1] and len(s2.ledger.entries) == 1
    assert "cannot be unmasked" in s2.withheld[0][1]


def test_a_malformed_share_fails_its_client_alone():
    mod = user_level_mod(users_per_client=PER)

    def floats(msg, context, call_next):
        out = mod(msg, context, call_next)
        if msg.metadata.message_type == "train" and context.node_id == 102:
            share = out.content[K_CONTRIB]["share"].numpy()
            out.content[K_CONTRIB] = arrays_of({"share": share.astype(np.float64)})
        return out

    s, grid, released = run(mod=floats, rounds=1)
    assert sorted(released) == [1] and accounted_events(s) == [2]  # 100 and 101 survive
    assert [m.metadata.dst_node_id for m in grid.sent if K_REVEAL_ASK in m.content] == [100, 101]
    # 102's (float) share is not in the sum and its masks were removed by the reveals: the
    # release is the two survivors' unmasked decoding
    enc = aggregator().encoding
    np.testing.assert_array_equal(
        released[1], the_survivors_unmasked_decoding(grid, 1, enc, without={102})
    )


def test_setups_a_distributed_round_refuses_are_one_line_errors():
    fed = FedAvg()
    with pytest.raises(ValueError, match="key agreement") as e:
        UserLevelDP(fed, aggregator(), delta=1e-5, seed=SEED, min_owners=2)  # secure default
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="rotation is keyed by seed=11"):
        UserLevelDP(fed, aggregator(), delta=1e-5, seed=3, randomness="seeded", min_owners=2)
    with pytest.raises(ValueError, match="pass min_owners=2"):
        UserLevelDP(fed, aggregator(), delta=1e-5, seed=SEED, randomness="seeded")
    with pytest.raises(ValueError, match="encoding is for dim=48"):
        grid = LocalGrid(user_level_mod(users_per_client=PER), App(), {})
        s = UserLevelDP(
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
            aggregator(),
            delta=1e-5,
            seed=SEED,
            randomness="seeded",
            min_owners=2,
        )
        s.start(grid=grid, initial_arrays=arrays_of({"w": np.zeros(10, np.float32)}), num_rounds=1)


def test_a_client_refuses_a_reveal_of_itself_or_from_outside_the_roster():
    from flwr.app import Context

    from fedudp.flower.secure_mod import reveal_reply, roster_bytes
    from fedudp.flower.wire import K_REVEAL

    def ask(node: int, dropped: list[int]) -> Message:
        rec = ConfigRecord(
            {
                "round": 1,
                "roster": roster_bytes([100, 101, 102]),
                "dropped": np.asarray(dropped, dtype=np.int64).tobytes(),
                "seed": SEED,
            }
        )
        msg = Message(RecordDict({K_REVEAL_ASK: rec}), dst_node_id=node, message_type="train")
        ctx = Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})
        return reveal_reply(msg, ctx)

    ok = ask(100, [1])
    assert not ok.has_error() and [r.dropped for r in records_to_reveals(ok.content)] == [1]
    assert K_REVEAL in ok.content
    assert ask(100, [0]).has_error()  # its own masks: never revealed
    assert ask(100, [3]).has_error()  # outside the roster
    assert ask(999, [1]).has_error()  # not in the roster


def run_config(**extra) -> dict:
    """A distributed app's run config (Flower's ``[tool.flwr.app.config]``)."""
    return {
        "fedudp.privacy.epsilon": 8.0,
        "fedudp.privacy.delta": 1e-5,
        "fedudp.public.users": N,
        "num-server-rounds": 2,
        "fedudp.train.sampling_rate": RATE,
        "fedudp.privacy.clip": CLIP,
        "fedudp.aggregator": "ddgauss",
        "fedudp.privacy.placement": "distributed",
        "fedudp.privacy.randomness": "seeded",
        "fedudp.seed": SEED,
        "fedudp.train.min_owners": 2,
        "fedudp.clients": CLIENTS,
        "fedudp.estimator.bits": 20,
        **extra,
    }


@pytest.mark.parametrize("noise", ["ddgauss", "skellam"])
def test_from_run_config_builds_the_distributed_estimator_of_the_declared_numbers(noise):
    """The run config's estimator is the one ``calibrated`` gives for the declared ε, δ, T,
    q, N, clip, bits, survivors and clients (so the contract's keys reach it), and a run with
    it releases exactly the estimator's release of the masked shares it received."""
    from fedudp.aggregators import SkellamAggregator

    cls = DdgAggregator if noise == "ddgauss" else SkellamAggregator
    init = arrays_of({"w": np.zeros(DIM, np.float32)})
    s = UserLevelDP.from_run_config(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
        run_config(**{"fedudp.aggregator": noise}),
        init,
    )
    want = cls.calibrated(
        clip=CLIP,
        epsilon=8.0,
        delta=1e-5,
        rounds=2,
        sampling=Sampling(RATE, N),
        dim=DIM,
        min_owners=2,
        owner_units=[N] * CLIENTS,
        seed=SEED,
        bits=20,
    )
    got = s.aggregator
    assert type(got) is cls and got.encoding == want.encoding
    assert (got.min_owners, got.owners) == (2, CLIENTS)
    # twin: the default number of owners (64) would give another heuristic scale
    other = cls.calibrated(
        clip=CLIP,
        epsilon=8.0,
        delta=1e-5,
        rounds=2,
        sampling=Sampling(RATE, N),
        dim=DIM,
        min_owners=2,
        owner_units=[N] * 64,
        seed=SEED,
        bits=20,
    )
    assert other.encoding.scale != got.encoding.scale
    _, grid, released = run(got, rounds=1)
    assert only_masked_shares(grid, padded_dim(DIM)) and released
    for r, mean in released.items():
        assert np.array_equal(mean, the_survivors_unmasked_decoding(grid, r, got.encoding))


@pytest.mark.parametrize(
    ("drop", "override", "key"),
    [
        ("fedudp.clients", {}, "fedudp.clients"),
        ("fedudp.privacy.randomness", {}, "fedudp.privacy.randomness"),
        ("fedudp.privacy.placement", {}, "fedudp.aggregator"),
        (None, {"fedudp.train.min_owners": 1}, "fedudp.train.min_owners"),
    ],
)
def test_from_run_config_refuses_an_incomplete_distributed_config_naming_the_key(
    drop, override, key
):
    rc = {**run_config(), **override}
    if drop:
        del rc[drop]
    init = arrays_of({"w": np.zeros(DIM, np.float32)})
    with pytest.raises(ValueError) as err:
        UserLevelDP.from_run_config(FedAvg(), rc, init)
    text = str(err.value)
    assert key in text and "\n" not in text, text
