"""Per-record gradients from one batched pass (fedudp.owner.per_sample) equal torch.func's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedudp.owner import dpsgd, per_sample
from fedudp.owner.dpsgd import DpSgdSpec, dpsgd_deltas
from fedudp.owner.kernels import Kernels
from fedudp.models.cnn import PaperCNN


def _vmap_grads(model, params, x, y, names):
    def loss(p, xb, yb):
        return F.cross_entropy(functional_call(model, {**params, **p}, (xb[None],)), yb[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))({n: params[n] for n in names}, x, y)


@pytest.mark.parametrize(
    "personal", [(), ("fc1.weight", "fc1.bias"), ("conv1.weight", "conv1.bias")]
)
def test_cnn_per_record_gradients_equal_vmap(personal):
    torch.manual_seed(0)
    model = PaperCNN().double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = tuple(k for k in params if k not in personal)
    x, y = torch.randn(7, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (7,))
    assert per_sample.supported(model, names)
    got = per_sample.per_record_gradients(model, params, x, y, names)
    want = _vmap_grads(model, params, x, y, names)
    assert set(got) == set(names)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)


def test_linear_model_and_unsupported_layers():
    model = nn.Linear(5, 3).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    got = per_sample.per_record_gradients(model, params, x, y, ("weight", "bias"))
    want = _vmap_grads(model, params, x, y, ("weight", "bias"))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)
    seq = nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4), nn.Linear(4, 3))
    assert per_sample.supported(seq, ("0.weight", "2.weight"))
    assert not per_sample.supported(seq, ("1.weight",))  # LayerNorm: vmap fallback
    assert not per_sample.supported(nn.Conv2d(4, 4, 3, groups=2), ("weight",))


def test_dpsgd_batched_path_equals_the_vmap_path(monkeypatch):
    """The same DP-SGD round (keyed sampling and noise) through both per-record paths, on the
    CNN with several records per user and owner-specific frozen layers (paper mode's shape).
    The ghost path (tests/owner/test_ghost.py) is switched off: this compares the other two."""
    torch.manual_seed(1)
    model = PaperCNN().double()
    for p in model.parameters():
        p.requires_grad_(False)
    allp = {k: v.detach().clone() for k, v in model.named_parameters()}
    names = tuple(k for k in allp if not k.startswith("fc1"))
    shared = {k: allp[k] for k in names}
    owners, users_per, k = 3, 5, 2
    n = owners * users_per * k
    x, y = torch.randn(n, 1, 28, 28, dtype=torch.float64), torch.randint(0, 10, (n,))
    frozen = {
        kk: allp[kk].unsqueeze(0).repeat(owners, *[1] * allp[kk].dim())
        + 0.01 * torch.randn(owners, *allp[kk].shape, dtype=torch.float64)
        for kk in allp
        if kk.startswith("fc1")
    }
    starts, sizes = np.arange(0, n, k), np.full(n // k, k)
    first, users, ids = (
        np.arange(0, owners * users_per, users_per),
        np.full(owners, users_per),
        np.arange(owners),
    )
    spec = DpSgdSpec(0.7, 0.05, 3, 2, 0.1, 5, kernels=Kernels(ghost=False))
    fast = dpsgd_deltas(
        model, shared, frozen, {}, x, y, starts, sizes, first, users, users, ids, spec, 1, names, 64
    )
    monkeypatch.setattr(dpsgd.per_sample, "supported", lambda *a: False)
    slow = dpsgd_deltas(
        model, shared, frozen, {}, x, y, starts, sizes, first, users, users, ids, spec, 1, names, 64
    )
    assert float(fast.abs().max()) > 0
    torch.testing.assert_close(fast, slow, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "conv",
    [
        dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=(3, 2), stride=(2, 1), dilation=(1, 2), padding=(2, 0)),
        dict(kernel_size=4, stride=3, padding=0),
    ],
)
@pytest.mark.parametrize("c_in", [3, 9])  # below and above per_sample.KERNELS_BELOW
def test_conv_per_record_weight_gradients_with_stride_dilation_padding(conv, c_in):
    """Both forms of the per-record conv weight gradient (output gradients as kernels below
    KERNELS_BELOW input channels, records as groups above), on layer shapes the paper CNN does
    not have (strides that do not divide, dilation, asymmetric padding)."""
    assert 3 < per_sample.KERNELS_BELOW <= 9
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(c_in, 5, **conv), nn.ReLU(), nn.Flatten(), nn.LazyLinear(4))
    model(torch.randn(1, c_in, 11, 13))  # materialise the lazy layer
    model = model.double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = tuple(params)
    x, y = torch.randn(6, c_in, 11, 13, dtype=torch.float64), torch.randint(0, 4, (6,))
    assert per_sample.supported(model, names)
    got = per_sample.per_record_gradients(model, params, x, y, names)
    want = _vmap_grads(model, params, x, y, names)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("block", [1, 4, 5, 32])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("c_in", [3, 8])  # both forms (KERNELS_BELOW)
def test_conv_weight_per_record_blocks_equal_each_records_autograd(block, channels_last, c_in):
    """Both forms, in blocks that do and do not divide the 11 records (and a block larger than
    all of them), on contiguous and channels-last activations: each record's weight gradient
    equals autograd's on that record alone."""
    torch.manual_seed(3)
    conv = nn.Conv2d(c_in, 4, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(1, 2)).double()
    a = torch.randn(11, c_in, 9, 10, dtype=torch.float64)
    out = conv(a).detach()
    g = torch.randn_like(out)
    if channels_last:
        a, g = (t.contiguous(memory_format=torch.channels_last) for t in (a, g))
    got = per_sample.conv2d_weight_per_record(a, g, conv, block=block)
    for r in range(11):
        (want,) = torch.autograd.grad((conv(a[r : r + 1]) * g[r : r + 1]).sum(), conv.weight)
        torch.testing.assert_close(got[r], want, rtol=1e-10, atol=1e-12)


def test_conv_weight_per_record_of_no_records_is_empty():
    conv = nn.Conv2d(3, 4, 3, padding=1)
    a, g = torch.randn(0, 3, 5, 5), torch.randn(0, 4, 5, 5)
    assert per_sample.conv2d_weight_per_record(a, g, conv).shape == (0, 4, 3, 3, 3)


class _ViewHead(nn.Module):
    """A convolution whose output the model ``view``s (NCHW-only code)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 6 * 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.conv(x.view(-1, 2, 12, 12))), 2)
        return self.fc(h.view(h.shape[0], -1))


class _MemoryOrder(nn.Module):
    """Reads its convolution's output in memory order (a layout-dependent result)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 12 * 12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.view(-1, 2, 12, 12))
        n = h[0].numel()
        return self.fc(torch.as_strided(h, (h.shape[0], n), (n, 1)))


def _pool_cnn() -> nn.Sequential:
    return nn.Sequential(
        nn.Unflatten(1, (2, 12, 12)),
        nn.Conv2d(2, 8, 3, padding=1),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 9, 3, padding=1),
        nn.BatchNorm2d(9),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(9 * 3 * 3, 4),
    )


