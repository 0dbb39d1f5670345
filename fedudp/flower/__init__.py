"""fedudp's Flower integration, one optional package (``pip install 'fedudp[flower]'``;
docs/flower-apps.md, docs/engines.md).

User-level DP inside any Flower app (Message API, flwr 1.42):

* ``UserLevelDP`` (``strategy``): the server-side strategy wrapper, which releases one private
  mean update per round through the billboard's release path;
* ``user_level_mod`` (``mod``): the client mod, which trains the app's step once per sampled
  user and replies with their clipped updates; ``client_users`` gives an app its client's
  users; ``TorchTraining`` (``fast``) is the mod's fast path;
* ``fedudp.flower.contract``: the run-config contract (``python -m fedudp.flower.contract``).

``engine=flower`` (a fedudp run on Flower): ``server_app`` (the transport and the simulation),
``client_app`` (one owner per SuperNode), ``wire`` (the one record vocabulary and codec, shared
with the wrapper), ``ray_watchdog``; ``entry`` is the ``flwr run`` ServerApp. The runner reaches
this package through the engine registry, by name (``fedudp.engines.ENGINES``).

The names below are imported on first use, so that ``fedudp.flower.mod`` and
``fedudp.flower.client_app`` load nothing of the server side. Without Flower installed,
importing this package raises ``ImportError`` saying what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

INSTALL_HINT = (
    "fedudp.flower needs Flower: pip install 'fedudp[flower]' (the local engine needs nothing more)"
)

try:
    import flwr  # noqa: F401
except ImportError as e:  # the optional extra is absent: say what to install
    raise ImportError(INSTALL_HINT) from e

__all__ = [
    "UserLevelDP",
    "RunFailed",
    "user_level_mod",
    "client_users",
    "sampled_users",
    "TorchTraining",
    "RUN_CONFIG",
    "RunConfigError",
    "K_DP",
    "K_CONTRIB",
    "K_COUNTS",
    "K_PERSONAL",
]

# each public name and the module that holds it
_WHERE = {
    "UserLevelDP": "strategy",
    "RunFailed": "outcome",
    "user_level_mod": "mod",
    "client_users": "mod",
    "sampled_users": "mod",
    "TorchTraining": "fast",
    "RUN_CONFIG": "fast_data",
    "RunConfigError": "contract",
    "K_DP": "wire",
    "K_CONTRIB": "wire",
    "K_COUNTS": "wire",
    "K_PERSONAL": "wire",
}

if TYPE_CHECKING:
    from fedudp.flower.contract import RunConfigError
    from fedudp.flower.fast import TorchTraining
    from fedudp.flower.fast_data import RUN_CONFIG
    from fedudp.flower.mod import client_users, sampled_users, user_level_mod
    from fedudp.flower.outcome import RunFailed
    from fedudp.flower.strategy import UserLevelDP
    from fedudp.flower.wire import K_CONTRIB, K_COUNTS, K_DP, K_PERSONAL


def __getattr__(name: str) -> Any:
    """A public name, from its module (imported on first use)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'fedudp.flower' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fedudp.flower.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
