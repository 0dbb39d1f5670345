"""The guard of ``fedudp/owner/owners.py``: THE owner-side computation (``Owners``,
``OwnerTraining``, ``OwnerHooks``, ``user_units``, ``owner_units``).

The owner component is built both by the config builder (``fedudp.build.owners`` on a tiny
synthetic config from tests/conftest.py) and from plain values (``Owners(model, spec, training,
budget)``). What it computes is checked against computations written here without it: the
logistic model's loss by hand (logits = x Wᵀ + b + p, mean cross-entropy), gradients with
``torch.autograd``, local SGD as a plain Python loop over the batch orders the module documents
(fedudp.owner.orders.batch_orders: per user keyed by its stable id, per owner by its global
id, both from fedudp.randomness).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_cfg
from fedudp import build
from fedudp.aggregators import GaussianAggregator, MeanAggregator, Sampling
from fedudp.protocol.contributions import Constraint
from fedudp.owner.local_sgd import LocalSpec
from fedudp.protocol.messages import OwnerReply
from fedudp.protocol.methods import make_method
from fedudp.owner.owner_level import owner_units
from fedudp.owner.owners import OwnerHooks, Owners, user_units
from fedudp.owner.settings import OwnerTraining
from fedudp.models import make_model
from fedudp.randomness import Purpose, numpy_rng

# 150 records over 4 owners (38, 38, 37, 37), users of 5 records (the last of each owner 3 or
# 2): 32 users; 12 features, 10 classes; local SGD: batches of 2, 2 epochs, lr 0.5
KW = dict(
    dataset__num_records=150,
    partition__records_per_user=5,
    train__batch_size=2,
    train__local_epochs=2,
)
SEED, LR, BATCH, EPOCHS, ROUND = 0, 0.5, 2, 2, 3
SHARED = ("shared.weight", "shared.bias")
PERSONAL = ("personal.bias",)


def cfg_for(method: str = "joint_dp", **kw):
    return tiny_cfg(method, **{**KW, **kw})


@pytest.fixture(scope="module")
def fed():
    return build.federation(cfg_for()).to(torch.float32)


def broadcast(seed: int = 1) -> dict[str, torch.Tensor]:
    """Non-trivial shared parameters (the model starts at zero, where gradients are bland)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "shared.weight": 0.3 * torch.randn(10, 12, generator=g),
        "shared.bias": 0.3 * torch.randn(10, generator=g),
    }


def owners_personal(n: int = 4, seed: int = 2) -> dict[str, torch.Tensor]:
    """Each owner's own (trained-looking) personal offsets, far from the public zero copy."""
    g = torch.Generator().manual_seed(seed)
    return {"personal.bias": 2.0 * torch.randn(n, 10, generator=g)}


def direct_owners(
    mode: str = "delta",
    budget: int = 8192,
    method: str = "joint_dp",
    owner_weights: str = "uniform",
    hooks=None,
    paper: bool = False,
) -> Owners:
    """The owner component from plain values (same model seed as the config's)."""
    model = make_model("linear", (12,), 10, seed=SEED)
    for p in model.parameters():
        p.requires_grad_(False)
    spec = make_method(method, model, paper=paper)
    training = OwnerTraining(
        LocalSpec(SEED, LR, BATCH, EPOCHS), LocalSpec(SEED, LR, BATCH, EPOCHS), mode, owner_weights
    )
    return Owners(model, spec, training, budget, hooks=hooks)


def vectors(owners: Owners, fed, shared, personal, users) -> torch.Tensor:
    """[len(users), d]: ``user_vectors`` reassembled in the order of ``users``."""
    rows = {}
    for us, G in owners.user_vectors(fed, shared, personal, np.asarray(users), ROUND):
        for u, g in zip(us, G):
            rows[int(u)] = g
    return torch.stack([rows[int(u)] for u in users])


# -- the independent computations -----------------------------------------------------------------
def loss(x, y, W, b, p):
    return F.cross_entropy(x @ W.T + b + p, y)  # mean over the batch


def hand_sgd(x, y, params: dict, trainable: tuple[str, ...], orders: list[np.ndarray]) -> dict:
    """Plain minibatch SGD (batches of BATCH in each epoch's order, lr LR) on ``trainable``."""
    params = {k: v.clone() for k, v in params.items()}
    for order in orders:
        for s in range(0, len(order), BATCH):
            idx = torch.from_numpy(order[s : s + BATCH])
            live = {k: params[k].clone().requires_grad_(k in trainable) for k in params}
            grads = torch.autograd.grad(
                loss(x[idx], y[idx], live["W"], live["b"], live["p"]), [live[k] for k in trainable]
            )
            for k, g in zip(trainable, grads):
                params[k] = params[k] - LR * g
    return params


