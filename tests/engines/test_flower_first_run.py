"""A Flower user's first run, from docs/flower-apps.md alone (issue 50).

* The fast path on Flower's PyTorch quickstart as written: ``load_data(partition_id,
  num_partitions, batch_size)`` returning ``(trainloader, testloader)`` of dict batches
  (``{"img", "label"}``, here a tiny in-memory dataset of the same shape), ``train`` with
  ``torch.optim.SGD(momentum=0.9)`` over a shuffling loader, ``batch-size`` and
  ``local-epochs`` in the run config. ``TorchTraining`` with the app's settings sends what the
  per-user path sends (momentum, weight decay, minibatches, epochs), shuffles as a shuffling
  loader does (the same steps for the same order), and refuses by name what it would not
  reproduce. Weakened twins (momentum dropped, shuffling dropped) are caught.
* Logging configured once: a wrapper run during which absl warns (dp-accounting's RDP at q < 1)
  prints each ServerApp line once; the twin without ``root_placeholder`` prints it twice.
* ``fedudp.train.min_owners`` above the strategy's ``min_train_nodes``: one warning naming both.
* The strategy summary before round 1 says nothing was released yet (not "0 releases").
* docs/flower-apps.md and the example say how Flower's runtime dependency installation meets a
  fedudp that is on no package index.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from test_flower_fast import CLIENTS, K, Grid, delivered, strategy
from torch import nn
from torch.utils.data import DataLoader

import fedudp.flower.strategy as flower
from fedudp.flower import K_CONTRIB, K_DP, UserLevelDP, user_level_mod
from fedudp.flower.availability import availability_problem
from fedudp.flower.fast import RUN_CONFIG, TorchTraining

ROOT = Path(__file__).resolve().parents[2]
LR, BATCH, EPOCHS = 0.05, 3, 2


# -- Flower's PyTorch quickstart, the shape of its task.py (tiny in-memory images) -------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.fc1 = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        return self.fc1(x.view(-1, 4 * 4 * 4))


class Partition(torch.utils.data.Dataset):
    """Partition ``p``'s records as Flower Datasets gives them: dicts {"img", "label"}."""

    def __init__(self, p: int, test: bool = False) -> None:
        rng = np.random.default_rng(1000 + p + (500 if test else 0))
        n = 2 if test else 2 + (p * 3) % 6
        self.y = rng.integers(0, 10, n)
        self.x = rng.standard_normal((n, 3, 6, 6)).astype(np.float32) + self.y[:, None, None, None]
        self.x = self.x.astype(np.float32)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"img": torch.from_numpy(self.x[i]), "label": int(self.y[i])}


def quickstart_load_data(shuffle: bool = True):
    def load_data(partition_id: int, num_partitions: int, batch_size: int):
        trainloader = DataLoader(Partition(partition_id), batch_size=batch_size, shuffle=shuffle)
        testloader = DataLoader(Partition(partition_id, test=True), batch_size=batch_size)
        return trainloader, testloader

    return load_data


