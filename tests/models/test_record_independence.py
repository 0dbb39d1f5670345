"""Record independence checked, not assumed (issue 49): a model whose per-record outputs or
gradients depend on the other records of a batch passed the model check and ran under
``privacy.placement=local_dpsgd``, where the one-pass per-record kernel let one user's record
reach the other users' per-record gradients (``fc(x - x.mean(0))``: removing one user moved the
owner's clipped sum by 2.50 C with 8 users per step; ``TorchTraining`` accepted it too).

``fedudp.models.independence.check_independent`` (with the owners' kernels,
``fedudp.owner.independence``) compares every batched kernel's per-record outputs and gradients
with each record's own forward and backward on the public example batch and refuses, naming the
module. Each refusal is checked on every kernel path (the output comparison switched off, each
kernel alone still refuses); the weakened twin (the reference taken from the batched pass
itself, as the old probe did) lets ``x - x.mean(0)`` through, and the test catches it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import fedudp
from fedudp import build
from fedudp.errors import ConfigError
from fedudp.flower.fast import TorchTraining
from fedudp.models import independence, make_model
from fedudp.owner import independence as owner_check
from fedudp.owner import per_sample

FEATURES, CLASSES = 5, 4


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.fc(x)


class MeanCentred(Plain):
    """Linear only, no refused layer: the issue's batch-mixing model."""

    def forward(self, x):
        return self.fc(x - x.mean(0))


class BatchStats(nn.Module):
    def __init__(self, track: bool = True):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(FEATURES, 8),
            nn.BatchNorm1d(8, affine=False, track_running_stats=track),
            nn.Linear(8, CLASSES),
        )

    def forward(self, x):
        return self.body(x)


class AcrossBatch(nn.Module):
    """Attention over the batch dimension: every record attends to every other."""

    def forward(self, h):
        return torch.softmax(h @ h.T, dim=-1) @ h


class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(FEATURES, 8)
        self.attend = AcrossBatch()
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.out(self.attend(self.q(x)))


class Centring(nn.Module):
    """A buffer updated in place by every forward (an EMA of the batch mean, not named as
    running state, so the name rule of check_model does not see it)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("centre", torch.zeros(FEATURES))

    def forward(self, x):
        self.centre.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return x - self.centre


class BufferNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.centring = Centring()
        self.fc = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.fc(self.centring(x))


class MixGrad(torch.autograd.Function):
    """Identity forward; the backward mixes the records' output gradients."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clone()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g + g.mean(0, keepdim=True)


class GradMixing(Plain):
    def forward(self, x):
        return MixGrad.apply(self.fc(x))


class Noisy(Plain):
    def forward(self, x):
        return self.fc(x + 0.1 * torch.randn_like(x))


class Normalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, 8)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.fc(x))))


# model, the module the refusal names, what it says
MIXING = [
    (MeanCentred, "model layer <model> (MeanCentred) mixes the records of a batch"),
    (lambda: BatchStats(track=False), "model layer body.1 (BatchNorm1d) fails on a record alone"),
    (CrossAttention, "model layer attend (AcrossBatch) mixes the records of a batch"),
    (BufferNet, "model layer centring (Centring) changes its buffer 'centring.centre' in place"),
]


def refusal(model, **kw) -> str | None:
    """The check's message for ``model`` on every owner kernel, or None if accepted."""
    try:
        owner_check.check(model, (FEATURES,), CLASSES, **kw)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(("make", "says"), MIXING)
def test_a_model_mixing_records_is_refused_naming_the_module(make, says):
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = torch.random.get_rng_state()
    why = refusal(model)
    assert why is not None and says in why, why
    assert "\n" not in why
    if "mixes" in why:  # what to use instead
        assert "nn.LayerNorm or nn.GroupNorm" in why and "x - x.mean(0)" in why
    # nothing changed: parameters, buffers (the in-place buffer too), the global RNG
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(torch.random.get_rng_state(), state)


def test_batch_norm_in_training_mode_is_refused_by_its_running_statistics():
    why = refusal(BatchStats(track=True))
    assert why is not None and "body.1 (BatchNorm1d) changes its buffer" in why


