"""The schema's own checks (``validate``): the value ranges (epsilon > 0, delta in (0, 1), ...)
and the cross-key constraints of a ``RunConfig``, each a ``ConfigError`` naming the offending
key *before* any data is loaded or any round runs.

They read the configuration's values only: no plugin is imported, no registry is asked, no
device is queried. The checks that need the registered parts (the names, an estimator's or a
training algorithm's requirements) and the CUDA device are the builder's
(``fedudp.build.checks``), which runs these once per run.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any

from fedudp.config.schema import (
    ClipPolicy,
    EngineName,
    RandomnessMode,
    RunConfig,
    TrainConfig,
    resolved_aggregator,
)
from fedudp.errors import ConfigError
from fedudp.protocol.choices import Method, Placement, Unit

__all__ = ["validate", "coerce"]


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _finite_pos(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def coerce(obj: Any, prefix: str = "") -> None:
    """Turn plain strings into the schema's enums in place (programmatic use), naming bad keys.

    Parameters
    ----------
    obj : Any
        A config dataclass (``RunConfig`` or a section), changed in place, recursively.
    prefix : str, default ""
        The dotted path of ``obj``, for the message.

    Raises
    ------
    ConfigError
        A value that is not one of its enum's values.
    """
    import dataclasses
    import typing

    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        t = hints.get(f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(v):
            coerce(v, key + ".")
        elif isinstance(t, type) and issubclass(t, Enum) and not isinstance(v, t):
            try:
                setattr(obj, f.name, t(v))
            except ValueError:
                raise ConfigError(
                    f"{key}: invalid value {v!r}, expected one of {[e.value for e in t]}"
                ) from None


def validate(cfg: RunConfig) -> None:
    """Range and cross-key checks of the run's own keys, before any work.

    The schema's part of a run's checks: the builder runs it once per run, after importing the
    ``plugins`` and checking the configured names against the registries, and checks the CUDA
    device after it (``fedudp.build.checks.check_config``); an estimator's and an algorithm's
    options are checked by that estimator or algorithm (``fedudp.build.check``).

    Parameters
    ----------
    cfg : RunConfig
        The configuration (its plain strings become the schema's enums, in place).

    Raises
    ------
    ConfigError
        One line naming the key and what it must be.
    """
    coerce(cfg)
    _check_privacy(cfg)
    _check_training(cfg.train)
    # estimator.* values are checked by the chosen estimator itself (its ``calibrated``), and
    # algorithm.* by the chosen training algorithm, through the config builder (fedudp.build)
    _check_data(cfg)
    _check_method(cfg)
    _check_outputs(cfg)


def _check_privacy(cfg: RunConfig) -> None:
    """privacy.* (the budget, the clip, the noise), audit.* and the seed."""
    p = cfg.privacy
    _need(
        _finite_pos(p.epsilon), "privacy.epsilon", f"must be a finite number > 0, got {p.epsilon}"
    )
    _need(
        isinstance(p.delta, (int, float)) and 0 < p.delta < 1,
        "privacy.delta",
        f"must be in (0, 1), got {p.delta}",
    )
    _need(_finite_pos(p.clip), "privacy.clip", f"must be > 0, got {p.clip}")
    _need(
        isinstance(p.clip_quantile, (int, float)) and 0 < p.clip_quantile < 1,
        "privacy.clip_quantile",
        f"must be in (0, 1), got {p.clip_quantile}",
    )
    _need(_finite_pos(p.clip_lr), "privacy.clip_lr", f"must be > 0, got {p.clip_lr}")
    _need(
        p.clip_count_noise is None or _finite_pos(p.clip_count_noise),
        "privacy.clip_count_noise",
        f"must be null (expected cohort / 20) or > 0, got {p.clip_count_noise}",
    )
    _need(
        isinstance(cfg.audit.canaries, int)
        and (cfg.audit.canaries == 0 or cfg.audit.canaries >= 2),
        "audit.canaries",
        f"must be 0 (off) or an integer >= 2, got {cfg.audit.canaries}",
    )
    _need(
        isinstance(cfg.audit.noise_scale, (int, float)) and 0 < cfg.audit.noise_scale <= 1,
        "audit.noise_scale",
        f"must be in (0, 1] (1: off), got {cfg.audit.noise_scale}",
    )
    _need(
        p.noise_multiplier is None
        or (math.isfinite(p.noise_multiplier) and p.noise_multiplier > 0),
        "privacy.noise_multiplier",
        f"must be null (calibrate) or > 0, got {p.noise_multiplier}",
    )
    _need(
        isinstance(cfg.seed, int) and 0 <= cfg.seed < 2**32,
        "seed",
        f"must be an integer in [0, 2**32), got {cfg.seed}",
    )


def _check_training(t: TrainConfig) -> None:
    """train.*: rounds, epochs, sampling, learning rates, batches, minimum cohort."""
    _need(t.rounds >= 1, "train.rounds", f"must be >= 1, got {t.rounds}")
    _need(t.local_epochs >= 1, "train.local_epochs", f"must be >= 1, got {t.local_epochs}")
    _need(
        t.personal_epochs is None or t.personal_epochs >= 0,
        "train.personal_epochs",
        f"must be null or >= 0, got {t.personal_epochs}",
    )
    _need(
        isinstance(t.sampling_rate, (int, float)) and 0 < t.sampling_rate <= 1,
        "train.sampling_rate",
        f"must be in (0, 1], got {t.sampling_rate}",
    )
    _need(_finite_pos(t.lr), "train.lr", f"must be > 0, got {t.lr}")
    _need(_finite_pos(t.server_lr), "train.server_lr", f"must be > 0, got {t.server_lr}")
    _need(t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}")
    _need(t.eval_every >= 1, "train.eval_every", f"must be >= 1, got {t.eval_every}")
    _need(
        isinstance(t.min_owners, int) and t.min_owners >= 1,
        "train.min_owners",
        f"must be an integer >= 1, got {t.min_owners}",
    )
    _need(
        isinstance(t.owner_dropout, (int, float)) and 0.0 <= t.owner_dropout < 1.0,
        "train.owner_dropout",
        f"must be a probability in [0, 1), got {t.owner_dropout}",
    )
    _need(
        isinstance(t.min_users, int) and t.min_users >= 0,
        "train.min_users",
        f"must be an integer >= 0, got {t.min_users}",
    )


def _check_data(cfg: RunConfig) -> None:
    """dataset.*, partition.* and public.* (the declared public numbers)."""
    d, part = cfg.dataset, cfg.partition
    _need(d.num_records >= 1, "dataset.num_records", f"must be >= 1, got {d.num_records}")
    _need(part.num_owners >= 1, "partition.num_owners", f"must be >= 1, got {part.num_owners}")
    _need(
        part.num_owners <= d.num_records,
        "partition.num_owners",
        f"{part.num_owners} owners but only dataset.num_records={d.num_records} records: "
        "every owner needs at least one record",
    )
    _need(
        part.records_per_user >= 1,
        "partition.records_per_user",
        f"must be >= 1, got {part.records_per_user}",
    )
    _need(
        1 <= part.classes_per_owner,
        "partition.classes_per_owner",
        f"must be >= 1, got {part.classes_per_owner}",
    )
    _need(
        _finite_pos(part.dirichlet_alpha),
        "partition.dirichlet_alpha",
        f"must be > 0, got {part.dirichlet_alpha}",
    )
    _need(
        isinstance(d.test_fraction, (int, float)) and 0 <= d.test_fraction < 1,
        "dataset.test_fraction",
        f"must be in [0, 1), got {d.test_fraction}",
    )
    _need(
        d.classes is None or (isinstance(d.classes, int) and d.classes >= 2),
        "dataset.classes",
        f"must be null or an integer >= 2, got {d.classes}",
    )
    _need(
        d.input_shape is None
        or (len(d.input_shape) >= 1 and all(isinstance(v, int) and v >= 1 for v in d.input_shape)),
        "dataset.input_shape",
        f"must be null or a list of integers >= 1 (e.g. [8] or [1, 28, 28]), got {d.input_shape}",
    )
    pub = cfg.public
    for key in ("users", "owner_capacity", "records_per_user"):
        v = getattr(pub, key)
        _need(
            v is None or (isinstance(v, int) and v >= 1),
            f"public.{key}",
            f"must be null or an integer >= 1, got {v}",
        )
    if d.name == "synthetic":
        _need(d.features >= 1, "dataset.features", f"must be >= 1, got {d.features}")
        _need(
            d.input_shape is None or list(d.input_shape) == [d.features],
            "dataset.input_shape",
            f"synthetic records have shape [dataset.features] = "
            f"[{d.features}], got {d.input_shape} (leave it null)",
        )
        _need(
            d.pool_train >= d.num_records,
            "dataset.pool_train",
            f"must be >= dataset.num_records={d.num_records}, got {d.pool_train}",
        )


def _check_method(cfg: RunConfig) -> None:
    """The method against the aggregator, the noise placement, the privacy unit and group
    privacy (cross-key rules)."""
    p, part = cfg.privacy, cfg.partition
    if cfg.method in (Method.fedavg, Method.per_silo):
        _need(
            cfg.aggregator in ("auto", "none"),
            "aggregator",
            f"method={cfg.method.value} is non-private and needs aggregator=none (or auto), "
            f"got {cfg.aggregator}",
        )
    if cfg.method in (Method.full_dp, Method.joint_dp):
        _need(
            cfg.aggregator != "none",
            "aggregator",
            f"method={cfg.method.value} is private; aggregator=none releases without noise",
        )
    if p.placement == Placement.local_dpsgd and cfg.method in (Method.full_dp, Method.joint_dp):
        _need(
            cfg.aggregator == "auto",
            "aggregator",
            "privacy.placement=local_dpsgd adds the noise inside the owners (DP-SGD) and the "
            f"billboard averages their deltas; leave aggregator=auto, got {cfg.aggregator}",
        )
        _need(
            p.unit != Unit.owner,
            "privacy.unit",
            "privacy.placement=local_dpsgd clips each user's gradient (user level); owner level "
            "needs privacy.placement=server",
        )
    _check_distributed(cfg)
    if p.group_privacy:
        _need(
            p.placement == Placement.local_dpsgd
            and cfg.method in (Method.full_dp, Method.joint_dp),
            "privacy.group_privacy",
            "converts record-level DP-SGD inside the owners to user level; it needs "
            "privacy.placement=local_dpsgd and method=full_dp or joint_dp",
        )
        _need(
            p.unit == Unit.user,
            "privacy.group_privacy",
            f"gives a user-level guarantee (privacy.unit=user), got privacy.unit={Unit(p.unit).value}",
        )
        _need(
            p.noise_multiplier is None,
            "privacy.group_privacy",
            "calibrates the record-level noise to the converted budget; leave "
            "privacy.noise_multiplier=null",
        )
    if p.unit == Unit.record and cfg.method in (Method.full_dp, Method.joint_dp):
        _need(
            part.records_per_user == 1,
            "privacy.unit",
            "record with placement=server clips per user, so it needs "
            "partition.records_per_user=1 (a user-level guarantee, privacy.unit=user, already "
            "implies record level)",
        )


DISTRIBUTED = ("ddgauss", "skellam")  # the estimators of privacy.placement=distributed


def _check_distributed(cfg: RunConfig) -> None:
    """privacy.placement=distributed and its estimators (ddgauss, skellam), before any work."""
    p, t = cfg.privacy, cfg.train
    name = resolved_aggregator(cfg)
    private = cfg.method in (Method.full_dp, Method.joint_dp)
    _need(
        not t.owner_dropout or cfg.engine == EngineName.local.value,
        "train.owner_dropout",
        "simulates owner dropouts on engine=local only (on engine=flower owners fail for "
        "real); set it to 0",
    )
    if name in DISTRIBUTED:
        _need(
            private and p.placement == Placement.distributed,
            "aggregator",
            f"aggregator={name} adds its noise in the owners under secure aggregation: it needs "
            "privacy.placement=distributed and method=full_dp or joint_dp",
        )
    if not (private and p.placement == Placement.distributed):
        return
    _need(
        name in DISTRIBUTED,
        "aggregator",
        f"privacy.placement=distributed needs aggregator=ddgauss or skellam (or auto), got {name}",
    )
    _need(
        p.unit == Unit.user,
        "privacy.unit",
        "privacy.placement=distributed rounds and clips each user's vector (user level); "
        f"got privacy.unit={Unit(p.unit).value}",
    )
    _need(
        t.min_owners >= 2,
        "train.min_owners",
        "privacy.placement=distributed calibrates each owner's noise share for at least "
        f"train.min_owners surviving owners, and masks need two: set it >= 2, got {t.min_owners}",
    )
    _need(
        p.noise_multiplier is None,
        "privacy.noise_multiplier",
        "privacy.placement=distributed calibrates the owners' noise shares; leave it null",
    )
    _need(
        ClipPolicy(p.clip_policy) == ClipPolicy.fixed,
        "privacy.clip_policy",
        "privacy.placement=distributed clips to a fixed privacy.clip; set privacy.clip_policy=fixed",
    )
    _need(
        cfg.engine == EngineName.local.value or p.randomness == RandomnessMode.seeded,
        "privacy.randomness",
        "secure with privacy.placement=distributed needs the owners to agree on pairwise mask "
        "seeds the billboard never sees (SecAgg's key agreement), which engine=flower does not "
        "simulate: use engine=local, or privacy.randomness=seeded (docs/threat-model.md)",
    )
    _need(
        not cfg.audit.canaries,
        "audit.canaries",
        "canaries join the billboard's clipped sum, which privacy.placement=distributed never "
        "sees; set audit.canaries=0",
    )


def _check_outputs(cfg: RunConfig) -> None:
    """checkpoint.*, tracking.* and engine_opts.*."""
    _need(
        isinstance(cfg.checkpoint.every, int) and cfg.checkpoint.every >= 0,
        "checkpoint.every",
        f"must be an integer >= 0 (0: no checkpoints), got {cfg.checkpoint.every}",
    )
    _need(
        isinstance(cfg.checkpoint.keep, int) and cfg.checkpoint.keep >= 1,
        "checkpoint.keep",
        f"must be an integer >= 1, got {cfg.checkpoint.keep}",
    )
    _need(
        isinstance(cfg.tracking.experiment, str) and cfg.tracking.experiment.strip() != "",
        "tracking.experiment",
        "must be a non-empty experiment name",
    )
    if cfg.engine_opts.chunk_records < 0:
        raise ConfigError("engine_opts.chunk_records: must be >= 1, or 0 for auto")
    opn = cfg.engine_opts.owners_per_node
    _need(
        isinstance(opn, int) and not isinstance(opn, bool) and opn >= 1,
        "engine_opts.owners_per_node",
        f"must be an integer >= 1 (owners per Flower SuperNode), got {opn!r}",
    )
    cts = cfg.engine_opts.connect_timeout_s
    _need(
        isinstance(cts, (int, float)) and not isinstance(cts, bool) and cts > 0,
        "engine_opts.connect_timeout_s",
        f"must be a number of seconds > 0, got {cts!r}",
    )
    _check_device(cfg)


def _check_device(cfg: RunConfig) -> None:
    """``engine_opts.device``: cpu, cuda or cuda:N. A CUDA device with engine=local, or with
    engine=flower where each owner actor holds a GPU (``engine_opts.num_gpus > 0``: Ray then
    sets the actor's ``CUDA_VISIBLE_DEVICES``, so ``cuda`` is the actor's own GPU and ``cuda:N``
    with N > 0 is refused). Whether torch sees that device is the builder's check
    (``fedudp.build.checks.check_device``) with engine=local, the cluster's
    (``fedudp.flower.cluster.preflight``) and each actor's with engine=flower."""
    import re

    dev = cfg.engine_opts.device
    if not isinstance(dev, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", dev):
        raise ConfigError(f"engine_opts.device: must be cpu, cuda or cuda:N, got {dev!r}")
    if dev == "cpu" or cfg.engine != EngineName.flower.value:
        return
    gpus = cfg.engine_opts.num_gpus
    if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not gpus > 0:
        raise ConfigError(
            f"engine_opts.device={dev} with engine=flower needs engine_opts.num_gpus > 0 (got "
            f"{gpus!r}): each owner actor computes on the GPU Ray gives it; set "
            "engine_opts.num_gpus=1 (a fraction shares a GPU) or engine_opts.device=cpu"
        )
    if int(dev.partition(":")[2] or 0) > 0:
        raise ConfigError(
            f"engine_opts.device={dev}: with engine=flower an actor sees only the GPU(s) Ray "
            "gives it, numbered from 0 (CUDA_VISIBLE_DEVICES); use engine_opts.device=cuda "
            "(Ray chooses the GPU)"
        )
