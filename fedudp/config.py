"""Structured run configuration (docs/architecture.md#configuration-and-outputs), registered
with Hydra's ConfigStore.

OmegaConf rejects unknown keys and wrongly typed / unknown enum values at composition
time; ``validate`` checks the value ranges (epsilon > 0, delta in (0, 1), ...) and the
cross-key constraints, raising ``ConfigError`` naming the offending key *before* any
data is loaded or any round runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, cast

from fedudp.errors import ConfigError, DataError  # noqa: F401  (re-exported)
from fedudp.plain import Choice, jsonable  # (also re-exported)
from fedudp.protocol.choices import Method, OwnerWeights, Placement, SharedUpdate, Unit


class Accounting(Choice):
    certified = "certified"
    paper = "paper"


class Calibration(Choice):
    accountant = "accountant"
    closed_form = "closed_form"


class ClipPolicy(Choice):
    fixed = "fixed"
    adaptive = "adaptive"


class RandomnessMode(Choice):
    """privacy.randomness (fedudp.randomness.Randomness): every stream keyed by the run seed
    (seeded, a reproducible simulation), or release noise and privacy sampling from OS entropy
    (secure)."""

    seeded = "seeded"
    secure = "secure"


class OwnerRule(Choice):
    """How a natural federation's users are grouped into owners (``fedudp.data.records``)."""

    given = "given"  # the data's owner column (dataset.columns.owner)
    random = "random"  # users dealt at random into partition.num_owners owners
    column = "column"  # by a metadata column (partition.owner_column)
    dirichlet = "dirichlet"  # label-skewed (partition.dirichlet_alpha)


class UserRule(Choice):
    """How users are formed where the data has none (CIFAR)."""

    shuffle = "shuffle"  # records shuffled, cut into users of records_per_user
    dirichlet = "dirichlet"  # each user's records drawn with a Dirichlet(alpha) class mix


class Scheme(Choice):
    paper_classes = "paper_classes"
    iid = "iid"
    dirichlet = "dirichlet"


class EngineName(Choice):
    local = "local"
    flower = "flower"


class TrackingKind(Choice):
    """Where a run's parameters, per-round metrics and files are also logged (fedudp.tracking)."""

    none = "none"  # only the run folder's own files
    mlflow = "mlflow"  # an MLflow run (pip install 'fedudp[tracking]')
    tensorboard = "tensorboard"  # TensorBoard scalars in <run folder>/tb


class KeepAfterFinish(Choice):
    """Which checkpoints stay in a run folder once the run has finished (a finished run is
    never resumed: re-running it is skipped)."""

    none = "none"  # remove them all
    last = "last"  # keep the newest (the final parameters, for inspection)
    all = "all"  # keep the newest ``checkpoint.keep`` (as during the run)


@dataclass
class PrivacyConfig:
    epsilon: float = 1.0
    delta: float = 1e-5
    unit: Unit = Unit.user
    accounting: Accounting = Accounting.certified
    calibration: Calibration = Calibration.accountant
    placement: Placement = Placement.server
    clip: float = 1.0
    # None: calibrate to (epsilon, delta) over the whole schedule. A number: use it, and
    # stop (cleanly) before the round that would exceed the budget.
    noise_multiplier: float | None = None
    # placement=local_dpsgd only: DP-SGD clips and Poisson-samples *records* and is accounted
    # at record level, then converted to the user level by group privacy over a user's
    # records_per_user records (Huang et al. Table 4's reading, docs/algorithms.md#group-privacy): standard
    # form in certified mode, the paper's k·e^{kε}·δ form (heuristic) in paper mode
    group_privacy: bool = False
    # fixed: clip every round to ``clip``; adaptive: ``clip`` is the initial clip norm, then it
    # follows the ``clip_quantile`` of the units' norms at learning rate ``clip_lr`` through a
    # noisy count (std ``clip_count_noise``; null: expected cohort / 20), Andrew et al. 2021
    # (aggregator=gaussian under placement=server; under placement=local_dpsgd every DP-SGD step
    # releases its count, null: std z*sqrt(10)/2, a tenth of the step's budget; docs/algorithms.md#adaptive-clipping)
    clip_policy: ClipPolicy = ClipPolicy.fixed
    clip_quantile: float = 0.5
    clip_lr: float = 0.2
    clip_count_noise: float | None = None
    # seeded: every stream from the run seed (reproducible; a simulation, as the ledger says);
    # secure: release noise and privacy sampling from OS entropy, never from the seed
    # (docs/architecture.md#randomness)
    randomness: RandomnessMode = RandomnessMode.seeded


