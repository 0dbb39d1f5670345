"""A researcher's own federation from one columnar file: NumPy ``.npz`` or Apache Parquet.

Each file holds one split (train or test), one row per record, with named columns:

* features: in ``.npz`` one array ``[N, ...]``; in Parquet either one list column (each cell an
  array; nested lists give more dimensions, e.g. ``list<list<float>>`` for ``[N, 28, 28]``;
  every cell must have the same shape) or several numeric scalar columns, given as a list of
  names and stacked in that order into ``[N, F]``;
* the label: integers in ``[0, classes)``, ``classes`` passed by the caller (public: it fixes
  the model's output width, so it is declared, never read from the labels; a label outside is a
  ``DataError`` naming the file);
* the user id of each record: integers or strings (the privacy unit; never split);
* optionally the owner id of each record (a user must have one owner), and extra metadata
  columns (``meta``) kept in ``Records.meta`` (e.g. to group users with
  ``group_users(records, "column", column=...)``).

Float features become float32, integer features int64 (token ids). ``.npz`` files are read with
``allow_pickle=False``: save string ids as a str array (``np.asarray(ids, dtype=str)``), not an
object array. Parquet needs pyarrow (``pip install 'fedudp[parquet]'``).

Errors are ``DataError`` with a one-line message naming the file (and the column).
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedudp.data.readers import ReadRequest, register
from fedudp.data.records import Records, from_arrays
from fedudp.errors import ConfigError, DataError

__all__ = ["read_npz", "read_parquet", "MissingDependency"]


class MissingDependency(DataError, ImportError):
    """An optional package a reader needs is not installed (the message says what to install).

    Raised with one message, as ``ImportError`` is.
    """


def _existing(path: str | Path, how: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: no such file; {how}")
    return p


def _declared(classes: int | None, path: Path | str) -> int:
    """The caller's declared number of classes (never inferred from the labels)."""
    if classes is None:
        raise DataError(
            f"{path}: pass classes=<the number of classes> (public, declared: "
            "fedudp does not infer it from the labels)"
        )
    return classes


def _missing_column(path: Path, column: str, present: Sequence[str], key: str) -> DataError:
    listed = ", ".join(present) or "none"
    return DataError(
        f"{path}: no column {column!r} (columns present: {listed}); pass {key}='<column>'"
    )


def _wanted(
    features: str | Sequence[str], label: str, user: str, owner: str | None, meta: Sequence[str]
) -> list[tuple[str, str]]:
    """(column, argument name) pairs to read, features first."""
    feats = [features] if isinstance(features, str) else list(features)
    pairs = [(f, "features") for f in feats] + [(label, "label"), (user, "user")]
    pairs += [] if owner is None else [(owner, "owner")]
    return pairs + [(m, "meta") for m in meta]


# ------------------------------------------------------------------------------------- npz


def _load_npz(path: Path) -> Any:
    try:
        return np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable .npz archive ({e})") from e


def _npz_column(npz: Any, path: Path, name: str) -> np.ndarray:
    try:
        return npz[name]
    except ValueError as e:  # an object array needs pickle, which stays off
        raise DataError(
            f"{path}: column {name!r} is an object array; save it as a numeric or "
            f"str array (np.asarray(values, dtype=str))"
        ) from e


def _npz_columns(
    p: Path,
    features: str,
    label: str,
    user: str,
    owner: str | None,
    meta: Sequence[str],
    load_features: bool = True,
) -> dict[str, np.ndarray]:
    """The archive's wanted columns, each checked (a missing one named); the features only
    with ``load_features``."""
    with _load_npz(p) as npz:
        present = list(npz.files)
        for column, key in _wanted(features, label, user, owner, meta):
            if column not in present:
                raise _missing_column(p, column, present, key)
        return {
            name: _npz_column(npz, p, name)
            for name, _ in _wanted(features, label, user, owner, meta)
            if load_features or name != features
        }


def read_npz(
    path: str | Path,
    *,
    features: str = "x",
    label: str = "y",
    user: str = "user",
    owner: str | None = None,
    meta: Sequence[str] = (),
    classes: int | None = None,
) -> Records:
    """``Records`` from a ``.npz`` archive written by ``np.savez``/``np.savez_compressed``.

    Parameters
    ----------
    path
        The archive.
    features, label, user, owner, meta
        The names of the archive's arrays: the features, the integer labels, the user id of each
        record, optionally the owner id of each record and extra per-record id columns.
    classes
        The declared number of classes (required).

    Returns
    -------
    Records
        The archive's records, checked as in ``Records``.

    Raises
    ------
    DataError
        A missing array or ``classes``, or arrays that do not describe records (one line naming
        the file and the array).
    """
    p = _existing(path, "write it with np.savez(path, x=..., y=..., user=...)")
    cols = _npz_columns(p, features, label, user, owner, meta)
    return from_arrays(
        cols[features],
        cols[label],
        cols[user],
        None if owner is None else cols[owner],
        _declared(classes, p),
        meta={m: cols[m] for m in meta},
        source=str(p),
    )


# ---------------------------------------------------------------------------------- parquet


def _pyarrow() -> tuple[Any, Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingDependency(
            "read_parquet needs pyarrow, which is not installed: pip install 'fedudp[parquet]'"
        ) from e
    return pa, pc, pq


def _schema_names(pq: Any, path: Path) -> list[str]:
    try:
        return list(pq.read_schema(path).names)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a non-Parquet file
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__})") from e


