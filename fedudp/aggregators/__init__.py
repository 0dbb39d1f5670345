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


def _gaussian(cfg: RunConfig, sampling: Sampling, rounds: int) -> GaussianAggregator:
    p = cfg.privacy
    z = p.noise_multiplier
    if z is None:
        z = calibrate_noise_multiplier(lambda s: gaussian_round_event(s, sampling.rate),
                                       p.epsilon, p.delta, rounds)
    return GaussianAggregator(p.clip, z, sampling)


def _none(cfg: RunConfig, sampling: Sampling, rounds: int) -> MeanAggregator:
    return MeanAggregator()


BUILDERS: dict[AggregatorName, Callable[[RunConfig, Sampling, int], Aggregator]] = {
    AggregatorName.gaussian: _gaussian,
    AggregatorName.none: _none,
}


def build_aggregator(cfg: RunConfig, sampling: Sampling, rounds: int) -> Aggregator:
    name = resolved_aggregator(cfg)
    if name not in BUILDERS:
        raise ConfigError(f"aggregator: {name.value} is not available in this build "
                          f"(available: {sorted(k.value for k in BUILDERS)})")
    return BUILDERS[name](cfg, sampling, rounds)
