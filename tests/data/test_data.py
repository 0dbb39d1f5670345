"""Owners -> users -> records (docs/algorithms.md#data-partition) and the IDX reader."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import tiny_cfg, tiny_mnist, write_idx
from fedudp.config import DataError
from fedudp.data import partition
from fedudp.build import federation as build_federation
from fedudp.data.idx import check_available, load_idx_dataset, parse_idx

LABELS = np.random.default_rng(7).integers(0, 10, 60_000)
TEST_LABELS = np.random.default_rng(8).integers(0, 10, 10_000)


def _paper(owners: int, seed: int, k: int = 8, total: int = 10_000):
    rng = np.random.default_rng(seed)
    return partition.paper_classes(LABELS, TEST_LABELS, total, owners, k, 10, 10_000 // owners, rng)


@pytest.mark.parametrize("owners", [4, 16, 64, 512])
def test_paper_split_invariants(owners):
    train, test, classes = _paper(owners, seed=1)
    sizes = np.array([len(t) for t in train])
    lo, hi = 10_000 // owners, -(-10_000 // owners)
    assert sizes.sum() == 10_000 and set(sizes) <= {lo, hi}
    assert (sizes == hi).sum() == 10_000 % owners or lo == hi
    allidx = np.concatenate(train)
    assert len(np.unique(allidx)) == len(allidx), "owners' training records overlap"
    tall = np.concatenate(test)
    assert len(np.unique(tall)) == len(tall), "owners' test records overlap"
    for j in range(owners):
        assert len(classes[j]) == 8 and len(set(classes[j])) == 8
        assert set(LABELS[train[j]]) <= set(classes[j]) and len(set(LABELS[train[j]])) <= 8
        # the test shard uses the same class set
        assert set(TEST_LABELS[test[j]]) <= set(classes[j])
        assert len(test[j]) > 0


def test_paper_split_balanced_over_classes():
    train, _, classes = _paper(16, seed=2)
    for j in range(16):
        counts = np.bincount(LABELS[train[j]], minlength=10)[classes[j]]
        assert counts.max() - counts.min() <= 1  # round robin over its classes


def test_partition_is_seeded():
    a, b, c = _paper(16, 3), _paper(16, 3), _paper(16, 4)
    assert all(np.array_equal(x, y) for x, y in zip(a[0], b[0]))
    assert not all(np.array_equal(x, y) for x, y in zip(a[0], c[0]))


@settings(max_examples=25, deadline=None)
@given(total=st.integers(1, 3000), owners=st.integers(1, 400))
def test_owner_sizes_floor_ceil(total, owners):
    if owners > total:
        with pytest.raises(ValueError):
            partition.owner_sizes(total, owners)
        return
    s = partition.owner_sizes(total, owners)
    assert s.sum() == total and s.min() == total // owners and s.max() == -(-total // owners)


def test_iid_and_dirichlet_disjoint_and_sized():
    rng = np.random.default_rng(0)
    train, test = partition.iid(60_000, 10_000, 10_000, 16, 625, rng)
    idx = np.concatenate(train)
    assert len(np.unique(idx)) == 10_000 and {len(t) for t in train} == {625}
    train, test, props = partition.dirichlet(
        LABELS, TEST_LABELS, 10_000, 16, 0.1, 10, 300, np.random.default_rng(1)
    )
    idx = np.concatenate(train)
    assert len(np.unique(idx)) == 10_000 and {len(t) for t in train} == {625}
    # alpha=0.1 concentrates each owner on few classes
    top = [np.bincount(LABELS[t], minlength=10).max() / len(t) for t in train]
    assert np.median(top) > 0.5


@pytest.mark.parametrize("rpu", [1, 3, 10])
def test_users_cut_owners(rpu):
    fed = build_federation(
        tiny_cfg(**{"partition.records_per_user": rpu, "dataset.num_records": 150})
    )
    sizes = fed.user_sizes()
    assert sizes.sum() == 150 and sizes.max() == rpu
    for j in range(fed.num_owners):
        us = sizes[fed.owner_user_offsets[j] : fed.owner_user_offsets[j + 1]]
        assert (us[:-1] == rpu).all() if rpu > 1 else (us == 1).all()
        assert (
            fed.user_owner[fed.owner_user_offsets[j] : fed.owner_user_offsets[j + 1]] == j
        ).all()
    assert set(fed.owner_sizes()) == {37, 38}


def test_federation_owner_classes_and_test_shards():
    fed = build_federation(
        tiny_cfg(**{"dataset.num_records": 400, "partition.classes_per_owner": 3})
    )
    for j in range(fed.num_owners):
        od = fed.owner(j)
        assert set(od.y.tolist()) <= set(fed.owner_classes[j].tolist())
        assert set(od.y_test.tolist()) <= set(fed.owner_classes[j].tolist())


def test_idx_roundtrip_gz_and_raw(tmp_path):
    root = tiny_mnist(tmp_path, n_train=50, n_test=20)
    tx, ty, vx, vy = load_idx_dataset("mnist", root)
    assert tx.shape == (50, 28, 28) and ty.shape == (50,) and vx.shape == (20, 28, 28)
    assert tx.dtype == np.uint8 and ty.max() <= 9
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "x", arr, gz=False)
    assert np.array_equal(parse_idx((tmp_path / "x").read_bytes()), arr)


def test_idx_bad_files_rejected(tmp_path):
    with pytest.raises(ValueError, match="magic"):
        parse_idx(b"\x00\x00\x09\x99" + b"\x00" * 12)
    with pytest.raises(ValueError, match="payload"):  # header says 5 labels, 2 present
        parse_idx(b"\x00\x00\x08\x01" + b"\x00\x00\x00\x05" + b"\x01\x02")


def test_missing_data_folder_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="dataset.root"):
        check_available("mnist", tmp_path / "nowhere", download=False)


def test_bad_idx_file_is_a_data_error_naming_the_file(tmp_path):
    root = tiny_mnist(tmp_path, n_train=50, n_test=20)
    bad = root / "mnist" / "t10k-labels-idx1-ubyte"
    bad.write_bytes(bad.read_bytes()[:-5])  # truncated payload
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte: IDX label payload"):
        load_idx_dataset("mnist", root)


def test_out_of_range_label_names_the_file_and_value(tmp_path):
    root = tiny_mnist(tmp_path, n_train=50, n_test=20)
    labels = np.zeros(20, dtype=np.uint8)
    labels[7] = 12
    write_idx(root / "mnist" / "t10k-labels-idx1-ubyte", labels, gz=False)
    with pytest.raises(
        DataError, match=r"t10k-labels-idx1-ubyte: label 12 at index 7 is outside \[0, 10\)"
    ):
        load_idx_dataset("mnist", root)


def test_more_records_than_the_data_holds_is_a_config_error(tmp_path):
    from fedudp.config import ConfigError
    from fedudp.run import run

    root = tiny_mnist(tmp_path / "data", n_train=300, n_test=50)
    cfg = tiny_cfg(
        "fedavg", **{"dataset.name": "mnist", "dataset.root": str(root), "dataset.num_records": 500}
    )
    with pytest.raises(ConfigError, match="dataset.num_records: 500 records asked for"):
        run(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _old_standardized_pool(root):
    """The pool as fedudp standardized it before issue 40 (its literal formula): numpy's mean and
    std of the whole training array, every image in float32, a channel dim added."""
    from fedudp.data.federation import IMAGE_CLASSES, Pool

    tx, ty, vx, vy = load_idx_dataset("mnist", str(root), False)
    mean, std = tx.mean() / 255.0, tx.std() / 255.0
    table = ((np.arange(256, dtype=np.uint8).astype(np.float32) / 255.0 - mean) / std).astype(
        np.float32
    )
    norm = lambda a: table[a][:, None]  # noqa: E731
    return Pool(norm(tx), ty.astype(np.int64), norm(vx), vy.astype(np.int64), IMAGE_CLASSES), tx


def test_image_pool_converts_only_the_records_asked_for_as_the_whole_pool_did(tmp_path):
    """Byte images stay bytes in the pool; the records a run uses are standardized on selection,
    bit for bit the whole-array formula's values, with its strides (torch picks convolution
    kernels by strides), and no float copy of the pool is made."""
    from fedudp.data.federation import image_pool

    root = tiny_mnist(tmp_path, n_train=700, n_test=90)
    old, _ = _old_standardized_pool(root)
    pool = image_pool("mnist", str(root))
    assert pool.train_x.dtype == np.uint8 and pool.test_x.dtype == np.uint8
    idx = np.random.default_rng(3).permutation(700)[:123]
    for raw, want in ((pool.train_x, old.train_x), (pool.test_x, old.test_x)):
        for sel in (idx[idx < len(raw)], np.arange(len(raw))):
            got, ref = pool.features(raw, sel), want[sel]
            assert got.dtype == np.float32 and np.array_equal(got, ref)
            assert got.shape == ref.shape and got.strides == ref.strides


def test_mnist_federation_equals_the_whole_pool_path(tmp_path):
    """The built federation (records, labels, test split, user ids) equals what partitioning the
    old whole-pool float32 arrays gives, tensor values and strides alike."""
    from fedudp.data.federation import partition_pool

    root = tiny_mnist(tmp_path, n_train=700, n_test=90)
    old, _ = _old_standardized_pool(root)
    cfg = tiny_cfg(
        "fedavg", **{"dataset.name": "mnist", "dataset.root": str(root), "dataset.num_records": 400}
    )
    new = build_federation(cfg)
    p = cfg.partition
    ref = partition_pool(
        old,
        num_owners=p.num_owners,
        num_records=400,
        records_per_user=p.records_per_user,
        scheme=str(p.scheme.value if hasattr(p.scheme, "value") else p.scheme),
        classes_per_owner=p.classes_per_owner,
        dirichlet_alpha=p.dirichlet_alpha,
        test_per_owner=p.test_per_owner,
        seed=cfg.seed,
    )
    for name in ("x", "y", "x_test", "y_test"):
        a, b = getattr(new, name), getattr(ref, name)
        assert a.dtype == b.dtype and a.stride() == b.stride() and torch.equal(a, b), name
    for name in ("user_offsets", "user_owner", "owner_user_offsets", "test_offsets", "user_ids"):
        assert np.array_equal(getattr(new, name), getattr(ref, name)), name


@pytest.mark.parametrize(
    "shape,sparse", [((700, 28, 28), True), ((3000, 28, 28), False), ((3, 5, 7), True)]
)
def test_pixel_stats_are_numpys_mean_and_std_bit_for_bit(shape, sparse):
    """``pixel_stats`` sums in numpy's pairwise order; a sum in another order (chunks of 8192
    added one after the other) is caught on the larger arrays."""
    from fedudp.data.federation import pixel_stats

    a = np.random.default_rng(sum(shape)).integers(0, 256, shape, dtype=np.uint8)
    if sparse:  # MNIST-like: mostly zero background
        a[a < 180] = 0
    mean, std = pixel_stats(a)
    assert mean == a.mean() and std == a.std()
    if a.size > 1 << 20:
        flat, sq = a.reshape(-1), np.square(np.arange(256.0) - mean)
        seq = sum(np.add.reduce(sq[flat[i : i + 8192]]) for i in range(0, a.size, 8192))
        assert np.sqrt(seq / a.size) != std  # the weakened twin differs
    with pytest.raises(TypeError, match="uint8"):
        pixel_stats(a.astype(np.int64))