@pytest.mark.parametrize(("make", "says"), MIXING[:3])
def test_every_kernel_path_refuses_them_on_its_own(make, says, monkeypatch):
    """The output comparison off: each kernel's per-record gradients against each record's own
    backward still refuse (a mixing model fails on every path a configuration can take)."""
    model = make()
    kernels = owner_check.kernels(model)
    want = {owner_check.PER_RECORD, owner_check.ONE_STEP}
    assert set(kernels) == want | (set() if isinstance(model, BatchStats) else {owner_check.GHOST})
    monkeypatch.setattr(independence, "_output_step", lambda *a: None)
    for label, kernel in kernels.items():
        with pytest.raises(ValueError, match="in its gradients|record's own backward") as e:
            independence.check_independent(model, (FEATURES,), CLASSES, kernels={label: kernel})
        # a batch-norm layer fails on a record alone (whatever the kernel); the others are
        # caught by the kernel's own gradients, which the message names
        assert label in str(e.value) or isinstance(model, BatchStats)
    assert refusal(Plain()) is None  # the kernel comparison alone accepts a plain model


def test_a_backward_that_mixes_records_is_refused_by_the_kernel_comparison():
    model = GradMixing()
    why = refusal(model)
    assert why is not None and "mixes the records of a batch in its gradients" in why
    assert "of fc.weight (model layer fc (Linear))" in why
    # the forward alone does not see it
    assert (
        independence._output_step(
            model,
            independence._copies(model, torch.float64),
            torch.randn(6, FEATURES, dtype=torch.float64),
            1e-9,
            "",
        )
        is None
    )


def test_a_random_forward_is_refused():
    why = refusal(Noisy())
    assert why is not None and "random generator" in why


@pytest.mark.parametrize(
    ("name", "shape", "classes", "tokens"),
    [
        ("linear", (FEATURES,), CLASSES, False),
        ("cnn", (1, 28, 28), 10, False),
        ("char_gru", (12,), 30, True),
    ],
)
def test_fedudps_models_are_accepted_on_every_kernel(name, shape, classes, tokens):
    model = make_model(name, shape, classes, seed=0)
    assert owner_check.kernels(model)  # at least one batched kernel compared
    owner_check.check(model, shape, classes, tokens)


def test_a_layer_norm_model_is_accepted_and_the_answer_remembered(monkeypatch):
    model = Normalised()
    assert len(owner_check.kernels(model)) == 3
    assert refusal(model) is None

    def rerun(*a):
        raise AssertionError("checked twice")

    monkeypatch.setattr(independence, "_refusal", rerun)
    assert refusal(model) is None  # remembered per model, shape, classes, kernels and modes
    model.eval()  # another mode: checked again
    with pytest.raises(AssertionError, match="checked twice"):
        refusal(model)


def _from_the_batch(model, at, x):
    """The weakened twin's reference: the batched pass compared with itself (the old probe)."""
    out = independence._forward(model, at, x)
    return [out[r : r + 1] for r in range(len(x))]


def _gradients_from_the_kernel(model, at, x, y):
    names = tuple(n for n, _ in model.named_parameters())
    return per_sample.per_record_gradients(model, at, x, y, names)


def test_weakened_twin_comparing_the_batched_kernel_with_itself_is_caught(monkeypatch):
    assert refusal(MeanCentred()) is not None
    monkeypatch.setattr(independence, "own_outputs", _from_the_batch)
    monkeypatch.setattr(independence, "own_gradients", _gradients_from_the_kernel)
    assert refusal(MeanCentred()) is None  # the hole is back: the twin lets it through
    with pytest.raises(AssertionError):
        test_a_model_mixing_records_is_refused_naming_the_module(*MIXING[0])


def _overrides(**extra):
    return {
        "method": "full_dp",
        "privacy.placement": "local_dpsgd",
        "dataset.name": "synthetic",
        "dataset.features": FEATURES,
        "dataset.classes": CLASSES,
        "train.rounds": 1,
        "progress": False,
        **extra,
    }


