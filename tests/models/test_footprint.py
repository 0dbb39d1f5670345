"""A model that cannot fit this machine is refused in one line naming the key, before any
allocation (fedudp.models.footprint; issue 49: ``dataset.classes=1000000000000`` was a raw
allocator traceback, ``dataset.classes=10000000`` an out-of-memory error blaming DP-SGD's
per-record gradients)."""

from __future__ import annotations

import pytest
import torch

from fedudp import build
from fedudp.config import ConfigError, config_from_overrides
from fedudp.models import footprint
from fedudp.models.validate import PROBE_BATCH


class RealAllocation(Exception):
    """The model was about to be built with real memory."""


@pytest.fixture
def watched(monkeypatch):
    """``build.make_model`` that records each call's device and refuses a real (non-meta)
    build of more than a million parameters instead of allocating it."""
    calls: list[str] = []
    real = build.make_model

    def make(name, shape, classes, seed):
        meta = torch.empty(0).device.type == "meta"
        calls.append("meta" if meta else "real")
        if not meta and classes * max(1, shape[0]) > 1_000_000:
            raise RealAllocation(f"{classes} classes")
        return real(name, shape, classes, seed)

    monkeypatch.setattr(build.owner_side, "make_model", make)
    return calls


@pytest.mark.parametrize("classes", [1_000_000_000_000, 10_000_000])
def test_too_many_classes_is_one_line_naming_the_key_before_allocation(watched, classes):
    cfg = config_from_overrides({"dataset.classes": classes})
    with pytest.raises(ConfigError) as e:
        build.model(cfg, probe=True)
    msg = str(e.value)
    assert msg.startswith(f"dataset.classes={classes}: the model has ")
    assert "\n" not in msg and "lower dataset.classes" in msg
    assert set(watched) == {"meta"}  # only shape-only builds ran


@pytest.mark.parametrize("classes", [1_000_000_000_000, 10_000_000])
def test_twin_without_the_check_reaches_the_real_allocation(watched, monkeypatch, classes):
    # the weakened twin: no footprint rule (as before issue 49)
    monkeypatch.setattr(footprint, "check_model", lambda *a, **k: None)
    cfg = config_from_overrides({"dataset.classes": classes})
    with pytest.raises(RealAllocation):
        build.model(cfg, probe=True)
    assert watched == ["real"]


def test_a_default_model_passes_and_is_built_for_real(watched):
    net = build.model(config_from_overrides({}), probe=True)
    assert watched[-1] == "real" and set(watched[:-1]) == {"meta"}
    assert next(net.parameters()).device.type == "cpu"


def test_the_rule_counts_the_probe_the_update_and_one_owner_step(monkeypatch):
    # the default federation: 10,000 one-record users, q = 1, chunks of 8192 dense records
    cfg = config_from_overrides({})
    with torch.device("meta"):
        meta = build.make_model("linear", (60,), 10, 0)
    names, units = build._footprint_units(cfg, meta)
    assert units == 8192 and sorted(names) == ["shared.bias", "shared.weight"]
    total, shared = 60 * 10 + 10 + 10, 60 * 10 + 10
    need = footprint.model_need(total, shared, 4, units)
    assert need == 4 * ((1 + PROBE_BATCH) * total + (1 + units) * shared)
    # q = 0.01: the expected cohort (100 users) bounds the step
    few = config_from_overrides({"train.sampling_rate": 0.01})
    assert build._footprint_units(few, meta)[1] == 100
    # owner-side DP-SGD: one unit (the rule knows no more)
    local = config_from_overrides({"privacy.placement": "local_dpsgd"})
    assert build._footprint_units(local, meta)[1] == 1
    # exactly at the bound passes, one byte under it is refused
    monkeypatch.setattr(footprint, "memory_bytes", lambda device="cpu": need)
    build.model(cfg)
    monkeypatch.setattr(footprint, "memory_bytes", lambda device="cpu": need - 1)
    with pytest.raises(ConfigError, match=r"^dataset\.classes=10: .*lower dataset\.classes"):
        build.model(cfg)


def test_a_big_body_names_the_model_not_the_classes(monkeypatch):
    monkeypatch.setattr(footprint, "memory_bytes", lambda device="cpu": 10_000)
    cfg = config_from_overrides(
        {
            "dataset.name": "npz",
            "dataset.path": "unused.npz",
            "dataset.input_shape": [80],
            "dataset.tokens": True,
            "dataset.classes": 10,
            "model.name": "char_gru",
            "public.users": 100,
            "public.owner_capacity": 10,
            "public.records_per_user": 5,
        }
    )
    with pytest.raises(ConfigError, match=r"^model\.name=char_gru: .*choose a smaller model"):
        build.model(cfg)


def test_memory_and_sizes_read():
    from fedudp import memory

    have = memory.memory_bytes()
    assert have is None or have > 2**20
    assert memory.size_text(6.4e12) == "5.82 TiB"
    assert memory.size_text(512) == "512 B"
