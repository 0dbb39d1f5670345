"""A block of owners' federation (``build.federation(cfg, owners=range(a, b))``, a Flower
SuperNode's with ``engine_opts.owners_per_node``): equal to the whole federation's block, and
for npz read by row, never touching another owner's features."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedudp import build
from fedudp.config import config_from_overrides
import fedudp.data.row_reads as row_reads
from fedudp.flower.blocks import owner_blocks
from formats import natural_arrays, write_npz

SIZES = [1, 3, 5, 20, 2, 8, 40, 1, 7, 12, 4, 9, 15, 2, 6, 30]  # 16 users
OWNERS = [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 3, 3, 3, 3, 3]


def npz_cfg(path, **over):
    base = {
        "progress": False,
        "seed": 3,
        "dataset.name": "npz",
        "dataset.path": str(path),
        "partition.num_owners": 4,
        "public.users": 16,
        "public.owner_capacity": 16,
        "public.records_per_user": 40,
        "dataset.test_fraction": 0.0,
        "dataset.classes": 4,
        "dataset.input_shape": [6],
    }
    return config_from_overrides({**base, **over})


GIVEN = {"dataset.columns.owner": "owner", "partition.owner_rule": "given"}


def _same(a, b) -> None:
    for f in ("x", "y", "x_test", "y_test"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    for f in ("user_offsets", "user_owner", "owner_user_offsets", "test_offsets"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    np.testing.assert_array_equal(a.owner_ids, b.owner_ids)
    np.testing.assert_array_equal(a.user_ids, b.user_ids)


def _setups(tmp_path):
    plain = write_npz(tmp_path / "fed.npz", SIZES, OWNERS)
    packed = tmp_path / "packed.npz"
    np.savez_compressed(packed, **natural_arrays(SIZES, OWNERS))
    test = write_npz(tmp_path / "test.npz", [2] * 16, OWNERS, seed=1)
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    arrays = natural_arrays(SIZES, OWNERS)
    table = pa.table(
        {
            "x": pa.array(list(arrays["x"])),
            "y": arrays["y"],
            "user": arrays["user"],
            "owner": arrays["owner"],
        }
    )
    parquet = tmp_path / "fed.parquet"
    pq.write_table(table, parquet, row_group_size=16)
    return [
        npz_cfg(parquet, **GIVEN, **{"dataset.name": "parquet"}),
        npz_cfg(plain, **GIVEN),
        npz_cfg(plain, **{"partition.owner_rule": "random", "dataset.test_fraction": 0.25}),
        npz_cfg(packed, **GIVEN),
        npz_cfg(plain, **GIVEN, **{"dataset.test_path": str(test)}),
    ]


@pytest.mark.parametrize("per", [1, 3])
def test_a_block_build_equals_the_whole_federations_block(per, tmp_path):
    for cfg in _setups(tmp_path):
        whole = build.federation(cfg)
        for r in owner_blocks(whole.num_owners, per):
            _same(build.federation(cfg, owners=r), whole.block(r.start, r.stop))


class Spy:
    """A features array that records which rows were read."""

    def __init__(self, array, seen: list) -> None:
        self.array, self.seen, self.shape, self.ndim = array, seen, array.shape, array.ndim

    def __getitem__(self, idx):
        self.seen.append(np.arange(self.shape[0])[idx])
        return self.array[idx]


def _reads(tmp_path, monkeypatch, r: range) -> tuple[set, set, list]:
    """(rows read, the block's own rows, the arrays np.load decompressed) for block ``r``."""
    path = write_npz(tmp_path / "fed.npz", SIZES, OWNERS)
    cfg = npz_cfg(path, **GIVEN)
    owner_of_row = np.asarray(OWNERS)[np.repeat(np.arange(16), SIZES)]
    mine = set(np.flatnonzero((owner_of_row >= r.start) & (owner_of_row < r.stop)).tolist())
    seen: list = []
    loaded: list = []
    orig_rows, orig_col = row_reads.npz_rows, row_reads._npz_column

    def spying_rows(p, name):
        rd = orig_rows(p, name)
        assert rd.mapped  # np.savez stores members uncompressed: memory-mapped
        return row_reads.RowReader(rd.path, Spy(rd.array, seen), rd.mapped)

    def spying_col(npz, p, name):
        loaded.append(name)
        return orig_col(npz, p, name)

    monkeypatch.setattr(row_reads, "npz_rows", spying_rows)
    monkeypatch.setattr(row_reads, "_npz_column", spying_col)
    build.federation(cfg, owners=r)
    read = set(np.concatenate(seen).tolist()) if seen else set()
    return read, mine, loaded


def _check_only_its_rows(tmp_path, monkeypatch) -> None:
    read, mine, loaded = _reads(tmp_path, monkeypatch, range(1, 3))
    assert read == mine  # exactly the block's records' features, no other owner's
    assert "x" not in loaded  # the features array was never loaded whole


def test_the_block_build_reads_only_its_owners_features(tmp_path, monkeypatch):
    _check_only_its_rows(tmp_path, monkeypatch)


def test_a_block_build_reading_the_whole_file_is_caught(tmp_path, monkeypatch):
    # the weakened twin: every row's features read, then the block's kept
    orig = row_reads.RowReader.rows

    def whole_then_keep(self, idx):
        every = orig(self, np.arange(self.array.shape[0]))
        return every[np.asarray(idx, dtype=np.int64)]

    monkeypatch.setattr(row_reads.RowReader, "rows", whole_then_keep)
    with pytest.raises(AssertionError):
        _check_only_its_rows(tmp_path, monkeypatch)


def test_a_parquet_block_reads_only_the_row_groups_of_its_rows(tmp_path, monkeypatch):
    cfg = _setups(tmp_path)[0]
    groups: list = []
    orig = row_reads.ParquetRows.__getitem__

    def spying(self, idx):
        real = self.file.read_row_groups

        def read_row_groups(gs, columns=None):
            groups.extend(gs)
            assert columns == ["x"]  # the feature column only
            return real(gs, columns=columns)

        self.file.read_row_groups = read_row_groups
        return orig(self, idx)

    monkeypatch.setattr(row_reads.ParquetRows, "__getitem__", spying)
    build.federation(cfg, owners=range(0, 1))  # owner 0: users 0..2, rows 0..8
    assert set(groups) == {0}  # rows 0..8 lie in the first row group of 16


def _fed_cfgs(tmp_path):
    from conftest import tiny_mnist
    from formats import write_femnist

    fem = write_femnist(tmp_path / "femnist", [3, 9, 1, 14, 6, 2])
    femnist = config_from_overrides(
        {
            "progress": False,
            "seed": 3,
            "dataset.name": "femnist",
            "dataset.root": str(fem),
            "model.name": "cnn",
            "partition.num_owners": 3,
            "public.users": 6,
            "public.owner_capacity": 6,
            "public.records_per_user": 14,
        }
    )
    mnist = config_from_overrides(
        {
            "progress": False,
            "dataset.name": "mnist",
            "dataset.root": str(tiny_mnist(tmp_path / "mnist")),
            "dataset.num_records": 240,
            "partition.num_owners": 3,
        }
    )
    return [femnist, mnist]


def test_leaf_and_idx_blocks_equal_the_whole_federations_block(tmp_path):
    for cfg in _fed_cfgs(tmp_path):
        whole = build.federation(cfg)
        for r in owner_blocks(whole.num_owners, 2):
            _same(build.federation(cfg, owners=r), whole.block(r.start, r.stop))


# -- IDX: uncompressed image files are memory-mapped; a block gathers only its records' rows ----
class _Gathered(np.ndarray):
    """A memory-mapped IDX image array that records the rows gathered from it by index
    array (``Pool.features``; slices, as the pixel statistics read, are not gathers)."""

    log: dict

    def __getitem__(self, key):
        if isinstance(key, np.ndarray) and key.dtype != bool:
            self.log.setdefault(self.name, set()).update(int(i) for i in key.reshape(-1))
        return super().__getitem__(key)


def _raw_mnist(tmp_path):
    import gzip

    from conftest import tiny_mnist

    root = tiny_mnist(tmp_path / "raw")
    for gz in (root / "mnist").glob("*.gz"):
        gz.with_suffix("").write_bytes(gzip.decompress(gz.read_bytes()))
        gz.unlink()
    return root


def _gathers(tmp_path, monkeypatch, owners):
    import fedudp.data.idx as idx

    log: dict = {}
    real = idx._mapped_images

    def spying(path):
        arr = real(path)
        if arr is None:
            return None
        out = arr.view(_Gathered)
        out.log, out.name = log, path.name
        return out

    monkeypatch.setattr(idx, "_mapped_images", spying)
    cfg = config_from_overrides(
        {
            "progress": False,
            "dataset.name": "mnist",
            "dataset.root": str(_raw_mnist(tmp_path)),
            "dataset.num_records": 240,
            "partition.num_owners": 3,
        }
    )
    fed = build.federation(cfg, owners=owners)
    return fed, log


def test_an_uncompressed_idx_block_gathers_only_its_records(tmp_path, monkeypatch):
    whole, log_whole = _gathers(tmp_path / "w", monkeypatch, None)
    block, log = _gathers(tmp_path / "b", monkeypatch, range(1, 2))
    _same(block, whole.block(1, 2))
    train = "train-images-idx3-ubyte"
    assert len(log[train]) == len(block.y) < len(whole.y) == len(log_whole[train]) == 240


def test_an_idx_block_gathering_every_record_is_caught(tmp_path, monkeypatch):
    # the weakened twin: the whole federation gathered, then the block kept
    real = build.federation

    def whole_then_block(cfg, records=None, owners=None):
        fed = real(cfg, records)
        return fed if owners is None else fed.block(owners.start, owners.stop)

    monkeypatch.setattr(build, "federation", whole_then_block)
    block, log = _gathers(tmp_path, monkeypatch, range(1, 2))
    with pytest.raises(AssertionError):
        assert len(log["train-images-idx3-ubyte"]) == len(block.y)
