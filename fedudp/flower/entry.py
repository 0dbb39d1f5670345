"""The ``flwr run .`` entry: Flower's own tooling drives a fedudp run (``[tool.flwr.app]``).

The ServerApp turns ``--run-config`` into a ``RunConfig`` (every key except ``output-dir`` is a
dotted fedudp key such as ``train.rounds=3``; ``partition.num_owners=0`` means one owner per
connected SuperNode) and runs ``fedudp.run.run`` with ``engine=flower`` on the grid Flower hands
it; the owners are ``fedudp.flower.client_app.client_app``.
"""

from __future__ import annotations

import os
import time
from logging import INFO

from flwr.app import Context
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

from fedudp.config import config_from_overrides
from fedudp.run import run

__all__ = ["server_app", "main", "count_nodes"]

server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """The ServerApp's main: ``--run-config`` as a ``RunConfig`` and one ``fedudp.run.run``.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
    context : flwr.app.Context
        Its ``run_config``: dotted fedudp keys, and ``output-dir``.
    """
    rc = dict(context.run_config)
    out_dir = os.path.abspath(str(rc.pop("output-dir", "outputs/flwr")))
    if int(rc.get("partition.num_owners", 0)) == 0:
        rc["partition.num_owners"] = count_nodes(grid)
    cfg = config_from_overrides({**rc, "engine": "flower", "progress": False})
    s = run(cfg, out_dir, grid=grid)
    log(
        INFO,
        "fedudp: %s accuracy %.4f epsilon %s rounds %s -> %s",
        s["method"],
        s["accuracy_mean"],
        s["epsilon_display"],
        s["rounds_completed"],
        out_dir,
    )


def count_nodes(grid: Grid, settle_s: float = 2.0, timeout_s: float = 300.0) -> int:
    """Number of connected SuperNodes, once it has stopped growing for ``settle_s``.

    Parameters
    ----------
    grid : flwr.serverapp.Grid
    settle_s : float, default 2.0
    timeout_s : float, default 300.0

    Returns
    -------
    int

    Raises
    ------
    RuntimeError
        No SuperNode connected within ``timeout_s``.
    """
    t_end = time.time() + timeout_s
    last, since = -1, time.time()
    while time.time() < t_end:
        n = len(list(grid.get_node_ids()))
        if n != last:
            last, since = n, time.time()
        elif n > 0 and time.time() - since >= settle_s:
            return n
        time.sleep(0.2)
    raise RuntimeError("no Flower SuperNodes connected")