@dataclass
class TrainConfig:
    rounds: int = 20
    local_epochs: int = 1
    sampling_rate: float = 1.0
    shared_update: SharedUpdate = SharedUpdate.delta
    lr: float = 0.5  # owners' local SGD step (shared deltas and personal updates)
    batch_size: int = 32  # records per local SGD step
    server_lr: float = 1.0  # billboard step: u += server_lr * mean (delta) / u -= ... (gradient)
    personal_epochs: int | None = None  # personal-parameter epochs per round (None: local_epochs)
    eval_every: int = 1
    # owner-level updates (fedavg, placement=local_dpsgd): how the billboard averages owners
    owner_weights: OwnerWeights = OwnerWeights.uniform
    # fail closed (docs/algorithms.md#fail-closed): a round releases nothing and spends no
    # epsilon when fewer than min_owners owners answered or they hold fewer than min_users
    # declared user slots (their public capacities, never the sampled count)
    min_owners: int = 1
    min_users: int = 1

    def resolved_personal_epochs(self) -> int:
        """``personal_epochs``, defaulting to ``local_epochs``."""
        return self.local_epochs if self.personal_epochs is None else self.personal_epochs


@dataclass
class ColumnsConfig:
    """npz / parquet / hf: the column (array) names of the features (one name, or a list of
    scalar columns), label, user and owner, and the metadata columns kept
    (``partition.owner_rule=column`` groups by one of them)."""

    x: Any = "x"
    y: str = "y"
    user: str = "user"
    owner: str | None = None
    meta: list[str] = field(default_factory=list)


@dataclass
class DatasetConfig:
    # a registered data reader's name (fedudp.data.readers.READERS): synthetic, mnist,
    # fashion_mnist (planned), npz, parquet, hf, femnist, shakespeare, cifar10, cifar100, memory
    # (natural users, docs/your-data.md) or a plugin's
    name: str = "synthetic"
    root: str = "data"
    download: bool = False
    num_records: int = 10_000  # the paper's N: size of the training subset split over owners
    # synthetic only: feature dimension, pool sizes, teacher strength
    features: int = 60
    # the number of classes (the model's output width; public, never read from the data):
    # synthetic: null means 10; npz / parquet / hf / memory: required, labels outside
    # [0, classes) are refused; the built-in data sets declare their own (docs/your-data.md)
    classes: int | None = None
    # npz / parquet / hf / memory: each record's feature shape, e.g. [8] or [1, 28, 28]
    # (public, required; the data must have exactly this shape); the others declare their own
    input_shape: list[int] | None = None
    # npz / parquet / hf / memory: the features are integer token ids (model.name=auto then
    # builds the char GRU); false: float features (integer features are refused)
    tokens: bool = False
    pool_train: int = 60_000
    pool_test: int = 10_000
    signal: float = 6.0
    # natural users (npz, parquet: a file; femnist, shakespeare, cifar10/100: a folder, root)
    path: str | None = None  # npz / parquet: the training records' file
    test_path: str | None = None  # their test file (same columns); None: hold out below
    split: str = "train"  # hf: the split read for training
    test_split: str | None = "test"  # hf: its test split (absent or null: hold out below)
    test_fraction: float = 0.2  # held out of each user's records when there is no test set
    columns: ColumnsConfig = field(default_factory=lambda: ColumnsConfig())
    coarse: bool = False  # cifar100: the 20 coarse labels instead of the 100 fine
    unknown_char: str | None = None  # shakespeare: map characters outside LEAF's 80 to this one


@dataclass
class PartitionConfig:
    num_owners: int = 64
    records_per_user: int = 1
    scheme: Scheme = Scheme.paper_classes
    classes_per_owner: int = 8
    dirichlet_alpha: float = 0.5
    test_per_owner: int | None = None  # None: the test pool split evenly over owners
    # natural users (docs/your-data.md): grouping users into owners, forming users (CIFAR)
    owner_rule: OwnerRule = OwnerRule.random
    owner_column: str | None = None
    user_rule: UserRule = UserRule.shuffle


@dataclass
class ModelConfig:
    # a registered model's name (fedudp.models.MODELS) or auto: linear for flat features, cnn
    # for images, char_gru for token sequences
    name: str = "auto"
    # parameter-name patterns (fnmatch) kept personal by joint_dp; empty: the model's default
    personal: list[str] = field(default_factory=list)
    # your own torch.nn.Module: "package.module.Class" (or a factory), called with kwargs (and
    # input_shape / classes where its signature asks for them); overrides name
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class PublicConfig:
    """What the accountant treats as public about a federation read from data, declared once
    and checked against the data before any round (docs/your-data.md#public-numbers):
    the number of users N (the sampling denominator), every owner's user capacity M (owner-side
    DP-SGD's schedule) and the most records one user holds (group privacy's k, the estimators'
    m). Planned federations (synthetic, mnist, fashion_mnist) take them from the plan; set here
    they must agree with it."""

    users: int | None = None
    owner_capacity: int | None = None
    records_per_user: int | None = None


