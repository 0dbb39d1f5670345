"""How ``fedudp.flower.fast.TorchTraining`` reads an app's ``load_data`` and its settings.

An app's loader comes in the shapes Flower's templates use: ``load_data(partition_id,
num_partitions)`` returning ``(x, y)``, or Flower's PyTorch quickstart's
``load_data(partition_id, num_partitions, batch_size)`` returning ``(trainloader, testloader)``
whose batches are dicts (``{"img": ..., "label": ...}``). This module calls it with the declared
batch size, takes the training loader, checks that the loader's own order and batching are the
declared ones (refusing, by name, what the fast path would not reproduce: a shuffling loader
declared unshuffled, another batch size, ``drop_last``, a custom sampler), and turns its batches
into one user's ``(x, y)``. Settings given as a key (``lr="lr"``, ``batch_size="batch-size"``)
are read from the training message's config records, then from the run config.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

__all__ = ["RUN_CONFIG", "Unreproducible", "data_arity", "records_of", "setting"]

# the key under which user_level_mod hands TorchTraining the client's run config, beside the
# training message's config records (a fedudp.* key: never one of the app's records)
RUN_CONFIG = "fedudp.run-config"


class Unreproducible(ValueError):
    """The app's training data or settings ask for something the fast path does not reproduce
    (a setup error: it fails the client, naming it, rather than dropping a user)."""


def setting(what: str, value: Any, configs: Mapping[str, Any]) -> Any:
    """``value``, or for a str the value of that key in the training message's config records
    (the app's: fedudp's own ``fedudp.*`` records are not looked at), else in the run config
    (``configs[RUN_CONFIG]``); a ``ValueError`` naming ``what`` and the keys there are.

    Parameters
    ----------
    what : str
        The setting's name (the message's).
    value : Any
        The declared value, or the key that holds it.
    configs : Mapping[str, Any]
        The training message's config records and, under ``RUN_CONFIG``, the run config.

    Returns
    -------
    Any

    Raises
    ------
    ValueError
        A key found nowhere.
    """
    if not isinstance(value, str):
        return value
    apps = [rec for key, rec in configs.items() if not str(key).startswith("fedudp.")]
    run = configs.get(RUN_CONFIG) or {}
    for rec in [*apps, run]:
        if value in rec:
            return rec[value]
    known = sorted({str(k) for r in apps for k in r} | {str(k) for k in run})
    raise ValueError(
        f"TorchTraining: {what}={value!r} is not a key of the training message's config "
        f"records nor of the run config ({known}); pass it in the server's train_config or "
        f"the run config, or give {what} as a number"
    )


def data_arity(data: Callable[..., Any]) -> tuple[int, int]:
    """(positional parameters ``data`` accepts, how many it requires); (3, 2) when it cannot be
    inspected or takes ``*args`` (then called with two arguments, or three with a batch size).

    Parameters
    ----------
    data : callable
        The app's ``load_data``.

    Returns
    -------
    tuple[int, int]
    """
    try:
        params = list(inspect.signature(data).parameters.values())
    except (TypeError, ValueError):
        return 3, 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 3, 2
    pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(pos), sum(p.default is p.empty for p in pos)


def _tensor_like(a: Any) -> bool:
    return isinstance(a, (torch.Tensor, np.ndarray))


def _loader_like(a: Any) -> bool:
    """A loader of batches (a DataLoader, or another iterable that is not records)."""
    return isinstance(a, DataLoader) or (
        hasattr(a, "__iter__") and not isinstance(a, (torch.Tensor, np.ndarray, str, dict))
    )


def _check_loader(loader: DataLoader, where: str, batch_size: int | None, shuffle: bool) -> None:
    """Refuse a DataLoader whose order or batching the declaration would not reproduce."""
    sampler = loader.sampler
    if loader.batch_size is None:
        raise Unreproducible(
            f"TorchTraining: {where} returns a DataLoader with a custom batch_sampler; the fast "
            "path batches a user's records itself: return a DataLoader(batch_size=...) or leave "
            "fast= out of user_level_mod"
        )
    if loader.drop_last:
        raise Unreproducible(
            f"TorchTraining: {where} returns a DataLoader with drop_last=True, which the fast "
            "path does not reproduce: drop it or leave fast= out of user_level_mod"
        )
    if loader.batch_size != batch_size:
        raise Unreproducible(
            f"TorchTraining: {where} returns a DataLoader with batch_size={loader.batch_size}, "
            f"but batch_size={batch_size} is declared: declare batch_size={loader.batch_size} "
            "(or its run-config key, e.g. batch_size='batch-size')"
        )
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or (
            sampler.num_samples is not None and sampler.num_samples != len(sampler.data_source)
        ):
            raise Unreproducible(
                f"TorchTraining: {where} returns a DataLoader sampling with replacement or "
                "num_samples, which the fast path does not reproduce: leave fast= out of "
                "user_level_mod"
            )
        if not shuffle:
            raise Unreproducible(
                f"TorchTraining: {where} returns a DataLoader with shuffle=True, but "
                "shuffle=False is declared: declare shuffle=True (a fresh order of each "
                "user's records every epoch)"
            )
    elif isinstance(sampler, SequentialSampler):
        if shuffle:
            raise Unreproducible(
                f"TorchTraining: {where} returns a DataLoader in order (shuffle=False), but "
                "shuffle=True is declared: declare shuffle=False"
            )
    else:
        raise Unreproducible(
            f"TorchTraining: {where} returns a DataLoader with sampler "
            f"{type(sampler).__name__}, which the fast path does not reproduce (only in order "
            "or shuffled): leave fast= out of user_level_mod"
        )


def _batch(b: Any, keys: tuple[str, str] | None, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's (inputs, labels): a pair, or a dict read at ``keys`` (default "img",
    "label", Flower Datasets' image datasets)."""
    if isinstance(b, Mapping):
        k = keys if keys is not None else ("img", "label")
        if not all(key in b for key in k):
            raise Unreproducible(
                f"TorchTraining: {where}'s batches are dicts with keys {sorted(map(str, b))}, "
                f"without {list(k)}: pass keys=(inputs key, labels key), e.g. "
                "keys=('image', 'label')"
            )
        return torch.as_tensor(b[k[0]]), torch.as_tensor(b[k[1]])
    a, c = b
    return torch.as_tensor(a), torch.as_tensor(c)


