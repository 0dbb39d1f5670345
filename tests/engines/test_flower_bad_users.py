"""One user's bad data changes nothing but the noisy release, on ``user_level_mod``'s per-user
path and its fast path (``TorchTraining``), driven in this process by Flower's own
``Strategy.start`` over a grid that hands every message to the ClientApp chain (as in
tests/engines/test_flower_secure.py).

A base federation where one sampled user's update is NaN (the app's step returns NaN; on the
fast path one NaN feature in one record), or whose training step raises (on the fast path its
``data`` raises, or its labels break the batched pass), is compared with its neighbour without
that user (the user's declared slot holds no records: a zero update). Every public quantity is
identical: what each client sends (the record keys, the declared users, the contribution's
shape, success or error), the release decision of every round, the ledger's events and ε, the
round metrics that say how many clients answered, the released model's shape; in seeded mode
even the released values (the same keyed noise on the same clipped sum). The bad user is
counted: the reply's ``failed`` / ``raised``, the round's ``nonfinite_users`` /
``raised_users``; the app's metrics stay finite.

Weakened twins, each caught: the mod that clips and sends a NaN update (``Constraint.apply``,
the hole of issue 49); the mod that lets a user's exception fail the client (the release then
loses the client's other users, and with ``min_owners`` = every client the round is withheld
while the neighbour's is released); the fast path that lets a user's bad data fail the batch;
the vectorized local SGD whose padding slots read another user's NaN record (the other users'
updates then NaN, dropped: the release loses them).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message.message import make_message
from flwr.common.constant import ErrorCode
from flwr.serverapp.strategy import FedAvg

import fedudp.flower.collect as flower_collect
import fedudp.flower.mod as flower_mod
from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.protocol.contributions import Constraint
from fedudp.flower import K_CONTRIB, K_COUNTS, RunFailed, UserLevelDP, sampled_users, user_level_mod
from fedudp.flower.fast import TorchTraining
from fedudp.flower.guard import UserRows

CLIENTS, PER = 3, 4  # client p holds users 4p .. 4p + 3
N, RATE, CLIP, Z, SEED, ROUNDS = CLIENTS * PER, 0.6, 0.5, 1.0, 3, 2
DIM = 6
# the bad user: sampled in round 1 (the keyed Poisson sample), at client 1
BAD = next(u for u in sampled_users(range(PER, 2 * PER), SEED, 1, RATE, N))


@pytest.fixture(autouse=True)
def server_identity():
    """What Flower's ServerApp runtime sets before ``main``, restored afterwards."""
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


def arrays_of(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


class App:
    """A fake training step: user u moves ``w`` by a vector of its own (some beyond the clip);
    the ``bad`` user's step returns NaN (``"nan"``), raises (``"raise"``) or, in the
    neighbour, holds no records and leaves the model unchanged (``"absent"``)."""

    def __init__(self, bad: str | None) -> None:
        self.bad = bad

    def __call__(self, msg: Message, context: Context) -> Message:
        u = int(context.node_config["partition-id"])
        w = msg.content["arrays"]["w"].numpy().astype(np.float32)
        step = np.float32((u + 1) / 40) * np.cos(np.arange(DIM, dtype=np.float32) + u)
        records = 1 + u % 3
        if u == BAD and self.bad == "raise":
            raise RuntimeError(f"user {u}'s data cannot be read")
        if u == BAD and self.bad == "nan":
            step = np.full(DIM, np.nan, np.float32)
        if u == BAD and self.bad == "absent":
            step, records = np.zeros(DIM, np.float32), 0
        loss = float(np.nansum(step)) if u != BAD or self.bad != "nan" else float("nan")
        return Message(
            RecordDict(
                {
                    "arrays": arrays_of({"w": w + step}),
                    "metrics": MetricRecord({"num-examples": records, "train_loss": loss}),
                }
            ),
            reply_to=msg,
        )


class LocalGrid:
    """Each message goes to its node's ClientApp chain (``mod`` then ``app``) with that node's
    context; an exception out of the chain becomes Flower's error reply (the ClientApp
    crashed), as Flower's runtime makes it."""

    def __init__(self, mod, app) -> None:
        self.mod, self.app = mod, app
        self.contexts = {
            100 + p: Context(
                run_id=1,
                node_id=100 + p,
                node_config={"partition-id": p, "num-partitions": CLIENTS},
                state=RecordDict(),
                run_config={},
            )
            for p in range(CLIENTS)
        }
        self.replies: list[tuple[int, int, Message]] = []  # (round, client, reply)

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            dst = m.metadata.dst_node_id
            msg = make_message(
                Metadata(
                    run_id=1,
                    message_id=f"m{time.monotonic_ns()}",
                    src_node_id=1,
                    dst_node_id=dst,
                    reply_to_message_id="",
                    group_id=m.metadata.group_id,
                    created_at=time.time(),
                    ttl=3600.0,
                    message_type=m.metadata.message_type,
                ),
                m.content,
            )
            try:
                rep = self.mod(msg, self.contexts[dst], self.app)
            except Exception as e:  # noqa: BLE001  (what Flower's runtime replies)
                rep = Message(
                    error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(e)), reply_to=msg
                )
            if m.metadata.message_type == "train":
                dp = m.content["fedudp.dp"] if "fedudp.dp" in m.content else None
                r = int(dp["round"]) if dp is not None else 0  # 0: not UserLevelDP's
                self.replies.append((r, dst - 100, rep))
            out.append(rep)
        return out


