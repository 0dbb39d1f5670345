"""Noise calibration: the smallest noise multiplier whose schedule meets a target (ε, δ).

``calibrate_noise_multiplier`` finds the smallest noise multiplier z = sigma / C whose whole
schedule (all rounds, the sampling rate) stays within the target (epsilon, delta), with
``dp_accounting.calibrate_dp_mechanism`` over the accountant's own epsilon
(``fedudp.privacy.bounded.bounded_epsilon``: the smaller of PLD's and RDP's bounds), so that the
ledger of a calibrated run reads the very numbers the calibration read.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import dp_accounting

from fedudp.errors import ConfigError
from fedudp.privacy.bounded import (
    MAX_PLD_WINDOW,
    bounded_epsilon,
    event_epsilon,
    pld_interval,
    pld_size,
    pld_supports,
    quiet_absl,
    rdp_accountant,
)
from fedudp.privacy.pld_fast import MemoPLDAccountant, direct_pld_epsilon

__all__ = [
    "MAX_NOISE_MULTIPLIER",
    "MIN_NOISE_MULTIPLIER",
    "BudgetError",
    "calibrate_noise_multiplier",
    "rounds_text",
    "schedule_epsilon",
    "validate_budget",
]

# Noise multipliers beyond this are treated as "target unreachable" (the run would be noise).
MAX_NOISE_MULTIPLIER = 1e4
MIN_NOISE_MULTIPLIER = 1e-6  # calibration below it: the target does not need noise


class BudgetError(ConfigError):
    """The target (epsilon, delta) cannot be met by the configured schedule (a user error).

    Raised with one message, as ``ValueError`` is.
    """


def schedule_epsilon(
    make_event: Callable[[float], dp_accounting.DpEvent],
    noise: float,
    rounds: int,
    delta: float,
    interval: float = 1e-4,
) -> float:
    """Epsilon of ``rounds`` self-composed releases of ``make_event(noise)``.

    Parameters
    ----------
    make_event
        One round's release, given the noise multiplier.
    noise
        The noise multiplier.
    rounds
        The number of rounds.
    delta
        The δ at which epsilon is read.
    interval
        The PLD's discretization interval.

    Returns
    -------
    float
        The accountant's epsilon (PLD bounded by RDP; RDP for events PLD cannot represent).
    """
    eps = event_epsilon(
        dp_accounting.SelfComposedDpEvent(make_event(noise), rounds), delta, interval
    )
    assert eps is not None, "make_event builds events PLD or RDP supports"
    return eps


def rounds_text(rounds: int) -> str:
    """``1 round``, ``100,000,000 rounds``: a count of rounds as every message prints it.

    Parameters
    ----------
    rounds : int
        The count of rounds.

    Returns
    -------
    str
        The count with thousands separators and ``round`` or ``rounds``.
    """
    return f"{int(rounds):,} round{'' if int(rounds) == 1 else 's'}"


def _delta_too_large(delta: float, target_epsilon: float) -> BudgetError:
    return BudgetError(
        f"privacy.delta={delta} is too large for this schedule: (epsilon={target_epsilon}, "
        f"delta={delta}) holds for any noise multiplier (e.g. delta >= the sampling "
        "rate); choose delta well below the chance that a user is sampled"
    )


def _rdp_calibration(
    event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    lower: float,
    tol: float,
) -> float:
    """dp-accounting's RDP calibration of ``event`` from ``lower`` (guess 1.0)."""
    with quiet_absl():
        return float(
            dp_accounting.calibrate_dp_mechanism(
                rdp_accountant,
                event,
                target_epsilon,
                delta,
                bracket_interval=dp_accounting.LowerEndpointAndGuess(lower, 1.0),
                tol=tol,
            )
        )


def _first_meeting(
    make_event: Callable[[float], dp_accounting.DpEvent],
    z_hi: float,
    target_epsilon: float,
    delta: float,
    rounds: int,
    interval: float,
    tol: float,
) -> tuple[float, float]:
    """(z, ε) at the first of ``z_hi``, ``z_hi (1 + tol/10)``, ... (64 steps) whose schedule
    ε (the accountant's: the smaller of PLD and RDP) meets the target."""
    for _ in range(64):
        if (
            eps_hi := schedule_epsilon(make_event, z_hi, rounds, delta, interval)
        ) <= target_epsilon:
            return z_hi, eps_hi
        z_hi *= 1 + tol / 10
    raise BudgetError(
        f"privacy.epsilon={target_epsilon}: the noise calibration did not "
        f"converge in {rounds} rounds at privacy.delta={delta}"
    )


