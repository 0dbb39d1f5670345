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

The API reference (docs/api/) documents every public module and lists each module's public
names, exactly its ``__all__``. A directive ``::: fedudp.package.*`` stands for one directive
per public module of the package, the package first, then its modules in name order (public as
``scripts/tools/code_metrics.py`` counts them: no part of the name starts with ``_``;
``__main__`` aside), so a page follows the package's modules as they are added or moved. A
mkdocstrings directive ``::: fedudp.some.module`` without a ``members`` option of its own gets
``members: [<the module's __all__>]`` (``expand_members``; read from the source with ``ast``,
nothing is imported), so a page never lists more or fewer names than the module exports.
tests/test_public_api.py checks the pages' rendered member lists against ``__all__``.
"""

from __future__ import annotations

import ast
import json
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


# "::: fedudp.package.*": every public module of the package (expand_packages)
_PACKAGE = re.compile(r"^:::\s+(?P<id>[A-Za-z_][\w.]*)\.\*\s*$")
# a mkdocstrings directive: "::: identifier" alone on its line (its options indented below it)
_DIRECTIVE = re.compile(r"^:::\s+(?P<id>[A-Za-z_][\w.]*)\s*$")


def _metrics_rule():
    """``_public`` of scripts/tools/code_metrics.py (the one rule for a public module)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "tools" / "code_metrics.py"
    spec = importlib.util.spec_from_file_location("fedudp_code_metrics", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._public


def public_modules(package: str, root: Path) -> list[str]:
    """The public modules of ``package`` (a package or a plain module) of the repository at
    ``root``: the package itself (when it has an ``__init__``), then its modules and
    subpackages, in name order."""
    public = _metrics_rule()
    base = root.joinpath(*package.split("."))
    if base.with_suffix(".py").is_file():
        return [package]
    out = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(root)
        if path.name == "__main__.py" or not public(rel.relative_to(rel.parts[0])):
            continue
        parts = rel.with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out.append(name)
    return sorted(out, key=lambda n: (n != package, n))


def expand_packages(markdown: str, root: Path) -> str:
    """``markdown`` with each ``::: package.*`` line replaced by one ``::: module`` directive
    per public module of the package (``public_modules``), a blank line between them."""
    out = []
    for line in markdown.splitlines():
        m = _PACKAGE.match(line)
        if m is None:
            out.append(line)
            continue
        for name in public_modules(m.group("id"), root):
            out += [f"::: {name}", ""]
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def expand_api(markdown: str, root: Path) -> str:
    """The page as mkdocstrings reads it: packages expanded, then members from ``__all__``."""
    return expand_members(expand_packages(markdown, root), root)


def module_exports(identifier: str, root: Path) -> list[str] | None:
    """The names of the literal ``__all__`` of module ``identifier`` of the repository at
    ``root`` (with any literal ``__all__ += [...]`` after it), read from its source; None when
    ``identifier`` is no module there or its ``__all__`` is missing or not a literal list."""
    base = root.joinpath(*identifier.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    if not path.is_file():
        return None
    names: list[str] | None = None
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if not any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            continue
        if isinstance(node, ast.AugAssign) and names is None:
            continue
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            try:
                value = [str(n) for n in ast.literal_eval(node.value)]
            except ValueError:
                return None
            names = (names or []) + value if isinstance(node, ast.AugAssign) else value
    return names


def expand_members(markdown: str, root: Path) -> str:
    """``markdown`` with ``members: [...]`` (the module's ``__all__``) added to every
    ``::: module`` directive that has no ``members`` option (outside code fences); a directive
    for a class or function, or for a module without a literal ``__all__``, is left as it is."""
    lines = markdown.splitlines()
    out, fence, i = [], None, 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        m = _FENCE.match(line)
        if m:
            fence = None if fence == m.group(2) else (fence or m.group(2))
            continue
        d = _DIRECTIVE.match(line) if fence is None else None
        if d is None:
            continue
        block = []  # the directive's indented options
        while i < len(lines) and (lines[i].startswith((" ", "\t")) or not lines[i].strip()):
            if not lines[i].strip() and not (
                i + 1 < len(lines) and lines[i + 1].startswith((" ", "\t"))
            ):
                break
            block.append(lines[i])
            i += 1
        names = module_exports(d.group("id"), root)
        if names is None or any(b.strip().startswith("members:") for b in block):
            out += block
            continue
        members = f"      members: {json.dumps(names)}"
        if any(b.strip() == "options:" for b in block):
            at = next(k for k, b in enumerate(block) if b.strip() == "options:")
            out += block[: at + 1] + [members] + block[at + 1 :]
        else:
            out += ["    options:", members] + block
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


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
    markdown = expand_api(markdown, root)
    return _rewrite(markdown, base, page_dir, root, source_url, src)
