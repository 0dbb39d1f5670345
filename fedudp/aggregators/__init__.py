"""User-level DP mean estimators, one module each, registered by name
(docs/architecture.md#aggregator, docs/algorithms.md#user-level-mean-estimators).

``aggregator=<name>`` builds ``REGISTRY[name].from_config(cfg, sampling, rounds, dim)``;
``check_aggregator_config(cfg)`` runs the chosen estimator's config-only checks before any
data is loaded. ``privacy.placement=local_dpsgd`` (private methods) uses ``LocalDpSgdMean``:
the noise is added inside the owners, the billboard only averages.
"""
from __future__ import annotations

from fedudp.aggregators import few_users, gaussian, outlier, winsorized  # noqa: F401  (register)
from fedudp.aggregators.base import (REGISTRY, Aggregate, Aggregator, Constraint, Contribution,
                                     ParameterError, Sampling, clip_rows, finite_rows, register)
from fedudp.aggregators.few_users import FewUsersAggregator
from fedudp.aggregators.gaussian import GaussianAggregator, MeanAggregator
from fedudp.aggregators.local_dpsgd import LocalDpSgdMean
from fedudp.aggregators.outlier import FriendlyCoreAggregator, OutlierRemovalAggregator
from fedudp.aggregators.winsorized import WinsorizedAggregator
from fedudp.config import ConfigError, Method, Placement, RunConfig, resolved_aggregator

__all__ = ["Aggregate", "Aggregator", "Constraint", "Contribution", "Sampling", "REGISTRY",
           "register", "clip_rows", "finite_rows", "aggregator_class", "build_aggregator",
           "check_aggregator_config", "GaussianAggregator", "MeanAggregator", "LocalDpSgdMean",
           "WinsorizedAggregator", "OutlierRemovalAggregator", "FriendlyCoreAggregator",
           "FewUsersAggregator", "ParameterError"]


def aggregator_class(cfg: RunConfig) -> type[Aggregator]:
    if (Placement(cfg.privacy.placement) == Placement.local_dpsgd
            and Method(cfg.method) in (Method.full_dp, Method.joint_dp)):
        return LocalDpSgdMean
    name = resolved_aggregator(cfg).value
    if name not in REGISTRY:
        raise ConfigError(f"aggregator: {name} is not available in this build "
                          f"(available: {sorted(REGISTRY)})")
    return REGISTRY[name]


def check_aggregator_config(cfg: RunConfig) -> None:
    """The configured estimator's checks that need only the config (before data or calibration)."""
    aggregator_class(cfg).check_config(cfg)


def build_aggregator(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int) -> Aggregator:
    """The configured estimator, calibrated over ``rounds`` releases of ``dim``-vectors."""
    cls = aggregator_class(cfg)
    cls.check_config(cfg)
    return cls.from_config(cfg, sampling, rounds, dim)
