"""The outcome of a ``UserLevelDP`` run and the utility it can expect, in the log and the
ledger (``fedudp.flower.strategy``): ``finish`` after the last round (``RunFailed`` when nothing
was released), ``log_utility`` before round 1 (public numbers only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common import log

from fedudp.flower.collect import Collected
from fedudp.flower.wire import is_personal, weighted_metrics
from fedudp.protocol import ledger_file
from fedudp.protocol.contributions import Contribution

__all__ = ["RunFailed", "finish", "log_utility", "release_noise", "hand_over", "summary"]


class RunFailed(RuntimeError):
    """No training round of a ``UserLevelDP`` run released (every one was withheld)."""


def finish(dp: Any, num_rounds: int) -> dict:
    """The run's outcome, in the log and the ledger (``ledger.extra["outcome"]``): every
    round released, some withheld (a warning naming them), or none released (``RunFailed``:
    the ServerApp's run then ends failed, not completed).

    Parameters
    ----------
    dp : UserLevelDP
    num_rounds : int

    Returns
    -------
    dict
        The outcome.

    Raises
    ------
    RunFailed
        No round released.
    """
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
    norm exceeds it. Public numbers only (the estimator's calibration, q, N, d).

    Parameters
    ----------
    dp : UserLevelDP
    initial_arrays : flwr.app.ArrayRecord

    Returns
    -------
    dict
        What was logged (also ``dp.utility``).
    """
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


def release_noise(aggregator: Any, dim: int) -> tuple[float | None, str]:
    """(the standard deviation per coordinate of the noise on the released *mean* update, how it
    was obtained), from the estimator's own calibrated constants; (None, why) where no single
    number describes it. Clip + Gaussian: z·C / (q·N); outlier removal and FriendlyCore: their
    Gaussian's std (added to the mean); winsorized: the Laplace noise's std per rotated
    coordinate, sqrt(2)·(2/ε')·(2·h·τ') / N (the rotation keeps norms).

    Parameters
    ----------
    aggregator : Aggregator
        A calibrated fedudp estimator.
    dim : int
        The number of shared coordinates d.

    Returns
    -------
    tuple[float or None, str]
    """
    from fedudp.aggregators.base import ClippedSumAggregator
    from fedudp.aggregators.distributed import DistributedAggregator

    if isinstance(aggregator, DistributedAggregator):  # the shares' sum at min_owners
        cohort = aggregator.sampling.expected_cohort
        return float(aggregator.noise_std) / cohort, "the noise shares' sum/(q·N)"
    if isinstance(aggregator, ClippedSumAggregator):
        cohort = aggregator.sampling.expected_cohort
        return float(aggregator.noise_std) / cohort, "z·C/(q·N)"
    if aggregator.name == "winsorized":
        n = aggregator.sampling.population
        scale = aggregator.noise_multiplier * 2.0 * aggregator.h * aggregator.tau_coord
        return math.sqrt(2.0) * scale / n, "Laplace sqrt(2)·(2/ε')·2hτ'/N"
    std = getattr(aggregator, "noise_std", None)
    if std is not None:
        return float(std), "its Gaussian's std on the mean"
    return None, f"{aggregator.name}: no single noise std (data-dependent)"


# -- the docs' table ----------------------------------------------------------------------------


def hand_over(
    dp: Any,
    server_round: int,
    arrays: ArrayRecord,
    replies: Sequence[Message],
    got: Collected,
    c: Contribution,
    eps: float,
) -> tuple[ArrayRecord | None, MetricRecord | None]:
    """The wrapped strategy applies the one private update as it would a client's model;
    its metrics: the app's training metrics over all the clients' users, record-weighted
    (outside the DP guarantee, as the ledger says).

    Parameters
    ----------
    dp : UserLevelDP
    server_round : int
    arrays : flwr.app.ArrayRecord
        The broadcast plus the released mean update.
    replies : Sequence[flwr.app.Message]
        The round's replies (the first is the wrapped strategy's ``reply_to``).
    got : Collected
        What the replies held.
    c : Contribution
        The merged contribution (its count of users).
    eps : float
        The ε after this release.

    Returns
    -------
    tuple[flwr.app.ArrayRecord or None, flwr.app.MetricRecord or None]
        The wrapped strategy's arrays (else ``arrays``) and the round's metrics.
    """
    app_metrics = (
        weighted_metrics(got.train_metrics)
        if got.train_metrics
        else MetricRecord({"num-examples": 1})
    )
    inner_arrays, inner_metrics = dp.strategy.aggregate_train(
        server_round,
        [
            Message(
                RecordDict({"arrays": arrays, "metrics": app_metrics}),
                reply_to=replies[0],
            )
        ]
        if replies
        else [],
    )
    metrics = MetricRecord(
        {
            "epsilon": eps,
            "users": int(c.count),
            "clients": len(got.parts),
            "failed_clients": got.failed,
            "nonfinite_users": got.nonfinite,
            "raised_users": got.raised,
            "delta": dp.delta,
        }
    )
    shown = ", ".join(
        f"{k} {v:.4g}" for k, v in app_metrics.items() if k != "num-examples" and got.train_metrics
    )
    log(
        INFO,
        "UserLevelDP round %s: %s clients replied (%s failed), %s users released as one "
        "update, epsilon %.4f (delta %g)%s",
        server_round,
        len(got.parts),
        got.failed,
        c.count,
        eps,
        dp.delta,
        f"; the app's training metrics: {shown}" if shown else "",
    )
    if inner_metrics is not None:
        for k, v in inner_metrics.items():
            if k not in metrics:
                metrics[k] = v
    return (inner_arrays if inner_arrays is not None else arrays), metrics


def summary(dp: Any) -> None:
    """Flower's strategy summary, logged by ``start`` before round 1: the estimator, the
    rounds it is calibrated for, the budget and the randomness (and, once rounds have run,
    the releases so far and their ε).

    Parameters
    ----------
    dp : UserLevelDP
    """
    n = len(dp.ledger.entries)
    so_far = (
        f"{n} release{'s' if n != 1 else ''} so far, epsilon {dp.epsilon:.4f}"
        if n or dp.withheld
        else "nothing released yet"
    )
    log(
        INFO,
        "UserLevelDP: estimator %s for %s rounds, target epsilon %s at delta %g, "
        "randomness %s; %s%s",
        dp.aggregator.name,
        dp.rounds if dp.rounds is not None else "any number of",
        f"{dp.target_epsilon:g}" if dp.target_epsilon is not None else "none",
        dp.delta,
        dp.randomness.ledger_name,
        so_far,
        f" ({dp.stopped})" if dp.stopped else "",
    )
    dp.strategy.summary()