def estimator_defaults() -> dict[str, Any]:
    """``estimator.*``: every registered estimator's options (``Aggregator.options``,
    docs/algorithms.md#user-level-mean-estimators) at their defaults. A free-form dict whose keys
    ``validate`` checks against the registry; the chosen estimator reads its own, typed, in the
    config builder. The shared ones: ``bound``, the public a-priori bound B on each unit vector
    (l2 norm, or per coordinate where the estimator says so); ``tau``, the concentration radius
    (None: the estimator derives it from its own assumptions, e.g. ~bound/sqrt(m)); ``beta``, the
    failure probability."""
    from fedudp.aggregators import REGISTRY
    from fedudp.plugins import load_entry_points

    load_entry_points()
    return {name: opt.default for name, opt in sorted(REGISTRY.options().items())}


@dataclass
class AlgorithmConfig:
    """A seed's training algorithm on the one round loop (``fedudp.algorithms``;
    docs/algorithms.md#training-algorithms).

    Every ``None`` takes the paper's formula (each module's docstring gives it); ``train.rounds``
    is the configured T (the paper's, often infeasible, T is recorded beside it in summary.json).
    ``lipschitz``: the gradient bound G (Levy, Asi) / L (Huang); None: ``estimator.bound``
    (``privacy.clip`` for Huang Alg. 1). ``radius``: R, the radius of the parameter ball Θ that
    iterates are projected on. ``sigma``: Levy's sub-Gaussian parameter (None: G/sqrt(d)).
    ``strong_convexity``: μ of the public regulariser (μ/2)||θ||² added server-side (Asi Alg. 4).
    ``smoothness``: H (Levy Alg. 4's per-phase step 1/(H + λ_t)). ``noise_personal``: Huang
    Alg. 1 only (``method=joint_dp``): the paper's full-DP baseline, the shared step's noise σ
    also added to every owner's personal block every step (``fedudp.algorithms.huang_alg1``).
    """

    # a registered training algorithm's name (fedudp.algorithms.ALGORITHMS), or none
    name: str = "none"
    step_size: float | None = None
    radius: float = 10.0
    lipschitz: float | None = None
    sigma: float | None = None
    smoothing_radius: float | None = None
    phases: int | None = None
    lam: float | None = None
    strong_convexity: float = 0.1
    smoothness: float = 1.0
    averaged: bool | None = None
    # Huang Alg. 1's full-DP baseline (§3.2 / App. A.3): noise N(0, σ²) also on every owner's
    # personal block every step (inside the owner component; accounting unchanged)
    noise_personal: bool = False


@dataclass
class EngineConfig:
    chunk_records: int = 0  # local engine: records per vmapped chunk (0: auto, see chunk_budget)
    threads: int = 0  # torch threads (0: torch default)
    float64: bool = False  # equivalence mode
    # local engine: where the model, the records and the owners' kernels run (cpu | cuda |
    # cuda:N); noise is still drawn in float64 on the CPU generators (docs/architecture.md#engines)
    device: str = "cpu"
    # flower engine only (Ray resources per owner, an existing cluster, reply timeout)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    address: str | None = None
    timeout_s: float | None = None  # flower engine: wait for owners' replies (None: no limit)


@dataclass
class CheckpointConfig:
    """Checkpoints of the round loop (``fedudp.protocol.checkpoint``): one after every
    ``every``-th completed round (0: none), the newest ``keep`` kept in the run folder while it
    runs, and ``keep_after_finish`` of them once it has finished (a finished run is never
    resumed: ``none`` by default, so a sweep of many runs keeps no file it cannot use; an
    interrupted or failed run keeps its checkpoints). They change nothing a run computes, so a
    finished or resumed run compares its configuration without them."""

    every: int = 1
    keep: int = 2
    # once the run has finished (stop_reason other than interrupted / failed): none, last, all
    keep_after_finish: KeepAfterFinish = KeepAfterFinish.none


@dataclass
class TrackingConfig:
    """Experiment tracking (``fedudp.tracking``, docs/tracking.md): ``tracking=mlflow`` (or
    ``tracking.kind=mlflow``) logs the run to MLflow, ``tracking=tensorboard`` writes TensorBoard
    scalars. It changes nothing a run computes. ``uri``: an MLflow tracking URI (a server,
    ``http://host:5000``, or a database); null: an embedded SQLite store in the run folder
    (a sweep's: in the sweep folder) that needs no server. ``experiment``: the MLflow
    experiment's name."""

    kind: TrackingKind = TrackingKind.none
    uri: str | None = None
    experiment: str = "fedudp"


