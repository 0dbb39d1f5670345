"""Reading some records' features without the others' (a block of owners' records on a Flower
SuperNode, ``engine_opts.owners_per_node``; docs/engines.md#multi-node).

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

import numpy as np

from fedudp.data.columnar import _existing, _load_npz, _missing_column, _npz_column, _wanted
from fedudp.data.records import Records, _features, from_arrays

__all__ = ["RowReader", "npz_rows", "read_npz_plan"]


@dataclass
class RowReader:
    """Rows of one features array in a file, read on demand.

    Attributes
    ----------
    path : str
        The file (named in errors).
    array : numpy.ndarray
        A read-only memory map of the array (or, for a compressed member, the array).
    mapped : bool
        True: ``array`` is a memory map and reading rows touches only those rows' bytes.
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
        return _features(np.asarray(self.array[np.asarray(idx, dtype=np.int64)]), self.path)


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
    from fedudp.data.columnar import _declared

    p = _existing(path, "write it with np.savez(path, x=..., y=..., user=...)")
    with _load_npz(p) as npz:
        present = list(npz.files)
        for column, key in _wanted(features, label, user, owner, meta):
            if column not in present:
                raise _missing_column(p, column, present, key)
        cols = {
            name: _npz_column(npz, p, name)
            for name, _ in _wanted(features, label, user, owner, meta)
            if name != features
        }
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
