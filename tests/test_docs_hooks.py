"""docs/hooks.py, the documentation site's link check for links that leave docs/.

The site holds docs/ only; the hook checks that each link from a page to another repository file
(source, tests, scripts) names a file that exists, and rewrites it so that the site has no dead
link. A missing target is a warning, which ``mkdocs build --strict`` (.ci/run) turns into an error.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("fedudp_docs_hooks", ROOT / "docs" / "hooks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rewrite(markdown: str, page: str = "usage.md", source_url: str = "") -> str:
    hooks = _hooks()
    page_dir = Path(page).parent.as_posix()
    page_dir = "" if page_dir == "." else page_dir
    base = f"docs/{page_dir}".rstrip("/")
    return hooks._rewrite(markdown, base, page_dir, ROOT, source_url, page)


def test_links_inside_docs_are_left_to_mkdocs():
    text = "[Architecture](architecture.md#layers) and [a result](results/load/README.md)\n"
    assert rewrite(text) == text


def test_a_link_to_a_source_file_becomes_its_path_or_a_source_url():
    text = "the estimator ([gaussian](../fedudp/aggregators/gaussian.py)) and [`x`](../Makefile)"
    out = rewrite(text)
    assert out == "the estimator (gaussian (`fedudp/aggregators/gaussian.py`)) and `x` (`Makefile`)"
    url = rewrite(text, source_url="https://example.org/fedudp/blob/main/")
    assert "[gaussian](https://example.org/fedudp/blob/main/fedudp/aggregators/gaussian.py)" in url
    # from a page one folder down, the same file is two levels up
    deep = rewrite("[t](../../../fedudp/tuning.py)", page="results/tuning/README.md")
    assert deep == "t (`fedudp/tuning.py`)"


def test_a_missing_target_is_a_warning_and_code_is_left_alone(caplog):
    text = "[gone](../fedudp/core/rounds.py)\n```\n[in a fence](../nowhere.py)\n```\n`[inline](../x.py)`\n"
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.fedudp"):
        out = rewrite(text)
    assert out == text  # left as is: MkDocs reports it too
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "no file fedudp/core/rounds.py" in warned[0]


def test_the_changelog_page_rebases_root_relative_links():
    hooks = _hooks()
    out = hooks._rewrite(
        "[a](docs/architecture.md#layers) [c](CHANGELOG.md) [m](Makefile)",
        ".",
        "",
        ROOT,
        "",
        "CHANGELOG.md",
    )
    assert out == "[a](architecture.md#layers) [c](changelog.md) m (`Makefile`)"