def run(mod, app, min_owners: int = 1, initial: ArrayRecord | None = None):
    """``ROUNDS`` seeded rounds of FedAvg wrapped by UserLevelDP; (strategy, grid, released
    arrays per round, round metrics)."""
    grid = LocalGrid(mod, app)
    s = UserLevelDP(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
        GaussianAggregator(CLIP, Z, Sampling(RATE, N)),
        delta=1e-5,
        seed=SEED,
        randomness="seeded",
        min_owners=min_owners,
    )
    released, metrics = {}, {}
    inner = s.aggregate_train

    def recording(server_round, replies):
        arrays, m = inner(server_round, replies)
        if arrays is not None:
            released[server_round] = np.concatenate(
                [v.numpy().astype(np.float64).reshape(-1) for v in arrays.values()]
            )
        metrics[server_round] = dict(m) if m is not None else {}
        return arrays, m

    s.aggregate_train = recording
    try:
        s.start(
            grid=grid,
            initial_arrays=initial or arrays_of({"w": np.zeros(DIM, np.float32)}),
            num_rounds=ROUNDS,
            train_config=ConfigRecord({"lr": 0.1}),
        )
    except RunFailed:
        pass  # every round withheld: the public record says so (the outcome)
    return s, grid, released, metrics


def public(s, grid, released, metrics) -> dict:
    """Everything a neighbour may not change: per reply its keys, success, declared users and
    the contribution's shape; per round the release decision and the answering clients; the
    ledger's events and ε; the released model's shape; the run's outcome."""
    replies = []
    for r, p, rep in sorted(grid.replies, key=lambda t: t[:2]):
        if rep.has_error():
            replies.append((r, p, "error"))
            continue
        c = rep.content[K_CONTRIB]
        replies.append(
            (
                r,
                p,
                tuple(sorted(rep.content.keys())),
                int(rep.content[K_COUNTS]["users"]),
                {k: tuple(v.numpy().shape) for k, v in c.items()},
            )
        )
    return {
        "replies": replies,
        "withheld": [r for r, _ in s.withheld],
        "ledger": [
            (e.round, e.event, e.noise_multiplier, e.noise_std, e.sampling_rate, e.epsilon)
            for e in s.ledger.entries
        ],
        "clients": {r: (m.get("clients"), m.get("failed_clients")) for r, m in metrics.items()},
        "shapes": {r: a.shape for r, a in released.items()},
        "outcome": s.ledger.extra["outcome"]["status"],
    }


def neighbour_gap(base, nbr) -> tuple[bool, float]:
    """(every public quantity equal, the largest gap between the released models)."""
    same = public(*base) == public(*nbr)
    rb, rn = base[2], nbr[2]
    if rb.keys() != rn.keys():
        return same, float("inf")
    gaps = [float(np.abs(rb[r] - rn[r]).max()) for r in rb]
    return same, max(gaps, default=0.0) if all(np.isfinite(gaps)) else float("inf")


def clip_and_send(G, constraint, raised):
    """Weakened (the hole): every row clipped and sent, a NaN one included."""
    c = Constraint(rows=constraint.rows, clip=constraint.clip).apply(G)
    return UserRows(c, list(range(len(G))), [], dict(raised))


def fail_the_client(e, limit=200):
    """Weakened (the hole): a user's exception fails the whole client (re-raised from the
    handler that would drop the user alone)."""
    raise e


