"""Your own extensions, used from the ``fedudp`` command line and the Python API
(docs/architecture.md#plugins).

A plugin is an importable module that registers, when imported, any of: an estimator
(``@fedudp.aggregators.register``), a data reader (``fedudp.data.readers.register``), a training
algorithm (``fedudp.algorithms.register``) or a model (``fedudp.models.register``). Two ways to
have it imported before the configuration is checked:

* the config key ``plugins``: ``fedudp plugins=[my_pkg.my_ext] aggregator=my_estimator ...``
  (the module must be importable: installed, or on ``PYTHONPATH``);
* an installed package's entry point in the group ``fedudp.plugins`` (``[project.entry-points.
  "fedudp.plugins"] my_ext = "my_pkg.my_ext"`` in its pyproject.toml), loaded always.

Standard library only; a module that cannot be imported is a one-line ``ConfigError`` naming the
key (``plugins``) and the module.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from fedudp.errors import ConfigError

__all__ = ["GROUP", "load", "load_entry_points"]

GROUP = "fedudp.plugins"
_entry_points_loaded = False


def load_entry_points() -> None:
    """Import every installed ``fedudp.plugins`` entry point's module (once per process).

    Raises
    ------
    ConfigError
        When an entry point cannot be loaded (naming it and the error).
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=GROUP):
        try:
            ep.load()
        except Exception as e:
            raise ConfigError(
                f"entry point {ep.name} = {ep.value} (group {GROUP}): cannot be loaded: "
                f"{type(e).__name__}: {e}"
            ) from e


def load(modules: Iterable[str] = (), key: str = "plugins") -> None:
    """Import the installed entry points' modules and ``modules`` (each registers its
    extensions); an already imported module is not imported again.

    Parameters
    ----------
    modules
        Module names (``package.module``), e.g. the config's ``plugins``.
    key
        The configuration key named in errors.

    Raises
    ------
    ConfigError
        A name that is not a module name, a module that cannot be found, or one that fails on
        import (one line naming it).
    """
    load_entry_points()
    for name in modules:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}: a module name (package.module), got {name!r}")
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                raise ConfigError(
                    f"{key}: no module {name!r} (is it installed, or on PYTHONPATH?)"
                ) from None
            raise ConfigError(f"{key}: importing {name} failed: {e}") from e
        except Exception as e:
            raise ConfigError(f"{key}: importing {name} failed: {type(e).__name__}: {e}") from e