def user_orders(fed, u: int) -> list[np.ndarray]:
    """User u's records in visiting order per epoch: sorted by keys drawn from
    (seed, USER_ORDER, round, epoch, the user's stable id)."""
    a, n = int(fed.user_offsets[u]), int(np.diff(fed.user_offsets)[u])
    keys = [
        numpy_rng(SEED, Purpose.USER_ORDER, ROUND, e, int(fed.user_ids[u])).random(n)
        for e in range(EPOCHS)
    ]
    return [a + np.argsort(k, kind="stable") for k in keys]


def owner_orders(fed, j: int, purpose: Purpose) -> list[np.ndarray]:
    """Owner j's records in visiting order per epoch: keys from (seed, purpose, round, epoch,
    its global owner id)."""
    oo = fed.owner_offsets
    a, n = int(oo[j]), int(oo[j + 1] - oo[j])
    return [
        a
        + np.argsort(
            numpy_rng(SEED, purpose, ROUND, e, int(fed.owner_ids[j])).random(n), kind="stable"
        )
        for e in range(EPOCHS)
    ]


# -- units ----------------------------------------------------------------------------------------
def test_user_and_owner_units_are_the_record_ranges(fed):
    users = np.array([0, 7, 8, 31])
    u = user_units(fed, users)
    assert list(u.starts) == [0, 35, 38, 148] and list(u.sizes) == [5, 3, 5, 2]
    assert list(u.owners) == [0, 0, 1, 3]
    assert list(u.owner_starts) == [0, 0, 38, 113] and list(u.owner_sizes) == [38, 38, 38, 37]
    o = owner_units(fed, np.array([2, 0]))
    assert list(o.starts) == list(o.owner_starts) == [76, 0]
    assert list(o.sizes) == list(o.owner_sizes) == [37, 38] and list(o.owners) == [2, 0]


# -- the users' shared vectors --------------------------------------------------------------------
def test_gradient_vectors_equal_the_autograd_mean_gradient_at_the_public_copy(fed):
    owners = build.owners(cfg_for(train__shared_update="gradient"))
    assert owners.training.mode == "gradient" and owners.spec.shared == SHARED
    shared, personal = broadcast(), owners_personal()
    users = [0, 7, 9, 15, 23, 31]  # sizes 5, 3, 5, 3, 2, 2
    got = vectors(owners, fed, shared, personal, users)
    # certified: at the public personal copy, SharedPersonalLogistic's zero offset
    p_pub = torch.zeros(10)
    for i, u in enumerate(users):
        a, b = int(fed.user_offsets[u]), int(fed.user_offsets[u + 1])
        W = shared["shared.weight"].clone().requires_grad_(True)
        bias = shared["shared.bias"].clone().requires_grad_(True)
        gW, gb = torch.autograd.grad(loss(fed.x[a:b], fed.y[a:b], W, bias, p_pub), [W, bias])
        torch.testing.assert_close(got[i], torch.cat([gW.reshape(-1), gb]), atol=1e-6, rtol=1e-5)
    assert got.shape == (len(users), 130)


def test_delta_vectors_equal_a_hand_written_local_sgd_in_the_documented_order(fed):
    owners = build.owners(cfg_for())
    assert owners.training.mode == "delta"
    shared, personal = broadcast(), owners_personal()
    users = [1, 7, 12, 23, 30]  # sizes 5, 3, 5, 2, 5
    got = vectors(owners, fed, shared, personal, users)
    start = {"W": shared["shared.weight"], "b": shared["shared.bias"], "p": torch.zeros(10)}
    for i, u in enumerate(users):
        end = hand_sgd(fed.x, fed.y, start, ("W", "b"), user_orders(fed, u))
        want = torch.cat([(end["W"] - start["W"]).reshape(-1), end["b"] - start["b"]])
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-4)
    # the order matters: the reversed order gives another delta (the check above is not vacuous)
    rev = hand_sgd(fed.x, fed.y, start, ("W", "b"), [o[::-1].copy() for o in user_orders(fed, 1)])
    assert not torch.allclose(got[0][-10:], rev["b"] - start["b"], atol=1e-5)


