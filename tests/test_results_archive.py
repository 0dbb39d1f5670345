"""scripts/tools/results_archive.py: a result folder's raw files packed into one file and read back.

Packing is lossless (every byte of every file, under its relative path) and reproducible (the
same files give the same archive bytes); reading needs no unpacking; a file on disk wins over
the archived one; ``pack`` refuses to let a file that was appended to without unpacking replace
the archived one it does not continue (a twin without that guard loses the archived lines).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ra():
    spec = importlib.util.spec_from_file_location(
        "results_archive", ROOT / "scripts" / "tools" / "results_archive.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["results_archive"] = mod
    spec.loader.exec_module(mod)
    return mod


FILES = {
    "README.md": b"# kept\n",
    "figure.png": b"\x89PNG\r\n\x1a\n\x00binary",
    "runs/a/summary.json": b'{\n  "accuracy_mean": 0.1234567890123,\n  "x": [1, 2]\n}',
    "runs/a/.hydra/overrides.yaml": b"- method=full_dp\n- seed=0\n",
    "runs/a/metrics.jsonl": b'{"round": 1}\n{"round": 2}\n',
    "runs/b/owners.csv": b"owner,accuracy\n0,0.5\n1,0.25\n",
    "runs/b/run.log": b"",
    "runs/times.jsonl": b'{"run": "a", "wall_s": 1.5}\n',
    "bench.json": '{"caf\u00e9": "\u03b5 = 1"}\n'.encode(),
}
RAW = sorted(k for k in FILES if not k.endswith((".md", ".png")))


def make(folder: Path) -> Path:
    for rel, data in FILES.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    return folder


@pytest.mark.parametrize("fmt", ["tar", "jsonl"])
def test_pack_is_lossless_reproducible_and_read_in_place(ra, tmp_path, fmt):
    folder = make(tmp_path / "res")
    target = ra.pack(folder, ["runs", "bench.json"], fmt)
    assert target.name == {"tar": "raw.tar.xz", "jsonl": "raw.jsonl"}[fmt]
    # the raw files are gone (and their emptied folders); the write-up and the figure stay
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["README.md", "figure.png", target.name]
    )
    assert ra.members(folder) == {r: FILES[r] for r in RAW}
    for rel in RAW:
        assert ra.read_member(folder, rel) == FILES[rel]
        assert ra.read_text(folder / rel) == FILES[rel].decode()
        assert ra.is_file(folder / rel)
    assert ra.load_member(folder, "runs/a/summary.json")["accuracy_mean"] == 0.1234567890123
    assert ra.load_member(folder, "runs/a/metrics.jsonl") == [{"round": 1}, {"round": 2}]
    assert ra.load_member(folder, "runs/a/.hydra/overrides.yaml") == ["method=full_dp", "seed=0"]
    assert ra.load_member(folder, "runs/b/owners.csv")[1] == {"owner": "1", "accuracy": "0.25"}
    assert ra.open_member(folder, "runs/times.jsonl").readline().startswith('{"run"')
    assert not ra.is_file(folder / "runs" / "c" / "summary.json")
    with pytest.raises(FileNotFoundError):
        ra.read_member(folder, "runs/c/summary.json")
    # glob: one path component per '*', through the archive, from a subfolder too
    assert [
        p.relative_to(folder).as_posix() for p in ra.glob(folder / "runs", "*/summary.json")
    ] == ["runs/a/summary.json"]
    assert len(ra.glob(folder, "runs/*/*")) == 4  # .hydra is a folder, not a file at that depth
    # the same files packed again (unpack, pack) give the same bytes
    data = target.read_bytes()
    assert ra.unpack(folder) == RAW
    assert all((folder / r).read_bytes() == FILES[r] for r in RAW)
    ra.pack(folder, ["runs", "bench.json"], fmt)
    assert target.read_bytes() == data
    if fmt == "jsonl":  # one object per file, its exact text
        lines = [json.loads(x) for x in target.read_text(encoding="utf-8").splitlines()]
        assert [d["path"] for d in lines] == RAW
        assert all(set(d) == {"path", "text"} for d in lines)


def test_a_file_on_disk_wins_and_an_appended_one_continues(ra, tmp_path):
    folder = make(tmp_path / "res")
    ra.pack(folder, ["runs"])
    # a new run written beside the archive is read from disk and folded in by the next pack
    (folder / "runs" / "c").mkdir(parents=True)
    (folder / "runs" / "c" / "summary.json").write_text('{"accuracy_mean": 0.9}')
    assert ra.load_member(folder, "runs/c/summary.json") == {"accuracy_mean": 0.9}
    # times.jsonl continued after unpacking: allowed, the archived lines are its start
    ra.unpack(folder)
    with (folder / "runs" / "times.jsonl").open("a") as f:
        f.write('{"run": "c", "wall_s": 2.0}\n')
    ra.pack(folder, ["runs"])
    assert ra.read_text(folder / "runs" / "times.jsonl").count("\n") == 2
    assert "runs/c/summary.json" in ra.members(folder)


def test_pack_refuses_an_append_that_was_never_unpacked(ra, tmp_path, monkeypatch):
    folder = make(tmp_path / "res")
    ra.pack(folder, ["runs"])
    (folder / "runs").mkdir()
    (folder / "runs" / "times.jsonl").write_text('{"run": "c", "wall_s": 2.0}\n')  # no unpack
    with pytest.raises(ValueError, match="unpack before appending"):
        ra.pack(folder, ["runs"])
    assert b'"run": "a"' in ra.members(folder)["runs/times.jsonl"]  # nothing was lost
    assert (folder / "runs" / "times.jsonl").is_file()  # nor the new line
    ra.pack(folder, ["runs"], replace=True)  # asked for: the file on disk replaces it
    assert ra.members(folder)["runs/times.jsonl"] == b'{"run": "c", "wall_s": 2.0}\n'

    # the weakened twin: a pack without the guard silently drops the archived line
    folder2 = make(tmp_path / "res2")
    ra.pack(folder2, ["runs"])
    (folder2 / "runs").mkdir()
    (folder2 / "runs" / "times.jsonl").write_text('{"run": "c"}\n')
    real = ra.pack
    monkeypatch.setattr(
        ra, "pack", lambda f, p, fmt=None, remove=True, replace=False: real(f, p, fmt, remove, True)
    )
    ra.pack(folder2, ["runs"])
    assert b'"run": "a"' not in ra.members(folder2)["runs/times.jsonl"]  # what the guard prevents


def test_bad_input_is_one_line(ra, tmp_path):
    folder = make(tmp_path / "res")
    with pytest.raises(FileNotFoundError, match="no such file or folder to pack"):
        ra.pack(folder, ["nope"])
    with pytest.raises(ValueError, match="without '..'"):
        ra.read_member(folder, "../x")
    (folder / "raw.jsonl").write_text("{}\n")
    (folder / "raw.tar.xz").write_bytes(b"")
    with pytest.raises(ValueError, match="both raw.tar.xz and raw.jsonl"):
        ra.archive_of(folder)
    (folder / "raw.tar.xz").unlink()
    with pytest.raises(ValueError, match="needs 'path' and 'text'"):
        ra.members(folder)
    with pytest.raises(SystemExit, match="no such folder"):
        ra.main(["list", str(tmp_path / "missing")])
    bin_folder = make(tmp_path / "bin")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        ra.pack(bin_folder, ["figure.png"], "jsonl")
