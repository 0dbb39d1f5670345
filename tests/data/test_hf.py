"""fedudp.data.hf.read_hf: Hugging Face data sets saved with save_to_disk, users found by
flwr-datasets' NaturalIdPartitioner. Tiny data sets are built in memory; nothing is downloaded."""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

os.environ["HF_DATASETS_OFFLINE"] = "1"  # before datasets is imported: never reach the Hub
os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
pytest.importorskip("flwr_datasets")
Image = pytest.importorskip("PIL.Image")

from flwr_datasets.partitioner import NaturalIdPartitioner  # noqa: E402

from fedudp.config import DataError  # noqa: E402
from fedudp.data.columnar import MissingDependency  # noqa: E402
from fedudp.data.hf import read_hf  # noqa: E402
from fedudp.data.records import Records  # noqa: E402

F = datasets.Features
V = datasets.Value


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    yield
    if was:
        datasets.enable_progress_bars()


def _save(obj, path: Path) -> Path:
    obj.save_to_disk(str(path))
    return path


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and msg
    return msg


# ------------------------------------------------------------------------------- image data

GREY = [np.arange(12, dtype=np.uint8).reshape(3, 4) * (i + 1) for i in range(5)]
TRAIN_USERS = ["w2", "w1", "w2", "w0", "w1"]
TRAIN_LABELS = [3, 0, 1, 2, 0]
NAMES = ["a", "b", "c", "d", "e", "f"]  # 6 classes, labels use 0..3


def _grey_split(pixels, users, labels):
    return datasets.Dataset.from_dict(
        {"image": [Image.fromarray(p) for p in pixels], "label": labels, "writer": users},
        features=F(
            {
                "image": datasets.Image(),
                "label": datasets.ClassLabel(names=NAMES),
                "writer": V("string"),
            }
        ),
    )


@pytest.fixture(scope="module")
def grey_dict(tmp_path_factory) -> Path:
    test_pixels = [np.full((3, 4), 200, np.uint8), np.full((3, 4), 7, np.uint8)]
    dd = datasets.DatasetDict(
        {
            "train": _grey_split(GREY, TRAIN_USERS, TRAIN_LABELS),
            "test": _grey_split(test_pixels, ["w9", "w1"], [5, 1]),
        }
    )
    return _save(dd, tmp_path_factory.mktemp("hf") / "grey")


def test_images_users_labels_classes(grey_dict):
    train, test = read_hf(grey_dict, features="image", label="label", user="writer")
    assert isinstance(train, Records) and isinstance(test, Records)
    order = [3, 1, 4, 0, 2]  # w0's row, w1's rows, w2's rows (each in row order)
    assert train.x.dtype == np.float32 and train.x.shape == (5, 1, 3, 4)
    want = np.stack([GREY[i] for i in order]).astype(np.float32)[:, None] / np.float32(255)
    np.testing.assert_array_equal(train.x, want)
    assert train.x.max() <= 1.0 and train.x.min() >= 0.0
    assert train.user.tolist() == ["w0", "w1", "w1", "w2", "w2"]
    assert train.y.dtype == np.int64 and train.y.tolist() == [TRAIN_LABELS[i] for i in order]
    assert train.classes == 6 and test.classes == 6  # from the ClassLabel
    assert train.owner is None and dict(train.meta) == {}
    assert train.source == f"{grey_dict} (split 'train')"
    # test split: its own partitions (w1 before w9), values intact
    assert test.user.tolist() == ["w1", "w9"] and test.y.tolist() == [1, 5]
    np.testing.assert_array_equal(test.x[:, 0, 0, 0], np.float32([7, 200]) / np.float32(255))
    assert test.source == f"{grey_dict} (split 'test')"


