"""``fedudp.flower``: user-level DP inside a plain Flower PyTorch app (examples/flower_user_dp):
the strategy wrapper around Flower's FedAvg and the client mod, on Flower's simulation engine.

What is released is checked, not only that it runs: the ledger's ε equals a direct dp-accounting
computation with the literal constants; with the noise made negligible the released update is
the mean of the users' clipped updates over the public q·N, each user's update recomputed here
with the app's own training step on that user's data alone; no personal parameter crosses."""

from __future__ import annotations

import sys
from pathlib import Path

import dp_accounting
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "flower_user_dp"))

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # Ray simulations: ~1 min each


def simulate(server_app, client_app, clients: int = 4) -> None:
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


def test_the_example_app_is_user_level_dp_with_a_direct_epsilon():
    from user_dp_app import client_app, server_app

    simulate(server_app.app, client_app.app)
    strategy = server_app.RESULT["strategy"]
    d = server_app.DEFAULTS
    assert len(strategy.ledger.entries) == d["num-server-rounds"]
    z = strategy.aggregator.noise_multiplier
    # the ledger's epsilon, recomputed directly: 3 Poisson(0.5)-sampled Gaussian releases
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(0.5, dp_accounting.GaussianDpEvent(z)), 3
        )
    )
    direct = acc.get_epsilon(1e-5)
    assert strategy.ledger.entries[-1].epsilon == pytest.approx(direct, rel=1e-3)
    assert direct <= d["fedudp.privacy.epsilon"] * (1 + 1e-6)
    assert strategy.ledger.extra["public"] == {"users": 40, "user_sampling_rate": 0.5}
    # the server's history: every round's metrics carry the app's own training loss
    # (record-weighted over the users) beside epsilon, the users released and failed clients
    history = server_app.RESULT["result"].train_metrics_clientapp
    assert sorted(history) == [1, 2, 3]
    for r, m in history.items():
        assert m["epsilon"] == pytest.approx(strategy.ledger.entries[r - 1].epsilon)
        assert m["failed_clients"] == 0 and m["clients"] == 4 and 0 < m["users"] <= 40
        assert 0.0 < m["train_loss"] < 5.0
    # before round 1 the wrapper logged the noise on the released mean: z*C/(q*N)
    assert strategy.utility["noise_std"] == pytest.approx(z * 1.0 / (0.5 * 40))
    assert strategy.utility["expected_cohort"] == 20.0


def test_the_release_is_the_mean_of_the_users_clipped_updates():
    """The new global model is the broadcast plus (the sum of the sampled users' clipped updates
    + the round's keyed Gaussian noise of std z·C) over the public q N: each update recomputed
    from the app's own training step on that user's partition, the noise from the keyed
    generator (float64), the sample from the keyed Poisson mask. Run in a fresh process: Flower's
    simulation keeps state between runs in one process."""
    import subprocess

    p = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("flower_release_check.py"))],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("release ok"), p.stderr[-3000:]


def test_personal_layers_never_leave_the_clients():
    """With the output layer personal (``personal=["2.*"]`` on both sides), every reply the
    server receives carries only the shared layers' clipped sum (its length the shared
    dimension) and counts: no personal name, no personal-sized array; the server never moves
    the personal layer; the clients keep theirs in ``context.state``."""
    from flwr.app import ArrayRecord, ConfigRecord, Context
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from fedudp.aggregators import GaussianAggregator, Sampling
    from fedudp.flower import K_CONTRIB, UserLevelDP, user_level_mod
    from flower_faults import SendRecorder
    from user_dp_app import client_app
    from user_dp_app.task import make_model

    personal = ["2.*"]
    app_client = ClientApp(mods=[user_level_mod(users_per_client=10, personal=personal)])
    app_client.train()(client_app.train_fn)
    got, out = [], {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        agg = GaussianAggregator(1.0, 1.0, Sampling(0.5, 30))
        s = UserLevelDP(
            FedAvg(fraction_train=1.0, fraction_evaluate=0.0),
            agg,
            delta=1e-5,
            personal=personal,
            seed=3,
        )
        init = ArrayRecord(make_model().state_dict())
        res = s.start(
            grid=SendRecorder(grid, got),
            initial_arrays=init,
            num_rounds=2,
            train_config=ConfigRecord({"lr": 0.5}),
        )
        out["init"], out["final"] = init, res.arrays

    simulate(app, app_client, 3)
    model = make_model()
    shared_dim = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("2."))
    personal_names = [n for n, _ in model.named_parameters() if n.startswith("2.")]
    # 3 clients x 2 rounds; after other simulations in the same process a reply can be missing
    # (Flower's simulation state between runs, docs/flower-apps.md): every one that came is checked
    assert 3 <= len(got) <= 6
    for msg in got:
        assert not msg.has_error()
        # the contribution, the counts and the app's training metrics (scalars, no arrays)
        assert set(msg.content.keys()) == {K_CONTRIB, "fedudp.counts", "metrics"}
        assert set(msg.content["metrics"].keys()) == {"train_loss", "num-examples"}
        arrays = msg.content[K_CONTRIB]
        assert list(arrays.keys()) == ["sum"] and arrays["sum"].shape == (shared_dim,)
        assert not any(name in str(msg.content) for name in personal_names)
    for name in personal_names:  # the server never moves them
        assert (out["final"][name].numpy() == out["init"][name].numpy()).all()
    assert any(
        (out["final"][k].numpy() != out["init"][k].numpy()).any()
        for k in out["init"].keys()
        if k not in personal_names
    )


@pytest.mark.parametrize("aggregator", ["gaussian", "winsorized"])
def test_the_wrapper_and_mod_equal_fedudps_own_engine(aggregator):
    """The same federation, model, seed and calibrated estimator through Flower's FedAvg wrapped
    by ``UserLevelDP`` with ``user_level_mod`` (tests/engines/flower_equivalence_check.py) and
    through fedudp's own engine: the same shared parameters after 3 rounds (float32 summation
    order apart), the same users per round, the same ledger (events, σ, ε per round)."""
    import json
    import subprocess

    p = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("flower_equivalence_check.py")),
            aggregator,
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["shared_keys"] == got["flower_keys"]
    assert got["moved"] > 0.1  # the model did move, three times
    assert got["max_abs_diff"] <= 1e-6 * max(1.0, got["moved"])
    assert got["ours_users"] == got["flower_users"] and len(got["ours_users"]) == 3
    if aggregator == "gaussian":
        assert 0 < min(got["ours_users"]) < 20  # Poisson(0.6) samples of 20 users
    else:
        assert got["ours_users"] == [20, 20, 20]
    assert len(got["ours"]) == len(got["flower"]) == 3
    for a, b in zip(got["ours"], got["flower"]):
        assert a[0] == b[0] and a[2] == b[2] and a[3] == b[3]  # round, sigma, event
        assert a[1] == pytest.approx(b[1], rel=1e-12)  # epsilon
    assert got["ours_epsilon"] == pytest.approx(got["flower_epsilon"], rel=1e-12)
    assert got["ours_epsilon"] <= 8.0 * (1 + 1e-6)
