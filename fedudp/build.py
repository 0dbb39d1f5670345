"""The config builder: the one module that reads a ``RunConfig``'s fields and turns them into
objects (docs/architecture.md#the-config-builder).

Every other module takes plain Python values: estimators (``calibrated(epsilon=..., ...)``),
the owner component (``Owners(model, method, training, budget, hooks)``), the billboard, the
models, the federation and the training algorithms. This module maps the configuration's keys
onto those values, decides the method and the noise placement once (``method``,
``placement``), reports a bad value as a ``ConfigError`` naming the config key, and assembles a
run (``prepare``). Nothing here computes: each part's arithmetic and its own parameter checks
live with the part.

Order of ``prepare``, everything that needs only the config first (no data is read before the
config, the estimator's calibration and the budget have been checked):
validate -> estimator/algorithm checks -> data files present -> model, method, training ->
calibrated estimator (or a training algorithm's estimators and plan) -> ledger -> billboard ->
the federation (a planned one's owner and user counts equal the plan's; a natural one has the
declared owner count and at most the declared users: declarations are upper bounds). A natural
federation's records are read and checked against every declaration (``declared_inputs``,
``check_public``) right after the config's own checks, before any of the rest.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch

from fedudp import algorithms
from fedudp.aggregators import (
    REGISTRY,
    AdaptiveClipGaussian,
    Aggregator,
    GaussianAggregator,
    LocalDpSgdMean,
    Sampling,
)
from fedudp.aggregators.base import RUN_INPUTS, ParameterError
from fedudp.aggregators.memory import check_rows_fit
from fedudp.billboard.canaries import Canaries
from fedudp.billboard.fail_closed import minimum_error
from fedudp.billboard.server import Billboard, ServerStep
from fedudp.config import (
    Accounting,
    Calibration,
    ClipPolicy,
    ConfigError,
    DataError,
    EngineName,
    KeepAfterFinish,
    Method,
    OwnerRule,
    OwnerWeights,
    Placement,
    RandomnessMode,
    RunConfig,
    Scheme,
    SharedUpdate,
    TrackingKind,
    Unit,
    UserRule,
    jsonable,
    resolved_aggregator,
    validate,
)
from fedudp.data import federation as federation_mod
from fedudp.data.federation import Federation
from fedudp.data.idx import check_available
from fedudp.data.readers import READERS, DataReader, ReadRequest
from fedudp.data.records import Records, group_users
from fedudp.models import make_model
from fedudp.models.split import SplitModel
from fedudp.owner import local_sgd
from fedudp.owner.owners import OwnerHooks, Owners, OwnerTraining
from fedudp.plugins import load as load_plugins
from fedudp.privacy.accountant import (
    MAX_PLD_POINTS,
    BudgetError,
    Ledger,
    accountant_for,
    pld_too_large,
)
from fedudp.protocol.methods import MethodSpec, make_method
from fedudp.randomness import Randomness

__all__ = [
    "RunSettings",
    "Prepared",
    "prepare",
    "check",
    "settings",
    "placement",
    "estimator",
    "estimator_class",
    "model",
    "method",
    "owner_training",
    "owners",
    "federation",
    "ledger",
    "planned_owner_records",
    "planned_owner_users",
    "planned_units",
    "planned_shape",
    "records_per_unit",
    "CONFIG_KEYS",
]


# -- the run's plain settings (what the runner, the engines and the tools read) -----------------
@dataclass(frozen=True)
class RunSettings:
    """The plain values a runner needs from a config, besides the built objects."""

    method: str
    private: bool
    placement: str | None  # server | local_dpsgd (private methods only)
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


def settings(cfg: RunConfig) -> RunSettings:
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
    )


def placement(cfg: RunConfig) -> Placement:
    """Where the noise is added: in the owners (``local_dpsgd``, private methods only) or on the
    billboard (``server``). Decided here, once."""
    private = Method(cfg.method) in (Method.full_dp, Method.joint_dp)
    if private and Placement(cfg.privacy.placement) == Placement.local_dpsgd:
        return Placement.local_dpsgd
    return Placement.server


# -- the public plan: counts known before any data is read ----------------------------------------
def reader(cfg: RunConfig) -> DataReader:
    """The registered data reader of ``dataset.name`` (``fedudp.data.readers.READERS``)."""
    load_plugins(cfg.plugins)
    name = str(cfg.dataset.name)
    if name not in READERS:
        raise ConfigError(READERS.unknown(name))
    return READERS[name]


def read_request(cfg: RunConfig) -> ReadRequest:
    """The reader's plain values from ``dataset.*``, ``partition.*`` and the seed."""
    d, part, cols = cfg.dataset, cfg.partition, cfg.dataset.columns
    return ReadRequest(
        name=str(d.name),
        path=d.path,
        test_path=d.test_path,
        root=str(d.root),
        split=str(d.split),
        test_split=d.test_split,
        features=cols.x if isinstance(cols.x, str) else tuple(str(c) for c in cols.x),
        label=str(cols.y),
        user=str(cols.user),
        owner=cols.owner,
        meta=tuple(cols.meta),
        coarse=bool(d.coarse),
        unknown_char=d.unknown_char,
        user_rule=UserRule(part.user_rule).value,
        records_per_user=int(part.records_per_user),
        dirichlet_alpha=float(part.dirichlet_alpha),
        seed=int(cfg.seed),
    )


def natural(cfg: RunConfig) -> bool:
    """Whether the users (and owner sizes) come from the data (docs/your-data.md)."""
    return reader(cfg).natural


def declared(cfg: RunConfig, key: str) -> int:
    """A natural federation's declared public number ``public.<key>`` (``ConfigError`` if not
    declared; ``prepare`` first reads the data so that its message gives the data's value)."""
    v = getattr(cfg.public, key)
    if v is None:
        raise ConfigError(
            f"public.{key}: a federation read from data needs it declared "
            "(docs/your-data.md#public-numbers)"
        )
    return int(v)