# -- the per-user path --------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["nan", "raise"])
def test_one_bad_user_changes_nothing_public_on_the_per_user_path(bad):
    mod = user_level_mod(users_per_client=PER)
    base = run(mod, App(bad), min_owners=CLIENTS)
    nbr = run(mod, App("absent"), min_owners=CLIENTS)
    same, gap = neighbour_gap(base, nbr)
    assert same, (public(*base), public(*nbr))
    assert gap < 1e-6  # seeded: the same keyed noise on the same clipped sum
    s, grid, released, metrics = base
    assert len(s.ledger.entries) == ROUNDS and not s.withheld
    # the bad user is counted: in its client's reply and in the round's metrics
    ((rep),) = [m for r, p, m in grid.replies if (r, p) == (1, BAD // PER)]
    key = "failed" if bad == "nan" else "raised"
    assert int(rep.content[K_COUNTS][key]) == 1
    assert metrics[1]["nonfinite_users" if bad == "nan" else "raised_users"] == 1
    assert np.isfinite(rep.content["metrics"]["train_loss"])
    # the other users of that client are all there: count = the neighbour's minus the empty slot
    sampled = sampled_users(range(PER, 2 * PER), SEED, 1, RATE, N)
    assert int(rep.content[K_COUNTS]["count"]) == len(sampled) - 1


def test_weakened_per_user_mods_are_caught(monkeypatch):
    mod = user_level_mod(users_per_client=PER)
    nbr = run(mod, App("absent"), min_owners=CLIENTS)
    with monkeypatch.context() as m:  # a NaN user clipped and sent
        m.setattr(flower_mod, "user_rows", clip_and_send)
        weak = run(mod, App("nan"), min_owners=CLIENTS)
    same, gap = neighbour_gap(weak, nbr)
    assert not same  # the server fails that client: the round is withheld
    with monkeypatch.context() as m:  # ... and a server that does not check the contribution
        m.setattr(flower_mod, "user_rows", clip_and_send)
        m.setattr(flower_collect, "bad_contribution", lambda rec, dim: None)
        weak = run(mod, App("nan"))
    assert neighbour_gap(weak, run(mod, App("absent")))[1] == float("inf")  # a NaN model
    with monkeypatch.context() as m:  # a user's exception fails its client
        m.setattr(flower_mod, "one_line", fail_the_client)
        weak = run(mod, App("raise"), min_owners=CLIENTS)
    assert not neighbour_gap(weak, nbr)[0]
    assert 1 in weak[0].withheld[0]  # round 1 withheld while the neighbour's released


# -- the fast path ------------------------------------------------------------------------------
def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def fast_data(bad: str | None):
    """``data(u, n)``: 2-4 records per user; the ``bad`` user has one NaN feature
    (``"nan"``), raises (``"raise"``), has a label out of range (``"label"``: the batched pass
    raises), or no records (``"absent"``)."""

    def data(u: int, n: int):
        rng = np.random.default_rng(10 + u)
        m = 2 + u % 3
        y = rng.integers(0, 3, m)
        x = rng.standard_normal((m, 4)) + (y[:, None] - 1.0)
        if u == BAD and bad == "raise":
            raise OSError(f"user {u}'s file is unreadable")
        if u == BAD and bad == "nan":
            x[0, 1] = np.nan
        if u == BAD and bad == "label":
            y[0] = 7
        if u == BAD and bad == "absent":
            x, y = x[:0], y[:0]
        return torch.tensor(x, dtype=torch.float32), torch.tensor(y)

    return data


def never_called(msg: Message, context: Context) -> Message:
    raise AssertionError("the fast path called the app's train step")


def fast_run(bad, cls=TorchTraining, min_owners=CLIENTS, epochs=1):
    fast = cls(
        make_model, fast_data(bad), lr="lr", epochs=epochs, batch_size=2 if epochs > 1 else None
    )
    mod = user_level_mod(users_per_client=PER, fast=fast)
    return run(mod, never_called, min_owners, ArrayRecord(make_model().state_dict()))


class Unisolated(TorchTraining):
    """Weakened: one user's bad data fails the batch (no per-user isolation)."""

    def updates(self, arrays, names, users, num_users, configs):
        G, metrics, raised = super().updates(arrays, names, users, num_users, configs)
        if raised:
            raise ValueError(next(iter(raised.values())))
        return G, metrics, raised


@pytest.mark.parametrize(("bad", "epochs"), [("nan", 1), ("nan", 2), ("raise", 1), ("label", 1)])
def test_one_bad_user_changes_nothing_public_on_the_fast_path(bad, epochs):
    base = fast_run(bad, epochs=epochs)
    nbr = fast_run("absent", epochs=epochs)
    same, gap = neighbour_gap(base, nbr)
    assert same, (public(*base), public(*nbr))
    assert gap < 1e-6
    s, grid, released, metrics = base
    assert len(s.ledger.entries) == ROUNDS
    key = "nonfinite_users" if bad == "nan" else "raised_users"
    assert metrics[1][key] == 1 and np.isfinite(metrics[1].get("train_loss", 0.0))


def test_weakened_fast_paths_are_caught(monkeypatch):
    nbr = fast_run("absent")
    with monkeypatch.context() as m:
        m.setattr(flower_mod, "user_rows", clip_and_send)
        weak = fast_run("nan")
    assert not neighbour_gap(weak, nbr)[0]
    for bad in ("raise", "label"):
        weak = fast_run(bad, cls=Unisolated)
        assert not neighbour_gap(weak, nbr)[0]
        assert weak[0].withheld and weak[0].withheld[0][0] == 1
    # the vectorized local SGD's padding reading another user's NaN record (NaN * 0 = NaN)
    from fedudp.owner import gradients, local_sgd

    def leaky_loss(model, params, xb, yb, mb):
        out = torch.func.functional_call(model, dict(params), (xb,))
        per = torch.nn.functional.cross_entropy(out, yb, reduction="none")
        return (per * mb).sum() / mb.sum().clamp(min=1.0)

    with monkeypatch.context() as m:
        m.setattr(local_sgd, "masked_loss", leaky_loss)
        m.setattr(gradients, "masked_loss", leaky_loss)
        weak = fast_run("nan", epochs=2)
    assert neighbour_gap(weak, fast_run("absent", epochs=2))[1] > 1e-3
