"""A Hugging Face data set saved on this machine, its users found by flwr-datasets.

``read_hf(path)`` reads a folder written by ``datasets.Dataset.save_to_disk`` or
``datasets.DatasetDict.save_to_disk`` (loaded with ``datasets.load_from_disk``; nothing is
downloaded). To get one, on a machine with network run
``datasets.load_dataset(name).save_to_disk(path)`` and copy the folder here.

* Splits: a saved ``DatasetDict`` gives the training records from split ``split`` and the test
  records from ``test_split`` (None when the dict has no such split, or ``test_split=None``). A
  saved single ``Dataset`` is the training split, whatever its name; the test records are None.
* Users: the natural-id column ``user`` (int or str ids; the privacy unit, never split). Each
  split is partitioned as a Flower user partitions it, with flwr-datasets'
  ``NaturalIdPartitioner(partition_by=user)``: partition ``p`` holds the records of
  ``partitioner.partition_id_to_natural_id[p]`` (the distinct ids, sorted).
* Order: the records are laid out partition by partition (partition 0 first), each user's
  records in the split's row order: exactly the rows of ``partitioner.load_partition(0)``,
  ``load_partition(1)``, ... concatenated, as one flat array per column.
* Features (``features``):

  - an image column (``datasets.Image``, decoded to PIL images): float32 ``[N, C, H, W]`` in
    [0, 1] (8-bit modes ``L``/``LA``/``RGB``/``RGBA`` divided by 255, 16-bit ``I;16`` by 65535,
    mode ``1`` as 0/1; palette and other colour modes converted to RGB first). Every image must
    have the same mode-derived channel count and size;
  - a list/array column (``List``/``Sequence`` of numbers, nested for more dimensions, or
    ``Array2D``..``Array5D``): ``[N, ...]``, every cell of one shape;
  - one numeric scalar column: ``[N, 1]``; or several (a list of names): stacked in that order
    into ``[N, F]``.

  Float and bool features become float32, integer features int64 (token ids).
* Labels (``label``): a ``ClassLabel`` or an integer column. ``classes``: the argument if given,
  else the ``ClassLabel``'s number of names (the schema's declaration); an integer column needs
  the argument (never inferred from the labels); a label outside ``[0, classes)`` is a
  ``DataError``.
* ``owner`` (optional) and ``meta`` name scalar columns kept as ``Records.owner`` / ``.meta``.

Errors are ``DataError`` with a one-line message naming the folder (and split and column).
Needs ``datasets`` and ``flwr-datasets`` (``pip install 'fedudp[hf]'``), imported only when
``read_hf`` runs; without them a ``MissingDependency`` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedudp.data.columnar import MissingDependency
from fedudp.data.readers import ReadRequest, register
from fedudp.data.records import Records, from_arrays
from fedudp.errors import ConfigError, DataError

__all__ = ["read_hf"]

_HOW = (
    "on a machine with network run datasets.load_dataset(name).save_to_disk(path) and copy "
    "the folder here"
)
_IMAGE_SCALE = {
    "1": 1.0,
    "L": 255.0,
    "LA": 255.0,
    "RGB": 255.0,
    "RGBA": 255.0,
    "I;16": 65535.0,
    "I;16L": 65535.0,
    "I;16B": 65535.0,
    "I;16N": 65535.0,
}
_TO_RGB = {
    "P": "RGB",
    "PA": "RGBA",
    "CMYK": "RGB",
    "YCbCr": "RGB",
    "LAB": "RGB",
    "HSV": "RGB",
    "La": "LA",
    "RGBa": "RGBA",
    "RGBX": "RGB",
}


def _libs() -> tuple[Any, Any, Any]:
    """(datasets, NaturalIdPartitioner, pyarrow), imported on first use."""
    try:
        import datasets
        import pyarrow as pa
        import pyarrow.compute  # (pa.compute.list_value_length)
        from flwr_datasets.partitioner import NaturalIdPartitioner
    except ImportError as e:
        raise MissingDependency(
            "read_hf needs datasets and flwr-datasets, which are not "
            "installed: pip install 'fedudp[hf]'"
        ) from e
    return datasets, NaturalIdPartitioner, pa


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _load(datasets: Any, folder: Path) -> Any:
    if not folder.exists():
        raise DataError(
            f"{folder}: no such folder; read_hf reads a Hugging Face data set saved "
            f"on this machine: {_HOW}"
        )
    saved = ("dataset_dict.json", "state.json")
    if not folder.is_dir() or not any((folder / f).is_file() for f in saved):
        raise DataError(
            f"{folder}: not a data set saved by datasets' save_to_disk (no "
            f"dataset_dict.json or state.json); {_HOW}"
        )
    try:
        return datasets.load_from_disk(str(folder))
    except Exception as e:  # a damaged save: missing or unreadable .arrow files, bad json
        raise DataError(
            f"{folder}: not a readable saved data set ({_first_line(e)}); {_HOW}"
        ) from e


def _splits(
    datasets: Any, loaded: Any, folder: Path, split: str, test_split: str | None
) -> list[tuple[Any, str]]:
    """[(training Dataset, its name for messages), maybe (test Dataset, name)]."""
    if isinstance(loaded, datasets.Dataset):
        return [(loaded, str(folder))]
    present = list(loaded.keys())
    if split not in present:
        raise DataError(
            f"{folder}: no split {split!r} (splits present: "
            f"{', '.join(present) or 'none'}); pass split='<name>'"
        )
    out = [(loaded[split], f"{folder} (split {split!r})")]
    if test_split is not None and test_split in present:
        out.append((loaded[test_split], f"{folder} (split {test_split!r})"))
    return out


def _wanted(
    features: str | Sequence[str], label: str, user: str, owner: str | None, meta: Sequence[str]
) -> list[tuple[str, str]]:
    """(column, argument name) pairs to read, features first."""
    feats = [features] if isinstance(features, str) else list(features)
    pairs = [(f, "features") for f in feats] + [(label, "label"), (user, "user")]
    pairs += [] if owner is None else [(owner, "owner")]
    return pairs + [(m, "meta") for m in meta]


def _check_columns(ds: Any, where: str, wanted: list[tuple[str, str]]) -> None:
    present = list(ds.column_names)
    for column, key in wanted:
        if column not in present:
            raise DataError(
                f"{where}: no column {column!r} (columns present: "
                f"{', '.join(present) or 'none'}); pass {key}='<column>'"
            )


# ----------------------------------------------------------------------------------- columns


def _arrow(ds: Any, name: str) -> Any:
    """The column as one pyarrow Array (row order of ``ds``)."""
    return ds.select_columns([name]).with_format("arrow")[name].combine_chunks()


def _is_number(pa: Any, t: Any) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _peel(pa: Any, arr: Any, where: str, name: str) -> tuple[Any, list[int]]:
    """Peel list levels off ``arr``: (the flat values, the per-cell shape)."""
    shape: list[int] = []
    n = len(arr)
    while True:
        if isinstance(arr.type, pa.ExtensionType):  # datasets' Array2D..Array5D
            arr = arr.storage
            continue
        if not (
            pa.types.is_list(arr.type)
            or pa.types.is_large_list(arr.type)
            or pa.types.is_fixed_size_list(arr.type)
        ):
            break
        if arr.null_count:
            raise DataError(f"{where}: column {name!r} has empty (null) cells")
        lengths = np.unique(pa.compute.list_value_length(arr).to_numpy(zero_copy_only=False))
        if len(lengths) > 1:
            raise DataError(
                f"{where}: column {name!r} has cells of different lengths "
                f"({int(lengths[0])} and {int(lengths[1])}); every record's "
                f"features must have one shape"
            )
        shape.append(int(lengths[0]) if len(lengths) else 0)
        arr = arr.flatten()
    if n and len(arr) != n * int(np.prod(shape)):
        raise DataError(f"{where}: column {name!r} has cells of different shapes")
    return arr, shape


def _numbers(pa: Any, arr: Any, where: str, name: str, what: str) -> np.ndarray:
    if not _is_number(pa, arr.type):
        raise DataError(f"{where}: column {name!r} must hold {what}, got {arr.type}")
    if arr.null_count:
        raise DataError(f"{where}: column {name!r} has missing (null) values")
    return arr.to_numpy(zero_copy_only=False)


def _pixels(img: Any, where: str, name: str, row: int) -> np.ndarray:
    """One PIL image as float32 [C, H, W] in [0, 1]."""
    mode = img.mode
    if mode in _TO_RGB:
        img, mode = img.convert(_TO_RGB[mode]), _TO_RGB[mode]
    if mode not in _IMAGE_SCALE:
        raise DataError(
            f"{where}: column {name!r} record {row} is an image of mode {mode!r}; "
            f"convert the column to 8-bit images (mode 'L' or 'RGB') first"
        )
    a = np.asarray(img).astype(np.float32) / np.float32(_IMAGE_SCALE[mode])
    return a[None] if a.ndim == 2 else a.transpose(2, 0, 1)


def _images(ds: Any, where: str, name: str) -> np.ndarray:
    out: np.ndarray | None = None
    row = 0
    for batch in ds.select_columns([name]).iter(batch_size=1024):
        for img in batch[name]:
            if img is None:
                raise DataError(f"{where}: column {name!r} record {row} has no image (null)")
            a = _pixels(img, where, name, row)
            if out is None:
                out = np.empty((len(ds), *a.shape), dtype=np.float32)
            elif a.shape != out.shape[1:]:
                raise DataError(
                    f"{where}: column {name!r} has images of different shapes "
                    f"({list(out.shape[1:])} in record 0, {list(a.shape)} in "
                    f"record {row}); every record's features must have one shape "
                    f"(resize or convert the images first)"
                )
            out[row] = a
            row += 1
    assert out is not None  # the split is not empty
    return out


def _features(
    datasets: Any, pa: Any, ds: Any, where: str, features: str | Sequence[str]
) -> np.ndarray:
    if isinstance(features, str):
        feature = ds.features[features]
        if isinstance(feature, datasets.Image):
            if not feature.decode:
                ds = ds.cast_column(features, datasets.Image(decode=True))
            return _images(ds, where, features)
        arr = _arrow(ds, features)
        values, shape = _peel(pa, arr, where, features)
        x = _numbers(
            pa,
            values,
            where,
            features,
            "numeric features (an image, a list/array of numbers or a number)",
        )
        return x.reshape(len(arr), *(shape or [1]))
    cols = []
    for name in features:
        arr = _arrow(ds, name)
        cols.append(
            _numbers(
                pa,
                arr,
                where,
                name,
                "numbers (features given as several columns are numeric scalars)",
            )
        )
    return np.stack(cols, axis=1) if cols else np.zeros((len(ds), 0), np.float32)


def _labels(datasets: Any, pa: Any, ds: Any, where: str, label: str) -> np.ndarray:
    arr = _arrow(ds, label)
    if not (isinstance(ds.features[label], datasets.ClassLabel) or pa.types.is_integer(arr.type)):
        raise DataError(
            f"{where}: column {label!r} must hold integer labels (a ClassLabel or "
            f"an int column), got {arr.type}; encode it first, e.g. "
            f"ds.class_encode_column({label!r})"
        )
    if arr.null_count:
        raise DataError(f"{where}: column {label!r} has missing (null) labels")
    return arr.to_numpy(zero_copy_only=False)


def _ids(pa: Any, ds: Any, where: str, name: str) -> np.ndarray:
    arr = _arrow(ds, name)
    t = arr.type
    if not (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)):
        raise DataError(f"{where}: column {name!r} must hold integer or string ids, got {t}")
    if arr.null_count:
        raise DataError(f"{where}: column {name!r} has missing (null) values")
    return arr.to_numpy(zero_copy_only=False)


def _partition_order(
    partitioner_cls: Any, ds: Any, where: str, user: str, ids: np.ndarray
) -> np.ndarray:
    """Row order putting the records partition by partition, as ``NaturalIdPartitioner``
    numbers the users, each user's rows in split order."""
    partitioner = partitioner_cls(partition_by=user)
    partitioner.dataset = ds
    _ = partitioner.num_partitions  # builds partition_id_to_natural_id
    natural = partitioner.partition_id_to_natural_id
    pid = {nid: p for p, nid in natural.items()}
    distinct, inverse = np.unique(ids, return_inverse=True)
    try:
        of_distinct = np.array([pid[u] for u in distinct.tolist()], dtype=np.int64)
    except KeyError as e:  # not expected: the partitioner saw the same column
        raise DataError(
            f"{where}: user {e.args[0]!r} of column {user!r} is in no "
            f"NaturalIdPartitioner partition"
        ) from None
    return np.argsort(of_distinct[inverse.reshape(-1)], kind="stable")


