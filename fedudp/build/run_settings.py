"""The run's plain settings (what the runner, the engines and the tools read), the noise
placement and the run's randomness: read from a ``RunConfig`` once per run
(``fedudp.build.checks.check_config``)."""

from __future__ import annotations

from dataclasses import dataclass

from fedudp.config import (
    Accounting,
    EngineName,
    KeepAfterFinish,
    Method,
    Placement,
    RandomnessMode,
    RunConfig,
    TrackingKind,
)
from fedudp.randomness import Randomness

__all__ = ["RunSettings", "settings", "placement", "randomness"]


# -- the run's plain settings (what the runner, the engines and the tools read) -----------------
@dataclass(frozen=True)
class RunSettings:
    """The plain values a runner needs from a config, besides the built objects.

    Attributes
    ----------
    method, private, placement : str, bool, str or None
        The method; whether it is a DP one; ``server`` or ``local_dpsgd`` (private only).
    engine, dataset, seed : str, str, int
        The engine's and the data reader's names; the run seed.
    rounds, eval_every : int
        ``train.rounds`` and ``train.eval_every``.
    target_epsilon, delta : float or None
        ``privacy.epsilon`` and ``privacy.delta`` (private methods only).
    checkpoint_every, checkpoint_keep, keep_after_finish : int, int, str
        ``checkpoint.every``, ``checkpoint.keep`` and ``checkpoint.keep_after_finish``.
    resume, progress : str or None, bool
        The run folder to resume; whether a progress bar is shown.
    threads, timeout_s, num_cpus, num_gpus, address : int, float or None, float, float, str
        ``engine_opts``: torch threads; Flower's reply timeout, Ray resources, cluster.
    noise_personal : bool
        Huang Alg. 1's full-DP baseline (the ledger says so).
    sampling_rate, bound, accounting : float, float, str
        The billboard's Poisson rate q; ``estimator.bound``; certified or paper.
    tracking, tracking_uri, tracking_experiment : str, str or None, str
        ``tracking.kind``, ``tracking.uri`` and ``tracking.experiment``.
    randomness : str
        ``privacy.randomness``: seeded or secure.
    min_owners, min_users : int
        ``train.min_owners`` and ``train.min_users`` (fail closed).
    owner_dropout : float
        ``train.owner_dropout``: each owner's simulated chance to drop out of a round.
    owners_per_node, connect_timeout_s : int, float
        ``engine_opts``: Flower's owners per SuperNode; its connect timeout.
    """

    method: str
    private: bool
    placement: str | None  # server | local_dpsgd | distributed (private methods only)
    engine: str
    dataset: str
    seed: int
    rounds: int
    eval_every: int
    target_epsilon: float | None  # private methods only
    delta: float | None
    checkpoint_every: int
    checkpoint_keep: int
    resume: str | None
    progress: bool
    threads: int
    timeout_s: float | None  # engine=flower
    num_cpus: float
    num_gpus: float
    address: str | None
    noise_personal: bool  # Huang Alg. 1's full-DP baseline (the ledger says so)
    sampling_rate: float  # the billboard's Poisson rate q
    bound: float  # the public a-priori bound on a unit's vector
    accounting: str  # certified | paper
    keep_after_finish: str = "none"  # checkpoints kept once the run has finished: none | last | all
    tracking: str = "none"  # none | mlflow | tensorboard (fedudp.tracking)
    tracking_uri: str | None = None  # MLflow tracking URI; None: the embedded store
    tracking_experiment: str = "fedudp"
    randomness: str = "seeded"  # privacy.randomness: seeded | secure (fedudp.randomness)
    min_owners: int = 1  # train.min_owners / min_users: fail closed (Billboard)
    min_users: int = 1
    owner_dropout: float = 0.0  # train.owner_dropout: simulated owner dropouts (engine=local)
    owners_per_node: int = 1  # engine_opts.owners_per_node (engine=flower)
    connect_timeout_s: float = 600.0  # engine_opts.connect_timeout_s (engine=flower)


def settings(cfg: RunConfig) -> RunSettings:
    """The run's plain settings, read from ``cfg`` once.

    Parameters
    ----------
    cfg : RunConfig
        The configuration (validated, or at least its enums valid).

    Returns
    -------
    RunSettings
        Plain values (enums as their strings); the privacy ones None for non-DP methods.

    Raises
    ------
    ValueError
        An enum field holds a value outside its choices (``validate`` names it first).
    """
    private = Method(cfg.method) in (Method.full_dp, Method.joint_dp)
    p, e = cfg.privacy, cfg.engine_opts
    return RunSettings(
        method=Method(cfg.method).value,
        private=private,
        placement=placement(cfg).value if private else None,
        engine=EngineName(cfg.engine).value,
        dataset=str(cfg.dataset.name),
        seed=int(cfg.seed),
        rounds=int(cfg.train.rounds),
        eval_every=int(cfg.train.eval_every),
        target_epsilon=p.epsilon if private else None,
        delta=p.delta if private else None,
        checkpoint_every=int(cfg.checkpoint.every),
        checkpoint_keep=int(cfg.checkpoint.keep),
        resume=cfg.resume or None,
        progress=bool(cfg.progress),
        threads=int(e.threads),
        timeout_s=e.timeout_s,
        num_cpus=float(e.num_cpus),
        num_gpus=float(e.num_gpus),
        address=str(e.address) if e.address else None,
        noise_personal=bool(cfg.algorithm.noise_personal),
        sampling_rate=float(cfg.train.sampling_rate),
        bound=float(cfg.estimator["bound"]),
        accounting=Accounting(p.accounting).value,
        keep_after_finish=KeepAfterFinish(cfg.checkpoint.keep_after_finish).value,
        tracking=TrackingKind(cfg.tracking.kind).value,
        tracking_uri=str(cfg.tracking.uri) if cfg.tracking.uri else None,
        tracking_experiment=str(cfg.tracking.experiment),
        randomness=RandomnessMode(p.randomness).value,
        min_owners=int(cfg.train.min_owners),
        min_users=int(cfg.train.min_users),
        owner_dropout=float(cfg.train.owner_dropout),
        owners_per_node=int(e.owners_per_node),
        connect_timeout_s=float(e.connect_timeout_s),
    )


def placement(cfg: RunConfig) -> Placement:
    """Where the noise is added: in the owners (``local_dpsgd``, private methods only) or on the
    billboard (``server``). Decided here, once.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    Placement
        ``local_dpsgd`` for a private method configured so, else ``server``.
    """
    private = Method(cfg.method) in (Method.full_dp, Method.joint_dp)
    if private and Placement(cfg.privacy.placement) == Placement.local_dpsgd:
        return Placement.local_dpsgd
    if private and Placement(cfg.privacy.placement) == Placement.distributed:
        return Placement.distributed
    return Placement.server


def randomness(cfg: RunConfig) -> Randomness:
    """The run's randomness (``privacy.randomness``): seeded by ``seed``, or secure.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    Randomness
        Every stream of the run, keyed by ``cfg.seed``.
    """
    return Randomness(int(cfg.seed), RandomnessMode(cfg.privacy.randomness).value)
