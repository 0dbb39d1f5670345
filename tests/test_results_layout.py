"""docs/results holds write-ups, figures and one compact file of raw outputs per result, not runs.

Each result folder has a README.md; its raw run outputs are packed in at most one ``raw.tar.xz``
or ``raw.jsonl`` (scripts/tools/results_archive.py), which reads back, holds no machine path (the rule
tests/test_repository_links.py applies to the text files) and is described in
docs/results/README.md; no file is tracked both loose and packed; and the tracked files under
docs/results stay at most ``LIMIT``. The checks run on git's list of tracked files (skipped
outside a git checkout), and each is shown to catch a layout that breaks it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "docs/results"
LIMIT = 200


@pytest.fixture(scope="module")
def ra():
    spec = importlib.util.spec_from_file_location(
        "results_archive", ROOT / "scripts" / "tools" / "results_archive.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["results_archive"] = mod
    spec.loader.exec_module(mod)
    return mod


def tracked() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", RESULTS],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout")
    return [n for n in out.decode("utf-8", "surrogateescape").split("\0") if n]


def layout_problems(files: list[str], index: str, limit: int = LIMIT) -> list[str]:
    """What is wrong with ``files`` (tracked paths under docs/results) as a results layout;
    ``index`` is docs/results/README.md's text."""
    bad = []
    if len(files) > limit:
        bad.append(f"{len(files)} tracked files under {RESULTS} (at most {limit}): pack raw files")
    folders = sorted({f.split("/")[2] for f in files if f.count("/") >= 3})
    have = set(files)
    for d in folders:
        if f"{RESULTS}/{d}/README.md" not in have:
            bad.append(f"{RESULTS}/{d}: no README.md")
        packed = [a for a in ("raw.tar.xz", "raw.jsonl") if f"{RESULTS}/{d}/{a}" in have]
        if len(packed) > 1:
            bad.append(f"{RESULTS}/{d}: both raw.tar.xz and raw.jsonl")
        for a in packed:
            if f"[{d}]" not in index or a not in index.split(f"[{d}]", 1)[1].split("\n", 1)[0]:
                bad.append(f"{RESULTS}/{d}/{a}: not described on its line of {RESULTS}/README.md")
    return bad


def archive_problems(ra, files: list[str]) -> list[str]:
    """Archives that do not read, hold a machine path, or hold a file also tracked loose."""
    bad, have = [], set(files)
    for f in files:
        if not f.endswith(("/raw.tar.xz", "/raw.jsonl")):
            continue
        folder = ROOT / f.rsplit("/", 1)[0]
        try:
            members = ra.members(folder)
        except Exception as e:  # noqa: BLE001  (report every archive, not the first)
            bad.append(f"{f}: does not read: {e}")
            continue
        if not members:
            bad.append(f"{f}: empty")
        base = f.rsplit("/", 1)[0]
        for rel, data in sorted(members.items()):
            if b"/" + b"work/" in data:
                bad.append(f"{f} ({rel}): a machine path (scripts/tools/scrub_paths.py)")
            if f"{base}/{rel}" in have:
                bad.append(f"{f} ({rel}): also tracked loose")
    return bad


def index_text() -> str:
    return (ROOT / RESULTS / "README.md").read_text(encoding="utf-8")


def test_results_hold_few_files_and_every_folder_a_readme():
    files = tracked()
    assert not layout_problems(files, index_text()), "\n".join(layout_problems(files, index_text()))


def test_every_archive_reads_back_clean_and_holds_no_tracked_file(ra):
    files = tracked()
    assert any(f.endswith("/raw.tar.xz") for f in files)
    assert not archive_problems(ra, files), "\n".join(archive_problems(ra, files))


def test_the_checks_catch_a_broken_layout(ra, tmp_path, monkeypatch):
    files, index = tracked(), index_text()
    # too many files: the raw runs of a folder tracked again one by one
    many = files + [f"{RESULTS}/beyond_seeds/runs/r{i}/summary.json" for i in range(LIMIT)]
    assert any("tracked files" in p for p in layout_problems(many, index))
    # a folder without README.md, and one with both kinds of archive
    assert any("no README.md" in p for p in layout_problems(files + [f"{RESULTS}/x/a.json"], index))
    two = files + [f"{RESULTS}/beyond_seeds/raw.jsonl"]
    assert any("both raw.tar.xz and raw.jsonl" in p for p in layout_problems(two, index))
    # an archive the index does not describe
    undocumented = index.replace("raw.tar.xz", "the archive")
    assert any("not described" in p for p in layout_problems(files, undocumented))
    # an archive holding a machine path, or a file that is also tracked loose
    folder = tmp_path / RESULTS / "demo"
    folder.mkdir(parents=True)
    (folder / "a.json").write_text('{"data": "/' + 'work/x"}')
    (folder / "b.json").write_text("{}")
    ra.pack(folder, ["a.json", "b.json"], "jsonl")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    probs = archive_problems(ra, [f"{RESULTS}/demo/raw.jsonl", f"{RESULTS}/demo/b.json"])
    assert any("machine path" in p for p in probs) and any("tracked loose" in p for p in probs)
