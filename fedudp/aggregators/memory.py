"""Pre-flight memory check for estimators that need the cohort's per-unit rows.

An aggregator with ``needs_per_user_vectors`` receives one row of ``dim`` shared coordinates
per sampled unit and holds them as one matrix on the billboard
(docs/architecture.md#one-round-as-data), then works
on float64 copies (centring, the randomized Hadamard rotation padded to a power of two, the
friend counts' distance blocks). With 60,000 users and the paper CNN that is tens of GiB, so
such a run is refused *before any work* when the estimate exceeds the memory available,
with the estimate in the message; sum aggregators (``gaussian``, ``none``) need O(dim).
"""
from __future__ import annotations

import math

from fedudp.config import ConfigError

GIB = 1024 ** 3
DISTANCE_CHUNK = 1024      # rows per block of the friend counts (outlier.friend_counts)


def cohort_rows(rate: float, population: int) -> int:
    """A high quantile of the Poisson cohort's size: q N + 6 sd, at most N."""
    if rate >= 1.0:
        return int(population)
    sd = math.sqrt(population * rate * (1.0 - rate))
    return int(min(population, math.ceil(rate * population + 6 * sd + 10)))


def rows_bytes(rows: int, dim: int, itemsize: int) -> int:
    """The cohort matrix, two float64 working copies padded to a power of two, and one block
    of pairwise distances (a generous bound for every row estimator here)."""
    padded = 1 << max(dim - 1, 0).bit_length()
    return int(rows * dim * itemsize + 2 * rows * padded * 8 + 2 * DISTANCE_CHUNK * rows * 8)


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_rows_fit(aggregator, dim: int, itemsize: int, available: int | None = None) -> int:
    """Estimated bytes of one release's rows; ``ConfigError`` (naming the need) if an
    aggregator that needs them would not fit in the memory available."""
    if aggregator is None or not aggregator.needs_per_user_vectors:
        return 0
    s = aggregator.sampling
    rows = cohort_rows(s.rate, s.population)
    need = rows_bytes(rows, dim, itemsize)
    have = available_bytes() if available is None else available
    if have is not None and need > have:
        raise ConfigError(
            f"aggregator={aggregator.name}: its per-unit rows need about {need / GIB:.1f} GiB "
            f"(up to {rows} units x {dim} shared coordinates, plus float64 working copies), "
            f"{have / GIB:.1f} GiB is available; lower train.sampling_rate or the number of "
            "users, use privacy.unit=owner, or an aggregator that takes sums (gaussian)")
    return need
