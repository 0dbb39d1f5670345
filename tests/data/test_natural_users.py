"""Natural-user data layer: Records, grouping rules, and the npz / Parquet / LEAF / CIFAR readers.

Every file is generated here, in tmp_path, in its exact published format (no data set is
downloaded). Each error is checked to be one line naming the file or column.
"""

from __future__ import annotations

import ast
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from fedudp.config import DataError
from fedudp.data import cifar, columnar, leaf
from fedudp.data.owner_rules import capacity_bound
from fedudp.data.records import Records, from_arrays, group_users, summary, users_by_rule

DATA = Path(__file__).resolve().parents[2] / "fedudp" / "data"


def one_line(exc: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and msg.strip() == msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def assert_users_intact(r: Records) -> None:
    """Every user's records carry one owner."""
    assert r.owner is not None
    for u in np.unique(r.user):
        assert len(np.unique(r.owner[r.user == u])) == 1, u


def labelled_users(
    num_users: int = 200, classes: int = 4, per_user: int = 3, seed: int = 0
) -> Records:
    """Users each holding ``per_user`` records of one class (class = user % classes)."""
    rng = np.random.default_rng(seed)
    user = np.repeat(np.arange(num_users), per_user)
    perm = rng.permutation(len(user))
    user = user[perm]
    return from_arrays(
        rng.random((len(user), 2)).astype(np.float32), user % classes, user, classes=classes
    )


# ------------------------------------------------------------------------------- Records


def test_records_from_arrays_dtypes_and_torch():
    torch = pytest.importorskip("torch")
    r = from_arrays(
        torch.arange(12, dtype=torch.float64).reshape(4, 3),
        torch.tensor([0, 1, 2, 1], dtype=torch.int32),
        np.array(["a", "b", "a", "c"]),
    )
    assert r.x.dtype == np.float32 and r.x.shape == (4, 3)
    assert r.y.dtype == np.int64 and r.y.tolist() == [0, 1, 2, 1]
    assert r.user.tolist() == ["a", "b", "a", "c"] and r.owner is None and r.classes == 3
    tok = from_arrays(
        np.array([[1, 2], [3, 4]], np.int32),
        np.array([0, 1]),
        np.array([7, 8], np.uint8),
        owner=np.array([0, 0]),
        classes=5,
    )
    assert tok.x.dtype == np.int64 and tok.user.dtype == np.int64 and tok.classes == 5
    objs = from_arrays(np.zeros((2, 1)), np.array([0, 0]), np.array(["u", "v"], dtype=object))
    assert objs.user.dtype.kind == "U"
    with pytest.raises(TypeError, match="x must be a numpy array or a torch tensor, got list"):
        from_arrays([[1.0]], np.array([0]), np.array([0]))


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(y=np.array([0, 1, 2])), "y must be 1-D with one entry per record (4)"),
        (dict(y=np.array([0, 1, 5, 0])), "label 5 of record 2 is outside [0, 3)"),
        (dict(y=np.array([[0, 1], [1, 0]])), "labels must be 1-D"),
        (dict(x=np.array([[0.0], [np.nan], [1.0], [2.0]])), "features of record 1 are NaN"),
        (dict(user=np.array([[1, 2], [3, 4]])), "user ids must be 1-D"),
        (dict(owner=np.array([0, 1, 1, 0])), "user 'a' has records under two owners (0 and 1)"),
    ],
)
def test_records_validation_one_line(kw, needle):
    base = dict(
        x=np.zeros((4, 1)),
        y=np.array([0, 1, 2, 0]),
        user=np.array(["a", "b", "a", "c"]),
        classes=3,
        source="mine.npz",
    )
    with pytest.raises(DataError) as e:
        from_arrays(**{**base, **kw})
    one_line(e, "mine.npz: ", needle)
    assert isinstance(e.value, ValueError)


def test_records_is_frozen():
    r = labelled_users(4, 2, 1)
    with pytest.raises(Exception):
        r.classes = 3  # type: ignore[misc]


