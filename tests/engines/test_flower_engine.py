"""engine=flower: equivalence with engine=local, the owner boundary, failures.

All Flower runs here go through ``fedudp.run.run`` -> ``fedudp.flower.server_app.execute`` ->
``flwr.simulation.run_simulation`` with the Ray backend (in this process; one Ray stays up
between tests of the module: ``one_ray_for_the_module``). Faults are injected by the test-only
``flower_faults`` mod.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import tiny_cfg
from flower_faults import SendRecorder, inject
import fedudp.run
from fedudp.config import RunConfig, config_from_json, config_from_overrides, config_to_json
import fedudp.flower.server_app as flower_server
import fedudp.flower.wire as flower_wire
from fedudp.run import run

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_ray_for_the_module")]


@pytest.fixture(scope="module")
def one_ray_for_the_module():
    """Keep the Ray that the module's first simulation starts up for the module's other runs.

    Flower's Ray backend calls ``ray.init`` only when Ray is not initialised and ``ray.shutdown``
    after every simulation, so each run started a new Ray (ray.init: about a fifth of a run here).
    Here only the backend's shutdown is skipped: the first run starts Ray exactly as the engine
    asks (``init_args``), every run still creates and terminates its own actors, and Ray is
    shut down once at the end of the module. What a run computes does not depend on it (the
    tests compare each Flower run with the local engine's)."""
    import ray
    from flwr.server.superlink.fleet.vce.backend import raybackend

    class KeepRayUp:
        def __getattr__(self, name):
            return getattr(ray, name)

        def shutdown(self, *a, **k) -> None:
            pass

    mp = pytest.MonkeyPatch()
    mp.setattr(raybackend, "ray", KeepRayUp())
    try:
        yield
    finally:
        mp.undo()
        ray.shutdown()


def tiny(method: str, engine: str, **kw) -> RunConfig:
    """120 synthetic records over 4 owners in equivalence mode (docs/architecture.md#engines)."""
    base = {
        "engine": engine,
        "dataset.num_records": 120,
        "dataset.features": 20,
        "engine_opts.chunk_records": 1,
        "engine_opts.threads": 1,
        "engine_opts.float64": True,
        # one Ray actor (2 CPUs each on this 2-core machine) serves all 4 owners: a second
        # actor process would import torch and fedudp again for every run
        "engine_opts.num_cpus": 2.0,
    }
    return tiny_cfg(method, **{k.replace(".", "__"): v for k, v in {**base, **kw}.items()})


class RecordingGrid:
    """The server's grid, recording every message the billboard receives."""

    def __init__(self, grid, received: list) -> None:
        self._grid, self._received = grid, received

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def pull_messages(self, ids):
        got = list(self._grid.pull_messages(ids))
        self._received.extend(got)
        return got

    def send_and_receive(self, msgs, timeout=None):
        got = list(self._grid.send_and_receive(msgs, timeout=timeout))
        self._received.extend(got)
        return got


class Capture:
    """Each engine's result and transport, and every message the Flower server receives."""

    def __init__(self, monkeypatch) -> None:
        self.results: dict[str, object] = {}
        self.transports: dict[str, object] = {}
        self.received: list = []
        cap, orig_rounds, orig_connect = (
            self,
            fedudp.run.run_rounds,
            flower_server.FlowerTransport._connect,
        )

        def run_rounds(rounds, eval_every, billboard, transport, *a, **k):
            kind = "flower" if isinstance(transport, flower_server.FlowerTransport) else "local"
            cap.transports[kind] = transport
            cap.results[kind] = res = orig_rounds(rounds, eval_every, billboard, transport, *a, **k)
            return res

        def connect(self):
            self.grid = RecordingGrid(self.grid, cap.received)
            orig_connect(self)

        monkeypatch.setattr(fedudp.run, "run_rounds", run_rounds)
        monkeypatch.setattr(flower_server.FlowerTransport, "_connect", connect)

    @property
    def flower_transport(self) -> flower_server.FlowerTransport:
        return self.transports["flower"]


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def _both(cfg_kw: dict, method: str, tmp_path, monkeypatch):
    cap = Capture(monkeypatch)
    out = {}
    for eng in ("local", "flower"):
        d = tmp_path / eng
        out[eng] = (run(tiny(method, eng, **cfg_kw), d), _metrics(d))
    return cap, out


def _assert_equivalent(cap, out) -> None:
    loc, flo = cap.results["local"], cap.results["flower"]
    assert loc.rounds_completed == flo.rounds_completed
    assert set(loc.shared) == set(flo.shared)
    for k in loc.shared:
        torch.testing.assert_close(flo.shared[k], loc.shared[k], atol=1e-8, rtol=0)
    ml, mf = out["local"][1], out["flower"][1]
    assert len(ml) == len(mf)
    for a, b in zip(ml, mf):
        assert a.get("accuracy_mean") == b.get("accuracy_mean")
        assert a.get("epsilon") == b.get("epsilon")
        assert a.get("users_used") == b.get("users_used")
        assert a["failed_owners"] == b["failed_owners"] == 0
    np.testing.assert_array_equal(loc.owner_accuracy, flo.owner_accuracy)
    sl, sf = out["local"][0], out["flower"][0]
    assert sf["engine"] == "flower"
    assert sl["accuracy_mean"] == sf["accuracy_mean"] and sl["epsilon"] == sf["epsilon"]


def _assert_no_personal(cap, personal_names: tuple[str, ...], shared_dim: int) -> None:
    """Every message the server received: no personal name anywhere, only shared-shaped arrays."""
    assert cap.received, "no messages were recorded"
    for msg in cap.received:
        assert not msg.has_error()
        rd = msg.content
        texts = list(rd.keys())
        for rec in rd.array_records.values():
            texts += list(rec.keys())
            for arr in rec.values():
                a = arr.numpy()
                assert a.shape[-1] == shared_dim, (a.shape, shared_dim)
        for rec in list(rd.config_records.values()) + list(rd.metric_records.values()):
            for k, v in rec.items():
                texts.append(k)
                texts += [str(x) for x in (v if isinstance(v, list) else [v])]
        blob = " ".join(texts)
        for name in personal_names:
            assert name not in blob
        assert "fedudp.personal" not in blob  # the owner-state keys


@pytest.mark.parametrize(
    "method,kw",
    [
        ("fedavg", {}),
        # a given noise multiplier (no calibration: faster); the budget check still applies
        (
            "joint_dp",
            {"train.sampling_rate": 0.5, "privacy.noise_multiplier": 3.0, "privacy.epsilon": 5.0},
        ),
        # adaptive clipping: the clip the owners apply changes every round (sent with the round)
        (
            "joint_dp",
            {
                "train.sampling_rate": 0.5,
                "privacy.noise_multiplier": 3.0,
                "privacy.epsilon": 5.0,
                "privacy.clip_policy": "adaptive",
                "privacy.clip": 0.05,
                "privacy.clip_count_noise": 10.0,
                "privacy.clip_lr": 1.0,
            },
        ),
        # DP-FTRL tree aggregation: cyclic cohorts, one event per tree, correlated noise
        (
            "full_dp",
            {
                "aggregator": "dp_ftrl_tree",
                "train.sampling_rate": 0.5,
                "privacy.noise_multiplier": 2.0,
                "privacy.epsilon": 50.0,
            },
        ),
        # owner-side DP-SGD with an adaptive clip: each owner's released fraction travels back
        # (slow: the default suite's time; the fraction's wire format is in test_reply_codec_roundtrip)
        pytest.param(
            "full_dp",
            {
                "privacy.placement": "local_dpsgd",
                "privacy.clip_policy": "adaptive",
                "privacy.clip": 0.05,
                "privacy.clip_lr": 1.0,
                "train.rounds": 2,
            },
            marks=pytest.mark.slow,
        ),
        # banded matrix factorization under joint DP: 2 groups sampled at 1/2 (cyclic Poisson)
        pytest.param(
            "joint_dp",
            {
                "aggregator": "dp_mf_banded",
                "train.sampling_rate": 0.25,
                "estimator.bands": 2,
                "privacy.noise_multiplier": 2.0,
                "privacy.epsilon": 50.0,
            },
            marks=pytest.mark.slow,
        ),
        # an estimator on the cohort's per-user rows (calibrates itself; owners only clip nothing)
        ("full_dp", {"aggregator": "winsorized", "estimator.bound": 5.0, "train.rounds": 2}),
        # DP-SGD inside the owners, paper mode: at each owner's own personal layer, and
        # Table 4's reading: record-level DP-SGD, user level by group privacy over 2 records a user
        (
            "joint_dp",
            {
                "privacy.placement": "local_dpsgd",
                "privacy.accounting": "paper",
                "privacy.group_privacy": True,
                "partition.records_per_user": 2,
                "train.rounds": 2,
            },
        ),
    ],
)
def test_flower_matches_local_engine(method, kw, tmp_path, monkeypatch):
    cap, out = _both(kw, method, tmp_path, monkeypatch)
    _assert_equivalent(cap, out)
    bb_dim = cap.flower_transport.owners.shared_dim
    if method == "joint_dp" and "privacy.placement" not in kw:
        assert out["flower"][0]["guarantee"] == "certified"
        assert all(0 < m["cohort"] < 120 for m in out["flower"][1])
        assert cap.flower_transport.owners.spec.personal
    if kw.get("privacy.clip_policy") == "adaptive":  # the clip moved, the same on both engines
        clips = [m["agg_clip"] for m in out["flower"][1]]
        assert len(set(clips)) == len(clips) == kw.get("train.rounds", 3)
        assert clips == [m["agg_clip"] for m in out["local"][1]]
    if kw.get("aggregator") == "winsorized":  # owners sent rows, one per user
        rows = [
            m.content[flower_wire.K_VECTORS]["rows"].numpy()
            for m in cap.received
            if flower_wire.K_VECTORS in m.content
        ]
        assert rows and sum(r.shape[0] for r in rows) == 2 * 120
    _assert_no_personal(cap, cap.flower_transport.owners.spec.personal, bb_dim)


@pytest.mark.parametrize(
    "aggregator",
    [  # 12-13 s each: two of the three in the slow suite
        pytest.param("outlier_removal", marks=pytest.mark.slow),
        "friendlycore",
        pytest.param("few_users", marks=pytest.mark.slow),
    ],
)
def test_every_row_estimator_runs_on_flower(aggregator, tmp_path, monkeypatch):
    # the seed estimators need many users for their privacy proofs: 3,000 users, 2 rounds
    kw = {
        "aggregator": aggregator,
        "dataset.num_records": 3000,
        "dataset.pool_train": 4000,
        "train.rounds": 2,
        "privacy.epsilon": 8.0,
        "engine_opts.chunk_records": 0,
    }
    if aggregator == "few_users":
        kw.update({"estimator.tries": 20.0})
    cap, out = _both(kw, "full_dp", tmp_path, monkeypatch)
    _assert_equivalent(cap, out)


def test_per_silo_sends_nothing_personal(tmp_path, monkeypatch):
    cap, out = _both({"train.rounds": 2}, "per_silo", tmp_path, monkeypatch)
    _assert_equivalent(cap, out)
    assert cap.results["flower"].personal == {}
    for msg in cap.received:  # only acknowledgements and test metrics came back
        assert not msg.content.array_records
    _assert_no_personal(cap, cap.flower_transport.owners.spec.personal, 0)


def test_failed_owners_are_excluded_and_counted(tmp_path, monkeypatch):
    # owner 1 fails in round 2; owner 2 sends NaN vectors in round 1 (rejected on the billboard)
    cap = Capture(monkeypatch)
    inject(monkeypatch, {(2, 1): "raise", (1, 2): "nan"})
    cfg = tiny("joint_dp", "flower", **{"privacy.noise_multiplier": 3.0, "privacy.epsilon": 5.0})
    s = run(cfg, tmp_path)
    m = _metrics(tmp_path)
    users = np.diff(cap.flower_transport.fed.owner_user_offsets)
    assert s["rounds_completed"] == 3 and s["stop_reason"] == "completed"
    assert m[0]["failed_owners"] == 1 and m[0]["failed_units"] == users[2]
    assert m[0]["users_used"] == 120 - users[2]
    assert m[0]["failures"] == [
        {
            "owner": 2,
            "units": int(users[2]),
            "reason": "ValueError: shared vector of the wrong length or not finite",
        }
    ]
    assert m[1]["failed_owners"] == 1 and m[1]["failed_units"] == users[1]
    assert m[1]["users_used"] == 120 - users[1]
    assert m[1]["failures"] == [
        {"owner": 1, "units": int(users[1]), "reason": "[fedudp.OwnerFailure] injected failure"}
    ]
    assert m[2]["failed_owners"] == 0 and m[2]["users_used"] == 120
    # the ledger composed every round's release regardless of exclusions
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert len(ledger["entries"]) == 3


def test_a_bug_in_an_owner_stops_the_run(tmp_path, monkeypatch):
    # an exception that is not an OwnerFailure is fedudp's own bug: it must surface
    inject(monkeypatch, {(2, 0): "bug"})
    cfg = tiny("fedavg", "flower")
    with pytest.raises(RuntimeError, match="(?s)owner 0 raised in round 2.*injected bug"):
        run(cfg, tmp_path)


def test_reply_codec_roundtrip():
    from fedudp.aggregators import Contribution
    from fedudp.protocol.messages import OwnerReply

    rep = OwnerReply(
        ("a.w", "a.b"), Contribution(torch.randn(3, 5, dtype=torch.float64), None, 3), 1
    )
    j, back = flower_wire.records_to_reply(flower_wire.reply_to_records(rep, 7, 0.1))
    assert j == 7 and back.param_names == rep.param_names and back.failed == 1
    assert back.contribution.count == 3 and back.contribution.total is None
    assert torch.equal(back.contribution.rows, rep.contribution.rows)
    # owner-side DP-SGD's adaptive clip: the owner's released fraction travels with its delta
    rep = OwnerReply(
        ("a.w",),
        Contribution(
            None, torch.randn(5, dtype=torch.float64), 1, fraction_sum=0.625, fraction_reports=1
        ),
    )
    back = flower_wire.records_to_reply(flower_wire.reply_to_records(rep, 2, 0.1))[1]
    assert (back.contribution.fraction_sum, back.contribution.fraction_reports) == (0.625, 1)
    cfg = tiny("joint_dp", "flower", **{"privacy.noise_multiplier": 3.0})
    assert config_to_json(config_from_json(config_to_json(cfg))) == config_to_json(cfg)
    o = config_from_overrides({"method": "fedavg", "train.rounds": 2, "partition.num_owners": 3})
    assert o.method.value == "fedavg" and o.train.rounds == 2 and o.partition.num_owners == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_owner_timeout_is_excluded(tmp_path, monkeypatch):
    # owner 3 sleeps past engine_opts.timeout_s in round 3: excluded, the run goes on
    cap = Capture(monkeypatch)
    inject(monkeypatch, {(3, 3): "sleep:10"})
    cfg = tiny(
        "joint_dp",
        "flower",
        **{
            "engine_opts.timeout_s": 5.0,
            "privacy.noise_multiplier": 3.0,
            "privacy.epsilon": 5.0,
            # two actors: with one, the owners queued behind the sleeping one would time out too
            "engine_opts.num_cpus": 1.0,
        },
    )
    s = run(cfg, tmp_path)
    m = _metrics(tmp_path)
    users_of_3 = int(np.diff(cap.flower_transport.fed.owner_user_offsets)[3])
    assert s["rounds_completed"] == 3
    assert [r["failed_owners"] for r in m] == [0, 0, 1]
    assert m[2]["failed_units"] == users_of_3 and m[2]["users_used"] == 120 - users_of_3
    assert m[2]["failures"][0]["reason"].startswith("timeout")


@pytest.mark.slow  # 15 s each; the default suite keeps test_flower_matches_local_engine
@pytest.mark.parametrize(
    "method,kw",
    [
        (
            "joint_dp",
            {"train.sampling_rate": 0.5, "privacy.noise_multiplier": 2.0, "privacy.epsilon": 8.0},
        ),
        ("full_dp", {"privacy.placement": "local_dpsgd", "privacy.epsilon": 8.0}),
    ],
)
def test_flower_matches_local_on_a_natural_federation(method, kw, tmp_path, monkeypatch):
    """Users of 1..40 records, owners of 2..6 users, from an NPZ file (docs/your-data.md): the
    Flower owners read and lay out the same federation and compute the same vectors."""
    from fedudp.config import config_from_overrides
    from formats import write_npz

    sizes = [1, 3, 5, 20, 2, 8, 40, 1, 7, 12, 4, 9, 15, 2, 6, 30]
    path = write_npz(tmp_path / "fed.npz", sizes, [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3])
    cap, out = Capture(monkeypatch), {}
    for eng in ("local", "flower"):
        cfg = config_from_overrides(
            {
                "method": method,
                "engine": eng,
                "progress": False,
                "train.rounds": 2,
                "train.batch_size": 4,
                "dataset.name": "npz",
                "dataset.path": str(path),
                "dataset.columns.owner": "owner",
                "partition.owner_rule": "given",
                "partition.num_owners": 4,
                "public.users": 16,
                "public.owner_capacity": 6,
                "public.records_per_user": 32,
                "dataset.classes": 4,
                "dataset.input_shape": [6],
                "engine_opts.chunk_records": 1,
                "engine_opts.threads": 1,
                "engine_opts.float64": True,
                **kw,
            }
        )
        out[eng] = (run(cfg, tmp_path / eng), _metrics(tmp_path / eng))
    _assert_equivalent(cap, out)
    assert out["flower"][0]["num_users"] == 16 and out["flower"][0]["num_owners"] == 4


def test_a_foreign_server_gets_a_clear_failure(tmp_path):
    """Flower's own FedAvg ServerApp addressing fedudp's ClientApp: every reply is a Flower
    error naming what fedudp expected (the server records failures), never a KeyError."""
    from flwr.app import ArrayRecord, ConfigRecord, Context as AppContext
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
    from fedudp.flower.client_app import client_app

    got: list = []
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: AppContext) -> None:
        recording = SendRecorder(grid, got)
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=2).start(
            grid=recording,
            initial_arrays=ArrayRecord({"w": torch.zeros(3)}),
            num_rounds=1,
            train_config=ConfigRecord({"lr": 0.1}),
        )

    run_simulation(
        server_app=app,
        client_app=client_app,
        num_supernodes=2,
        backend_name="ray",
        backend_config={
            "client_resources": {"num_cpus": 2.0, "num_gpus": 0.0},  # one actor: see tiny()
            "init_args": {"address": "local"},
        },
    )
    assert len(got) == 2
    for msg in got:
        assert msg.has_error()
        assert "fedudp's ClientApp answers fedudp's billboard only" in msg.error.reason
        assert "KeyError" not in msg.error.reason
