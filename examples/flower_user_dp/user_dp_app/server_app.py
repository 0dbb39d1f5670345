"""The ServerApp: Flower's FedAvg, wrapped by fedudp's UserLevelDP (the fedudp lines marked)."""
from __future__ import annotations

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedudp.aggregators import GaussianAggregator, Sampling                 # fedudp
from fedudp.flower import UserLevelDP                                      # fedudp
from user_dp_app.task import make_model

app = ServerApp()
RESULT: dict = {}          # the last run's strategy (tests read its ledger)
# pyproject.toml's [tool.flwr.app.config] (flwr run passes it; run_simulation passes none)
DEFAULTS = {"num-server-rounds": 3, "num-clients": 4, "lr": 0.5, "clip": 1.0, "epsilon": 4.0,
            "delta": 1e-5, "user-rate": 0.5, "output-dir": ""}


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = {**DEFAULTS, **dict(context.run_config)}
    rounds, clients, per_client = int(rc["num-server-rounds"]), int(rc["num-clients"]), 10
    users = clients * per_client                                            # fedudp
    aggregator = GaussianAggregator.calibrated(                             # fedudp
        clip=float(rc["clip"]), epsilon=float(rc["epsilon"]), delta=float(rc["delta"]),
        rounds=rounds, sampling=Sampling(rate=float(rc["user-rate"]), population=users))
    strategy = UserLevelDP(FedAvg(fraction_train=1.0, fraction_evaluate=1.0),  # fedudp
                           aggregator, delta=float(rc["delta"]),
                           target_epsilon=float(rc["epsilon"]))
    RESULT["strategy"] = strategy
    strategy.start(grid=grid, initial_arrays=ArrayRecord(make_model().state_dict()),
                   num_rounds=rounds, train_config=ConfigRecord({"lr": float(rc["lr"])}))
    if rc.get("output-dir"):          # the ledger, for whoever ran it (flwr run --run-config)
        out = Path(str(rc["output-dir"]))
        out.mkdir(parents=True, exist_ok=True)
        (out / "ledger.json").write_text(json.dumps(strategy.ledger.to_dict(), indent=1,
                                                    default=str))
