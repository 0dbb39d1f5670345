"""CIFAR-10 and CIFAR-100 from their published "python version" pickles.

Krizhevsky's pages (https://www.cs.toronto.edu/~kriz/cifar.html) ship two tarballs whose folders
this module reads:

* ``cifar-10-batches-py/``: ``data_batch_1`` .. ``data_batch_5`` (train) and ``test_batch``;
  each a pickled dict with bytes keys: ``b"data"``, uint8 ``[n, 3072]`` (each row one 32x32
  colour image: the 1024 red values, then the green, then the blue, each plane row by row), and
  ``b"labels"``, n ints in [0, 10).
* ``cifar-100-python/``: ``train`` and ``test``; ``b"data"`` as above, ``b"fine_labels"`` in
  [0, 100) and ``b"coarse_labels"`` in [0, 20).

Records: x float32 ``[N, 3, 32, 32]`` = pixel / 255 in [0, 1] (no mean/std normalisation), y
int64, records in file order (batches 1..5 then the test batch). CIFAR has no natural users:
the readers give every record its own user (user = record index, owners None); form real users
with ``users_by_rule`` (a seeded shuffle into users of ``records_per_user`` records, or a
label-skewed Dirichlet rule) and then group them with ``group_users``.

The pickles are read by an unpickler that only builds plain containers and numpy arrays (no
other global is allowed), so a tampered file cannot run code. Errors are ``DataError`` with a
one-line message naming the file or folder.
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from fedudp.data.readers import ReadRequest, register
from fedudp.data.records import Records, from_arrays, users_by_rule
from fedudp.errors import DataError

__all__ = ["read_cifar10", "read_cifar100", "users_by_rule"]

CIFAR10_DIR = "cifar-10-batches-py"
CIFAR100_DIR = "cifar-100-python"
PIXELS = 3 * 32 * 32

# (module, name) pairs a CIFAR pickle may name: numpy's array reconstruction and, in the
# Python 2 protocol, bytes decoding. "numpy.core" is numpy 1's name for numpy 2's "numpy._core".
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),
}


class _SafeUnpickler(pickle.Unpickler):
    """Builds only containers, scalars and numpy arrays (the globals in ``_ALLOWED``)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR file")
        if module.startswith("numpy.core."):
            try:
                return getattr(importlib.import_module("numpy._core" + module[10:]), name)
            except ImportError:  # numpy 1: numpy.core is the real module
                pass
        return getattr(importlib.import_module(module), name)


def _folder(root: str | Path, name: str, files: list[str]) -> Path:
    """``<root>/<name>`` or, when it holds the files itself, ``root``."""
    root = Path(root)
    for folder in (root / name, root):
        if all((folder / f).is_file() for f in files):
            return folder
    tarball = "CIFAR-10" if name == CIFAR10_DIR else "CIFAR-100"
    raise DataError(
        f"{root / name}: no {tarball} python-version files ({', '.join(files)}); "
        f"download the {tarball} python version tarball from "
        f"https://www.cs.toronto.edu/~kriz/cifar.html and unpack it in {root} "
        f"(tar xzf ... -C {root} makes {root / name}/)"
    )


