"""One release path for fedudp's billboard and the Flower wrapper (issue 50,
docs/architecture.md#one-release-path).

The same contributions reach ``Billboard`` (driven by fedudp's own round loop,
``fedudp.billboard.rounds.run_rounds``) and ``UserLevelDP`` (driven in this process by Flower's
``Strategy.start`` over test_flower_secure's grid, clients running ``user_level_mod``): client 2
of three fails in round 2 (``min_owners=3``: withheld), and the target ε sits within the budget
rule's slack of the second release's ε, so round 4 is the budget stop. Both make the same
release decisions, with the same ε per round and the same ledger lines (event, noise
multiplier, std, sampling rate, ε, the RDP cross-check, the released values' SHA-256), each
line durable in ``ledger.jsonl`` before the release leaves. The weakened twins, a wrapper with a
second budget rule (no slack), one that composes a round before its fail-closed decision and
one whose ledger line reaches the file after the update left, are caught; neither source keeps
a copy of the rules (read from their syntax trees; the check finds them in the gate's own).
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

import fedudp.flower.strategy
from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.protocol.contributions import Contribution
from fedudp.billboard.release import BUDGET_SLACK, ReleaseGate
from fedudp.billboard.rounds import Collected, Evaluation, run_rounds
from fedudp.billboard.server import Billboard, ServerStep
from fedudp.flower import K_CONTRIB, K_COUNTS, K_DP, UserLevelDP, user_level_mod
from fedudp.privacy.accountant import ADJACENCY, Ledger, accountant_for
from fedudp.protocol import ledger_file
from fedudp.protocol.messages import Failure, OwnerReply
from test_flower_secure import CLIENTS, CLIP, DIM, PER, RATE, SEED, Z, App, LocalGrid, N, arrays_of
from test_flower_secure import server_identity  # noqa: F401  (autouse: the ServerApp's identity)

ROUNDS, DELTA, MIN_OWNERS = 4, 1e-5, CLIENTS
FAILING = {2: 102}  # round -> the node that sends no contribution (client 2)


def aggregator() -> GaussianAggregator:
    return GaussianAggregator(CLIP, Z, Sampling(RATE, N))


def epsilon_after(k: int, target: float) -> float:
    """ε after ``k`` releases, from a fresh accountant built as both paths build theirs."""
    event = aggregator().dp_event()
    acc = accountant_for(event, None, target)
    acc.compose(event, k)
    return float(acc.epsilon(DELTA))


@pytest.fixture(scope="module")
def target() -> float:
    """A target just below the second release's ε, within the rule's slack: the second release
    is made (it reaches the target up to the slack), the third would exceed it. The PLD grid
    depends on the target, so it is found as a fixed point and checked."""
    t = epsilon_after(2, 5.0) / (1 + BUDGET_SLACK / 2)
    t = epsilon_after(2, t) / (1 + BUDGET_SLACK / 2)
    eps2 = epsilon_after(2, t)
    assert t < eps2 <= t * (1 + BUDGET_SLACK)
    assert epsilon_after(3, t) > t * (1 + BUDGET_SLACK)
    return t


def flower_run(target: float, tmp: Path, gate=ReleaseGate) -> dict:
    """``UserLevelDP`` over the in-process grid; ``gate``: the release path it is given."""
    app, mod = App(), user_level_mod(users_per_client=PER)

    def chain(msg, context, call_next):
        r = int(msg.content[K_DP]["round"]) if K_DP in msg.content else None
        if FAILING.get(r) == msg.metadata.dst_node_id:  # infrastructure: no contribution
            return Message(RecordDict(), reply_to=msg)
        return mod(msg, context, call_next)

    path = tmp / "flower.jsonl"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fedudp.flower.strategy, "ReleaseGate", gate)
        s = UserLevelDP(
            FedAvg(
                fraction_train=1.0,
                fraction_evaluate=0.0,
                min_train_nodes=CLIENTS,
                min_available_nodes=CLIENTS,
            ),
            aggregator(),
            delta=DELTA,
            target_epsilon=target,
            seed=SEED,
            randomness="seeded",
            min_owners=MIN_OWNERS,
            ledger_path=path,
        )
    out: dict = {"contributions": {}, "epsilon": {}, "stopped_at": None, "durable_at": {}}
    configure, aggregate, inner = s.configure_train, s.aggregate_train, s.strategy.aggregate_train

    def configure_train(server_round, *a, **k):
        messages = list(configure(server_round, *a, **k))
        if not messages and out["stopped_at"] is None:
            out["stopped_at"] = server_round
        return messages

    def aggregate_train(server_round, replies):
        replies = list(replies)
        out["contributions"][server_round] = [
            (
                r.metadata.src_node_id - 100,
                Contribution(
                    None,
                    torch.from_numpy(r.content[K_CONTRIB]["sum"].numpy().astype(np.float64)),
                    int(r.content[K_COUNTS]["count"]),
                    int(r.content[K_COUNTS]["clipped"]),
                ),
            )
            for r in replies
            if K_CONTRIB in r.content
        ]
        arrays, metrics = aggregate(server_round, replies)
        if arrays is not None:
            out["epsilon"][server_round] = metrics["epsilon"]
        return arrays, metrics

    def handed_on(server_round, replies):  # the release leaves: the wrapped strategy's turn
        out["durable_at"][server_round] = [e.round for e in ledger_file.read(path)[1]]
        return inner(server_round, replies)

    s.configure_train, s.aggregate_train, s.strategy.aggregate_train = (
        configure_train,
        aggregate_train,
        handed_on,
    )
    s.start(
        grid=LocalGrid(chain, app, {}),
        initial_arrays=arrays_of({"w": np.zeros(DIM, np.float32)}),
        num_rounds=ROUNDS,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    out.update(strategy=s, file=ledger_file.read(path))
    return out


class Replayed:
    """fedudp's ``Transport`` replaying the Flower clients' contributions, round by round; the
    client that sent none is a ``Failure``."""

    def __init__(self, contributions: dict) -> None:
        self.contributions = contributions

    def train(self, shared, cohort, round_):
        got = self.contributions[round_]
        answered = {j for j, _ in got}
        return Collected(
            [OwnerReply(("w",), c) for _, c in got],
            [Failure(j, 0, "no contribution") for j in range(CLIENTS) if j not in answered],
        )

    def evaluate(self, shared, round_, while_waiting=None):
        if while_waiting is not None:
            while_waiting()
        return Evaluation(np.zeros(CLIENTS), np.zeros(CLIENTS))

    def personal(self):
        return {}

    def info(self):
        return {}


def billboard_run(target: float, contributions: dict, tmp: Path) -> dict:
    """A ``Billboard`` with the wrapper's estimator, budget and minimum, over the replay."""
    agg = aggregator()
    led = Ledger(
        unit="user",
        adjacency=ADJACENCY,
        accounting="certified",
        guarantee=agg.guarantee,
        mechanism=agg.name,
        accountant=agg.accountant,
        delta=DELTA,
        target_epsilon=target,
    )
    bb = Billboard(
        {"w": torch.zeros(DIM, dtype=torch.float64)},
        agg,
        agg.sampling,
        led,
        accountant_for(agg.dp_event(), agg.group, target),
        seed=SEED,
        target_epsilon=target,
        delta=DELTA,
        min_owners=MIN_OWNERS,
        owner_units=(PER,) * CLIENTS,
    )
    path = tmp / "billboard.jsonl"
    ledger_file.write(path, ledger_file.head(led), [])
    bb.ledger_sink = ledger_file.LedgerFile(path).append
    durable_at, step = {}, ServerStep(1.0)

    def stepping(u, mean):  # the release leaves: the step, then the broadcast
        durable_at[bb.ledger.entries[-1].round] = [e.round for e in ledger_file.read(path)[1]]
        return step(u, mean)

    bb.step = stepping
    lines: list[dict] = []
    res = run_rounds(ROUNDS, ROUNDS, bb, Replayed(contributions), np.ones(CLIENTS), lines.append)
    return {
        "board": bb,
        "result": res,
        "epsilon": {x["round"]: x["epsilon"] for x in lines if "epsilon" in x},
        "withheld": tuple(bb.withheld),
        "stopped_at": res.rounds_completed + 1 if res.stop_reason == "budget" else None,
        "durable_at": durable_at,
        "file": ledger_file.read(path),
    }