@dataclass
class AuditConfig:
    """Empirical privacy checks inside a training run (docs/algorithms.md#one-run-canary-estimate).
    ``canaries``: K random canary users inserted into the run (0: none); the summary reports the
    one-run ε estimate from them beside the ledger's ε. ``noise_scale``: multiplies the release
    noise of clip + Gaussian *without telling the ledger* (1.0: off). Below 1 the run is a
    deliberately broken mechanism for checking an audit: its ε is marked ``(weakened, not a
    guarantee)`` everywhere."""

    canaries: int = 0
    noise_scale: float = 1.0


@dataclass
class RunConfig:
    method: Method = Method.joint_dp
    # a registered estimator's name (fedudp.aggregators.REGISTRY), or auto: gaussian for
    # full_dp / joint_dp, none for fedavg and per_silo
    aggregator: str = "auto"
    engine: EngineName = EngineName.local
    seed: int = 0
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    engine_opts: EngineConfig = field(default_factory=EngineConfig)
    estimator: dict[str, Any] = field(default_factory=estimator_defaults)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    public: PublicConfig = field(default_factory=PublicConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    # a run folder: continue that run from its newest usable checkpoint (same configuration)
    resume: str | None = None
    progress: bool = True
    # your own modules imported before the config is checked: each registers an estimator, a
    # data reader, a training algorithm or a model (docs/architecture.md#plugins); packages
    # installed with a ``fedudp.plugins`` entry point are loaded always
    plugins: list[str] = field(default_factory=list)


# Huang et al. (001) Table 3: local epochs E and global rounds T for each number of owners n
HUANG_TABLE3 = {4: (20, 10), 16: (10, 10), 64: (10, 10), 128: (5, 20), 256: (5, 20), 512: (5, 20)}


def huang_table3(owners: Any, which: str) -> int:
    """``${huang_table3:${partition.num_owners},E}`` (or ``T``) in the Huang presets."""
    n = int(owners)
    if n not in HUANG_TABLE3 or which not in ("E", "T"):
        raise ConfigError(
            f"partition.num_owners: Huang et al. Table 3 gives E and T for n in "
            f"{sorted(HUANG_TABLE3)}, not {n}; set train.local_epochs and train.rounds"
        )
    return HUANG_TABLE3[n][0 if which == "E" else 1]


def register() -> None:
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="fedudp_schema", node=RunConfig)
    OmegaConf.register_new_resolver("huang_table3", huang_table3, replace=True)


def unknown_key_message(key: str) -> str:
    """The one line for a key the schema does not have (given with or without ``+``)."""
    if key.startswith("model.kwargs."):  # a free-form dict: a new key needs Hydra's '+'
        return (
            f"{key}: a model argument is a new key of the free-form dict model.kwargs: "
            f"add it with '+' ({'+' + key}=...)"
        )
    return (
        f"{key}: unknown key (the config schema has no such setting, with or without '+'); "
        "your own model is model.target=package.module.Class and its own arguments go "
        "under model.kwargs, e.g. +model.kwargs.hidden=64"
    )


def check_known_keys(node: Any, prefix: str = "") -> None:
    """A composed config (an OmegaConf node) holds only the schema's keys: Hydra's ``+key=value``
    adds a key that ``RunConfig`` does not declare, and ``OmegaConf.to_object`` would then drop
    it silently (``+train.roundz=3`` ran with the default rounds). The free-form dict
    ``model.kwargs`` takes any key, and so does ``estimator`` (``validate`` checks its keys
    against the registered estimators' options). Raises a one-line ``ConfigError`` naming the first unknown
    key."""
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    if not (isinstance(node, DictConfig) and dataclasses.is_dataclass(schema)):
        return  # a free-form dict (model.kwargs)
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        full = prefix + str(key)
        if key not in names:
            raise ConfigError(unknown_key_message(full))
        child = node._get_node(key)  # OmegaConf private API: no interpolation resolved
        if isinstance(child, DictConfig):
            check_known_keys(child, f"{full}.")


def resolved_aggregator(cfg: RunConfig) -> str:
    """The estimator's registry name; ``aggregator=auto``: gaussian for the private methods,
    none otherwise."""
    name = str(getattr(cfg.aggregator, "value", cfg.aggregator))
    if name != "auto":
        return name
    private = cfg.method in (Method.full_dp, Method.joint_dp)
    return "gaussian" if private else "none"