def test_summary_counts():
    r = from_arrays(
        np.zeros((6, 1)),
        np.zeros(6, np.int64),
        np.array([1, 1, 1, 2, 3, 3]),
        owner=np.array([0, 0, 0, 0, 1, 1]),
        classes=2,
    )
    s = summary(r)
    assert (s.records, s.users, s.owners, s.classes) == (6, 3, 2, 2)
    assert s.records_per_user == (1, 2.0, 3) and s.users_per_owner == (1, 1.5, 2)
    assert "records per user min/median/max 1/2/3" in str(s)
    assert summary(r.with_owner(None)).owners is None


# --------------------------------------------------------------------------- grouping rules


def test_group_random_balanced_intact_seeded():
    r = labelled_users(103)
    g = group_users(r, "random", num_owners=10, seed=3)
    assert_users_intact(g)
    per_owner = [len(np.unique(g.user[g.owner == k])) for k in range(10)]
    # each user by its own keyed hash (tests/data/test_owner_rules.py): sizes Binomial(103, 1/10)
    assert sum(per_owner) == 103 and max(per_owner) <= capacity_bound(103, 10)
    again = group_users(r, "random", num_owners=10, seed=3)
    assert np.array_equal(g.owner, again.owner)
    assert not np.array_equal(g.owner, group_users(r, "random", num_owners=10, seed=4).owner)
    assert np.array_equal(g.x, r.x) and np.array_equal(g.user, r.user)  # records untouched
    # the owner count is declared (an upper bound): more owners than users leaves some empty
    few = group_users(labelled_users(3), "random", num_owners=4)
    assert sorted(np.unique(few.owner).tolist()) != [0, 1, 2, 3] and len(np.unique(few.owner)) == 3


def test_group_column_and_conflict():
    x = np.zeros((5, 1))
    site = np.array(["north", "north", "south", "south", "south"])
    r = from_arrays(
        x,
        np.zeros(5, np.int64),
        np.array([1, 1, 2, 3, 3]),
        meta={"site": site},
        classes=1,
        source="fed.parquet",
    )
    g = group_users(r, "column", column="site")
    assert g.owner.tolist() == site.tolist()
    assert_users_intact(g)
    bad = from_arrays(
        x,
        np.zeros(5, np.int64),
        np.array([1, 1, 2, 3, 3]),
        meta={"site": np.array(["n", "n", "s", "s", "n"])},
        classes=1,
        source="fed.parquet",
    )
    with pytest.raises(DataError) as e:
        group_users(bad, "column", column="site")
    one_line(e, "fed.parquet", "column 'site'", "user 3 two values ('n' and 's')")
    with pytest.raises(DataError) as e:
        group_users(r, "column", column="region")
    one_line(e, "fed.parquet", "'region'", "columns present: site")


def test_group_dirichlet_intact_seeded_and_skewed():
    r = labelled_users(400, classes=4, per_user=2)
    g = group_users(r, "dirichlet", num_owners=8, alpha=0.05, seed=0)
    assert_users_intact(g)
    sizes = np.bincount(g.owner[np.unique(g.user, return_index=True)[1]], minlength=8)
    assert sizes.sum() == 400 and sizes.min() > 0  # balanced in expectation only
    assert np.array_equal(
        g.owner, group_users(r, "dirichlet", num_owners=8, alpha=0.05, seed=0).owner
    )
    assert not np.array_equal(
        g.owner, group_users(r, "dirichlet", num_owners=8, alpha=0.05, seed=1).owner
    )

    def dominated(alpha: float, seed: int) -> float:
        o = group_users(r, "dirichlet", num_owners=8, alpha=alpha, seed=seed)
        shares = [
            np.bincount(o.y[o.owner == k], minlength=4).max() / (o.owner == k).sum()
            for k in range(8)
        ]
        return float(np.mean(np.array(shares) >= 0.5))

    small = np.mean([dominated(0.05, s) for s in range(6)])
    large = np.mean([dominated(100.0, s) for s in range(6)])
    assert small >= 0.7 and large <= 0.1, (small, large)


