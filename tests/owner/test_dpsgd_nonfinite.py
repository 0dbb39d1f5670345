"""Owner-side DP-SGD drops a user whose gradient is not finite, alone (issue 49;
docs/algorithms.md#owner-side-dp-sgd).

An owner holding one user whose record the model turns into NaN releases the delta of the same
owner without that user (same public capacity, seed and owner id: the same Poisson draws for
the other users and the same noise), on every kernel owner-side DP-SGD can take: ``ghost``
(clipped sums without per-user gradients), ``per_sample`` (per-record gradients, averaged per
user) and the vmapped chunks. An adaptive clip's released fraction is the neighbour's too (the
dropped user is left out of the count, as if absent). The weakened twin (the old clip factors,
which give a NaN norm factor 1) makes the owner's delta non-finite, and the check catches it;
so does the count's twin (the dropped user counted as a sampled b_i = 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from fedudp.owner import dpsgd, ghost, per_sample
from fedudp.owner.kernels import Kernels
from fedudp.privacy import mechanisms

FEATURES, CLASSES, USERS = 6, 4, 6  # owner 0's last user is the NaN one


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(FEATURES, 12), nn.Tanh(), nn.Linear(12, CLASSES)).double()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _deltas(model, per_user: int, with_nan_user: bool, kernels: Kernels, budget: int = 5):
    """(deltas [2, d], fractions [2], dropped [2]) of two owners of ``USERS`` users each (public
    capacity ``USERS``), owner 0's last user left out where ``with_nan_user`` is False and
    otherwise holding a record whose features are NaN."""
    g = torch.Generator().manual_seed(11)
    n = 2 * USERS * per_user
    x = torch.randn(n, FEATURES, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    bad_user = USERS - 1  # owner 0's last
    x[bad_user * per_user + per_user // 2] = float("nan")
    starts, sizes = np.arange(0, n, per_user), np.full(2 * USERS, per_user)
    first, users = np.array([0, USERS]), np.array([USERS, USERS])
    if not with_nan_user:  # the neighbour: owner 0 without its last user
        keep = np.flatnonzero(np.arange(2 * USERS) != bad_user)
        starts, sizes = starts[keep], sizes[keep]
        first, users = np.array([0, USERS - 1]), np.array([USERS - 1, USERS])
    shared = {k: v.detach().clone() for k, v in model.named_parameters()}
    names = tuple(shared)
    # batch 3 of capacity 6: q = 1/2, two steps an epoch, two epochs; an adaptive clip's count
    spec = dpsgd.DpSgdSpec(1.3, 0.05, 3, 2, 0.5, 7, count_noise=0.8, kernels=kernels)
    fractions, dropped = np.zeros(2), np.zeros(2, dtype=np.int64)
    capacity, ids = np.array([USERS, USERS]), np.array([4, 9])
    out = dpsgd.dpsgd_deltas(
        model, shared, {}, {}, x, y, starts, sizes, first, users, capacity, ids, spec, 2, names,
        budget, fractions=fractions, dropped=dropped,
    )  # fmt: skip
    return out, fractions, dropped


def _kernel(monkeypatch, kernel: str) -> tuple[list[int], Kernels]:
    """Send ``dpsgd_deltas`` down ``kernel``: (the list the ghost calls are counted in, the
    owner side's setting to pass, ``DpSgdSpec.kernels``)."""
    calls: list[int] = []
    orig = ghost.ghost_gradients
    monkeypatch.setattr(ghost, "ghost_gradients", lambda *a, **k: calls.append(1) or orig(*a, **k))
    if kernel == "vmap":  # neither batched kernel: the vmapped chunks
        monkeypatch.setattr(per_sample, "supported", lambda model, names: False)
    return calls, Kernels(ghost=kernel == "ghost")


def check_the_nan_user_is_absent(model, per_user: int, kernels: Kernels) -> None:
    """The owner with the NaN user releases a finite delta and fraction equal to those of the
    owner without it; the other owner is untouched; the user is counted as dropped."""
    d, f, dropped = _deltas(model, per_user, True, kernels)
    d0, f0, dropped0 = _deltas(model, per_user, False, kernels)
    assert bool(torch.isfinite(d).all()), "the owner's noisy delta is not finite"
    assert float(d.abs().max()) > 0
    torch.testing.assert_close(d, d0, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(f, f0, rtol=1e-12, atol=1e-12)
    assert dropped.tolist() == [1, 0] and dropped0.tolist() == [0, 0]


@pytest.mark.parametrize("per_user", [1, 3])
@pytest.mark.parametrize("kernel", ["ghost", "per_sample", "vmap"])
def test_an_owner_with_one_nan_user_releases_the_delta_without_it(kernel, per_user, monkeypatch):
    calls, kernels = _kernel(monkeypatch, kernel)
    check_the_nan_user_is_absent(_mlp(), per_user, kernels)
    assert bool(calls) == (kernel == "ghost")  # the kernel named is the one that ran


def _old_clip_factors(G, clip, norms=None):
    """The weakened twin: every row kept, a NaN norm's factor 1 (``clip_factors`` alone)."""
    factor, was = mechanisms.clip_factors(G, clip, norms)
    return factor, was, torch.ones(len(factor), dtype=torch.bool, device=factor.device)


@pytest.mark.parametrize("kernel", ["ghost", "per_sample", "vmap"])
def test_twin_clip_factors_that_let_a_nan_through_are_caught(kernel, monkeypatch):
    _, kernels = _kernel(monkeypatch, kernel)
    monkeypatch.setattr(dpsgd, "finite_clip_factors", _old_clip_factors)
    d, _, _ = _deltas(_mlp(), 1, True, kernels)
    # the NaN reaches its owner's delta (on the vmapped kernel the other owners' of its chunk
    # too: the [owners, rows] weight matrix multiplies it by 0)
    assert not bool(torch.isfinite(d[0]).all())
    with pytest.raises(AssertionError, match="not finite"):
        check_the_nan_user_is_absent(_mlp(), 1, kernels)


@pytest.mark.parametrize("kernel", ["ghost", "vmap"])
def test_twin_a_count_that_keeps_the_nan_user_as_sampled_is_caught(kernel, monkeypatch):
    """The sum honest, but the adaptive clip's count over every sampled user (the dropped one
    a b_i = 0): the released fraction moves against the neighbour's, the check catches it."""
    _, kernels = _kernel(monkeypatch, kernel)
    monkeypatch.setattr(dpsgd, "counted", lambda finite: np.ones_like(finite))
    with pytest.raises(AssertionError, match="Not equal to tolerance"):
        check_the_nan_user_is_absent(_mlp(), 1, kernels)


def test_finite_clip_factors_drop_exactly_the_non_finite_rows():
    """``finite_clip_factors``: ``clip_factors`` on the finite rows; NaN and ±inf rows (float32
    and float64) get factor 0 and are neither clipped nor finite."""
    for dtype in (torch.float32, torch.float64):
        G = torch.tensor(
            [
                [3.0, 4.0],
                [float("nan"), 0.0],
                [0.1, 0.0],
                [float("inf"), 1.0],
                [0.0, -float("inf")],
            ],
            dtype=dtype,
        )
        factor, was, ok = mechanisms.finite_clip_factors(G, 1.0)
        ref, ref_was = mechanisms.clip_factors(G[[0, 2]], 1.0)
        assert ok.tolist() == [True, False, True, False, False]
        assert was.tolist() == [True, False, False, False, False]
        assert torch.equal(factor[[0, 2]], ref) and ref_was.tolist() == [True, False]
        assert factor[[1, 3, 4]].tolist() == [0.0, 0.0, 0.0] and factor.dtype == dtype
