"""The grids of ``bench_cluster.py --grid`` and the ``.npz`` data set of the memory grid.

Each grid is a list of runs (``_cluster_child.make_cfg``'s spec without rounds and reps);
``bench_cluster.run_grid`` repeats it ``--reps`` times, the repetitions interleaved.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["GRIDS", "npz_file", "NPZ_DIR"]

NPZ_DIR = Path("/tmp/fedudp-bench-npz")


def _run(n: int, engine: str, nodes: int = 1, **kw) -> dict:
    spec = {"owners": n, "engine": engine, "per": 1 if engine == "local" else n // 2}
    spec.update(nodes=nodes, features=20, rpu=1, npz=None, variant="")
    spec.update(kw)
    return spec


def scale() -> list[dict]:
    """Local against Flower on 1 node and on 2 nodes (one actor each), n/2 owners a node."""
    return [
        _run(n, e, nodes)
        for n in (1000, 5000, 10000)
        for e, nodes in (("local", 1), ("flower", 1), ("flower", 2))
    ]


def memory() -> list[dict]:
    """Owners' features read by row from an uncompressed .npz (1,000 float32 features, 10
    users of 10 records per owner: 400 kB an owner), n/2 owners a node."""
    big = {"features": 1000, "rpu": 10, "npz": True}
    return [
        _run(n, e, nodes, **big)
        for n in (500, 1000, 2000)
        for e, nodes in (("local", 1), ("flower", 1), ("flower", 2))
    ]


def overhead() -> list[dict]:
    """A round's fixed cost on Flower: the polling what-ifs (``_cluster_child``), a round with
    almost no work (20 owners), and a heavier round (784 features, 5 records per user)."""
    return [
        _run(1000, "local"),
        _run(1000, "flower"),
        _run(1000, "flower", variant="flower_poll_2ms"),
        _run(1000, "flower", variant="poll_2ms"),
        _run(20, "local"),
        _run(20, "flower"),
        _run(20, "flower", variant="poll_2ms"),
        _run(1000, "local", features=784, rpu=5),
        _run(1000, "flower", features=784, rpu=5),
    ]


def poll() -> list[dict]:
    """The polling what-ifs over more rounds (run with ``--rounds 12``): 20 and 1,000 owners."""
    return [
        _run(n, e, variant=v)
        for n in (20, 1000)
        for e, v in (
            ("local", ""),
            ("flower", ""),
            ("flower", "flower_poll_2ms"),
            ("flower", "poll_2ms"),
        )
    ]


def heavy() -> list[dict]:
    """A heavier round (784 features, 5 records per user, 1,000 owners; ``--rounds 12``):
    local against Flower on 1 and on 2 nodes."""
    return [
        _run(1000, e, nodes, features=784, rpu=5)
        for e, nodes in (("local", 1), ("flower", 1), ("flower", 2))
    ]


def trace() -> list[dict]:
    """Which blocks each actor serves (``--rounds 8``): npz at 1,000 owners, 1 and 2 nodes."""
    big = {"features": 1000, "rpu": 10, "npz": True, "trace": True}
    return [_run(1000, "flower", nodes, **big) for nodes in (1, 2)]


def pinned_memory() -> list[dict]:
    """The memory and trace grids again on the commit that sends each node's messages to one
    actor (``fedudp.flower.ray_backend``, ``using_backend(pin=True)``) and wakes Flower's
    message injector on push (variant ``"pinned"``: fedudp as it is then; ``--rounds 8``)."""
    big = {"features": 1000, "rpu": 10, "npz": True, "variant": "pinned"}
    return [
        _run(n, e, nodes, **big, trace=e == "flower")
        for n in (1000, 2000)
        for e, nodes in (("local", 1), ("flower", 1), ("flower", 2))
    ]


def pinned_poll() -> list[dict]:
    """The fixed cost of a Flower round on that commit (variant ``"pinned"``; ``--rounds 12``):
    20 and 1,000 owners, local against Flower on 1 and on 2 nodes."""
    return [
        _run(n, e, nodes, variant="pinned")
        for n in (20, 1000)
        for e, nodes in (("local", 1), ("flower", 1), ("flower", 2))
    ]


def pinned_scale() -> list[dict]:
    """5,000 and 10,000 owners on that commit (variant ``"pinned"``): local against Flower on
    1 and on 2 nodes, connect time included."""
    return [
        _run(n, e, nodes, variant="pinned")
        for n in (5000, 10000)
        for e, nodes in (("local", 1), ("flower", 1), ("flower", 2))
    ]


def smoke() -> list[dict]:
    """A quick check of the machinery (not reported)."""
    return [_run(100, "flower", 2), _run(100, "flower", 1, variant="poll_2ms")]


GRIDS = {
    "scale": scale,
    "memory": memory,
    "overhead": overhead,
    "poll": poll,
    "heavy": heavy,
    "trace": trace,
    "pinned_memory": pinned_memory,
    "pinned_poll": pinned_poll,
    "pinned_scale": pinned_scale,
    "smoke": smoke,
}


def npz_file(n: int, features: int, rpu: int, write: bool = True) -> Path:
    """An uncompressed ``.npz`` of ``n`` owners × 10 users × ``rpu`` records (float32
    features ``x``, labels ``y`` of 10 classes from a random linear teacher, ``user``,
    ``owner``), written once to ``NPZ_DIR``.

    Parameters
    ----------
    n, features, rpu : int
    write : bool, default True
        False: only the path.

    Returns
    -------
    pathlib.Path
    """
    path = NPZ_DIR / f"fed-{n}-{features}-{rpu}.npz"
    if path.is_file() or not write:
        return path
    NPZ_DIR.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    records = n * 10 * rpu
    x = rng.standard_normal((records, features), dtype=np.float32)
    w = rng.standard_normal((features, 10), dtype=np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int64)
    user = np.repeat(np.arange(n * 10, dtype=np.int64), rpu)
    owner = user // 10
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, x=x, y=y, user=user, owner=owner)
    tmp.rename(path)
    return path