def test_users_by_rule_shuffle():
    r = from_arrays(
        np.arange(10, dtype=np.float32)[:, None], np.arange(10) % 2, np.arange(10), classes=2
    )
    u = users_by_rule(r, "shuffle", records_per_user=4, seed=5)
    assert u.owner is None and sorted(np.bincount(u.user).tolist()) == [2, 4, 4]
    assert np.bincount(u.user).tolist()[-1] == 2  # the last user is the small one
    assert np.array_equal(u.x, r.x) and np.array_equal(u.y, r.y)
    assert np.array_equal(u.user, users_by_rule(r, records_per_user=4, seed=5).user)
    assert not np.array_equal(u.user, users_by_rule(r, records_per_user=4, seed=6).user)


def test_users_by_rule_dirichlet_skew():
    rng = np.random.default_rng(1)
    r = from_arrays(np.zeros((1001, 1)), rng.integers(0, 5, 1001), np.arange(1001), classes=5)

    def mean_top_share(alpha: float) -> float:
        u = users_by_rule(r, "dirichlet", records_per_user=20, alpha=alpha, seed=2)
        sizes = np.bincount(u.user)
        assert sizes.sum() == 1001 and len(sizes) == 51 and sizes[-1] == 1  # every record once
        return float(np.mean([np.bincount(u.y[u.user == k]).max() / sizes[k] for k in range(50)]))

    assert mean_top_share(0.05) > 0.75 and mean_top_share(100.0) < 0.45
    a = users_by_rule(r, "dirichlet", records_per_user=20, alpha=0.5, seed=2)
    b = users_by_rule(r, "dirichlet", records_per_user=20, alpha=0.5, seed=2)
    c = users_by_rule(r, "dirichlet", records_per_user=20, alpha=0.5, seed=3)
    assert np.array_equal(a.user, b.user) and not np.array_equal(a.user, c.user)


# ------------------------------------------------------------------------------------- npz


def test_read_npz_exact(tmp_path):
    p = tmp_path / "fed.npz"
    x = np.arange(24, dtype=np.float64).reshape(4, 2, 3)
    np.savez(
        p,
        x=x,
        y=np.array([2, 0, 1, 2]),
        user=np.array(["ann", "bob", "ann", "cy"]),
        site=np.array([10, 11, 10, 12]),
    )
    r = columnar.read_npz(p, owner="site", classes=3)
    assert r.x.dtype == np.float32 and r.x.shape == (4, 2, 3) and np.array_equal(r.x, x)
    assert r.y.tolist() == [2, 0, 1, 2] and r.classes == 3
    assert r.user.tolist() == ["ann", "bob", "ann", "cy"] and r.owner.tolist() == [10, 11, 10, 12]
    m = columnar.read_npz(p, meta=["site"], classes=7)
    assert m.owner is None and m.meta["site"].tolist() == [10, 11, 10, 12] and m.classes == 7
    assert m.source == str(p)
    # the class count is declared, never max(label) + 1; a label outside it names the file
    with pytest.raises(DataError) as e:
        columnar.read_npz(p)
    one_line(e, str(p), "pass classes=")
    with pytest.raises(DataError) as e:
        columnar.read_npz(p, classes=2)
    one_line(e, str(p), "label 2 of record 0 is outside [0, 2)")


def test_read_npz_errors(tmp_path):
    with pytest.raises(DataError) as e:
        columnar.read_npz(tmp_path / "none.npz")
    one_line(e, "none.npz: no such file")
    p = tmp_path / "fed.npz"
    np.savez(p, feats=np.zeros((3, 2)), y=np.zeros(3, np.int64), user=np.arange(3))
    with pytest.raises(DataError) as e:
        columnar.read_npz(p)
    one_line(e, str(p), "no column 'x'", "columns present: feats, y, user", "features=")
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.zeros((3, 2)), y=np.zeros((3, 2), np.int64), user=np.arange(3))
    with pytest.raises(DataError) as e:
        columnar.read_npz(bad, classes=3)
    one_line(e, str(bad), "labels must be 1-D", "(3, 2)")
    short = tmp_path / "short.npz"
    np.savez(short, x=np.zeros((3, 2)), y=np.zeros(3, np.int64), user=np.arange(2))
    with pytest.raises(DataError) as e:
        columnar.read_npz(short, classes=3)
    one_line(e, str(short), "user must be 1-D with one entry per record (3)")
    obj = tmp_path / "obj.npz"
    np.savez(
        obj, x=np.zeros((2, 1)), y=np.zeros(2, np.int64), user=np.array(["a", None], dtype=object)
    )
    with pytest.raises(DataError) as e:
        columnar.read_npz(obj, classes=3)
    one_line(e, str(obj), "column 'user' is an object array")
    notzip = tmp_path / "text.npz"
    notzip.write_text("hello")
    with pytest.raises(DataError) as e:
        columnar.read_npz(notzip)
    one_line(e, str(notzip))


