"""Personal training and evaluation of a convolution model at the owners' speed (issue 40):
per_silo (every parameter personal) and joint_dp (``fc1.*`` personal) on a small generated
federation of owners of unequal sizes, with the paper CNN on 12x12 images.

What ``Owners.personal_round`` and ``Owners.evaluate`` compute is checked against plain
per-owner computations written here from torch primitives (``functional_call``,
``torch.autograd.grad``, ``F.cross_entropy``); which kernel the personal step takes is checked
against the one FedAvg's owner training takes on the same owners.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedudp.data.federation import Federation
from fedudp.models import make_model
from fedudp.owner import evaluation, local_sgd
from fedudp.owner.local_sgd import LocalSpec
from fedudp.owner.owners import Owners
from fedudp.owner.settings import OwnerTraining
from fedudp.protocol.methods import make_method
from fedudp.randomness import Purpose, numpy_rng

SEED, LR, BATCH, EPOCHS, ROUND = 0, 0.1, 8, 2, 2
# records per owner: at batches of 8, owners of 16 and 8 records average >= 8 records a step
# (local_sgd.loop_units: the per-owner loop), those of 11 and 5 fewer (vmapped)
TRAIN, TEST = (16, 8, 5, 11), (9, 0, 3, 14)
SHAPE = (1, 12, 12)


def federation() -> Federation:
    g = torch.Generator().manual_seed(7)
    n, m = sum(TRAIN), sum(TEST)
    # two users per owner (sizes do not matter to the owner-level updates)
    user_sizes = [s for t in TRAIN for s in (t // 2, t - t // 2)]
    return Federation(
        x=torch.randn(n, *SHAPE, generator=g),
        y=torch.randint(0, 10, (n,), generator=g),
        user_offsets=np.concatenate([[0], np.cumsum(user_sizes)]).astype(np.int64),
        user_owner=np.repeat(np.arange(len(TRAIN)), 2),
        owner_user_offsets=np.arange(0, 2 * len(TRAIN) + 1, 2, dtype=np.int64),
        x_test=torch.randn(m, *SHAPE, generator=g),
        y_test=torch.randint(0, 10, (m,), generator=g),
        test_offsets=np.concatenate([[0], np.cumsum(TEST)]).astype(np.int64),
        num_classes=10,
        owner_classes=None,
    )


def owners_for(method: str) -> Owners:
    model = make_model("cnn", SHAPE, 10, seed=SEED)
    for p in model.parameters():
        p.requires_grad_(False)
    spec = LocalSpec(SEED, LR, BATCH, EPOCHS)
    return Owners(model, make_method(method, model), OwnerTraining(spec, spec, "delta"), 512)


def start(owners: Owners, seed: int = 3) -> tuple[dict, dict]:
    """Non-trivial broadcast shared parameters and owners' own personal parameters."""
    g = torch.Generator().manual_seed(seed)
    init = dict(owners.model.named_parameters())
    shared = {
        k: init[k] + 0.05 * torch.randn(init[k].shape, generator=g) for k in owners.spec.shared
    }
    personal = {
        k: init[k] + 0.05 * torch.randn(len(TRAIN), *init[k].shape, generator=g)
        for k in owners.spec.personal
    }
    return shared, personal


def plain_sgd(model, fed: Federation, j: int, shared: dict, mine: dict) -> dict:
    """Owner j's epochs of minibatch SGD on its ``mine`` parameters over all its records, its
    records visited in the order of keys from (seed, PERSONAL_ORDER, round, epoch, owner id)."""
    oo = fed.owner_offsets
    a, n = int(oo[j]), int(oo[j + 1] - oo[j])
    mine = {k: v.clone() for k, v in mine.items()}
    for e in range(EPOCHS):
        keys = numpy_rng(SEED, Purpose.PERSONAL_ORDER, ROUND, e, int(fed.owner_ids[j])).random(n)
        order = torch.from_numpy(a + np.argsort(keys, kind="stable"))
        for s in range(0, n, BATCH):
            idx = order[s : s + BATCH]
            live = {k: v.detach().requires_grad_(True) for k, v in mine.items()}
            logits = functional_call(model, {**shared, **live}, (fed.x[idx],))
            grads = torch.autograd.grad(F.cross_entropy(logits, fed.y[idx]), list(live.values()))
            mine = {k: v.detach() - LR * g for (k, v), g in zip(live.items(), grads)}
    return mine