def _autograd_per_record(model, params, x, y, names):
    out = {n: [] for n in names}
    for i in range(len(x)):
        at = {k: v.detach().requires_grad_(k in names) for k, v in params.items()}
        loss = F.cross_entropy(functional_call(model, at, (x[i : i + 1],)), y[i : i + 1])
        gs = torch.autograd.grad(loss, [at[n] for n in names])
        for n, g in zip(names, gs):
            out[n].append(g)
    return {n: torch.stack(v) for n, v in out.items()}


def test_channels_last_conv_outputs_in_the_per_record_pass(monkeypatch):
    """Where the model takes it, the shared convolutions' outputs are converted to channels-last
    in the per-record pass (the pooling after them then runs on that layout) and every record's
    gradient still equals autograd's on that record alone; the probe is public (no data), leaves
    the model's modes, batch-norm statistics and the global RNG as they were, and is
    remembered."""
    torch.manual_seed(3)
    model = _pool_cnn().eval()  # eval: dropout off, running statistics (the per-record rule)
    model[6].running_mean.uniform_(-0.5, 0.5)
    model[6].running_var.uniform_(0.5, 2.0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = ("1.weight", "1.bias", "5.weight", "5.bias", "10.weight", "10.bias")
    x, y = torch.randn(6, 288), torch.randint(0, 4, (6,))
    model[6].train()  # a probe in training mode updates no statistic for good
    stats = (model[6].running_mean.clone(), model[6].running_var.clone())
    rng = torch.get_rng_state()
    per_sample.channels_last_ok(model, params, ["1", "5"], (288,), torch.float32)
    assert model[6].training and not model[3].training
    torch.testing.assert_close(model[6].running_mean, stats[0], rtol=0, atol=0)
    torch.testing.assert_close(model[6].running_var, stats[1], rtol=0, atol=0)
    assert torch.equal(torch.get_rng_state(), rng)
    model[6].eval()
    assert per_sample.channels_last_ok(model, params, ["1", "5"], (288,), torch.float32)
    seen = []

    def spy(mod, inp, out):  # the layout the pooling after conv "1" receives
        seen.append(inp[0].is_contiguous(memory_format=torch.channels_last))

    h = model[4].register_forward_hook(spy)
    try:
        got = per_sample.per_record_gradients(model, params, x, y, names)
    finally:
        h.remove()
    assert seen == [True]
    want = _autograd_per_record(model, params, x, y, names)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5)
    seen.clear()
    h = model[4].register_forward_hook(spy)
    try:  # Kernels(channels_last=False): the model's own layout
        off = per_sample.per_record_gradients(model, params, x, y, names, channels_last=False)
    finally:
        h.remove()
    assert seen == [False]  # the model's own layout
    for n in names:
        torch.testing.assert_close(got[n], off[n], rtol=1e-5, atol=1e-6)
    # remembered per (paths, record shape, dtype, parameter dtypes, modes): the training-mode
    # probe's answer and the eval-mode one
    memo = per_sample._CL_OK[model]
    assert len(memo) == 2 and [k for k, v in memo.items() if v and not any(k[-1])]