# --------------------------------------------------------------------------------- parquet


@pytest.fixture
def arrow():
    """(pyarrow, pyarrow.parquet); the Parquet tests skip where the 'parquet' extra is absent."""
    return pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")


def test_read_parquet_list_column(tmp_path, arrow):
    pa, pq = arrow
    p = tmp_path / "fed.parquet"
    table = pa.table(
        {
            "pixels": pa.array([[0.0, 0.5, 1.0], [0.25, 0.75, 0.5]], pa.list_(pa.float64())),
            "label": pa.array([1, 0], pa.int32()),
            "uid": pa.array(["u1", "u2"]),
            "hospital": pa.array(["h1", "h2"]),
        }
    )
    pq.write_table(table, p)
    r = columnar.read_parquet(
        p, features="pixels", label="label", user="uid", owner="hospital", classes=2
    )
    assert r.x.dtype == np.float32 and r.x.tolist() == [[0.0, 0.5, 1.0], [0.25, 0.75, 0.5]]
    assert r.y.dtype == np.int64 and r.y.tolist() == [1, 0] and r.classes == 2
    assert r.user.tolist() == ["u1", "u2"] and r.owner.tolist() == ["h1", "h2"]
    nested = tmp_path / "img.parquet"
    imgs = np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)
    pq.write_table(
        pa.table(
            {
                "x": pa.array(imgs.tolist(), pa.list_(pa.list_(pa.float32(), 3))),
                "y": [0, 1],
                "user": [5, 5],
            }
        ),
        nested,
    )
    n = columnar.read_parquet(nested, classes=2)
    assert n.x.shape == (2, 2, 3) and np.array_equal(n.x, imgs) and n.user.dtype == np.int64
    tokens = tmp_path / "tok.parquet"
    pq.write_table(
        pa.table(
            {"x": pa.array([[1, 2], [3, 4]], pa.list_(pa.int64(), 2)), "y": [0, 1], "user": [1, 2]}
        ),
        tokens,
    )
    t = columnar.read_parquet(tokens, classes=2)
    assert t.x.dtype == np.int64 and t.x.tolist() == [[1, 2], [3, 4]]


def test_read_parquet_scalar_columns_and_meta(tmp_path, arrow):
    pa, pq = arrow
    p = tmp_path / "tab.parquet"
    pq.write_table(
        pa.table(
            {
                "age": [30.0, 41.0, 52.0],
                "bmi": [21.5, 30.0, 25.0],
                "y": [1, 0, 1],
                "user": [7, 8, 7],
                "region": ["e", "w", "e"],
            }
        ),
        p,
    )
    r = columnar.read_parquet(p, features=["bmi", "age"], meta=["region"], classes=2)
    with pytest.raises(DataError) as e:
        columnar.read_parquet(p, features=["bmi", "age"], classes=1)
    one_line(e, str(p), "label 1 of record 0 is outside [0, 1)")
    assert r.x.shape == (3, 2) and r.x.tolist() == [[21.5, 30.0], [30.0, 41.0], [25.0, 52.0]]
    assert r.meta["region"].tolist() == ["e", "w", "e"] and r.meta["region"].dtype.kind == "U"
    g = group_users(r, "column", column="region")
    assert g.owner.tolist() == ["e", "w", "e"]


