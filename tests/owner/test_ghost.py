"""Per-user clipping without per-user gradients (``fedudp.owner.ghost``) against each user's
explicitly computed gradient (one autograd call per user, float64), per layer kind, and the
clipped sum against the owners' ordinary constraint (``make_reply``) on the vectors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from fedudp.protocol.contributions import Constraint
from fedudp.owner import ghost, ghost_norms
from fedudp.owner.kernels import Kernels
from fedudp.protocol.messages import make_reply
from tests.owner.kernel_switch import owners_take


class Seq(nn.Module):
    """A Linear on inputs with a middle (sequence) dim, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(20, 10)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)).flatten(1))


class Tokens(nn.Module):
    """Embedding (with a padding index) -> LayerNorm -> head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(24, 10)

    def forward(self, x):
        return self.head(self.norm(self.emb(x)).flatten(1))


def _conv(norm: str | None = None, **kw) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(2, 4, 3, **kw)]
    if norm == "group":
        layers.append(nn.GroupNorm(2, 4))
    if norm == "batch":
        layers.append(nn.BatchNorm2d(4))
    layers += [nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 10)]
    return nn.Sequential(*layers)


CASES = {
    "linear": (lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 10)), (6,)),
    "linear_seq": (Seq, (4, 6)),
    "conv_stride_pad_dil": (lambda: _conv(stride=2, padding=1, dilation=2), (2, 9, 9)),
    "conv_plain": (lambda: _conv(), (2, 6, 6)),
    "embedding_layernorm": (Tokens, (6,)),
    "groupnorm": (lambda: _conv("group", padding=1), (2, 5, 5)),
    "batchnorm_eval": (lambda: _conv("batch", padding=1).eval(), (2, 5, 5)),
}


def _data(shape, sizes, seed, tokens=False):
    g = torch.Generator().manual_seed(seed)
    n = int(sum(sizes))
    if tokens:
        x = torch.randint(0, 7, (n, *shape), generator=g)
    else:
        x = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (n,), generator=g)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return x, y, starts, np.asarray(sizes, dtype=np.int64)


def _model(case, seed=0):
    torch.manual_seed(seed)
    make, shape = CASES[case]
    model = make().double()
    for m in model.modules():  # non-trivial affine and running statistics
        if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm2d)):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.3, 0.3)
            m.running_var.uniform_(0.5, 2.0)
    return model, shape


def _per_user(model, params, x, y, starts, sizes, names, scale):
    """[U, d] float64: each user's vector, scale times its mean gradient, one autograd call
    per user (the definition)."""
    rows = []
    for s, k in zip(starts, sizes):
        at = {n: v.detach().requires_grad_(n in names) for n, v in params.items()}
        out = functional_call(model, at, (x[s : s + k],))
        loss = F.cross_entropy(out, y[s : s + k]) * scale
        gs = torch.autograd.grad(loss, [at[n] for n in names])
        rows.append(torch.cat([t.reshape(-1) for t in gs]))
    return torch.stack(rows)


def _clipped_sum_as_make_reply(gg, V, names, c):
    """ghost.clipped_sum(gg, c), checked against make_reply on the explicit vectors V: the same
    count, clipped and failed users and the same total; returns (contribution, failed)."""
    got, failed = ghost.clipped_sum(gg, c)
    ref = make_reply(V.clone(), names, c)
    assert (got.count, got.clipped, failed) == (
        ref.contribution.count,
        ref.contribution.clipped,
        ref.failed,
    )
    torch.testing.assert_close(got.total, ref.contribution.total, rtol=1e-9, atol=1e-13)
    return got, failed


SIZES = {"one": [1] * 7, "many": [1, 3, 5, 2, 1, 4]}


# both forms of the Linear / Conv2d weights' norms, forced, and the cost rule's choice
FORMS = [
    (case, form)
    for case in sorted(CASES)
    for form in ([None, "ghost", "materialized"] if case.startswith(("linear", "conv")) else [None])
]


@pytest.mark.parametrize("case,form", FORMS)
@pytest.mark.parametrize("users", sorted(SIZES))
def test_norms_and_clipped_sum_equal_the_explicit_per_user_gradients(case, users, form):
    model, shape = _model(case)
    x, y, starts, sizes = _data(shape, SIZES[users], 1, tokens=case.startswith("embedding"))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = tuple(params)
    assert ghost.supported(model, names)
    V = _per_user(model, params, x, y, starts, sizes, names, -0.3)
    gg = ghost.ghost_gradients(model, params, x, y, starts, sizes, names, -0.3, form=form)
    torch.testing.assert_close(gg.norms, V.norm(dim=1), rtol=1e-10, atol=1e-14)
    assert bool(gg.finite.all())
    f = torch.linspace(0.2, 1.0, len(sizes), dtype=torch.float64)
    torch.testing.assert_close(
        gg.weighted_sum(f), (f.unsqueeze(1) * V).sum(0), rtol=1e-9, atol=1e-13
    )
    # the clipped sum and its counts are make_reply's on the explicit vectors
    srt = V.norm(dim=1).sort().values  # a clip between two users' norms
    c = Constraint(rows=False, clip=float(srt[len(srt) // 2 - 1] + srt[len(srt) // 2]) / 2)
    got, _ = _clipped_sum_as_make_reply(gg, V, names, c)
    assert 0 < got.clipped < got.count


def test_a_weakened_twin_without_cross_terms_is_caught(monkeypatch):
    """Dropping the cross terms r != r' of the Gram form (each record's own norm squared, summed)
    leaves one-record users right and multi-record users wrong: the comparison above catches it."""
    model, shape = _model("linear")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = tuple(params)

    def diagonal_only(G, A):
        return ((G * G).sum(2) * (A * A).sum(2)).sum(1)

    monkeypatch.setattr(ghost_norms, "_gram_sq", diagonal_only)
    for users, wrong in (("one", False), ("many", True)):
        x, y, starts, sizes = _data(shape, SIZES[users], 1)
        V = _per_user(model, params, x, y, starts, sizes, names, 1.0)
        gg = ghost.ghost_gradients(model, params, x, y, starts, sizes, names, 1.0, form="ghost")
        close = torch.allclose(gg.norms, V.norm(dim=1), rtol=1e-10, atol=1e-14)
        assert close != wrong
        if wrong:  # exactly the multi-record users are off
            off = ~torch.isclose(gg.norms, V.norm(dim=1), rtol=1e-10, atol=1e-14)
            assert off.tolist() == [bool(k > 1) for k in sizes]


def test_non_finite_users_are_dropped_as_make_reply_drops_them():
    """A user with a NaN input (and one whose input overflows its gradient to inf) contributes
    nothing and is counted as failed, as on today's path; the others' sum is unchanged."""
    model, shape = _model("conv_plain")
    x, y, starts, sizes = _data(shape, SIZES["many"], 2)
    x[starts[1] + 1, 0, 2, 2] = float("nan")  # the second user's second record
    x[starts[3], 1, 1, 1] = float("inf")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = tuple(params)
    V = _per_user(model, params, x, y, starts, sizes, names, 1.0)
    gg = ghost.ghost_gradients(model, params, x, y, starts, sizes, names, 1.0)
    assert gg.finite.tolist() == torch.isfinite(V).all(1).tolist() == [1, 0, 1, 0, 1, 1]
    c = Constraint(rows=False, clip=0.05)
    got, failed = ghost.clipped_sum(gg, c)
    ref = make_reply(V.clone(), names, c)
    assert (
        (got.count, got.clipped, failed)
        == (4, ref.contribution.clipped, 2)
        == (
            ref.contribution.count,
            ref.contribution.clipped,
            ref.failed,
        )
    )
    torch.testing.assert_close(got.total, ref.contribution.total, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("kernels_below", [1, 100])  # each per-record form for every layer
def test_one_record_users_over_several_conv_blocks_with_dropped_users(monkeypatch, kernels_below):
    """One-record users whose conv weight gradients come in several blocks (8, 8, 5: the last
    one short), non-finite users in the second and third blocks: norms, drops, the clip and the
    clipped sum as make_reply gives them from the explicit vectors."""
    from fedudp.owner import per_sample

    monkeypatch.setattr(per_sample, "BLOCK", 8)
    monkeypatch.setattr(per_sample, "KERNELS_BELOW", kernels_below)
    model, shape = _model("conv_plain")
    x, y, starts, sizes = _data(shape, [1] * 21, 5)
    x[starts[9], 0, 1, 1] = float("nan")
    x[starts[18], 1, 2, 2] = float("inf")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = tuple(params)
    V = _per_user(model, params, x, y, starts, sizes, names, 1.0)
    gg = ghost.ghost_gradients(model, params, x, y, starts, sizes, names, 1.0, "materialized")
    conv_w = [n for n, f in gg.forms.items() if f == "materialized" and n.endswith("weight")]
    blocks = [len(L.per_user[n]) for L in gg.layers for n in L.per_user if n in conv_w]
    assert blocks and all(b == 3 for b in blocks if b > 1) and 3 in blocks
    fin = torch.isfinite(V).all(1)
    assert gg.finite.tolist() == fin.tolist() and (~fin).nonzero().flatten().tolist() == [9, 18]
    torch.testing.assert_close(gg.norms[fin], V[fin].norm(dim=1), rtol=1e-10, atol=1e-14)
    got, failed = _clipped_sum_as_make_reply(gg, V, names, Constraint(rows=False, clip=0.05))
    assert failed == 2 and got.count == 19


def test_unsupported_layers_and_modes_fall_back():
    bn = _conv("batch")  # training mode: batch statistics couple the records
    assert not ghost.supported(bn, tuple(n for n, _ in bn.named_parameters()))
    assert ghost.supported(bn.eval(), tuple(n for n, _ in bn.named_parameters()))
    for mod in (
        nn.Conv2d(4, 4, 3, groups=2),
        nn.Conv2d(2, 2, 3, padding="same"),
        nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
        nn.Embedding(5, 3, max_norm=1.0),
        nn.LSTM(3, 3),
        nn.Conv1d(2, 2, 3),
    ):
        assert not ghost.supported(mod, tuple(n for n, _ in mod.named_parameters()))
    twice = nn.Linear(3, 3).double()

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.f = twice

        def forward(self, x):
            return self.f(self.f(x))

    m = Twice()
    params = {n: p.detach() for n, p in m.named_parameters()}
    with pytest.raises(NotImplementedError, match="called twice"):
        x, y, starts, sizes = _data((3,), [1, 2], 0)
        ghost.ghost_gradients(m, params, x, y % 3, starts, sizes, tuple(params), 1.0)


def mlp(input_shape, classes):
    """The end-to-end tests' model (``model.target=test_ghost.mlp``): every weight's norm takes
    the Gram form for one-record users."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 16), nn.Tanh(), nn.Linear(16, classes)
    )


