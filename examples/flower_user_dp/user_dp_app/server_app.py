"""The ServerApp: Flower's FedAvg, wrapped by fedudp's UserLevelDP (the fedudp lines marked).

Every privacy setting comes from the run config's ``fedudp.*`` keys (pyproject.toml,
``--run-config``): the estimator, ε, δ, the clip, the user sampling rate, the rounds and the
number of users N, calibrated by fedudp (``UserLevelDP.from_run_config``) for the app's own
``num-server-rounds``.
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedudp.flower import UserLevelDP  # fedudp
from user_dp_app.task import make_model

app = ServerApp()
RESULT: dict = {}  # the last run's strategy and Flower Result (tests read them)
# pyproject.toml's [tool.flwr.app.config] (flwr run passes it; run_simulation passes none)
DEFAULTS = {
    "num-server-rounds": 3,
    "lr": 0.5,
    "output-dir": "",
    "fedudp.aggregator": "gaussian",
    "fedudp.privacy.epsilon": 4.0,
    "fedudp.privacy.delta": 1e-5,
    "fedudp.privacy.clip": 1.0,
    "fedudp.train.sampling_rate": 0.5,
    "fedudp.public.users": 40,
    "fedudp.users-per-client": 10,
    "fedudp.privacy.randomness": "secure",
    "fedudp.seed": 0,
}


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = {**DEFAULTS, **dict(context.run_config)}
    RESULT.pop("result", None)
    arrays = ArrayRecord(make_model().state_dict())
    strategy = UserLevelDP.from_run_config(  # fedudp
        FedAvg(fraction_train=1.0, fraction_evaluate=1.0), rc, arrays
    )  # fedudp
    RESULT["strategy"] = strategy
    try:  # raises fedudp.flower.RunFailed if every round was withheld: the run fails
        RESULT["result"] = strategy.start(
            grid=grid,
            initial_arrays=arrays,
            num_rounds=int(rc["num-server-rounds"]),
            train_config=ConfigRecord({"lr": float(rc["lr"])}),
        )
    finally:
        if rc.get("output-dir"):  # the ledger, for whoever ran it (flwr run --run-config)
            out = Path(str(rc["output-dir"]))
            out.mkdir(parents=True, exist_ok=True)
            (out / "ledger.json").write_text(
                json.dumps(strategy.ledger.to_dict(), indent=1, default=str)
            )
            if "result" in RESULT:  # the server's history: metrics per round
                res = RESULT["result"]
                history = {
                    what: {r: dict(m) for r, m in getattr(res, what).items()}
                    for what in ("train_metrics_clientapp", "evaluate_metrics_clientapp")
                }
                (out / "history.json").write_text(json.dumps(history, indent=1))