def decisions(run: dict) -> tuple:
    """(released rounds, withheld rounds, the round the budget stopped before)."""
    entries = (run["strategy"] if "strategy" in run else run["board"]).ledger.entries
    withheld = (
        tuple(r for r, _ in run["strategy"].withheld) if "strategy" in run else run["withheld"]
    )
    return tuple(e.round for e in entries), withheld, run["stopped_at"]


def lines(run: dict) -> list[dict]:
    return [
        asdict(e) for e in (run["strategy"] if "strategy" in run else run["board"]).ledger.entries
    ]


@pytest.fixture(scope="module")
def honest(target, tmp_path_factory):
    """The wrapper's run and the billboard's over its contributions (once for the module)."""
    from flwr.supercore.task_identity import TaskIdentity

    tmp = tmp_path_factory.mktemp("release_path")
    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    try:
        fl = flower_run(target, tmp)
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old
    return target, tmp, fl, billboard_run(target, fl["contributions"], tmp)


def test_both_paths_make_the_same_releases_and_ledger(honest):
    _, _, fl, bb = honest
    # the scenario has teeth: a withheld round, releases before and after, then the budget stop
    assert decisions(bb) == decisions(fl) == ((1, 3), (2,), 4)
    assert bb["result"].stop_reason == "budget"
    assert fl["strategy"].stopped.startswith("budget: round 4's release would reach epsilon")
    assert bb["epsilon"] == fl["epsilon"] and list(fl["epsilon"]) == [1, 3]
    got, want = lines(fl), lines(bb)
    assert got == want  # event, noise multiplier, std, sampling rate, ε, RDP ε, SHA-256
    assert len({e["release_sha256"] for e in got}) == 2 and all(e["epsilon"] for e in got)
    assert fl["strategy"].epsilon == bb["board"].gate.epsilon() == got[-1]["epsilon"]
    # durable before the release leaves, and the same lines on disk
    assert fl["durable_at"] == bb["durable_at"] == {1: [1], 3: [1, 3]}
    assert [asdict(e) for e in fl["file"][1]] == [asdict(e) for e in bb["file"][1]] == want
    assert fl["file"][0]["extra"]["outcome"]["released"] == 2  # the final head, at the end


