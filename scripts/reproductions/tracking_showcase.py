"""The tracked 2×2 sweep, its report plots and the MLflow UI over it (docs/results/tracking).

One sweep, three views of it:

1. ``fedudp -m method=fedavg,full_dp privacy.epsilon=1,8 tracking=mlflow`` on the embedded
   synthetic default (one parent MLflow run, four children, in the sweep folder's SQLite store);
2. ``fedudp-report SWEEP --plots --out OUT/report`` (the comparison table, accuracy and ε per
   round, the privacy-utility frontier);
3. the MLflow UI (``mlflow ui`` on 127.0.0.1, a free port) over the sweep's store, opened in
   headless Chromium and saved as ``OUT/mlflow_sweep.png``.

fedudp's tracking extra installs ``mlflow-skinny`` (the client, no UI server); the UI needs the
full ``mlflow`` package and the screenshot Playwright, both taken from a side venv given as
``--ui-venv`` (``python3 -m venv UIVENV && UIVENV/bin/pip install
'mlflow>=3.17,<4' playwright``), and Chromium from ``--chromium`` (Debian's package
``chromium``; Playwright drives it, nothing is downloaded). The screenshot itself is
``scripts/reproductions/mlflow_ui_screenshot.py``.

    .venv/bin/python scripts/reproductions/tracking_showcase.py --ui-venv UIVENV --out docs/results/tracking
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SWEEP = ["-m", "method=fedavg,full_dp", "privacy.epsilon=1,8", "tracking=mlflow", "progress=false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, seconds: float = 120) -> None:
    end = time.time() + seconds
    while time.time() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the MLflow UI did not answer at {url} within {seconds:.0f} s")


def experiment_and_parent(store: str) -> tuple[str, str]:
    """The experiment's id and the sweep's parent run's name."""
    from mlflow.tracking import MlflowClient

    c = MlflowClient(store)
    exp = c.get_experiment_by_name("fedudp")
    if exp is None:
        raise SystemExit(f"no experiment 'fedudp' in {store}")
    parents = c.search_runs([exp.experiment_id], "tags.role = 'sweep'")
    if len(parents) != 1:
        raise SystemExit(f"expected one parent run in {store}, found {len(parents)}")
    return exp.experiment_id, parents[0].info.run_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs/results/tracking"))
    ap.add_argument(
        "--ui-venv",
        required=True,
        help="a venv with the full mlflow package (the UI) and playwright",
    )
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--sweep-dir", help="where the sweep goes (default: a temporary folder)")
    a = ap.parse_args()
    out = Path(a.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    sweep = Path(a.sweep_dir or tempfile.mkdtemp(prefix="fedudp_tracked_")).absolute() / "sweep"
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    timings = {}

    t = time.perf_counter()
    subprocess.run(
        [str(BIN / "fedudp"), *SWEEP, f"hydra.sweep.dir={sweep}"], check=True, env=env, cwd=ROOT
    )
    timings["sweep"] = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(
        [str(BIN / "fedudp-report"), str(sweep), "--plots", "--out", str(out / "report")],
        check=True,
        env=env,
        cwd=ROOT,
    )
    timings["report"] = time.perf_counter() - t

    store = f"sqlite:///{sweep / 'mlflow.db'}"
    exp, parent = experiment_and_parent(store)
    ui_bin = Path(a.ui_venv) / "bin"
    port = free_port()
    ui = subprocess.Popen(
        [
            str(ui_bin / "mlflow"),
            "ui",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            store,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/health")
        t = time.perf_counter()
        subprocess.run(
            [
                str(ui_bin / "python"),
                str(ROOT / "scripts/reproductions/mlflow_ui_screenshot.py"),
                base,
                exp,
                str(out / "mlflow_sweep.png"),
                parent,
                a.chromium,
            ],
            check=True,
            env=env,
            timeout=300,
        )
        timings["screenshot"] = time.perf_counter() - t
    finally:
        os.killpg(ui.pid, 15)
        ui.wait(timeout=30)
    print(f"sweep {sweep}\n" + "\n".join(f"{k}: {v:.1f} s" for k, v in timings.items()))


if __name__ == "__main__":
    main()