def train(net, trainloader, epochs, lr, device, weight_decay=0.0):
    """The quickstart's ``train`` (``weight_decay`` added to test that setting too)."""
    net.to(device)
    criterion = torch.nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            images = batch["img"].to(device)
            labels = batch["label"].to(device)
            optimizer.zero_grad()
            loss = criterion(net(images), labels)
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def quickstart_train_fn(load_data, weight_decay=0.0):
    """The quickstart's ``@app.train()``: batch size and epochs from the run config."""

    def train_fn(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        p, n = context.node_config["partition-id"], context.node_config["num-partitions"]
        trainloader, _ = load_data(p, n, context.run_config["batch-size"])
        loss = train(
            model,
            trainloader,
            context.run_config["local-epochs"],
            float(msg.content["config"]["lr"]),
            "cpu",
            weight_decay,
        )
        metrics = {"train_loss": loss, "num-examples": len(trainloader.dataset)}
        return Message(
            RecordDict(
                {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord(metrics)}
            ),
            reply_to=msg,
        )

    return train_fn


RUN = {"batch-size": BATCH, "local-epochs": EPOCHS}


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(torch_threads)
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


def contexts() -> list[Context]:
    return [
        Context(
            run_id=1,
            node_id=p + 1,
            node_config={"partition-id": p, "num-partitions": CLIENTS},
            state=RecordDict(),
            run_config=dict(RUN),
        )
        for p in range(CLIENTS)
    ]


def one_round(mod, step) -> tuple[list[dict], dict]:
    """One round: each client's contribution through ``mod`` and the wrapper's release."""
    s = strategy()
    arrays = ArrayRecord(Net().state_dict())
    msgs = list(s.configure_train(1, arrays, ConfigRecord({"lr": LR}), Grid()))
    ctxs = contexts()
    replies = [mod(delivered(m, p + 1), ctxs[p], step) for p, m in enumerate(msgs)]
    errors = [r.error.reason for r in replies if r.has_error()]
    if errors:
        raise ValueError(errors[0])
    contrib = [{k: v.numpy().copy() for k, v in r.content[K_CONTRIB].items()} for r in replies]
    released, _ = s.aggregate_train(1, replies)
    return contrib, {k: v.numpy().copy() for k, v in released.items()}


def gap(a, b) -> float:
    (ca, ra), (cb, rb) = a, b
    worst = max(float(np.abs(x[k] - y[k]).max()) for x, y in zip(ca, cb, strict=True) for k in x)
    return max(worst, max(float(np.abs(ra[k] - rb[k]).max()) for k in ra))


def never_called(msg, context):
    raise AssertionError("the fast path called the app's train step")


def documented(load_data, **kw) -> TorchTraining:
    """docs/flower-apps.md's call for the quickstart: its settings, its run-config keys."""
    args = dict(lr="lr", batch_size="batch-size", epochs="local-epochs", momentum=0.9)
    return TorchTraining(Net, load_data, **{**args, **kw})


class DropsMomentum(TorchTraining):
    """Weakened: plain SGD whatever the app's optimizer (an adapter's silent loss)."""

    @property
    def plain(self) -> bool:
        return True


class DropsShuffle(TorchTraining):
    """Weakened: the records in the loader's order whatever the app's shuffling."""

    def _orders(self, sizes, starts, run, users):
        self.shuffle = False
        try:
            return super()._orders(sizes, starts, run, users)
        finally:
            self.shuffle = True


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_the_quickstart_as_written_releases_what_its_train_step_releases(weight_decay):
    load = quickstart_load_data(shuffle=False)  # the same order on both paths
    slow = one_round(user_level_mod(users_per_client=K), quickstart_train_fn(load, weight_decay))
    fast = one_round(
        user_level_mod(
            users_per_client=K, fast=documented(load, shuffle=False, weight_decay=weight_decay)
        ),
        never_called,
    )
    assert gap(slow, fast) < 2e-6
    weak = one_round(
        user_level_mod(
            users_per_client=K,
            fast=DropsMomentum(
                Net,
                load,
                "lr",
                "local-epochs",
                "batch-size",
                momentum=0.9,
                weight_decay=weight_decay,
            ),
        ),
        never_called,
    )
    assert gap(slow, weak) > 1e-4  # the twin that drops the app's momentum is caught


def app_update(x, y, orders, weight_decay=0.0) -> torch.Tensor:
    """The quickstart's ``train`` on one user's records visited in ``orders`` (one per epoch)."""

    class Epochs:  # a loader giving each epoch's order in turn (the quickstart's loop reads it)
        def __init__(self) -> None:
            self.epoch = 0

        def __len__(self) -> int:
            return -(-len(y) // BATCH)

        def __iter__(self):
            order = orders[self.epoch]
            self.epoch += 1
            for b in range(0, len(order), BATCH):
                idx = torch.from_numpy(order[b : b + BATCH])
                yield {"img": x[idx], "label": y[idx]}

    net = Net()
    w0 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    train(net, Epochs(), EPOCHS, LR, "cpu", weight_decay)
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double() - w0.double()


def test_shuffling_is_the_apps_steps_in_a_fresh_order_each_epoch():
    load = quickstart_load_data(shuffle=True)
    t = documented(load, shuffle=True, shuffle_seed=7)
    arrays = {k: v.numpy() for k, v in Net().state_dict().items()}
    names = list(arrays)
    users = [1, 4, 5]
    configs = {"config": ConfigRecord({"lr": LR}), RUN_CONFIG: RUN, K_DP: {"round": 3}}
    G, _, raised = t.updates(arrays, names, users, 15, configs)
    assert not raised
    weak = DropsShuffle(
        Net, load, "lr", "local-epochs", "batch-size", momentum=0.9, shuffle=True, shuffle_seed=7
    )
    W = weak.updates(arrays, names, users, 15, configs)[0]
    for i, u in enumerate(users):
        part = Partition(u)
        x, y = torch.from_numpy(part.x), torch.from_numpy(part.y)
        rng = np.random.default_rng([7, 3, u])  # the documented key: (shuffle_seed, round, user)
        orders = [rng.permutation(len(y)) for _ in range(EPOCHS)]
        assert torch.allclose(G[i], app_update(x, y, orders), atol=2e-6)
        in_order = [np.arange(len(y))] * EPOCHS
        if len(y) > BATCH:  # several steps: the order matters, and the twin is caught
            assert not torch.allclose(W[i], app_update(x, y, orders), atol=1e-4)
            assert torch.allclose(W[i], app_update(x, y, in_order), atol=2e-6)
    # OS entropy unless seeded: two rounds' orders differ
    secure = documented(load, shuffle=True)
    a = secure.updates(arrays, names, [5], 15, configs)[0]
    b = secure.updates(arrays, names, [5], 15, configs)[0]
    assert not torch.equal(a, b)


def test_what_the_fast_path_cannot_reproduce_is_refused_by_name():
    load = quickstart_load_data(shuffle=True)
    # the quickstart's three-argument load_data without a batch size: refused at once
    with pytest.raises(ValueError, match="no batch_size is declared: pass batch_size="):
        TorchTraining(Net, load, lr="lr")
    arrays = {k: v.numpy() for k, v in Net().state_dict().items()}
    configs = {"config": ConfigRecord({"lr": LR}), RUN_CONFIG: RUN}
    cases = {
        "shuffle=True, but shuffle=False is declared": documented(load),
        "batch_size=3, but batch_size=4 is declared": documented(
            lambda p, n: DataLoader(Partition(p), batch_size=3), batch_size=4
        ),
        "shuffle=False), but shuffle=True is declared": documented(
            quickstart_load_data(shuffle=False), shuffle=True
        ),
        "keys=": documented(load, shuffle=True, keys=("image", "label")),
    }
    for why, t in cases.items():
        with pytest.raises(ValueError, match=re.escape(why)):
            t.updates(arrays, list(arrays), [0, 1], 15, configs)
    # through the mod: the client fails with that reason (no user silently dropped)
    with pytest.raises(ValueError, match=re.escape("shuffle=True, but shuffle=False")):
        one_round(user_level_mod(users_per_client=K, fast=documented(load)), never_called)
    # a run-config key that is not there is named
    with pytest.raises(ValueError, match="epochs='local-epochs' is not a key"):
        documented(load, shuffle=True).updates(
            arrays, list(arrays), [0], 15, {"config": ConfigRecord({"lr": LR})}
        )


# -- logging configured once -------------------------------------------------------------------
def wrapper_run_with_absl_warning(monkeypatch) -> tuple[int, list]:
    """A wrapper run (test_flower_secure's in-process grid) whose clients' training warns
    through absl once, as dp-accounting's RDP does at q < 1; the root logger without handlers,
    as in a ServerApp process. Flower's console handler and stderr (where ``basicConfig`` and
    Python's last resort write) both go to one buffer. Returns (how many times round 1's line
    was printed, the root logger's handlers afterwards)."""
    import io
    import sys

    import test_flower_secure as secure
    from absl import logging as absl_logging

    buf = io.StringIO()
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # pytest's own capture handlers set aside
    monkeypatch.setattr(sys, "stderr", buf)
    for h in logging.getLogger("flwr").handlers:
        if isinstance(h, logging.StreamHandler):
            monkeypatch.setattr(h, "stream", buf)

    class Warns(secure.App):
        def __call__(self, msg, context):
            absl_logging.warning("_compute_log_a_frac failed to converge (a stand-in)")
            return super().__call__(msg, context)

    monkeypatch.setattr(secure, "App", Warns)
    secure.run("seeded", rounds=2)
    lines = [ln for ln in buf.getvalue().splitlines() if "UserLevelDP round 1:" in ln]
    return len(lines), list(root.handlers)


def test_a_run_at_q_below_one_logs_each_line_once(monkeypatch):
    with monkeypatch.context() as m:
        printed, handlers = wrapper_run_with_absl_warning(m)
    assert printed == 1 and handlers == []


def test_without_the_placeholder_every_line_prints_twice(monkeypatch):
    """The weakened twin (no ``root_placeholder``): absl configures the root logger and the
    check above fails."""
    with monkeypatch.context() as m:
        m.setattr(flower, "root_placeholder", contextlib.nullcontext)
        printed, handlers = wrapper_run_with_absl_warning(m)
    assert printed == 2 and handlers  # what the check catches


def test_the_real_calibration_at_q_below_one_configures_no_root_logger(monkeypatch):
    """``from_run_config`` at q = 0.5 (the example's run config: dp-accounting's RDP warns
    through absl at some orders when its caches are cold) leaves the root logger bare."""
    from fedudp.privacy import accountant

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    for cache in ("_RDP_VECTORS",):  # cold, so that the warning path runs here
        if isinstance(getattr(accountant, cache, None), dict):
            monkeypatch.setattr(accountant, cache, type(getattr(accountant, cache))())
    rc = {
        "num-server-rounds": 3,
        "fedudp.privacy.epsilon": 4.0,
        "fedudp.privacy.delta": 1e-5,
        "fedudp.privacy.clip": 1.0,
        "fedudp.train.sampling_rate": 0.5,
        "fedudp.public.users": 40,
    }
    UserLevelDP.from_run_config(FedAvg(), rc, ArrayRecord(Net().state_dict()))
    assert root.handlers == []


# -- min_owners against the strategy's availability -------------------------------------------
def test_min_owners_above_min_train_nodes_is_named_before_round_1(monkeypatch, caplog):
    import test_flower_secure as secure

    why = availability_problem(FedAvg(min_train_nodes=2, min_available_nodes=2), 3)
    assert why is not None and "fedudp.train.min_owners = 3" in why
    assert "min_train_nodes = 2" in why and "min_available_nodes = 2" in why
    assert availability_problem(FedAvg(min_train_nodes=3), 3) is None

    def warned() -> bool:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            secure.run("seeded", rounds=1, min_owners=3)  # FedAvg's min_train_nodes: 2
        return any(
            "exceeds the strategy's min_train_nodes" in r.getMessage() for r in caplog.records
        )

    assert warned()
    # weakened twin: compared with the nodes connected now (3 here), not the strategy's
    # guarantee (a round that starts early samples min_train_nodes): no warning
    monkeypatch.setattr(flower, "availability_problem", lambda s, m: None if m <= 3 else "x")
    assert not warned()


# -- the summary before round 1 ----------------------------------------------------------------
def summary_line(s: UserLevelDP, caplog) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO):
        s.summary()
    return next(r.getMessage() for r in caplog.records if "estimator" in r.getMessage())


def test_the_summary_before_round_1_says_nothing_was_released_yet(caplog):
    class OldSummary(UserLevelDP):  # weakened twin: the count of releases at the start
        def summary(self) -> None:
            flower.log(
                logging.INFO, "UserLevelDP: estimator x, %d releases", len(self.ledger.entries)
            )

    def honest(line: str) -> bool:
        return "nothing released yet" in line and "0 releases" not in line

    s = strategy()
    assert honest(summary_line(s, caplog))
    weak = OldSummary(s.strategy, s.aggregator, delta=1e-5)
    assert not honest(summary_line(weak, caplog))


# -- Flower's runtime dependency installation ---------------------------------------------------
def test_the_docs_and_the_example_turn_off_runtime_dependency_installation():
    """docs/flower-apps.md says what meets a fedudp on no package index (the error, the
    variable, the other way), and every ``flwr run`` of the example's README runs in a shell
    block that exports the variable before it."""
    docs = (ROOT / "docs" / "flower-apps.md").read_text()
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in docs
    assert "not found in the package registry" in docs and "finished:failed" in docs
    assert "--disable-runtime-dependency-installation" in docs  # a SuperLink one starts

    def every_run_disabled(readme: str) -> bool:
        ok = True
        for block in re.split(r"\n\s*\n", readme):
            for i, line in enumerate(block.splitlines()):
                if re.match(r"\s*flwr run ", line):
                    before = "\n".join(block.splitlines()[:i])
                    ok &= "export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in before
        return ok

    readme = (ROOT / "examples" / "flower_user_dp" / "README.md").read_text()
    assert "flwr run " in readme and every_run_disabled(readme)
    # weakened twin: the README as it was (no export) fails the check
    assert not every_run_disabled(readme.replace("export FLWR_DISABLE_RUNTIME", "# FLWR_DISABLE"))