@pytest.mark.parametrize(
    "kw",
    [
        {"train__shared_update": "gradient"},  # each user's mean gradient, clip + Gaussian
        {"privacy__clip_policy": "adaptive"},  # one-step deltas, adaptive clipping
        {"train__shared_update": "gradient", "partition__records_per_user": 4},
        {"aggregator": "dp_ftrl_tree"},  # one-step deltas, DP-FTRL's tree
    ],
    ids=["gradient-gaussian", "delta-adaptive", "gradient-4-records", "delta-tree"],
)
def test_a_run_on_the_ghost_path_equals_the_run_on_todays_path(kw, tmp_path, monkeypatch):
    """engine=local, server placement: the owners' replies (clipped sums, counts, clipped
    counts) each round and the run's losses and ε with the ghost path equal those of the run
    with every user's vector built and clipped (``Kernels(ghost=False)``), on the same seed."""
    import fedudp.owner.owners as ow
    from conftest import tiny_cfg
    from fedudp.run import run

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    calls: list[int] = []
    inside = [False]  # counted in the owners' replies only (the record-independence probe at
    # prepare time runs every kernel, the ghost one included, whatever Kernels says)
    orig = ghost.ghost_gradients
    monkeypatch.setattr(
        ghost,
        "ghost_gradients",
        lambda *a, **k: (calls.append(1) if inside[0] else None) or orig(*a, **k),
    )
    replies: dict[bool, list] = {True: [], False: []}
    honest = ow.Owners.reply

    def reply(self, *a, **k):
        inside[0] = True
        try:
            return honest(self, *a, **k)
        finally:
            inside[0] = False

    out = {}
    for flag in (True, False):
        owners_take(monkeypatch, Kernels(ghost=flag))
        monkeypatch.setattr(
            ow.Owners,
            "reply",
            lambda self, *a, flag=flag, **k: (
                replies[flag].append(reply(self, *a, **k)) or replies[flag][-1]
            ),
        )
        cfg = tiny_cfg(
            "full_dp", model__target="test_ghost.mlp", train__rounds=2, train__lr=2.0, **kw
        )
        out[flag] = run(cfg, tmp_path / str(flag))
        if flag:
            assert len(calls) >= 2  # the ghost path, every round
            calls.clear()
    assert not calls  # Kernels(ghost=False): the reference path
    assert len(replies[True]) == len(replies[False]) == 2
    for a, b in zip(replies[True], replies[False]):
        ca, cb = a.contribution, b.contribution
        assert (ca.count, ca.clipped, a.failed) == (cb.count, cb.clipped, b.failed)
        assert 0 < ca.clipped  # the clip binds for some users
        torch.testing.assert_close(ca.total, cb.total, rtol=1e-5, atol=1e-6)
    assert out[True]["epsilon"] == out[False]["epsilon"]
    assert out[True]["loss"] == pytest.approx(out[False]["loss"], rel=1e-5)


