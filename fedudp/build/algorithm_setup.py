"""A seed's training algorithm (``algorithm.*``): the plain values it is set up from, its
declared requirements checked against the config, its refusals under their config keys."""

from __future__ import annotations

from typing import Any

from fedudp import algorithms
from fedudp.aggregators import Aggregator, Sampling
from fedudp.aggregators.base import ParameterError
from fedudp.build.estimators import config_key, estimator
from fedudp.build.plan import planned_owner_users
from fedudp.config import (
    Accounting,
    ConfigError,
    EngineName,
    Method,
    RunConfig,
    SharedUpdate,
    Unit,
    resolved_aggregator,
)

__all__ = ["algorithm_context", "check_algorithm", "algorithm_error"]


# -- training algorithms --------------------------------------------------------------------------
def algorithm_context(cfg: RunConfig, dim: int, personal_dim: int = 0) -> algorithms.Context:
    """The plain values a seed's training algorithm is set up from; its estimators are built
    by ``estimator`` with the run's privacy settings (``Context.estimator``).

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``algorithm.*``, ``privacy.*``, ``estimator.*``, ...).
    dim : int
        The shared parameters' dimension d.
    personal_dim : int, default 0
        The personal parameters' dimension (Huang Alg. 1).

    Returns
    -------
    algorithms.Context
        The algorithm's parameters, the privacy budget, the plan's counts and an estimator
        factory.
    """
    a, e = cfg.algorithm, cfg.estimator

    def make_estimator(name: str, sampling: Sampling, rounds: int, **overrides: Any) -> Aggregator:
        return estimator(cfg, sampling, rounds, dim, name=name, **overrides)

    return algorithms.Context(
        params=algorithms.AlgorithmParams(
            step_size=a.step_size,
            radius=a.radius,
            lipschitz=a.lipschitz,
            sigma=a.sigma,
            smoothing_radius=a.smoothing_radius,
            phases=a.phases,
            lam=a.lam,
            strong_convexity=a.strong_convexity,
            smoothness=a.smoothness,
            averaged=a.averaged,
            noise_personal=bool(a.noise_personal),
        ),
        epsilon=float(cfg.privacy.epsilon),
        delta=float(cfg.privacy.delta),
        paper=Accounting(cfg.privacy.accounting) == Accounting.paper,
        rounds=int(cfg.train.rounds),
        seed=int(cfg.seed),
        owner_users=planned_owner_users(cfg),
        records_per_user=int(cfg.partition.records_per_user),
        dim=int(dim),
        clip=float(cfg.privacy.clip),
        bound=float(e["bound"]),
        tau=None if e["tau"] is None else float(e["tau"]),
        beta=float(e["beta"]),
        estimator=make_estimator,
        method=Method(cfg.method).value,
        personal_dim=int(personal_dim),
    )


def check_algorithm(cfg: RunConfig) -> None:
    """The chosen training algorithm's declared requirements and its parameters' ranges.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Raises
    ------
    ConfigError
        ``noise_personal`` without huang_alg1; an engine, method, aggregator, shared update or
        unit the algorithm does not run with; unequal owners where it needs them; a parameter
        it refuses (``algorithm_error``).
    """
    name = str(cfg.algorithm.name)
    if cfg.algorithm.noise_personal and name != "huang_alg1":
        raise ConfigError(
            "algorithm.noise_personal: is Huang Alg. 1's full-DP baseline: it needs "
            f"algorithm.name=huang_alg1, got {name}"
        )
    if name == "none":
        return
    req = algorithms.requirements(name)
    if EngineName(cfg.engine).value not in req.engines:
        raise ConfigError(
            f"engine: algorithm.name={name} runs on engine={'|'.join(req.engines)} only"
        )
    if Method(cfg.method).value not in req.methods:
        raise ConfigError(
            f"method: algorithm.name={name} needs method in "
            f"{list(req.methods)}, got {Method(cfg.method).value}"
        )
    agg = resolved_aggregator(cfg)
    if agg != req.aggregator:
        raise ConfigError(
            f"aggregator: algorithm.name={name} runs its steps with "
            f"aggregator={req.aggregator}, got {agg}"
        )
    if SharedUpdate(cfg.train.shared_update).value != req.shared_update:
        raise ConfigError(
            f"train.shared_update: algorithm.name={name} is a "
            f"{req.shared_update} method: set train.shared_update="
            f"{req.shared_update}"
        )
    if Unit(cfg.privacy.unit).value not in req.units:
        raise ConfigError(
            f"privacy.unit: algorithm.name={name} is analysed at "
            f"{' or '.join(req.units)} level, not {Unit(cfg.privacy.unit).value}"
        )
    if req.equal_owners:
        N, n, k = cfg.dataset.num_records, cfg.partition.num_owners, cfg.partition.records_per_user
        if not (N % n == 0 and (N // n) % k == 0):
            raise ConfigError(
                f"partition.records_per_user: algorithm.name={name} needs every owner to "
                f"hold the same number of users: dataset.num_records={N} / "
                f"partition.num_owners={n} records per owner must be a multiple of "
                f"partition.records_per_user={k}"
            )
    try:
        algorithms.check(name, algorithm_context(cfg, 1))
    except ParameterError as err:
        raise algorithm_error(err) from None


def algorithm_error(err: ParameterError) -> ConfigError:
    """A training algorithm's refused value as a ``ConfigError`` naming its config key
    (``algorithm.<option>``, ``train.rounds``, ``partition.records_per_user``, ...).

    Parameters
    ----------
    err : ParameterError
        The training algorithm's error (its ``param`` names the parameter).

    Returns
    -------
    ConfigError
        The error, its message led by the config key (returned, not raised).
    """
    import dataclasses

    options = {f.name for f in dataclasses.fields(algorithms.AlgorithmParams)}
    key = f"algorithm.{err.param}" if err.param in options else config_key(err.param)
    text = str(err)
    for lead in (err.param + ": ", err.param + " "):
        if text.startswith(lead):
            return ConfigError(f"{key}: {text[len(lead) :]}")
    return ConfigError(f"{key}: {text}")
