"""MNIST / Fashion-MNIST in their original IDX format, from a local folder (``dataset.root``).

Files are looked up as ``<root>/<name>/<file>``, ``<root>/<file>`` (gzip or not). With
``download=True`` missing files are fetched from the public mirrors; without it a missing
folder or file is a ``FileNotFoundError`` naming the path and the key to set.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
import urllib.request
from pathlib import Path

import numpy as np

from fedudp.errors import DataError

__all__ = [
    "CLASSES",
    "FILES",
    "parse_idx",
    "load_idx_dataset",
    "check_available",
]

CLASSES = 10  # MNIST and Fashion-MNIST

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
_MIRRORS = {
    "mnist": ["https://ossci-datasets.s3.amazonaws.com/mnist/"],
    "fashion_mnist": ["http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"],
}
# md5 of the upstream .gz files (the ones torchvision checks)
_MD5 = {
    ("mnist", "train-images-idx3-ubyte"): "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    ("mnist", "train-labels-idx1-ubyte"): "d53e105ee54ea40749a09fcbcd1e9432",
    ("mnist", "t10k-images-idx3-ubyte"): "9fb629c4189551a2d022fa330f9573f3",
    ("mnist", "t10k-labels-idx1-ubyte"): "ec29112dd5afa0611ce80d1b7f02629c",
    ("fashion_mnist", "train-images-idx3-ubyte"): "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    ("fashion_mnist", "train-labels-idx1-ubyte"): "25c81989df183df01b3e8a0aad5dffbe",
    ("fashion_mnist", "t10k-images-idx3-ubyte"): "bef4ecab320f06d8554ea6380940ec79",
    ("fashion_mnist", "t10k-labels-idx1-ubyte"): "bb300cfdad3c16e7a12a480ee83cd310",
}


def parse_idx(raw: bytes) -> np.ndarray:
    """Decode one IDX file.

    Parameters
    ----------
    raw
        The file's bytes (not compressed).

    Returns
    -------
    numpy.ndarray
        Magic 2051: uint8 images ``[N, rows, cols]``; 2049: uint8 labels ``[N]``.

    Raises
    ------
    ValueError
        Another magic number, or a truncated header or payload.
    """
    if len(raw) < 8:
        raise ValueError("IDX data too short for a header")
    magic, n = struct.unpack(">II", raw[:8])
    if magic == 2051:
        if len(raw) < 16:
            raise ValueError("IDX image header truncated")
        rows, cols = struct.unpack(">II", raw[8:16])
        data = np.frombuffer(raw, dtype=np.uint8, offset=16)
        if data.size != n * rows * cols:
            raise ValueError(
                f"IDX image payload has {data.size} bytes, header says {n}x{rows}x{cols}"
            )
        return data.reshape(n, rows, cols)
    if magic == 2049:
        data = np.frombuffer(raw, dtype=np.uint8, offset=8)
        if data.size != n:
            raise ValueError(f"IDX label payload has {data.size} entries, header says {n}")
        return data
    raise ValueError(f"not an IDX image/label file (magic {magic})")


def _candidates(root: Path, name: str, stem: str) -> list[Path]:
    out = []
    for folder in (root / name, root):
        out += [folder / (stem + ".gz"), folder / stem]
    return out


def _read(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    with opener(path, "rb") as f:
        return f.read()


def _mapped_images(path: Path) -> np.ndarray | None:
    """An uncompressed IDX image file memory-mapped read-only (``[N, rows, cols]`` uint8): only
    the rows a run gathers are read from it (a Flower node its block's, docs/engines.md), the
    page cache shared by the processes that map it. None for a gzipped file (decompressed whole
    by ``_read``) or another magic number (``parse_idx`` says what is wrong).

    Raises
    ------
    ValueError
        A truncated header, or a payload of another size than the header's.
    """
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:2] == b"\x1f\x8b" or len(head) < 8 or struct.unpack(">I", head[:4])[0] != 2051:
        return None
    if len(head) < 16:
        raise ValueError("IDX image header truncated")
    n, rows, cols = struct.unpack(">III", head[4:16])
    size = path.stat().st_size - 16
    if size != n * rows * cols:
        raise ValueError(f"IDX image payload has {size} bytes, header says {n}x{rows}x{cols}")
    if n * rows * cols == 0:
        return np.zeros((n, rows, cols), dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r", offset=16, shape=(n, rows, cols))


def _download(name: str, stem: str, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / (stem + ".gz")
    last: Exception | None = None
    for base in _MIRRORS[name]:
        try:
            with urllib.request.urlopen(base + stem + ".gz", timeout=30) as r:
                blob = r.read()
            if hashlib.md5(blob).hexdigest() != _MD5[(name, stem)]:
                raise ValueError(f"checksum mismatch for {stem}.gz from {base}")
            tmp = target.with_suffix(".part")
            tmp.write_bytes(blob)
            os.replace(tmp, target)
            return target
        except Exception as e:  # noqa: BLE001 - report the last mirror's failure
            last = e
    raise DataError(f"dataset.download: could not download {stem}.gz for {name}: {last}")


def load_idx_dataset(
    name: str, root: str | os.PathLike, download: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The four IDX arrays of ``name`` (MNIST or Fashion-MNIST) from ``root``.

    Parameters
    ----------
    name
        ``"mnist"`` or ``"fashion_mnist"``.
    root
        The folder holding the IDX files (gzipped or not), or ``<name>/`` with them.
    download
        Fetch missing files from the mirrors (checked against their MD5) first.

    Returns
    -------
    tuple of numpy.ndarray
        (train_x uint8 ``[N, 28, 28]``, train_y, test_x, test_y).

    Raises
    ------
    ValueError
        An unknown ``name``.
    DataError
        A file not found (without ``download``), unreadable or failing its checksum, or a
        download that failed.
    """
    if name not in _MIRRORS:
        raise ValueError(f"dataset.name: unknown IDX dataset {name!r}")
    root = Path(root).expanduser()
    arrays, paths = {}, {}
    for key, stem in FILES.items():
        path = next((p for p in _candidates(root, name, stem) if p.is_file()), None)
        if path is None:
            if not download:
                raise DataError(
                    f"dataset.root: {stem}(.gz) for {name} not found under {root} (looked in "
                    f"{root / name} and {root}); point dataset.root at the folder holding the IDX "
                    f"files or set dataset.download=true"
                )
            path = _download(name, stem, root / name)
        try:
            mapped = _mapped_images(path) if key.endswith("_images") else None
            arrays[key] = mapped if mapped is not None else parse_idx(_read(path))
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{path}: {e}") from None
        paths[key] = path
    for split in ("train", "test"):
        if len(arrays[f"{split}_images"]) != len(arrays[f"{split}_labels"]):
            raise DataError(
                f"{paths[f'{split}_labels']}: {len(arrays[f'{split}_labels'])} labels "
                f"for {len(arrays[f'{split}_images'])} images in {paths[f'{split}_images']}"
            )
        labels = arrays[f"{split}_labels"]
        if labels.ndim != 1 or arrays[f"{split}_images"].ndim != 3:
            raise DataError(
                f"{paths[f'{split}_labels']}: expected 1-d labels and 3-d images, got "
                f"{labels.ndim}-d labels and {arrays[f'{split}_images'].ndim}-d images"
            )
        bad = np.flatnonzero(labels >= CLASSES)
        if len(bad):
            raise DataError(
                f"{paths[f'{split}_labels']}: label {int(labels[bad[0]])} at index "
                f"{int(bad[0])} is outside [0, {CLASSES}) ({len(bad)} such labels)"
            )
    return (
        arrays["train_images"],
        arrays["train_labels"],
        arrays["test_images"],
        arrays["test_labels"],
    )


def check_available(name: str, root: str | os.PathLike, download: bool) -> None:
    """Fail fast (before any work) if the files are neither present nor downloadable.

    Parameters
    ----------
    name
        ``"mnist"`` or ``"fashion_mnist"``.
    root
        The folder of the IDX files.
    download
        Whether missing files may be downloaded.

    Raises
    ------
    DataError
        A file missing under ``root`` without ``download`` (naming ``dataset.root``).
    """
    root = Path(root).expanduser()
    for stem in FILES.values():
        if not any(p.is_file() for p in _candidates(root, name, stem)) and not download:
            raise DataError(
                f"dataset.root: {stem}(.gz) for {name} not found under {root}; point "
                f"dataset.root at the folder holding the IDX files or set dataset.download=true"
            )
