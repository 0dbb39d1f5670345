"""The run configuration's schema: its choices (enums) and sections (dataclasses), registered
with Hydra's ConfigStore (``fedudp.config.files.register``;
docs/architecture.md#configuration-and-outputs).

OmegaConf rejects unknown keys and wrongly typed / unknown enum values at composition time.
Importing this package imports nothing of fedudp but its foundation modules (``errors``,
``plain``, ``protocol.choices``); constructing a ``RunConfig`` reads the estimator registry's
option defaults (``estimator_defaults``), the one place the schema meets the registered parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedudp.errors import ConfigError
from fedudp.plain import Choice
from fedudp.protocol.choices import Method, OwnerWeights, Placement, SharedUpdate, Unit

__all__ = [
    "Accounting",
    "Calibration",
    "ClipPolicy",
    "RandomnessMode",
    "OwnerRule",
    "UserRule",
    "Scheme",
    "EngineName",
    "TrackingKind",
    "KeepAfterFinish",
    "Method",
    "OwnerWeights",
    "Placement",
    "SharedUpdate",
    "Unit",
    "PrivacyConfig",
    "TrainConfig",
    "ColumnsConfig",
    "DatasetConfig",
    "PartitionConfig",
    "ModelConfig",
    "PublicConfig",
    "AlgorithmConfig",
    "EngineConfig",
    "CheckpointConfig",
    "TrackingConfig",
    "AuditConfig",
    "RunConfig",
    "estimator_defaults",
    "HUANG_TABLE3",
    "huang_table3",
    "resolved_aggregator",
]


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
    """privacy.*: the guarantee and the mechanism (field comments give the details).

    Attributes
    ----------
    epsilon, delta, unit : float, float, Unit
        The (ε, δ) target of the whole run, and its privacy unit.
    accounting, calibration, placement, clip : Accounting, Calibration, Placement, float
        Certified or paper ε; how σ is calibrated; where noise is added; the clip norm.
    noise_multiplier : float or None
        None: calibrated to (ε, δ); a number: used, stopping before the budget is exceeded.
    group_privacy, clip_policy, clip_quantile, clip_lr, clip_count_noise, randomness : Any
        Group privacy (local_dpsgd); adaptive clipping; seeded or secure randomness.
    """

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
    """train.*: the round schedule and the owners' local training.

    Attributes
    ----------
    rounds, local_epochs, sampling_rate, shared_update : int, int, float, SharedUpdate
        Rounds T; local epochs per round; the units' sampling rate; delta or gradient.
    lr, batch_size, server_lr, personal_epochs, eval_every : float, int, float, int, int
        Local SGD step and batch; billboard step; personal epochs (None: local_epochs).
    owner_weights, min_owners, min_users : OwnerWeights, int, int
        Owner-level averaging; fail closed below these (owners answered, user slots).
    owner_dropout : float
        Simulated: each owner drops out of each round with this probability.
    """

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
    # simulated infrastructure: each owner drops out of each round with this probability
    # (public randomness keyed by seed and round, never data; engine=local): a dropped owner
    # is an owner failure (fail closed below min_owners; docs/algorithms.md#fail-closed)
    owner_dropout: float = 0.0

    def resolved_personal_epochs(self) -> int:
        """``personal_epochs``, defaulting to ``local_epochs``."""
        return self.local_epochs if self.personal_epochs is None else self.personal_epochs


@dataclass
class ColumnsConfig:
    """npz / parquet / hf: the column (array) names of the features (one name, or a list of
    scalar columns), label, user and owner, and the metadata columns kept
    (``partition.owner_rule=column`` groups by one of them).

    Attributes
    ----------
    x, y, user, owner, meta : str or list of str, str, str, str or None, list of str
        The feature column(s), label, user, owner (or None) and metadata columns.
    """

    x: Any = "x"
    y: str = "y"
    user: str = "user"
    owner: str | None = None
    meta: list[str] = field(default_factory=list)


@dataclass
class DatasetConfig:
    """dataset.*: the data reader and its options (field comments say which reader reads which).

    Attributes
    ----------
    name, root, download, num_records : str, str, bool, int
        A registered reader's name; its folder; may it download; the paper's N.
    features, pool_train, pool_test, signal : int, int, int, float
        synthetic only: feature dimension, pool sizes, teacher strength.
    classes, input_shape, tokens : int or None, list of int or None, bool
        Public: number of classes, each record's feature shape, token-id features.
    path, test_path, split, test_split, test_fraction, columns : Any
        Natural users: files (or splits), the held-out fraction, a ``ColumnsConfig``.
    coarse, unknown_char : bool, str or None
        cifar100's coarse labels; shakespeare's character outside LEAF's 80.
    """

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
    """partition.*: how records and users are dealt to owners.

    Attributes
    ----------
    num_owners, records_per_user, test_per_owner : int, int, int or None
        Owners; records per user; test records per owner (None: the pool split evenly).
    scheme, classes_per_owner, dirichlet_alpha : Scheme, int, float
        Planned data: the split of classes over owners.
    owner_rule, owner_column, user_rule : OwnerRule, str or None, UserRule
        Natural users: grouping users into owners; forming users (CIFAR).
    """

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
    """model.*: the model.

    Attributes
    ----------
    name, personal : str, list of str
        A registered model's name (or auto); joint_dp's personal parameter patterns.
    target, kwargs : str or None, dict
        Your own ``torch.nn.Module`` ("package.module.Class" or factory) and its kwargs.
    """

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
    they must agree with it.

    Attributes
    ----------
    users, owner_capacity, records_per_user : int or None
        N, every owner's capacity M, the most records of one user (None: from the plan).
    """

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
    failure probability.

    Returns
    -------
    dict of str to Any
        Each option's dotted name (sorted) to its default.
    """
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

    Attributes
    ----------
    name, noise_personal : str, bool
        A registered training algorithm's name (or none); Huang's full-DP baseline.
    step_size, lipschitz, sigma, smoothing_radius, lam, phases, averaged : Any
        The paper's symbols (None: its formula); ``averaged``: return the averaged iterate.
    radius, strong_convexity, smoothness : float
        R, μ, H (above).
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
    """engine_opts.*: how the engine runs (changes no number but ``float64``).

    Attributes
    ----------
    chunk_records, threads, float64, device : int, int, bool, str
        local: records per chunk (0: auto); torch threads; float64 mode; cpu / cuda:N (flower:
        cpu / cuda, each actor's GPU, with num_gpus > 0).
    num_cpus, num_gpus, address, timeout_s : float, float, str or None, float or None
        flower: Ray resources per SuperNode, a cluster, the reply timeout (None: none).
    owners_per_node : int
        flower: owners per SuperNode, in contiguous blocks (node k holds owners
        ``[k·b, min((k+1)·b, n))``); 1: one owner per node.
    connect_timeout_s : float
        flower: how long the SuperNodes may take to connect and answer the first query.
    """

    chunk_records: int = 0  # local engine: records per vmapped chunk (0: auto, see chunk_budget)
    threads: int = 0  # torch threads (0: torch default)
    float64: bool = False  # equivalence mode
    # where the model, the records and the owners' kernels run (cpu | cuda | cuda:N; flower:
    # each actor's GPU, with num_gpus > 0); noise is still drawn in float64 on the CPU generators
    # (docs/architecture.md#engines, docs/engines.md#gpus)
    device: str = "cpu"
    # flower engine only (Ray resources per owner, an existing cluster, reply timeout)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    address: str | None = None
    timeout_s: float | None = None  # flower engine: wait for owners' replies (None: no limit)
    owners_per_node: int = 1  # flower engine: owners per SuperNode (contiguous blocks)
    connect_timeout_s: float = 600.0  # flower engine: nodes connect, and answer, within this


@dataclass
class CheckpointConfig:
    """Checkpoints of the round loop (``fedudp.protocol.checkpoint``): one after every
    ``every``-th completed round (0: none), the newest ``keep`` kept in the run folder while it
    runs, and ``keep_after_finish`` of them once it has finished (a finished run is never
    resumed: ``none`` by default, so a sweep of many runs keeps no file it cannot use; an
    interrupted or failed run keeps its checkpoints). They change nothing a run computes, so a
    finished or resumed run compares its configuration without them.

    Attributes
    ----------
    every, keep : int
        Checkpoint every this many rounds (0: none); how many are kept while running.
    keep_after_finish : KeepAfterFinish
        Which stay once the run has finished.
    """

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
    experiment's name.

    Attributes
    ----------
    kind, uri, experiment : TrackingKind, str or None, str
        none, mlflow or tensorboard; the MLflow URI and experiment (above).
    """

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
    guarantee)`` everywhere.

    Attributes
    ----------
    canaries, noise_scale : int, float
        K canary users (0: none); the unaccounted release noise factor (1.0: off).
    """

    canaries: int = 0
    noise_scale: float = 1.0


@dataclass
class RunConfig:
    """The whole run configuration: ``fedudp key=value ...`` and ``fedudp.simulate`` compose it.

    Attributes
    ----------
    method, aggregator, engine, seed : Method, str, EngineName, int
        The method; an estimator's name (or auto); local or flower; the run seed.
    privacy, train, dataset, partition, model : PrivacyConfig, TrainConfig, ...
        The sections above (``DatasetConfig``, ``PartitionConfig``, ``ModelConfig``).
    engine_opts, algorithm, checkpoint, tracking, public, audit : EngineConfig, ...
        The sections above (``AlgorithmConfig``, ``CheckpointConfig``, ...).
    estimator, resume, progress, plugins : dict, str or None, bool, list of str
        Estimator options; a run folder to resume; a progress bar; modules imported first.
    """

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
    """``${huang_table3:${partition.num_owners},E}`` (or ``T``) in the Huang presets.

    Parameters
    ----------
    owners, which : Any, str
        The number of owners n; ``E`` (local epochs) or ``T`` (rounds).

    Returns
    -------
    int
        Table 3's value.

    Raises
    ------
    ConfigError
        n is not in Table 3, or ``which`` is neither E nor T.
    """
    n = int(owners)
    if n not in HUANG_TABLE3 or which not in ("E", "T"):
        raise ConfigError(
            f"partition.num_owners: Huang et al. Table 3 gives E and T for n in "
            f"{sorted(HUANG_TABLE3)}, not {n}; set train.local_epochs and train.rounds"
        )
    return HUANG_TABLE3[n][0 if which == "E" else 1]


def resolved_aggregator(cfg: RunConfig) -> str:
    """The estimator's registry name; ``aggregator=auto``: gaussian for the private methods,
    none otherwise.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    str
        ``cfg.aggregator``, with auto resolved by ``cfg.method``.
    """
    name = str(getattr(cfg.aggregator, "value", cfg.aggregator))
    if name != "auto":
        return name
    private = cfg.method in (Method.full_dp, Method.joint_dp)
    if private and cfg.privacy.placement == Placement.distributed:
        return "ddgauss"
    return "gaussian" if private else "none"
