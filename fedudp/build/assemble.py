"""A whole run before its first round (``prepare``): the owner side, the billboard, the data.

Everything that needs only the config first (no data is read before the config, the
estimator's calibration and the budget have been checked): the checks (``fedudp.build.checks``,
once) -> model, method, training -> calibrated estimator (or a training algorithm's estimators
and plan) -> ledger -> billboard -> the federation (a planned one's owner and user counts equal
the plan's; a natural one has the declared owner count and at most the declared users:
declarations are upper bounds). A natural federation's records are read and checked against
every declaration (``declared_inputs``, ``check_public``) right after the config's own checks,
before any of the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedudp import algorithms
from fedudp.aggregators import Aggregator, Sampling
from fedudp.aggregators.base import ParameterError
from fedudp.aggregators.memory import check_rows_fit
from fedudp.billboard.canaries import Canaries
from fedudp.billboard.fail_closed import minimum_error
from fedudp.billboard.server import Billboard, ServerStep
from fedudp.build.algorithm_setup import algorithm_context, algorithm_error
from fedudp.build.checks import Checked, check, check_run
from fedudp.build.data import check_public, federation, natural_records
from fedudp.build.estimators import estimator
from fedudp.build.guarantee import check_audit, ledger
from fedudp.build.owner_side import _inputs_declared, method, model, owners
from fedudp.build.plan import natural, planned_owner_users, planned_units
from fedudp.build.run_settings import RunSettings, randomness
from fedudp.config import ConfigError, EngineName, RunConfig
from fedudp.data.federation import Federation
from fedudp.owner.owners import Owners
from fedudp.privacy.accountant import Ledger, accountant_for
from fedudp.protocol.methods import MethodSpec

__all__ = ["Prepared", "prepare"]


@dataclass
class Prepared:
    """A validated run before its first round: the owner side, the billboard, the data.

    Attributes
    ----------
    cfg, settings : RunConfig, RunSettings
        The configuration and its plain settings.
    owners : Owners
        The owner side (model, method, training kernels, device).
    aggregator : Aggregator or None
        The user-level estimator (None: no estimator).
    ledger : Ledger
        The privacy ledger every release is recorded in.
    billboard : Billboard or None
        The server side of the round loop.
    fed : Federation
        The federation (every owner's private records).
    algorithm : Any, default None
        A training algorithm's setup (``fedudp.algorithms.Setup``; ``algorithm.name != none``).
    spec : MethodSpec
        The method's spec (``owners.spec``), a property.
    """

    cfg: RunConfig
    settings: RunSettings
    owners: Owners
    aggregator: Aggregator | None
    ledger: Ledger
    billboard: Billboard | None
    fed: Federation
    algorithm: Any = None  # fedudp.algorithms.Setup (algorithm.name != none)

    @property
    def spec(self) -> MethodSpec:
        return self.owners.spec


def prepare(
    cfg: RunConfig,
    *,
    model_object: Any = None,
    records: Any = None,
    checked: Checked | None = None,
) -> Prepared:
    """Everything that needs only the config first (see the module doc), then the data.

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration.
    model_object : torch.nn.Module or None
        Your own module (the Python API, engine=local).
    records : Records or tuple of Records or None
        In-memory records (``dataset.name=memory``).
    checked : Checked or None
        ``cfg``'s own checks and settings, made by the runner (``check_config``): then only
        the rest of the checks run here (``check_run``); None: every check runs here.

    Returns
    -------
    Prepared
        The owner side, the estimator, the ledger, the billboard and the federation.

    Raises
    ------
    ConfigError
        Every user error, naming the key or file. A natural federation's records are read
        (and its declared public numbers checked) right after the config's own checks: its
        input shape and its counts come from them.
    """
    checked = check(cfg) if checked is None or checked.cfg is not cfg else _rest(checked)
    if model_object is not None and EngineName(cfg.engine) == EngineName.flower:
        raise ConfigError(
            "engine: a model object from the Python API lives in this process; "
            "engine=flower owners build theirs from the config (model.target=...)"
        )
    # the model and its probe need only the declared input shape and classes: checked before a
    # natural federation's files are read (a missing declaration: after, to quote the data)
    net = model(cfg, records, model_object, probe=True) if _inputs_declared(cfg) else None
    if natural(cfg):
        check_public(cfg, natural_records(cfg, records)[0])
    run = checked.settings
    if net is None:
        net = model(cfg, records, model_object, probe=True)
    spec = method(cfg, net)
    params = dict(net.named_parameters())
    dim = sum(int(params[k].numel()) for k in spec.shared)
    personal_dim = sum(int(params[k].numel()) for k in spec.personal)
    n_owners, n_users = planned_units(cfg)
    # each owner's public capacity in sampled units: what the fail-closed rule counts
    owner_units = np.ones(n_owners, np.int64) if spec.cohort_is_owners else planned_owner_users(cfg)
    if spec.communicates and (
        why := minimum_error(cfg.train.min_owners, cfg.train.min_users, owner_units)
    ):
        raise ConfigError(why)
    canaries = int(cfg.audit.canaries)
    sampling = Sampling(
        cfg.train.sampling_rate, (n_owners if spec.cohort_is_owners else n_users) + canaries
    )
    sampling, aggregator, algo = _estimator_or_algorithm(cfg, spec, sampling, dim, personal_dim)
    check_audit(cfg, spec, aggregator)
    own = owners(cfg, algo.owner_hooks if algo is not None else None, net, spec)
    led = _ledger(cfg, spec, aggregator, algo)
    board = None
    if aggregator is not None:
        shared = {k: params[k] for k in spec.shared}
        board = _billboard(
            cfg, run, spec, own, aggregator, sampling, led, algo, shared, owner_units
        )
    fed = _federation(cfg, records, own, n_owners, n_users)
    return Prepared(cfg, run, own, aggregator, led, board, fed, algo)


def _federation(
    cfg: RunConfig, records: Any, own: Owners, n_owners: int, n_users: int
) -> Federation:
    """The federation on the owners' device and dtype, with the plan's public n: a planned
    federation has exactly it; a natural one the declared owner count, and at most the declared
    users (the others are absent: zero contributions)."""
    fed = federation(cfg, records).to(own.dtype, own.device)
    if fed.num_owners != n_owners or (
        fed.num_users > n_users if natural(cfg) else fed.num_users != n_users
    ):
        raise RuntimeError(
            f"partition gave {fed.num_owners} owners / {fed.num_users} users, "
            f"planned {n_owners} / {n_users}"
        )
    return fed


def _rest(checked: Checked) -> Checked:
    """The checks the runner's ``check_config`` left (``check_run``), on ``checked.cfg``."""
    check_run(checked.cfg)
    return checked


def _estimator_or_algorithm(
    cfg: RunConfig, spec: MethodSpec, sampling: Sampling, dim: int, personal_dim: int
) -> tuple[Sampling, Aggregator | None, Any]:
    """(sampling, estimator, training algorithm's setup): a seed's algorithm sets up its own
    sampling and estimator; otherwise the configured estimator over ``train.rounds``."""
    if not spec.communicates:
        return sampling, None, None
    if str(cfg.algorithm.name) == "none":
        return sampling, estimator(cfg, sampling, cfg.train.rounds, dim), None
    try:
        algo = algorithms.setup(str(cfg.algorithm.name), algorithm_context(cfg, dim, personal_dim))
    except ParameterError as err:
        raise algorithm_error(err) from None
    return algo.sampling, algo.aggregator, algo


def _ledger(cfg: RunConfig, spec: MethodSpec, aggregator: Aggregator | None, algo: Any) -> Ledger:
    """The run's ledger head (``fedudp.build.ledger``) with the audit options' and the training
    algorithm's notes."""
    led = ledger(cfg, spec, aggregator)
    canaries = int(cfg.audit.canaries)
    if canaries:
        led.notes.append(
            f"audit.canaries={canaries}: {canaries} canary units (fixed random "
            "directions at the clip norm, sampled like users) are in the public "
            "population and join each release; the summary's "
            "canary_epsilon_estimate (Andrew et al. 2024, final model) is an "
            "empirical estimate from them, not a bound"
        )
    if cfg.audit.noise_scale != 1.0:
        led.notes.append(
            f"audit.noise_scale={cfg.audit.noise_scale:g}: the release noise is "
            f"{cfg.audit.noise_scale:g} x what this ledger accounts; its epsilon is "
            "NOT a guarantee (a deliberately weakened mechanism for checking an audit)"
        )
    if algo is not None:
        led.notes += algo.notes
        led.extra["algorithm"] = algo.summary
    return led


def _billboard(
    cfg: RunConfig,
    run: RunSettings,
    spec: MethodSpec,
    own: Owners,
    aggregator: Aggregator,
    sampling: Sampling,
    led: Ledger,
    algo: Any,
    shared: Mapping[str, torch.Tensor],
    owner_units: np.ndarray,
) -> Billboard:
    """The billboard over the shared parameters, its accountant and its plan; a budget that
    even one round exceeds is refused (``ConfigError``)."""
    dim = sum(int(v.numel()) for v in shared.values())
    check_rows_fit(aggregator, dim, torch.empty((), dtype=own.dtype).element_size())
    plan = algo.plan if algo is not None else None
    if plan is None and hasattr(aggregator, "participation"):  # its own cohorts (a tree)
        plan = aggregator.participation(cfg.seed)
    target = run.target_epsilon if spec.private else None
    accountant = None
    if aggregator.private:
        accountant = accountant_for(
            Billboard.first_event(aggregator, plan), aggregator.group, target
        )
        if aggregator.group is not None:  # record-level events, user level by group privacy
            led.extra["group_conversion"] = str(aggregator.group)
    canaries = int(cfg.audit.canaries)
    board = Billboard(  # on the CPU whatever engine_opts.device (its .cpu(): the same tensor)
        {k: v.detach().cpu() for k, v in shared.items()},
        aggregator,
        sampling,
        led,
        accountant,
        seed=cfg.seed,
        step=ServerStep(cfg.train.server_lr, own.training.mode),
        target_epsilon=target,
        delta=cfg.privacy.delta,
        plan=plan,
        canaries=(Canaries(canaries, dim, sampling.rate, cfg.seed) if canaries else None),
        randomness=randomness(cfg),
        min_owners=int(cfg.train.min_owners),
        min_users=int(cfg.train.min_users),
        owner_units=owner_units,
    )
    if spec.private and not board.within_budget():
        raise ConfigError(
            f"privacy.epsilon={cfg.privacy.epsilon}: even one round with noise "
            f"multiplier {aggregator.noise_multiplier} exceeds it"
        )
    return board
