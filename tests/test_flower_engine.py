"""engine=flower (issue 4): equivalence with engine=local, the owner boundary, failures.

All Flower runs here go through ``fedudp.run.run`` -> ``FlowerEngine`` ->
``flwr.simulation.run_simulation`` with the Ray backend (in this process; Ray stays up
between tests of the module).
"""
from __future__ import annotations

import json
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from fedudp.config import RunConfig  # noqa: E402
from fedudp.engines import flower as F  # noqa: E402
from fedudp.engines import flower_app as A  # noqa: E402
from fedudp.engines.local import LocalEngine  # noqa: E402
from fedudp.run import run  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def tiny(method: str, engine: str, **kw) -> RunConfig:
    cfg = RunConfig()
    cfg.progress = False
    cfg.method = method
    cfg.engine = engine
    cfg.dataset.num_records, cfg.dataset.pool_train, cfg.dataset.pool_test = 120, 1000, 200
    cfg.dataset.features = 20
    cfg.partition.num_owners = 4
    cfg.train.rounds = 3
    cfg.train.batch_size = 8
    # equivalence mode (ARCHITECTURE.md §5)
    cfg.engine_opts.chunk_records, cfg.engine_opts.threads, cfg.engine_opts.float64 = 1, 1, True
    for k, v in kw.items():
        obj = cfg
        *path, last = k.split(".")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, v)
    return cfg


class Capture:
    """Record each engine's result, and every message the Flower server receives."""

    def __init__(self, monkeypatch) -> None:
        self.results: dict[str, object] = {}
        self.received: list = []
        self.engine: F.FlowerEngine | None = None
        self.faults: dict = {}
        cap = self
        orig_local, orig_serve = LocalEngine.run, F.FlowerEngine.serve

        def local_run(self, *a, **k):
            res = orig_local(self, *a, **k)
            cap.results["local"] = res
            return res

        def serve(self, grid, on_round=None):
            cap.engine = self
            self.on_receive = cap.received.append
            self.faults.update(cap.faults)
            res = orig_serve(self, grid, on_round)
            cap.results["flower"] = res
            return res

        monkeypatch.setattr(LocalEngine, "run", local_run)
        monkeypatch.setattr(F.FlowerEngine, "serve", serve)


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def _both(cfg_kw: dict, method: str, tmp_path, monkeypatch, faults=None):
    cap = Capture(monkeypatch)
    cap.faults = faults or {}
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
        assert a["accuracy_mean"] == b["accuracy_mean"]
        assert a.get("epsilon") == b.get("epsilon")
        assert a.get("users_used") == b.get("users_used")
        assert b["failed_owners"] == 0
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
        assert "personal" not in blob


@pytest.mark.parametrize("method,kw", [
    ("fedavg", {}),
    # a given noise multiplier (no calibration: faster); the budget check still applies
    ("joint_dp", {"train.sampling_rate": 0.5, "privacy.noise_multiplier": 3.0,
                  "privacy.epsilon": 5.0}),
])
def test_flower_matches_local_engine(method, kw, tmp_path, monkeypatch):
    cap, out = _both(kw, method, tmp_path, monkeypatch)
    _assert_equivalent(cap, out)
    if method == "joint_dp":
        assert out["flower"][0]["guarantee"] == "certified"
        assert all(0 < m["cohort"] < 120 for m in out["flower"][1])
        names = cap.engine.spec.personal
        assert names
        _assert_no_personal(cap, names, cap.engine.billboard.dim)


def test_per_silo_sends_nothing_personal(tmp_path, monkeypatch):
    cap, out = _both({"train.rounds": 2}, "per_silo", tmp_path, monkeypatch)
    _assert_equivalent(cap, out)
    assert cap.results["flower"].personal == {}
    for msg in cap.received:       # only acknowledgements and test metrics came back
        assert not msg.content.array_records
    _assert_no_personal(cap, cap.engine.spec.personal, 0)