def planned_owner_records(cfg: RunConfig) -> np.ndarray:
    """Each owner's public record count: floor/ceil(N/n) planned; for a natural federation
    the declared capacity times the declared records per user (an upper bound)."""
    if natural(cfg):
        return np.full(
            cfg.partition.num_owners,
            declared(cfg, "owner_capacity") * declared(cfg, "records_per_user"),
            dtype=np.int64,
        )
    return federation_mod.planned_owner_records(cfg.dataset.num_records, cfg.partition.num_owners)


def planned_owner_users(cfg: RunConfig) -> np.ndarray:
    """Each owner's public user count: its records cut into users of records_per_user planned;
    for a natural federation the declared capacity ``public.owner_capacity``."""
    if natural(cfg):
        return np.full(cfg.partition.num_owners, declared(cfg, "owner_capacity"), dtype=np.int64)
    return federation_mod.planned_owner_users(
        cfg.dataset.num_records, cfg.partition.num_owners, cfg.partition.records_per_user
    )


def planned_units(cfg: RunConfig) -> tuple[int, int]:
    """(owners, users) of the federation: planned, or declared (``public.users``)."""
    if natural(cfg):
        return int(cfg.partition.num_owners), declared(cfg, "users")
    users = planned_owner_users(cfg)
    return len(users), int(users.sum())


def planned_shape(cfg: RunConfig, records: Any = None) -> tuple[tuple[int, ...], int]:
    """(input shape, classes) of the configured dataset: public, known before any data is read
    (``input_spec``)."""
    return input_spec(cfg, records)[:2]


SYNTHETIC_CLASSES = 10  # dataset.classes=null on the synthetic data set


def declares_inputs(cfg: RunConfig) -> bool:
    """Whether the configuration declares the inputs (``dataset.classes``,
    ``dataset.input_shape``, ``dataset.tokens``): a reader with no ``inputs`` of its own (npz,
    parquet, hf, memory, most plugins)."""
    return str(cfg.dataset.name) != "synthetic" and reader(cfg).inputs is None


def input_spec(cfg: RunConfig, records: Any = None) -> tuple[tuple[int, ...], int, bool]:
    """(input shape, classes, whether the inputs are token ids): public, never read from the
    data. A reader with ``inputs`` declares its own (synthetic: [features] and
    ``dataset.classes``, 10 when null); the others take ``dataset.input_shape``,
    ``dataset.classes`` and ``dataset.tokens`` (``ConfigError`` when one is missing;
    ``prepare`` first reads the data so that the message gives its value). ``records`` is
    accepted for callers that pass them and is not read."""
    d = cfg.dataset
    name = str(d.name)
    if name == "synthetic":
        return (
            (int(d.features),),
            SYNTHETIC_CLASSES if d.classes is None else int(d.classes),
            False,
        )
    own = reader(cfg).inputs
    if own is not None:
        shape, classes, tokens = own(read_request(cfg))
        for key, mine, given in (
            ("classes", classes, d.classes),
            ("input_shape", list(shape), d.input_shape),
        ):
            if (
                given is not None
                and (list(cast(list, given)) if key == "input_shape" else given) != mine
            ):
                raise ConfigError(
                    f"dataset.{key}: dataset.name={name} declares {mine}, got "
                    f"{given} (leave it null)"
                )
        return tuple(shape), classes, tokens
    for key in ("classes", "input_shape"):
        if getattr(d, key) is None:
            raise ConfigError(
                f"dataset.{key}: dataset.name={name} needs it declared (public: "
                "the model's shape, docs/your-data.md#public-numbers)"
            )
    assert d.input_shape is not None and d.classes is not None  # checked just above
    return tuple(int(v) for v in d.input_shape), int(d.classes), bool(d.tokens)