@pytest.mark.parametrize("method", ["per_silo", "joint_dp"])
def test_personal_round_is_each_owners_plain_sgd(method):
    fed, owners = federation(), owners_for(method)
    shared, personal = start(owners)
    new = owners.personal_round(fed, shared, personal, ROUND)
    assert set(new) == set(owners.spec.personal)
    for j in range(len(TRAIN)):
        mine = {k: v[j] for k, v in personal.items()}
        want = plain_sgd(owners.model, fed, j, shared, mine)
        for k in want:
            torch.testing.assert_close(new[k][j], want[k], atol=2e-5, rtol=1e-4)
    # the owners' inputs are not modified in place
    init = start(owners)[1]
    assert all(torch.equal(personal[k], init[k]) for k in personal)


def test_per_silo_personal_step_takes_fedavgs_owner_kernels(monkeypatch):
    """per_silo's personal step and FedAvg's owner training (the whole model, every owner, the
    same records and epochs) send the same owners to the same kernel: the per-owner loop for
    owners of >= 8 records a step, vmap for the others."""
    calls: list[tuple[str, str, tuple[int, ...]]] = []
    stage = ["?"]
    for name in ("_local_sgd_loop", "_local_sgd_vmap"):
        real = getattr(local_sgd, name)

        def spy(*args, _real=real, _name=name):
            orders = args[6]
            calls.append((stage[0], _name, tuple(int(s) for s in (orders[:, 0] >= 0).sum(1))))
            return _real(*args)

        monkeypatch.setattr(local_sgd, name, spy)
    fed = federation()
    silo, fedavg = owners_for("per_silo"), owners_for("fedavg")
    shared, _ = start(fedavg)
    stage[0] = "personal"
    silo.personal_round(fed, {}, silo.initial_personal(len(TRAIN)), ROUND)
    stage[0] = "fedavg"
    fedavg.owner_deltas(fed, shared, {}, np.arange(len(TRAIN)), ROUND, constraint=None)  # type: ignore[arg-type]

    def routed(s: str) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for st, name, sizes in calls:
            if st == s:
                out.setdefault(name, []).extend(sizes)
        return {k: sorted(v) for k, v in out.items()}

    assert (
        routed("personal")
        == routed("fedavg")
        == {
            "_local_sgd_loop": [8, 16],
            "_local_sgd_vmap": [5, 11],
        }
    )


def plain_evaluation(model, fed: Federation, shared: dict, personal: dict):
    """Each owner's (accuracy, mean loss) on its test shard, one forward per owner (NaN for an
    empty shard)."""
    acc, loss = np.full(len(TEST), np.nan), np.full(len(TEST), np.nan)
    for j in range(len(TEST)):
        a, b = int(fed.test_offsets[j]), int(fed.test_offsets[j + 1])
        if b == a:
            continue
        logits = functional_call(
            model, {**shared, **{k: v[j] for k, v in personal.items()}}, (fed.x_test[a:b],)
        )
        acc[j] = float((logits.argmax(1) == fed.y_test[a:b]).double().mean())
        loss[j] = float(F.cross_entropy(logits.double(), fed.y_test[a:b]))
    return acc, loss


@pytest.mark.parametrize("method", ["per_silo", "joint_dp"])
def test_evaluation_with_personal_convolution_model_is_each_owners_forward(method):
    fed, owners = federation(), owners_for(method)
    shared, personal = start(owners)
    want_acc, want_loss = plain_evaluation(owners.model, fed, shared, personal)
    acc, loss = owners.evaluate(fed, shared, personal)
    np.testing.assert_array_equal(np.isnan(acc), np.isnan(want_acc))
    np.testing.assert_allclose(acc, want_acc, equal_nan=True)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("method", ["per_silo", "joint_dp"])
def test_evaluation_paths_agree(method):
    """``evaluate_sums``'s per-owner loop (auto for a convolution model with personal
    parameters) and its vmapped forward (the former path) give the same sums."""
    fed, owners = federation(), owners_for(method)
    shared, personal = start(owners)
    off = fed.test_offsets
    got = {
        path: evaluation.evaluate_sums(
            owners.model, shared, personal, fed.x_test, fed.y_test, off, path=path
        )
        for path in ("auto", "loop", "vmap")
    }
    for path in ("auto", "loop"):
        np.testing.assert_array_equal(got[path][0], got["vmap"][0])
        np.testing.assert_allclose(got[path][1], got["vmap"][1], rtol=1e-5)
    assert got["loop"][1][1] == 0.0 and got["loop"][0][1] == 0.0  # the empty shard
    with pytest.raises(ValueError, match="path"):
        evaluation.evaluate_sums(owners.model, shared, personal, fed.x_test, fed.y_test, off, "x")