def _read_split(
    libs: tuple[Any, Any, Any],
    ds: Any,
    where: str,
    features: str | Sequence[str],
    label: str,
    user: str,
    owner: str | None,
    meta: Sequence[str],
) -> tuple[dict[str, Any], Any]:
    """The split's columns as numpy arrays, already in partition order (see the module doc)."""
    datasets, partitioner_cls, pa = libs
    if len(ds) == 0:
        raise DataError(f"{where}: the split has no records")
    users = _ids(pa, ds, where, user)
    order = _partition_order(partitioner_cls, ds, where, user, users)
    cols: dict[str, Any] = {
        "x": _features(datasets, pa, ds, where, features),
        "y": _labels(datasets, pa, ds, where, label),
        "user": users,
        "owner": None if owner is None else _ids(pa, ds, where, owner),
        "meta": {m: _numbers_or_ids(pa, ds, where, m) for m in meta},
    }
    for k in ("x", "y", "user", "owner"):
        if cols[k] is not None:
            cols[k] = cols[k][order]
    cols["meta"] = {m: v[order] for m, v in cols["meta"].items()}
    feature = ds.features[label]
    return cols, (feature.num_classes if isinstance(feature, datasets.ClassLabel) else None)


def _numbers_or_ids(pa: Any, ds: Any, where: str, name: str) -> np.ndarray:
    arr = _arrow(ds, name)
    if _is_number(pa, arr.type):
        return _numbers(pa, arr, where, name, "numbers")
    return _ids(pa, ds, where, name)


