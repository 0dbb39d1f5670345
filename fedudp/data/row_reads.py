"""Reading some records' features without the others' (a block of owners' records on a Flower
SuperNode, ``engine_opts.owners_per_node``; docs/engines.md, "Multi-node").

The plan of a natural federation (which user goes to which owner, which record to which
user) needs the labels, users, owners and metadata columns only; ``read_npz_plan`` reads
those and stands a record index in for each record's features (``Records.x`` is
``arange(N)``), so that the grouping and the layout carry the indices along; the features of
the records a block holds are then read by row (``RowReader``): an uncompressed ``.npz``
member is memory-mapped at its offset in the archive and only the asked rows are touched; a
compressed member cannot be read by row and is decompressed whole (then only the asked rows
are kept).
"""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from fedudp.data.columnar import (
    _declared,
    _existing,
    _load_npz,
    _missing_column,
    _npz_column,
    _npz_columns,
    _parquet_features,
    _parquet_ids,
    _pyarrow,
    _schema_names,
    _wanted,
)
from fedudp.data.records import Records, _features, from_arrays

__all__ = ["RowReader", "npz_rows", "read_npz_plan", "ParquetRows", "read_parquet_plan"]


@dataclass
class RowReader:
    """Rows of one features array in a file, read on demand.

    Attributes
    ----------
    path : str
        The file (named in errors).
    array : numpy.ndarray or ParquetRows
        A read-only memory map of the array (for a compressed member, the array; for Parquet,
        the file's row groups).
    mapped : bool
        True: reading rows touches only those rows' bytes (Parquet: their row groups').
    """

    path: str
    array: np.ndarray
    mapped: bool

    def rows(self, idx: np.ndarray) -> np.ndarray:
        """The features of records ``idx``, in that order, converted as ``from_arrays`` does.

        Parameters
        ----------
        idx : numpy.ndarray
            int64 record indices.

        Returns
        -------
        numpy.ndarray
            float32 or int64 features ``[len(idx), ...]``.
        """
        got = np.array(self.array[np.asarray(idx, dtype=np.int64)])  # a writable copy
        return np.require(_features(got, self.path), requirements=["W", "C"])


def npz_rows(path: str | Path, name: str) -> RowReader:
    """A ``RowReader`` for the array ``name`` of an ``.npz`` archive.

    Parameters
    ----------
    path : str or Path
        The archive (``np.savez`` stores members uncompressed, ``np.savez_compressed`` not).
    name : str
        The member's array name (without ``.npy``).

    Returns
    -------
    RowReader
        Memory-mapped for an uncompressed member.
    """
    p = Path(path)
    with zipfile.ZipFile(p) as z:
        info = z.getinfo(name + ".npy")
        stored = info.compress_type == zipfile.ZIP_STORED
        offset = info.header_offset
    if not stored:
        with _load_npz(p) as npz:
            return RowReader(str(p), _npz_column(npz, p, name), False)
    with open(p, "rb") as f:
        f.seek(offset)
        local = f.read(30)  # the member's local file header
        n_name, n_extra = struct.unpack("<HH", local[26:30])
        f.seek(offset + 30 + n_name + n_extra)
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        start = f.tell()
    if dtype.hasobject:  # an object array needs pickle, which stays off
        with _load_npz(p) as npz:
            _npz_column(npz, p, name)
    mm = np.memmap(
        p, dtype=dtype, mode="r", offset=start, shape=shape, order="F" if fortran else "C"
    )
    return RowReader(str(p), mm, True)


