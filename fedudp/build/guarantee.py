"""What the run states about its privacy: the guarantee, the ledger's head, the audit options'
requirements and the estimator's minimum number of users."""

from __future__ import annotations

import warnings

from fedudp.aggregators import Aggregator
from fedudp.build.plan import public_numbers
from fedudp.build.run_settings import placement, randomness
from fedudp.config import (
    Accounting,
    ConfigError,
    Placement,
    RandomnessMode,
    RunConfig,
    Unit,
)
from fedudp.privacy.accountant import MAX_PLD_POINTS, Ledger, pld_too_large
from fedudp.protocol.methods import MethodSpec

__all__ = ["run_guarantee", "ledger", "check_audit", "warn_min_users"]


# -- the ledger -----------------------------------------------------------------------------------
def run_guarantee(spec: MethodSpec, aggregator: Aggregator | None) -> str:
    """The method's guarantee, downgraded to heuristic when the aggregator's own accounting
    follows a paper's unproven constant (``privacy.accounting=paper``).

    Parameters
    ----------
    spec : MethodSpec
        The method's spec (its guarantee).
    aggregator : Aggregator or None
        The estimator.

    Returns
    -------
    str
        ``weakened`` (``audit.noise_scale`` != 1), ``heuristic`` or the method's guarantee.
    """
    if aggregator is not None and aggregator.noise_scale != 1.0:
        return "weakened"  # audit.noise_scale: less noise than the ledger accounts
    if aggregator is not None and aggregator.guarantee == "heuristic":
        return "heuristic"
    return spec.guarantee


def ledger(cfg: RunConfig, spec: MethodSpec, aggregator: Aggregator | None) -> Ledger:
    """The run's ledger head: unit, adjacency, accounting, guarantee, what is public, what is
    released outside the guarantee.

    Parameters
    ----------
    cfg, spec, aggregator : RunConfig, MethodSpec, Aggregator or None
        The configuration, the method's spec and its estimator.

    Returns
    -------
    Ledger
        The ledger, no release yet (its notes, public numbers and randomness set).
    """
    p = cfg.privacy
    private = spec.private
    notes = [
        "released outside the DP guarantee (simulator observations, not covered by epsilon): "
        "the per-round diagnostics in metrics.jsonl (clipped/kept fractions, cohort sizes, "
        "failures, the estimators' scores and checks), the counts of owners, users and "
        "records in summary.json, and the evaluation accuracy and loss of every owner "
        "(metrics.jsonl, owners.csv; on engine=flower sent by the owners in evaluate "
        "replies), computed with personal parameters trained "
        + (
            "with the full-DP baseline's noise (algorithm.noise_personal)"
            if cfg.algorithm.noise_personal
            else "without noise"
        ),
        "the number of units N (hence the Poisson denominator q*N) and each owner's user "
        "count are treated as public",
        "epsilon certifies the idealized mechanism; seeded randomness is a simulation"
        if RandomnessMode(p.randomness) == RandomnessMode.seeded
        else "epsilon certifies the idealized mechanism; release noise and privacy sampling "
        "from OS entropy (privacy.randomness=secure; 64-bit seeds for torch's generators, "
        "float64 noise; floating-point attacks on the Gaussian are not addressed)",
    ]
    if spec.feedback and spec.unit == Unit.user:
        notes.append(
            "paper mode: shared vectors are computed at each owner's own personal "
            "parameters (trained without noise on all its users), which the per-user "
            "accounting ignores (docs/algorithms.md#certified-vs-paper-accounting): "
            "guarantee is heuristic"
        )
    if aggregator is not None and private:
        notes += aggregator.ledger_notes()
    if Unit(p.unit) == Unit.record:
        notes.append("records_per_user=1: each user is one record, so user level is record level")
    unit = Unit(p.unit).value if private else None
    dp_agg = aggregator if private else None  # a private method always has its estimator
    accountant = dp_agg.accountant if dp_agg is not None else None
    if (
        dp_agg is not None
        and accountant is not None
        and accountant.startswith("dp_accounting.PLDAccountant")
        and pld_too_large(dp_agg.dp_event())
    ):
        # a noise so small that its PLD would not fit: RDP accounts for it (an upper bound too)
        accountant = (
            "dp_accounting.RdpAccountant (the PLD of this noise multiplier would hold "
            f"more than {MAX_PLD_POINTS:.0e} values)"
        )
    led = Ledger(
        unit=unit,
        adjacency=dp_agg.adjacency if dp_agg is not None else None,
        accounting=Accounting(p.accounting).value if private else None,
        guarantee=run_guarantee(spec, aggregator),
        mechanism=aggregator.name if aggregator else "none",
        accountant=accountant,
        delta=p.delta if private else None,
        target_epsilon=p.epsilon if private else None,
        notes=notes,
        trust=dp_agg.trust if dp_agg is not None else None,
    )
    led.extra["public"] = public_numbers(cfg)
    led.randomness = randomness(cfg).ledger_name
    return led


AUDITABLE = ("gaussian", "gaussian_adaptive")


def check_audit(cfg: RunConfig, spec: MethodSpec, aggregator: Aggregator | None) -> None:
    """``audit.canaries`` and ``audit.noise_scale`` need clip + Gaussian on the billboard.

    Parameters
    ----------
    cfg, spec, aggregator : RunConfig, MethodSpec, Aggregator or None
        The configuration, the method's spec and its estimator.

    Raises
    ------
    ConfigError
        An audit key set without clip + Gaussian on the billboard, or with a training
        algorithm.
    """
    for key, on in (
        ("audit.canaries", cfg.audit.canaries != 0),
        ("audit.noise_scale", cfg.audit.noise_scale != 1.0),
    ):
        if not on:
            continue
        name = aggregator.name if aggregator is not None else "none"
        if not spec.private or name not in AUDITABLE or placement(cfg) != Placement.server:
            raise ConfigError(
                f"{key}: works with clip + Gaussian on the billboard (method=full_dp "
                f"or joint_dp, aggregator=gaussian or privacy.clip_policy=adaptive, "
                f"privacy.placement=server), not method={cfg.method.value} "
                f"aggregator={name}"
            )
        if str(cfg.algorithm.name) != "none":
            raise ConfigError(
                f"{key}: not with a seed's training algorithm (algorithm.name={cfg.algorithm.name})"
            )


def warn_min_users(aggregator: Aggregator | None) -> dict:
    """An unmet theoretical minimum number of users for the estimator's utility guarantee: a
    warning (privacy holds for any n) and the summary's fields.

    Parameters
    ----------
    aggregator : Aggregator or None
        The estimator (its ``min_users_required`` and sampling population).

    Returns
    -------
    dict
        ``min_users_met``, ``min_users_required`` and ``units``; empty where no minimum.
    """
    need = aggregator.min_users_required if aggregator is not None else None
    if need is None or aggregator is None:
        return {}
    n = aggregator.sampling.population
    if n < need:
        warnings.warn(
            f"aggregator={aggregator.name}: n={n} units is below the theoretical "
            f"minimum {need} for its utility guarantee (privacy still holds)",
            stacklevel=1,  # (the default: the warning names this line)
        )
    return {"min_users_met": bool(n >= need), "min_users_required": int(need), "units": int(n)}