def test_order_is_natural_id_partitioner_partitions(grey_dict):
    train, _ = read_hf(grey_dict, features="image", label="label", user="writer")
    ds = datasets.load_from_disk(str(grey_dict))["train"]
    part = NaturalIdPartitioner(partition_by="writer")
    part.dataset = ds
    rows = [part.load_partition(p) for p in range(part.num_partitions)]
    assert [r["writer"][0] for r in rows] == list(part.partition_id_to_natural_id.values())
    assert train.user.tolist() == [u for r in rows for u in r["writer"]]
    assert train.y.tolist() == [y for r in rows for y in r["label"]]
    pixels = [np.asarray(im) for r in rows for im in r["image"]]
    np.testing.assert_array_equal(train.x[:, 0] * 255, np.stack(pixels).astype(np.float32))


def test_classes_argument_overrides_classlabel(grey_dict):
    train, test = read_hf(grey_dict, features="image", label="label", user="writer", classes=9)
    assert train.classes == 9 and test.classes == 9


def test_rgb_and_palette_images_channels_first(tmp_path):
    rgb = np.zeros((2, 3, 3), np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 255, 51, 0
    pal = Image.fromarray(rgb).convert("P")
    ds = datasets.Dataset.from_dict(
        {"img": [Image.fromarray(rgb), pal], "y": [0, 1], "user": [1, 0]},
        features=F({"img": datasets.Image(), "y": V("int64"), "user": V("int64")}),
    )
    train, test = read_hf(_save(ds, tmp_path / "rgb"), features="img", classes=2)
    assert test is None
    assert train.x.shape == (2, 3, 2, 3) and train.x.dtype == np.float32
    assert train.user.dtype == np.int64 and train.user.tolist() == [0, 1]
    for r in range(2):
        np.testing.assert_allclose(train.x[r, :, 0, 0], [1.0, 0.2, 0.0], atol=1e-6)


# --------------------------------------------------------------------- arrays and scalars


def _vectors(users, labels, start=0):
    n = len(users)
    return {
        "vec": [[start + 3 * i + k + 0.5 for k in range(3)] for i in range(n)],
        "grid": [np.arange(4, dtype=np.float32).reshape(2, 2) + i for i in range(n)],
        "nest": [[[i, i + 1, i + 2], [0, 0, i]] for i in range(n)],
        "a": [float(i) for i in range(n)],
        "b": [10 * i for i in range(n)],
        "y": labels,
        "user": users,
        "site": [u % 2 for u in users],
        "note": [f"r{i}" for i in range(n)],
    }


VEC_F = F(
    {
        "vec": datasets.List(V("float32"), length=3),
        "grid": datasets.Array2D((2, 2), "float32"),
        "nest": datasets.List(datasets.List(V("int32"))),
        "a": V("float64"),
        "b": V("int64"),
        "y": V("int64"),
        "user": V("int64"),
        "site": V("int64"),
        "note": V("string"),
    }
)


@pytest.fixture(scope="module")
def vec_dict(tmp_path_factory) -> Path:
    dd = datasets.DatasetDict(
        {
            "fit": datasets.Dataset.from_dict(_vectors([5, 3, 5, 3], [0, 1, 2, 1]), features=VEC_F),
            "eval": datasets.Dataset.from_dict(_vectors([3, 8], [4, 0], start=100), features=VEC_F),
        }
    )
    return _save(dd, tmp_path_factory.mktemp("hf") / "vec")


def test_list_column_int_labels_classes_declared(vec_dict):
    # an integer label column has no declared class count: the caller passes it (never
    # max(label) + 1), and a label outside it is refused naming the split
    with pytest.raises(DataError) as e:
        read_hf(vec_dict, split="fit", test_split="eval", features="vec")
    assert "is not a ClassLabel; pass classes=" in _one_line(e)
    with pytest.raises(DataError) as e:
        read_hf(vec_dict, split="fit", test_split="eval", features="vec", classes=4)
    assert "(split 'eval'): label 4 of record 0 is outside [0, 4)" in _one_line(e)
    train, test = read_hf(vec_dict, split="fit", test_split="eval", features="vec", classes=5)
    order = [1, 3, 0, 2]  # user 3's rows, then user 5's
    assert train.x.dtype == np.float32 and train.x.shape == (4, 3)
    want = np.array([[3 * i + k + 0.5 for k in range(3)] for i in order], np.float32)
    np.testing.assert_array_equal(train.x, want)
    assert train.user.dtype == np.int64 and train.user.tolist() == [3, 3, 5, 5]
    assert train.y.tolist() == [1, 1, 0, 2]
    assert train.classes == 5 and test.classes == 5
    assert test.user.tolist() == [3, 8] and test.y.tolist() == [4, 0]
    np.testing.assert_array_equal(test.x[0], np.float32([100.5, 101.5, 102.5]))


def test_array2d_and_nested_lists(vec_dict):
    train, _ = read_hf(vec_dict, split="fit", test_split="eval", features="grid", classes=5)
    assert train.x.shape == (4, 2, 2) and train.x.dtype == np.float32
    np.testing.assert_array_equal(train.x[0], np.arange(4, dtype=np.float32).reshape(2, 2) + 1)
    train, _ = read_hf(vec_dict, split="fit", test_split="eval", features="nest", classes=5)
    assert train.x.shape == (4, 2, 3) and train.x.dtype == np.int64  # integers: token ids
    assert train.x[0].tolist() == [[1, 2, 3], [0, 0, 1]]


def test_scalar_columns_owner_and_meta(vec_dict):
    train, test = read_hf(
        vec_dict,
        split="fit",
        test_split="eval",
        features=["a", "b"],
        owner="site",
        meta=("note", "b"),
        classes=7,
    )
    order = [1, 3, 0, 2]
    assert train.x.dtype == np.float32 and train.x.shape == (4, 2)
    np.testing.assert_array_equal(train.x, np.float32([[i, 10 * i] for i in order]))
    assert train.owner.tolist() == [1, 1, 1, 1] and test.owner.tolist() == [1, 0]
    assert train.meta["note"].tolist() == [f"r{i}" for i in order]
    assert train.meta["b"].tolist() == [10 * i for i in order]
    assert train.classes == 7
    one, _ = read_hf(vec_dict, split="fit", features="a", classes=3)  # one scalar: [N, 1]
    assert one.x.shape == (4, 1)
    ints, _ = read_hf(vec_dict, split="fit", features=["b"], classes=3)
    assert ints.x.dtype == np.int64 and ints.x[:, 0].tolist() == [10, 30, 0, 20]


def test_single_dataset_and_missing_test_split(vec_dict, tmp_path):
    ds = datasets.Dataset.from_dict(_vectors([1, 0], [1, 0]), features=VEC_F)
    train, test = read_hf(_save(ds, tmp_path / "one"), features="vec", classes=2)
    assert test is None and train.user.tolist() == [0, 1] and train.classes == 2
    assert train.source == str(tmp_path / "one")
    _, test = read_hf(vec_dict, split="fit", features="vec", classes=3)  # no 'test' split
    assert test is None
    _, test = read_hf(vec_dict, split="fit", test_split=None, features="vec", classes=3)
    assert test is None


# ------------------------------------------------------------------------------------ errors


def test_missing_folder(tmp_path):
    with pytest.raises(DataError) as e:
        read_hf(tmp_path / "nowhere")
    msg = _one_line(e)
    assert str(tmp_path / "nowhere") in msg and "no such folder" in msg
    assert "datasets.load_dataset(name).save_to_disk(path)" in msg and "copy the folder" in msg


@pytest.mark.parametrize("kind", ["empty", "file", "damaged"])
def test_not_a_saved_data_set(tmp_path, kind):
    p = tmp_path / "thing"
    if kind == "file":
        p.write_text("x")
    else:
        p.mkdir()
    if kind == "damaged":
        (p / "state.json").write_text("{not json")
    with pytest.raises(DataError) as e:
        read_hf(p)
    msg = _one_line(e)
    assert msg.startswith(f"{p}: not a") and "save_to_disk" in msg


def test_missing_split(vec_dict):
    with pytest.raises(DataError) as e:
        read_hf(vec_dict, features="vec")  # split='train' is not there
    msg = _one_line(e)
    assert msg == (f"{vec_dict}: no split 'train' (splits present: fit, eval); pass split='<name>'")


def test_missing_column_in_train_and_test(vec_dict, grey_dict):
    with pytest.raises(DataError) as e:
        read_hf(vec_dict, split="fit", features="pixels")
    msg = _one_line(e)
    assert msg.startswith(
        f"{vec_dict} (split 'fit'): no column 'pixels' (columns present: "
        f"vec, grid, nest, a, b, y, user, site, note)"
    )
    assert msg.endswith("pass features='<column>'")
    with pytest.raises(
        DataError,
        match=r"no column 'user' \(columns present: image, label, "
        r"writer\); pass user='<column>'",
    ):
        read_hf(grey_dict, features="image", label="label")
    with pytest.raises(DataError, match=r"no column 'zone'.*pass meta='<column>'"):
        read_hf(vec_dict, split="fit", features="vec", meta=["zone"])


def test_column_missing_only_in_test_split(tmp_path):
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"x": [[1.0]], "y": [0], "user": ["u"]}),
            "test": datasets.Dataset.from_dict({"x": [[1.0]], "label": [0], "user": ["u"]}),
        }
    )
    p = _save(dd, tmp_path / "d")
    with pytest.raises(DataError) as e:
        read_hf(p)
    assert _one_line(e).startswith(
        f"{p} (split 'test'): no column 'y' (columns present: x, label, user)"
    )


