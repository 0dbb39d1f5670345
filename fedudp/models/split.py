"""Shared / personal split of a model's parameters by name patterns
(docs/algorithms.md#joint-dp-and-the-four-methods).

A pattern is an fnmatch pattern over ``named_parameters()`` names; a bare layer name
(``fc1``) means that layer's parameters (``fc1.*``). A pattern matching nothing is a
``ValueError`` listing the parameter names, so a typo never silently shares everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import ClassVar

import torch.nn as nn

__all__ = [
    "SplitModel",
    "ParamSplit",
    "split_by_patterns",
]


class SplitModel(nn.Module):
    """A fedudp model: declares which parameters joint_dp keeps personal by default
    (fnmatch patterns over ``named_parameters()``; ``model.personal`` overrides them).

    Attributes
    ----------
    default_personal : tuple of str
        Patterns of the parameters kept personal by default.
    """

    default_personal: ClassVar[tuple[str, ...]] = ()


@dataclass(frozen=True)
class ParamSplit:
    """The parameter names of a model, split (``split_by_patterns``).

    Attributes
    ----------
    shared, personal : tuple of str
        The shared and the personal parameter names, in the model's order.
    """

    shared: tuple[str, ...]
    personal: tuple[str, ...]


def _expand(pattern: str) -> list[str]:
    return [pattern] if any(ch in pattern for ch in "*?[.") else [pattern, pattern + ".*"]


def split_by_patterns(model: nn.Module, patterns: Sequence[str]) -> ParamSplit:
    """The model's parameters split into shared and personal by name patterns.

    Parameters
    ----------
    model
        The model.
    patterns
        ``fnmatch`` patterns of the personal parameters' names (``model.personal``).

    Returns
    -------
    ParamSplit
        The shared and the personal names, in the model's parameter order.

    Raises
    ------
    ValueError
        A pattern that matches no parameter (naming the model's parameters).
    """
    names = [n for n, _ in model.named_parameters()]
    personal: set[str] = set()
    for pat in patterns:
        hits = {n for n in names for p in _expand(pat) if fnmatchcase(n, p)}
        if not hits:
            raise ValueError(
                f"pattern {pat!r} matches no parameter of "
                f"{type(model).__name__}; its parameters are {names}"
            )
        personal |= hits
    return ParamSplit(
        shared=tuple(n for n in names if n not in personal),
        personal=tuple(n for n in names if n in personal),
    )