def records_per_unit(cfg: RunConfig) -> int:
    """Records per privacy unit m (public): records_per_user, or an owner's share at owner
    level; a natural federation's declared ``public.records_per_user`` (times the declared
    owner capacity at owner level)."""
    if natural(cfg):
        m = declared(cfg, "records_per_user")
        return m * declared(cfg, "owner_capacity") if Unit(cfg.privacy.unit) == Unit.owner else m
    if Unit(cfg.privacy.unit) == Unit.owner:
        return max(1, cfg.dataset.num_records // max(1, cfg.partition.num_owners))
    return int(cfg.partition.records_per_user)


# -- natural federations (docs/your-data.md) --------------------------------------------------------
_NATURAL_CACHE: dict[str, tuple] = {}


def _natural_key(cfg: RunConfig) -> str:
    import json
    from dataclasses import asdict

    return json.dumps(
        jsonable(
            {"dataset": asdict(cfg.dataset), "partition": asdict(cfg.partition), "seed": cfg.seed}
        ),
        sort_keys=True,
    )


def natural_records(cfg: RunConfig, given: Any = None) -> tuple[Records, Records | None]:
    """The grouped training records (every user has an owner) and the test records of a
    natural federation: read from the configured files (once per process), or ``given``
    (``dataset.name=memory``: a ``Records`` or a (train, test) pair)."""
    name = str(cfg.dataset.name)
    if name == "memory":
        if given is None:
            raise ConfigError(
                "dataset.name: memory takes its records from the Python API: "
                "fedudp.simulate(config, records=...)"
            )
        train, test = given if isinstance(given, tuple) else (given, None)
        return _group(cfg, *declared_inputs(cfg, train, test))
    if given is not None:
        raise ConfigError(
            f"dataset.name: {name} reads its records from files; records given "
            "through the Python API need dataset.name=memory"
        )
    key = _natural_key(cfg)
    if key not in _NATURAL_CACHE:
        _NATURAL_CACHE.clear()
        _NATURAL_CACHE[key] = _group(cfg, *declared_inputs(cfg, *_read_natural(cfg)))
    return _NATURAL_CACHE[key]


def _read_natural(cfg: RunConfig) -> tuple[Records, Records | None]:
    """The configured reader's (train, test) records (``fedudp.data.readers``)."""
    rd = reader(cfg)
    if rd.read is None:
        raise ConfigError(f"dataset.name: {rd.name} has no reader of files")
    return rd.read(read_request(cfg))


def declared_inputs(
    cfg: RunConfig, train: Records, test: Records | None
) -> tuple[Records, Records | None]:
    """The records checked against the declared inputs (``input_spec``) before any other use:
    npz / parquet / hf / memory must declare ``dataset.classes`` and ``dataset.input_shape``
    (a missing one is one line giving the data's values), every record must have the declared
    shape, integer features need ``dataset.tokens=true`` (and float ones false), and every label
    must lie in [0, classes) (a ``DataError`` naming the file). The records come back with the
    declared class count (in-memory records' own ``classes`` is replaced)."""
    from dataclasses import replace

    name = str(cfg.dataset.name)
    d = cfg.dataset
    splits = [r for r in (train, test) if r is not None]
    if declares_inputs(cfg) and (d.classes is None or d.input_shape is None):
        top = max((int(r.y.max()) + 1 for r in splits if len(r)), default=0)
        key = "classes" if d.classes is None else "input_shape"
        raise ConfigError(
            f"dataset.{key}: a federation read from {name} needs its model's shape "
            "declared (docs/your-data.md#public-numbers); this data has "
            f"dataset.input_shape={list(train.x.shape[1:])}, dataset.classes>={top} "
            f"(labels 0..{top - 1})"
        )
    shape, classes, tokens = input_spec(cfg)
    out = []
    for r in splits:
        where = r.source or "records"
        if tuple(r.x.shape[1:]) != shape:
            raise ConfigError(
                f"dataset.input_shape: {list(shape)} declared, the records of "
                f"{where} have shape {list(r.x.shape[1:])}"
            )
        if (r.x.dtype == np.int64) != tokens:
            raise ConfigError(
                f"dataset.tokens: {str(tokens).lower()} declared, the features of {where} are "
                + (
                    "integers: set dataset.tokens=true for token ids, or store float features"
                    if not tokens
                    else "floats: token ids are integers (or set dataset.tokens=false)"
                )
            )
        try:
            out.append(r if r.classes == classes else replace(r, classes=classes))
        except DataError as e:  # a label outside [0, classes)
            raise DataError(f"dataset.classes: {classes} declared; {e}") from None
    return out[0], (out[1] if test is not None else None)


def _group(cfg: RunConfig, train: Records, test: Records | None) -> tuple[Records, Records | None]:
    """Users into owners by ``partition.owner_rule``; test records without training users to
    owners (CIFAR's test batch dealt evenly; a user seen only in the test split by a keyed hash
    of its key), over the public owner list ``0..num_owners-1`` for ``random``/``dirichlet``;
    without a test set, ``dataset.test_fraction`` of each user's records held out. Every rule
    places a user by its own key and data and public numbers, so no neighbour moves another."""
    from fedudp.data import natural as nat

    part, d = cfg.partition, cfg.dataset
    rule = OwnerRule(part.owner_rule).value
    try:
        if rule == "given":
            if train.owner is None:
                raise ConfigError(
                    "partition.owner_rule: given needs an owner column "
                    "(dataset.columns.owner=<column>)"
                )
        elif rule == "column":
            if not part.owner_column:
                raise ConfigError(
                    "partition.owner_column: owner_rule=column groups users by a "
                    "metadata column; name it (and list it in dataset.columns.meta)"
                )
            train = group_users(train, "column", column=part.owner_column)
        else:
            train = group_users(
                train,
                cast(Literal["random", "column", "dirichlet"], rule),  # partition.owner_rule
                num_owners=part.num_owners,
                seed=cfg.seed,
                alpha=part.dirichlet_alpha if rule == "dirichlet" else None,
            )
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"partition.owner_rule={rule}: {e}") from None
    assert train.owner is not None  # grouped above
    # the public owner list where the rule has one: test records never follow the data's owners
    owners = (
        np.arange(part.num_owners, dtype=np.int64)
        if rule in ("random", "dirichlet")
        else np.unique(train.owner)
    )
    if test is None:
        if d.test_fraction > 0:
            train, test = nat.holdout(train, d.test_fraction, cfg.seed)
    elif reader(cfg).test_without_users:
        # no users in the test batch (CIFAR): each record its own (never a training user)
        test = nat.deal(
            test.with_user(np.array([f"test{i}" for i in range(len(test))])), owners, cfg.seed
        )
    elif test.owner is None:  # a user seen only in the test split: by its own key
        test = nat.deal_test_users(test, train, owners, cfg.seed)
    return train, test


def natural_numbers(train: Records) -> dict:
    """What a grouped natural federation holds: users, owners, the largest owner (users), the
    largest user (records)."""
    users, uinv = np.unique(train.user, return_inverse=True)
    per_user = np.bincount(uinv)
    first = np.unique(train.user, return_index=True)[1]
    assert train.owner is not None  # a grouped federation
    _, owner_users = np.unique(train.owner[first], return_counts=True)
    return {
        "users": len(users),
        "owners": len(owner_users),
        "owner_capacity": int(owner_users.max(initial=0)),
        "records_per_user": int(per_user.max(initial=0)),
    }


def check_public(cfg: RunConfig, train: Records) -> None:
    """The declared public numbers against the data, as upper bounds: at most ``public.users``
    users in at most ``partition.num_owners`` owners, every owner within the capacity, every
    user within the records bound (fewer users, or empty owners, run under the same declaration
    with the same schedule, divisor and noise). A missing declaration is one line that gives the
    data's value; data exceeding one is one line naming the key."""
    have = natural_numbers(train)
    missing = [
        k for k in ("users", "owner_capacity", "records_per_user") if getattr(cfg.public, k) is None
    ]
    if missing:
        raise ConfigError(
            f"public.{missing[0]}: a federation read from data needs its public "
            "numbers declared (docs/your-data.md#public-numbers); this data has "
            + ", ".join(
                f"public.{k}={have[k]}" for k in ("users", "owner_capacity", "records_per_user")
            )
        )
    if have["owners"] > cfg.partition.num_owners:
        raise ConfigError(
            f"partition.num_owners: {cfg.partition.num_owners} declared, the data "
            f"is grouped into {have['owners']} owners (an upper bound: declare at "
            "least that many)"
        )
    pub = cfg.public
    if have["users"] > pub.users:
        raise ConfigError(
            f"public.users: {pub.users} declared, the data has {have['users']} users "
            "(an upper bound: declare at least that many)"
        )
    if have["owner_capacity"] > pub.owner_capacity:
        raise ConfigError(
            f"public.owner_capacity: {pub.owner_capacity} declared, an owner of the "
            f"data holds {have['owner_capacity']} users"
        )
    if have["records_per_user"] > pub.records_per_user:
        raise ConfigError(
            f"public.records_per_user: {pub.records_per_user} declared, a user of "
            f"the data holds {have['records_per_user']} records"
        )