def test_read_parquet_errors(tmp_path, arrow):
    pa, pq = arrow
    p = tmp_path / "fed.parquet"
    pq.write_table(pa.table({"x": pa.array([[1.0], [2.0, 3.0]]), "y": [0, 1], "user": [1, 2]}), p)
    with pytest.raises(DataError) as e:
        columnar.read_parquet(p, user="writer")
    one_line(e, str(p), "no column 'writer'", "columns present: x, y, user", "user=")
    with pytest.raises(DataError) as e:
        columnar.read_parquet(p)
    one_line(e, str(p), "column 'x' has cells of different lengths (1 and 2)")
    with pytest.raises(DataError) as e:
        columnar.read_parquet(p, features=["x"])
    one_line(e, str(p), "feature column 'x' must be a numeric scalar column")
    with pytest.raises(DataError) as e:
        columnar.read_parquet(tmp_path / "gone.parquet")
    one_line(e, "gone.parquet: no such file")


def test_read_parquet_without_pyarrow(tmp_path, monkeypatch):
    for mod in ("pyarrow", "pyarrow.compute", "pyarrow.parquet"):
        monkeypatch.setitem(sys.modules, mod, None)  # `import pyarrow` now fails
    with pytest.raises(ImportError) as e:
        columnar.read_parquet(tmp_path / "fed.parquet")
    one_line(e, "pip install 'fedudp[parquet]'")
    assert isinstance(e.value, DataError)


# ------------------------------------------------------------------------------------ LEAF


def leaf_file(path: Path, users: dict[str, tuple[list, list]], hierarchies: bool = False) -> None:
    obj = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    if hierarchies:
        obj["hierarchies"] = ["h"] * len(users)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def femnist_image(seed: int) -> list[float]:
    return (np.random.default_rng(seed).integers(0, 256, 784) / 255).tolist()


def test_read_femnist_exact(tmp_path):
    imgs = {i: femnist_image(i) for i in range(5)}
    leaf_file(
        tmp_path / "train" / "all_data_0_train_9.json",
        {"f0001_12": ([imgs[0], imgs[1]], [3, 61]), "f0002_40": ([imgs[2]], [10])},
        hierarchies=True,
    )
    leaf_file(tmp_path / "train" / "all_data_1_train_9.json", {"f0003_07": ([imgs[3]], [0])})
    leaf_file(
        tmp_path / "test" / "all_data_0_test_9.json",
        {"f0001_12": ([imgs[4]], [5]), "f0002_40": ([imgs[0]], [36])},
    )
    train, test = leaf.read_femnist(tmp_path)
    assert train.x.dtype == np.float32 and train.x.shape == (4, 1, 28, 28)
    assert np.array_equal(train.x[1, 0], np.float32(imgs[1]).reshape(28, 28))
    assert train.y.dtype == np.int64 and train.y.tolist() == [3, 61, 10, 0]
    assert train.user.tolist() == ["f0001_12", "f0001_12", "f0002_40", "f0003_07"]
    assert train.classes == test.classes == 62 and train.owner is None
    assert set(test.users) <= set(train.users) and test.y.tolist() == [5, 36]
    assert np.array_equal(test.x[0, 0].ravel(), np.float32(imgs[4]))


def test_read_femnist_errors(tmp_path):
    with pytest.raises(DataError) as e:
        leaf.read_femnist(tmp_path)
    one_line(
        e,
        str(tmp_path / "train"),
        "github.com/TalwalkarLab/leaf",
        "preprocess.sh",
        "-t user",
        f"{tmp_path}/train/*.json",
        f"{tmp_path}/test/*.json",
    )
    leaf_file(tmp_path / "train" / "a.json", {"w1": ([[0.5] * 783], [1])})
    leaf_file(tmp_path / "test" / "a.json", {"w1": ([femnist_image(0)], [1])})
    with pytest.raises(DataError) as e:
        leaf.read_femnist(tmp_path)
    one_line(e, str(tmp_path / "train" / "a.json"), "'w1'", "783 values, expected 784")
    leaf_file(tmp_path / "train" / "a.json", {"w1": ([femnist_image(0)], [62])})
    with pytest.raises(DataError) as e:
        leaf.read_femnist(tmp_path)
    one_line(e, "a.json", "outside [0, 62)")
    leaf_file(tmp_path / "train" / "a.json", {"w1": ([femnist_image(0)], [1])})
    leaf_file(tmp_path / "train" / "b.json", {"w1": ([femnist_image(1)], [2])})
    with pytest.raises(DataError) as e:
        leaf.read_femnist(tmp_path)
    one_line(e, "b.json", "user 'w1' is also in a.json")


