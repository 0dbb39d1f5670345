"""Plain-value construction: the checks ``calibrated`` makes of its keyword-only plain values
(each refusal a ``ParameterError`` whose message starts with the parameter's name) and the
calibration of a noise multiplier to a target (ε, δ) (``calibrate``); docs/architecture.md#aggregator.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from enum import Enum
from typing import Any

from fedudp.aggregators.base import ParameterError
from fedudp.privacy.accountant import (
    MAX_NOISE_MULTIPLIER,
    BudgetError,
    calibrate_noise_multiplier,
    rounds_text,
)
from fedudp.protocol.contributions import Sampling

__all__ = [
    "calibrate",
    "check_at_least",
    "check_budget",
    "check_count",
    "check_dim",
    "check_fraction",
    "check_positive",
    "check_sampling",
    "choice",
    "concentration_radius",
    "need",
]


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def need(ok: bool, param: str, rule: str, value: Any) -> None:
    """``ParameterError("<param> <rule>, got <value>")`` unless ``ok``.

    Parameters
    ----------
    ok : bool
        The rule holds.
    param : str
        The parameter's name.
    rule : str
        What it must be.
    value : Any
        What it is.

    Raises
    ------
    ParameterError
        ``ok`` is false.
    """
    if not ok:
        raise ParameterError(
            param,
            f"{param} {rule}, got {value!r}"
            if isinstance(value, str)
            else f"{param} {rule}, got {value}",
        )


def check_positive(param: str, value: Any) -> None:
    """``value`` is a finite number > 0.

    Parameters
    ----------
    param : str
        The parameter's name.
    value : Any
        Its value.

    Raises
    ------
    ParameterError
        It is not.
    """
    need(_real(value) and value > 0, param, "must be > 0", value)


def check_at_least(param: str, value: Any, low: float) -> None:
    """``value`` is a finite number >= ``low``.

    Parameters
    ----------
    param : str
        The parameter's name.
    value : Any
        Its value.
    low : float
        The least value.

    Raises
    ------
    ParameterError
        It is not.
    """
    need(_real(value) and value >= low, param, f"must be >= {low:g}", value)


def check_fraction(param: str, value: Any) -> None:
    """``value`` is a number in (0, 1).

    Parameters
    ----------
    param : str
        The parameter's name.
    value : Any
        Its value.

    Raises
    ------
    ParameterError
        It is not.
    """
    need(_real(value) and 0 < value < 1, param, "must be in (0, 1)", value)


def check_count(param: str, value: Any, low: int = 1) -> None:
    """``value`` is an integer >= ``low``.

    Parameters
    ----------
    param : str
        The parameter's name.
    value : Any
        Its value.
    low : int, default 1
        The least value.

    Raises
    ------
    ParameterError
        It is not.
    """
    need(_integer(value) and value >= low, param, f"must be an integer >= {low}", value)


def check_budget(epsilon: Any, delta: Any, rounds: Any) -> None:
    """The target (ε, δ) over ``rounds`` releases (the accountant's own rules, plain names).

    Parameters
    ----------
    epsilon, delta : Any
        The target (ε, δ).
    rounds : Any
        The releases.

    Raises
    ------
    ParameterError
        A value the accountant refuses.
    """
    need(_real(epsilon) and epsilon > 0, "epsilon", "must be a finite number > 0", epsilon)
    check_fraction("delta", delta)
    check_count("rounds", rounds)


def check_dim(dim: Any) -> None:
    """The vectors' length is an integer >= 1.

    Parameters
    ----------
    dim : Any
        The length.

    Raises
    ------
    ParameterError
        It is not.
    """
    check_count("dim", dim)


def check_sampling(sampling: Any, replace_one: str | None = None) -> None:
    """``sampling`` is a ``Sampling``; a replace-one estimator (``replace_one``: its name) needs
    rate 1 (every unit, every round, a public n: no amplification claimed).

    Parameters
    ----------
    sampling : Any
        The estimator's sampling.
    replace_one : str or None, default None
        A replace-one estimator's name (it needs rate 1).

    Raises
    ------
    ParameterError
        Not a ``Sampling``, or a rate below 1 for a replace-one estimator.
    """
    if not isinstance(sampling, Sampling):
        raise ParameterError(
            "sampling",
            f"sampling must be a Sampling(rate, population), got {type(sampling).__name__}",
        )
    if replace_one is not None:
        need(
            sampling.rate == 1.0,
            "sampling.rate",
            f"must be 1 for {replace_one} (replace-one "
            "with a public n: every unit, every round; no amplification claimed)",
            sampling.rate,
        )


def choice(param: str, value: Any, options: tuple[str, ...]) -> str:
    """``value`` (a string or a config enum) as one of ``options``.

    Parameters
    ----------
    param : str
        The parameter's name.
    value : Any
        A string or a config enum.
    options : tuple of str
        The accepted values.

    Returns
    -------
    str
        The value.

    Raises
    ------
    ParameterError
        Another value.
    """
    plain = value.value if isinstance(value, Enum) else value
    need(
        isinstance(plain, str) and plain in options,
        param,
        "must be one of " + ", ".join(repr(o) for o in options),
        value,
    )
    return plain


def concentration_radius(tau: Any, default: Callable[[int], float], records_per_unit: Any) -> float:
    """``tau`` when given (> 0); else ``default(records_per_unit)`` (the estimator's derivation
    from the bound and the records per unit m, which must then be given).

    Parameters
    ----------
    tau : Any
        The given radius, or None.
    default : callable
        m -> the derived radius.
    records_per_unit : Any
        m (needed when ``tau`` is None).

    Returns
    -------
    float
        τ.

    Raises
    ------
    ParameterError
        A radius that is not > 0, or no ``tau`` and no m.
    """
    if tau is not None:
        check_positive("tau", tau)
        return tau
    if records_per_unit is None:
        raise ParameterError(
            "tau", "tau is None: give tau, or records_per_unit (and the bound) to derive it"
        )
    check_count("records_per_unit", records_per_unit)
    return default(records_per_unit)


def calibrate(
    make_event: Callable[[float], Any],
    epsilon: float,
    delta: float,
    rounds: int,
    *,
    run_rounds: int | None = None,
) -> float:
    """``calibrate_noise_multiplier`` for ``calibrated``: an unreachable target is a
    ``ParameterError`` naming epsilon (the config builder re-raises the accountant's
    ``BudgetError``). ``run_rounds``: the run's rounds where ``make_event`` is already the
    whole run's event (``rounds`` is then 1), so that the refusal names the run's rounds.

    Parameters
    ----------
    make_event : callable
        z -> one release's DpEvent.
    epsilon, delta : float
        The target (ε, δ).
    rounds : int
        The releases composed.
    run_rounds : int or None, default None
        The run's rounds where ``make_event`` is the whole run's event.

    Returns
    -------
    float
        The smallest noise multiplier z meeting the target.

    Raises
    ------
    ParameterError
        An unreachable target (naming epsilon; ``facts["config"]`` the ``BudgetError``).
    """
    try:
        return calibrate_noise_multiplier(make_event, epsilon, delta, rounds)
    except BudgetError as err:
        if "unreachable" not in str(err):  # another refusal (delta too large): its own words
            param = "delta" if str(err).startswith("privacy.delta") else "epsilon"
            raise ParameterError(param, f"{param}: {err}", config=err) from None
        shown = rounds_text(rounds if run_rounds is None else run_rounds)
        if run_rounds is not None:
            err = BudgetError(
                f"privacy.epsilon={epsilon} at privacy.delta={delta} is unreachable in "
                f"{shown} even with noise multiplier {MAX_NOISE_MULTIPLIER:g}; lower "
                "train.rounds or raise privacy.epsilon"
            )
        raise ParameterError(
            "epsilon",
            f"epsilon is unreachable: the noise calibration's target (epsilon="
            f"{epsilon:g}, delta={delta:g}) is not met in {shown} even with noise "
            f"multiplier {MAX_NOISE_MULTIPLIER:g}",
            config=err,
        ) from None
