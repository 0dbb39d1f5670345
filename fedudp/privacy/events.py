"""dp-accounting events as plain JSON, and the privacy cost of choosing among runs.

``event_to_json`` / ``event_from_json`` write a ``DpEvent`` as nested dicts (``{"dp_event":
"GaussianDpEvent", "noise_multiplier": 1.0}``) and read it back, for the run summary and the
sweep report. Reading accepts only the event classes of ``dp_accounting.dp_event`` by name (no
module is imported from a file, nothing is evaluated).

Selecting the best of several private runs costs privacy (Papernot & Steinke, "Hyperparameter
Tuning with Renyi Differential Privacy", ICLR 2022, arXiv:2110.03620):

* ``composed_selection``: a fixed set of runs (a grid) whose outputs are all looked at is the
  composition of the runs' events (any choice made from them is post-processing).
* ``candidate_event``: one candidate of a sweep is one configuration; its k seeds, all looked
  at to score it, are the k-fold composition of the single-run event.
* ``repeat_and_select``: when the *number* of candidates K is itself random, drawn before the
  sweep from a truncated negative binomial of declared mean and shape (Poisson: shape = inf,
  geometric: shape = 1, logarithmic: shape = 0), and every candidate is the same mechanism (one
  ``DpEvent``), releasing the best candidate costs ``RepeatAndSelectDpEvent(event, mean,
  shape)``, accounted with dp-accounting's RDP accountant (the only one that supports it).
"""

from __future__ import annotations

import math
from typing import Any

import attr
import dp_accounting
from dp_accounting import dp_event as _dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from fedudp.privacy.accountant import _quiet_absl

__all__ = [
    "TAG",
    "SHAPES",
    "event_to_json",
    "event_from_json",
    "rdp_epsilon",
    "pld_or_rdp_epsilon",
    "composed_selection",
    "candidate_event",
    "repeat_and_select",
]

TAG = "dp_event"  # the key naming the class (never a DpEvent field name)
SHAPES = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}


def _classes() -> dict[str, type]:
    return {
        name: obj
        for name, obj in vars(_dp_event).items()
        if isinstance(obj, type) and issubclass(obj, _dp_event.DpEvent)
    }


def event_to_json(event: dp_accounting.DpEvent) -> dict[str, Any]:
    """``event`` as nested plain dicts and lists.

    Parameters
    ----------
    event
        A dp-accounting event.

    Returns
    -------
    dict
        ``{"dp_event": class name, field: value, ...}``, nested for composed events.
    """
    if not isinstance(event, _dp_event.DpEvent):
        raise TypeError(f"not a dp_accounting DpEvent: {event!r}")
    out: dict[str, Any] = {TAG: type(event).__name__}
    for f in attr.fields(type(event)):
        out[f.name] = _value_to_json(getattr(event, f.name))
    return out


def _value_to_json(v: Any) -> Any:
    if isinstance(v, _dp_event.DpEvent):
        return event_to_json(v)
    if isinstance(v, (list, tuple)):
        return [_value_to_json(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    return v


def event_from_json(d: dict[str, Any]) -> dp_accounting.DpEvent:
    """The ``DpEvent`` that ``event_to_json`` wrote.

    Parameters
    ----------
    d
        ``event_to_json``'s dict.

    Returns
    -------
    dp_accounting.DpEvent
        The event.

    Raises
    ------
    ValueError
        Anything ``event_to_json`` does not write.
    """
    classes = _classes()
    if not isinstance(d, dict) or not isinstance(d.get(TAG), str) or d[TAG] not in classes:
        raise ValueError(f"not a dp_accounting event: {str(d)[:80]}")
    cls = classes[d[TAG]]
    names = {f.name for f in attr.fields(cls)}
    extra = set(d) - names - {TAG}
    if extra:
        raise ValueError(f"{d[TAG]}: unknown fields {sorted(extra)}")
    return cls(**{k: _value_from_json(v) for k, v in d.items() if k != TAG})


def _value_from_json(v: Any) -> Any:
    if isinstance(v, dict) and TAG in v:
        return event_from_json(v)
    if isinstance(v, dict) and set(v) == {"float"}:
        return float(v["float"])
    if isinstance(v, list):
        return [_value_from_json(x) for x in v]
    return v


def rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    """ε at ``delta`` of ``event`` under dp-accounting's RDP accountant.

    Parameters
    ----------
    event
        The event.
    delta
        The δ.

    Returns
    -------
    float
        The ε.
    """
    acc = rdp_privacy_accountant.RdpAccountant()
    with _quiet_absl():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


def pld_or_rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> tuple[float, str]:
    """ε at ``delta`` of ``event``: dp-accounting's PLD accountant where it supports the event,
    else its RDP accountant.

    Parameters
    ----------
    event
        The event.
    delta
        The δ.

    Returns
    -------
    tuple
        (ε, ``"pld"`` or ``"rdp"``: the accountant used).
    """
    pld = dp_accounting.pld.PLDAccountant()
    if pld.supports(event):
        pld.compose(event)
        return float(pld.get_epsilon(delta)), "pld"
    return rdp_epsilon(event, delta), "rdp"


def composed_selection(events: list[dp_accounting.DpEvent], delta: float) -> tuple[float, str]:
    """ε of choosing among a fixed set of runs with these events: their composition.

    Equal events are grouped into one ``SelfComposedDpEvent`` each (the same composition;
    dp-accounting self-composes a PLD in one step instead of convolving k copies).

    Parameters
    ----------
    events
        One event per run.
    delta
        The δ.

    Returns
    -------
    tuple
        (ε, the accountant used), as ``pld_or_rdp_epsilon``.
    """
    groups: list[list] = []
    for e in events:
        for g in groups:
            if g[0] == e:
                g[1] += 1
                break
        else:
            groups.append([e, 1])
    parts = [e if k == 1 else dp_accounting.SelfComposedDpEvent(e, k) for e, k in groups]
    return pld_or_rdp_epsilon(
        parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts), delta
    )


def candidate_event(events: list[dp_accounting.DpEvent]) -> dp_accounting.DpEvent:
    """One candidate's event: its runs (seeds) composed.

    Parameters
    ----------
    events
        The candidate's runs' events.

    Returns
    -------
    dp_accounting.DpEvent
        k equal events: ``SelfComposedDpEvent(event, k)``; different ones: a
        ``ComposedDpEvent``; one run: its event.
    """
    if not events:
        raise ValueError("a candidate needs at least one run")
    if len(events) == 1:
        return events[0]
    if all(e == events[0] for e in events):
        return dp_accounting.SelfComposedDpEvent(events[0], len(events))
    return dp_accounting.ComposedDpEvent(list(events))


def repeat_and_select(
    event: dp_accounting.DpEvent, mean: float, shape: float, delta: float
) -> float:
    """ε at ``delta`` of releasing the best of a random number of runs of ``event`` (Papernot &
    Steinke 2022, via dp-accounting's RDP accountant).

    Parameters
    ----------
    event
        One candidate's event.
    mean, shape
        The truncated negative binomial the number of runs is drawn from (``SHAPES``; Poisson is
        ``math.inf``).
    delta
        The δ.

    Returns
    -------
    float
        The ε.
    """
    return rdp_epsilon(_dp_event.RepeatAndSelectDpEvent(event, float(mean), float(shape)), delta)