def test_shakespeare_vocab_and_exact(tmp_path):
    assert len(leaf.VOCAB) == 80 and len(set(leaf.VOCAB)) == 80
    assert leaf.VOCAB[0] == "\n" and leaf.VOCAB[-1] == "}" and leaf.VOCAB.index("a") == 53
    line = (
        "To be, or not to be: that is the question.\nWhether 'tis nobler in the mind [to]}"
        + "?" * 80
    )[:80]
    other = (
        "ROMEO. But soft! what light through yonder window breaks? It is the east & Juliet"
        + "!" * 80
    )[:80]
    leaf_file(
        tmp_path / "train" / "s.json",
        {
            "THE_TRAGEDY_OF_HAMLET_HAMLET": ([line, other], [" ", "Z"]),
            "ROMEO_AND_JULIET_ROMEO": ([other], ["\n"]),
        },
        hierarchies=True,
    )
    leaf_file(tmp_path / "test" / "s.json", {"ROMEO_AND_JULIET_ROMEO": ([line], ["e"])})
    train, test = leaf.read_shakespeare(tmp_path)
    assert train.x.dtype == np.int64 and train.x.shape == (3, 80) and train.classes == 80
    assert "".join(leaf.VOCAB[i] for i in train.x[0]) == line
    assert train.x[0, :3].tolist() == [leaf.VOCAB.index("T"), leaf.VOCAB.index("o"), 1]
    assert train.y.tolist() == [1, leaf.VOCAB.index("Z"), 0]
    assert train.user.tolist() == ["THE_TRAGEDY_OF_HAMLET_HAMLET"] * 2 + ["ROMEO_AND_JULIET_ROMEO"]
    assert test.user.tolist() == ["ROMEO_AND_JULIET_ROMEO"] and test.y.tolist() == [57]


def test_shakespeare_unknown_chars_and_lengths(tmp_path):
    odd = "a" * 79 + "|"
    leaf_file(tmp_path / "train" / "s.json", {"ROLE": ([odd], ["a"])})
    leaf_file(tmp_path / "test" / "s.json", {"ROLE": (["b" * 80], ["$"])})
    with pytest.raises(DataError) as e:
        leaf.read_shakespeare(tmp_path)
    one_line(e, "s.json", "'ROLE'", "'|' (U+007C)", "unknown=' '")
    train, test = leaf.read_shakespeare(tmp_path, unknown=" ")
    assert train.x[0, -1] == 1 and test.y.tolist() == [1]
    leaf_file(tmp_path / "train" / "s.json", {"ROLE": (["a" * 79], ["a"])})
    with pytest.raises(DataError) as e:
        leaf.read_shakespeare(tmp_path)
    one_line(e, "s.json", "an input that is not a string of 80 characters")
    with pytest.raises(DataError) as e:
        leaf.read_shakespeare(tmp_path / "nowhere")
    one_line(e, "Shakespeare", "github.com/TalwalkarLab/leaf", "data/shakespeare/data/train")


# ----------------------------------------------------------------------------------- CIFAR


def cifar_images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)


def write_cifar10(root: Path, protocol: int = 2) -> dict[str, dict]:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for i, name in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        d = {
            b"batch_label": name.encode(),
            b"labels": [(i + j) % 10 for j in range(3)],
            b"data": cifar_images(3, i),
            b"filenames": [b"a.png", b"b.png", b"c.png"],
        }
        (folder / name).write_bytes(pickle.dumps(d, protocol=protocol))
        batches[name] = d
    return batches


