"""Screenshots of the documentation site's API pages, in headless Chromium driven by Playwright.

Serves a built site (``mkdocs build --strict`` writes ``site/``) on 127.0.0.1 with Python's
``http.server`` and captures each page's rendered signature and docstring:

* ``docs/images/api_simulate.png``: the ``fedudp.simulate`` entry of ``api/simulate.html``;
* ``docs/images/api_userleveldp.png``: the ``UserLevelDP`` entry of ``api/flower.html``.

Run with a Python that has Playwright (``pip install playwright``; no browser download: it
drives Debian's ``/usr/bin/chromium``, ``apt-get install chromium``):

    .venv/bin/mkdocs build --strict
    python scripts/tools/docs_screenshots.py [--site site] [--out docs/images] [--chromium PATH]
"""

from __future__ import annotations

import argparse
import functools
import http.server
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# (page, the element id mkdocstrings gives the object's heading, output file)
SHOTS = [
    ("api/simulate.html", "fedudp.api.simulate", "api_simulate.png"),
    ("api/flower.html", "fedudp.flower.UserLevelDP", "api_userleveldp.png"),
]
ARGS = [  # headless on a machine without a GPU, a sandbox or a network
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]


def serve(site: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    """The site served on a free loopback port, in a daemon thread."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 -- the base class's signature
            pass

    handler = functools.partial(Quiet, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def shoot(base: str, out: Path, chromium: str, width: int) -> list[Path]:
    """Each API entry: its heading, signature and docstring (the element mkdocstrings renders
    for the object), whole."""
    from playwright.sync_api import sync_playwright

    written = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=ARGS)
        page = browser.new_page(viewport={"width": width, "height": 900}, device_scale_factor=1)
        for rel, ident, name in SHOTS:
            page.goto(f"{base}/{rel}#{ident}")
            heading = page.locator(f'[id="{ident}"]')
            heading.wait_for(timeout=30000)
            # the theme's sticky header would cover the top of an entry scrolled into view
            page.add_style_tag(content=".md-header { position: static !important; }")
            # the heading and the object's body (signature, docstring) that follows it
            entry = heading.locator("xpath=ancestor::div[contains(@class,'doc-object')][1]")
            if entry.count() != 1:
                raise SystemExit(f"{rel}: no rendered entry for {ident}")
            path = out / name
            entry.screenshot(path=str(path))
            written.append(path)
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", type=Path, default=ROOT / "site", help="the built site (site/)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--width", type=int, default=1400, help="viewport width in pixels")
    args = ap.parse_args(argv)
    if not (args.site / "api" / "simulate.html").is_file():
        print(
            f"docs_screenshots: error: {args.site}: no built site "
            "(run `.venv/bin/mkdocs build --strict` first)",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    httpd, base = serve(args.site)
    try:
        for path in shoot(base, args.out, args.chromium, args.width):
            print(path)
    finally:
        httpd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