@pytest.mark.parametrize("mode", ["delta", "gradient"])
def test_a_users_vector_does_not_move_when_another_user_is_removed(fed, mode):
    owners = direct_owners(mode)
    shared, personal = broadcast(), owners_personal()
    base = vectors(owners, fed, shared, personal, np.arange(fed.num_users))
    for gone in (3, 20):  # a user of the same owner as users 0..7, and of another
        nb = fed.without_user(gone)
        assert nb.num_users == fed.num_users - 1
        keep = [u for u in range(fed.num_users) if u != gone]
        got = vectors(owners, nb, shared, personal, np.arange(nb.num_users))
        torch.testing.assert_close(got, base[keep], atol=1e-6, rtol=1e-5)


# -- the reply ------------------------------------------------------------------------------------
def test_reply_carries_shared_vectors_only(fed):
    owners = build.owners(cfg_for())
    shared, personal = broadcast(), owners_personal()
    units = np.array([0, 4, 9, 17, 30])
    G = vectors(owners, fed, shared, personal, units)
    # the clipped sum (clip+Gaussian's constraint), clipping by hand at the median norm
    norms = G.double().norm(dim=1)
    clip = float(norms.median())
    assert int((norms > clip).sum()) == 2
    constraint = GaussianAggregator(clip, 1.0, Sampling(1.0, 32)).constraint
    rep = owners.reply(fed, shared, personal, units, ROUND, constraint)
    assert isinstance(rep, OwnerReply)
    assert rep.param_names == SHARED and not set(rep.param_names) & set(PERSONAL)
    # no personal field (``raised``: the users dropped for a raising step, counts and reasons)
    assert set(vars(rep)) == {"param_names", "contribution", "failed", "raised"}
    assert rep.raised == ()
    c = rep.contribution
    want = (G.double() * torch.clamp(clip / norms, max=1.0).unsqueeze(1)).sum(0)
    assert c.rows is None and c.total.shape == (130,) and c.count == 5 and rep.failed == 0
    torch.testing.assert_close(c.total.double(), want, atol=1e-6, rtol=1e-5)
    assert c.clipped == int((norms > clip).sum())
    # the rows an estimator on the cohort matrix asks for: the shared vectors themselves
    rows = owners.reply(fed, shared, personal, units, ROUND, Constraint(rows=True))
    assert rows.param_names == SHARED
    torch.testing.assert_close(rows.contribution.rows, G)
    assert owners.shared_dim == 130 == 10 * 12 + 10


def test_certified_reply_does_not_depend_on_the_owners_personal_parameters(fed):
    shared, personal = broadcast(), owners_personal()
    perturbed = {"personal.bias": personal["personal.bias"] + 5.0 * torch.randn(4, 10)}
    units = np.arange(0, 32, 3)
    rows = Constraint(rows=True)
    for mode in ("delta", "gradient"):
        owners = build.owners(cfg_for(train__shared_update=mode))
        assert not owners.spec.feedback
        a = owners.reply(fed, shared, personal, units, ROUND, rows).contribution.rows
        b = owners.reply(fed, shared, perturbed, units, ROUND, rows).contribution.rows
        assert torch.equal(a, b)
    # paper accounting computes the vectors at the owners' own parameters: they do move
    paper = build.owners(cfg_for(privacy__accounting="paper"))
    assert paper.spec.feedback
    a = paper.reply(fed, shared, personal, units, ROUND, rows).contribution.rows
    b = paper.reply(fed, shared, perturbed, units, ROUND, rows).contribution.rows
    assert not torch.allclose(a, b, atol=1e-4)


def test_owner_unit_vectors_are_the_mean_of_the_owners_users_vectors(fed):
    owners = build.owners(cfg_for(privacy__unit="owner"))
    shared, personal = broadcast(), owners_personal()
    units = np.array([1, 3])
    (got,) = list(owners.unit_vectors(fed, shared, personal, units, ROUND))
    ou = fed.owner_user_offsets
    for i, j in enumerate(units):
        G = vectors(owners, fed, shared, personal, np.arange(ou[j], ou[j + 1]))
        torch.testing.assert_close(got[i], G.mean(0), atol=1e-6, rtol=1e-5)


