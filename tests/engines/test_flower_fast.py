"""``user_level_mod``'s fast path (``fedudp.flower.fast.TorchTraining``) against its per-user
path, called directly (no simulation).

The per-user path calls a plain PyTorch training step once per sampled user (build the model,
load the broadcast, ``torch.optim.SGD`` over the user's records in order, reply with the
model); the fast path computes the same users' updates together with the owner kernels. For the
same users, sample and seeds (seeded mode) the clients' replies and the server's release
(``UserLevelDP.aggregate_train``, the same keyed noise) agree to float32 rounding: one-record and
many-record users, one SGD step (the one-step kernel) and several epochs of minibatches
(vectorized local SGD), clipped sums and rows, with personal layers (never sent, the client's
own trained in order). Weakened twins of the fast path (each user's summed instead of mean
gradient; the sampled users' records trained as one unit) are caught by the same comparison."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message.message import make_message
from flwr.serverapp.strategy import FedAvg

from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.flower import K_CONTRIB, K_COUNTS, K_DP, K_PERSONAL, UserLevelDP, user_level_mod
from fedudp.flower.fast import TorchTraining

K, CLIENTS, N = 5, 3, 15  # users per client, clients, users
LR = 0.5


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def data_of(records):
    """``data(u, n)``: user u's records (``records(u)`` of them), a class-dependent shift."""

    def data(u: int, n: int):
        rng = np.random.default_rng(100 + u)
        m = records(u)
        y = rng.integers(0, 3, m)
        x = rng.standard_normal((m, 6)) + 2.0 * (y[:, None] - 1)
        return torch.tensor(x, dtype=torch.float32), torch.tensor(y)

    return data


def app_step(data, epochs: int, batch: int | None):
    """The app's own ``@app.train()``: plain PyTorch on partition-id's records; its metric
    is the first step's loss (the loss at the broadcast)."""

    def train_fn(msg: Message, context: Context) -> Message:
        model = make_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = data(context.node_config["partition-id"], context.node_config["num-partitions"])
        opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        with torch.no_grad():
            first = float(torch.nn.functional.cross_entropy(model(x), y))
        b = batch or len(y)
        for _ in range(epochs):
            for s in range(0, len(y), b):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[s : s + b]), y[s : s + b]).backward()
                opt.step()
        out = RecordDict(
            {
                "arrays": ArrayRecord(model.state_dict()),
                "metrics": MetricRecord({"train_loss": first, "num-examples": len(y)}),
            }
        )
        return Message(out, reply_to=msg)

    return train_fn


def never_called(msg: Message, context: Context) -> Message:
    raise AssertionError("the fast path called the app's train step")


class Grid:
    def get_node_ids(self):
        return list(range(1, CLIENTS + 1))


def strategy(personal=(), clip: float = 1.0) -> UserLevelDP:
    # a fixed noise multiplier (a calibration would cost seconds; the noise is the same
    # keyed draw on both paths either way)
    agg = GaussianAggregator(clip, 3.0, Sampling(rate=0.7, population=N))
    return UserLevelDP(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0),
        agg,
        delta=1e-5,
        randomness="seeded",
        seed=11,
        personal=personal,
    )


def delivered(msg: Message, node: int) -> Message:
    """A server's training message as a client receives it (explicit metadata, the way
    Flower's own mod tests build theirs)."""
    return make_message(
        Metadata(
            run_id=1,
            message_id=f"m{time.monotonic_ns()}",
            src_node_id=0,
            dst_node_id=node,
            reply_to_message_id="",
            group_id="1",
            created_at=time.time(),
            ttl=3600.0,
            message_type="train",
        ),
        msg.content,
    )


def context(partition: int) -> Context:
    return Context(
        run_id=1,
        node_id=partition + 1,
        node_config={"partition-id": partition, "num-partitions": CLIENTS},
        state=RecordDict(),
        run_config={},
    )


