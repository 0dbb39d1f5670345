"""Benchmark-only: on ``PYTHONPATH`` of a ``bench_cluster.py --trace-blocks`` run, every Python
process of the run (the Ray client actors included) logs which owners' block each
``fedudp.flower.client_app.block_side`` call served and whether that process had read it
before, one line ``pid start stop new`` appended to ``$FEDUDP_BENCH_BLOCK_LOG``."""

from __future__ import annotations

import importlib.abc
import os
import sys

_LOG = os.environ.get("FEDUDP_BENCH_BLOCK_LOG")
_NAME = "fedudp.flower.client_app"


def _patch(mod) -> None:
    orig = mod.block_side

    def block_side(cfg_json, block):
        key = (mod._key(cfg_json), block.start, block.stop)
        new = key not in mod._BLOCKS
        out = orig(cfg_json, block)
        with open(_LOG, "a") as f:
            f.write(f"{os.getpid()} {block.start} {block.stop} {int(new)}\n")
        return out

    mod.block_side = block_side


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _NAME:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def run(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = run  # type: ignore[method-assign]
        return spec


if _LOG:
    import importlib.util

    sys.meta_path.insert(0, _Finder())
