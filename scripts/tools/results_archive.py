"""The one compact file of a result folder: its raw run outputs, packed, and read back transparently.

A folder of ``docs/results/`` keeps its write-ups (``README.md`` and other Markdown), its PNG
figures and at most a few single data files as they are; the raw files its runs wrote (run
folders with ``config.yaml``, ``summary.json``, ``ledger.json``, ``metrics.jsonl``, logs, benchmark
JSON) are packed into ONE file beside them, under their original paths relative to the folder:

* ``raw.tar.xz``: an xz-compressed tar (run-folder trees, many files);
  ``tar xJf raw.tar.xz`` in the folder restores them;
* ``raw.jsonl``: one JSON object per file, ``{"path": <relative path>, "text": <its exact text>}``,
  sorted by path (a few small benchmark files); ``jq -r 'select(.path=="bench.json").text'``.

Both are written byte for byte reproducibly (sorted members, fixed times and owners), so packing
the same files again gives the same bytes. A file on disk wins over the archived one of the same
path: a script that writes new runs into an unpacked folder reads its own new files, and ``pack``
folds them in. Reading (the scripts' ``open_member``, ``read_text``, ``is_file``, ``glob``) needs
no unpacking; resuming a grid does (the run scripts call ``unpack`` first).

Usage (standard library only):

    .venv/bin/python scripts/tools/results_archive.py list docs/results/tuning
    .venv/bin/python scripts/tools/results_archive.py cat docs/results/tuning runs/grid/0/summary.json
    .venv/bin/python scripts/tools/results_archive.py unpack docs/results/tuning      # the raw files back
    .venv/bin/python scripts/tools/results_archive.py pack docs/results/tuning runs   # fold them in again
"""

from __future__ import annotations

import argparse
import fnmatch
import io
import json
import lzma
import os
import sys
import tarfile
from functools import lru_cache
from pathlib import Path, PurePosixPath

__all__ = [
    "ARCHIVES",
    "archive_of",
    "archive_folder",
    "members",
    "open_member",
    "read_member",
    "load_member",
    "locate",
    "read_text",
    "is_file",
    "glob",
    "rglob",
    "unpack",
    "pack",
]

TAR, JSONL = "raw.tar.xz", "raw.jsonl"
ARCHIVES = (TAR, JSONL)
# never packed: checkpoints, worker claims, caches
SKIP = ("*.pt", ".claims", "__pycache__", "*.pyc", ".DS_Store")


def archive_of(folder: str | os.PathLike) -> Path | None:
    """The folder's ``raw.tar.xz`` or ``raw.jsonl``, or None; a folder with both is an error."""
    found = [Path(folder) / a for a in ARCHIVES if (Path(folder) / a).is_file()]
    if len(found) > 1:
        raise ValueError(f"{folder}: both {TAR} and {JSONL}; keep one (see {__file__})")
    return found[0] if found else None


@lru_cache(maxsize=8)
def _load(path: str, mtime_ns: int, size: int) -> dict[str, bytes]:
    del mtime_ns, size  # the cache key: a re-packed archive is read again
    if path.endswith(".tar.xz"):
        out = {}
        with tarfile.open(path, "r:xz") as tar:
            for m in tar.getmembers():
                if m.isfile():
                    f = tar.extractfile(m)
                    assert f is not None
                    out[m.name] = f.read()
        return out
    out = {}
    for no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        if "path" not in d or "text" not in d:
            raise ValueError(f"{path}:{no}: a line needs 'path' and 'text'")
        out[d["path"]] = d["text"].encode("utf-8")
    return out


def members(folder: str | os.PathLike) -> dict[str, bytes]:
    """Relative path -> bytes of every file the folder's archive holds ({} without one)."""
    a = archive_of(folder)
    if a is None:
        return {}
    st = a.stat()
    return _load(str(a), st.st_mtime_ns, st.st_size)


def _rel(relpath: str | os.PathLike) -> str:
    rel = PurePosixPath(Path(relpath).as_posix())
    if rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"{relpath}: a path relative to the result folder, without '..'")
    return rel.as_posix()


def read_member(folder: str | os.PathLike, relpath: str | os.PathLike) -> bytes:
    """The bytes of ``folder/relpath``: the file on disk if there is one, else the archived one.

    Raises
    ------
    FileNotFoundError
        Neither on disk nor in the folder's archive.
    """
    rel = _rel(relpath)
    p = Path(folder) / rel
    if p.is_file():
        return p.read_bytes()
    data = members(folder).get(rel)
    if data is None:
        raise FileNotFoundError(f"{p}: not on disk and not in {archive_of(folder) or 'an archive'}")
    return data


def open_member(folder: str | os.PathLike, relpath: str | os.PathLike, binary: bool = False):
    """A read-only file object of ``folder/relpath`` (on disk, else from the folder's archive)."""
    data = read_member(folder, relpath)
    return io.BytesIO(data) if binary else io.StringIO(data.decode("utf-8"))


