"""Run by tests/engines/test_flower_user_dp.py in a fresh process (see there)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "flower_user_dp"))


def simulate(server_app, client_app, clients: int) -> None:
    from flwr.simulation import run_simulation

    run_simulation(
        server_app=server_app,
        client_app=client_app,
        num_supernodes=clients,
        backend_name="ray",
        backend_config={
            "client_resources": {"num_cpus": 1.0, "num_gpus": 0.0},
            "init_args": {"address": "local"},
        },
    )


def main() -> None:
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from fedudp.aggregators import GaussianAggregator, Sampling
    from fedudp.flower import UserLevelDP, sampled_users
    from fedudp.randomness import Purpose, torch_generator
    from user_dp_app import client_app
    from user_dp_app.task import load_data, make_model, train

    clients, per, rate, clip, lr, z = 3, 10, 0.6, 0.05, 0.5, 1.3
    agg = GaussianAggregator(clip, z, Sampling(rate, clients * per))
    out: dict = {}
    app = ServerApp()

    @app.main()
    def server(grid: Grid, context: Context) -> None:
        s = UserLevelDP(
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0),
            agg,
            delta=1e-5,
            seed=7,
            randomness="seeded",
        )  # the noise regenerated below
        res = s.start(
            grid=grid,
            initial_arrays=ArrayRecord(make_model().state_dict()),
            num_rounds=1,
            train_config=ConfigRecord({"lr": lr}),
        )
        out["arrays"], out["strategy"] = res.arrays, s

    simulate(app, client_app.app, clients)
    start = make_model().state_dict()
    flat = lambda sd: torch.cat([v.reshape(-1).double() for v in sd.values()])  # noqa: E731
    users = sampled_users(range(clients * per), 7, 1, rate, clients * per)
    assert 0 < len(users) < clients * per
    total = torch.zeros_like(flat(start))
    for u in users:
        m = make_model()
        m.load_state_dict(start)
        x, y = load_data(u, clients * per)
        train(m, x, y, lr=lr)
        g = flat(m.state_dict()) - flat(start)
        total += g * min(1.0, clip / float(torch.linalg.vector_norm(g)))
    noise = torch.randn(
        total.shape, generator=torch_generator(7, Purpose.NOISE, 1), dtype=torch.float64
    )
    want = flat(start) + (total + z * clip * noise) / (rate * clients * per)
    got = flat(out["arrays"].to_torch_state_dict())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert out["strategy"].ledger.entries[0].round == 1
    print("release ok")


if __name__ == "__main__":
    main()
