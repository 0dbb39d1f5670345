"""A block of owners' federation from natural data (``fedudp.build.data.federation(cfg,
owners=...)``; a Flower SuperNode's, ``engine_opts.owners_per_node``).

The public plan (which users go to which owner) is made as for the whole federation; the
block's federation is the whole one's ``block(a, b)``, exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedudp.config import OwnerRule, RunConfig
from fedudp.data.federation import Federation

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
    from fedudp.data import natural as nat

    train, test = natural_records(cfg, records)
    check_public(cfg, train)
    n = int(cfg.partition.num_owners)
    if OwnerRule(cfg.partition.owner_rule).value in ("random", "dirichlet"):
        whole = nat.layout(train, test, n, owner_ids=np.arange(n, dtype=np.int64))
    else:
        whole = nat.layout(train, test, n)
    return whole.block(owners.start, owners.stop)