@pytest.mark.parametrize("labels, got", [([0.0, 1.5], "double"), (["cat", "dog"], "string")])
def test_non_integer_labels(tmp_path, labels, got):
    ds = datasets.Dataset.from_dict({"x": [[1.0], [2.0]], "y": labels, "user": [0, 1]})
    p = _save(ds, tmp_path / "d")
    with pytest.raises(DataError) as e:
        read_hf(p)
    assert _one_line(e) == (
        f"{p}: column 'y' must hold integer labels (a ClassLabel or an int "
        f"column), got {got}; encode it first, e.g. "
        f"ds.class_encode_column('y')"
    )


def test_bad_values_name_the_column(tmp_path):
    def fails(data, match, features=None, **kw):
        p = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        _save(datasets.Dataset.from_dict(data, features=features), p)
        with pytest.raises(DataError) as e:
            read_hf(p, **kw)
        msg = _one_line(e)
        assert msg.startswith(f"{p}: ") and match in msg, msg

    fails(
        {"x": [[1.0], [1.0, 2.0]], "y": [0, 1], "user": [0, 1]},
        "column 'x' has cells of different lengths (1 and 2)",
    )
    fails(
        {"x": [[1.0], [2.0]], "y": [0, None], "user": [0, 1]},
        "column 'y' has missing (null) labels",
    )
    fails(
        {"x": [[1.0], [2.0]], "y": [0, 1], "user": ["a", None]},
        "column 'user' has missing (null) values",
    )
    fails(
        {"x": [[1.0], [2.0]], "y": [0, 1], "user": [0.5, 1.5]},
        "column 'user' must hold integer or string ids, got double",
    )
    fails(
        {"x": ["hello", "world"], "y": [0, 1], "user": [0, 1]},
        "column 'x' must hold numeric features (an image, a list/array of numbers or a "
        "number), got string",
    )
    fails({"x": [[1.0], [2.0]], "y": [0, -1], "user": [0, 1]}, "label -1 of record", classes=2)
    imgs = [
        Image.fromarray(np.zeros((2, 2), np.uint8)),
        Image.fromarray(np.zeros((3, 2), np.uint8)),
    ]
    p = _save(
        datasets.Dataset.from_dict(
            {"im": imgs, "y": [0, 1], "user": [0, 1]},
            features=F({"im": datasets.Image(), "y": V("int64"), "user": V("int64")}),
        ),
        tmp_path / "mixed",
    )
    with pytest.raises(DataError) as e:
        read_hf(p, features="im")
    assert _one_line(e).startswith(
        f"{p}: column 'im' has images of different shapes ([1, 2, 2] in record 0, [1, 3, 2] "
        f"in record 1)"
    )


