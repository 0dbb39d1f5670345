"""Every check of a run, each run once, before any work (docs/architecture.md#the-config-builder).

``check_config``: the user's plugins imported, the schema's own checks (``fedudp.config.validate``:
ranges and cross-key rules), the configured names against the registries and the CUDA device;
it returns the run's plain settings (``Checked``), made here once. ``check_run``: what needs the
registered parts: the estimator's and the training algorithm's declared requirements, the
randomness, the planned public numbers, the data files' presence. ``check`` is both, for a
caller that prepares a run on its own (``fedudp.build.prepare`` without ``checked``).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedudp.build.algorithm_setup import check_algorithm
from fedudp.build.estimators import check_estimator
from fedudp.build.plan import check_planned_public, natural
from fedudp.build.run_settings import RunSettings, settings
from fedudp.config import (
    ConfigError,
    EngineName,
    RandomnessMode,
    RunConfig,
    coerce,
    resolved_aggregator,
    validate,
)
from fedudp.data.idx import check_available
from fedudp.plugins import load as load_plugins

__all__ = [
    "Checked",
    "check_config",
    "check_run",
    "check",
    "check_names",
    "check_device",
    "check_randomness",
]


@dataclass(frozen=True)
class Checked:
    """A configuration whose own checks passed (``check_config``) and its plain settings.

    Attributes
    ----------
    cfg : RunConfig
        The configuration checked.
    settings : RunSettings
        Its plain settings, read once (``fedudp.build.settings``).
    """

    cfg: RunConfig
    settings: RunSettings


def check_config(cfg: RunConfig) -> Checked:
    """The configuration's own checks, once per run, before any work.

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration (its plain strings become the schema's enums, in place).

    Returns
    -------
    Checked
        ``cfg`` and its plain settings.

    Raises
    ------
    ConfigError
        One line naming the key: a plugin that cannot be imported, a value out of range, a
        name no registry holds, a CUDA device torch does not see.
    """
    load_plugins(cfg.plugins)  # a plugin registers the names checked below
    coerce(cfg)  # (validate coerces too: the names' errors keep their place after the enums')
    check_names(cfg)
    validate(cfg)
    check_device(cfg)
    return Checked(cfg, settings(cfg))


def check_names(cfg: RunConfig) -> None:
    """The configured names against the registries (their choices in the message), and the
    ``estimator.*`` keys against the registered estimators' options.

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``aggregator``, ``dataset.name``, ``algorithm.name``, ``model.name``).

    Raises
    ------
    ConfigError
        A name no registry holds, or an ``estimator.*`` key no estimator takes.
    """
    from fedudp.aggregators import REGISTRY
    from fedudp.algorithms import ALGORITHMS
    from fedudp.data.readers import READERS
    from fedudp.models import MODELS

    for key, name, registry, extra in (
        ("aggregator", cfg.aggregator, REGISTRY, ("auto",)),
        ("dataset.name", cfg.dataset.name, READERS, ()),
        ("algorithm.name", cfg.algorithm.name, ALGORITHMS, ("none",)),
        ("model.name", cfg.model.name, MODELS, ("auto",)),
    ):
        name = str(getattr(name, "value", name))
        if name not in registry and name not in extra:
            raise ConfigError(
                f"{key}: no {registry.kind} {name!r} (available: "
                f"{', '.join(extra + registry.names())}; your own: docs/architecture.md#plugins)"
            )
    options = REGISTRY.options()
    for k in cfg.estimator:
        if k not in options:
            raise ConfigError(
                f"estimator.{k}: no registered estimator takes this option (the options: "
                f"{', '.join(sorted(options))})"
            )


def check_device(cfg: RunConfig) -> None:
    """A CUDA ``engine_opts.device`` with engine=local only where torch sees that device (its
    form, cpu, cuda or cuda:N, and engine=flower's ``engine_opts.num_gpus`` are the schema's
    checks, ``fedudp.config.validate``). With engine=flower this process is the driver, which
    builds and computes on the CPU: the cluster's GPUs are checked by
    ``fedudp.flower.cluster.preflight``, each actor's by the actor
    (``fedudp.flower.client_app``), never here.

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``engine_opts.device``, ``engine``).

    Raises
    ------
    ConfigError
        engine=local: CUDA is not available, or the device index is beyond torch's device
        count.
    """
    dev = str(cfg.engine_opts.device)
    if dev == "cpu" or EngineName(cfg.engine) == EngineName.flower:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"engine_opts.device={dev}: torch sees no CUDA device "
            "(torch.cuda.is_available() is False); use engine_opts.device=cpu"
        )
    index = int(dev.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"engine_opts.device={dev}: torch sees {torch.cuda.device_count()} CUDA "
            f"device(s) (cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
        )


def check_run(cfg: RunConfig) -> None:
    """Every check that needs the registered parts (after ``check_config``): the planned public
    numbers, the estimator's and the algorithm's declared requirements, the randomness, the
    data files' presence. ``ConfigError`` naming the key.

    Parameters
    ----------
    cfg : RunConfig
        The configuration, after ``check_config``.

    Raises
    ------
    ConfigError
        A requirement not met, a training algorithm on natural data, in-memory records with
        engine=flower, or a missing data set (naming the key).
    """
    check_planned_public(cfg)
    check_estimator(cfg)
    check_algorithm(cfg)
    check_randomness(cfg)
    if natural(cfg):
        if str(cfg.algorithm.name) != "none":
            raise ConfigError(
                f"algorithm.name: the seeds' training algorithms run on planned "
                f"federations (synthetic, mnist, fashion_mnist), not on "
                f"dataset.name={cfg.dataset.name!s}"
            )
        if str(cfg.dataset.name) == "memory" and EngineName(cfg.engine) == EngineName.flower:
            raise ConfigError(
                "engine: records given through the Python API live in this "
                "process; engine=flower owners read their data from files "
                "(dataset.name=npz|parquet|...)"
            )
    elif str(cfg.dataset.name) != "synthetic":
        check_available(str(cfg.dataset.name), cfg.dataset.root, cfg.dataset.download)


def check(cfg: RunConfig) -> Checked:
    """Every check that needs only the config (``check_config``, then ``check_run``).

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration.

    Returns
    -------
    Checked
        ``cfg`` and its plain settings.

    Raises
    ------
    ConfigError
        One line naming the key, before any data is read.
    """
    checked = check_config(cfg)
    check_run(cfg)
    return checked


def check_randomness(cfg: RunConfig) -> None:
    """``privacy.randomness=secure`` covers the billboard's sample and noise and owner-side
    DP-SGD's; the seeds' training algorithms and the banded mechanism draw their own privacy
    sampling or noise from the seed (their plans), so they refuse it rather than run half
    seeded.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Raises
    ------
    ConfigError
        ``privacy.randomness=secure`` with a seed's training algorithm, ``dp_mf_banded`` or
        ``dp_mf_blt``.
    """
    if RandomnessMode(cfg.privacy.randomness) != RandomnessMode.secure:
        return
    if str(cfg.algorithm.name) != "none":
        raise ConfigError(
            f"privacy.randomness=secure: not with a seed's training algorithm "
            f"(algorithm.name={cfg.algorithm.name!s} draws its "
            "cohorts and noise from the seed); use privacy.randomness=seeded"
        )
    if (name := resolved_aggregator(cfg)) in ("dp_mf_banded", "dp_mf_blt"):
        raise ConfigError(
            f"privacy.randomness=secure: not with aggregator={name} (its "
            "groups' Poisson sample is drawn from the seed); use "
            "privacy.randomness=seeded or another aggregator"
        )