def load_member(folder: str | os.PathLike, relpath: str | os.PathLike):
    """``folder/relpath`` parsed by its suffix: ``.json`` an object, ``.jsonl`` a list of objects,
    ``.yaml``/``.yml`` what PyYAML reads, ``.csv`` a list of dicts, anything else its text."""
    text = read_member(folder, relpath).decode("utf-8")
    suffix = PurePosixPath(_rel(relpath)).suffix
    if suffix == ".json":
        return json.loads(text)
    if suffix == ".jsonl":
        return [json.loads(x) for x in text.splitlines() if x.strip()]
    if suffix in (".yaml", ".yml"):
        import yaml  # PyYAML: in the project's environment (Hydra's dependency)

        return yaml.safe_load(text)
    if suffix == ".csv":
        import csv

        return list(csv.DictReader(io.StringIO(text)))
    return text


def archive_folder(path: str | os.PathLike) -> Path | None:
    """The nearest folder at or above ``path`` that has a ``raw.tar.xz`` or ``raw.jsonl``, or
    None (the search stops at the checkout's root)."""
    p = Path(path).absolute()
    for folder in (p, *p.parents):
        if archive_of(folder) is not None:
            return folder
        if (folder / ".git").exists():
            break
    return None


def locate(path: str | os.PathLike) -> tuple[Path, str] | None:
    """(result folder, relative path) of the nearest folder above ``path`` whose archive holds
    it, or None."""
    p = Path(path).absolute()
    for folder in p.parents:
        if archive_of(folder) is not None:
            rel = p.relative_to(folder).as_posix()
            if rel in members(folder):
                return folder, rel
        if (folder / ".git").exists():
            break
    return None


def read_text(path: str | os.PathLike) -> str:
    """The text of ``path``: on disk if it is there, else from the archive of a folder above it."""
    p = Path(path)
    if p.is_file():
        return p.read_text(encoding="utf-8")
    hit = locate(p)
    if hit is None:
        raise FileNotFoundError(f"{p}: not on disk and in no result archive above it")
    return read_member(*hit).decode("utf-8")


