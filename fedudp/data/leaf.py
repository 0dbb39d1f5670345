"""FEMNIST and Shakespeare in LEAF's published JSON format, with their natural users.

LEAF (Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018;
github.com/TalwalkarLab/leaf) writes each data set as a folder with ``train/`` and ``test/``
subfolders of ``*.json`` files. Each file is one object::

    {"users": [u1, u2, ...], "num_samples": [n1, n2, ...],
     "user_data": {u1: {"x": [...], "y": [...]}, ...}}

(some files also carry "hierarchies", which is accepted and ignored). A user appears in one file
of a split. With LEAF's ``preprocess.sh -t sample`` every user's records are split between train
and test (the same user ids in both); with ``-t user`` whole users go to train or to test.

* FEMNIST: users are writers; ``x`` is 784 floats in [0, 1] (a 28x28 grey image flattened row by
  row, pixel / 255 as LEAF wrote it: the background is near 1, the ink near 0); ``y`` is in
  [0, 62) (digits 0-9, then upper-case, then lower-case letters). Records: x float32
  ``[N, 1, 28, 28]`` unchanged (no inversion or normalisation), y int64, 62 classes.
* Shakespeare: users are speaking roles (play and character); ``x`` is an 80-character string
  and ``y`` the single next character. Characters map to their position in LEAF's 80-character
  vocabulary ``VOCAB``. Records: x int64 ``[N, 80]`` token ids, y int64, 80 classes.

User ids are LEAF's strings, records are kept in file order (files sorted by name, users in each
file's "users" order). Errors are ``DataError`` with a one-line message naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedudp.data.readers import fixed_inputs, register
from fedudp.data.records import Records, from_arrays
from fedudp.errors import DataError

__all__ = ["VOCAB", "FEMNIST_CLASSES", "read_femnist", "read_shakespeare"]

# LEAF's Shakespeare character vocabulary (its utils' ALL_LETTERS): newline, space, 23
# punctuation marks and digits, A-Z, '[', ']', a-z and '}'. A character's id is its index here.
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
assert len(VOCAB) == 80 and len(set(VOCAB)) == 80
CHAR_ID = {c: i for i, c in enumerate(VOCAB)}
_CODE_ORDER = np.argsort([ord(c) for c in VOCAB]).astype(np.int64)  # ids by code point
_SORTED_CODES = np.array([ord(VOCAB[i]) for i in _CODE_ORDER], dtype=np.uint32)
SEQ_LEN = 80
FEMNIST_CLASSES = 62
FEMNIST_PIXELS = 784

Convert = Callable[[Path, str, list, list], tuple[np.ndarray, np.ndarray]]


def _split_dir(root: Path, split: str, name: str, flags: str) -> list[Path]:
    folder = root / split
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise DataError(
            f"{folder}: no LEAF {name} *.json files; get LEAF from github.com/TalwalkarLab/leaf, "
            f"run data/{name.lower()}/preprocess.sh ({flags} -t user for a user-level split, or "
            f"-t sample to split each user's records) and copy data/{name.lower()}/data/train "
            f"and .../test to {root}/train/*.json and {root}/test/*.json"
        )
    return files


def _load(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable LEAF JSON file ({type(e).__name__})") from e
    if not isinstance(obj, dict) or not {"users", "user_data"} <= obj.keys():
        raise DataError(f"{path}: not a LEAF file (needs the keys 'users' and 'user_data')")
    return obj


def _user_lists(path: Path, obj: dict, user: str, i: int) -> tuple[list, list]:
    data = obj["user_data"].get(user)
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("x"), list)
        or not isinstance(data.get("y"), list)
    ):
        raise DataError(f"{path}: user {user!r} has no 'x' and 'y' lists in 'user_data'")
    if len(data["x"]) != len(data["y"]):
        raise DataError(f"{path}: user {user!r} has {len(data['x'])} x and {len(data['y'])} y")
    counts = obj.get("num_samples")
    if isinstance(counts, list) and i < len(counts) and counts[i] != len(data["y"]):
        raise DataError(
            f"{path}: user {user!r} has {len(data['y'])} records but num_samples says {counts[i]}"
        )
    return data["x"], data["y"]


def _read_split(
    root: Path, split: str, name: str, flags: str, convert: Convert, classes: int
) -> Records:
    xs, ys, users = [], [], []
    seen: dict[str, str] = {}
    for path in _split_dir(root, split, name, flags):
        obj = _load(path)
        for i, user in enumerate(obj["users"]):
            user = str(user)
            if user in seen:
                raise DataError(
                    f"{path}: user {user!r} is also in {seen[user]}; a user must be "
                    f"in one file of a split (two copies of the data in one folder?)"
                )
            seen[user] = path.name
            x, y = convert(path, user, *_user_lists(path, obj, user, i))
            xs.append(x)
            ys.append(y)
            users.append(np.full(len(y), user))
    if not ys:
        raise DataError(f"{root / split}: the LEAF files there list no users")
    return from_arrays(
        np.concatenate(xs),
        np.concatenate(ys),
        np.concatenate(users),
        classes=classes,
        source=str(root / split),
    )


def _labels(path: Path, user: str, y: list, classes: int) -> np.ndarray:
    try:
        out = np.asarray(y, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as e:
        raise DataError(f"{path}: user {user!r} has labels that are not integers") from e
    if out.ndim != 1 or ((out < 0) | (out >= classes)).any():
        raise DataError(f"{path}: user {user!r} has labels outside [0, {classes})")
    return out


# ---------------------------------------------------------------------------------- FEMNIST


def _femnist_user(path: Path, user: str, x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
    try:
        img = (
            np.asarray(x, dtype=np.float32).reshape(len(x), -1)
            if x
            else np.zeros((0, FEMNIST_PIXELS), np.float32)
        )
    except (TypeError, ValueError) as e:
        raise DataError(
            f"{path}: user {user!r} has images that are not lists of {FEMNIST_PIXELS} numbers"
        ) from e
    if img.shape[1] != FEMNIST_PIXELS:
        raise DataError(
            f"{path}: user {user!r} has images of {img.shape[1]} values, expected "
            f"{FEMNIST_PIXELS} (28x28)"
        )
    if not ((img >= 0) & (img <= 1)).all():
        raise DataError(
            f"{path}: user {user!r} has pixel values outside [0, 1] (LEAF writes pixel / 255)"
        )
    return img.reshape(-1, 1, 28, 28), _labels(path, user, y, FEMNIST_CLASSES)


def read_femnist(root: str | Path) -> tuple[Records, Records]:
    """(train, test) FEMNIST ``Records`` from ``<root>/train/*.json`` and ``<root>/test/*.json``.

    Parameters
    ----------
    root
        The folder holding LEAF's ``train/`` and ``test/`` json files.

    Returns
    -------
    tuple of Records
        x float32 ``[N, 1, 28, 28]`` in [0, 1] as LEAF wrote it, y int64 in [0, 62), users the
        writers' LEAF ids (str), owners None.

    Raises
    ------
    DataError
        No json files under ``root``, or a file that is not LEAF's format.
    """
    root = Path(root)
    flags = "e.g. ./preprocess.sh -s niid --sf 1.0 -k 0"
    return tuple(
        _read_split(root, s, "FEMNIST", flags, _femnist_user, FEMNIST_CLASSES)
        for s in ("train", "test")
    )  # type: ignore[return-value]


# ------------------------------------------------------------------------------ Shakespeare


def _unknown_id(unknown: str) -> int | None:
    if unknown == "error":
        return None
    if len(unknown) != 1 or unknown not in CHAR_ID:
        raise ValueError(f"unknown must be 'error' or one character of VOCAB, got {unknown!r}")
    return CHAR_ID[unknown]


def _texts(path: Path, user: str, texts: list, length: int, what: str) -> str:
    """The user's strings joined, after checking each is a str of ``length`` characters."""
    if not all(isinstance(t, str) and len(t) == length for t in texts):
        raise DataError(
            f"{path}: user {user!r} has {what} that is not a string of {length} "
            f"character{'s' * (length > 1)}"
        )
    return "".join(texts)


def _encode(path: Path, user: str, text: str, fallback: int | None) -> np.ndarray:
    """int64 vocabulary ids of ``text``'s characters (unknown ones: ``fallback`` or an error)."""
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
    pos = np.searchsorted(_SORTED_CODES, codes).clip(max=len(VOCAB) - 1)
    known = _SORTED_CODES[pos] == codes
    if not known.all():
        bad = chr(int(codes[np.argmin(known)]))
        if fallback is None:
            raise DataError(
                f"{path}: user {user!r} has the character {bad!r} "
                f"(U+{ord(bad):04X}) outside LEAF's 80-character vocabulary; pass "
                f"unknown=' ' to map such characters to a space"
            )
    return np.where(known, _CODE_ORDER[pos], -1 if fallback is None else fallback)


def _shakespeare_converter(fallback: int | None) -> Convert:
    def convert(path: Path, user: str, x: list, y: list) -> tuple[np.ndarray, np.ndarray]:
        inputs = _texts(path, user, x, SEQ_LEN, "an input")
        targets = _texts(path, user, y, 1, "a target")
        return (
            _encode(path, user, inputs, fallback).reshape(len(x), SEQ_LEN),
            _encode(path, user, targets, fallback),
        )

    return convert


def read_shakespeare(root: str | Path, *, unknown: str = "error") -> tuple[Records, Records]:
    """(train, test) Shakespeare ``Records`` from ``<root>/train/*.json`` and ``<root>/test/``.

    Parameters
    ----------
    root
        The folder holding LEAF's ``train/`` and ``test/`` json files.
    unknown
        ``"error"`` (the default): a character outside LEAF's vocabulary ``VOCAB`` is an error;
        one character of ``VOCAB`` (e.g. ``" "``): every such character gets that character's id.

    Returns
    -------
    tuple of Records
        x int64 ``[N, 80]`` and y int64 ``[N]``: ids in ``VOCAB`` (80 classes); users LEAF's role
        ids (str), owners None.

    Raises
    ------
    ValueError
        ``unknown`` neither ``"error"`` nor one character of ``VOCAB``.
    DataError
        A character outside ``VOCAB`` with ``unknown="error"`` (naming the file, user and
        character), or files that are not LEAF's format.
    """
    root, fallback = Path(root), _unknown_id(unknown)
    flags = "e.g. ./preprocess.sh -s niid --sf 1.0 -k 0"
    convert = _shakespeare_converter(fallback)
    return tuple(
        _read_split(root, s, "Shakespeare", flags, convert, len(VOCAB)) for s in ("train", "test")
    )  # type: ignore[return-value]


register(
    "femnist",
    lambda request: read_femnist(request.root),
    inputs=fixed_inputs((1, 28, 28), FEMNIST_CLASSES),
)
register(
    "shakespeare",
    lambda request: read_shakespeare(request.root, unknown=request.unknown_char or "error"),
    inputs=fixed_inputs((SEQ_LEN,), len(VOCAB), tokens=True),
)