def _pld_calibration(
    make_event: Callable[[float], dp_accounting.DpEvent],
    event: Callable[[float], dp_accounting.DpEvent],
    z_hi: float,
    target_epsilon: float,
    delta: float,
    rounds: int,
    interval: float,
    tol: float,
) -> float:
    """The accountant's calibration below ``z_hi`` (which meets the target): halve until the
    target is missed, then Brent's method on that bracket."""
    z_lo = z_hi / 2
    while (eps_lo := schedule_epsilon(make_event, z_lo, rounds, delta, interval)) <= target_epsilon:
        # ε = 0 at a finite noise, or no floor in sight: δ covers the release whatever the noise
        if eps_lo == 0.0 or z_lo < MIN_NOISE_MULTIPLIER:
            raise _delta_too_large(delta, target_epsilon)
        z_hi, z_lo = z_lo, z_lo / 2
    try:
        z = dp_accounting.calibrate_dp_mechanism(
            lambda: MemoPLDAccountant(interval, bounded_epsilon),
            event,
            target_epsilon,
            delta,
            bracket_interval=dp_accounting.ExplicitBracketInterval(z_lo, z_hi),
            tol=tol,
        )
    except ValueError:  # no sign change seen by Brent's method (rounding at the ends)
        return z_hi  # meets the target (checked above): the safe end of the bracket
    return float(z)


def calibrate_noise_multiplier(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    rounds: int,
    tol: float = 1e-3,
) -> float:
    """Smallest noise multiplier whose ``rounds``-fold schedule meets (target_epsilon, delta).

    Parameters
    ----------
    make_event
        One round's release as a dp-accounting event, given the noise multiplier ``z``.
    target_epsilon, delta
        The (ε, δ) the whole schedule must meet.
    rounds
        The number of rounds (the event is self-composed ``rounds`` times).
    tol
        The calibration's relative tolerance on the noise multiplier.

    Returns
    -------
    float
        The noise multiplier; the schedule's ε at it (the accountant's ε, ``bounded_epsilon``)
        is at most ``target_epsilon``.

    Raises
    ------
    BudgetError
        A bad budget or ``rounds < 1``; a target that even ``MAX_NOISE_MULTIPLIER`` does not
        reach (naming the target); a δ so large that any noise meets the target; a calibration
        that does not converge.
    """
    validate_budget(target_epsilon, delta)
    interval = pld_interval(target_epsilon)
    if rounds < 1:
        raise BudgetError(f"train.rounds must be >= 1, got {rounds}")
    if schedule_epsilon(make_event, MAX_NOISE_MULTIPLIER, rounds, delta, interval) > target_epsilon:
        raise BudgetError(
            f"privacy.epsilon={target_epsilon} at privacy.delta={delta} is unreachable in "
            f"{rounds_text(rounds)} even with noise multiplier {MAX_NOISE_MULTIPLIER:g}"
        )

    def event(z: float) -> dp_accounting.DpEvent:
        return dp_accounting.SelfComposedDpEvent(make_event(z), rounds)

    if not pld_supports(event(1.0)):  # pure-DP steps: RDP only
        return _rdp_calibration(event, target_epsilon, delta, 1e-6, tol)

    # RDP is an upper bound on epsilon, so its calibration brackets the PLD one from above;
    # it is also fast where PLD is slow (small noise, large epsilon).
    z_hi = _rdp_calibration(event, target_epsilon, delta, 1e-4, tol / 10)
    # what is calibrated is the accountant's epsilon (``bounded_epsilon``: the smaller of PLD
    # and RDP), which at RDP's z is at most RDP's up to the last digit of its composition
    z_hi, eps_hi = _first_meeting(make_event, z_hi, target_epsilon, delta, rounds, interval, tol)
    if eps_hi == 0.0:  # ε = 0 at a finite noise: δ covers the release whatever the noise
        raise _delta_too_large(delta, target_epsilon)
    if pld_size(event(z_hi), interval) > MAX_PLD_WINDOW or (
        direct_pld_epsilon(event(z_hi), delta, interval) > target_epsilon
    ):
        # PLD is not below the target at RDP's z (too long a schedule for its grid, or too
        # large a PLD): below that z RDP exceeds the target and PLD only grows (or stays out),
        # so RDP's z is the smallest that meets it
        return z_hi
    return _pld_calibration(make_event, event, z_hi, target_epsilon, delta, rounds, interval, tol)


def validate_budget(epsilon: float, delta: float) -> None:
    """Check a target budget before any long work.

    Raises
    ------
    BudgetError
        ``privacy.epsilon`` not a finite number > 0, or ``privacy.delta`` not in (0, 1).
    """
    if not (isinstance(epsilon, (int, float)) and math.isfinite(epsilon) and epsilon > 0):
        raise BudgetError(f"privacy.epsilon must be a finite number > 0, got {epsilon}")
    if not (isinstance(delta, (int, float)) and 0 < delta < 1):
        raise BudgetError(f"privacy.delta must be in (0, 1), got {delta}")
