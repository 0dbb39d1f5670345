"""One-line notices about a run's length (standard library only; issue 49).

A calibration makes any number of rounds feasible (``train.rounds=1000000000`` at q = 0.01
calibrates in seconds), so a typo can start a run of years. Two notices, never a refusal (a long
run may be meant): before round 1, a run of more than ``LONG_RUN_ROUNDS`` rounds says so; after
the second round a process runs (the first includes start-up work, many times a later round's
time: docs/benchmarks.md#figures-from-the-codes-docstrings), a run whose remaining rounds at that round's
measured speed would take more than ``LONG_RUN_SECONDS`` says how long. Both change nothing the run computes, and a stopped run
continues with ``resume=``.
"""

from __future__ import annotations

__all__ = ["LONG_RUN_ROUNDS", "LONG_RUN_SECONDS", "duration_text", "rounds_notice", "speed_notice"]

LONG_RUN_ROUNDS = 100_000  # more rounds than any experiment of fedudp's docs
LONG_RUN_SECONDS = 86_400.0  # a day


def duration_text(seconds: float) -> str:
    """``90`` -> ``1.5 minutes``; ``5e7`` -> ``1.6 years``.

    Parameters
    ----------
    seconds : float

    Returns
    -------
    str
    """
    for unit, size in (("year", 365.25 * 86400), ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = f"{seconds / size:.3g}"
            return f"{n} {unit}{'' if n == '1' else 's'}"
    return f"{seconds:.3g} seconds"


def rounds_notice(rounds: int, done: int = 0, limit: int | None = None) -> str | None:
    """Before round ``done + 1`` of a run of ``rounds`` rounds (``done``: a resumed run's rounds
    so far): the notice when more than ``limit`` (``LONG_RUN_ROUNDS``) rounds are left, else
    None.

    Parameters
    ----------
    rounds, done : int
        The run's rounds; those already done.
    limit : int, optional
        The most rounds left without a notice (default ``LONG_RUN_ROUNDS``).

    Returns
    -------
    str or None
    """
    limit = LONG_RUN_ROUNDS if limit is None else int(limit)
    left = int(rounds) - int(done)
    if left <= limit:
        return None
    return (
        f"train.rounds={int(rounds)}: this run has {left:,} rounds to go (more than "
        f"{limit:,}); its expected length is reported after the first round. Lower "
        "train.rounds if this is not meant (Ctrl-C stops the run cleanly, resume= continues it)"
    )


def speed_notice(
    rounds: int, round_: int, seconds: float, limit: float | None = None
) -> str | None:
    """After round ``round_`` (this process's second) took ``seconds``: the notice when the
    ``rounds - round_`` rounds left would take more than ``limit`` (``LONG_RUN_SECONDS``)
    seconds at that speed (an estimate: a round's time varies, and a budget or the estimator
    may stop the run earlier), else None.

    Parameters
    ----------
    rounds, round_ : int
        The run's rounds; the round just measured.
    seconds : float
        How long it took.
    limit : float, optional
        The most seconds left without a notice (default ``LONG_RUN_SECONDS``).

    Returns
    -------
    str or None
    """
    limit = LONG_RUN_SECONDS if limit is None else float(limit)
    left = int(rounds) - int(round_)
    estimate = max(float(seconds), 0.0) * left
    if left <= 0 or estimate <= limit:
        return None
    return (
        f"train.rounds={int(rounds)}: round {int(round_)} took {seconds:.3g} s, so the "
        f"{left:,} round{'' if left == 1 else 's'} left would take about {duration_text(estimate)} (more than "
        f"{duration_text(limit)}). Lower train.rounds if this is not meant (Ctrl-C stops the "
        "run cleanly, resume= continues it)"
    )
