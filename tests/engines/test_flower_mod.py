"""``fedudp.flower.user_level_mod`` called directly (no simulation): what each user's training
step starts from, what the client keeps, what it sends.

* every sampled user's update starts from the broadcast, personal layers included (the
  server's initial, public values), never from the client's own personal layers, so that a
  user's update depends only on the broadcast and that user's records;
* the client's own personal layers are trained on all its users' records, in order, each user
  starting from the previous one's personal layers, kept in ``context.state``, never sent;
* evaluation messages get the client's own personal layers before the app evaluates;
* the reply is the clipped sum of the sampled users' shared updates and their count, nothing
  else; with ``users_of`` the declared indices are checked against the server's population."""

from __future__ import annotations

import time

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message.message import make_message

from fedudp.flower import K_CONTRIB, K_COUNTS, K_DP, K_PERSONAL, sampled_users, user_level_mod

NAMES = ("shared.w", "head.w")


def broadcast(step: int) -> dict[str, np.ndarray]:
    return {
        "shared.w": np.full(3, float(step), np.float32),
        "head.w": np.zeros(2, np.float32),
    }  # the server never moves the head


def arrays_of(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def server_message(content: RecordDict, kind: str) -> Message:
    """A message as a server sends it (outside a running app: explicit metadata, the way
    Flower's own mod tests build theirs)."""
    return make_message(
        Metadata(
            run_id=1,
            message_id=f"m{time.monotonic_ns()}",
            src_node_id=0,
            dst_node_id=1,
            reply_to_message_id="",
            group_id="1",
            created_at=time.time(),
            ttl=3600.0,
            message_type=kind,
        ),
        content,
    )


def train_message(arrays: dict, round_: int, rate: float, population: int, clip: float):
    return server_message(
        RecordDict(
            {
                "arrays": arrays_of(arrays),
                "config": ConfigRecord({"lr": 0.1}),
                K_DP: ConfigRecord(
                    {
                        "round": round_,
                        "seed": 5,
                        "randomness": "seeded",
                        "rate": rate,
                        "rows": False,
                        "clip": clip,
                        "population": population,
                        "personal": [""],
                    }
                ),
            }
        ),
        "train",
    )


class App:
    """A fake training step: user u moves every parameter by (u + 1) · 0.1 (the shared vector
    far beyond the clip for large u), and records what it started from."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, dict]] = []

    def __call__(self, msg: Message, context: Context) -> Message:
        u = int(context.node_config["partition-id"])
        got = {k: v.numpy().copy() for k, v in msg.content["arrays"].items()}
        self.calls.append((u, got, msg.metadata.message_type))
        if msg.metadata.message_type != "train":
            return Message(RecordDict({"metrics": MetricRecord({"ok": 1})}), reply_to=msg)
        out = {k: v + np.float32((u + 1) * 0.1) for k, v in got.items()}
        return Message(
            RecordDict({"arrays": arrays_of(out), "metrics": MetricRecord({"num-examples": 1})}),
            reply_to=msg,
        )


def context(partition: int, clients: int) -> Context:
    return Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": partition, "num-partitions": clients},
        state=RecordDict(),
        run_config={},
    )


def test_users_start_at_the_public_broadcast_and_the_client_keeps_its_own_head():
    mod = user_level_mod(users_per_client=4, personal=["head.*"])
    app, ctx = App(), context(partition=1, clients=3)  # users 4..7 of 12
    clip, rate = 0.25, 0.6
    for r in (1, 2):
        app.calls.clear()
        reply = mod(train_message(broadcast(r), r, rate, 12, clip), ctx, app)
        assert not reply.has_error()
        # the contribution, the counts and the app's own training metrics (its records here)
        assert set(reply.content.keys()) == {K_CONTRIB, K_COUNTS, "metrics"}
        sampled = sampled_users(range(4, 8), 5, r, rate, 12)
        # first the sampled users, each from the broadcast itself (public head: zeros)
        firsts = app.calls[: len(sampled)]
        assert [u for u, _, _ in firsts] == sampled
        for _, start, _ in firsts:
            assert np.array_equal(start["head.w"], np.zeros(2, np.float32))
            assert np.array_equal(start["shared.w"], broadcast(r)["shared.w"])
        # then every user of the client, in order, the head carried from one to the next
        chain = app.calls[len(sampled) :]
        assert [u for u, _, _ in chain] == [4, 5, 6, 7]
        for (u, start, _), prev in zip(chain[1:], chain[:-1]):
            assert np.allclose(start["head.w"], prev[1]["head.w"] + (prev[0] + 1) * 0.1)
            assert np.array_equal(start["shared.w"], broadcast(r)["shared.w"])
        kept = ctx.state[K_PERSONAL]
        assert list(kept.keys()) == ["head.w"]
        want = chain[-1][1]["head.w"] + 0.8  # user 7 moves it by 0.8
        assert np.allclose(kept["head.w"].numpy(), want)
        # the reply: the sampled users' shared updates ((u + 1) 0.1 on 3 coordinates), each
        # clipped to the clip, summed; their count
        total = sum(min(1.0, clip / ((u + 1) * 0.1 * np.sqrt(3))) * (u + 1) * 0.1 for u in sampled)
        got = reply.content[K_CONTRIB]["sum"].numpy()
        assert got.shape == (3,) and np.allclose(got, total, rtol=1e-6)
        assert int(reply.content[K_COUNTS]["count"]) == len(sampled)
    # the second round's chain started from the head the first round left
    assert not np.array_equal(chain[0][1]["head.w"], np.zeros(2, np.float32))


def test_evaluation_gets_the_clients_own_personal_layers():
    mod = user_level_mod(users_per_client=2, personal=["head.*"])
    app, ctx = App(), context(partition=0, clients=2)
    mod(train_message(broadcast(1), 1, 1.0, 4, 10.0), ctx, app)
    kept = ctx.state[K_PERSONAL]["head.w"].numpy().copy()
    assert np.allclose(kept, 0.1 + 0.2)  # users 0 and 1, in order
    app.calls.clear()
    ev = server_message(RecordDict({"arrays": arrays_of(broadcast(3))}), "evaluate")
    mod(ev, ctx, app)
    ((_, seen, kind),) = app.calls
    assert kind == "evaluate"
    assert np.array_equal(seen["head.w"], kept)
    assert np.array_equal(seen["shared.w"], broadcast(3)["shared.w"])


def test_a_weakened_mod_that_starts_users_from_the_clients_head_is_caught():
    """The property the first test checks is not vacuous: after one round the client's head
    differs from the broadcast's, so a mod that started users from it would be seen."""
    mod = user_level_mod(users_per_client=2, personal=["head.*"])
    app, ctx = App(), context(partition=0, clients=1)
    mod(train_message(broadcast(1), 1, 1.0, 2, 10.0), ctx, app)
    assert not np.array_equal(ctx.state[K_PERSONAL]["head.w"].numpy(), broadcast(2)["head.w"])


def test_users_of_is_checked_against_the_servers_population():
    mod = user_level_mod(users_of=lambda c: [3, 9])
    reply = mod(train_message(broadcast(1), 1, 1.0, 5, 1.0), context(0, 1), App())
    assert reply.has_error() and "outside 0..4" in reply.error.reason
    ok = user_level_mod(users_of=lambda c: [3, 4])(
        train_message(broadcast(1), 1, 1.0, 5, 1.0), context(0, 1), App()
    )
    assert not ok.has_error() and int(ok.content[K_COUNTS]["count"]) == 2


def test_a_population_above_the_servers_is_refused():
    # N (fedudp.public.users) is an upper bound: 2 clients x 4 users = 8 <= 10 run unchanged
    reply = user_level_mod(users_per_client=4)(
        train_message(broadcast(1), 1, 1.0, 10, 1.0), context(0, 2), App()
    )
    assert not reply.has_error()
    reply = user_level_mod(users_per_client=4)(
        train_message(broadcast(1), 1, 1.0, 10, 1.0), context(0, 3), App()
    )
    assert reply.has_error() and "12 users, more than" in reply.error.reason
    assert "calibrated for (10, fedudp.public.users)" in reply.error.reason
    with pytest.raises(ValueError, match="users_per_client"):
        user_level_mod(users_per_client=0)


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        np.array(3.5, dtype=np.float64),
        np.zeros((0, 5), np.float32),
        np.arange(6, dtype=">i4"),
        np.array([True, False]),
    ],
)
def test_the_fast_array_decode_equals_flowers(arr):
    from fedudp.flower.wire import to_numpy as _numpy

    a = Array(arr)
    got, want = _numpy(a), a.numpy()
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


