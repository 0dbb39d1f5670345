"""The Flower wrapper withholds from public numbers only (issue 49, docs/flower-apps.md#fail-closed).

``UserLevelDP`` calls the billboard's rule (``fedudp.billboard.fail_closed.withhold_reason``):
the clients that answered and the user slots they declare (``users-per-client``), never how many
of their users were sampled. In this process (test_flower_secure's grid and fake app), client 2
of three fails every round; the release decisions of different seeded samples and of a neighbour
(one user's data removed: its slot trains nothing) are identical. The weakened twin, a client
that reports its sampled count as its users (the old rule, from the client side), is caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp.strategy import FedAvg

from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.flower import K_COUNTS, RunFailed, UserLevelDP, user_level_mod
from test_flower_secure import CLIP, DIM, PER, RATE, Z, App, LocalGrid, arrays_of, N
from test_flower_secure import server_identity  # noqa: F401  (autouse: the ServerApp's identity)

ROUNDS, FAILING_NODE, SEEDS = 4, 102, (0, 1, 2, 3)


class NeighbourApp(App):
    """The fake app without one user's data: that user's step changes nothing."""

    def __init__(self, removed: int | None) -> None:
        super().__init__()
        self.removed = removed

    def __call__(self, msg, context):
        if int(context.node_config["partition-id"]) != self.removed:
            return super().__call__(msg, context)
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)


def sampled_count_as_users(mod):
    """The weakened twin: the client reports how many users it sampled as its users."""

    def twin(msg, context, call_next):
        reply = mod(msg, context, call_next)
        if not reply.has_error() and K_COUNTS in reply.content:
            counts = reply.content[K_COUNTS]
            counts["users"] = int(counts["count"])
        return reply

    return twin


def decisions(seed: int, min_users: int, removed: int | None = None, twin=False) -> tuple:
    """(withheld rounds, released rounds, how the run ended) of one run."""
    mod = user_level_mod(users_per_client=PER)
    if twin:
        mod = sampled_count_as_users(mod)

    def chain(msg, context, call_next):
        if msg.metadata.dst_node_id == FAILING_NODE:  # infrastructure: no contribution
            return Message(RecordDict(), reply_to=msg)
        return mod(msg, context, call_next)

    grid = LocalGrid(chain, NeighbourApp(removed), {})
    s = UserLevelDP(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
        GaussianAggregator(CLIP, Z, Sampling(RATE, N)),
        delta=1e-5,
        seed=seed,
        randomness="seeded",
        min_users=min_users,
    )
    end = "completed"
    try:
        s.start(
            grid=grid,
            initial_arrays=arrays_of({"w": np.zeros(DIM, np.float32)}),
            num_rounds=ROUNDS,
            train_config=ConfigRecord({"lr": 0.1}),
        )
    except RunFailed:
        end = "failed"
    return tuple(r for r, _ in s.withheld), tuple(e.round for e in s.ledger.entries), end


def all_decisions(min_users: int, twin=False) -> set[tuple]:
    return {decisions(seed, min_users, removed, twin) for seed in SEEDS for removed in (None, 5)}


@pytest.mark.parametrize(
    "min_users,want",
    [
        (8, ((), tuple(range(1, ROUNDS + 1)), "completed")),  # 2 clients x 4 slots answer
        (9, (tuple(range(1, ROUNDS + 1)), (), "failed")),
    ],
)
def test_decisions_follow_only_the_answering_clients_declared_slots(min_users, want):
    assert all_decisions(min_users) == {want}


def test_twin_reporting_the_sampled_count_is_caught():
    # min_users=4 is met by the 8 declared slots every round; the sampled count of the two
    # answering clients (Binomial(8, 0.5)) falls below it in some rounds of some samples
    assert len(all_decisions(4, twin=True)) > 1
    assert all_decisions(4) == {((), tuple(range(1, ROUNDS + 1)), "completed")}