def public_numbers(cfg: RunConfig) -> dict:
    """The numbers the accountant treats as public, and where they come from (the ledger):
    the populations (upper bounds for a natural federation) and the model's input shape and
    classes (``input_spec``)."""
    shape, classes, tokens = input_spec(cfg)
    inputs = {
        "classes": int(classes),
        "input_shape": [int(v) for v in shape],
        "tokens": bool(tokens),
    }
    if natural(cfg):
        name = str(cfg.dataset.name)
        return {
            "users": declared(cfg, "users"),
            "owners": int(cfg.partition.num_owners),
            "owner_capacity": declared(cfg, "owner_capacity"),
            "records_per_user": declared(cfg, "records_per_user"),
            **inputs,
            "source": "declared (public.*, partition.num_owners as upper bounds; "
            + (
                "dataset.classes, dataset.input_shape, dataset.tokens"
                if declares_inputs(cfg)
                else f"the inputs {name} declares"
            )
            + "), checked against the data before the first round",
        }
    users = planned_owner_users(cfg)
    return {
        "users": int(users.sum()),
        "owners": len(users),
        "owner_capacity": int(users.max()),
        "records_per_user": int(cfg.partition.records_per_user),
        **inputs,
        "source": "planned from the config (dataset.num_records, partition.*, dataset.*)",
    }


def check_planned_public(cfg: RunConfig) -> None:
    """A planned federation's ``public.*``, where set, must be the plan's."""
    if natural(cfg):
        return
    plan = public_numbers(cfg)
    for k in ("users", "owner_capacity", "records_per_user"):
        v = getattr(cfg.public, k)
        if v is not None and v != plan[k]:
            raise ConfigError(
                f"public.{k}: {v} declared, the planned federation has {plan[k]} "
                "(leave it null for a planned data set)"
            )


# -- estimators -----------------------------------------------------------------------------------
# the config key of each plain value an estimator or algorithm may name in a ParameterError
# (errors name the key): the run's values (RUN_INPUTS), a few parts of them, and every
# registered estimator's options (``estimator.<name>``, looked up when the error is raised)
CONFIG_KEYS = {
    **RUN_INPUTS,
    "sampling.rate": "train.sampling_rate",
    "sampling.population": "partition",
    "noise_multiplier": "privacy.noise_multiplier",
    "records_per_user": "partition.records_per_user",
}


def config_key(param: str) -> str:
    """The configuration key of a plain value's name (itself when there is none)."""
    if param in CONFIG_KEYS:
        return CONFIG_KEYS[param]
    if param in REGISTRY.options():
        return f"estimator.{param}"
    return param


_BUDGET = ("epsilon", "delta", "rounds")


def config_message(err: ParameterError) -> str:
    """``err``'s message with the parameter's name replaced by its config key
    (``"clip must be > 0, got 0"`` -> ``"privacy.clip must be > 0, got 0"``)."""
    key, text = config_key(err.param), str(err)
    if text.startswith(err.param + " "):
        return key + text[len(err.param) :]
    return f"{key}: {text}"


def config_error(
    err: ParameterError, name: str = "", sampling: Sampling | None = None
) -> ConfigError:
    """The ``ConfigError`` for a refused plain value: the key named, a budget that cannot be met
    a ``BudgetError``, a population too small for an estimator's proof a ``partition`` error."""
    given = err.facts.get("config")
    if isinstance(given, ConfigError):
        return given
    if err.param == "sampling.population" and name:
        n = sampling.population if sampling is not None else "?"
        need = err.facts.get("need")
        head = (
            f"partition: aggregator={name} needs n >= {need} units, got n={n}"
            if need is not None
            else f"partition: aggregator={name} with n={n} units"
        )
        return ConfigError(
            f"{head}: {err.facts.get('detail') or str(err)}. Raise users or "
            "privacy.epsilon, or use aggregator=gaussian"
        )
    return (BudgetError if err.param in _BUDGET else ConfigError)(config_message(err))


def estimator_class(cfg: RunConfig) -> type[Aggregator]:
    """The configured estimator's class: owner-side DP-SGD's billboard mean under
    ``placement=local_dpsgd``, else the registered ``aggregator`` (auto: gaussian for the
    private methods, the plain mean otherwise)."""
    adaptive = ClipPolicy(cfg.privacy.clip_policy) == ClipPolicy.adaptive
    if placement(cfg) == Placement.local_dpsgd:
        return LocalDpSgdMean  # an adaptive clip is its own option (clip_policy)
    name = resolved_aggregator(cfg)
    if adaptive:
        if name not in (GaussianAggregator.name, AdaptiveClipGaussian.name):
            raise ConfigError(
                f"privacy.clip_policy: adaptive clipping adapts clip + Gaussian's "
                f"clip (aggregator=gaussian), not aggregator={name}; set "
                "privacy.clip_policy=fixed"
            )
        return AdaptiveClipGaussian
    if name not in REGISTRY:
        raise ConfigError(
            f"aggregator: {name} is not available in this build (available: {sorted(REGISTRY)})"
        )
    return REGISTRY[name]


