"""``fedudp.flower`` in a deployment's terms, in this process (no simulation, no Ray): Flower's
own ``FedAvg`` wrapped by ``UserLevelDP``, driven by Flower's own ``Strategy.start`` over a grid
written here that hands every message to ``user_level_mod`` and a fake training step.

* Secure randomness (the wrapper's default): a client knows the run config's seed, everything
  in the ``fedudp.dp`` record it receives and the round numbers; it regenerates every stream it
  can derive from them (every ``Purpose``, plausible seeds and keys) and subtracts each from the
  release: the clipped mean is never recovered (error of the order of the noise), and the users
  that trained are not the ones the seeded sample names. The seeded twin, same constants: the
  client recovers the clipped mean to float32 precision, so the test has teeth.
* Fail closed: every client fails (a ``fedudp.users-per-client`` mismatch): no release, the
  model unchanged, no ε spent, each client's reason in the server's log, ``RunFailed``; a round
  below ``min_owners`` is withheld while the others release; ε and δ are required.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import pytest
import torch
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
from flwr.serverapp.strategy import FedAvg

from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.flower import (
    K_CONTRIB,
    K_DP,
    RunFailed,
    UserLevelDP,
    sampled_users,
    user_level_mod,
)
from fedudp.randomness import KEYS, Purpose, numpy_rng, torch_generator

CLIENTS, PER = 3, 4  # 12 users, client p holds users 4p .. 4p + 3
N, RATE, CLIP, Z, SEED, ROUNDS = CLIENTS * PER, 0.5, 0.5, 1.0, 11, 2
DIM = 48  # one shared array of 48 values
NOISE_STD_MEAN = Z * CLIP / (RATE * N)  # the noise's std on each released coordinate


@pytest.fixture(autouse=True)
def server_identity():
    """What Flower's ServerApp runtime sets before ``main`` (a message made on the server
    reads its run id from it), restored afterwards."""
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


def arrays_of(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


class App:
    """A fake training step: user u moves every parameter by (u + 1) / 100 (users 7.. clipped
    at 0.5); records which users trained in which round."""

    def __init__(self) -> None:
        self.trained: list[tuple[int, int]] = []  # (round, user)

    def __call__(self, msg: Message, context: Context) -> Message:
        u = int(context.node_config["partition-id"])
        self.trained.append((int(msg.content["config"]["server-round"]), u))
        w = msg.content["arrays"]["w"].numpy()
        return Message(
            RecordDict(
                {
                    "arrays": arrays_of({"w": w + np.float32((u + 1) / 100)}),
                    "metrics": MetricRecord({"num-examples": 1}),
                }
            ),
            reply_to=msg,
        )


class LocalGrid:
    """The ``Grid`` calls ``Strategy.start`` makes, answered in this process: each message goes
    to its node's ClientApp chain (``user_level_mod`` then ``App``) with that node's context;
    ``replies`` keeps what the server received."""

    def __init__(self, mod, app, run_config: dict) -> None:
        self.mod, self.app = mod, app
        self.contexts = {
            100 + p: Context(
                run_id=1,
                node_id=100 + p,
                node_config={"partition-id": p, "num-partitions": CLIENTS},
                state=RecordDict(),
                run_config=run_config,
            )
            for p in range(CLIENTS)
        }
        self.sent: list[Message] = []
        self.replies: list[Message] = []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for m in messages:
            self.sent.append(m)
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
            out.append(self.mod(msg, self.contexts[dst], self.app))
        self.replies += out
        return out


def run(randomness: str, run_config: dict | None = None, rounds: int = ROUNDS, **kw):
    """``rounds`` rounds; returns (strategy, grid, app, the arrays after each round)."""
    app = App()
    grid = LocalGrid(user_level_mod(users_per_client=PER), app, run_config or {})
    agg = GaussianAggregator(CLIP, Z, Sampling(RATE, N))
    s = UserLevelDP(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
        agg,
        delta=1e-5,
        seed=SEED,
        randomness=randomness,
        **kw,
    )
    init = arrays_of({"w": np.zeros(DIM, np.float32)})
    after: list[np.ndarray] = []
    inner = s.aggregate_train

    def recording(server_round, replies):
        arrays, metrics = inner(server_round, replies)
        if arrays is not None:
            after.append(arrays["w"].numpy().astype(np.float64))
        return arrays, metrics

    s.aggregate_train = recording
    s.start(
        grid=grid, initial_arrays=init, num_rounds=rounds, train_config=ConfigRecord({"lr": 0.1})
    )
    return s, grid, app, after


def candidate_noises(known: list[int], round_: int):
    """Every standard-normal [DIM] vector a client can regenerate: each purpose's stream, from
    every seed it could guess (the run config's, the numbers in its fedudp.dp record, 0), every
    key tuple over those numbers and small integers, drawn through torch's and numpy's
    constructors as fedudp draws them."""
    seeds = sorted({0, SEED, *known})
    values = sorted({0, 1, 2, round_, *known})
    for p in Purpose:
        for seed in seeds:
            for keys in itertools.product(values, repeat=len(KEYS[p])):
                if any(not 0 <= v < 2**32 for v in (seed, *keys)):
                    continue
                yield torch.randn(
                    DIM, generator=torch_generator(seed, p, *keys), dtype=torch.float64
                ).numpy()
                yield numpy_rng(seed, p, *keys).standard_normal(DIM)


def best_recovery(randomness: str) -> tuple[float, float, bool]:
    """(the smallest RMS error of a client's estimate of round 1's clipped mean over every
    stream it regenerates, the RMS of the release's own noise, whether the users that trained
    are the ones the seeded sample names)."""
    s, grid, app, after = run(randomness, rounds=1)
    (released,) = after
    sent = grid.sent[0].content[K_DP]
    assert ("seed" in sent) == (randomness == "seeded")  # the seed only when seeded
    known = [
        int(v) for k, v in sent.items() if isinstance(v, (int, float)) and float(v).is_integer()
    ]
    # the true clipped sum: what the clients replied (the test sees every reply)
    total = sum(r.content[K_CONTRIB]["sum"].numpy() for r in grid.replies)
    mean = total / (RATE * N)
    errors = [
        float(np.sqrt(np.mean((released - Z * CLIP * n / (RATE * N) - mean) ** 2)))
        for n in candidate_noises(known, 1)
    ]
    noise_rms = float(np.sqrt(np.mean((released - mean) ** 2)))
    users = sorted(u for r, u in app.trained if r == 1)
    return min(errors), noise_rms, users == sampled_users(range(N), SEED, 1, RATE, N)


def test_secure_release_is_not_recoverable_from_anything_a_client_knows():
    err, noise_rms, same_sample = best_recovery("secure")
    assert noise_rms > 0.5 * NOISE_STD_MEAN
    assert err > 0.5 * NOISE_STD_MEAN  # every regenerated noise leaves noise-size error
    assert not same_sample  # P(equal by chance) = 2**-12


def test_seeded_twin_is_recoverable_so_the_test_has_teeth():
    err, noise_rms, same_sample = best_recovery("seeded")
    assert noise_rms > 0.5 * NOISE_STD_MEAN
    assert err < 1e-6  # the exact clipped mean, float32 apart
    assert same_sample


def test_secure_streams_differ_between_two_runs_with_the_same_seed():
    _, _, app1, a1 = run("secure")
    _, _, app2, a2 = run("secure")
    assert not np.array_equal(a1[-1], a2[-1])
    _, _, app3, a3 = run("seeded")
    _, _, app4, a4 = run("seeded")
    np.testing.assert_array_equal(a3[-1], a4[-1])
    assert sorted(app3.trained) == sorted(app4.trained)  # FedAvg orders nodes at random


def test_the_ledger_names_the_randomness():
    assert run("secure", rounds=1)[0].ledger.to_dict()["randomness"] == "secure"
    assert run("seeded", rounds=1)[0].ledger.to_dict()["randomness"] == "seeded (simulation)"


@pytest.fixture
def flwr_log():
    """The records of Flower's logger (where the wrapper logs)."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    h = Keep(level=logging.DEBUG)
    logger = logging.getLogger("flwr")
    logger.addHandler(h)
    yield records
    logger.removeHandler(h)


def test_every_client_failing_releases_nothing_spends_nothing_and_fails_the_run(flwr_log):
    app = App()
    grid = LocalGrid(
        user_level_mod(users_per_client=PER), app, {"fedudp.users-per-client": 5}
    )  # 3 x 5 = 15 users: refused by each
    s = UserLevelDP(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
        GaussianAggregator(CLIP, Z, Sampling(RATE, N)),
        delta=1e-5,
    )
    init = arrays_of({"w": np.zeros(DIM, np.float32)})
    with pytest.raises(RunFailed, match="every training round was withheld"):
        s.start(
            grid=grid, initial_arrays=init, num_rounds=3, train_config=ConfigRecord({"lr": 0.1})
        )
    assert s.ledger.entries == [] and s.ledger.epsilon == 0.0 and s.epsilon == 0.0
    assert [r for r, _ in s.withheld] == [1, 2, 3] and app.trained == []
    assert all(r.has_error() for r in grid.replies) and len(grid.replies) == 9
    text = [r.getMessage() for r in flwr_log]
    failed = [t for t in text if "failed:" in t and "UserLevelDP round" in t]
    assert len(failed) == 9  # each client's reason, every round
    assert all("calibrated for" in t or "users" in t for t in failed)
    assert sum("withheld, nothing released, no epsilon spent" in t for t in text) == 3
    assert not any("UserLevelDP round" in t and "users, epsilon" in t for t in text)


def test_a_round_below_min_owners_is_withheld_and_the_rest_release():
    # every client answers: 3 >= 3, released; with min_owners=4 every round is withheld
    s, _, _, after = run("secure", min_owners=3)
    assert len(s.ledger.entries) == ROUNDS and len(after) == ROUNDS
    with pytest.raises(RunFailed):
        run("secure", min_owners=4)
    # min_users counts the users the answering clients hold (12), not how many were sampled
    s, _, _, _ = run("secure", min_users=12)
    assert len(s.ledger.entries) == ROUNDS
    with pytest.raises(RunFailed, match="holding 12 user"):
        run("secure", min_users=13)


def test_one_failing_client_is_logged_and_the_round_still_releases(flwr_log):
    app = App()

    def flaky(msg, context, call_next):
        if int(context.node_config["partition-id"]) == 1:
            return Message(RecordDict(), reply_to=msg)  # a reply without contributions
        return user_level_mod(users_per_client=PER)(msg, context, call_next)

    grid = LocalGrid(flaky, app, {})
    s = UserLevelDP(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
        GaussianAggregator(CLIP, Z, Sampling(RATE, N)),
        delta=1e-5,
    )
    s.start(
        grid=grid,
        initial_arrays=arrays_of({"w": np.zeros(DIM, np.float32)}),
        num_rounds=1,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    assert len(s.ledger.entries) == 1
    assert any(
        "client node 101 failed" in r.getMessage() and "user_level_mod" in r.getMessage()
        for r in flwr_log
    )


def test_epsilon_and_delta_are_required_in_the_run_config():
    base = {
        "fedudp.public.users": N,
        "fedudp.train.rounds": 2,
        "fedudp.privacy.clip": 1.0,
        "fedudp.train.sampling_rate": 0.5,
        "fedudp.privacy.noise_multiplier": 1.0,
    }  # no calibration: fast
    init = arrays_of({"w": np.zeros(DIM, np.float32)})
    with pytest.raises(ValueError, match=r"^fedudp\.privacy\.epsilon: required"):
        UserLevelDP.from_run_config(FedAvg(), {**base, "fedudp.privacy.delta": 1e-5}, init)
    with pytest.raises(ValueError, match=r"^fedudp\.privacy\.delta: required"):
        UserLevelDP.from_run_config(FedAvg(), {**base, "fedudp.privacy.epsilon": 2.0}, init)
    full = {**base, "fedudp.privacy.epsilon": 2.0, "fedudp.privacy.delta": 1e-5}
    s = UserLevelDP.from_run_config(FedAvg(), full, init)
    assert s.randomness.is_secure and (s.min_owners, s.min_users) == (1, 1)  # the defaults
    s = UserLevelDP.from_run_config(
        FedAvg(),
        {
            **full,
            "fedudp.privacy.randomness": "seeded",
            "fedudp.seed": 4,
            "fedudp.train.min_owners": 2,
        },
        init,
    )
    assert not s.randomness.is_secure and s.seed == 4 and s.min_owners == 2