# -- the personal update --------------------------------------------------------------------------
def test_personal_round_is_each_owners_sgd_on_all_its_records(fed):
    owners = build.owners(cfg_for())
    shared, personal = broadcast(), owners_personal()
    new = owners.personal_round(fed, shared, personal, ROUND)
    assert set(new) == set(PERSONAL)
    for j in (0, 3):
        start = {
            "W": shared["shared.weight"],
            "b": shared["shared.bias"],
            "p": personal["personal.bias"][j],
        }
        end = hand_sgd(fed.x, fed.y, start, ("p",), owner_orders(fed, j, Purpose.PERSONAL_ORDER))
        torch.testing.assert_close(new["personal.bias"][j], end["p"], atol=1e-5, rtol=1e-4)
    # the input is not modified in place
    assert not torch.equal(new["personal.bias"], personal["personal.bias"])


# -- hooks ----------------------------------------------------------------------------------------
class RecordingHooks(OwnerHooks):
    def __init__(self, plain: bool) -> None:
        self.plain, self.calls = plain, []

    def user_gradients(self, owners, fed, shared, fr_unit, fr_common, sub, user_ids, round_):
        self.calls.append(("user_gradients", round_, tuple(int(u) for u in user_ids), len(sub)))
        if self.plain:
            return None
        return torch.stack([torch.full((owners.shared_dim,), float(u)) for u in user_ids])

    def personal_round(self, owners, fed, shared, personal, round_):
        self.calls.append(("personal_round", round_))
        if self.plain:
            return None
        return {k: v + 1.0 for k, v in personal.items()}


def test_owner_hooks_are_called_and_their_results_used(fed):
    shared, personal = broadcast(), owners_personal()
    users = np.array([2, 8, 19])
    hooks = RecordingHooks(plain=False)
    owners = build.owners(cfg_for(train__shared_update="gradient"), hooks=hooks)
    G = vectors(owners, fed, shared, personal, users)
    ids = [float(fed.user_ids[u]) for u in users]
    assert torch.equal(G, torch.tensor(ids).unsqueeze(1).expand(3, 130))
    assert hooks.calls == [("user_gradients", ROUND, tuple(int(i) for i in ids), 3)]
    new = owners.personal_round(fed, shared, personal, ROUND)
    assert torch.equal(new["personal.bias"], personal["personal.bias"] + 1.0)
    assert hooks.calls[-1] == ("personal_round", ROUND)
    # None: the plain owner's results
    plain_hooks = RecordingHooks(plain=True)
    hooked = build.owners(cfg_for(train__shared_update="gradient"), hooks=plain_hooks)
    plain = build.owners(cfg_for(train__shared_update="gradient"))
    assert torch.equal(
        vectors(hooked, fed, shared, personal, users), vectors(plain, fed, shared, personal, users)
    )
    assert torch.equal(
        hooked.personal_round(fed, shared, personal, ROUND)["personal.bias"],
        plain.personal_round(fed, shared, personal, ROUND)["personal.bias"],
    )
    assert plain_hooks.calls == [
        ("user_gradients", ROUND, tuple(int(i) for i in ids), 3),
        ("personal_round", ROUND),
    ]


# -- chunking -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["delta", "gradient"])
def test_chunk_budget_does_not_change_the_vectors(fed, mode):
    shared, personal = broadcast(), owners_personal()
    users = np.arange(0, fed.num_users, 3)  # 11 users of all 4 owners
    small, large = direct_owners(mode, budget=1), direct_owners(mode, budget=10**6)
    parts = list(small.user_vectors(fed, shared, personal, users, ROUND))
    whole = list(large.user_vectors(fed, shared, personal, users, ROUND))
    assert len(parts) == 11 and len(whole) == 1  # one user per chunk vs all
    assert np.array_equal(np.concatenate([us for us, _ in parts]), users)
    a = torch.cat([G for _, G in parts])
    torch.testing.assert_close(a, whole[0][1], atol=1e-6, rtol=1e-5)
    # the config builder's owner component computes the same
    built = build.owners(cfg_for(train__shared_update=mode))
    torch.testing.assert_close(
        a, vectors(built, fed, shared, personal, users), atol=1e-6, rtol=1e-5
    )
    if mode == "delta":  # the personal update (the same in both modes): per owner
        torch.testing.assert_close(
            small.personal_round(fed, shared, personal, ROUND)["personal.bias"],
            large.personal_round(fed, shared, personal, ROUND)["personal.bias"],
            atol=1e-6,
            rtol=1e-5,
        )


