"""fedudp: federated-learning simulation with user-level and joint differential privacy.

    import fedudp
    result = fedudp.simulate({"method": "joint_dp", "train.rounds": 3})

``simulate``, ``SimulationResult``, ``RunConfig``, ``ConfigError``, ``config_from_overrides``,
``Records`` and ``from_arrays`` (your own federation, docs/your-data.md) and ``__version__`` are imported on first use (``import fedudp`` alone stays light: every fedudp process, Ray workers
included, imports the package first).

Flower and Ray read the two variables below at import time; with no network, telemetry and usage
reporting stay off. This is the one place they are set.
"""

import os
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

_API = {
    "simulate": "fedudp.api",
    "SimulationResult": "fedudp.api",
    "RunConfig": "fedudp.config",
    "ConfigError": "fedudp.config",
    "config_from_overrides": "fedudp.config",
    "Records": "fedudp.data.records",
    "from_arrays": "fedudp.data.records",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed package's metadata (fedudp/provenance.py)
        from fedudp.provenance import version

        return version()
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'fedudp' has no attribute {name!r}")