def test_failed_owners_are_excluded_and_counted(tmp_path, monkeypatch):
    # owner 1 raises in round 2; owner 2 sends a NaN row in round 1 (dropped on the owner)
    cap = Capture(monkeypatch)
    cap.faults = {(2, 1): "raise", (1, 2): "nan"}
    cfg = tiny("joint_dp", "flower", **{"privacy.noise_multiplier": 3.0, "privacy.epsilon": 5.0})
    s = run(cfg, tmp_path)
    m = _metrics(tmp_path)
    assert s["rounds_completed"] == 3 and s["stop_reason"] == "completed"
    assert m[0]["failed_owners"] == 0 and m[0]["failed_units"] == 1
    assert m[0]["users_used"] == 119
    users_of_1 = int(np.diff(cap.engine.fed.owner_user_offsets)[1])
    assert m[1]["failed_owners"] == 1 and m[1]["failed_units"] == users_of_1
    assert m[1]["users_used"] == 120 - users_of_1
    assert m[2]["failed_owners"] == 0 and m[2]["users_used"] == 120
    # the ledger composed every round's release regardless of exclusions
    ledger = json.loads((tmp_path / "ledger.json").read_text())
    assert len(ledger["entries"]) == 3


def test_reply_codec_roundtrip():
    from fedudp.core.messages import OwnerReply
    rep = OwnerReply(("a.w", "a.b"), torch.randn(3, 5, dtype=torch.float64), None, 3, 0, 1)
    j, back = A.records_to_reply(A.reply_to_records(rep, 7, 0.1))
    assert j == 7 and back.param_names == rep.param_names and back.count == 3 and back.failed == 1
    assert torch.equal(back.vectors, rep.vectors) and back.clipped_sum is None
    cfg = tiny("joint_dp", "flower", **{"privacy.noise_multiplier": 3.0})
    assert A.cfg_to_json(A.cfg_from_json(A.cfg_to_json(cfg))) == A.cfg_to_json(cfg)
    o = A.cfg_from_overrides({"method": "fedavg", "train.rounds": 2, "partition.num_owners": 3})
    assert o.method.value == "fedavg" and o.train.rounds == 2 and o.partition.num_owners == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_owner_timeout_is_excluded(tmp_path, monkeypatch):
    # owner 3 sleeps past engine_opts.timeout_s in round 3: excluded, the run goes on
    cap = Capture(monkeypatch)
    cap.faults = {(3, 3): "sleep:10"}
    cfg = tiny("joint_dp", "flower", **{"engine_opts.timeout_s": 5.0,
                                         "privacy.noise_multiplier": 3.0, "privacy.epsilon": 5.0})
    s = run(cfg, tmp_path)
    m = _metrics(tmp_path)
    users_of_3 = int(np.diff(cap.engine.fed.owner_user_offsets)[3])
    assert s["rounds_completed"] == 3
    assert [r["failed_owners"] for r in m] == [0, 0, 1]
    assert m[2]["failed_units"] == users_of_3 and m[2]["users_used"] == 120 - users_of_3


class RowMean:
    """A test aggregator that needs the per-user rows (plain mean of the cohort matrix)."""

    name = "row_mean"
    needs_per_user_vectors = True
    private = False

    def __call__(self, G, *, rng=None):
        from fedudp.aggregators import Aggregate
        return Aggregate(mean=G.mean(0) if len(G) else torch.zeros(G.shape[1], dtype=G.dtype),
                         users_used=int(G.shape[0]), diagnostics={"cohort": int(G.shape[0])})

    def dp_event(self, sampling=None):
        import dp_accounting
        return dp_accounting.NonPrivateDpEvent()


def test_per_user_vector_path_matches_local(tmp_path, monkeypatch):
    # the billboard's aggregator needs the rows: owners send [n_users, d], nothing summed
    from fedudp import aggregators
    from fedudp.config import AggregatorName
    monkeypatch.setitem(aggregators.BUILDERS, AggregatorName.none, lambda c, s, r, d=0: RowMean())
    cap, out = _both({"train.rounds": 2}, "fedavg", tmp_path, monkeypatch)
    _assert_equivalent(cap, out)
    rows = [msg.content[A.K_VECTORS]["vectors"].numpy() for msg in cap.received
            if A.K_VECTORS in msg.content]
    assert rows and sum(r.shape[0] for r in rows) == 2 * 120
