"""Plain values shared by every layer (standard library; numpy only inside ``jsonable``):
``Choice``, the string enum of a configuration choice, and ``jsonable``, a value as plain JSON
types. The configuration (``fedudp.config``) and the modules below the builder both use them,
so that nothing below the builder imports the configuration."""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

__all__ = ["Choice", "jsonable"]


class Choice(str, Enum):  # noqa: UP042 - StrEnum would change format() and auto() for subclasses
    """A config choice: a string enum whose ``str()`` is its value (folder names, tables)."""

    def __str__(self) -> str:
        return str(self.value)


def jsonable(x: Any) -> Any:
    """Plain JSON types: enums as their values, numpy scalars as Python, non-finite as None.

    Parameters
    ----------
    x : Any
        A value (dicts and sequences converted throughout).

    Returns
    -------
    Any
        Dicts (string keys), lists and plain scalars.
    """
    import numpy as np

    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Enum):
        return x.value
    if isinstance(x, (np.floating, np.integer, np.bool_)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