def _need(cond: bool, key: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def _finite_pos(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def coerce(obj: Any, prefix: str = "") -> None:
    """Turn plain strings into the schema's enums in place (programmatic use), naming bad keys."""
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


def check_names(cfg: RunConfig) -> None:
    """The configured names against the registries (their choices in the message), and the
    ``estimator.*`` keys against the registered estimators' options."""
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


def validate(cfg: RunConfig) -> None:
    """Range and cross-key checks of the run's own keys, before any work (an estimator's and an
    algorithm's options are checked by that estimator or algorithm, ``fedudp.build.check``).
    The ``plugins`` are imported first; the names of the estimator, data reader, training
    algorithm and model must be registered. Raises ``ConfigError`` naming the key."""
    from fedudp.plugins import load

    load(cfg.plugins)
    coerce(cfg)
    check_names(cfg)
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
    _check_device(cfg)


def _check_device(cfg: RunConfig) -> None:
    """``engine_opts.device``: cpu, cuda or cuda:N, a CUDA device only where torch sees one and
    only with engine=local (the Flower engine places nothing on a GPU)."""
    import re

    dev = cfg.engine_opts.device
    if not isinstance(dev, str) or not re.fullmatch(r"cpu|cuda(:\d+)?", dev):
        raise ConfigError(f"engine_opts.device: must be cpu, cuda or cuda:N, got {dev!r}")
    if dev == "cpu":
        return
    if cfg.engine != EngineName.local.value:
        raise ConfigError(
            f"engine_opts.device={dev}: only engine=local runs on a GPU (the Flower engine "
            "places nothing on one); use engine_opts.device=cpu with engine=flower"
        )
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


# -- (de)serialization: one vocabulary for Hydra, the Flower wire and `flwr run --run-config` --
def _effective_classes(d: Any) -> Any:
    """A config dict with ``dataset.classes`` null on a planned data set (synthetic, mnist,
    fashion_mnist) written as the 10 it means: runs saved before the key became optional
    (``classes: 10``) and runs saved after compare equal."""
    ds = d.get("dataset") if isinstance(d, dict) else None
    if (
        isinstance(ds, dict)
        and ds.get("classes") is None
        and str(ds.get("name", "synthetic")) in ("synthetic", "mnist", "fashion_mnist")
    ):
        d = {**d, "dataset": {**ds, "classes": 10}}
    return d


def config_dict(cfg: RunConfig) -> dict:
    import dataclasses

    return _effective_classes(jsonable(dataclasses.asdict(cfg)))


def config_to_json(cfg: RunConfig) -> str:
    import json

    return json.dumps(config_dict(cfg), sort_keys=True)


def config_from_json(text: str) -> RunConfig:
    """Inverse of ``config_to_json`` (the schema turns strings back into enums)."""
    import json

    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), json.loads(text))
    return cast(RunConfig, OmegaConf.to_object(merged))  # the structured schema's dataclass


def config_from_overrides(overrides: dict[str, Any]) -> RunConfig:
    """``{"train.rounds": 3, "method": "fedavg"}`` -> a ``RunConfig``; an unknown key or a bad
    value is a ``ConfigError`` naming the key."""
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

    base = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(base, True)
    for k, v in overrides.items():
        if k == "tracking" and not isinstance(v, dict):  # tracking=mlflow, as on the command line
            k = "tracking.kind"
        try:
            if k.startswith(("model.kwargs", "estimator")):  # free-form dicts
                with open_dict(base.model.kwargs if k.startswith("model") else base.estimator):
                    OmegaConf.update(base, k, v, merge=True)
                continue
            OmegaConf.update(base, k, v, merge=True)
        except ConfigAttributeError:
            raise ConfigError(unknown_key_message(k)) from None
        except OmegaConfBaseException as e:
            raise ConfigError(f"{k}: {str(e).splitlines()[0]}") from None
    return cast(RunConfig, OmegaConf.to_object(base))  # the structured schema's dataclass


def with_schema_defaults(config: Any) -> dict:
    """A saved config (a dict or an OmegaConf node) over the current schema's defaults: a key
    added after the run was made, at its default, does not make an old run another run, and
    ``1`` and ``1.0`` compare equal. A config the schema cannot read (a key it no longer has)
    comes back as saved."""
    from omegaconf import OmegaConf

    node = config if OmegaConf.is_config(config) else OmegaConf.create(config)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), node)
        return _effective_classes(jsonable(OmegaConf.to_container(merged, enum_to_str=True)))
    except Exception:  # noqa: BLE001
        return cast(dict, OmegaConf.to_container(node))  # a saved config: a mapping