def check_estimator(cfg: RunConfig) -> None:
    """What an estimator declares about itself, checked against the config before any work:
    the calibrations it supports, whether it takes a fixed noise multiplier, whether it is
    analysed replace-one (every unit every round)."""
    cls = estimator_class(cfg)
    if not cls.private:
        return
    cal = Calibration(cfg.privacy.calibration).value
    if cal not in cls.calibrations:
        raise ConfigError(
            f"privacy.calibration: closed_form {cls.closed_form_note}; use accountant"
        )
    if cfg.privacy.noise_multiplier is not None and not cls.fixed_noise:
        raise ConfigError(
            f"privacy.noise_multiplier: only aggregator=gaussian (and "
            f"placement=local_dpsgd) take a fixed noise multiplier; "
            f"aggregator={cls.name} calibrates its own noise, leave it null"
        )
    if cls.replace_one and cfg.train.sampling_rate < 1.0:
        raise ConfigError(
            f"train.sampling_rate: aggregator={cls.name} is analysed replace-one "
            "with a public n (every unit, every round); set train.sampling_rate=1"
        )


def estimator_values(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int) -> dict:
    """The run's values an estimator may take (``RUN_INPUTS``, every one), read from the
    config; an estimator's ``inputs`` pick from them."""
    p, t = cfg.privacy, cfg.train
    group = bool(p.group_privacy)
    values = {
        "dim": dim,
        "epsilon": p.epsilon,
        "delta": p.delta,
        "rounds": rounds,
        "sampling": sampling,
        "clip": p.clip,
        "clip_policy": ClipPolicy(p.clip_policy).value,
        "clip_quantile": p.clip_quantile,
        "clip_lr": p.clip_lr,
        "clip_count_noise": p.clip_count_noise,
        "accounting": Accounting(p.accounting).value,
        "calibration": Calibration(p.calibration).value,
        "records_per_unit": records_per_unit(cfg) if cfg.estimator["tau"] is None else None,
        "batch_size": t.batch_size,
        "local_epochs": t.local_epochs,
        "owner_units": planned_owner_records(cfg) if group else planned_owner_users(cfg),
        "group_size": int(cfg.partition.records_per_user) if group else None,
        "noise_scale": float(cfg.audit.noise_scale),
    }
    assert values.keys() == RUN_INPUTS.keys()  # the builder gives every declared run value
    return values


def estimator_options(cfg: RunConfig, cls: type[Aggregator]) -> dict:
    """The estimator's declared options (``cls.options``), each read from
    ``estimator.<name>`` as its declared type; a value of the wrong type is a ``ConfigError``
    naming the key."""
    out = {}
    for opt in cls.options:
        given = cfg.estimator.get(opt.name, opt.default)
        try:
            out[opt.name] = opt.value(given)
        except ValueError as e:
            raise ConfigError(f"estimator.{opt.name}: aggregator={cls.name} {e}") from None
    return out


def estimator(
    cfg: RunConfig,
    sampling: Sampling,
    rounds: int,
    dim: int,
    *,
    name: str | None = None,
    **overrides: Any,
) -> Aggregator:
    """The configured estimator (or the registered ``name``), calibrated over ``rounds``
    releases of ``dim``-vectors. Built with explicit keyword arguments: exactly the run values
    the class declares (``inputs``) and its options (``options``, from ``estimator.*``);
    ``overrides`` replace some of them (a training algorithm's own τ), and one the class does
    not declare is a ``TypeError``. A fixed ``privacy.noise_multiplier`` goes to the class's
    ``with_noise_multiplier`` with its ``noise_inputs``."""
    cls = REGISTRY[name] if name is not None else estimator_class(cfg)
    if name is None:
        check_estimator(cfg)
    if cls.needs_per_user_vectors and dim < 1:
        raise ConfigError(f"aggregator={cls.name} needs at least one shared parameter")
    run = estimator_values(cfg, sampling, rounds, dim)
    declared = {k: run[k] for k in cls.inputs} | estimator_options(cfg, cls)
    unknown = sorted(set(overrides) - set(declared))
    if unknown:
        raise TypeError(f"estimator {cls.name} takes no {unknown} (it declares {sorted(declared)})")
    values = declared | overrides
    fixed = cfg.privacy.noise_multiplier if cls.private and cls.fixed_noise else None
    try:
        if fixed is not None:
            kwargs = {k: values[k] for k in cls.noise_inputs}
            return cls.with_noise_multiplier(noise_multiplier=fixed, **kwargs)
        return cls.calibrated(**values)
    except ParameterError as err:
        raise config_error(err, cls.name, sampling) from None


# -- models, method, owners -----------------------------------------------------------------------
def model(
    cfg: RunConfig, records: Any = None, given: Any = None, probe: bool = False
) -> SplitModel:
    """The configured model at the run seed's initialisation (float64 in equivalence mode),
    parameters frozen (the owner side trains functional copies): ``model.target`` (your own
    module), else ``model.name`` (``auto``: linear for flat features, cnn for images,
    char_gru for token sequences); ``given``: a module object from the Python API (copied).
    Layers that break per-user privacy (BatchNorm, ...) are refused, naming the layer.
    ``probe``: also run ``probe_model`` (``prepare`` does, once per run: a Flower owner
    rebuilding the model from the same config skips it)."""
    from fedudp.models import custom, footprint
    from fedudp.models import validate as model_check

    load_plugins(cfg.plugins)  # a plugin's model (a Flower owner builds it from the config)
    shape, classes, tokens = input_spec(cfg, records)
    name = str(cfg.model.name)
    try:
        if given is not None:
            m = custom.fresh_copy(given)
        elif cfg.model.target:
            m = custom.from_target(
                cfg.model.target,
                dict(cfg.model.kwargs),
                input_shape=shape,
                classes=classes,
                seed=cfg.seed,
            )
        else:
            if name == "auto" and tokens:
                name = "char_gru"
            footprint.check_model(  # before any allocation (fedudp.models.footprint's rule)
                lambda c: make_model(name, shape, c, seed=cfg.seed),
                classes=classes,
                model_key=f"model.name={name}",
                float64=bool(cfg.engine_opts.float64),
                device=str(cfg.engine_opts.device),
                shared_and_units=lambda meta: _footprint_units(cfg, meta),
            )
            m = make_model(name, shape, classes, seed=cfg.seed)
        model_check.check_model(m)
        if probe:
            probe_model(m, shape, classes, tokens)  # output [batch, classes], per-record path
    except ConfigError:  # already names its key (fedudp.models.footprint)
        raise
    except ValueError as e:
        key = "model.target" if cfg.model.target and given is None else "model.name"
        raise ConfigError(f"{key}: {e}" if given is None else f"model: {e}") from None
    if cfg.engine_opts.float64:
        m = m.double()
    for prm in m.parameters():
        prm.requires_grad_(False)
    # a SplitModel, or a user's module that carries default_personal (fedudp.models.custom)
    return cast(SplitModel, m)


