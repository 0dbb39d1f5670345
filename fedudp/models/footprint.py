"""Memory a run or an audit needs at least, checked before anything is allocated (issue 49).

A configuration whose arrays cannot fit this machine ends as one line naming the key, before
the allocation that would fail (or swap the machine for minutes and then fail with a message
about something else). Every bound here is a *lower* bound on what the run holds at once, so a
refusal is never wrong; a configuration that passes can still run out of memory later.

The model rule (``model_copies``, ``check_model``): with P the model's parameters and S its
shared ones (the ones the billboard releases), a run holds at least

    P                       the model itself,
    PROBE_BATCH x P         the probe's per-record gradients of its public example batch,
    S                       the billboard's noisy update,
    U x S                   one vectorized owner step, which stacks a copy of the shared
                            parameters for each of the U units it trains at once,

elements of the model's dtype. U is 1 unless the local engine computes user-level vectors on
the billboard's side (``privacy.placement=server``, user cohorts): then U = min(the expected
cohort q x N, the units one chunk of ``engine_opts.chunk_records`` holds, each counted as
min(train.batch_size, records per user) records). P and S come from the model built on
PyTorch's ``meta`` device (shapes only, no memory), before the real one is built. The memory
is the machine's (its cgroup limit where lower) or, with ``engine_opts.device=cuda``, the
GPU's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedudp.errors import ConfigError
from fedudp.memory import memory_bytes, size_text

__all__ = ["model_copies", "model_need", "check_model"]


def model_copies(units: int) -> int:
    """How many copies of the shared parameters the rule above counts beside the model and the
    probe's gradients: the billboard's update and ``units`` stacked owner copies.

    Parameters
    ----------
    units : int
        U, the owner copies stacked in one step (at least 1 counted).

    Returns
    -------
    int
        ``1 + max(1, units)``.
    """
    return 1 + max(1, int(units))


def model_need(parameters: int, shared: int, itemsize: int, units: int) -> int:
    """Bytes a run holds at least (the module doc's rule).

    Parameters
    ----------
    parameters, shared : int
        The model's parameter count P and its shared ones S.
    itemsize : int
        Bytes per value.
    units : int
        U (``model_copies``).

    Returns
    -------
    int
        ``itemsize * ((1 + PROBE_BATCH) * P + model_copies(U) * S)``.
    """
    from fedudp.models.validate import PROBE_BATCH

    return itemsize * ((1 + PROBE_BATCH) * int(parameters) + model_copies(units) * int(shared))


def check_model(
    build_model: Callable[[int], Any],
    *,
    classes: int,
    model_key: str,
    float64: bool,
    device: str,
    shared_and_units: Callable[[Any], tuple[tuple[str, ...], int]],
) -> None:
    """Refuse (``ConfigError`` naming ``dataset.classes=<C>`` when the output width makes most
    of the model, else ``model_key``) a model that cannot fit the module doc's rule, before it
    is built: ``build_model(classes)`` is called on the ``meta`` device (no memory), and
    ``shared_and_units(meta_model)`` gives the names of its shared parameters and U (the
    config builder's). A model that cannot be built there is not checked (it is built for real
    next, and checked by what it allocates).

    Parameters
    ----------
    build_model : callable
        The model for a number of classes.
    classes : int
        ``dataset.classes``.
    model_key : str
        The configuration key the refusal names otherwise.
    float64 : bool
        The run computes in float64 (8 bytes per value).
    device : str
        ``engine_opts.device``: whose memory is compared.
    shared_and_units : callable
        The meta model in, (shared parameter names, U) out.

    Raises
    ------
    ConfigError
        The model needs more memory than ``device`` has.
    """
    import torch

    try:
        with torch.device("meta"):
            m = build_model(classes)
            names, units = shared_and_units(m)
    except Exception:  # noqa: BLE001 - not buildable on meta: the real build decides
        return
    params = dict(m.named_parameters())
    if not params:
        return
    total = sum(int(p.numel()) for p in params.values())
    shared = sum(int(params[k].numel()) for k in names if k in params)
    itemsize = 8 if float64 else next(iter(params.values())).element_size()
    need = model_need(total, shared, itemsize, units)
    have = memory_bytes(device)
    if have is None or need <= have:
        return
    from fedudp.models.validate import PROBE_BATCH

    by_classes = False  # the classes name the refusal where they make most of the model
    if classes > 2:
        with torch.device("meta"):
            two = sum(int(p.numel()) for p in build_model(2).parameters())
        by_classes = (total - two) * 2 > total
    named = f"dataset.classes={classes}" if by_classes else model_key
    fix = "lower dataset.classes" if by_classes else "choose a smaller model (or input shape)"
    raise ConfigError(
        f"{named}: the model has {total:,} parameters ({size_text(total * itemsize)}); a run "
        f"holds at least {1 + PROBE_BATCH} copies of them and {model_copies(units):,} of its "
        f"{shared:,} shared ones (the probe's per-record gradients, the billboard's update, "
        f"{units:,} unit(s) stacked in one owner step): {size_text(need)}, over the "
        f"{size_text(have)} of memory on {device}; {fix}"
        + (" (or engine_opts.chunk_records, train.sampling_rate)" if units > 1 else "")
    )
