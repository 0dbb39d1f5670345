"""Screenshot of the MLflow UI's runs table for one experiment, in headless Chromium driven by
Playwright: the columns accuracy_mean, epsilon (metrics), method, privacy.epsilon (parameters)
and guarantee (tag), the sweep's parent run expanded to show its children. Run by
``scripts/reproductions/tracking_showcase.py`` with a Python that has Playwright (``pip install playwright``;
no browser download: it drives Debian's /usr/bin/chromium).

    python scripts/reproductions/mlflow_ui_screenshot.py BASE_URL EXPERIMENT_ID OUT.png PARENT_RUN_NAME [CHROMIUM]
"""

import sys
from playwright.sync_api import sync_playwright

base, exp, out, parent = sys.argv[1:5]
chromium = sys.argv[5] if len(sys.argv) > 5 else "/usr/bin/chromium"
COLUMNS = ["accuracy_mean", "epsilon", "method", "privacy.epsilon", "guarantee"]
with sync_playwright() as p:
    b = p.chromium.launch(
        executable_path=chromium,
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-quic",
        ],
    )
    pg = b.new_page(viewport={"width": 1600, "height": 560})
    pg.goto(f"{base}/#/experiments/{exp}/runs")
    pg.get_by_text("Training runs").wait_for(timeout=60000)
    pg.wait_for_timeout(2000)
    close = pg.get_by_role("button", name="Close")
    if close.count():
        close.first.click()
    pg.get_by_role("button", name="Columns").click()
    search = pg.get_by_placeholder("Search columns")
    for name in ("Dataset", "Source", "Models"):
        pg.get_by_text(name, exact=True).last.click()
    for name in COLUMNS:
        search.fill(name)
        pg.wait_for_timeout(300)
        pg.locator("label, span").get_by_text(name, exact=True).first.click()
    search.fill("")
    pg.keyboard.press("Escape")
    pg.wait_for_timeout(500)
    # expand the sweep's parent run to show its children
    name = pg.get_by_role("link", name=parent).first
    box = name.bounding_box()
    pg.mouse.click(box["x"] - 28, box["y"] + box["height"] / 2)  # the row's expander
    pg.wait_for_timeout(1500)
    pg.screenshot(path=out)
    b.close()
