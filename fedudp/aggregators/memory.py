"""Pre-flight memory check for estimators that need the cohort's per-unit rows.

An aggregator with ``needs_per_user_vectors`` receives one row of ``dim`` shared coordinates
per sampled unit, held once on the billboard as the owners produced them
(docs/architecture.md#one-round-as-data); the estimator reads them in float64 chunks
(``fedudp.aggregators.rows``) and adds its own working set (``RowsAggregator.working_bytes``:
the winsorized mean's stored range bins, the friend counts' float64 blocks, few users' rotated
block). With 60,000 users and the paper CNN the rows alone are GiBs, so a run whose estimate
exceeds the memory available is refused *before any work*, with the estimate in the message;
sum aggregators (``gaussian``, ``none``) need O(dim).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from fedudp.aggregators.rows import DISTANCE_CHUNK, chunks_bytes  # noqa: F401
from fedudp.errors import ConfigError

if TYPE_CHECKING:
    from fedudp.aggregators.base import Aggregator

__all__ = [
    "GIB",
    "OWNER_ROW_COPIES",
    "available_bytes",
    "check_rows_fit",
    "cohort_rows",
    "rows_bytes",
]

GIB = 1024**3
# The rows may be held twice for a moment: engine=local's ``Owners.reply`` writes a planned
# cohort's row chunks into one matrix as they come (``fedudp.protocol.messages.rows_reply``), but a
# natural federation's cohort (computed sorted by size) is put back in order by a gathered copy,
# and on engine=flower the owners' replies are held while ``Contribution.merge`` writes them into
# one matrix. The estimate counts the matrix twice (an upper bound for the planned case).
OWNER_ROW_COPIES = 2


def cohort_rows(rate: float, population: int) -> int:
    """A high quantile of the Poisson cohort's size: q N + 6 sd, at most N.

    Parameters
    ----------
    rate : float
        The Poisson sampling rate q.
    population : int
        N.

    Returns
    -------
    int
        The rows planned for.
    """
    if rate >= 1.0:
        return int(population)
    sd = math.sqrt(population * rate * (1.0 - rate))
    return int(min(population, math.ceil(rate * population + 6 * sd + 10)))


def rows_bytes(rows: int, dim: int, itemsize: int, aggregator: Aggregator | None = None) -> int:
    """Peak bytes of one release's rows: the [rows, dim] matrix in the owners' dtype
    (``itemsize``) and the larger of what comes on top of it at any one time: its copy while
    the owners assemble it (``OWNER_ROW_COPIES``), or the estimator's working set
    (``aggregator.working_bytes``; without an aggregator, a few float64 chunks).

    Parameters
    ----------
    rows : int
        The cohort's rows.
    dim : int
        Their width.
    itemsize : int
        Bytes per value in the owners' dtype.
    aggregator : Aggregator or None, default None
        The estimator whose ``working_bytes`` may come on top (None: a few float64 chunks).

    Returns
    -------
    int
        Bytes.
    """
    matrix = int(rows) * int(dim) * int(itemsize)
    work = (
        aggregator.working_bytes(int(rows), int(dim))
        if aggregator is not None and hasattr(aggregator, "working_bytes")
        else chunks_bytes()
    )
    return int(matrix + max((OWNER_ROW_COPIES - 1) * matrix, work))


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where unknown).

    Returns
    -------
    int or None
        Bytes.
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_rows_fit(
    aggregator: Aggregator, dim: int, itemsize: int, available: int | None = None
) -> int:
    """Estimated bytes of one release's rows; ``ConfigError`` (naming the need) if an
    aggregator that needs them would not fit in the memory available.

    Parameters
    ----------
    aggregator : Aggregator
        The row estimator.
    dim : int
        The rows' width.
    itemsize : int
        Bytes per value.
    available : int or None, default None
        The bytes available (None: ``available_bytes()``).

    Returns
    -------
    int
        The estimated bytes.

    Raises
    ------
    ConfigError
        The rows would not fit (naming what they need).
    """
    if aggregator is None or not aggregator.needs_per_user_vectors:
        return 0
    s = aggregator.sampling
    rows = cohort_rows(s.rate, s.population)
    need = rows_bytes(rows, dim, itemsize, aggregator)
    have = available_bytes() if available is None else available
    if have is not None and need > have:
        raise ConfigError(
            f"aggregator={aggregator.name}: its per-unit rows need about {need / GIB:.1f} GiB "
            f"(up to {rows} units x {dim} shared coordinates, held once in the owners' dtype, "
            f"copied once while the owners assemble them, plus the estimator's float64 working "
            f"chunks), {have / GIB:.1f} GiB is available; lower train.sampling_rate or the "
            "number of users, use privacy.unit=owner, or an aggregator that takes sums (gaussian)"
        )
    return need