def test_twin_with_a_second_budget_rule_is_caught(honest, tmp_path):
    """A wrapper that keeps its own budget rule without the slack stops a round early."""
    target, _, _, bb = honest

    class NoSlack(ReleaseGate):
        def over_budget(self, event):
            eps = self.epsilon_if(event)
            return None if eps <= self.target_epsilon else f"release would reach {eps}"

    twin = flower_run(target, tmp_path, NoSlack)
    assert decisions(twin) != decisions(bb) and lines(twin) != lines(bb)
    assert decisions(twin) == ((1,), (), 2)  # stopped before round 2 (ε2 is just above target)


def test_twin_composing_before_the_fail_closed_decision_is_caught(honest, tmp_path):
    """A wrapper that composes a round's event before deciding to withhold it spends ε on the
    withheld round."""
    target, _, fl, bb = honest

    class ComposesFirst(ReleaseGate):
        event = aggregator().dp_event()  # the wrapper's event (the same estimator)

        def withhold(self, *a, **k):
            self.accountant.compose(self.event)
            return super().withhold(*a, **k)

        def append(self, entry, event):  # already composed: ledgered as it stands
            eps = float(self.accountant.epsilon(self.delta))
            entry = replace(entry, epsilon=eps, epsilon_rdp=self.accountant.epsilon_rdp(DELTA))
            self.ledger.entries.append(entry)
            if self.sink is not None:
                self.sink(entry)
            return entry

    twin = flower_run(target, tmp_path, ComposesFirst)
    assert decisions(twin) != decisions(bb)
    # the withheld round spent ε: two rounds' worth after one release, and the budget stops it
    assert decisions(twin) == ((1,), (2,), 3)
    assert twin["strategy"].epsilon > twin["strategy"].ledger.entries[-1].epsilon


def test_twin_writing_the_line_after_the_update_left_is_caught(honest, tmp_path):
    """A wrapper whose ledger line reaches the file one release late (as a ledger written at
    the end, or with the next round's metrics, would): the update left before its line."""
    target, _, fl, _ = honest

    class Late(ReleaseGate):
        pending = None

        def append(self, entry, event):
            sink, self.sink = self.sink, None
            try:
                out = super().append(entry, event)
            finally:
                self.sink = sink
            if self.pending is not None and sink is not None:
                sink(self.pending)
            self.pending = out
            return out

    twin = flower_run(target, tmp_path, Late)
    assert twin["durable_at"] == {1: [], 3: [1]} != fl["durable_at"]
    assert lines(twin) == lines(fl)  # the same releases and ledger in memory: only the order


ACCOUNTING = {"compose", "epsilon", "epsilon_if", "epsilon_rdp"}


def copies(cls: type) -> list[str]:
    """What the module of ``cls`` does that is the release path's: an accountant's method
    called on anything but the gate, the fail-closed rule called, a budget slack written, a
    ledger entry built or appended."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            on = ast.unparse(n.func.value)
            if n.func.attr in ACCOUNTING and not on.endswith("gate"):
                out.append(ast.unparse(n))
            if n.func.attr == "append" and on.endswith("entries"):
                out.append(ast.unparse(n))
        if isinstance(n, ast.Call) and ast.unparse(n.func) in ("withhold_reason", "LedgerEntry"):
            if not (n.keywords and n.keywords[0].arg is None):  # LedgerEntry(**saved): a reading
                out.append(ast.unparse(n))
        if isinstance(n, ast.Constant) and n.value == BUDGET_SLACK:
            out.append(repr(n.value))
    return out


def test_neither_side_keeps_a_copy_of_the_rules():
    assert copies(UserLevelDP) == [] and copies(Billboard) == []
    assert isinstance(UserLevelDP(FedAvg(), aggregator(), delta=DELTA).gate, ReleaseGate)
    # the check has teeth: the release path's own module is where every one of them is
    assert len(copies(ReleaseGate)) >= 4
