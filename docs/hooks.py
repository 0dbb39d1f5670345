"""MkDocs hooks for the fedudp site (mkdocs.yml: ``hooks``; excluded from the site's files).

The guide pages in docs/ link to files of the repository outside docs/ (source modules, tests,
scripts, examples) with relative links, so that they work when read on a Git host or in the
checkout. A static site holds only docs/, so MkDocs would report each such link as missing.
``on_page_markdown`` rewrites them before MkDocs validates links:

* the target must exist in the repository (a missing one is a warning, so ``mkdocs build
  --strict`` fails on it, as it does on a broken link inside docs/);
* with ``extra.source_url`` set in mkdocs.yml (e.g. a repository's ``.../blob/main``) the link
  points there; without it the link becomes its text followed by the repository path in code
  (no dead link in the site).

``changelog.md`` is generated from the repository's CHANGELOG.md, whose links are relative to
the repository root; they are rebased onto docs/ the same way.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.fedudp")

_FENCE = re.compile(r"^(\s*)(```|~~~)")
# [text](target) or ![alt](target), target without spaces, optional "title"
_LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>(?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?(?P<target>[^)\s>]+)>?"
    r"(?P<title>\s+\"[^\"]*\")?\s*\)"
)
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# repository files outside docs/ that the site shows as pages of its own
PAGES_OF_ROOT_FILES = {"CHANGELOG.md": "docs/changelog.md"}


def _rewrite_line(line: str, base: str, page_dir: str, root: Path, source_url: str, where: str):
    """The line with every relative link that leaves docs/ rewritten (code spans untouched).
    ``base``: the repository folder the links are relative to; ``page_dir``: the page's folder
    inside docs/ (a link into docs/ is made relative to it)."""

    def fix(m: re.Match) -> str:
        target = m.group("target")
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        in_repo = posixpath.normpath(posixpath.join(base, path) if path else base)
        if in_repo.startswith("docs/") or in_repo == "docs":
            if base == posixpath.join("docs", page_dir).rstrip("/"):
                return m.group(0)  # inside docs/: MkDocs validates it
            rel = posixpath.relpath(in_repo, posixpath.join("docs", page_dir))
            title = m.group("title") or ""
            hashed = f"{rel}#{anchor}" if anchor else rel
            return f"{m.group('bang')}[{m.group('text')}]({hashed}{title})"
        if in_repo in PAGES_OF_ROOT_FILES:  # a repository file the site has as a page
            rel = posixpath.relpath(PAGES_OF_ROOT_FILES[in_repo], posixpath.join("docs", page_dir))
            hashed = f"{rel}#{anchor}" if anchor else rel
            return f"{m.group('bang')}[{m.group('text')}]({hashed})"
        if in_repo.startswith(".."):
            log.warning(f"{where}: link {target!r} points outside the repository")
            return m.group(0)
        if not (root / in_repo).exists():
            log.warning(f"{where}: link {target!r}: no file {in_repo} in the repository")
            return m.group(0)
        if source_url:
            url = f"{source_url.rstrip('/')}/{in_repo}" + (f"#{anchor}" if anchor else "")
            return f"{m.group('bang')}[{m.group('text')}]({url})"
        text = m.group("text")
        if m.group("bang"):
            return f"`{in_repo}`"
        if text.strip("`") == in_repo or text.strip("`").rstrip("/") == in_repo.rstrip("/"):
            return text if text.startswith("`") else f"`{in_repo}`"
        return f"{text} (`{in_repo}`)"

    # leave links inside inline code alone (a code span inside a link's text is fine)
    spans = [c.span() for c in _INLINE_CODE.finditer(line)]

    def outside_code(m: re.Match) -> str:
        if any(a <= m.start() < b for a, b in spans):
            return m.group(0)
        return fix(m)

    return _LINK.sub(outside_code, line)


def _rewrite(markdown: str, base: str, page_dir: str, root: Path, source_url: str, src: str):
    lines, fence = [], None
    for no, line in enumerate(markdown.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(2) else (fence or m.group(2))
            lines.append(line)
            continue
        if fence is None:
            line = _rewrite_line(line, base, page_dir, root, source_url, f"{src}:{no}")
        lines.append(line)
    return "\n".join(lines) + ("\n" if markdown.endswith("\n") else "")


def on_page_markdown(markdown, page, config, files):
    docs = Path(config["docs_dir"]).resolve()
    root = docs.parent
    source_url = (config.get("extra") or {}).get("source_url") or ""
    src = page.file.src_uri
    page_dir = posixpath.dirname(src)
    if src == "changelog.md":
        # the page is the repository's CHANGELOG.md, its links relative to the repository root
        text = (root / "CHANGELOG.md").read_text(encoding="utf-8")
        return _rewrite(text, ".", page_dir, root, source_url, "CHANGELOG.md")
    base = posixpath.join("docs", page_dir).rstrip("/")
    return _rewrite(markdown, base, page_dir, root, source_url, src)