def read_npz_plan(
    path: str | Path,
    *,
    features: str = "x",
    label: str = "y",
    user: str = "user",
    owner: str | None = None,
    meta: Sequence[str] = (),
    classes: int | None = None,
) -> tuple[Records, RowReader]:
    """An ``.npz`` archive's records without their features: ``x`` is each record's index
    (``read_npz``'s columns and checks otherwise), and a ``RowReader`` of the features.

    Parameters
    ----------
    path, features, label, user, owner, meta, classes
        As ``fedudp.data.columnar.read_npz``.

    Returns
    -------
    tuple of (Records, RowReader)
        The records (``x``: int64 record indices) and their features by row.

    Raises
    ------
    DataError
        As ``read_npz``.
    """
    p = _existing(path, "write it with np.savez(path, x=..., y=..., user=...)")
    cols = _npz_columns(p, features, label, user, owner, meta, load_features=False)
    rows = npz_rows(p, features)
    n = int(rows.array.shape[0]) if rows.array.ndim else 0
    recs = from_arrays(
        np.arange(n, dtype=np.int64),
        cols[label],
        cols[user],
        None if owner is None else cols[owner],
        _declared(classes, p),
        meta={m: cols[m] for m in meta},
        source=str(p),
    )
    return recs, rows


class ParquetRows:
    """A Parquet file's features, read by row: only the row groups that hold the asked rows,
    and only the feature columns (``fedudp.data.columnar.read_parquet``'s features).

    Parameters
    ----------
    path : Path
        The Parquet file.
    features : str or sequence of str
        One list column, or scalar columns stacked into ``[N, F]``.
    """

    def __init__(self, path: Path, features: str | Sequence[str]) -> None:
        _pa, _pc, pq = _pyarrow()
        self.path, self.features = path, features
        self.file = pq.ParquetFile(path)
        sizes = [self.file.metadata.row_group(i).num_rows for i in range(self.file.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.shape = (int(self.starts[-1]),)
        self.ndim = 1

    def __getitem__(self, idx: np.ndarray) -> np.ndarray:
        pa, pc, _pq = _pyarrow()
        idx = np.asarray(idx, dtype=np.int64)
        cols = [self.features] if isinstance(self.features, str) else list(self.features)
        group = np.searchsorted(self.starts, idx, side="right") - 1
        wanted = np.unique(group)
        table = self.file.read_row_groups([int(g) for g in wanted], columns=cols)
        sizes = np.diff(self.starts)[wanted]
        base = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        pos = base[np.searchsorted(wanted, group)] + idx - self.starts[group]
        return _parquet_features(pa, pc, table.take(pa.array(pos)), self.path, self.features)


def read_parquet_plan(
    path: str | Path,
    *,
    features: str | Sequence[str] = "x",
    label: str = "y",
    user: str = "user",
    owner: str | None = None,
    meta: Sequence[str] = (),
    classes: int | None = None,
) -> tuple[Records, RowReader]:
    """A Parquet file's records without their features (``x``: each record's index; only the
    id and label columns are read) and a ``RowReader`` of the features by row group.

    Parameters
    ----------
    path, features, label, user, owner, meta, classes
        As ``fedudp.data.columnar.read_parquet``.

    Returns
    -------
    tuple of (Records, RowReader)
        The records (``x``: int64 record indices) and their features by row.

    Raises
    ------
    DataError
        As ``read_parquet``.
    """
    _pa, _pc, pq = _pyarrow()
    p = _existing(path, "write it with pyarrow.parquet.write_table")
    present = _schema_names(pq, p)
    wanted = _wanted(features, label, user, owner, meta)
    for column, key in wanted:
        if column not in present:
            raise _missing_column(p, column, present, key)
    names = list(dict.fromkeys([label, user, *([] if owner is None else [owner]), *meta]))
    table = pq.read_table(p, columns=names)
    ids = {name: _parquet_ids(table, p, name) for name in names}
    recs = from_arrays(
        np.arange(table.num_rows, dtype=np.int64),
        ids[label],
        ids[user],
        None if owner is None else ids[owner],
        _declared(classes, p),
        meta={m: ids[m] for m in meta},
        source=str(p),
    )
    return recs, RowReader(str(p), cast(Any, ParquetRows(p, features)), True)
