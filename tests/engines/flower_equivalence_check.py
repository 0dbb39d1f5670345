"""Run by tests/engines/test_flower_user_dp.py in a fresh process (Flower's simulation keeps
state between runs in one process): ``python flower_equivalence_check.py AGGREGATOR``.

The same federation, model, seed and estimator twice:

* fedudp's own engine (``fedudp.simulate``, engine=local, full DP: every parameter shared, the
  users' local deltas, the server step u + mean);
* a plain Flower app: Flower's ``FedAvg`` wrapped by ``UserLevelDP`` with fedudp's calibrated
  estimator (the one the builder made for the run above), the ClientApp with
  ``user_level_mod(users_of=...)`` holding the same owners' users, its training step one SGD
  step on a user's records, as fedudp's owner takes for a user with batch >= its records.

Prints one JSON line: the largest difference of the final shared parameters, both ledgers'
per-round (ε, σ, event), each side's released user counts."""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
import torch.nn as nn

OWNERS, USERS_PER_OWNER, FEATURES, SEED, LR = 4, 5, 10, 11, 0.5
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 2))


def records():
    import fedudp

    rng = np.random.default_rng(5)
    sizes = 2 + rng.integers(0, 5, OWNERS * USERS_PER_OWNER)  # 2..6 records per user
    user = np.repeat(np.arange(len(sizes)), sizes)
    owner = user // USERS_PER_OWNER
    y = rng.integers(0, 2, len(user))
    x = rng.standard_normal((len(user), FEATURES)) + 1.2 * (2 * y[:, None] - 1)
    first = np.r_[0, np.cumsum(sizes)[:-1]]  # each user's first record: a test set
    test = fedudp.from_arrays(x[first].astype(np.float32), y[first], user[first], owner[first])
    return fedudp.from_arrays(x.astype(np.float32), y, user, owner), test


def config(aggregator: str) -> dict:
    users = OWNERS * USERS_PER_OWNER
    cfg = {
        "method": "full_dp",
        "aggregator": aggregator,
        "engine": "local",
        "seed": SEED,
        "privacy.epsilon": 8.0,
        "privacy.delta": 1e-5,
        "privacy.clip": 1.0,
        "train.rounds": ROUNDS,
        # the rows estimators are analysed replace-one with a public n: every user, every round
        "train.sampling_rate": 0.6 if aggregator == "gaussian" else 1.0,
        "train.local_epochs": 1,
        "train.batch_size": 64,
        "train.lr": LR,
        "train.server_lr": 1.0,
        "train.shared_update": "delta",
        "partition.owner_rule": "given",
        "partition.num_owners": OWNERS,
        "public.users": users,
        "public.owner_capacity": USERS_PER_OWNER,
        "public.records_per_user": 6,
        "dataset.classes": 2,
        "dataset.input_shape": [FEATURES],
    }
    return cfg


def main(aggregator: str) -> None:
    import fedudp
    from fedudp import build
    from fedudp.api import _config

    train, test = records()
    cfg = config(aggregator)
    ours = fedudp.simulate(cfg, records=(train, test), model=make_model())
    prep = build.prepare(
        _config({"dataset.name": "memory", **cfg}), model_object=make_model(), records=(train, test)
    )
    fed, agg = prep.fed, prep.aggregator

    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    from fedudp.flower import UserLevelDP, user_level_mod

    offsets, by_owner = fed.user_offsets, fed.owner_user_offsets

    def users_of(context: Context) -> list[int]:
        p = int(context.node_config["partition-id"])
        return list(range(int(by_owner[p]), int(by_owner[p + 1])))

    client = ClientApp(mods=[user_level_mod(users_of=users_of)])

    @client.train()
    def train_fn(msg: Message, context: Context) -> Message:
        model = make_model()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        u = int(context.node_config["partition-id"])  # the mod's user
        x, y = fed.x[offsets[u] : offsets[u + 1]], fed.y[offsets[u] : offsets[u + 1]]
        opt = torch.optim.SGD(model.parameters(), lr=float(msg.content["config"]["lr"]))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        return Message(
            RecordDict(
                {
                    "arrays": ArrayRecord(model.state_dict()),
                    "metrics": MetricRecord({"num-examples": len(y)}),
                }
            ),
            reply_to=msg,
        )

    out: dict = {}
    server = ServerApp()

    @server.main()
    def server_main(grid: Grid, context: Context) -> None:
        s = UserLevelDP(
            # every client in every round: the first round waits for all the nodes (with
            # FedAvg's default minimum of 2 it may start with the first two that connected)
            FedAvg(
                fraction_train=1.0,
                fraction_evaluate=0.0,
                min_train_nodes=OWNERS,
                min_available_nodes=OWNERS,
            ),
            agg,
            delta=float(cfg["privacy.delta"]),
            target_epsilon=float(cfg["privacy.epsilon"]),
            seed=SEED,
            randomness="seeded",
        )  # reproducible: fedudp's engine's streams
        res = s.start(
            grid=grid,
            initial_arrays=ArrayRecord(make_model().state_dict()),
            num_rounds=ROUNDS,
            train_config=ConfigRecord({"lr": LR}),
        )
        out["arrays"], out["strategy"] = res.arrays, s
        out["users"] = [int(m["users"]) for _, m in sorted(res.train_metrics_clientapp.items())]

    run_simulation(
        server_app=server,
        client_app=client,
        num_supernodes=OWNERS,
        backend_name="ray",
        backend_config={
            "client_resources": {"num_cpus": 1.0, "num_gpus": 0.0},
            "init_args": {"address": "local"},
        },
    )
    theirs = out["arrays"].to_torch_state_dict()
    diff = max(
        float((theirs[k].double() - ours.shared[k].double()).abs().max()) for k in ours.shared
    )
    scale = max(float(v.abs().max()) for v in ours.shared.values())
    moved = max(
        float((ours.shared[k].double() - v.double()).abs().max())
        for k, v in make_model().state_dict().items()
    )
    led = out["strategy"].ledger
    print(
        json.dumps(
            {
                "aggregator": aggregator,
                "max_abs_diff": diff,
                "scale": scale,
                "moved": moved,
                "shared_keys": sorted(ours.shared),
                "flower_keys": sorted(theirs),
                "ours": [[e.round, e.epsilon, e.noise_std, e.event] for e in ours.ledger.entries],
                "flower": [[e.round, e.epsilon, e.noise_std, e.event] for e in led.entries],
                "ours_users": [h["users_used"] for h in ours.history],
                "flower_users": out["users"],
                "ours_epsilon": ours.epsilon,
                "flower_epsilon": out["strategy"].epsilon,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
