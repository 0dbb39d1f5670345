"""The seeds' training algorithms on the one round loop (docs/algorithms.md#training-algorithms),
one module each, chosen with ``algorithm.name`` (presets
``+experiment=levy_alg3|levy_alg4|asi_alg3|asi_alg4|huang_alg1|huang_alg2``).

An algorithm adds no round loop, owner computation or accountant of its own: it builds its
estimators from the aggregator registry, and configures the declared hooks of the billboard
(``fedudp.core.plan``: cohort per round, event per round, server step) and of the owner
component (``OwnerTraining.smoothing_radius``, ``OwnerTraining.personal_step``,
``Owners.round_units``). ``run.prepare`` calls ``check_config`` (before any work) and
``setup``.

Levy et al. Alg. 3 needs no module: it is ``model.name=linear method=full_dp
train.shared_update=gradient aggregator=winsorized`` (preset ``levy_alg3``).
"""
from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

import numpy as np

from fedudp.aggregators.base import Aggregator, Sampling
from fedudp.config import (AlgorithmName, ConfigError, EngineName, Method, RunConfig,
                           SharedUpdate, Unit, resolved_aggregator)

__all__ = ["Context", "Setup", "check_config", "setup"]


@dataclass
class Context:
    """What an algorithm needs to know before the data: the config, the owner component, the
    public counts (owners, users, each owner's users), the shared dimension."""

    cfg: RunConfig
    owners: object                     # fedudp.core.owner.Owners
    owner_users: np.ndarray            # users of each owner (public)
    dim: int

    @property
    def n_users(self) -> int:
        return int(self.owner_users.sum())

    @property
    def n_owners(self) -> int:
        return len(self.owner_users)

    @property
    def m(self) -> int:
        """Records per user."""
        return int(self.cfg.partition.records_per_user)


@dataclass
class Setup:
    aggregator: Aggregator             # the billboard's (the first phase's where there are several)
    plan: object                       # fedudp.algorithms.schedule.AlgorithmPlan
    sampling: Sampling                 # the billboard's units and rate
    summary: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _module(name: AlgorithmName):
    from fedudp.algorithms import asi_alg3, asi_alg4, huang_alg1, huang_alg2, levy_alg4
    return {AlgorithmName.levy_alg4: levy_alg4, AlgorithmName.asi_alg3: asi_alg3,
            AlgorithmName.asi_alg4: asi_alg4, AlgorithmName.huang_alg1: huang_alg1,
            AlgorithmName.huang_alg2: huang_alg2}[name]


def need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def require(cfg: RunConfig, *, methods: tuple[Method, ...], aggregator: str) -> None:
    """The checks every algorithm shares: engine, method, estimator, gradient updates."""
    name = AlgorithmName(cfg.algorithm.name).value
    need(EngineName(cfg.engine) == EngineName.local, "engine",
         f"algorithm.name={name} runs on engine=local only")
    need(Method(cfg.method) in methods, "method",
         f"algorithm.name={name} needs method in {[m.value for m in methods]}, got {Method(cfg.method).value}")
    need(resolved_aggregator(cfg).value == aggregator, "aggregator",
         f"algorithm.name={name} runs its steps with aggregator={aggregator}, got "
         f"{resolved_aggregator(cfg).value}")
    need(SharedUpdate(cfg.train.shared_update) == SharedUpdate.gradient, "train.shared_update",
         f"algorithm.name={name} is a gradient method: set train.shared_update=gradient")
    need(Unit(cfg.privacy.unit) != Unit.owner, "privacy.unit",
         f"algorithm.name={name} is analysed at user (or record) level, not owner")
    a = cfg.algorithm
    need(a.step_size is None or a.step_size > 0, "algorithm.step_size", f"must be null or > 0, got {a.step_size}")
    need(a.radius > 0, "algorithm.radius", f"must be > 0, got {a.radius}")
    need(a.lipschitz is None or a.lipschitz > 0, "algorithm.lipschitz", f"must be null or > 0, got {a.lipschitz}")
    need(a.sigma is None or a.sigma > 0, "algorithm.sigma", f"must be null or > 0, got {a.sigma}")
    need(a.smoothing_radius is None or a.smoothing_radius >= 0, "algorithm.smoothing_radius",
         f"must be null or >= 0, got {a.smoothing_radius}")
    need(a.phases is None or a.phases >= 1, "algorithm.phases", f"must be null or >= 1, got {a.phases}")
    need(a.lam is None or a.lam >= 0, "algorithm.lam", f"must be null or >= 0, got {a.lam}")
    need(a.strong_convexity > 0, "algorithm.strong_convexity", f"must be > 0, got {a.strong_convexity}")
    need(a.smoothness > 0, "algorithm.smoothness", f"must be > 0, got {a.smoothness}")


def check_config(cfg: RunConfig) -> None:
    """Config-only checks of the chosen algorithm (``ConfigError`` naming the key)."""
    need(not cfg.algorithm.noise_personal or AlgorithmName(cfg.algorithm.name) == AlgorithmName.huang_alg1,
         "algorithm.noise_personal", "is Huang Alg. 1's full-DP baseline: it needs "
         f"algorithm.name=huang_alg1, got {AlgorithmName(cfg.algorithm.name).value}")
    if AlgorithmName(cfg.algorithm.name) == AlgorithmName.none:
        return
    _module(AlgorithmName(cfg.algorithm.name)).check_config(cfg)


def setup(ctx: Context) -> Setup | None:
    """The algorithm's estimators, plan and owner hooks (None for ``algorithm.name=none``)."""
    name = AlgorithmName(ctx.cfg.algorithm.name)
    if name == AlgorithmName.none:
        return None
    s = _module(name).setup(ctx)
    s.summary = {"name": name.value, **s.summary}
    return s


def with_keys(cfg: RunConfig, **keys) -> RunConfig:
    """A copy of ``cfg`` with dotted keys set (an estimator calibrated for one phase)."""
    c = copy.deepcopy(cfg)
    for k, v in keys.items():
        obj = c
        *path, last = k.split("__")
        for p in path:
            obj = getattr(obj, p)
        setattr(obj, last, v)
    return c


def set_owner_hooks(owners, plan, **training) -> None:
    """The owner component's declared hooks: training options and the round's cohort."""
    owners.training = dataclasses.replace(owners.training, **training)
    owners.round_units = plan.cohort


def split_rounds(total: int, parts: int, key: str = "train.rounds") -> list[int]:
    need(total >= parts, key, f"{total} rounds cannot be split over {parts} phases")
    base, extra = divmod(total, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def public_permutation(seed: int, n: int) -> np.ndarray:
    from fedudp.randomness import Purpose, numpy_rng
    return numpy_rng(seed, Purpose.SCHEDULE, 0).permutation(n)
