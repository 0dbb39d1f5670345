"""Evaluation with Flower Datasets' partitioners under ``user_level_mod`` (docs/flower-apps.md#
evaluation-and-the-apps-metrics): an app that loads its data the way Flower's quickstart does (a
partitioner created once, with the first ``num_partitions`` it is asked for, then cached) and
evaluates through ``client_users`` sees exactly its client's users' records, whichever of
training and evaluation comes first; the quickstart's unchanged evaluation (``partition-id`` of
``num-partitions``) reads one user's slice instead, which the test catches."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict

pytest.importorskip("flwr_datasets")
from datasets import Dataset  # noqa: E402
from flwr_datasets.partitioner import IidPartitioner  # noqa: E402
from test_flower_mod import arrays_of, broadcast, context, server_message, train_message  # noqa: E402

from fedudp.flower import client_users, user_level_mod  # noqa: E402

N, K, CLIENTS, RECORDS = 12, 4, 3, 600  # users, users per client, clients, records


class QuickstartData:
    """``load_data(partition_id, num_partitions)`` as Flower's quickstart writes it: the
    partitioner is built on the first call and cached, whatever later calls ask for."""

    def __init__(self) -> None:
        self.partitioner: IidPartitioner | None = None
        self.dataset = Dataset.from_dict({"idx": list(range(RECORDS))})

    def load_data(self, partition_id: int, num_partitions: int) -> list[int]:
        if self.partitioner is None:
            self.partitioner = IidPartitioner(num_partitions=num_partitions)
            self.partitioner.dataset = self.dataset
        return list(self.partitioner.load_partition(partition_id)["idx"])


class App:
    def __init__(self, via_client_users: bool) -> None:
        self.data, self.via = QuickstartData(), via_client_users
        self.evaluated: list[int] = []

    def __call__(self, msg: Message, ctx: Context) -> Message:
        nc = ctx.node_config
        if msg.metadata.message_type == "train":
            rows = self.data.load_data(nc["partition-id"], nc["num-partitions"])
            got = {k: v.numpy() for k, v in msg.content["arrays"].items()}
            return Message(
                RecordDict(
                    {
                        "arrays": arrays_of(got),
                        "metrics": MetricRecord({"num-examples": len(rows)}),
                    }
                ),
                reply_to=msg,
            )
        if self.via:  # the walk-through's evaluation: every user of this client
            users, n = client_users(ctx)
            self.evaluated = [i for u in users for i in self.data.load_data(u, n)]
        else:  # the quickstart's, unchanged
            self.evaluated = self.data.load_data(nc["partition-id"], nc["num-partitions"])
        return Message(
            RecordDict({"metrics": MetricRecord({"num-examples": len(self.evaluated)})}),
            reply_to=msg,
        )


def the_clients_records(p: int) -> set[int]:
    """Client p's records: the union of Flower Datasets' IidPartitioner(N) partitions of its
    users p*K .. p*K + K - 1."""
    part = IidPartitioner(num_partitions=N)
    part.dataset = Dataset.from_dict({"idx": list(range(RECORDS))})
    return {i for u in range(p * K, (p + 1) * K) for i in part.load_partition(u)["idx"]}


def evaluate(mod, app, ctx) -> None:
    mod(server_message(RecordDict({"arrays": arrays_of(broadcast(2))}), "evaluate"), ctx, app)


@pytest.mark.parametrize("train_first", [True, False])
def test_evaluation_through_client_users_sees_the_clients_whole_data(train_first):
    mod, app = user_level_mod(users_per_client=K), App(via_client_users=True)
    ctx = context(1, CLIENTS)
    ctx.run_config = {"fedudp.public.users": N}
    if train_first:
        assert not mod(train_message(broadcast(1), 1, 1.0, N, 1.0), ctx, app).has_error()
    evaluate(mod, app, ctx)
    want = the_clients_records(1)
    assert len(want) == K * RECORDS // N
    assert sorted(app.evaluated) == sorted(want)


def test_the_quickstarts_unchanged_evaluation_reads_one_users_slice():
    """The weakened twin: after training (partitioner cached at N partitions) the unchanged
    evaluation loads partition ``partition-id`` = 1 of N, user 1's records, which belong to
    another client."""
    mod, app = user_level_mod(users_per_client=K), App(via_client_users=False)
    ctx = context(1, CLIENTS)
    mod(train_message(broadcast(1), 1, 1.0, N, 1.0), ctx, app)
    evaluate(mod, app, ctx)
    assert len(app.evaluated) == RECORDS // N  # one user's slice
    assert not set(app.evaluated) & the_clients_records(1)
    assert np.isin(app.evaluated, sorted(the_clients_records(0))).all()