class MetricApp:
    """A fake training step reporting the app's own metrics: user u has 2 + u records and a
    training loss of u / 10; its context records what the app saw."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def __call__(self, msg: Message, context: Context) -> Message:
        from fedudp.flower import client_users

        self.seen.append({**dict(context.node_config), "users": client_users(context)})
        if msg.metadata.message_type != "train":
            return Message(RecordDict({"metrics": MetricRecord({"ok": 1})}), reply_to=msg)
        u = int(context.node_config["partition-id"])
        got = {k: v.numpy() + np.float32(0.01) for k, v in msg.content["arrays"].items()}
        metrics = MetricRecord({"train_loss": u / 10, "num-examples": 2 + u})
        return Message(RecordDict({"arrays": arrays_of(got), "metrics": metrics}), reply_to=msg)


def test_the_apps_training_metrics_are_record_weighted_over_the_sampled_users():
    mod, app = user_level_mod(users_per_client=4), MetricApp()
    reply = mod(train_message(broadcast(1), 1, 0.6, 12, 1.0), context(1, 3), app)
    sampled = sampled_users(range(4, 8), 5, 1, 0.6, 12)
    assert sampled  # (seed 5, round 1: users 4..7 at q = 0.6)
    m = reply.content["metrics"]
    records = sum(2 + u for u in sampled)
    assert m["num-examples"] == records
    assert m["train_loss"] == pytest.approx(sum((2 + u) * u / 10 for u in sampled) / records)
    assert set(m.keys()) == {"num-examples", "train_loss"}


def test_the_app_sees_a_stable_key_for_its_clients_users_in_training_and_evaluation():
    """In training ``partition-id`` is the user's global index (of N); the client's own stays
    under ``fedudp.client-partition-id``, and ``client_users`` gives the client's users and N in
    training and evaluation alike, so that evaluation can load the client's whole data."""
    mod, app = user_level_mod(users_per_client=4), MetricApp()
    ctx = context(2, 3)  # users 8..11 of N = 12
    mod(train_message(broadcast(1), 1, 1.0, 12, 1.0), ctx, app)
    assert [s["partition-id"] for s in app.seen] == [8, 9, 10, 11]
    for s in app.seen:
        assert s["num-partitions"] == 12 and s["fedudp.user-id"] == s["partition-id"]
        assert s["fedudp.client-partition-id"] == 2 and s["fedudp.client-num-partitions"] == 3
        assert s["users"] == ([8, 9, 10, 11], 12)
    app.seen.clear()
    ctx.run_config = {"fedudp.public.users": 12}
    mod(server_message(RecordDict({"arrays": arrays_of(broadcast(2))}), "evaluate"), ctx, app)
    ((ev,),) = [app.seen]
    assert ev["partition-id"] == 2 and ev["num-partitions"] == 3  # the client's, untouched
    assert ev["users"] == ([8, 9, 10, 11], 12)


def test_client_users_outside_the_mod_says_so():
    from fedudp.flower import client_users

    with pytest.raises(LookupError, match="no user_level_mod"):
        client_users(context(0, 1))


def test_training_metrics_can_be_left_out_of_the_reply():
    mod = user_level_mod(users_per_client=4, train_metrics=False)
    reply = mod(train_message(broadcast(1), 1, 1.0, 12, 1.0), context(1, 3), MetricApp())
    assert set(reply.content.keys()) == {K_CONTRIB, K_COUNTS}
