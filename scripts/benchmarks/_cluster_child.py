"""One run of ``bench_cluster.py`` in its own process: the configuration, the timers, and the
what-if variants of the Flower engine's polling (benchmark-only monkeypatches, never used by
fedudp itself).

Timers (epoch seconds where a time point, seconds where a duration): ``rounds`` (the
transport's ``train``), ``exchanges`` (each ``FlowerTransport._exchange``: push, wait, pull),
``connect_s`` (``FlowerTransport._connect``) and its time points ``t_connect0`` (start),
``t_nodes`` (``grid.get_node_ids`` first listed every node), ``t_connect1`` (the first query
answered); ``t_child0`` (this process started), ``t_run0`` (``fedudp.run.run`` called).

Variants (``spec["variant"]``):

* ``""``: fedudp and Flower as they are;
* ``"flower_poll_2ms"``: Flower's simulation moves a pushed message from its state to the
  actors' queue every 2 ms instead of every 0.1 s (``vce_api.add_messages_to_queue``);
* ``"poll_2ms"``: that, and fedudp's ``_exchange`` sleeps at most 2 ms between pulls (instead
  of backing off to 50 ms);
* ``"pinned"``: no what-if; a label for the runs made on the commit that pins each node's
  messages to one actor and wakes Flower's injector on push (fedudp as it is then).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
import types
from pathlib import Path

__all__ = ["make_cfg", "child"]


def make_cfg(spec: dict):
    """The benchmark's workload for ``spec`` (see ``bench_cluster.py``).

    Parameters
    ----------
    spec : dict
        owners, engine, per, rounds, ckpt, features, rpu (records per user), npz (a path or
        None), address (a Ray cluster or None).

    Returns
    -------
    fedudp.config.RunConfig
    """
    from fedudp.config import RunConfig

    n, rpu, feats = spec["owners"], spec.get("rpu", 1), spec.get("features", 20)
    cfg = RunConfig()
    cfg.progress = False
    cfg.method = "joint_dp"
    cfg.engine = spec["engine"]
    if spec.get("npz"):
        cfg.dataset.name = "npz"
        cfg.dataset.path = spec["npz"]
        cfg.dataset.columns.owner = "owner"
        cfg.dataset.classes = 10
        cfg.dataset.input_shape = [feats]
        cfg.dataset.test_fraction = 0.0
        cfg.partition.owner_rule = "given"
        cfg.public.users = 10 * n
        cfg.public.owner_capacity = 10
        cfg.public.records_per_user = rpu
    else:
        cfg.dataset.num_records = 10 * n * rpu
        cfg.dataset.pool_train = 10 * n * rpu
        cfg.dataset.pool_test = max(2 * n, 1000)
        cfg.dataset.features = feats
        cfg.partition.scheme = "iid"
        cfg.partition.records_per_user = rpu
    cfg.partition.num_owners = n
    cfg.train.rounds = spec["rounds"]
    cfg.train.sampling_rate = 0.5
    cfg.train.eval_every = 10**6  # after the last round only
    cfg.privacy.noise_multiplier = 3.0
    cfg.privacy.epsilon = 1e6
    cfg.engine_opts.threads = 1
    cfg.engine_opts.num_cpus = 1.0
    cfg.engine_opts.owners_per_node = spec["per"]
    if spec.get("address"):
        cfg.engine_opts.address = spec["address"]
    cfg.checkpoint.every = spec.get("ckpt", 0)  # 0: none
    return cfg


def _timed(cls, name: str, sink: list, points: dict | None = None) -> None:
    orig = getattr(cls, name)

    def wrapper(self, *a, **k):
        t0 = time.perf_counter()
        if points is not None:
            points.setdefault(f"t_{name}0", time.time())
        try:
            return orig(self, *a, **k)
        finally:
            sink.append(time.perf_counter() - t0)
            if points is not None:
                points.setdefault(f"t_{name}1", time.time())

    setattr(cls, name, wrapper)


def _fast_flower_queue() -> None:
    """Flower's simulation: pushed messages to the actors' queue every 2 ms (what-if)."""
    import flwr.server.superlink.fleet.vce.vce_api as vce

    def add_messages_to_queue(state, queue, nodes_mapping, f_stop: threading.Event) -> None:
        while not f_stop.is_set():
            for node_id in nodes_mapping:
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(0.002)

    vce.add_messages_to_queue = add_messages_to_queue


def _instrument_flower(points: dict, connect: list, exchanges: list, variant: str) -> None:
    import fedudp.flower.server_app as server

    _timed(server.FlowerTransport, "_connect", connect, points)
    _timed(server.FlowerTransport, "_exchange", exchanges)
    orig_connect = server.FlowerTransport._connect

    def connect_spy(self) -> None:
        get_ids = self.grid.get_node_ids

        def ids():
            got = get_ids()
            if len(list(got)) >= len(self.blocks):
                points.setdefault("t_nodes", time.time())
            return got

        self.grid.get_node_ids = ids
        try:
            orig_connect(self)
        finally:
            self.grid.get_node_ids = get_ids

    server.FlowerTransport._connect = connect_spy
    if variant in ("flower_poll_2ms", "poll_2ms"):
        _fast_flower_queue()
    if variant == "poll_2ms":
        real = time.sleep
        server.time = types.SimpleNamespace(  # type: ignore[assignment]
            time=time.time, sleep=lambda s: real(min(s, 0.002))
        )


def child(spec: dict, t_child0: float) -> None:
    """One run of ``spec`` in this process; prints one ``RESULT {json}`` line.

    Parameters
    ----------
    spec : dict
        See ``make_cfg``; ``variant`` as in this module's docstring.
    t_child0 : float
        When this process started (epoch seconds).
    """
    import torch

    torch.set_num_threads(1)
    import fedudp.engines.local as local
    from fedudp.run import run

    times: list[float] = []
    connect: list[float] = []
    exchanges: list[float] = []
    points: dict = {"t_child0": t_child0}
    _timed(local.LocalTransport, "train", times)
    if spec["engine"] == "flower":
        import fedudp.flower.server_app as server

        _timed(server.FlowerTransport, "train", times)
        _instrument_flower(points, connect, exchanges, spec.get("variant", ""))
    cfg = make_cfg(spec)
    points["t_run0"] = time.time()
    with tempfile.TemporaryDirectory() as d:
        s = run(cfg, Path(d))
    points["t_end"] = time.time()
    print(
        "RESULT "
        + json.dumps(
            {
                "rounds": times,
                "exchanges": exchanges,
                "connect_s": connect[0] if connect else None,
                "points": points,
                "stop_reason": s["stop_reason"],
                "flower_nodes": s.get("flower_nodes"),
            }
        ),
        flush=True,
    )
