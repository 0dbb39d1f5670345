"""``engine_opts.device`` without a GPU: the owner kernels, the replies and the releases run on
the ``meta`` device as a stand-in for CUDA (docs/architecture.md#the-local-engine-on-a-gpu).

A meta tensor has a shape, a dtype and a device but no values, and torch refuses to mix it with
a CPU tensor exactly where it refuses to mix a CUDA one (a binary op, ``cat``, ``where``,
``index_add_``; CPU index tensors for indexing and 0-dim CPU scalars are allowed on both). So a
kernel that runs to the end on meta inputs with a meta result creates no hidden CPU tensor on its
way. Reading a value (``int()``, ``bool()``, ``.cpu()``, ``.numpy()``) is impossible on meta;
the whole-reply test stubs those reads (counts 0, flags False, copies as CPU zeros, masks True)
to walk the rest of the path: its numbers mean nothing, only where the tensors live is checked.
The value-level check (a CUDA run equals the CPU run) is ``tests/engines/test_local_device.py``,
which needs a CUDA device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from conftest import tiny_cfg
from fedudp.protocol.contributions import Constraint, Contribution
from fedudp.owner import ghost, ghost_norms, local_sgd, one_step, per_sample
from fedudp.owner.orders import batch_orders
from fedudp.randomness import Purpose
from fedudp.owner.owners import Owners
from fedudp.privacy import mechanisms
from fedudp.protocol import messages
from fedudp.run import prepare

META = torch.device("meta")


@pytest.fixture
def norms_to_cpu(monkeypatch):
    """``row_norms64`` of meta rows as it returns for CUDA rows: a CPU float64 tensor."""
    real = mechanisms.row_norms64

    def norms(G):
        first = mechanisms._blocks(G)[0]
        if first.is_meta:
            return torch.full((first.shape[0],), 0.5, dtype=torch.float64)
        return real(G)

    for mod in (mechanisms, ghost_norms, messages):
        monkeypatch.setattr(mod, "row_norms64", norms)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mlp":
        m: nn.Module = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 4))
    else:
        from fedudp.models.cnn import PaperCNN

        m = nn.Sequential(nn.Unflatten(1, (1, 28, 28)), PaperCNN())
    return m.requires_grad_(False).to(META)


STARTS, SIZES = np.array([0, 3, 10, 20]), np.array([3, 7, 1, 5])


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_the_owner_kernels_stay_on_their_inputs_device(kind, norms_to_cpu):
    m = _model(kind)
    params = {k: v.detach() for k, v in m.named_parameters()}
    names = tuple(params)
    x = torch.empty(40, 12 if kind == "mlp" else 784, device=META)
    y = torch.zeros(40, dtype=torch.int64, device=META)
    outs = {
        "one_step": one_step.one_step_vectors(m, params, x, y, STARTS, SIZES, names, 0.5),
        "one_step_single": one_step.one_step_vectors(
            m, params, x, y, np.arange(4), np.ones(4, np.int64), names, 0.5
        ),
        "per_record": per_sample.per_record_gradients(m, params, x[:5], y[:5], names),
    }
    for form in ("ghost", "materialized"):
        gg = ghost.ghost_gradients(m, params, x, y, STARTS, SIZES, names, 1.0, form=form)
        outs[form] = gg.sq
        assert gg.of.device == META and gg.finite.device == META
    units = local_sgd.Units(STARTS, SIZES, np.arange(4), STARTS, SIZES)  # 4 one-user owners
    tr = local_sgd.expand(params, 4)
    for path in ("vmap", "loop"):
        outs[f"mean_{path}"] = local_sgd.mean_gradients(m, tr, {}, {}, x, y, units, path=path)
        spec = local_sgd.LocalSpec(0, 0.1, 4, 2)
        orders = batch_orders(units, spec, 1, Purpose.USER_ORDER)
        outs[f"sgd_{path}"] = local_sgd.local_sgd(m, tr, {}, {}, x, y, orders, spec, path=path)
    outs["flat_delta"] = local_sgd.flat_delta(tr, params, names)
    for name, out in outs.items():
        for t in out.values() if isinstance(out, dict) else [out]:
            assert t.device == META, name


@pytest.fixture
def meta_values(monkeypatch, norms_to_cpu):
    """Value reads of meta tensors stubbed (module doc): the path walks on, values meaningless."""
    T = torch.Tensor
    real = {n: getattr(T, n) for n in ("__int__", "__index__", "__bool__", "__float__", "item")}
    real |= {n: getattr(T, n) for n in ("cpu", "numpy", "tolist")}

    def stub(name):
        orig = real[name]

        def read(self, *a, **k):
            if not self.is_meta:
                return orig(self, *a, **k)
            flag = self.dtype == torch.bool
            if name == "cpu":
                return (torch.ones if flag else torch.zeros)(self.shape, dtype=self.dtype)
            if name == "numpy":
                cpu = torch.ones(self.shape, dtype=self.dtype) if flag else None
                return (
                    cpu if cpu is not None else torch.zeros(self.shape, dtype=self.dtype)
                ).numpy()
            if name == "tolist":
                return torch.zeros(self.shape, dtype=self.dtype).tolist()
            return {"__bool__": False, "__float__": 0.5}.get(name, 0)

        return read

    for n in real:
        monkeypatch.setattr(T, n, stub(n))


def _on_meta(method: str, **kw):
    p = prepare(tiny_cfg(method, **kw))
    o = p.owners
    o.model.to(META)
    own = Owners(o.model, o.spec, o.training, o.budget, o.hooks)
    p.fed.to(own.dtype, META)
    assert p.billboard is not None
    shared = {k: v.to(META) for k, v in p.billboard.shared_params().items()}
    return p, own, shared


@pytest.mark.parametrize(
    "method,kw",
    [
        ("full_dp", {}),
        ("full_dp", {"aggregator": "gaussian_adaptive"}),
        ("full_dp", {"privacy.unit": "owner"}),
        ("full_dp", {"train.local_epochs": 2}),
        ("full_dp", {"privacy.placement": "local_dpsgd"}),
        ("fedavg", {}),
        ("joint_dp", {"aggregator": "winsorized", "estimator.bound": 10.0}),
    ],
)
def test_a_reply_and_its_release_stay_on_the_owners_device(method, kw, meta_values):
    p, own, shared = _on_meta(method, **kw)
    assert own.device == META and p.fed.x.device == META
    personal = own.personal_round(p.fed, shared, own.initial_personal(p.fed.num_owners), 1)
    assert all(v.device == META for v in personal.values())
    units = np.arange(p.fed.num_owners if own.spec.cohort_is_owners else p.fed.num_users)
    agg = p.aggregator
    constraint = agg.constraint if agg is not None else Constraint(rows=False)
    rep = own.reply(p.fed, shared, personal, units, 1, constraint)
    c = rep.contribution
    assert (c.rows if c.rows is not None else c.total).device == META
    if agg is not None:
        merged = Contribution.merge([c], own.shared_dim, own.dtype, agg.needs_per_user_vectors)
        out = agg.release(merged, rng=torch.Generator().manual_seed(0))
        assert out.mean.device == META
    acc, loss = own.evaluate(p.fed, shared, personal)
    assert acc.shape == loss.shape == (p.fed.num_owners,)
