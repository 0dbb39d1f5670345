"""The owner side's batched paths are explicit settings (``fedudp.owner.kernels.Kernels``).

The builder's owners take the default ``Kernels()`` (every path on: what a run took when the
choices were module globals); ``Owners`` hands its setting on to owner-side DP-SGD
(``DpSgdSpec.kernels``), where ``ghost=False`` keeps every step off the ghost kernel. The
weakened twin (the DP-SGD spec built without the owners' setting) is caught by the same check.
"""

from __future__ import annotations

import dataclasses

import pytest

from conftest import tiny_cfg
from fedudp import build
from fedudp.owner import dpsgd, ghost, owner_level
from fedudp.owner.kernels import Kernels
from fedudp.owner.owners import Owners
from fedudp.owner.settings import OwnerTraining
from fedudp.run import run
from tests.owner.kernel_switch import owners_take


def test_the_default_is_every_path_on():
    assert Kernels() == Kernels(ghost=True, one_step=True, channels_last=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Kernels().ghost = False  # type: ignore[misc]


@pytest.mark.parametrize("method", ["joint_dp", "fedavg"])
def test_the_builders_owners_take_the_default_kernels(method):
    owners = build.owners(tiny_cfg(method))
    assert isinstance(owners, Owners) and isinstance(owners.training, OwnerTraining)
    assert owners.training.kernels == Kernels()


def dpsgd_run(monkeypatch, tmp_path, kernels: Kernels | None) -> tuple[list, int]:
    """One owner-side DP-SGD round on the linear model (whose users take the ghost kernel by
    default): (the kernels each ``dpsgd_deltas`` call was given, the ghost calls inside the
    owners' replies)."""
    if kernels is not None:
        owners_take(monkeypatch, kernels)
    seen: list[Kernels] = []
    real = owner_level.dpsgd_deltas
    monkeypatch.setattr(
        owner_level, "dpsgd_deltas", lambda *a, **k: seen.append(a[12].kernels) or real(*a, **k)
    )
    calls, inside = [], [False]
    orig = ghost.ghost_gradients  # counted in the replies only (not the prepare-time probe)
    monkeypatch.setattr(
        ghost,
        "ghost_gradients",
        lambda *a, **k: (calls.append(1) if inside[0] else 0) or orig(*a, **k),
    )
    honest = Owners.reply

    def reply(self, *a, **k):
        inside[0] = True
        try:
            return honest(self, *a, **k)
        finally:
            inside[0] = False

    monkeypatch.setattr(Owners, "reply", reply)
    cfg = tiny_cfg(
        "joint_dp",
        privacy__placement="local_dpsgd",
        partition__records_per_user=5,
        train__rounds=1,
    )
    run(cfg, tmp_path)
    return seen, len(calls)


def check_handed_on(monkeypatch, tmp_path) -> None:
    off = Kernels(ghost=False, channels_last=False)
    seen, calls = dpsgd_run(monkeypatch, tmp_path / "off", off)
    assert seen and all(k == off for k in seen), seen
    assert calls == 0  # every step on the per-record kernel


def test_owner_dpsgd_takes_the_owners_kernels(monkeypatch, tmp_path):
    seen, calls = dpsgd_run(monkeypatch, tmp_path / "default", None)
    assert seen and all(k == Kernels() for k in seen) and calls > 0  # the ghost kernel ran
    monkeypatch.undo()
    check_handed_on(monkeypatch, tmp_path)


def test_twin_a_dpsgd_spec_without_the_owners_kernels_is_caught(monkeypatch, tmp_path):
    """``_owner_dpsgd`` building its ``DpSgdSpec`` with the default kernels, whatever the
    owners were given: the steps take the ghost kernel, and the check fails."""
    real = dpsgd.DpSgdSpec

    def forgetful(*a, kernels=None, **k):
        return real(*a, **k)

    monkeypatch.setattr(owner_level, "DpSgdSpec", forgetful)
    with pytest.raises(AssertionError):
        check_handed_on(monkeypatch, tmp_path)
