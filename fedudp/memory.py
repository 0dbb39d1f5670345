"""How much memory this machine has, and a refusal of arrays that cannot fit it (standard
library only, so that a command line can check its numbers before importing torch).

``fedudp.models.footprint`` uses it for a model's lower bound; ``fedudp-audit`` for the
releases it keeps (issue 49).
"""

from __future__ import annotations

import os
from pathlib import Path

from fedudp.errors import ConfigError

__all__ = ["memory_bytes", "size_text", "check_arrays"]


def memory_bytes(device: str = "cpu") -> int | None:
    """The memory an allocation on ``device`` can use: the machine's physical memory (its
    cgroup's ``memory.max`` where that is lower), or a CUDA device's total memory; None where
    it cannot be read.

    Parameters
    ----------
    device : str, default "cpu"
        ``cpu`` or a CUDA device (``cuda``, ``cuda:1``).

    Returns
    -------
    int or None
        Bytes.
    """
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            return None
        index = int(device.partition(":")[2] or 0)
        return int(torch.cuda.get_device_properties(index).total_memory)
    try:
        total = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return total


def size_text(n: float) -> str:
    """``6.4e12`` -> ``5.82 TiB`` (binary units).

    Parameters
    ----------
    n : float
        Bytes.

    Returns
    -------
    str
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError  # pragma: no cover - the loop returns


def check_arrays(what: str, elements: float, itemsize: int, fix: str) -> None:
    """Refuse (``ConfigError``: ``<what>: ...; <fix>``) arrays of ``elements`` elements of
    ``itemsize`` bytes that exceed this machine's memory, before they are allocated.

    Parameters
    ----------
    what : str
        What needs them (the message's start).
    elements : float
        How many elements.
    itemsize : int
        Bytes per element.
    fix : str
        What to change (the message's end).

    Raises
    ------
    ConfigError
        When they exceed this machine's memory.
    """
    have = memory_bytes()
    need = float(elements) * itemsize
    if have is not None and need > have:
        raise ConfigError(
            f"{what}: the releases it keeps need {size_text(need)}, over this machine's "
            f"{size_text(have)} of memory; {fix}"
        )