def _footprint_units(cfg: RunConfig, net: Any) -> tuple[tuple[str, ...], int]:
    """(the shared parameters' names, U) of ``fedudp.models.footprint``'s rule for ``net``
    (a model on the meta device): U, the units one vectorized owner step stacks at least, is
    1 unless the local engine computes user-level vectors (``placement=server``, user
    cohorts): then min(the expected cohort floor(q*N), the units one chunk holds)."""
    spec = method(cfg, net)
    if (
        spec.cohort_is_owners
        or EngineName(cfg.engine) != EngineName.local
        or placement(cfg) != Placement.server
        or (natural(cfg) and cfg.public.users is None)
    ):
        return spec.shared, 1
    per_user = cfg.public.records_per_user if natural(cfg) else cfg.partition.records_per_user
    cap = int(per_user or cfg.train.batch_size)  # at most a batch of a unit in one step
    if SharedUpdate(cfg.train.shared_update) == SharedUpdate.delta:
        cap = min(cap, int(cfg.train.batch_size))
    budget = local_sgd.chunk_budget(int(cfg.engine_opts.chunk_records), net)
    cohort = int(float(cfg.train.sampling_rate) * planned_units(cfg)[1])
    return spec.shared, max(1, min(cohort, budget // max(1, cap)))


def _inputs_declared(cfg: RunConfig) -> bool:
    """Whether ``input_spec`` answers from the config alone (no missing declaration)."""
    try:
        input_spec(cfg)
    except ConfigError:
        return False
    return True


def builtin_model(m: Any) -> bool:
    """Whether ``m``'s class is one of fedudp's own models (``fedudp.models``), whose
    per-record ``torch.func.vmap(grad(...))`` path ``tests/models/test_model_probe.py`` runs for
    every registered name: the run's probe skips that step for them (it imports
    ``torch._dynamo``, about a second of a small run's start); a user's or a plugin's model is
    always probed."""
    return type(m).__module__.startswith("fedudp.models.")


def probe_model(m: Any, shape: tuple[int, ...], classes: int, tokens: bool) -> None:
    """``fedudp.models.validate.probe`` on an example batch of the declared shape, and DP-SGD's
    one-pass per-record kernel on the same batch for every parameter whose layer qualifies for
    it (whichever of them a method shares, the kernel then runs on a subset of these layers; an
    exact nn.Linear applied twice per forward fails there); then every batched kernel's
    per-record outputs and gradients against each record's own pass (a model mixing the records
    of a batch is refused: ``fedudp.owner.independence``). One-line ``ValueError``."""
    from fedudp.models import validate as model_check
    from fedudp.owner import independence, per_sample

    model_check.probe(m, shape, classes, tokens, per_record=not builtin_model(m))
    names = tuple(n for n, _ in m.named_parameters() if per_sample.supported(m, (n,)))
    if names:
        x, y = model_check.example_batch(shape, classes, tokens, next(m.parameters()).dtype)
        try:
            per_sample.per_record_gradients(m, dict(m.named_parameters()), x, y, names)
        except (NotImplementedError, RuntimeError) as e:
            raise ValueError(
                f"model fails in DP-SGD's one-pass per-record gradients "
                f"(fedudp.owner.per_sample): {' '.join(str(e).split())}; give a "
                "layer applied more than once per forward its own nn.Linear "
                "subclass (as char_rnn.RecurrentLinear does)"
            ) from None
    independence.check(m, shape, classes, tokens)  # per-record independence, every kernel


def method(cfg: RunConfig, net: SplitModel) -> MethodSpec:
    """The method's split, privacy and update (decided here, once)."""
    try:
        return make_method(
            Method(cfg.method).value,
            net,
            personal=tuple(cfg.model.personal),
            unit=Unit(cfg.privacy.unit).value,
            placement=placement(cfg).value,
            paper=Accounting(cfg.privacy.accounting) == Accounting.paper,
        )
    except ValueError as e:
        raise ConfigError(f"model.personal: {e}") from None


def owner_training(cfg: RunConfig) -> OwnerTraining:
    """The owner side's public hyperparameters, and each owner's public capacity for
    owner-side DP-SGD (planned users; planned records under group privacy)."""
    t = cfg.train
    records = planned_owner_records(cfg)
    capacity = records if cfg.privacy.group_privacy else planned_owner_users(cfg)
    return OwnerTraining(
        local_sgd.LocalSpec(cfg.seed, t.lr, t.batch_size, t.local_epochs),
        local_sgd.LocalSpec(cfg.seed, t.lr, t.batch_size, t.resolved_personal_epochs()),
        SharedUpdate(t.shared_update).value,
        OwnerWeights(t.owner_weights).value,
        dpsgd_records=bool(cfg.privacy.group_privacy),
        dpsgd_capacity=tuple(int(c) for c in capacity),
        public_owner_records=tuple(int(r) for r in records),
        sort_users=natural(cfg),
        secure_randomness=RandomnessMode(cfg.privacy.randomness) == RandomnessMode.secure,
    )


def device(cfg: RunConfig) -> torch.device:
    """``engine_opts.device`` (checked by ``fedudp.config.validate``): where the local engine's
    model, records and owner kernels live; the billboard, the ledger, the generators and every
    noise draw stay on the CPU (docs/architecture.md#engines)."""
    return torch.device(str(cfg.engine_opts.device))


def owners(
    cfg: RunConfig,
    hooks: OwnerHooks | None = None,
    net: SplitModel | None = None,
    spec: MethodSpec | None = None,
    records: Any = None,
) -> Owners:
    """The owner component from the config alone: the billboard process and every Flower
    owner build the same. ``hooks``: a training algorithm's (``prepare`` passes them)."""
    if cfg.engine_opts.threads:
        torch.set_num_threads(cfg.engine_opts.threads)
    net = net if net is not None else model(cfg, records)
    net.to(device(cfg))  # in place: the owners' model on engine_opts.device
    spec = spec if spec is not None else method(cfg, net)
    return Owners(
        net,
        spec,
        owner_training(cfg),
        local_sgd.chunk_budget(cfg.engine_opts.chunk_records, net),
        hooks=hooks,
    )


def federation(cfg: RunConfig, records: Any = None) -> Federation:
    """Load the configured pool and partition it over owners and users (seeded); a natural
    federation's grouped records laid out, its declared public numbers checked first."""
    d, part = cfg.dataset, cfg.partition
    if natural(cfg):
        from fedudp.data import natural as nat

        train, test = natural_records(cfg, records)
        check_public(cfg, train)
        n = int(part.num_owners)  # the declared owner count; owners without users kept
        if OwnerRule(part.owner_rule).value in ("random", "dirichlet"):
            return nat.layout(train, test, n, owner_ids=np.arange(n, dtype=np.int64))
        return nat.layout(train, test, n)
    if str(d.name) == "synthetic":
        pool = federation_mod.synthetic(
            d.features, input_spec(cfg)[1], d.pool_train, d.pool_test, d.signal, cfg.seed
        )
    else:
        pool = federation_mod.image_pool(str(d.name), d.root, d.download)
        if d.num_records > len(pool.train_y):
            raise ConfigError(
                f"dataset.num_records: {d.num_records} records asked for, but "
                f"{d.root} holds {len(pool.train_y)} {d.name!s} "
                "training records"
            )
    try:
        return federation_mod.partition_pool(
            pool,
            num_owners=part.num_owners,
            num_records=d.num_records,
            records_per_user=part.records_per_user,
            scheme=Scheme(part.scheme).value,
            classes_per_owner=part.classes_per_owner,
            dirichlet_alpha=part.dirichlet_alpha,
            test_per_owner=part.test_per_owner,
            seed=cfg.seed,
        )
    except ValueError as e:  # the data cannot be split as configured
        raise ConfigError(f"partition.scheme={Scheme(part.scheme).value}: {e}") from None


# -- the ledger -----------------------------------------------------------------------------------
def run_guarantee(spec: MethodSpec, aggregator: Aggregator | None) -> str:
    """The method's guarantee, downgraded to heuristic when the aggregator's own accounting
    follows a paper's unproven constant (``privacy.accounting=paper``)."""
    if aggregator is not None and aggregator.noise_scale != 1.0:
        return "weakened"  # audit.noise_scale: less noise than the ledger accounts
    if aggregator is not None and aggregator.guarantee == "heuristic":
        return "heuristic"
    return spec.guarantee


def ledger(cfg: RunConfig, spec: MethodSpec, aggregator: Aggregator | None) -> Ledger:
    """The run's ledger head: unit, adjacency, accounting, guarantee, what is public, what is
    released outside the guarantee."""
    p = cfg.privacy
    private = spec.private
    notes = [
        "released outside the DP guarantee (simulator observations, not covered by epsilon): "
        "the per-round diagnostics in metrics.jsonl (clipped/kept fractions, cohort sizes, "
        "failures, the estimators' scores and checks), the counts of owners, users and "
        "records in summary.json, and the evaluation accuracy and loss of every owner "
        "(metrics.jsonl, owners.csv; on engine=flower sent by the owners in evaluate "
        "replies), computed with personal parameters trained "
        + (
            "with the full-DP baseline's noise (algorithm.noise_personal)"
            if cfg.algorithm.noise_personal
            else "without noise"
        ),
        "the number of units N (hence the Poisson denominator q*N) and each owner's user "
        "count are treated as public",
        "epsilon certifies the idealized mechanism; seeded randomness is a simulation"
        if RandomnessMode(p.randomness) == RandomnessMode.seeded
        else "epsilon certifies the idealized mechanism; release noise and privacy sampling "
        "from OS entropy (privacy.randomness=secure; 64-bit seeds for torch's generators, "
        "float64 noise; floating-point attacks on the Gaussian are not addressed)",
    ]
    if spec.feedback and spec.unit == Unit.user:
        notes.append(
            "paper mode: shared vectors are computed at each owner's own personal "
            "parameters (trained without noise on all its users), which the per-user "
            "accounting ignores (docs/algorithms.md#certified-vs-paper-accounting): "
            "guarantee is heuristic"
        )
    if aggregator is not None and private:
        notes += aggregator.ledger_notes()
    if Unit(p.unit) == Unit.record:
        notes.append("records_per_user=1: each user is one record, so user level is record level")
    unit = Unit(p.unit).value if private else None
    dp_agg = aggregator if private else None  # a private method always has its estimator
    accountant = dp_agg.accountant if dp_agg is not None else None
    if (
        dp_agg is not None
        and accountant is not None
        and accountant.startswith("dp_accounting.PLDAccountant")
        and pld_too_large(dp_agg.dp_event())
    ):
        # a noise so small that its PLD would not fit: RDP accounts for it (an upper bound too)
        accountant = (
            "dp_accounting.RdpAccountant (the PLD of this noise multiplier would hold "
            f"more than {MAX_PLD_POINTS:.0e} values)"
        )
    led = Ledger(
        unit=unit,
        adjacency=dp_agg.adjacency if dp_agg is not None else None,
        accounting=Accounting(p.accounting).value if private else None,
        guarantee=run_guarantee(spec, aggregator),
        mechanism=aggregator.name if aggregator else "none",
        accountant=accountant,
        delta=p.delta if private else None,
        target_epsilon=p.epsilon if private else None,
        notes=notes,
    )
    led.extra["public"] = public_numbers(cfg)
    led.randomness = randomness(cfg).ledger_name
    return led


# -- training algorithms --------------------------------------------------------------------------
def algorithm_context(cfg: RunConfig, dim: int, personal_dim: int = 0) -> algorithms.Context:
    """The plain values a seed's training algorithm is set up from; its estimators are built
    by ``estimator`` with the run's privacy settings (``Context.estimator``)."""
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
    """The chosen training algorithm's declared requirements and its parameters' ranges."""
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
    (``algorithm.<option>``, ``train.rounds``, ``partition.records_per_user``, ...)."""
    import dataclasses

    options = {f.name for f in dataclasses.fields(algorithms.AlgorithmParams)}
    key = f"algorithm.{err.param}" if err.param in options else config_key(err.param)
    text = str(err)
    for lead in (err.param + ": ", err.param + " "):
        if text.startswith(lead):
            return ConfigError(f"{key}: {text[len(lead) :]}")
    return ConfigError(f"{key}: {text}")


# -- a whole run ----------------------------------------------------------------------------------
def check(cfg: RunConfig) -> None:
    """Every check that needs only the config: ranges, the estimator's and the algorithm's
    declared requirements, the data files' presence. ``ConfigError`` naming the key."""
    validate(cfg)
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


def check_randomness(cfg: RunConfig) -> None:
    """``privacy.randomness=secure`` covers the billboard's sample and noise and owner-side
    DP-SGD's; the seeds' training algorithms and the banded mechanism draw their own privacy
    sampling or noise from the seed (their plans), so they refuse it rather than run half
    seeded."""
    if RandomnessMode(cfg.privacy.randomness) != RandomnessMode.secure:
        return
    if str(cfg.algorithm.name) != "none":
        raise ConfigError(
            f"privacy.randomness=secure: not with a seed's training algorithm "
            f"(algorithm.name={cfg.algorithm.name!s} draws its "
            "cohorts and noise from the seed); use privacy.randomness=seeded"
        )
    if resolved_aggregator(cfg) == "dp_mf_banded":
        raise ConfigError(
            "privacy.randomness=secure: not with aggregator=dp_mf_banded (its "
            "groups' Poisson sample is drawn from the seed); use "
            "privacy.randomness=seeded or another aggregator"
        )


def randomness(cfg: RunConfig) -> Randomness:
    """The run's randomness (``privacy.randomness``): seeded by ``seed``, or secure."""
    return Randomness(int(cfg.seed), RandomnessMode(cfg.privacy.randomness).value)


@dataclass
class Prepared:
    """A validated run before its first round: the owner side, the billboard, the data."""

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


def prepare(cfg: RunConfig, *, model_object: Any = None, records: Any = None) -> Prepared:
    """Everything that needs only the config first (see the module doc), then the data. Every
    user error is a ``ConfigError`` naming the key or file. A natural federation's records are
    read (and its declared public numbers checked) right after the config's own checks: its
    input shape and its counts come from them. ``model_object``: your own module (the Python
    API, engine=local); ``records``: in-memory records (``dataset.name=memory``)."""
    check(cfg)
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
    run = settings(cfg)
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
    aggregator = algo = None
    canaries = int(cfg.audit.canaries)
    sampling = Sampling(
        cfg.train.sampling_rate, (n_owners if spec.cohort_is_owners else n_users) + canaries
    )
    if spec.communicates:
        if str(cfg.algorithm.name) != "none":
            try:
                algo = algorithms.setup(
                    str(cfg.algorithm.name),
                    algorithm_context(cfg, dim, personal_dim),
                )
            except ParameterError as err:
                raise algorithm_error(err) from None
            sampling, aggregator = algo.sampling, algo.aggregator
        else:
            aggregator = estimator(cfg, sampling, cfg.train.rounds, dim)
    check_audit(cfg, spec, aggregator)
    own = owners(cfg, algo.owner_hooks if algo is not None else None, net, spec)
    led = ledger(cfg, spec, aggregator)
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
    board = None
    if aggregator is not None:
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
        board = Billboard(  # on the CPU whatever engine_opts.device (its .cpu(): the same tensor)
            {k: params[k].detach().cpu() for k in spec.shared},
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
    fed = federation(cfg, records).to(own.dtype, own.device)
    # the plan's public n: a planned federation has exactly it; a natural one the declared
    # owner count, and at most the declared users (the others are absent: zero contributions)
    if fed.num_owners != n_owners or (
        fed.num_users > n_users if natural(cfg) else fed.num_users != n_users
    ):
        raise RuntimeError(
            f"partition gave {fed.num_owners} owners / {fed.num_users} users, "
            f"planned {n_owners} / {n_users}"
        )
    return Prepared(cfg, run, own, aggregator, led, board, fed, algo)


AUDITABLE = ("gaussian", "gaussian_adaptive")


def check_audit(cfg: RunConfig, spec: MethodSpec, aggregator: Aggregator | None) -> None:
    """``audit.canaries`` and ``audit.noise_scale`` need clip + Gaussian on the billboard."""
    for key, on in (
        ("audit.canaries", cfg.audit.canaries != 0),
        ("audit.noise_scale", cfg.audit.noise_scale != 1.0),
    ):
        if not on:
            continue
        name = aggregator.name if aggregator is not None else "none"
        if not spec.private or name not in AUDITABLE or placement(cfg) != Placement.server:
            raise ConfigError(
                f"{key}: works with clip + Gaussian on the billboard (method=full_dp "
                f"or joint_dp, aggregator=gaussian or privacy.clip_policy=adaptive, "
                f"privacy.placement=server), not method={cfg.method.value} "
                f"aggregator={name}"
            )
        if str(cfg.algorithm.name) != "none":
            raise ConfigError(
                f"{key}: not with a seed's training algorithm (algorithm.name={cfg.algorithm.name})"
            )


def warn_min_users(aggregator: Aggregator | None) -> dict:
    """An unmet theoretical minimum number of users for the estimator's utility guarantee: a
    warning (privacy holds for any n) and the summary's fields."""
    need = aggregator.min_users_required if aggregator is not None else None
    if need is None or aggregator is None:
        return {}
    n = aggregator.sampling.population
    if n < need:
        warnings.warn(
            f"aggregator={aggregator.name}: n={n} units is below the theoretical "
            f"minimum {need} for its utility guarantee (privacy still holds)",
            stacklevel=1,  # (the default: the warning names this line)
        )
    return {"min_users_met": bool(n >= need), "min_users_required": int(need), "units": int(n)}