def _unpickle(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            obj = _SafeUnpickler(f, encoding="bytes").load()
    except (
        OSError,
        EOFError,
        pickle.UnpicklingError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
    ) as e:
        raise DataError(
            f"{path}: not a readable CIFAR python pickle ({e})".replace("\n", " ")
        ) from e
    if not isinstance(obj, dict):
        raise DataError(f"{path}: not a CIFAR batch (expected a pickled dict)")
    return obj


def _batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 images [n, 3, 32, 32], int64 labels [n]) of one pickled batch."""
    obj = _unpickle(path)
    for key in (b"data", label_key):
        if key not in obj:
            keys = ", ".join(repr(k) for k in obj)
            raise DataError(f"{path}: no key {key!r} (keys present: {keys})")
    data, labels = np.asarray(obj[b"data"]), np.asarray(obj[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != PIXELS:
        raise DataError(
            f"{path}: b'data' must be uint8 [n, {PIXELS}], got {data.dtype} {list(data.shape)}"
        )
    if labels.ndim != 1 or len(labels) != len(data) or labels.dtype.kind not in "iu":
        raise DataError(
            f"{path}: {label_key!r} must be {len(data)} integer labels, got "
            f"{labels.dtype} {list(labels.shape)}"
        )
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _records(folder: Path, files: list[str], label_key: bytes, classes: int) -> Records:
    parts = [_batch(folder / f, label_key) for f in files]
    x = np.concatenate([p[0] for p in parts]).astype(np.float32)
    x /= np.float32(255)
    y = np.concatenate([p[1] for p in parts])
    where = str(folder / files[0]) if len(files) == 1 else f"{folder}/{{{','.join(files)}}}"
    return from_arrays(x, y, np.arange(len(y), dtype=np.int64), classes=classes, source=where)


def read_cifar10(root: str | Path) -> tuple[Records, Records]:
    """(train, test) CIFAR-10 ``Records`` from ``<root>/cifar-10-batches-py/`` (or ``root``).

    Parameters
    ----------
    root
        The folder holding the python version of CIFAR-10 (or its ``cifar-10-batches-py``).

    Returns
    -------
    tuple of Records
        x float32 ``[N, 3, 32, 32]`` in [0, 1], y int64 in [0, 10), one user per record.

    Raises
    ------
    DataError
        The batches are not found under ``root``.
    """
    train = [f"data_batch_{i}" for i in range(1, 6)]
    folder = _folder(root, CIFAR10_DIR, train + ["test_batch"])
    return (_records(folder, train, b"labels", 10), _records(folder, ["test_batch"], b"labels", 10))


def read_cifar100(
    root: str | Path, labels: Literal["fine", "coarse"] = "fine"
) -> tuple[Records, Records]:
    """(train, test) CIFAR-100 ``Records`` from ``<root>/cifar-100-python/`` (or ``root``).

    Parameters
    ----------
    root
        The folder holding the python version of CIFAR-100 (or its ``cifar-100-python``).
    labels
        ``"fine"``: the 100 classes (``b"fine_labels"``); ``"coarse"``: the 20 superclasses
        (``b"coarse_labels"``).

    Returns
    -------
    tuple of Records
        x float32 ``[N, 3, 32, 32]`` in [0, 1], one user per record.

    Raises
    ------
    DataError
        The files are not found under ``root``.
    """
    if labels not in ("fine", "coarse"):
        raise ValueError(f"labels must be 'fine' or 'coarse', got {labels!r}")
    key, classes = (b"fine_labels", 100) if labels == "fine" else (b"coarse_labels", 20)
    folder = _folder(root, CIFAR100_DIR, ["train", "test"])
    return (_records(folder, ["train"], key, classes), _records(folder, ["test"], key, classes))


def _reader(name: str) -> Callable[[ReadRequest], tuple[Records, Records | None]]:
    """``dataset.name=cifar10|cifar100``: CIFAR has no users: the training records are cut into
    users by ``partition.user_rule`` (seeded); the test batch's records belong to no user."""

    def read(request: ReadRequest) -> tuple[Records, Records | None]:
        if name == "cifar10":
            train, test = read_cifar10(request.root)
        else:
            train, test = read_cifar100(request.root, labels="coarse" if request.coarse else "fine")
        train = users_by_rule(
            train,
            cast(Literal["shuffle", "dirichlet"], request.user_rule),  # partition.user_rule
            records_per_user=request.records_per_user,
            seed=request.seed,
            alpha=request.dirichlet_alpha if request.user_rule == "dirichlet" else None,
        )
        return train, test

    return read


def _inputs(request: ReadRequest) -> tuple[tuple[int, ...], int, bool]:
    classes = 10 if request.name == "cifar10" else (20 if request.coarse else 100)
    return (3, 32, 32), classes, False


register("cifar10", _reader("cifar10"), inputs=_inputs, test_without_users=True)
register("cifar100", _reader("cifar100"), inputs=_inputs, test_without_users=True)