def _list_cells(pa: Any, pc: Any, arr: Any, path: Path, name: str) -> tuple[Any, list[int]]:
    """Peel list levels off ``arr``: (the flat values, the per-cell shape)."""
    shape: list[int] = []
    n = len(arr)
    while (
        pa.types.is_list(arr.type)
        or pa.types.is_large_list(arr.type)
        or pa.types.is_fixed_size_list(arr.type)
    ):
        if arr.null_count:
            raise DataError(f"{path}: column {name!r} has empty (null) cells")
        lengths = np.unique(pc.list_value_length(arr).to_numpy(zero_copy_only=False))
        if len(lengths) > 1:
            raise DataError(
                f"{path}: column {name!r} has cells of different lengths "
                f"({int(lengths[0])} and {int(lengths[1])}); every record's "
                f"features must have one shape"
            )
        shape.append(int(lengths[0]) if len(lengths) else 0)
        arr = arr.flatten()
    if n and len(arr) != n * int(np.prod(shape)):
        raise DataError(f"{path}: column {name!r} has cells of different shapes")
    return arr, shape


def _numeric(pa: Any, arr: Any, path: Path, name: str) -> np.ndarray:
    if not (
        pa.types.is_integer(arr.type)
        or pa.types.is_floating(arr.type)
        or pa.types.is_boolean(arr.type)
    ):
        raise DataError(f"{path}: column {name!r} must be numeric, got {arr.type}")
    if arr.null_count:
        raise DataError(f"{path}: column {name!r} has missing (null) values")
    return arr.to_numpy(zero_copy_only=False)


def _parquet_features(
    pa: Any, pc: Any, table: Any, path: Path, features: str | Sequence[str]
) -> np.ndarray:
    if isinstance(features, str):
        arr = table.column(features).combine_chunks()
        values, shape = _list_cells(pa, pc, arr, path, features)
        return _numeric(pa, values, path, features).reshape(len(arr), *shape)
    cols = []
    for name in features:
        arr = table.column(name).combine_chunks()
        if not (
            pa.types.is_integer(arr.type)
            or pa.types.is_floating(arr.type)
            or pa.types.is_boolean(arr.type)
        ):
            raise DataError(
                f"{path}: feature column {name!r} must be a numeric scalar column, got {arr.type}"
            )
        cols.append(_numeric(pa, arr, path, name))
    return np.stack(cols, axis=1) if cols else np.zeros((table.num_rows, 0), np.float32)


def _parquet_ids(table: Any, path: Path, name: str) -> np.ndarray:
    arr = table.column(name).combine_chunks()
    if arr.null_count:
        raise DataError(f"{path}: column {name!r} has missing (null) values")
    return arr.to_numpy(zero_copy_only=False)


def read_parquet(
    path: str | Path,
    *,
    features: str | Sequence[str] = "x",
    label: str = "y",
    user: str = "user",
    owner: str | None = None,
    meta: Sequence[str] = (),
    classes: int | None = None,
) -> Records:
    """``Records`` from a Parquet file (one row per record).

    Parameters
    ----------
    path
        The Parquet file.
    features
        One list column (each cell an array, nested lists allowed) or a list of scalar column
        names stacked into ``[N, F]``.
    label, user, owner, meta
        Scalar columns: the integer labels, the user id of each record, optionally the owner id
        and extra per-record id columns.
    classes
        The declared number of classes (required).

    Returns
    -------
    Records
        The file's records, checked as in ``Records``.

    Raises
    ------
    MissingDependency
        pyarrow is not installed (``pip install 'fedudp[parquet]'``); a ``DataError`` and an
        ``ImportError``.
    DataError
        A missing column or ``classes``, or columns that do not describe records.
    """
    pa, pc, pq = _pyarrow()
    p = _existing(path, "write it with pyarrow.parquet.write_table")
    present = _schema_names(pq, p)
    wanted = _wanted(features, label, user, owner, meta)
    for column, key in wanted:
        if column not in present:
            raise _missing_column(p, column, present, key)
    table = pq.read_table(p, columns=list(dict.fromkeys(c for c, _ in wanted)))
    x = _parquet_features(pa, pc, table, p, features)
    ids = {
        name: _parquet_ids(table, p, name)
        for name in [label, user, *([] if owner is None else [owner]), *meta]
    }
    return from_arrays(
        x,
        ids[label],
        ids[user],
        None if owner is None else ids[owner],
        _declared(classes, p),
        meta={m: ids[m] for m in meta},
        source=str(p),
    )


def _reader(name: str) -> Callable[[ReadRequest], tuple[Records, Records | None]]:
    """``dataset.name=npz|parquet``: the training records of ``dataset.path`` and, where given,
    the test records of ``dataset.test_path`` (same columns)."""
    # npz takes one features array (checked below), parquet one or several columns
    read_file: Callable[..., Records] = read_npz if name == "npz" else read_parquet

    def read(request: ReadRequest) -> tuple[Records, Records | None]:
        if not request.path:
            raise ConfigError(
                f"dataset.path: dataset.name={name} reads the records of a file; "
                "set dataset.path=<file>"
            )
        if name == "npz" and not isinstance(request.features, str):
            raise ConfigError(
                "dataset.columns.x: an NPZ file holds the features as one array; "
                "name it (a list of columns is for parquet and hf)"
            )

        def read_one(path: str) -> Records:
            return read_file(
                path,
                features=request.features,
                label=request.label,
                user=request.user,
                owner=request.owner,
                meta=tuple(request.meta),
                classes=request.classes,
            )

        test = read_one(request.test_path) if request.test_path else None
        return read_one(request.path), test

    return read


register("npz", _reader("npz"))
register("parquet", _reader("parquet"))
