"""The two paths of ``fedudp/owner/local_sgd.py`` (units vmapped, or one after another with plain
autograd) compute the same local SGD and mean gradients, and ``loop_units`` picks per unit.

A small paper CNN (8x8 images) in float64: the paths differ only in float summation order.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedudp.owner import gradients, local_sgd
from fedudp.owner.orders import batch_orders
from fedudp.owner.local_sgd import LocalSpec, Units
from fedudp.models.cnn import PaperCNN
from fedudp.models.linear import SharedPersonalLogistic
from fedudp.randomness import Purpose

# units of 1 .. 40 records: batch 8 puts sizes 8 and 40 (steps of 8 records) on the loop, and
# 1, 5, 13 (two steps, 6.5 records on average) and 17 (three, 5.7) on the vmapped path
SIZES = np.array([13, 1, 40, 5, 8, 17])
SPEC = LocalSpec(seed=3, lr=0.1, batch_size=8, epochs=2)


def cnn():
    torch.manual_seed(0)
    m = PaperCNN(1, 10, 8).double()
    for p in m.parameters():
        p.requires_grad_(False)
    return m, {k: v.detach().clone() for k, v in m.named_parameters()}


def data(n: int = int(SIZES.sum())):
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(n, 1, 8, 8, generator=g, dtype=torch.float64),
        torch.randint(0, 10, (n,), generator=g),
    )


def units_of(sizes: np.ndarray) -> Units:
    starts = np.r_[0, np.cumsum(sizes)[:-1]].astype(np.int64)
    return Units(starts, sizes, np.arange(len(sizes)), starts, sizes)


def split(params):
    shared = {k: v for k, v in params.items() if not k.startswith("fc1")}
    personal = {k: v for k, v in params.items() if k.startswith("fc1")}
    return shared, personal


def test_loop_units_picks_convolution_units_with_large_steps():
    m, _ = cnn()
    assert list(local_sgd.loop_units(m, SIZES, 8)) == [False, False, True, False, True, False]
    assert list(local_sgd.loop_units(m, np.array([9, 9]), 4)) == [False, False]  # steps of 3
    assert list(local_sgd.loop_units(m, np.array([0, 7, 8]), None)) == [False, False, True]
    dense = SharedPersonalLogistic(12, 10)
    assert not local_sgd.loop_units(dense, np.array([500, 64]), 32).any()


@pytest.mark.parametrize("per_unit_personal", [False, True])
def test_local_sgd_paths_agree_and_leave_the_inputs_alone(per_unit_personal):
    m, params = cnn()
    x, y = data()
    units = units_of(SIZES)
    orders = batch_orders(units, SPEC, 2, Purpose.OWNER_ORDER)
    shared, personal = split(params)
    start = local_sgd.expand(shared, len(SIZES))
    # the personal layer: each unit its own copy (paper mode), or one common public copy
    fr_unit = (
        {
            k: v + 0.01 * torch.arange(len(SIZES), dtype=v.dtype).reshape(-1, *[1] * (v.dim() - 1))
            for k, v in local_sgd.expand(personal, len(SIZES)).items()
        }
        if per_unit_personal
        else {}
    )
    fr_common = {} if per_unit_personal else personal
    keep = {k: v.clone() for k, v in start.items()}
    got = {
        path: local_sgd.local_sgd(m, start, fr_unit, fr_common, x, y, orders, SPEC, path=path)
        for path in ("vmap", "loop", "auto")
    }
    for k in start:
        assert torch.equal(start[k], keep[k])  # not modified in place
        assert not torch.allclose(got["vmap"][k], start[k])  # trained
        torch.testing.assert_close(got["loop"][k], got["vmap"][k], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["auto"][k], got["vmap"][k], rtol=1e-10, atol=1e-12)


def test_loop_is_plain_minibatch_sgd_in_the_documented_order():
    m, params = cnn()
    x, y = data()
    units = units_of(SIZES[:1])  # 13 records: batches 8, 5
    orders = batch_orders(units, SPEC, 2, Purpose.OWNER_ORDER)
    got = local_sgd.local_sgd(
        m, local_sgd.expand(params, 1), {}, {}, x, y, orders, SPEC, path="loop"
    )
    net = PaperCNN(1, 10, 8).double()
    net.load_state_dict(params)
    opt = torch.optim.SGD(net.parameters(), lr=SPEC.lr)
    for e in range(SPEC.epochs):
        order = torch.from_numpy(orders[0, e])
        for s in range(0, 13, SPEC.batch_size):
            idx = order[s : s + SPEC.batch_size]
            opt.zero_grad()
            F.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    for k, v in net.named_parameters():
        torch.testing.assert_close(got[k][0], v.detach(), rtol=1e-10, atol=1e-12)


def test_mean_gradients_paths_agree(monkeypatch):
    monkeypatch.setattr(gradients, "LOOP_MAX_BATCH", 6)  # 40 records: 7 batches
    m, params = cnn()
    x, y = data()
    sizes = SIZES.copy()
    sizes[3] = 0  # an empty unit: zero
    units = units_of(sizes)
    shared, personal = split(params)
    start = local_sgd.expand(shared, len(sizes))
    got = {
        path: local_sgd.mean_gradients(m, start, {}, personal, x, y, units, path=path)
        for path in ("vmap", "loop", "auto")
    }
    for k in start:
        assert float(got["vmap"][k][3].abs().max()) == 0.0
        torch.testing.assert_close(got["loop"][k], got["vmap"][k], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["auto"][k], got["vmap"][k], rtol=1e-10, atol=1e-12)


def test_flat_delta_writes_the_flattened_change():
    g = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g)}
    end = {k: v + torch.randn(7, *v.shape, generator=g) for k, v in start.items()}
    names = ("b", "a")
    want = local_sgd.flatten(end, names) - local_sgd.flatten(local_sgd.expand(start, 7), names)
    assert torch.equal(local_sgd.flat_delta(end, start, names), want)
    out = torch.zeros(10, 17)
    local_sgd.flat_delta(end, start, names, out=out[2:9])
    assert torch.equal(out[2:9], want) and not out[:2].any() and not out[9:].any()


def test_bound_model_computes_functional_call_and_gives_its_parameters_back():
    from torch.func import functional_call

    torch.manual_seed(0)
    model = PaperCNN()
    own = {k: v for k, v in model.named_parameters()}
    other = {k: torch.randn_like(v) for k, v in own.items()}
    x = torch.randn(3, 1, 28, 28)
    with pytest.raises(RuntimeError, match="boom"):
        with gradients.bound(model, tuple(other)) as bind:
            bind(other)
            assert torch.equal(model(x), functional_call(model, other, (x,)))
            raise RuntimeError("boom")
    assert all(p is own[k] for k, p in model.named_parameters())  # its own, even on error
    with pytest.raises(KeyError, match="fc1.scale"):
        with gradients.bound(model, ("fc1.scale",)):
            pass