# -- owner-level updates --------------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["uniform", "size"])
def test_owner_sgd_updates_are_weighted_as_owner_weights_says(fed, weights):
    owners = build.owners(cfg_for("fedavg", train__owner_weights=weights))
    assert owners.spec.update == "owner_sgd" and owners.training.owner_weights == weights
    names = owners.spec.shared
    assert names == SHARED + PERSONAL and owners.spec.personal == ()
    shared = {**broadcast(), "personal.bias": 0.1 * torch.arange(10.0)}
    units = np.arange(4)
    agg = MeanAggregator(Sampling(1.0, 4))
    D = owners.owner_deltas(fed, shared, {}, units, ROUND, agg.constraint)
    assert D.shape == (4, 140)
    # each owner's delta: E epochs of SGD over all its records, in its owner-keyed order
    start = {"W": shared["shared.weight"], "b": shared["shared.bias"], "p": shared["personal.bias"]}
    for j in (0, 3):
        end = hand_sgd(
            fed.x, fed.y, start, ("W", "b", "p"), owner_orders(fed, j, Purpose.OWNER_ORDER)
        )
        want = torch.cat(
            [(end["W"] - start["W"]).reshape(-1), end["b"] - start["b"], end["p"] - start["p"]]
        )
        torch.testing.assert_close(D[j], want, atol=1e-5, rtol=1e-4)
        # an owner's own shard (what a Flower owner holds) gives the same delta
        (alone,) = owners.owner_deltas(
            fed.owner(j), shared, {}, np.array([0]), ROUND, agg.constraint
        )
        torch.testing.assert_close(alone, D[j], atol=1e-6, rtol=1e-5)
    rep = owners.reply(fed, shared, {}, units, ROUND, agg.constraint)
    assert rep.param_names == names
    w = np.ones(4) if weights == "uniform" else np.array([38.0, 38.0, 37.0, 37.0])
    c = rep.contribution
    assert c.count == 4 and c.weight == pytest.approx(w.sum())
    wt = torch.tensor(w, dtype=torch.float32).unsqueeze(1)
    torch.testing.assert_close(c.total, (wt * D).sum(0), atol=1e-6, rtol=1e-5)
    # the billboard's plain mean of the owners' updates
    torch.testing.assert_close(
        agg.release(c).mean, (wt * D).sum(0) / float(w.sum()), atol=1e-6, rtol=1e-5
    )


@pytest.mark.parametrize("budget", [8192, 7, 1])
def test_evaluation_is_each_owners_forward_on_its_own_test_shard(fed, budget, monkeypatch):
    """``Owners.evaluate`` against a forward per owner written here (logits = x Wᵀ + b + p_o with
    the owner's own personal offsets p_o): accuracy and mean loss per owner, NaN for an owner
    with no test records. A dense model's evaluation budget is the chunk budget: at 7 or 1
    record the shards are evaluated in pieces (no forward over more records than the budget)
    whose sums are added up per owner; the numbers are the same."""
    import dataclasses

    from fedudp.owner import evaluation

    t = fed.test_offsets
    cases = [fed, dataclasses.replace(fed, test_offsets=np.array([t[0], t[2], t[2], t[3], t[4]]))]
    owners = direct_owners(budget=budget)
    shared, personal = broadcast(), owners_personal()
    forwards = []
    real = evaluation.evaluate_sums

    def spy(model, sh, pers, x, y, offsets):
        forwards.append(len(offsets) - 1 and (len(offsets) - 1) * int(np.diff(offsets).max()))
        return real(model, sh, pers, x, y, offsets)

    monkeypatch.setattr(evaluation, "evaluate_sums", spy)
    for f in cases:
        assert min(np.diff(f.test_offsets)[[0, 2, 3]]) > 7  # pieces at budget 7 and 1
        acc, loss = owners.evaluate(f, shared, personal)
        for o in range(f.num_owners):
            a, b = int(f.test_offsets[o]), int(f.test_offsets[o + 1])
            if a == b:
                assert np.isnan(acc[o]) and np.isnan(loss[o])
                continue
            logits = (
                f.x_test[a:b] @ shared["shared.weight"].T
                + shared["shared.bias"]
                + personal["personal.bias"][o]
            )
            yy = f.y_test[a:b]
            assert acc[o] == pytest.approx(
                float((logits.argmax(1) == yy).double().mean()), abs=1e-12
            )
            assert loss[o] == pytest.approx(float(F.cross_entropy(logits, yy)), rel=1e-5)
    assert cases[1].test_offsets[1] == cases[1].test_offsets[2]  # owner 1 had no shard
    assert max(forwards) <= budget
    assert len(forwards) >= sum(-(-len(f.y_test) // budget) for f in cases)
