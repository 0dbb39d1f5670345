"""A model that does not fit the declared data or the per-record path is refused before any
round (issue 37; fedudp.models.validate.probe, fedudp.build.probe_model, run by
fedudp.build.prepare once per run): 7 outputs for 4
classes ran silently, 3 ended in cross-entropy's raw IndexError, nn.LSTMCell / GRUCell /
RNNCell failed inside vmap, a custom autograd.Function without a vmap rule gave a raw functorch
error. Each refusal is one line naming model.target (or model.name), the layer and what to use
instead; each premise (that the model really fails in vmap) is checked against torch itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from fedudp import build
from fedudp.config import config_from_overrides
from fedudp.errors import ConfigError
from fedudp.models.validate import example_batch, fast_per_record, probe

FEATURES, CLASSES = 5, 4


def build_model(cfg):
    """The model as ``fedudp.build.prepare`` builds it: checked and probed."""
    return build.model(cfg, probe=True)


def me(name: str) -> str:
    return f"{__name__}.{name}"


def cfg_for(target: str, **kwargs):
    over = {
        "dataset.name": "synthetic",
        "dataset.features": FEATURES,
        "dataset.classes": CLASSES,
        "model.target": target,
    }
    over.update({f"model.kwargs.{k}": v for k, v in kwargs.items()})
    return config_from_overrides(over)


class Head(nn.Module):
    def __init__(self, outputs: int = CLASSES):
        super().__init__()
        self.fc = nn.Linear(FEATURES, 8)
        self.out = nn.Linear(8, outputs)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x)))


class CellNet(nn.Module):
    """One recurrent step of a torch cell, then a linear head."""

    def __init__(self, kind: str = "LSTMCell"):
        super().__init__()
        self.cell = getattr(nn, kind)(FEATURES, 8)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = self.cell(x)
        return self.out(h[0] if isinstance(h, tuple) else h)


class OldSquare(torch.autograd.Function):
    """The pre-functorch form: ctx in forward, no setup_context, no vmap rule."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class Square(torch.autograd.Function):
    """The same function with a vmap rule (functorch's documented form)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class SquareLayer(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn.apply(x)


class FnNet(nn.Module):
    def __init__(self, with_rule: bool = False):
        super().__init__()
        self.fc = nn.Linear(FEATURES, CLASSES)
        self.sq = SquareLayer(Square if with_rule else OldSquare)

    def forward(self, x):
        return self.sq(self.fc(x))


class TwiceNet(nn.Module):
    """An exact nn.Linear applied twice per forward: fast_per_record's type rule admits it, the
    one-pass kernel cannot (its output gradient is not one record's)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(FEATURES, FEATURES)
        self.out = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.out(self.fc(torch.tanh(self.fc(x))))


def vmap_grads(model: nn.Module):
    """What every owner computation runs: each record's gradient through vmap(grad)."""
    x, y = example_batch((FEATURES,), CLASSES)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


@pytest.mark.parametrize("outputs", [7, 3])
def test_outputs_other_than_the_declared_classes_are_refused(outputs):
    with pytest.raises(ConfigError) as info:
        build_model(cfg_for(me("Head"), outputs=outputs))
    msg = str(info.value)
    assert msg.startswith(f"model.target: model output is [2, {outputs}]") and "\n" not in msg
    assert f"must be [2, {CLASSES}]" in msg and f"dataset.classes={CLASSES}" in msg


def test_a_model_that_fits_is_built_and_its_parameters_untouched():
    cfg = cfg_for(me("Head"))
    m = build_model(cfg)
    assert dict(m.named_parameters()).keys() == {"fc.weight", "fc.bias", "out.weight", "out.bias"}
    # the probe neither trains nor reseeds: the same config builds the same parameters twice
    again = build_model(cfg)
    for (_, a), (_, b) in zip(m.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b)


def test_the_declared_input_shape_is_what_the_probe_feeds():
    # the model expects 6 features; the declared shape is 5: the first layer is named
    class_path = "torch.nn.Linear"
    with pytest.raises(
        ConfigError,
        match=r"^model\.target: model layer <model> \(Linear\) fails "
        r"on an example batch of shape \[2, 5\]",
    ):
        build_model(cfg_for(class_path, in_features=6, out_features=CLASSES))


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell", "RNNCell"])
def test_recurrent_cells_are_refused_naming_the_layer(kind):
    # premise: torch's vmap cannot compute their per-record gradients
    with pytest.raises(RuntimeError):
        vmap_grads(CellNet(kind))
    with pytest.raises(ConfigError) as info:
        build_model(cfg_for(me("CellNet"), kind=kind))
    msg = str(info.value)
    assert msg.startswith(f"model.target: model layer cell ({kind}) has no torch.func.vmap")
    assert "GRULayer" in msg and "\n" not in msg


def test_an_autograd_function_without_a_vmap_rule_is_refused_naming_the_layer():
    with pytest.raises(RuntimeError, match="autograd.Function"):  # premise
        vmap_grads(FnNet())
    with pytest.raises(ConfigError) as info:
        build_model(cfg_for(me("FnNet")))
    msg = str(info.value)
    assert (
        msg.startswith(
            "model.target: model layer sq (SquareLayer) fails in the per-record gradient path"
        )
        and "\n" not in msg
    )
    assert "setup_context" in msg and "generate_vmap_rule" in msg
    # its twin with a vmap rule is accepted, and vmap then gives the gradient of x*x
    m = build_model(cfg_for(me("FnNet"), with_rule=True))
    g = vmap_grads(m)
    x, y = example_batch((FEATURES,), CLASSES)
    p = {n: q.detach().clone().requires_grad_(True) for n, q in m.named_parameters()}
    F.cross_entropy(functional_call(m, p, (x[:1],)), y[:1]).backward()
    assert torch.allclose(g["fc.weight"][0], p["fc.weight"].grad, atol=1e-6)


def test_a_linear_applied_twice_is_refused_by_the_one_pass_kernel():
    assert fast_per_record(TwiceNet())  # premise: the type rule admits it
    probe(TwiceNet(), (FEATURES,), CLASSES)  # and vmap runs it
    with pytest.raises(
        ConfigError,
        match=r"^model\.target: model fails in DP-SGD's one-pass "
        r"per-record gradients.*called twice.*own nn\.Linear",
    ):
        build_model(cfg_for(me("TwiceNet")))


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # linear
        {"dataset.name": "mnist", "dataset.classes": None, "dataset.features": 20},  # paper CNN
    ],
)
def test_built_in_models_pass_the_probe(overrides):
    over = {"dataset.name": "synthetic", "dataset.features": FEATURES, **overrides}
    build_model(config_from_overrides(over))