def read_hf(
    path: str | Path,
    *,
    split: str = "train",
    test_split: str | None = "test",
    features: str | Sequence[str] = "x",
    label: str = "y",
    user: str = "user",
    owner: str | None = None,
    meta: Sequence[str] = (),
    classes: int | None = None,
) -> tuple[Records, Records | None]:
    """(train, test) ``Records`` from a Hugging Face data set saved with ``save_to_disk``.

    Records are laid out partition by partition (see the module doc).

    Parameters
    ----------
    path
        The saved folder.
    split, test_split
        A ``DatasetDict``'s split names (no ``test_split`` in the dict, or None: test is None; a
        saved single ``Dataset`` is the training split).
    features
        An image column, a list/array column, or a list of numeric scalar columns.
    label
        A ``ClassLabel`` or int column.
    user
        The natural-id column (users found with flwr-datasets' ``NaturalIdPartitioner``).
    owner, meta
        Scalar columns: the owner id of each record, extra per-record id columns.
    classes
        The number of classes: the argument, else the ``ClassLabel``'s (an integer label column
        needs the argument).

    Returns
    -------
    tuple
        (train ``Records``, test ``Records`` or None).

    Raises
    ------
    DataError
        A missing split or column, or a column of the wrong kind (one line naming it).
    """
    libs = _libs()
    if not isinstance(features, str) and not (
        isinstance(features, Sequence) and all(isinstance(f, str) for f in features)
    ):
        raise TypeError(f"features must be a column name or a list of names, got {features!r}")
    folder = Path(path)
    loaded = _load(libs[0], folder)
    splits = _splits(libs[0], loaded, folder, split, test_split)
    wanted = _wanted(features, label, user, owner, meta)
    for ds, where in splits:
        _check_columns(ds, where, wanted)
    read = [
        (_read_split(libs, ds, where, features, label, user, owner, meta), where)
        for ds, where in splits
    ]
    if classes is None:
        classes = read[0][0][1]
    if classes is None:
        raise DataError(
            f"{splits[0][1]}: label column {label!r} is not a ClassLabel; pass "
            "classes=<the number of classes> (public, declared: fedudp does not "
            "infer it from the labels)"
        )
    out = [
        from_arrays(c["x"], c["y"], c["user"], c["owner"], classes, meta=c["meta"], source=where)
        for (c, _), where in read
    ]
    return out[0], (out[1] if len(out) > 1 else None)


def _read(request: ReadRequest) -> tuple[Records, Records | None]:
    """``dataset.name=hf``: a Hugging Face data set saved with ``save_to_disk``."""
    if not request.path:
        raise ConfigError(
            "dataset.path: dataset.name=hf reads a Hugging Face data set saved "
            "with save_to_disk; set dataset.path=<folder>"
        )
    return read_hf(
        request.path,
        split=request.split,
        test_split=request.test_split,
        features=request.features,
        label=request.label,
        user=request.user,
        owner=request.owner,
        meta=tuple(request.meta),
        classes=request.classes,
    )


register("hf", _read)
