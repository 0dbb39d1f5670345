"""One round, one owner, one aggregator contract: the structure the engines rely on
(docs/architecture.md#one-round-as-data)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

import fedudp.build
import fedudp.run
from conftest import tiny_cfg
from fedudp.aggregators import REGISTRY, Aggregator, Sampling
from fedudp.build import estimator as build_aggregator
from fedudp.aggregators import outlier
from fedudp.protocol.contributions import Constraint, Contribution
from fedudp.config import ConfigError
from fedudp.run import prepare

PKG = Path(fedudp.run.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_engines_never_import_the_entry_points():
    for path in (PKG / "engines").glob("*.py"):
        bad = {
            m
            for m in _imports(path)
            if m in ("fedudp.run", "fedudp.cli", "fedudp.flower.entry")
            or m.startswith(("fedudp.run.", "fedudp.cli.", "fedudp.flower.entry."))
        }
        assert not bad, (path.name, bad)


def _loops_over_rounds(path: Path) -> int:
    """``range(<start>, <...rounds> + 1)`` calls in ``path``, read from its syntax tree."""

    def is_rounds(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id.endswith("rounds")) or (
            isinstance(node, ast.Attribute) and node.attr.endswith("rounds")
        )

    hits = 0
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "range"
            and len(node.args) == 2
        ):
            stop = node.args[1]
            hits += (
                isinstance(stop, ast.BinOp)
                and isinstance(stop.op, ast.Add)
                and is_rounds(stop.left)
                and isinstance(stop.right, ast.Constant)
                and stop.right.value == 1
            )
    return hits


def test_round_loop_is_written_once(monkeypatch):
    # the only loop over rounds, range(<start>, rounds + 1), lives in billboard/rounds.py (a resumed
    # run starts after its checkpoint's round) ...
    hits = [p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py") if _loops_over_rounds(p)]
    assert hits == ["billboard/rounds.py"]
    # ... and the engine drives the run through it
    calls = []
    real = fedudp.run.run_rounds
    monkeypatch.setattr(
        fedudp.run, "run_rounds", lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1]
    )
    res = fedudp.run.execute(prepare(tiny_cfg("fedavg", **{"train.rounds": 2})))
    assert calls == [2] and res.rounds_completed == 2


def test_registry_covers_every_shipped_choice_and_declares_the_contract():
    shipped = {
        "gaussian",
        "gaussian_adaptive",
        "dp_ftrl_tree",
        "dp_mf_banded",
        "none",
        "winsorized",
        "outlier_removal",
        "friendlycore",
        "few_users",
    }
    assert set(REGISTRY) >= shipped  # (a test may have registered its own too)
    declared = {
        "name",
        "private",
        "needs_per_user_vectors",
        "adjacency",
        "accountant",
        "guarantee",
        "noise_multiplier",
        "noise_std",
        "min_users_required",
    }
    for name, cls in REGISTRY.items():
        assert issubclass(cls, Aggregator) and cls.name == name
        assert not inspect.isabstract(cls), name
        for attr in declared:
            assert hasattr(cls, attr), (name, attr)
        assert inspect.signature(cls.dp_event).parameters.keys() == {"self"}


@pytest.mark.parametrize("name", ["none", "gaussian", "winsorized", "friendlycore"])
def test_constraint_is_what_owners_send(name):
    cfg = tiny_cfg(
        "fedavg" if name == "none" else "full_dp",
        aggregator=name,
        **{
            "dataset.num_records": 3000,
            "dataset.pool_train": 4000,
            "privacy.epsilon": 8.0,
            "train.rounds": 1,
        },
    )
    agg = build_aggregator(cfg, Sampling(1.0, 3000), 1, 5)
    G = torch.randn(7, 5, dtype=torch.float64) * 3
    c = agg.constraint.apply(G)
    assert c.count == 7
    if agg.needs_per_user_vectors:
        assert c.total is None and torch.equal(c.rows, G)
    else:
        assert c.rows is None and c.total.shape == (5,)
        clip = agg.constraint.clip
        if clip is not None:
            assert torch.linalg.vector_norm(c.total) <= 7 * clip + 1e-9
    # merging chunk contributions equals the whole cohort's
    parts = [agg.constraint.apply(G[:3]), agg.constraint.apply(G[3:])]
    merged = Contribution.merge(parts, 5, torch.float64, agg.needs_per_user_vectors)
    assert merged.count == 7 and merged.clipped == c.clipped
    if agg.needs_per_user_vectors:
        assert torch.equal(merged.rows, G)
    else:
        torch.testing.assert_close(merged.total, c.total)


def test_constraint_without_clip_is_the_plain_sum():
    G = torch.randn(4, 3, dtype=torch.float64) * 100
    assert torch.equal(Constraint(rows=False).apply(G).total, G.sum(0))


def test_config_only_checks_run_before_any_data_is_loaded(monkeypatch):
    def no_data(cfg):
        raise AssertionError("data was loaded before the config-only checks")

    monkeypatch.setattr(fedudp.build.assemble, "federation", no_data)
    # an estimator's constraint, a closed form that does not exist, an unreachable budget,
    # an estimator's minimum n for its privacy proof: all before the data
    for kw, key in [
        ({"aggregator": "winsorized", "train.sampling_rate": 0.5}, "train.sampling_rate"),
        ({"privacy.calibration": "closed_form"}, "privacy.calibration"),
        ({"aggregator": "few_users", "privacy.calibration": "closed_form"}, "privacy.calibration"),
        ({"privacy.noise_multiplier": 0.1}, "privacy.epsilon"),
        ({"aggregator": "outlier_removal"}, "partition"),
    ]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            prepare(tiny_cfg("full_dp", **{k.replace(".", "__"): v for k, v in kw.items()}))


def test_planned_population_matches_the_partition():
    for kw in (
        {},
        {"partition.records_per_user": 3},
        {"partition.scheme": "dirichlet"},
        {"partition.scheme": "iid", "partition.records_per_user": 7},
    ):
        p = prepare(tiny_cfg("full_dp", **{k.replace(".", "__"): v for k, v in kw.items()}))
        assert p.billboard.sampling.population == p.fed.num_users


def test_above_threshold_minimum_n_bounds_its_false_pass():
    # the refusal threshold of outlier_removal is exactly where AT's false-pass probability
    # reaches the δ/4 it is charged
    for eps_at, rounds, gamma in [(0.5, 10, 1e-6), (4.0, 100, 1e-5), (1.0, 1, 0.01)]:
        need = outlier.min_users_at(eps_at, rounds, gamma)
        assert outlier.at_false_pass(need, eps_at, rounds) <= gamma
        assert outlier.at_false_pass(need - 2, eps_at, rounds) > gamma * 0.99


def test_owner_component_serves_one_owner_and_all_owners_alike():
    # the Flower ClientApp's view (one owner's shard) computes what the local engine computes
    # for all owners at once: personal updates and (paper mode: at those) users' vectors
    p = prepare(tiny_cfg("joint_dp", **{"privacy.accounting": "paper"}))
    fed, owners, shared = p.fed, p.owners, p.billboard.shared_params()
    personal = owners.personal_round(fed, shared, owners.initial_personal(fed.num_owners), 1)
    whole = torch.cat(
        [G for _, G in owners.user_vectors(fed, shared, personal, np.arange(fed.num_users), 2)]
    )
    parts = []
    for j in range(fed.num_owners):
        shard = fed.owner(j)
        mine = owners.personal_round(shard, shared, owners.initial_personal(1), 1)
        for k in mine:
            torch.testing.assert_close(mine[k][0], personal[k][j], rtol=0, atol=1e-6)
        parts += [
            G for _, G in owners.user_vectors(shard, shared, mine, np.arange(shard.num_users), 2)
        ]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("view", ["all_owners", "one_owner"])
def test_removing_a_user_leaves_every_other_users_vector_bit_identical(view):
    # certified joint_dp, 10 records per user, batch 4 < 10: a user's vector depends only on the
    # broadcast, public randomness and its own records
    # (docs/algorithms.md#certified-vs-paper-accounting), so removing the
    # first user of owner 0 (which shifts every later user's position) changes nothing else
    p = prepare(
        tiny_cfg(
            "joint_dp",
            **{"partition.records_per_user": 10, "train.batch_size": 4, "train.local_epochs": 2},
        )
    )
    fed, owners, shared = p.fed, p.owners, p.billboard.shared_params()
    gone = int(fed.owner_user_offsets[0])
    small = fed.without_user(gone)
    assert small.num_users == fed.num_users - 1 and np.diff(fed.user_offsets)[gone] == 10

    def vectors(f: "object") -> dict[int, torch.Tensor]:
        out = {}
        views = (
            [(f, np.arange(f.num_owners))]
            if view == "all_owners"
            else [(f.owner(j), [j]) for j in range(f.num_owners)]
        )
        for v, _ in views:
            personal = owners.initial_personal(v.num_owners)
            for us, G in owners.user_vectors(v, shared, personal, np.arange(v.num_users), 3):
                out.update({int(v.user_ids[u]): g for u, g in zip(us, G)})
        return out

    before, after = vectors(fed), vectors(small)
    assert set(before) - set(after) == {int(fed.user_ids[gone])}
    for uid, g in after.items():
        assert torch.equal(g, before[uid]), uid


@pytest.mark.parametrize("accounting", ["certified", "paper"])
def test_paper_mode_leaks_through_the_personal_layer_and_certified_does_not(accounting):
    # the paper-mode leak's neighbouring pair (fedudp.leak), noise-free: 4 owners x 20 users x 10
    # records, one class per owner, one user of owner 0 relabelled to another class (it pulls
    # its owner's noiselessly trained personal bias), 20 personal epochs, clip 0.05 near the
    # vectors' size. Adding the user moves the clipped sum by at most C in certified mode; in
    # paper mode the other users' vectors move too (through the personal layer), by more than C.
    from fedudp.leak import clipped_sums, leak_config

    pair = clipped_sums(leak_config(**{"privacy.accounting": accounting}))
    assert pair.clip == 0.05
    if accounting == "certified":
        assert pair.moved <= 1 + 1e-9
    else:
        assert pair.moved > 2, pair.moved