def test_channels_last_probe_runs_the_model_in_its_mode():
    """The probe takes the branch the pass will take: a model that views its convolution's
    output only in training mode is kept off in training mode and converted in eval mode; a
    dropout after the convolution in training mode draws over memory order, so the outputs
    differ and the conversion is kept off."""

    class TrainView(_ViewHead):
        def forward(self, x):
            h = F.max_pool2d(F.relu(self.conv(x.view(-1, 2, 12, 12))), 2)
            return self.fc(h.view(h.shape[0], -1) if self.training else h.flatten(1))

    model = TrainView()
    params = {k: v.detach() for k, v in model.named_parameters()}
    assert not per_sample.channels_last_ok(model, params, ["conv"], (288,), torch.float32)
    model.eval()
    assert per_sample.channels_last_ok(model, params, ["conv"], (288,), torch.float32)
    drop = nn.Sequential(nn.Unflatten(1, (2, 12, 12)), nn.Conv2d(2, 3, 3), nn.Dropout(0.5),
                         nn.Flatten(), nn.Linear(300, 4))  # fmt: skip
    params = {k: v.detach() for k, v in drop.named_parameters()}
    assert not per_sample.channels_last_ok(drop, params, ["1"], (288,), torch.float32)
    drop.eval()
    assert per_sample.channels_last_ok(drop, params, ["1"], (288,), torch.float32)


@pytest.mark.parametrize("cls", [_ViewHead, _MemoryOrder])
def test_channels_last_kept_off_where_the_model_does_not_take_it(cls):
    """A model that views its convolution's output (the converted forward raises) or reads it
    in memory order (the converted output differs) keeps its own layout, and its per-record
    gradients are right."""
    torch.manual_seed(4)
    model = cls()
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = tuple(params)
    assert not per_sample.channels_last_ok(model, params, ["conv"], (288,), torch.float32)
    x, y = torch.randn(5, 288), torch.randint(0, 4, (5,))
    got = per_sample.per_record_gradients(model, params, x, y, names)
    want = _autograd_per_record(model, params, x, y, names)
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-5)
