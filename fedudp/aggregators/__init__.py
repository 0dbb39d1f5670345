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


BUILDERS: dict[AggregatorName, Callable[..., Aggregator]] = {
    AggregatorName.gaussian: _gaussian,
    AggregatorName.none: _none,
    AggregatorName.winsorized: _winsorized,
}


def build_aggregator(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int = 0) -> Aggregator:
    """``dim``: the length of the vectors it will average (the shared dimension)."""
    name = resolved_aggregator(cfg)
    if name not in BUILDERS:
        raise ConfigError(f"aggregator: {name.value} is not available in this build "
                          f"(available: {sorted(k.value for k in BUILDERS)})")
    return BUILDERS[name](cfg, sampling, rounds, dim)