def test_prepare_probes_before_the_federation_is_built(monkeypatch):
    built = []
    monkeypatch.setattr(build.assemble, "owners", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError, match=r"^model\.target: model output is \[2, 7\]"):
        build.prepare(cfg_for(me("Head"), outputs=7))
    assert not built


def test_a_natural_federations_model_is_probed_before_its_files_are_read(tmp_path, monkeypatch):
    read = []
    monkeypatch.setattr(build.assemble, "natural_records", lambda *a, **k: read.append(1))
    cfg = config_from_overrides(
        {
            "dataset.name": "npz",
            "dataset.path": str(tmp_path / "f.npz"),
            "dataset.classes": CLASSES,
            "dataset.input_shape": [FEATURES],
            "model.target": me("Head"),
            "model.kwargs.outputs": 7,
        }
    )
    with pytest.raises(ConfigError, match=r"^model\.target: model output is \[2, 7\]"):
        build.prepare(cfg)
    assert not read


class TwiceWithNorm(TwiceNet):
    """TwiceNet plus a LayerNorm (vmap path for the whole model): the kernel still runs for the
    shared Linear layers of a method that keeps the norm personal, so it is probed too."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(FEATURES)

    def forward(self, x):
        return super().forward(self.norm(x))


def test_the_kernel_is_probed_on_the_layers_it_covers_when_others_do_not_qualify():
    m = TwiceWithNorm()
    assert not fast_per_record(m) and fast_per_record(m, ("fc.weight", "out.weight"))
    with pytest.raises(ConfigError, match=r"called twice"):
        build_model(cfg_for(me("TwiceWithNorm")))


@pytest.mark.parametrize("name", ["linear", "cnn", "char_gru"])
def test_every_registered_built_in_model_runs_the_per_record_vmap_path(name):
    """A run's probe skips ``torch.func.vmap(grad(...))`` for fedudp's own models
    (``build.builtin_model``): this is where that path is checked for each of them, and the
    list is the registry's."""
    from fedudp.models import MODELS, make_model
    from fedudp.models.validate import probe

    assert sorted(MODELS.names()) == ["char_gru", "cnn", "linear"]
    shape, tokens = {"linear": ((20,), False), "cnn": ((1, 28, 28), False)}.get(name, ((12,), True))
    m = make_model(name, shape, 5, seed=0)
    assert build.builtin_model(m)
    probe(m, shape, 5, tokens)  # per_record=True: runs vmap(grad)
