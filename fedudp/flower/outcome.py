"""The outcome of a ``UserLevelDP`` run and the utility it can expect, in the log and the
ledger (``fedudp.flower.strategy``): ``finish`` after the last round (``RunFailed`` when nothing
was released), ``log_utility`` before round 1 (public numbers only).
"""

from __future__ import annotations

from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.common import log

from fedudp.flower.contract import release_noise
from fedudp.flower.wire import is_personal
from fedudp.protocol import ledger_file

__all__ = ["RunFailed", "finish", "log_utility"]


class RunFailed(RuntimeError):
    """No training round of a ``UserLevelDP`` run released (every one was withheld)."""


def finish(dp: Any, num_rounds: int) -> dict:
    """The run's outcome, in the log and the ledger (``ledger.extra["outcome"]``): every
    round released, some withheld (a warning naming them), or none released (``RunFailed``:
    the ServerApp's run then ends failed, not completed)."""
    released = [e.round for e in dp.ledger.entries]
    withheld = [r for r, _ in dp.withheld]
    status = (
        "failed: nothing released"
        if num_rounds > 0 and not released
        else f"completed, {len(withheld)} of {num_rounds} rounds withheld"
        if withheld
        else "completed"
    )
    out = {
        "status": status,
        "rounds": num_rounds,
        "released": len(released),
        "withheld": [[r, why] for r, why in dp.withheld],
        "stopped": dp.stopped,
        "epsilon": dp.epsilon,
    }
    dp.ledger.extra["outcome"] = out
    if dp.ledger_path is not None:  # the final head (outcome, utility) and every line
        ledger_file.write(dp.ledger_path, ledger_file.head(dp.ledger), dp.ledger.entries)
    if status.startswith("failed"):
        if dp.withheld:
            r, why = dp.withheld[-1]
            reason = (
                f"every training round was withheld, nothing released (round {r}: {why}); "
                "see the clients' reasons above"
            )
        else:
            reason = f"no training round released ({dp.stopped or 'no round was run'})"
        log(WARNING, "UserLevelDP: run failed: %s", reason)
        raise RunFailed(f"UserLevelDP: {reason}")
    if withheld:
        log(
            WARNING,
            "UserLevelDP: %s of %s training rounds were withheld and released nothing "
            "(rounds %s; the last: %s); %s released, epsilon %.4f",
            len(withheld),
            num_rounds,
            ", ".join(map(str, withheld[:20])) + (" ..." if len(withheld) > 20 else ""),
            dp.withheld[-1][1],
            len(released),
            dp.epsilon,
        )
    else:
        log(
            INFO,
            "UserLevelDP: %s of %s rounds released, epsilon %.4f at delta %g%s",
            len(released),
            num_rounds,
            dp.epsilon,
            dp.delta,
            f" ({dp.stopped})" if dp.stopped else "",
        )
    return out


def log_utility(dp: Any, initial_arrays: ArrayRecord) -> dict:
    """Before round 1: the expected cohort q·N, the std per coordinate of the noise on the
    released mean update and its expected norm over the d shared coordinates, against a
    typical update norm (``expected_update_norm``, else the clip C: no user's clipped
    update is longer, so a mean of aligned updates is at most C). Warns when the noise's
    norm exceeds it. Public numbers only (the estimator's calibration, q, N, d)."""
    names = [k for k in initial_arrays if not is_personal(k, dp.personal)]
    dim = sum(int(np.prod(initial_arrays[k].shape)) for k in names)
    samp = dp.aggregator.sampling
    std, how = release_noise(dp.aggregator, dim)
    clip = dp.aggregator.constraint.clip
    typical, what = (
        (dp.expected_update_norm, "fedudp.expected-update-norm")
        if dp.expected_update_norm is not None
        else (clip, "the clip C")
        if clip is not None
        else (dp.update_bound, "the bound B (fedudp.estimator.bound)")
    )
    u: dict[str, Any] = {
        "expected_cohort": float(samp.rate * samp.population),
        "users": int(samp.population),
        "rate": float(samp.rate),
        "dim": dim,
        "noise_std": std,
        "noise_norm": None if std is None else std * float(np.sqrt(dim)),
        "typical_norm": typical,
        "typical_from": what,
    }
    dp.utility = u
    dp.ledger.extra["utility_before_round_1"] = dict(u, noise_from=how)
    if std is None:
        log(
            INFO,
            "UserLevelDP: %s; expected cohort q*N = %.4g*%d = %.4g users per round (%s)",
            dp.aggregator.name,
            samp.rate,
            samp.population,
            u["expected_cohort"],
            how,
        )
        return u
    log(
        INFO,
        "UserLevelDP: %s, expected cohort q*N = %.4g*%d = %.4g users per round; noise on "
        "the released mean update: std %.4g per coordinate (%s), expected norm %.4g over "
        "d = %d shared coordinates",
        dp.aggregator.name,
        samp.rate,
        samp.population,
        u["expected_cohort"],
        std,
        how,
        u["noise_norm"],
        dim,
    )
    if typical is not None and u["noise_norm"] > typical:
        log(
            WARNING,
            "UserLevelDP: the noise dominates: its expected norm %.4g per round exceeds a "
            "typical update norm %.4g (%s) by %.3gx; more users N, a larger q, fewer rounds, "
            "a larger epsilon or a smaller model would reduce it",
            u["noise_norm"],
            typical,
            what,
            u["noise_norm"] / typical,
        )
    return u