def records_of(
    got: Any,
    where: str,
    batch_size: int | None,
    shuffle: bool,
    keys: tuple[str, str] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One user's ``(x, y)`` from what the app's ``data`` returned: ``(x, y)``; an iterable of
    batches; or a tuple of loaders whose first is the training loader (Flower's quickstart's
    ``(trainloader, testloader)``). A DataLoader is checked against the declared ``batch_size``
    and ``shuffle`` (``Unreproducible`` naming the difference).

    Parameters
    ----------
    got : Any
        What ``data`` returned.
    where : str
        The user, for messages.
    batch_size : int or None
        The declared batch size.
    shuffle : bool
        The declared loader order.
    keys : tuple[str, str] or None
        The keys of a batch that is a mapping (x, y).

    Returns
    -------
    tuple[torch.Tensor, torch.Tensor]

    Raises
    ------
    Unreproducible
        A loader the declared SGD cannot reproduce.
    """
    first = got[0] if isinstance(got, tuple) and len(got) >= 2 else None
    if first is not None and _loader_like(first) and not isinstance(first, (tuple, list)):
        got = first  # (trainloader, testloader, ...): the training loader
    if isinstance(got, tuple) and len(got) == 2:
        x, y = torch.as_tensor(got[0]), torch.as_tensor(got[1])
    else:
        if isinstance(got, DataLoader):
            _check_loader(got, where, batch_size, shuffle)
            if isinstance(got.sampler, RandomSampler):  # the records in the dataset's order:
                # the fast path draws each epoch's order itself (``shuffle_seed``)
                got = DataLoader(got.dataset, batch_size=got.batch_size, collate_fn=got.collate_fn)
        batches = [_batch(b, keys, where) for b in got]
        if not batches:
            raise ValueError(f"TorchTraining: {where} gave no batches")
        x = torch.cat([a for a, _ in batches])
        y = torch.cat([b for _, b in batches])
    if len(x) != len(y):
        raise ValueError(f"TorchTraining: {where} gave {len(x)} inputs and {len(y)} labels")
    return x, y.long()