def run_rounds(mod, step, rounds: int = 2, rows: bool = False, personal=(), clip: float = 1.0):
    """Round by round: the wrapper's messages, each client's reply through ``mod``, the
    wrapper's release. Returns (per round: the replies' contribution arrays and counts, the
    released arrays) and the clients' contexts."""
    s = strategy(personal, clip)
    arrays = ArrayRecord(make_model().state_dict())
    ctxs = [context(p) for p in range(CLIENTS)]
    out = []
    for r in range(1, rounds + 1):
        msgs = list(s.configure_train(r, arrays, ConfigRecord({"lr": LR}), Grid()))
        for m in msgs:  # rows: each sampled user's unclipped update, as a rows estimator asks
            m.content[K_DP]["rows"] = rows
        replies = [mod(delivered(m, p + 1), ctxs[p], step) for p, m in enumerate(msgs)]
        assert not any(rep.has_error() for rep in replies), [
            rep.error.reason for rep in replies if rep.has_error()
        ]
        for rep in replies:  # what leaves a client: the contribution, its counts, the metrics
            assert set(rep.content.keys()) <= {K_CONTRIB, K_COUNTS, "metrics"}
        contrib = [
            {k: v.numpy().copy() for k, v in rep.content[K_CONTRIB].items()} for rep in replies
        ]
        counts = [
            (dict(rep.content[K_COUNTS]), dict(rep.content.metric_records.get("metrics", {})))
            for rep in replies
        ]
        if rows:
            out.append((contrib, counts, None))
            continue
        arrays, _ = s.aggregate_train(r, replies)
        out.append((contrib, counts, {k: v.numpy().copy() for k, v in arrays.items()}))
    return out, ctxs


def compare(a, b) -> float:
    """The largest difference between two runs' contributions and releases; infinite where
    the counts differ or the training metrics beyond float tolerance."""
    worst = 0.0
    for (ca, na, ra), (cb, nb, rb) in zip(a, b, strict=True):
        if [n for n, _ in na] != [n for n, _ in nb]:
            return float("inf")
        for (_, ma), (_, mb) in zip(na, nb, strict=True):
            if ma.keys() != mb.keys() or any(ma[k] != pytest.approx(mb[k], rel=1e-5) for k in ma):
                return float("inf")
        for x, y in zip(ca, cb, strict=True):
            for k in x:
                worst = max(worst, float(np.abs(x[k] - y[k]).max(initial=0.0)))
        for k in ra or {}:
            worst = max(worst, float(np.abs(ra[k] - rb[k]).max()))
    return worst


@pytest.fixture(autouse=True)
def one_thread():
    """A tiny model: one torch thread (on a loaded machine, more threads only wait)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def task_identity():
    """A server app's identity, which building Flower messages outside a running app needs."""
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


