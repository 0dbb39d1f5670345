"""ε of a ledger from the ledger alone (docs/usage.md#checkpoint-and-resume).

``epsilon_of_ledger`` composes the event of every entry of a ``ledger.jsonl`` (superseded ones,
the releases a resumed run made again, included: each was made) after the run's one-off block,
on the accountant a run builds (``accountant_for``, the head's target and δ), and returns ε at
the head's δ. For a run whose events are dp-accounting events (the billboard's sampled Gaussian,
a tree's or a matrix mechanism's events) it equals the ε the run reports, bit for bit. An entry's
event is read back from its text (``parse_event``: a parse, never an ``eval``).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

import dp_accounting
from dp_accounting import dp_event as _dp_event

from fedudp.privacy.accountant import ApproxDp, LedgerEntry, Parallel, accountant_for
from fedudp.privacy.distributed import NOISES, DistributedDpEvent

__all__ = [
    "parse_event",
    "epsilon_of_ledger",
]


def _classes() -> dict[str, type]:
    out: dict[str, type] = {
        name: obj
        for name, obj in vars(_dp_event).items()
        if isinstance(obj, type) and issubclass(obj, _dp_event.DpEvent)
    }
    out["ApproxDp"] = ApproxDp
    out["DistributedDpEvent"] = DistributedDpEvent
    return out


def parse_event(text: str) -> dp_accounting.DpEvent | ApproxDp | Parallel:
    """The event an entry's ``event`` text names (``str`` of a dp-accounting event, an
    ``ApproxDp`` block or a ``Parallel`` one); ``ValueError`` for anything else.

    Parameters
    ----------
    text : str
        The entry's ``event`` text.

    Returns
    -------
    dp_accounting.DpEvent or ApproxDp or Parallel
        The event it names, rebuilt.

    Raises
    ------
    ValueError
        The text is not Python, names an unknown event class, or holds anything but
        constants, lists, ``inf``/``nan`` and event calls.
    """
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise ValueError(f"not an event: {text[:80]!r}") from None
    classes = _classes()

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(x) for x in node.elts]
        if isinstance(node, ast.Name) and node.id in ("inf", "nan"):
            return float(node.id)
        if isinstance(node, ast.Name) and node.id in NOISES:  # a distributed event's noise
            return node.id
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name = node.func.id
            args = [value(a) for a in node.args]
            if name == "Parallel":
                return Parallel(tuple(args))
            if name not in classes:
                raise ValueError(f"unknown event class {name!r} in {text[:80]!r}")
            kwargs = {str(k.arg): value(k.value) for k in node.keywords if k.arg is not None}
            if len(kwargs) != len(node.keywords):
                raise ValueError(f"not an event: {text[:80]!r}")
            return classes[name](*args, **kwargs)
        raise ValueError(f"not an event: {text[:80]!r}")

    return value(tree)


def epsilon_of_ledger(head: dict[str, Any], entries: Sequence[LedgerEntry]) -> float:
    """ε at the head's δ of every release in ``entries`` (superseded ones included), composed
    after the head's one-off block on the accountant a run builds for them.

    Parameters
    ----------
    head : dict
        ``ledger.jsonl``'s head line (``delta``, ``target_epsilon``, ``extra``).
    entries : sequence of LedgerEntry
        Its entries, in order.

    Returns
    -------
    float
        ε of the composition (0.0 without entries, as ``Ledger.epsilon``).

    Raises
    ------
    ValueError
        An entry's event cannot be read, or the ledger reads at user level through group
        privacy (its conversion is recorded to 6 digits: not recomputable exactly).
    """
    extra = head.get("extra") or {}
    if "group_conversion" in extra:
        raise ValueError("a group-privacy ledger (extra.group_conversion) is not recomputed")
    events = [parse_event(e.event) for e in entries]
    one_off = extra.get("one_off_event")
    if not events:  # as ``Ledger.epsilon``: nothing released, nothing spent
        return 0.0
    acc = accountant_for(events[0], None, head.get("target_epsilon"))
    if one_off is not None:
        acc.compose(parse_event(one_off))
    for ev in events:
        acc.compose(ev)
    return float(acc.epsilon(head["delta"]))
