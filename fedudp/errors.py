"""The user-error type every layer may raise (the bottom of the import graph: it imports nothing).

A ``ConfigError`` says that a configuration value, the privacy budget, a data file or the output
folder is wrong. Its message starts with the key or file it names; the command line prints it as
one line ``fedudp: error: <message>`` and exits with status 2. ``fedudp.config`` re-exports it
and ``DataError``, its kind for data files.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DataError",
    "one_line",
]


class ConfigError(ValueError):
    """A user error (see the module doc)."""


class DataError(ConfigError):
    """A data file is missing, unreadable or inconsistent; the message names the file."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """An exception as one line: how a dropped user's or a failed owner's reason is logged.

    Parameters
    ----------
    e
        The exception.
    limit
        The most characters kept.

    Returns
    -------
    str
        Its type and the first line of its message, cut at ``limit`` characters.
    """
    text = str(e).strip().splitlines()
    one = f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")
    return one if len(one) <= limit else one[:limit] + "..."
