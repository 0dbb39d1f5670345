"""Owners in blocks per Flower SuperNode (``engine_opts.owners_per_node``): the public plan,
a block's units and failures, a block's federation equal to the whole one's slice, the
settings' errors and the connect timeout (no Flower run here; runs: test_flower_blocks.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import tiny_cfg
from fedudp import build
from fedudp.config import ConfigError, validate
from fedudp.data.federation import Federation
import fedudp.flower.blocks as blocks
import fedudp.flower.server_app as flower_server


def test_the_plan_is_contiguous_blocks_covering_every_owner_once():
    for n, b in [(4, 1), (4, 2), (4, 3), (10, 4), (1, 5)]:
        plan = blocks.owner_blocks(n, b)
        assert [j for r in plan for j in r] == list(range(n))
        assert all(0 < len(r) <= b for r in plan) and len(plan) == -(-n // b)
        np.testing.assert_array_equal(
            blocks.block_of_owner(plan), [k for k, r in enumerate(plan) for _ in r]
        )
    with pytest.raises(ValueError, match="engine_opts.owners_per_node"):
        blocks.owner_blocks(4, 0)


@pytest.mark.parametrize("key,value", [("owners_per_node", 0), ("connect_timeout_s", 0.0)])
def test_bad_block_settings_are_one_line_errors_naming_the_key(key, value):
    cfg = tiny_cfg("fedavg", **{f"engine_opts__{key}": value})
    with pytest.raises(ConfigError, match=f"^engine_opts.{key}: ") as e:
        validate(cfg)
    assert "\n" not in str(e.value)


def _whole() -> tuple[Federation, object]:
    cfg = tiny_cfg("joint_dp", dataset__num_records=120, partition__num_owners=5)
    return build.federation(cfg), cfg


def _same(a: Federation, b: Federation) -> None:
    for f in ("x", "y", "x_test", "y_test"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f in ("user_offsets", "user_owner", "owner_user_offsets", "test_offsets"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    np.testing.assert_array_equal(a.owner_ids, b.owner_ids)
    np.testing.assert_array_equal(a.user_ids, b.user_ids)
    assert a.num_classes == b.num_classes


def test_a_block_of_one_is_the_owner_shard():
    fed, _ = _whole()
    for j in range(fed.num_owners):
        _same(fed.block(j, j + 1), fed.owner(j))


def test_a_planned_block_build_equals_the_whole_federations_slice():
    fed, cfg = _whole()
    for r in blocks.owner_blocks(fed.num_owners, 2):
        part = build.federation(cfg, owners=r)
        _same(part, fed.block(r.start, r.stop))
        assert part.num_records < fed.num_records


def test_block_units_index_the_blocks_users_in_owner_order():
    fed, _ = _whole()
    offs = fed.owner_user_offsets
    rng = np.random.default_rng(0)
    cohort = np.sort(rng.choice(fed.num_users, 40, replace=False))
    owner = fed.user_owner[cohort]
    units = {int(j): cohort[owner == j] - offs[j] for j in np.unique(owner)}
    for r in blocks.owner_blocks(fed.num_owners, 2):
        got = blocks.block_units(units, r, offs, False)
        mine = cohort[(owner >= r.start) & (owner < r.stop)]
        np.testing.assert_array_equal(got, mine - offs[r.start])  # the block's own user index
        sub = fed.block(r.start, r.stop)
        np.testing.assert_array_equal(sub.user_ids[got], fed.user_ids[mine])
    owners_units = {1: np.zeros(1, dtype=np.int64), 2: np.zeros(1, dtype=np.int64)}
    np.testing.assert_array_equal(blocks.block_units(owners_units, range(2, 4), offs, True), [0])


def _first_owner_only(failed, plan, units):
    """A weakened twin: a failed node fails only its block's first owner."""
    from fedudp.protocol.messages import Failure

    return [Failure(plan[k].start, len(units.get(plan[k].start, ())), r) for k, r in failed.items()]


def _check_block_failures(fn) -> None:
    plan = blocks.owner_blocks(5, 2)
    units = {0: np.arange(3), 2: np.arange(4), 3: np.arange(1)}
    got = fn({1: "node lost"}, plan, units)
    assert [(f.owner, f.units, f.reason) for f in got] == [
        (2, 4, "node lost"),
        (3, 1, "node lost"),
    ]


def test_a_failed_node_is_a_failure_of_every_owner_of_its_block():
    _check_block_failures(blocks.block_failures)
    with pytest.raises(AssertionError):
        _check_block_failures(_first_owner_only)


class _FewNodes:
    """A grid on which fewer SuperNodes than blocks ever connect."""

    def get_node_ids(self):
        return [1]


def test_connect_waits_no_longer_than_the_declared_timeout():
    t = flower_server.FlowerTransport.__new__(flower_server.FlowerTransport)
    t.fed = build.federation(tiny_cfg("fedavg"))
    t.grid, t.stop_flag, t.timeout = _FewNodes(), None, None
    t.connect_timeout, t.per_node = 0.3, 2
    t.blocks = blocks.owner_blocks(t.fed.num_owners, 2)
    with pytest.raises(RuntimeError, match=r"engine_opts.connect_timeout_s=0.3, 2 needed"):
        t._connect()


def test_a_blocks_personal_state_is_saved_in_one_file_and_loads_back(tmp_path):
    import fedudp.flower.client_app as client
    from fedudp.protocol import checkpoint

    stacked = {"w": torch.arange(6.0).reshape(3, 2), "b": torch.tensor([1.0, 2.0, 3.0])}
    checkpoint.save_owners_personal(str(tmp_path), range(4, 7), stacked)
    # one atomic write per node: the block's file, each owner's row found in it
    assert [p.name for p in tmp_path.iterdir()] == ["owners-4-6.pt"]
    where = checkpoint.owner_state_files(tmp_path)
    assert {j: r for j, (_, r) in where.items()} == {4: 0, 5: 1, 6: 2}
    back = client._load_personal(str(tmp_path), range(4, 7))
    assert all(torch.equal(back[k], stacked[k]) for k in stacked)
    part = client._load_personal(str(tmp_path), range(5, 6))  # another plan reads the same files
    assert torch.equal(part["w"], stacked["w"][1:2])
