"""User-level DP mean estimators under one interface (ARCHITECTURE.md §4).

``build_aggregator(cfg, sampling, rounds)`` returns the configured estimator with its noise
calibrated for the whole schedule. Each builder takes the run config, the ``Sampling`` of
one release and the number of planned releases.
"""
from __future__ import annotations

from typing import Callable

from fedudp.aggregators.base import Aggregate, Aggregator, Sampling, clip_rows, finite_rows
from fedudp.aggregators.gaussian import GaussianAggregator, MeanAggregator, gaussian_round_event
from fedudp.config import AggregatorName, ConfigError, RunConfig, resolved_aggregator
from fedudp.privacy.accountant import calibrate_noise_multiplier

__all__ = ["Aggregate", "Aggregator", "Sampling", "clip_rows", "finite_rows", "build_aggregator",
           "GaussianAggregator", "MeanAggregator", "BUILDERS"]


def _gaussian(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int = 0) -> GaussianAggregator:
    p = cfg.privacy
    z = p.noise_multiplier
    if z is None:
        z = calibrate_noise_multiplier(lambda s: gaussian_round_event(s, sampling.rate),
                                       p.epsilon, p.delta, rounds)
    return GaussianAggregator(p.clip, z, sampling)


def _none(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int = 0) -> MeanAggregator:
    return MeanAggregator()


