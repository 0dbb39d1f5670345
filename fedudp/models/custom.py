"""Your own ``torch.nn.Module`` as a fedudp model (docs/your-data.md).

* ``from_target(target, kwargs, input_shape=, classes=, seed=)``: import ``target``
  ("package.module.ClassOrFactory"), call it with ``kwargs``, plus ``input_shape`` and
  ``classes`` (or ``num_classes``) where its signature names them and ``kwargs`` does not, with
  torch seeded from the run seed (the initialisation is public randomness, as for the built-in
  models), and check the result (``fedudp.models.validate.check_model``). This is what the
  config's ``model.target`` / ``model.kwargs`` do, so every process (a Flower owner too)
  rebuilds the same model from the config alone.
* ``adopt(module, personal)``: give a plain module joint_dp's default personal patterns.
* ``fresh_copy(model)``: an independent checked copy of a module object passed from Python
  (``engine=local`` only: a Flower owner runs in another process and rebuilds its model from
  the config, so a Python object reaches it only through ``model.target``).

How a plain module carries its personal patterns: ``adopt`` sets ``default_personal`` as an
*instance* attribute on the same object (``SplitModel`` declares it on the class; the method
split reads ``model.default_personal``, which finds either). Wrapping the module in a
``SplitModel`` instead would prefix every parameter name (``net.fc.weight``) and break the
user's patterns, checkpoints and state dicts; the module is neither copied nor wrapped.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from fedudp.models.split import split_by_patterns
from fedudp.models.validate import check_model

__all__ = [
    "from_target",
    "adopt",
    "fresh_copy",
]

_CLASSES_NAMES = ("classes", "num_classes")


def _why(e: BaseException) -> str:
    """An exception as one line: its type and message."""
    return " ".join(f"{type(e).__name__}: {e}".split())


def _resolve(target: str) -> Callable[..., Any]:
    """The object ``target`` names: the longest importable module prefix, then attributes."""
    parts = target.split(".") if isinstance(target, str) else []
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ValueError(
            f"model target {target!r} is not a dotted path 'package.module.Class' "
            "(a class or factory importable from Python)"
        )
    for i in range(len(parts) - 1, 0, -1):
        modname = ".".join(parts[:i])
        try:
            obj: Any = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name is not None and (modname == e.name or modname.startswith(e.name + ".")):
                continue  # this prefix is not a module: try a shorter one
            raise ValueError(
                f"model target {target!r}: importing {modname} failed: {_why(e)} "
                "(install the missing package)"
            ) from None
        except Exception as e:  # noqa: BLE001 - the user's module raised on import: say which
            raise ValueError(
                f"model target {target!r}: importing {modname} failed: {_why(e)}"
            ) from None
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                raise ValueError(
                    f"model target {target!r}: {type(obj).__name__} "
                    f"{getattr(obj, '__name__', modname)} has no attribute {attr!r} "
                    "(check the spelling, and that the class is defined at module level)"
                )
            obj = getattr(obj, attr)
        if not callable(obj):
            raise ValueError(
                f"model target {target!r} is a {type(obj).__name__}, not a class or "
                "factory returning a torch.nn.Module"
            )
        return obj
    raise ValueError(
        f"model target {target!r}: no module {parts[0]!r} can be imported (install "
        "it, or put its folder on PYTHONPATH / run from it)"
    )


def _signature_kwargs(
    fn: Callable[..., Any], given: Mapping[str, Any], input_shape: tuple[int, ...], classes: int
) -> dict[str, Any]:
    """``input_shape`` / ``classes`` / ``num_classes`` where ``fn``'s signature names them and
    ``given`` does not (a ``**kwargs`` catch-all gets nothing extra)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return {}
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    extra: dict[str, Any] = {}
    if "input_shape" in named and "input_shape" not in given:
        extra["input_shape"] = tuple(int(s) for s in input_shape)
    for n in _CLASSES_NAMES:
        if n in named and n not in given:
            extra[n] = int(classes)
    return extra


def from_target(
    target: str,
    kwargs: Mapping[str, Any] | None = None,
    *,
    input_shape: Sequence[int],
    classes: int,
    seed: int,
    personal: Sequence[str] = (),
) -> nn.Module:
    """The module ``target(**kwargs)``, built with torch seeded from ``seed`` (the global torch
    generator is restored afterwards) and checked by ``check_model``.

    Parameters
    ----------
    target
        The class or factory, ``package.module.Name``.
    kwargs
        Its arguments (plus ``input_shape`` / ``classes`` / ``num_classes`` where its signature
        asks for them).
    input_shape, classes
        The declared data.
    seed
        The seed its initialization draws from.
    personal
        joint_dp's default personal patterns (else its class's ``default_personal``).

    Returns
    -------
    torch.nn.Module
        The model.

    Raises
    ------
    ValueError
        Any failure, in one line naming the target.
    """
    fn = _resolve(target)
    given = dict(kwargs or {})
    call = {**given, **_signature_kwargs(fn, given, tuple(input_shape), classes)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        try:
            model = fn(**call)
        except Exception as e:  # noqa: BLE001 - the user's constructor raised: name the target
            raise ValueError(
                f"model target {target!r} called with {sorted(call)} raised {_why(e)}"
            ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model target {target!r} returned a {type(model).__name__}, not a "
            "torch.nn.Module (point it at the module's class or at a factory "
            "returning one)"
        )
    check_model(model)
    return adopt(model, personal) if personal or not hasattr(model, "default_personal") else model


def adopt(module: nn.Module, personal: Sequence[str]) -> nn.Module:
    """``module`` itself (not a copy or a wrapper: its parameter names stay as they are) with
    ``default_personal = tuple(personal)`` set on the instance.

    Parameters
    ----------
    module
        Your model.
    personal
        Its personal parameters' patterns; ``()`` leaves joint_dp to the config's
        ``model.personal``.

    Returns
    -------
    torch.nn.Module
        ``module``.

    Raises
    ------
    ValueError
        A pattern that matches no parameter (``split_by_patterns``).
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"a model must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(personal, str):
        raise ValueError(
            f"personal patterns must be a list of strings, got the string {personal!r}"
        )
    patterns = tuple(str(p) for p in personal)
    if patterns:
        split_by_patterns(module, patterns)
    # nn.Module.__setattr__ is annotated for tensors and modules only; a plain attribute is fine
    module.default_personal = patterns  # type: ignore[assignment]
    return module


def fresh_copy(model: nn.Module) -> nn.Module:
    """An independent deep copy of ``model`` (no parameter, buffer or attribute shared with the
    caller's object or another run), checked by ``check_model``; a plain module gets
    ``default_personal = ()`` unless it has one. For ``engine=local`` (the object lives in this
    process); Flower owners rebuild their model from the config (``model.target``).

    Parameters
    ----------
    model
        Your model.

    Returns
    -------
    torch.nn.Module
        The copy.
    """
    check_model(model)
    try:
        out = copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001 - any copy failure becomes the one-line model error
        raise ValueError(
            f"model {type(model).__name__} cannot be copied for a run ({_why(e)}); "
            "pass model.target instead"
        ) from None
    if not hasattr(out, "default_personal"):
        out.default_personal = ()  # type: ignore[assignment]  # as above: a plain attribute
    return out