@pytest.mark.parametrize("placement", ["local_dpsgd", "server"])
def test_the_public_entry_refuses_before_round_one(placement, monkeypatch):
    def no_data(*a, **k):
        raise AssertionError("the federation was built")

    monkeypatch.setattr(build.assemble, "federation", no_data)
    with pytest.raises(ConfigError, match=r"^model: model layer <model> \(MeanCentred\) mixes"):
        fedudp.simulate(_overrides(**{"privacy.placement": placement}), model=MeanCentred())


def test_the_public_entry_refuses_a_model_target(monkeypatch):
    monkeypatch.setattr(build.assemble, "federation", lambda *a, **k: pytest.fail("data read"))
    over = _overrides(**{"model.target": f"{__name__}.CrossAttention"})
    from fedudp.config import config_from_overrides

    with pytest.raises(ConfigError, match=r"model.target: model layer attend \(AcrossBatch\)"):
        build.prepare(config_from_overrides(over))


def test_the_flower_fast_path_refuses_before_any_update():
    x = torch.randn(3, FEATURES)

    def data(u, n):
        return x, torch.arange(3) % CLASSES

    def arrays(m):
        return {k: v.numpy() for k, v in m.state_dict().items()}

    bad = TorchTraining(MeanCentred(), data, lr=0.1)
    with pytest.raises(ValueError, match=r"^TorchTraining: model layer <model> \(MeanCentred\)"):
        bad.updates(arrays(MeanCentred()), ["fc.weight", "fc.bias"], [0, 1], 2, {})
    good = TorchTraining(Plain(), data, lr=0.1)
    G, _, raised = good.updates(arrays(good.module()), ["fc.weight", "fc.bias"], [0, 1], 2, {})
    assert not raised and G.shape == (2, FEATURES * CLASSES + CLASSES)
    assert np.isfinite(G.numpy()).all()


def _clipped_sum_sensitivity(model, kind: str, users: int = 8, outlier: float = 100.0) -> float:
    """``max_u ||S(D) - S(D without u)|| / C`` of one owner's clipped sum (one step, every user
    in it, one record each, C = 1), noise-free, by the kernel ``kind`` called directly."""
    from fedudp.owner import dpsgd
    from fedudp.privacy.mechanisms import clip_factors

    g = torch.Generator().manual_seed(0)
    x = 50.0 * torch.randn(users, FEATURES, generator=g, dtype=torch.float64)
    x[0] *= outlier
    y = torch.randint(0, CLASSES, (users,), generator=g)
    model = model.double()
    names = tuple(n for n, _ in model.named_parameters())

    def total(keep):
        xs, ys = x[keep], y[keep]
        if kind == "fast":  # the fast path's updates, clipped and summed as the mod does
            t = TorchTraining(model, lambda u, n: (xs[u : u + 1], ys[u : u + 1]), lr=1.0)
            t.check_independent = lambda x: None  # bypassed: the kernel as it ran before
            arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
            G = t.updates(arrays, names, list(range(len(ys))), len(ys), {})[0]
            return (clip_factors([G], 1.0)[0].unsqueeze(1) * G).sum(0)
        at = {k: v.detach().unsqueeze(0) for k, v in model.named_parameters()}
        n = len(ys)
        return dpsgd._owner_clipped_sum(
            model,
            at,
            {},
            {},
            xs,
            ys,
            np.arange(n),
            np.ones(n, np.int64),
            0,
            names,
            1.0,
            kind == "ghost",
        )[0].double()

    full = total(torch.ones(users, dtype=torch.bool))
    return max(float((full - total(torch.arange(users) != u)).norm()) for u in range(users))


@pytest.mark.parametrize("kind", ["per_sample", "ghost", "fast"])
def test_the_premise_what_a_mixing_model_releases_moves_by_more_than_the_clip(kind):
    """Why the check exists: on every kernel, the owner's clipped sum (what its noise protects)
    moves by at most C when one user leaves for the plain model, and by several C for
    ``fc(x - x.mean(0))`` (the check bypassed, as before issue 49)."""
    torch.manual_seed(0)
    assert _clipped_sum_sensitivity(Plain(), kind) <= 1.0 + 1e-9
    torch.manual_seed(0)
    assert _clipped_sum_sensitivity(MeanCentred(), kind) > 2.0