def is_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a file on disk or an archived member of a result folder above it."""
    return Path(path).is_file() or locate(path) is not None


def _match(rel: str, pattern: str) -> bool:
    parts, pat = rel.split("/"), pattern.split("/")
    return len(parts) == len(pat) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pat))


def glob(folder: str | os.PathLike, pattern: str) -> list[Path]:
    """``Path(folder).glob(pattern)`` (``*`` within one path component, no ``**``) over the files on
    disk and the archived members of ``folder`` or of the result folder above it, sorted."""
    folder = Path(folder)
    found = {p.absolute() for p in folder.glob(pattern) if p.is_file()}
    base = folder.absolute()
    for up in (base, *base.parents):
        if archive_of(up) is not None:
            prefix = base.relative_to(up).as_posix()
            full = pattern if prefix == "." else f"{prefix}/{pattern}"
            found |= {up / m for m in members(up) if _match(m, full)}
            break
        if (up / ".git").exists():
            break
    return sorted(folder / p.relative_to(base) for p in found)


def rglob(folder: str | os.PathLike, pattern: str) -> list[Path]:
    """``Path(folder).rglob(pattern)`` (``pattern`` matched against file names, at any depth) over
    the files on disk and the archived members under ``folder``, sorted."""
    folder = Path(folder)
    found = {p.absolute() for p in folder.rglob(pattern) if p.is_file()}
    base = folder.absolute()
    up = archive_folder(base)
    if up is not None:
        prefix = base.relative_to(up).as_posix()
        for m in members(up):
            if prefix == "." or m.startswith(prefix + "/"):
                if fnmatch.fnmatchcase(m.rsplit("/", 1)[-1], pattern):
                    found.add(up / m)
    return sorted(folder / p.relative_to(base) for p in found)


def unpack(folder: str | os.PathLike, overwrite: bool = False) -> list[str]:
    """Write the archived files that are not on disk (all of them with ``overwrite``) to their
    paths under ``folder``; the relative paths written. Each file is written whole (a temporary
    file renamed), so workers unpacking the same folder at once do not see half a file."""
    written = []
    for rel, data in sorted(members(folder).items()):
        p = Path(folder) / rel
        if p.exists() and not overwrite:
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, p)
        written.append(rel)
    return written


def _skipped(rel: str) -> bool:
    return any(fnmatch.fnmatchcase(part, s) for part in rel.split("/") for s in SKIP)


def _loose(folder: Path, paths: list[str]) -> dict[str, Path]:
    out = {}
    for given in paths:
        rel = _rel(given)
        p = folder / rel
        if p.is_dir():
            files = [q for q in p.rglob("*") if q.is_file()]
        elif p.is_file():
            files = [p]
        elif rel in members(folder) or any(m.startswith(rel + "/") for m in members(folder)):
            files = []  # packed already
        else:
            raise FileNotFoundError(f"{p}: no such file or folder to pack")
        for q in files:
            r = q.relative_to(folder).as_posix()
            if r not in ARCHIVES and not _skipped(r):
                out[r] = q
    return out


def _write_tar(path: Path, files: dict[str, bytes]) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for rel in sorted(files):
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(files[rel]), 0o644, 0
            tar.addfile(info, io.BytesIO(files[rel]))
    path.write_bytes(lzma.compress(buf.getvalue(), preset=9 | lzma.PRESET_EXTREME))


def _write_jsonl(path: Path, files: dict[str, bytes]) -> None:
    lines = []
    for rel in sorted(files):
        try:
            text = files[rel].decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{rel}: not UTF-8 text; pack this folder as {TAR}") from None
        lines.append(json.dumps({"path": rel, "text": text}, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def pack(
    folder: str | os.PathLike,
    paths: list[str],
    fmt: str | None = None,
    remove: bool = True,
    replace: bool = False,
) -> Path:
    """Fold the files under ``paths`` (files or folders, relative to ``folder``) into the folder's
    archive: its members so far, and the files on disk. ``fmt``: ``"tar"`` or ``"jsonl"``
    (default: the existing archive's, else ``tar``). With ``remove`` the packed files are deleted
    afterwards (and folders left empty), once the new archive reads back equal to what was packed.
    Returns the archive's path.

    Raises
    ------
    ValueError
        A file on disk would replace a different archived one that it does not continue (the
        archived bytes are not its start) and ``replace`` is not set: a script appended to a
        file that was never unpacked (``unpack`` first), or a run was redone (``replace``).
    """
    folder = Path(folder)
    old = archive_of(folder)
    if fmt is None:
        fmt = "jsonl" if old is not None and old.name == JSONL else "tar"
    if fmt not in ("tar", "jsonl"):
        raise ValueError(f"fmt={fmt!r}: 'tar' or 'jsonl'")
    loose = _loose(folder, paths)
    files = dict(members(folder))
    new = {r: p.read_bytes() for r, p in loose.items()}
    clash = [r for r, b in new.items() if r in files and not b.startswith(files[r])]
    if clash and not replace:
        raise ValueError(
            f"{folder / clash[0]}: differs from the archived file and does not continue it "
            f"({len(clash)} such file(s)); unpack before appending, or pass replace=True "
            "(--replace) to keep the files on disk"
        )
    files.update(new)
    if not files:
        raise FileNotFoundError(f"{folder}: nothing to pack under {paths}")
    target = folder / (TAR if fmt == "tar" else JSONL)
    tmp = target.with_name(target.name + ".tmp")
    (_write_tar if fmt == "tar" else _write_jsonl)(tmp, files)
    os.replace(tmp, target)
    if old is not None and old != target:
        old.unlink()
    st = target.stat()
    if _load(str(target), st.st_mtime_ns, st.st_size) != files:
        raise RuntimeError(f"{target}: does not read back as packed; loose files kept")
    if remove:
        for p in loose.values():
            p.unlink()
        emptied = {d for p in loose.values() for d in p.parents if folder in d.parents}
        for d in sorted(emptied, key=lambda d: -len(d.parts)):  # deepest first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("list", help="the archived files of a result folder")
    p.add_argument("folder")
    p = sub.add_parser("cat", help="one file's text (on disk, else archived)")
    p.add_argument("folder")
    p.add_argument("path")
    p = sub.add_parser("unpack", help="write the archived files that are not on disk")
    p.add_argument("folder")
    p.add_argument("--overwrite", action="store_true", help="also replace files on disk")
    p = sub.add_parser("pack", help="fold files or folders into the folder's archive")
    p.add_argument("folder")
    p.add_argument("paths", nargs="+", help="files or folders relative to the result folder")
    p.add_argument("--format", choices=("tar", "jsonl"), default=None)
    p.add_argument("--keep", action="store_true", help="keep the packed files on disk")
    p.add_argument("--replace", action="store_true", help="files on disk replace archived ones")
    a = ap.parse_args(argv)
    if not Path(a.folder).is_dir():
        raise SystemExit(f"results_archive.py: error: {a.folder}: no such folder")
    if a.cmd == "list":
        for rel, data in sorted(members(a.folder).items()):
            print(f"{len(data):>10} {rel}")
    elif a.cmd == "cat":
        try:
            sys.stdout.buffer.write(read_member(a.folder, a.path))
        except FileNotFoundError as e:
            raise SystemExit(f"results_archive.py: error: {e}") from None
    elif a.cmd == "unpack":
        done = unpack(a.folder, a.overwrite)
        print(f"{len(done)} file(s) written under {a.folder}")
    else:
        try:
            t = pack(a.folder, a.paths, a.format, remove=not a.keep, replace=a.replace)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"results_archive.py: error: {e}") from None
        print(f"{t}: {len(members(a.folder))} file(s), {t.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