@pytest.mark.parametrize("per_user", [1, 3])
def test_owner_dpsgd_steps_on_the_ghost_path_equal_the_per_record_path(per_user, monkeypatch):
    """Owner-side DP-SGD (keyed sampling and noise, an adaptive clip's released counts): each
    step's clipped sum through ``ghost`` equals the per-record path's (``per_sample``), users of
    one and of several records, owner-specific frozen layers."""
    from fedudp.owner import dpsgd

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 10)).double()
    allp = {k: v.detach().clone() for k, v in model.named_parameters()}
    names = ("0.weight", "0.bias", "2.weight")  # 2.bias: frozen, owner-specific
    shared = {k: allp[k] for k in names}
    owners, users_per = 3, 6
    n = owners * users_per * per_user
    x, y = torch.randn(n, 6, dtype=torch.float64), torch.randint(0, 10, (n,))
    frozen = {"2.bias": 0.1 * torch.randn(owners, 10, dtype=torch.float64)}
    starts, sizes = np.arange(0, n, per_user), np.full(n // per_user, per_user)
    first = np.arange(0, owners * users_per, users_per)
    users, ids = np.full(owners, users_per), np.arange(owners)
    calls: list[int] = []
    orig = ghost.ghost_gradients
    monkeypatch.setattr(ghost, "ghost_gradients", lambda *a, **k: calls.append(1) or orig(*a, **k))
    out, fr = {}, {}
    for flag in (True, False):
        spec = dpsgd.DpSgdSpec(
            0.7, 0.05, 3, 2, 0.1, 5, count_noise=0.5, kernels=Kernels(ghost=flag)
        )
        fr[flag] = np.zeros(owners)
        out[flag] = dpsgd.dpsgd_deltas(
            model, shared, frozen, {}, x, y, starts, sizes, first, users, users, ids, spec, 1,
            names, 64, fractions=fr[flag],
        )  # fmt: skip
        assert bool(calls) == flag
        calls.clear()
    assert float(out[True].abs().max()) > 0
    torch.testing.assert_close(out[True], out[False], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(fr[True], fr[False], rtol=1e-12)


def test_the_path_rule_reads_layer_shapes_only():
    """``gram_share``: the fraction of the shared parameters whose weight norm takes the Gram
    form, from the model's shapes (a zero record of the declared input shape) and the largest
    user's record count: the paper CNN's two heads (70 % of its parameters) at one record per
    user, none of its weights at 10 (every weight gradient is materialized anyway: today's path);
    an MLP's weights at both."""
    from fedudp.models.cnn import PaperCNN

    cnn = PaperCNN()
    names = tuple(n for n, _ in cnn.named_parameters())
    one = ghost.gram_share(cnn, (1, 28, 28), torch.float32, names, 1)
    assert one == pytest.approx(2 * 15680 / 44628)
    assert ghost.gram_share(cnn, (1, 28, 28), torch.float32, names, 10) == 0.0
    mlp_ = mlp((784,), 10)
    mnames = tuple(n for n, _ in mlp_.named_parameters())
    for k in (1, 10):
        assert ghost.gram_share(mlp_, (784,), torch.float64, mnames, k) > 0.98
    state = torch.get_rng_state()
    wrapped = nn.Sequential(nn.Dropout(0.5), mlp_)
    wnames = tuple(n for n, _ in wrapped.named_parameters())
    assert ghost.gram_share(wrapped, (784,), torch.float32, wnames, 1) > 0.98
    assert torch.equal(state, torch.get_rng_state())  # the probe draws nothing that stays drawn
