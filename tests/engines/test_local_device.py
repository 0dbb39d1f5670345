"""``engine_opts.device``: the local engine, the owners' kernels and the estimators on a CUDA
device, noise still drawn in float64 on the CPU generators (docs/architecture.md#engines).

The device cases run on ``cpu`` everywhere and on ``cuda`` where torch sees a CUDA device
(skipped here otherwise): a device run's released shared parameters and ledger equal the CPU
run's within float tolerance, and its noise draws equal the CPU run's bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_cfg
from fedudp import build
from fedudp.config import ConfigError, config_from_overrides, validate
from fedudp.run import execute, prepare

NO_CUDA = not torch.cuda.is_available()
# ["cpu"] + (["cuda"] if torch.cuda.is_available() else []), the cuda case shown as skipped
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(NO_CUDA, reason="no CUDA device"))]


def _run(method: str, device: str, **kw):
    """(result, prepared, every tensor drawn from a seeded generator by ``torch.randn`` or
    ``torch.rand``, in order)."""
    cfg = tiny_cfg(method, **{"train.rounds": 2, "engine_opts.device": device, **kw})
    p = prepare(cfg)
    drawn: list[torch.Tensor] = []
    randn, rand = torch.randn, torch.rand

    def spying(draw):
        def spy(*a, **k):
            out = draw(*a, **k)
            if k.get("generator") is not None:
                drawn.append(out.clone())
            return out

        return spy

    # the estimators' and owner-side DP-SGD's Gaussian draws, the uniform draws of Laplace
    # noise and of the filters' samples
    torch.randn, torch.rand = spying(randn), spying(rand)
    try:
        res = execute(p)
    finally:
        torch.randn, torch.rand = randn, rand
    return res, p, drawn


def _ledger(p) -> list[dict]:
    return [dataclasses.asdict(e) for e in p.ledger.entries]


# -- the default ---------------------------------------------------------------------------------
def test_device_cpu_is_exactly_the_default_run():
    assert tiny_cfg().engine_opts.device == "cpu"
    a, pa, na = _run("full_dp", "cpu")
    cfg = tiny_cfg("full_dp", **{"train.rounds": 2})
    pb = prepare(cfg)
    b = execute(pb)
    assert pa.owners.device == torch.device("cpu") and pa.fed.x.device.type == "cpu"
    assert set(a.shared) == set(b.shared)
    for k in a.shared:
        assert torch.equal(a.shared[k], b.shared[k]), k
    assert _ledger(pa) == _ledger(pb)
    assert na, "the releases drew their noise from the round's generator"


def test_device_is_a_config_key():
    assert config_from_overrides({"engine_opts.device": "cpu"}).engine_opts.device == "cpu"


# -- config errors: one line, naming the key, before any work --------------------------------------
@pytest.mark.parametrize("bad", ["gpu", "CUDA", "cuda:x", "cuda:", "cpu:0", ""])
def test_a_bad_device_string_is_one_line_naming_the_key(bad):
    with pytest.raises(ConfigError) as e:
        validate(tiny_cfg(**{"engine_opts.device": bad}))
    msg = str(e.value)
    assert msg.startswith("engine_opts.device: must be cpu, cuda or cuda:N") and "\n" not in msg


@pytest.mark.skipif(not NO_CUDA, reason="torch sees a CUDA device here")
@pytest.mark.parametrize("dev", ["cuda", "cuda:1"])
def test_cuda_without_a_cuda_device_is_refused_before_any_work(monkeypatch, dev):
    def never(*a, **k):
        raise AssertionError("work started before the config was refused")

    monkeypatch.setattr(build.assemble, "model", never)
    monkeypatch.setattr(build.assemble, "federation", never)
    with pytest.raises(ConfigError) as e:
        prepare(tiny_cfg("full_dp", **{"engine_opts.device": dev}))
    assert str(e.value) == (
        f"engine_opts.device={dev}: torch sees no CUDA device "
        "(torch.cuda.is_available() is False); use engine_opts.device=cpu"
    )


@pytest.mark.parametrize("dev", ["cuda", "cuda:0"])
def test_the_flower_engine_with_a_gpu_device_needs_num_gpus(monkeypatch, dev):
    """engine=flower computes on each actor's GPU only with a GPU reserved per actor
    (tests/engines/test_flower_gpu_owners.py for the rest)."""

    def never(*a, **k):
        raise AssertionError("work started before the config was refused")

    monkeypatch.setattr(build.assemble, "model", never)
    with pytest.raises(ConfigError) as e:
        prepare(tiny_cfg("full_dp", engine="flower", **{"engine_opts.device": dev}))
    msg = str(e.value)
    assert msg.startswith(f"engine_opts.device={dev} with engine=flower needs engine_opts.num_gpus")
    assert "engine_opts.device=cpu" in msg and "\n" not in msg


def test_flower_on_the_cpu_is_accepted():
    validate(tiny_cfg("full_dp", engine="flower", **{"engine_opts.device": "cpu"}))


# -- the device run against the CPU run ------------------------------------------------------------
CASES = [
    pytest.param("full_dp", {"aggregator": "gaussian"}, id="full_dp-gaussian"),
    pytest.param("joint_dp", {"aggregator": "gaussian_adaptive"}, id="joint_dp-adaptive"),
    pytest.param(
        "full_dp",
        {"aggregator": "dp_ftrl_tree", "train.sampling_rate": 0.25},
        id="full_dp-tree",
    ),
    pytest.param("full_dp", {"privacy.placement": "local_dpsgd"}, id="full_dp-owner_dpsgd"),
    pytest.param("joint_dp", {"privacy.unit": "owner"}, id="joint_dp-owner_unit"),
    pytest.param("full_dp", {"aggregator": "gaussian", "audit.canaries": 3}, id="full_dp-canaries"),
    # rows on the device (rows_reply) into the winsorized estimator: on cuda this also checks
    # that winsorized (fedudp/aggregators/winsorized.py, rows.py) is device-aware
    pytest.param(
        "joint_dp", {"aggregator": "winsorized", "estimator.bound": 10.0}, id="joint_dp-winsorized"
    ),
]


@pytest.fixture(scope="module")
def cpu_runs():
    return {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method,kw", CASES)
def test_a_device_run_releases_what_the_cpu_run_releases(cpu_runs, device, method, kw):
    key = (method, tuple(sorted(kw.items())))
    if key not in cpu_runs:
        cpu_runs[key] = _run(method, "cpu", **kw)
    ref, pref, noise_ref = cpu_runs[key]
    res, p, noise = _run(method, device, **kw)
    want = torch.device(device)
    # where things live: the owners' model and records on the device, the billboard on the CPU
    assert p.owners.device.type == want.type
    assert p.fed.x.device.type == want.type and p.fed.y.device.type == want.type
    assert p.billboard is not None and p.billboard.u.device.type == "cpu"
    assert all(v.device.type == "cpu" for v in res.shared.values())
    assert all(v.device.type == "cpu" for v in res.personal.values())
    # the same noise, bit for bit, drawn on the CPU in float64
    assert len(noise) == len(noise_ref) > 0
    for a, b in zip(noise, noise_ref):
        assert a.device.type == "cpu" and a.dtype == torch.float64
        assert torch.equal(a, b)
    # the same releases within float tolerance, the same ledger
    assert res.rounds_completed == ref.rounds_completed == 2
    for k in ref.shared:
        torch.testing.assert_close(res.shared[k], ref.shared[k], rtol=1e-4, atol=1e-5)
    for k in ref.personal:
        torch.testing.assert_close(res.personal[k], ref.personal[k], rtol=1e-4, atol=1e-5)
    assert _ledger(p) == _ledger(pref)


# -- the estimators on rows that live on the device ------------------------------------------------
ESTIMATORS = {
    "gaussian": (dict(clip=1.0, epsilon=2.0, delta=1e-5, rounds=3), 200),
    "gaussian_adaptive": (dict(clip=1.0, epsilon=2.0, delta=1e-5, rounds=3), 200),
    "outlier_removal": (
        dict(epsilon=8.0, delta=1e-5, bound=1.0, records_per_unit=1, rounds=2),
        450,
    ),
    "friendlycore": (dict(epsilon=8.0, delta=1e-5, tau=0.4, rounds=1), 1400),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_an_estimator_releases_on_the_rows_device(device, name):
    """Rows on the device in, the mean on the rows' device out, equal to the CPU's release
    for the same seed within float tolerance (the noise is the same draw)."""
    from fedudp.aggregators import REGISTRY, Sampling

    plain, n = ESTIMATORS[name]
    cls = REGISTRY[name]
    g = torch.Generator().manual_seed(5)
    X = 0.3 + 0.05 * torch.randn(n, 6, generator=g)
    X[: n // 20] = 5.0 * torch.randn(n // 20, 6, generator=g)
    X = X.to(torch.float32)
    cpu = cls.calibrated(sampling=Sampling(1.0, n), **plain)(X, rng=0)
    dev = cls.calibrated(sampling=Sampling(1.0, n), **plain)(X.to(device), rng=0)
    assert dev.mean.device.type == torch.device(device).type
    assert dev.mean.dtype == cpu.mean.dtype and dev.users_used == cpu.users_used
    torch.testing.assert_close(dev.mean.cpu(), cpu.mean, rtol=1e-5, atol=1e-5)