def _units_records(cfg: RunConfig, sampling: Sampling) -> int:
    """Records per privacy unit m (public): records_per_user, or an owner's share at owner level."""
    from fedudp.config import Unit
    if Unit(cfg.privacy.unit) == Unit.owner:
        return max(1, cfg.dataset.num_records // max(1, cfg.partition.num_owners))
    return int(cfg.partition.records_per_user)


def _winsorized(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int = 0):
    from fedudp.aggregators import winsorized as W
    from fedudp.config import Calibration
    from fedudp.privacy.mechanisms import next_pow2
    p, e = cfg.privacy, cfg.estimator
    if p.noise_multiplier is not None:
        raise ConfigError("privacy.noise_multiplier: only aggregator=gaussian takes a fixed noise "
                          "multiplier; aggregator=winsorized calibrates its per-coordinate budget")
    if sampling.rate < 1.0:
        raise ConfigError("train.sampling_rate: aggregator=winsorized is analysed replace-one with "
                          "a public n (every unit, every round); set train.sampling_rate=1")
    if dim < 1:
        raise ConfigError("aggregator=winsorized needs at least one shared parameter")
    n, coords = sampling.population, next_pow2(dim)
    tau = e.tau if e.tau is not None else W.default_tau(e.bound, n, _units_records(cfg, sampling), e.beta)
    if Calibration(p.calibration) == Calibration.closed_form:
        eps_coord = W.closed_form_eps_coord(p.epsilon, p.delta, rounds, coords)
    else:
        z = calibrate_noise_multiplier(lambda z: W.winsorized_round_event(1.0 / z, coords),
                                       p.epsilon, p.delta, rounds)
        eps_coord = 1.0 / z
    agg = W.WinsorizedAggregator(dim, tau, e.bound, eps_coord, sampling, gamma=e.beta)
    agg.min_users_required = W.min_users(coords, eps_coord, e.bound, agg.tau_coord, e.beta)
    return agg


def _filter_common(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int, name: str):
    """Checks and τ shared by outlier_removal and friendlycore (ALGORITHMS.md §4.2)."""
    p, e = cfg.privacy, cfg.estimator
    if p.noise_multiplier is not None:
        raise ConfigError(f"privacy.noise_multiplier: aggregator={name} calibrates its own noise; "
                          "leave it null")
    if sampling.rate < 1.0:
        raise ConfigError(f"train.sampling_rate: aggregator={name} is analysed replace-one with a "
                          "public n (every unit, every round); set train.sampling_rate=1")
    if dim < 1:
        raise ConfigError(f"aggregator={name} needs at least one shared parameter")
    import math
    m = _units_records(cfg, sampling)
    # [ASI] §4.3 practical default: τ = κ G sqrt(log(2nT/γ)/m) with κ = 1, G = estimator.bound
    tau = e.tau if e.tau is not None else e.bound * math.sqrt(
        math.log(2 * sampling.population * rounds / e.beta) / m)
    return p, e, tau


def _paper_sensitivity(tau: float, n: int, eps: float, delta: float, rounds: int) -> float:
    """[ASI] Lemma 3.5 read with constant 1: Δ = τ log(1/ζ')/n, ζ' = δ/(2(e^ε + 1 + T))."""
    import math
    zeta = delta / (2 * (math.exp(eps) + 1 + rounds))
    return tau * math.log(1 / zeta) / n


def _outlier_removal(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int = 0):
    """[ASI] Alg. 2: ε/2 for the one AboveThreshold, ε/2 (at δ/2) for the T Gaussian releases,
    δ/4 for AT passing a non-concentrated query, δ/4 for the coupling's ζ over T rounds."""
    from fedudp.aggregators import outlier as O
    from fedudp.config import Accounting, Calibration
    from fedudp.privacy.accountant import schedule_epsilon
    import dp_accounting
    p, e, tau = _filter_common(cfg, sampling, rounds, dim, "outlier_removal")
    n, eps, delta = sampling.population, p.epsilon, p.delta
    eps_at = eps / 2
    need = O.min_users_at(eps_at, rounds, delta / 4)
    if n < need:
        raise ConfigError(
            f"partition: aggregator=outlier_removal needs n >= {need} users (7.5 α_AT for "
            f"AboveThreshold at ε/2={eps_at:g}, T={rounds}, failure δ/4) for its privacy proof; "
            f"got n={n}. Raise users or privacy.epsilon, or use aggregator=gaussian")
    paper = Accounting(p.accounting) == Accounting.paper
    sens = (_paper_sensitivity(tau, n, eps, delta, rounds) if paper
            else O.sensitivity(tau, n, delta / (4 * rounds)))

    def event(z):
        return dp_accounting.GaussianDpEvent(z)
    if Calibration(p.calibration) == Calibration.closed_form:
        z = O.paper_sigma(tau, n, eps, delta, rounds) / sens
        got = eps_at + schedule_epsilon(event, z, rounds, delta / 2)
        if got > eps * (1 + 1e-6):
            raise ConfigError(
                f"privacy.calibration=closed_form: the paper's σ certifies ε={got:.3g} > "
                f"privacy.epsilon={eps:g} with the explicit sensitivity 30τK/n; use "
                "privacy.accounting=paper (heuristic) or privacy.calibration=accountant")
    else:
        z = calibrate_noise_multiplier(event, eps - eps_at, delta / 2, rounds)
    agg = O.OutlierRemovalAggregator(tau, z, sens, sampling, eps_at, rounds, delta / 2, need)
    agg.guarantee = "heuristic" if paper else "certified"
    return agg


def _friendlycore(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int = 0):
    """FriendlyCore filter per round: Laplace mass check (noise multiplier b = z) + Gaussian
    (z), composed with dp-accounting at δ/2; the rest of δ covers the failure terms."""
    from fedudp.aggregators import outlier as O
    from fedudp.config import Accounting, Calibration
    p, e, tau = _filter_common(cfg, sampling, rounds, dim, "friendlycore")
    if Calibration(p.calibration) == Calibration.closed_form:
        raise ConfigError("privacy.calibration=closed_form: aggregator=friendlycore has no seed "
                          "closed form (FriendlyCore is not one of the seeds); use accountant")
    n, eps, delta = sampling.population, p.epsilon, p.delta
    paper = Accounting(p.accounting) == Accounting.paper
    zeta = delta / (4 * rounds)
    sens = (_paper_sensitivity(tau, n, eps, delta, rounds) if paper
            else O.friendlycore_sensitivity(tau, n, zeta))
    z = calibrate_noise_multiplier(lambda z: O.friendlycore_round_event(z, z), eps, delta / 2, rounds)
    need = n
    while rounds * O.friendlycore_failure(need, z) <= delta / 4 and need > 1:
        need = max(1, need // 2)
    while rounds * O.friendlycore_failure(need, z) > delta / 4:
        need += max(1, need // 64)
    if n < need:
        raise ConfigError(
            f"partition: aggregator=friendlycore needs n >= {need} units so that a release with a "
            f"small kept set has probability <= δ/(4T) (mass check multiplier {z:.3g}); got n={n}. "
            "Raise users or privacy.epsilon")
    agg = O.FriendlyCoreAggregator(tau, z, sens, sampling, z, delta / 2, need)
    agg.guarantee = "heuristic" if paper else "certified"
    return agg


def _few_users(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int = 0):
    """[ESF] DP-Estimate-2 (optionally on rotated blocks); radius τ of the users' vectors."""
    from fedudp.aggregators.few_users import FewUsersAggregator
    from fedudp.config import Calibration
    import math
    p, e = cfg.privacy, cfg.estimator
    if p.noise_multiplier is not None:
        raise ConfigError("privacy.noise_multiplier: aggregator=few_users has no noise multiplier")
    if Calibration(p.calibration) == Calibration.closed_form:
        raise ConfigError("privacy.calibration=closed_form: [ESF]'s splits are Θ(·) without "
                          "constants; aggregator=few_users uses the proof's (ε/4, δ/4) per copy "
                          "and basic composition (calibration=accountant)")
    if sampling.rate < 1.0:
        raise ConfigError("train.sampling_rate: aggregator=few_users needs every unit every round "
                          "(replace-one, public n); set train.sampling_rate=1")
    if dim < 1:
        raise ConfigError("aggregator=few_users needs at least one shared parameter")
    m = _units_records(cfg, sampling)
    tau = e.tau if e.tau is not None else 10 * e.bound / math.sqrt(m)   # [ESF] r' = 10 r/√m
    try:
        return FewUsersAggregator(dim, tau, p.epsilon, p.delta, rounds, sampling, copies=e.copies,
                                  blocks=e.blocks, kappa=e.kappa, tries=e.tries, beta=e.beta)
    except ValueError as err:
        raise ConfigError(f"aggregator=few_users with n={sampling.population} units, "
                          f"ε={p.epsilon:g} over {rounds} rounds x {e.copies} copies x "
                          f"{e.blocks} blocks: {err}") from None


BUILDERS: dict[AggregatorName, Callable[..., Aggregator]] = {
    AggregatorName.gaussian: _gaussian,
    AggregatorName.none: _none,
    AggregatorName.winsorized: _winsorized,
    AggregatorName.outlier_removal: _outlier_removal,
    AggregatorName.friendlycore: _friendlycore,
    AggregatorName.few_users: _few_users,
}


def build_aggregator(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int = 0) -> Aggregator:
    """``dim``: the length of the vectors it will average (the shared dimension)."""
    name = resolved_aggregator(cfg)
    if name not in BUILDERS:
        raise ConfigError(f"aggregator: {name.value} is not available in this build "
                          f"(available: {sorted(k.value for k in BUILDERS)})")
    return BUILDERS[name](cfg, sampling, rounds, dim)
