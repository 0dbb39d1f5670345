"""One registry per extension point (docs/architecture.md#how-to-add-an-extension): estimators
(``fedudp.aggregators.REGISTRY``), data readers (``fedudp.data.readers.READERS``), training
algorithms (``fedudp.algorithms.ALGORITHMS``) and models (``fedudp.models.MODELS``).

A ``Registry`` maps a name to what builds it; a module registers its entry when it is imported
(a decorator or one call at its end), and the configuration's allowed names, and the messages
that list them, come from here. A name is registered once: a second, different entry under the
same name is refused (a plugin cannot silently replace a built-in). Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one extension point (estimators, algorithms, data readers, ...).

    Parameters
    ----------
    kind
        What an entry is (named in messages).
    key
        The configuration key that names one (``aggregator``, ``dataset.name``, ...).
    """

    def __init__(self, kind: str, key: str) -> None:
        self.kind, self.key = kind, key
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name`` (the same entry again is a no-op)."""
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"{self.kind} name must be an identifier, got {name!r}")
        have = self._entries.get(name)
        if have is not None and have is not entry and _origin(have) != _origin(entry):
            raise ValueError(
                f"{self.kind} {name!r} is registered already (by {_origin(have)}); "
                "choose another name"
            )
        self._entries[name] = entry
        return entry

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of ``add``."""
        return lambda entry: self.add(name, entry)

    def remove(self, name: str) -> None:
        """Forget ``name`` (tests that register a temporary entry)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry ``name``; an unknown name is a ``KeyError`` whose message lists the
        registered names."""
        if name not in self._entries:
            raise KeyError(self.unknown(name))
        return self._entries[name]

    def unknown(self, name: object) -> str:
        """The one line for an unregistered name: the key, the name, the choices."""
        return f"{self.key}: no {self.kind} {name!r} (available: {', '.join(self.names())})"

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def pop(self, name: str, default: T | None = None) -> T | None:
        return self._entries.pop(name, default)

    def items(self):
        return self._entries.items()

    def values(self):
        return self._entries.values()

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"


def _origin(entry: object) -> str:
    """Where an entry was defined (a module re-imported registers an equal entry again)."""
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"