@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_read_cifar10_exact(tmp_path, protocol):
    batches = write_cifar10(tmp_path, protocol)
    train, test = cifar.read_cifar10(tmp_path)
    assert train.x.dtype == np.float32 and train.x.shape == (15, 3, 32, 32)
    assert test.x.shape == (3, 3, 32, 32) and train.classes == test.classes == 10
    raw = batches["data_batch_2"][b"data"][1]  # record 4 of train
    for c, r, col in [(0, 0, 0), (1, 5, 7), (2, 31, 31), (0, 31, 0)]:
        assert train.x[4, c, r, col] == np.float32(raw[c * 1024 + r * 32 + col]) / np.float32(255)
    assert train.x.min() >= 0 and train.x.max() <= 1
    assert train.y.tolist() == [(i + j) % 10 for i in range(5) for j in range(3)]
    assert test.y.tolist() == [5, 6, 7] and train.user.tolist() == list(range(15))
    # the folder itself works as root too
    again, _ = cifar.read_cifar10(tmp_path / "cifar-10-batches-py")
    assert np.array_equal(again.x, train.x)
    users = users_by_rule(train, "shuffle", records_per_user=4, seed=0)
    assert sorted(np.bincount(users.user).tolist()) == [3, 4, 4, 4]
    assert_users_intact(group_users(users, "random", num_owners=2, seed=0))


def test_read_cifar100_fine_coarse(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 4), ("test", 2)):
        d = {
            b"data": cifar_images(n, n),
            b"fine_labels": list(range(95, 95 + n)),
            b"coarse_labels": list(range(15, 15 + n)),
            b"filenames": [b"f"] * n,
        }
        (folder / name).write_bytes(pickle.dumps(d, protocol=2))
    fine, fine_test = cifar.read_cifar100(tmp_path)
    assert fine.classes == 100 and fine.y.tolist() == [95, 96, 97, 98]
    assert fine.x.shape == (4, 3, 32, 32) and fine_test.y.tolist() == [95, 96]
    coarse, _ = cifar.read_cifar100(tmp_path, labels="coarse")
    assert coarse.classes == 20 and coarse.y.tolist() == [15, 16, 17, 18]
    assert np.array_equal(coarse.x[2].reshape(-1) * 255, cifar_images(4, 4)[2].astype(np.float32))


def test_cifar_errors(tmp_path):
    with pytest.raises(DataError) as e:
        cifar.read_cifar10(tmp_path)
    one_line(
        e,
        str(tmp_path / "cifar-10-batches-py"),
        "https://www.cs.toronto.edu/~kriz/cifar.html",
        "python version",
        f"unpack it in {tmp_path}",
    )
    with pytest.raises(DataError) as e:
        cifar.read_cifar100(tmp_path)
    one_line(e, "cifar-100-python", "CIFAR-100")
    batches = write_cifar10(tmp_path)
    folder = tmp_path / "cifar-10-batches-py"
    d = {**batches["test_batch"], b"data": np.zeros((3, 3071), np.uint8)}
    (folder / "test_batch").write_bytes(pickle.dumps(d, protocol=2))
    with pytest.raises(DataError) as e:
        cifar.read_cifar10(tmp_path)
    one_line(e, str(folder / "test_batch"), "uint8 [n, 3072]", "[3, 3071]")
    d = {k: v for k, v in batches["test_batch"].items() if k != b"labels"}
    (folder / "test_batch").write_bytes(pickle.dumps(d))
    with pytest.raises(DataError) as e:
        cifar.read_cifar10(tmp_path)
    one_line(e, "test_batch", "no key b'labels'")

    class Evil:  # (not print: Ray replaces builtins.print in a process that ran a simulation)
        def __reduce__(self):
            return (eval, ("'pwned'",))

    (folder / "test_batch").write_bytes(pickle.dumps({b"data": Evil()}))
    with pytest.raises(DataError) as e:
        cifar.read_cifar10(tmp_path)
    one_line(e, "test_batch", "builtins.eval is not allowed")


# ------------------------------------------------------------------------------- structure


@pytest.mark.parametrize("name", ["records", "owner_rules", "columnar", "leaf", "cifar"])
def test_imports_stay_in_the_data_layer(name):
    tree = ast.parse((DATA / f"{name}.py").read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    froms = {
        (n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
    }
    fedudp = {m for m, _ in froms if m and m.startswith("fedudp")} | {
        m for m in mods if m.startswith("fedudp")
    }
    # the errors, the records and the readers' registry; never the configuration (it sits above
    # the config builder, tests/test_layers.py)
    allowed = {"fedudp.errors", "fedudp.data.records", "fedudp.data.readers"}
    assert fedudp <= allowed | {"fedudp.data.owner_rules"}, fedudp
    assert {a for m, a in froms if m == "fedudp.errors"} <= {"ConfigError", "DataError"}
