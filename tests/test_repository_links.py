"""The repository is self-contained: a user who clones it can follow every reference.

(a) No file outside ``docs/results/`` (historical result write-ups, kept as measured) points
    outside the repository: no path into the parent folder's shared design or data, no absolute
    machine path, no citation of the design
    notes that used to live beside it (the in-repository docs are ``docs/architecture.md`` and
    ``docs/algorithms.md``).
(b) Every relative Markdown link in README.md and docs/*.md resolves to a file or folder of the
    repository, and its ``#anchor``, where it has one and points into a Markdown file, to a
    heading there.
(c) Every ``docs/architecture.md#anchor`` / ``docs/algorithms.md#anchor`` cited anywhere in the
    repository is a heading of that document.

Files are those git knows (tracked, plus untracked ones that are not ignored), or a directory
walk where git is missing. Heading anchors follow GitHub's rule: the heading's text without
Markdown markup, lowercased, every character that is not a letter, digit, space, '-' or '_'
dropped, spaces turned into '-', and '-1', '-2', ... appended to repeated anchors.
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve().relative_to(ROOT).as_posix()
# the two strings are split so that this file does not match its own check
FORBIDDEN = ("../" + "shared", "/" + "work/", "ARCHITECTURE" + ".md", "ALGORITHMS" + ".md")
HISTORICAL = "docs/results/"
SKIP_DIRS = {
    ".git",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    "outputs",
    "multirun",
    "build",
    "bench_out",
    ".claims",
}
DOCS = ("docs/architecture.md", "docs/algorithms.md")


@lru_cache(maxsize=1)
def repo_files() -> tuple[str, ...]:
    """Repository-relative paths (posix) of the files git knows, or of a directory walk."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
        names = [n for n in out.decode("utf-8", "surrogateescape").split("\0") if n]
    except (OSError, subprocess.SubprocessError):
        names = []
        for top, dirs, files in os.walk(ROOT):
            dirs[:] = [
                d
                for d in dirs
                if d not in SKIP_DIRS
                and not d.endswith(".egg-info")
                and not (Path(top) == ROOT and d == "data")
            ]
            names += [(Path(top) / f).relative_to(ROOT).as_posix() for f in files]
    return tuple(sorted(n for n in set(names) if (ROOT / n).is_file()))


def read_text(rel: str) -> str | None:
    """The file's text, or None for a binary file."""
    data = (ROOT / rel).read_bytes()
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def markdown_files() -> list[str]:
    return sorted(
        f
        for f in repo_files()
        if f == "README.md" or (f.startswith("docs/") and f.count("/") == 1 and f.endswith(".md"))
    )


_FENCE = re.compile(r"^(\s*)(```|~~~)")


def without_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the Markdown text outside fenced code blocks, inline code removed."""
    out, fence = [], None
    for no, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(2) else (fence or m.group(2))
            continue
        if fence is None:
            out.append((no, re.sub(r"`+[^`]*`+", "", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"[`*]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(rel: str) -> frozenset[str]:
    """The heading anchors of a Markdown file (ATX headings outside code blocks)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in without_code((ROOT / rel).read_text(encoding="utf-8")):
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    return frozenset(out)


def test_no_file_points_outside_the_repository():
    bad = []
    for rel in repo_files():
        if rel.startswith(HISTORICAL) or rel == THIS:
            continue
        text = read_text(rel)
        if text is None:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            hits = [s for s in FORBIDDEN if s in line]
            if hits:
                bad.append(f"{rel}:{no}: {', '.join(hits)}: {line.strip()[:120]}")
    assert not bad, (
        "references outside the repository (use docs/architecture.md#... or "
        "docs/algorithms.md#..., or an argument / environment variable for data):\n"
        + "\n".join(bad)
    )


def test_results_record_no_machine_path():
    """Result folders record what a run was given (config.yaml, Hydra's files, logs, JSON): the
    measuring machine's data and checkout paths are replaced by placeholders (``DATA``,
    ``FED.npz``, ``.``; scripts/tools/scrub_paths.py), so no result names a path of that machine."""
    bad = []
    for rel in repo_files():
        if not rel.startswith(HISTORICAL):
            continue
        text = read_text(rel)
        if text is None:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            if "/" + "work/" in line:
                bad.append(f"{rel}:{no}: {line.strip()[:120]}")
    assert not bad, (
        "machine paths in results (scrub them: scripts/tools/scrub_paths.py):\n"
        + "\n".join(bad[:20])
    )


_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


@pytest.mark.parametrize("md", markdown_files())
def test_markdown_links_resolve(md):
    files = set(repo_files())
    folders = {p for f in files for p in (Path(f).parents) if str(p) != "."}
    folders = {p.as_posix() for p in folders}
    bad = []
    for no, line in without_code((ROOT / md).read_text(encoding="utf-8")):
        targets = _LINK.findall(line) + ([m.group(1)] if (m := _REF.match(line)) else [])
        for target in targets:
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            if path:
                resolved = os.path.normpath((Path(md).parent / path).as_posix())
                if resolved.startswith(".."):
                    bad.append(f"{md}:{no}: {target}: outside the repository")
                    continue
                resolved = Path(resolved).as_posix()
                if resolved not in files and resolved not in folders:
                    bad.append(f"{md}:{no}: {target}: no such file in the repository")
                    continue
            else:
                resolved = md
            if anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                bad.append(f"{md}:{no}: {target}: no heading #{anchor} in {resolved}")
    assert not bad, "broken Markdown links:\n" + "\n".join(bad)


_CITED = re.compile(r"docs/(architecture|algorithms)\.md#([\w\-]+)")


def test_doc_anchors_cited_anywhere_exist():
    for doc in DOCS:
        assert (ROOT / doc).is_file(), f"{doc} is missing"
    bad, cited = [], 0
    for rel in repo_files():
        text = None if rel == THIS else read_text(rel)
        if text is None or "docs/a" not in text:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            for which, anchor in _CITED.findall(line):
                cited += 1
                doc = f"docs/{which}.md"
                if anchor not in anchors(doc):
                    bad.append(f"{rel}:{no}: {doc}#{anchor}: no such heading")
    assert cited, "no code cites docs/architecture.md or docs/algorithms.md"
    assert not bad, (
        "anchors cited but missing (headings of the docs: "
        + "; ".join(f"{d}: {sorted(anchors(d))}" for d in DOCS)
        + "):\n"
        + "\n".join(bad)
    )
