"""The engines a run's round loop runs on: one registry, ``ENGINES`` (``fedudp.registry``;
docs/engines.md).

``local`` is ``fedudp.engines.local.execute`` (in this process, nothing more to install).
``flower`` is declared *by name*: its module, ``fedudp.flower.server_app``, sits above the
runner (``tests/test_layers.py``) and needs the ``flower`` extra, so it is imported with
``importlib`` on first use, never by an import statement here. ``require(name)`` says, in one
line and before any long work, what a missing extra needs (``fedudp.run`` calls it at the start
of a run); ``execute_for(name)`` is the engine's ``execute``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedudp.engines import local
from fedudp.errors import ConfigError
from fedudp.registry import Registry

__all__ = ["Engine", "ENGINES", "FLOWER_HINT", "require", "execute_for"]

# an engine's execute(cfg, settings, owners, fed, constraint, drive, grid=None) -> RoundsResult
Execute = Callable[..., Any]

FLOWER_HINT = (
    "engine=flower needs Flower: pip install 'fedudp[flower]' (the local engine needs nothing more)"
)


@dataclass(frozen=True)
class Engine:
    """One engine: where its ``execute`` lives and what it needs installed.

    Parameters
    ----------
    module : str
        The module that holds ``execute`` (imported by name on first use unless ``execute`` is
        given).
    execute : callable or None
        The function itself, for an engine of this package (None: ``module.execute``).
    needs : tuple[str, ...]
        Top-level packages that must be importable (an optional extra's).
    missing : str
        The one-line error when one of ``needs`` is not.
    """

    module: str
    execute: Execute | None = None
    needs: tuple[str, ...] = ()
    missing: str = ""

    def check(self) -> None:
        """Raise the one-line ``ConfigError`` ``missing`` when a needed package is absent.

        Raises
        ------
        ConfigError
            A package of ``needs`` cannot be imported.
        """
        for package in self.needs:
            try:
                found = importlib.util.find_spec(package) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                raise ConfigError(self.missing or f"engine: {self.module} needs {package}")

    def load(self) -> Execute:
        """The engine's ``execute`` (its module imported on first use).

        Returns
        -------
        callable

        Raises
        ------
        ConfigError
            A needed package is absent (``check``).
        """
        self.check()
        if self.execute is not None:
            return self.execute
        execute: Execute = importlib.import_module(self.module).execute
        return execute


ENGINES: Registry[Engine] = Registry("engine", "engine")
ENGINES.add("local", Engine("fedudp.engines.local", local.execute))
# by name: fedudp.flower is above the runner and optional (pip install 'fedudp[flower]')
ENGINES.add("flower", Engine("fedudp.flower.server_app", needs=("flwr",), missing=FLOWER_HINT))


def require(name: str) -> None:
    """Check, before any long work, that engine ``name`` can run here.

    Parameters
    ----------
    name : str
        The ``engine`` config value.

    Raises
    ------
    ConfigError
        An unknown engine, or one whose extra is not installed (one line saying what to
        install).
    """
    if name not in ENGINES:
        raise ConfigError(ENGINES.unknown(name))
    ENGINES.get(name).check()


def execute_for(name: str) -> Execute:
    """Engine ``name``'s ``execute``.

    Parameters
    ----------
    name : str
        The ``engine`` config value.

    Returns
    -------
    callable
        ``execute(cfg, settings, owners, fed, constraint, drive, grid=None)``.

    Raises
    ------
    ConfigError
        As ``require``.
    """
    require(name)
    return ENGINES.get(name).load()
