"""A block of owners' federation from natural data (``fedudp.build.data.federation(cfg,
owners=...)``; a Flower SuperNode's, ``engine_opts.owners_per_node``).

The public plan (which users go to which owner) is made as for the whole federation; the
block's federation is the whole one's ``block(a, b)``, exactly. ``dataset.name=npz`` plans from
the labels, users, owners and metadata only (``fedudp.data.row_reads``: every record's index
stands in for its features) and then reads the block's features by row; the other formats read
every record and keep the block's (docs/engines.md#multi-node).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedudp.build.plan import input_spec
from fedudp.config import OwnerRule, RunConfig
from fedudp.data.federation import Federation
from fedudp.data.records import Records
from fedudp.data.row_reads import RowReader, read_npz_plan

__all__ = ["natural_block"]


def natural_block(cfg: RunConfig, records: Any, owners: range) -> Federation:
    """The block ``owners`` of a natural federation.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    records : Any
        In-memory records (``dataset.name=memory``), or None.
    owners : range
        The block's owners.

    Returns
    -------
    Federation
        Equal to the whole federation's ``block(owners.start, owners.stop)``.
    """
    from fedudp.build.data import check_public, natural_records

    if str(cfg.dataset.name) == "npz" and records is None:
        return _npz_block(cfg, owners)
    train, test = natural_records(cfg, records)
    check_public(cfg, train)
    return _layout(cfg, train, test).block(owners.start, owners.stop)


def _layout(cfg: RunConfig, train: Records, test: Records | None) -> Federation:
    """``fedudp.build.data.federation``'s layout of grouped records (the declared owners)."""
    from fedudp.data import natural as nat

    n = int(cfg.partition.num_owners)
    if OwnerRule(cfg.partition.owner_rule).value in ("random", "dirichlet"):
        return nat.layout(train, test, n, owner_ids=np.arange(n, dtype=np.int64))
    return nat.layout(train, test, n)


def _npz_block(cfg: RunConfig, owners: range) -> Federation:
    """The block of an npz federation: planned from the record indices, features by row."""
    from fedudp.build.data import _group, check_public, declared_inputs
    from fedudp.build.plan import read_request

    req = read_request(cfg)
    if not req.path or not isinstance(req.features, str):
        train, test = natural_records_whole(cfg)
        return _layout(cfg, train, test).block(owners.start, owners.stop)

    def plan(path: str) -> tuple[Records, RowReader]:
        return read_npz_plan(
            path,
            features=str(req.features),
            label=req.label,
            user=req.user,
            owner=req.owner,
            meta=tuple(req.meta),
            classes=req.classes,
        )

    train, rows = plan(req.path)
    test, test_rows = plan(req.test_path) if req.test_path else (None, None)
    classes = input_spec(cfg)[1]
    train = replace(train, classes=classes)  # the labels checked against the declaration
    test = None if test is None else replace(test, classes=classes)
    held_out = test is None  # dataset.test_fraction: test records are training-file rows
    train, test = _group(cfg, train, test)
    check_public(cfg, train)
    fed = _layout(cfg, train, test).block(owners.start, owners.stop)
    x = rows.rows(fed.x.numpy())
    src = rows if held_out or test_rows is None else test_rows
    x_test = src.rows(fed.x_test.numpy())
    # the declared shape and feature type, on the block's features (declared_inputs' checks)
    declared_inputs(cfg, _as_records(x, fed, rows.path), None)
    fed.x, fed.x_test = torch.from_numpy(x), torch.from_numpy(x_test)
    return fed


def natural_records_whole(cfg: RunConfig) -> tuple[Records, Records | None]:
    """Every record (a format or request that cannot be read by row)."""
    from fedudp.build.data import natural_records

    return natural_records(cfg)


def _as_records(x: np.ndarray, fed: Federation, source: str) -> Records:
    """The block's features as records (for ``declared_inputs``' checks only)."""
    y = fed.y.numpy()
    return Records(x, y, np.zeros(len(y), dtype=np.int64), None, int(fed.num_classes), {}, source)
