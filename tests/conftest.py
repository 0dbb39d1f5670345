"""Shared test helpers: tiny configs that run in about a second on the local engine."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from fedudp.config import RunConfig  # importing fedudp turns Flower/Ray telemetry off


def set_key(cfg: RunConfig, key: str, value) -> None:
    obj = cfg
    *path, last = key.split(".")
    for p in path:
        obj = obj[p] if isinstance(obj, dict) else getattr(obj, p)
    if isinstance(obj, dict):  # estimator.* (the registered estimators' options)
        if last not in obj:
            raise AttributeError(f"no config key {key}")
        obj[last] = value
        return
    if not hasattr(obj, last):
        raise AttributeError(f"no config key {key}")
    setattr(obj, last, value)


def tiny_cfg(method: str = "joint_dp", **kw) -> RunConfig:
    """4 owners, 160 synthetic records (one per user), 3 rounds; ``kw``: dotted keys."""
    cfg = RunConfig()
    cfg.progress = False
    cfg.method = method
    cfg.dataset.num_records, cfg.dataset.pool_train, cfg.dataset.pool_test = 160, 1000, 200
    cfg.dataset.features = 12
    cfg.partition.num_owners = 4
    cfg.train.rounds = 3
    cfg.train.batch_size = 8
    for k, v in kw.items():
        set_key(cfg, k.replace("__", "."), v)
    return cfg


def write_idx(path: Path, arr: np.ndarray, gz: bool = True) -> None:
    """Write a uint8 IDX file (magic 2051 images N x rows x cols, 2049 labels N)."""
    if arr.ndim == 3:
        head = struct.pack(">IIII", 2051, *arr.shape)
    else:
        head = struct.pack(">II", 2049, arr.shape[0])
    blob = head + arr.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(blob)
    else:
        path.write_bytes(blob)


def tiny_mnist(root: Path, n_train: int = 600, n_test: int = 200, seed: int = 0) -> Path:
    """A learnable MNIST-shaped IDX dataset under ``root/mnist`` (class = bright 7x7 block)."""
    rng = np.random.default_rng(seed)

    def make(n):
        y = rng.integers(0, 10, n)
        x = rng.integers(0, 60, (n, 28, 28))
        for i, c in enumerate(y):
            r, q = divmod(int(c), 4)
            x[i, 7 * r : 7 * r + 7, 7 * q : 7 * q + 7] += 180
        return x.clip(0, 255).astype(np.uint8), y.astype(np.uint8)

    tx, ty = make(n_train)
    vx, vy = make(n_test)
    d = root / "mnist"
    write_idx(d / "train-images-idx3-ubyte", tx)
    write_idx(d / "train-labels-idx1-ubyte", ty)
    write_idx(d / "t10k-images-idx3-ubyte", vx, gz=False)
    write_idx(d / "t10k-labels-idx1-ubyte", vy, gz=False)
    return root


def interrupt_after(monkeypatch, round_: int) -> None:
    """SIGINT to this process right after round ``round_``'s checkpoint is written."""
    import os
    import signal

    from fedudp.protocol import checkpoint

    save = checkpoint.Checkpointer.save

    def patched(self, r, state):
        path = save(self, r, state)
        if r == round_:
            os.kill(os.getpid(), signal.SIGINT)
        return path

    monkeypatch.setattr(checkpoint.Checkpointer, "save", patched)


# the test files of tests/engines/ that start Ray (engine=flower, flwr's simulation, flwr run, a
# Ray cluster); the others there call the Flower mod, the wrapper or the contract in-process
RAY_FILES = (
    "test_flower_engine.py",
    "test_flower_user_dp.py",
    "test_bench_flower_user_dp.py",
    "test_flower_flwr_run.py",
    "test_flower_user_dp_flwr_run.py",
    "test_flower_ray_cluster.py",
)


# modules with an expensive module-scoped fixture (see pytest_xdist_make_scheduler)
ONE_WORKER_MODULES = ("tests/billboard/test_canaries.py",)


def _may_start_ray(nodeid: str) -> bool:
    """Tests that may start Ray: the files above, and any other test whose id names flower
    (a test parametrized over the engines)."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/engines/"):
        return path.rsplit("/", 1)[-1] in RAY_FILES
    return "flower" in nodeid


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (the README's ``make test``: ``-n 2``) every test that may start Ray
    runs on one worker, one after the other: one Ray on the machine at a time, as without xdist
    (Ray's ports and /tmp/ray, the module-scoped Ray of tests/engines/test_flower_engine.py);
    every other test is its own unit of work, sent to whichever worker is free, except two
    groups that share an expensive computation in one process (below). (xdist's
    ``--dist loadgroup`` marks do not reach its scheduler under pytest 9.2: it renames
    ``item._nodeid``, which pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayOnOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if _may_start_ray(nodeid):
                return "ray"
            # the tests that prepare the huang_alg1 preset share one worker, so its noise
            # calibration (4,000 rounds at q = 1/2000: about 7 s of PLDs) is computed once and
            # found in the accountant's in-process caches by the others
            if "huang_alg1" in nodeid:
                return "huang_alg1"
            # a module whose module-scoped fixture is expensive (canaries: two audited runs,
            # about 5 s) runs on one worker, so the fixture is built once, not once per worker
            path = nodeid.split("::")[0]
            return path if path in ONE_WORKER_MODULES else nodeid

    return RayOnOneWorker(config, log)