CASES = {  # name: (records of user u, epochs, batch size, a clip that binds for some users)
    "one-record users, one step": (lambda u: 1, 1, None, 1.0),
    "2-9 records, one step": (lambda u: 2 + (u * 5) % 8, 1, None, 0.6),
    "2-9 records, 2 epochs of 3": (lambda u: 2 + (u * 5) % 8, 2, 3, 1.25),
    "one-record users, 3 epochs": (lambda u: 1, 3, 1, 1.3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_fast_path_releases_what_the_per_user_path_releases(case):
    records, epochs, batch, clip = CASES[case]
    data = data_of(records)
    slow, _ = run_rounds(
        user_level_mod(users_per_client=K), app_step(data, epochs, batch), clip=clip
    )
    fast_mod = user_level_mod(
        users_per_client=K,
        fast=TorchTraining(make_model, data, lr="lr", epochs=epochs, batch_size=batch),
    )
    fast, _ = run_rounds(fast_mod, never_called, clip=clip)
    assert compare(slow, fast) < 2e-6
    # not vacuous: users were sampled, some clipped and some not, and the model moved
    counts = [c for _, cs, _ in slow for c, _ in cs]
    assert sum(c["count"] for c in counts) > 3
    assert 0 < sum(c["clipped"] for c in counts) < sum(c["count"] for c in counts)
    init = make_model().state_dict()
    assert max(np.abs(slow[-1][2][k] - init[k].numpy()).max() for k in init) > 1e-3


def test_the_rows_are_each_users_own_update():
    data = data_of(lambda u: 1 + u % 4)
    slow, _ = run_rounds(user_level_mod(users_per_client=K), app_step(data, 2, 2), rows=True)
    fast_mod = user_level_mod(
        users_per_client=K, fast=TorchTraining(make_model, data, lr=LR, epochs=2, batch_size=2)
    )
    fast, _ = run_rounds(fast_mod, never_called, rows=True)
    assert compare(slow, fast) < 2e-6
    assert sum(len(c["rows"]) for cs, _, _ in slow for c in cs) > 3


def test_personal_layers_stay_and_the_clients_own_are_trained_in_order():
    data = data_of(lambda u: 2 + u % 3)
    head = ["2.*"]
    slow, slow_ctx = run_rounds(
        user_level_mod(users_per_client=K, personal=head), app_step(data, 2, 2), personal=head
    )
    fast_mod = user_level_mod(
        users_per_client=K,
        personal=head,
        fast=TorchTraining(make_model, data, lr="lr", epochs=2, batch_size=2),
    )
    fast, fast_ctx = run_rounds(fast_mod, never_called, personal=head)
    assert compare(slow, fast) < 2e-6
    d_shared = 6 * 8 + 8
    assert all(c["sum"].shape == (d_shared,) for cs, _, _ in fast for c in cs)
    for a, b in zip(slow_ctx, fast_ctx, strict=True):
        ka, kb = a.state[K_PERSONAL], b.state[K_PERSONAL]
        assert list(ka.keys()) == list(kb.keys()) == ["2.weight", "2.bias"]
        for k in ka.keys():
            assert np.abs(ka[k].numpy() - kb[k].numpy()).max() < 2e-6
        init = make_model().state_dict()["2.weight"].numpy()
        assert np.abs(kb["2.weight"].numpy() - init).max() > 1e-3  # trained


class SummedGradient(TorchTraining):
    """Weakened: each user's summed gradient (no division by its own record count)."""

    def updates(self, arrays, names, users, num_users, configs):
        _, _, _, sizes = self.records(users, num_users)
        V = super().updates(arrays, names, users, num_users, configs)
        return V[0] * torch.from_numpy(sizes).double().unsqueeze(1), V[1], V[2]


class OneUnit(TorchTraining):
    """Weakened: the sampled users' records trained as one unit (the client's joint step), its
    update sent once per user."""

    def updates(self, arrays, names, users, num_users, configs):
        V, metrics, raised = super().updates(arrays, names, users, num_users, configs)
        if not len(users):
            return V, metrics, raised
        x, y, _, _ = self.records(users, num_users)
        joint = TorchTraining(self.model, lambda u, n: (x, y), self.lr, self.epochs)
        G = joint.updates(arrays, names, [0], 1, configs)[0]
        return G.expand(len(users), -1).clone(), metrics, raised


@pytest.mark.parametrize("twin", [SummedGradient, OneUnit])
def test_weakened_fast_paths_are_caught(twin):
    data = data_of(lambda u: 2 + (u * 5) % 8)
    slow, _ = run_rounds(user_level_mod(users_per_client=K), app_step(data, 1, None))
    weak, _ = run_rounds(
        user_level_mod(users_per_client=K, fast=twin(make_model, data, lr="lr")), never_called
    )
    assert compare(slow, weak) > 1e-3


def test_the_fast_path_refuses_what_it_cannot_compute():
    with pytest.raises(ValueError, match="cross-entropy only"):
        TorchTraining(make_model, data_of(lambda u: 1), lr=0.1, loss=torch.nn.MSELoss())
    bn = TorchTraining(
        lambda: torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.BatchNorm1d(3)),
        data_of(lambda u: 1),
        lr=0.1,
    )
    with pytest.raises(ValueError, match="BatchNorm1d"):
        bn.module()
    t = TorchTraining(make_model, data_of(lambda u: 1), lr="step-size")
    with pytest.raises(ValueError, match="lr='step-size' is not a key"):
        t.learning_rate({"config": ConfigRecord({"lr": 0.1})})
    # a setup error reaches the server as the client's error reason
    s = strategy()
    msg = next(
        iter(s.configure_train(1, ArrayRecord(make_model().state_dict()), ConfigRecord({}), Grid()))
    )
    msg.content[K_DP]["rate"] = 1.0
    reply = user_level_mod(users_per_client=K, fast=t)(delivered(msg, 1), context(0), never_called)
    assert reply.has_error() and "lr='step-size' is not a key" in reply.error.reason