def test_empty_split(monkeypatch, tmp_path):
    # datasets 4.8 cannot reload an empty saved split; an in-memory one reaches the check
    p = _save(datasets.Dataset.from_dict({"x": [[1.0]], "y": [0], "user": [0]}), tmp_path / "d")
    empty = datasets.Dataset.from_dict({"x": [[1.0]], "y": [0], "user": [0]}).select([])
    monkeypatch.setattr(datasets, "load_from_disk", lambda path: empty)
    with pytest.raises(DataError) as e:
        read_hf(p)
    assert _one_line(e) == f"{p}: the split has no records"


def test_missing_dependency(monkeypatch, tmp_path):
    for mod in ("flwr_datasets", "flwr_datasets.partitioner"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    with pytest.raises(MissingDependency) as e:
        read_hf(tmp_path)
    assert isinstance(e.value, DataError) and isinstance(e.value, ImportError)
    assert "pip install 'fedudp[hf]'" in _one_line(e)


def test_imports_are_lazy_and_few():
    import fedudp.data.hf as hf

    tree = ast.parse(Path(hf.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in top if isinstance(n, ast.ImportFrom)}
    assert not {
        m for m in names if m.split(".")[0] in ("datasets", "flwr_datasets", "pyarrow", "PIL")
    }
    every = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    every |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in every if m.startswith("fedudp")} <= {
        "fedudp.errors",
        "fedudp.data.records",
        "fedudp.data.columnar",
        "fedudp.data.readers",
    }


def test_a_saved_data_set_runs_through_the_builder(tmp_path):
    """``dataset.name=hf``: a saved DatasetDict with a natural-id column read by the config
    builder, users intact, the declared public numbers checked, a run end to end."""
    import fedudp
    from fedudp.config import ConfigError

    rng = np.random.default_rng(0)

    def split(n):
        return datasets.Dataset.from_dict(
            {
                "x": rng.standard_normal((n, 5)).astype("float32").tolist(),
                "y": rng.integers(0, 3, n).tolist(),
                "writer": [f"w{i % 12}" for i in range(n)],
            }
        )

    datasets.DatasetDict({"train": split(120), "test": split(30)}).save_to_disk(str(tmp_path / "d"))
    over = {
        "dataset.name": "hf",
        "dataset.path": str(tmp_path / "d"),
        "progress": False,
        "dataset.columns.user": "writer",
        "partition.num_owners": 3,
        "train.rounds": 2,
        "method": "joint_dp",
    }
    with pytest.raises(
        ConfigError,
        match=r"^dataset\.classes: .*dataset\.input_shape=\[5\], "
        r"dataset\.classes>=3 \(labels 0\.\.2\)$",
    ):
        fedudp.simulate(over)
    over.update({"dataset.classes": 3, "dataset.input_shape": [5]})
    with pytest.raises(
        ConfigError,
        match=r"public\.users=12, public\.owner_capacity=\d+, "  # random owners: binomial
        r"public\.records_per_user=10$",
    ):
        fedudp.simulate(over)
    res = fedudp.simulate(
        {**over, "public.users": 12, "public.owner_capacity": 12, "public.records_per_user": 10}
    )
    assert res.summary["num_users"] == 12 and res.rounds_completed == 2
    assert res.summary["num_records"] == 120 and 0 < res.epsilon <= 1.0 + 1e-9
