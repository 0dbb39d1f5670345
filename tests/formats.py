"""Small data sets written in the benchmarks' published formats, for tests (nothing is
downloaded): LEAF's JSON (FEMNIST, Shakespeare), CIFAR-10/100's Python pickles, and an NPZ
federation with natural users of unequal sizes."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np

LEAF_VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


def leaf_file(path: Path, users: dict[str, tuple[list, list]]) -> None:
    """One LEAF JSON file: {"users", "num_samples", "user_data": {user: {"x", "y"}}}."""
    obj = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def write_femnist(root: Path, sizes: list[int], seed: int = 0, classes: int = 62) -> Path:
    """Writers ``f0000_00``.. with ``sizes[i]`` training images (28x28 in [0, 1], a class-wise
    pattern plus noise) and half as many test images (at least one), split over two files."""
    rng = np.random.default_rng(seed)
    proto = rng.random((classes, 784))
    split = {"train": {}, "test": {}}
    for i, n in enumerate(sizes):
        for part, k in (("train", n), ("test", max(1, n // 2))):
            y = rng.integers(0, classes, k)
            x = np.clip(proto[y] + 0.3 * rng.standard_normal((k, 784)), 0, 1).round(4)
            split[part][f"f{i:04d}_{i % 7:02d}"] = (x.tolist(), y.tolist())
    for part, users in split.items():
        names = list(users)
        half = len(names) // 2
        leaf_file(root / part / f"all_data_0_niid_{part}.json", {u: users[u] for u in names[:half]})
        leaf_file(root / part / f"all_data_1_niid_{part}.json", {u: users[u] for u in names[half:]})
    return root


def write_shakespeare(root: Path, sizes: list[int], seed: int = 0) -> Path:
    """Speaking roles with ``sizes[i]`` (80-character context, next character) pairs cut from a
    role's own generated text; test pairs from the same roles."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(LEAF_VOCAB[13:70]))  # digits, punctuation, capitals, lowercase
    split = {"train": {}, "test": {}}
    for i, n in enumerate(sizes):
        text = "".join(rng.choice(letters, 81 + n + n // 2 + 1))
        pairs = [(text[j : j + 80], text[j + 80]) for j in range(n + max(1, n // 2))]
        role = f"THE_PLAY_ROLE{i}"
        split["train"][role] = ([p[0] for p in pairs[:n]], [p[1] for p in pairs[:n]])
        split["test"][role] = ([p[0] for p in pairs[n:]], [p[1] for p in pairs[n:]])
    for part, users in split.items():
        leaf_file(root / part / f"all_data_niid_{part}.json", users)
    return root


def _cifar_images(n: int, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    proto = np.random.default_rng(99).integers(0, 256, (int(labels.max()) + 1, 3072))
    noise = rng.integers(-40, 41, (n, 3072))
    return np.clip(proto[labels] + noise, 0, 255).astype(np.uint8)


def write_cifar10(root: Path, per_batch: int = 40, test: int = 50, seed: int = 0) -> Path:
    """``<root>/cifar-10-batches-py/``: five training batches of ``per_batch`` images and a test
    batch, each a pickled dict with bytes keys (b"data" uint8 [n, 3072], b"labels")."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in [(f"data_batch_{k}", per_batch) for k in range(1, 6)] + [("test_batch", test)]:
        y = rng.integers(0, 10, n)
        d = {
            b"batch_label": name.encode(),
            b"labels": y.tolist(),
            b"data": _cifar_images(n, y, rng),
            b"filenames": [b"x.png"] * n,
        }
        (folder / name).write_bytes(pickle.dumps(d, protocol=2))
    return root


def write_cifar100(root: Path, train: int = 200, test: int = 50, seed: int = 0) -> Path:
    """``<root>/cifar-100-python/``: ``train`` and ``test`` with b"fine_labels" and
    b"coarse_labels"."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", train), ("test", test)):
        fine = rng.integers(0, 100, n)
        d = {
            b"data": _cifar_images(n, fine, rng),
            b"fine_labels": fine.tolist(),
            b"coarse_labels": (fine // 5).tolist(),
            b"filenames": [b"f"] * n,
        }
        (folder / name).write_bytes(pickle.dumps(d, protocol=2))
    return root


def natural_arrays(
    sizes: list[int],
    owners: list[int] | None = None,
    features: int = 6,
    classes: int = 4,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Users ``u0..`` holding ``sizes[i]`` records each (labels skewed per user: a user's own
    class two times in three), features a class signal plus noise; ``owners[i]``: user i's
    owner (an ``owner`` column), or none."""
    rng = np.random.default_rng(seed)
    centres = 2.0 * rng.standard_normal((classes, features))
    user = np.repeat(np.arange(len(sizes)), sizes)
    own = (np.arange(len(sizes)) % classes)[user]
    y = np.where(rng.random(len(user)) < 2 / 3, own, rng.integers(0, classes, len(user)))
    x = (centres[y] + rng.standard_normal((len(user), features))).astype(np.float32)
    out = {"x": x, "y": y.astype(np.int64), "user": np.array([f"u{i}" for i in user])}
    if owners is not None:
        out["owner"] = np.asarray(owners, dtype=np.int64)[user]
    return out


def write_npz(path: Path, sizes: list[int], owners: list[int] | None = None, **kw) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **natural_arrays(sizes, owners, **kw))
    return path
