"""The federation: a natural one's records read once, checked against the declared inputs and
public numbers and grouped into owners (docs/your-data.md); a planned one's pool partitioned."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal, cast

import numpy as np
import torch

from fedudp.build.plan import declares_inputs, input_spec, natural, read_request, reader
from fedudp.config import ConfigError, DataError, OwnerRule, RunConfig, Scheme, jsonable
from fedudp.data import federation as federation_mod
from fedudp.data.federation import Federation
from fedudp.data.records import Records, group_users
from fedudp.data.row_reads import RowReader, read_npz_plan, read_parquet_plan

__all__ = [
    "natural_records",
    "declared_inputs",
    "natural_numbers",
    "check_public",
    "federation",
]

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
    (``dataset.name=memory``: a ``Records`` or a (train, test) pair).

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``dataset.*``, ``partition.*``).
    given : Records or tuple of Records or None
        In-memory records (``dataset.name=memory`` only).

    Returns
    -------
    tuple of (Records, Records or None)
        The grouped training records (private data) and the test records.

    Raises
    ------
    ConfigError
        memory without records, records with another reader, a missing declaration or a
        grouping that fails (a ``DataError`` for data that disagrees with the declaration).
    """
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
    declared class count (in-memory records' own ``classes`` is replaced).

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``dataset.*``).
    train, test : Records, Records or None
        The records read (private data).

    Returns
    -------
    tuple of (Records, Records or None)
        The same records with the declared class count.

    Raises
    ------
    ConfigError
        A missing declaration, a wrong shape or feature type; ``DataError``: a label
        outside [0, classes).
    """
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
    largest user (records).

    Parameters
    ----------
    train : Records
        The grouped training records (every user has an owner).

    Returns
    -------
    dict
        ``users``, ``owners``, ``owner_capacity`` and ``records_per_user`` (private counts).
    """
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
    data's value; data exceeding one is one line naming the key.

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``public.*``, ``partition.num_owners``).
    train : Records
        The grouped training records.

    Raises
    ------
    ConfigError
        A missing declaration, or data exceeding a declared bound.
    """
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


def federation(cfg: RunConfig, records: Any = None, owners: range | None = None) -> Federation:
    """Load the configured pool and partition it over owners and users (seeded); a natural
    federation's grouped records laid out, its declared public numbers checked first.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    records : Any, default None
        In-memory records (``dataset.name=memory``).
    owners : range or None, default None
        A block of owners (a Flower SuperNode's, ``engine_opts.owners_per_node``): the public
        plan is made as for the whole federation, and only the block's records are read where
        the format allows (npz, Parquet: by row, see "A block of owners" below); equal to the whole federation's
        ``block(owners.start, owners.stop)``.

    Returns
    -------
    Federation
        Every owner's training and test records (private data), or the block's.

    Raises
    ------
    ConfigError
        ``natural_records``' and ``check_public``'s errors, more records asked for than the
        data set holds, or a partition that cannot be made.
    """
    d, part = cfg.dataset, cfg.partition
    if natural(cfg) and owners is not None:
        return _natural_block(cfg, records, owners)
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
            owners=owners,
        )
    except ValueError as e:  # the data cannot be split as configured
        raise ConfigError(f"partition.scheme={Scheme(part.scheme).value}: {e}") from None


# -- a block of owners (a Flower SuperNode's, engine_opts.owners_per_node) ----------------------
# The public plan (which users go to which owner) is made as for the whole federation; the
# block's federation is the whole one's ``block(a, b)``, exactly. npz and Parquet plan from the
# labels, users, owners and metadata only (``fedudp.data.row_reads``: every record's index
# stands in for its features) and then read the block's features by row; the other formats
# read every record and keep the block's (docs/engines.md, "Multi-node").


def _natural_block(cfg: RunConfig, records: Any, owners: range) -> Federation:
    """The block ``owners`` of a natural federation.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    records : Any
        In-memory records (``dataset.name=memory``), or None.
    owners : range
        The block's owners.

    Returns
    -------
    Federation
        Equal to the whole federation's ``block(owners.start, owners.stop)``.
    """
    if str(cfg.dataset.name) in ("npz", "parquet") and records is None:
        return _columnar_block(cfg, owners)
    return _whole_then_block(cfg, records, owners)


def _whole_then_block(cfg: RunConfig, records: Any, owners: range) -> Federation:
    """A format that cannot be read by row (LEAF's JSON, HF, CIFAR's batches, in-memory
    records): every record read, the block's kept (not cached: the rest is freed)."""
    if records is not None or str(cfg.dataset.name) == "memory":
        train, test = natural_records(cfg, records)
    else:
        train, test = _group(cfg, *declared_inputs(cfg, *_read_natural(cfg)))
    check_public(cfg, train)
    return _layout(cfg, train, test).block(owners.start, owners.stop)


def _layout(cfg: RunConfig, train: Records, test: Records | None) -> Federation:
    """``fedudp.build.data.federation``'s layout of grouped records (the declared owners)."""
    from fedudp.data import natural as nat

    n = int(cfg.partition.num_owners)
    if OwnerRule(cfg.partition.owner_rule).value in ("random", "dirichlet"):
        return nat.layout(train, test, n, owner_ids=np.arange(n, dtype=np.int64))
    return nat.layout(train, test, n)


def _columnar_block(cfg: RunConfig, owners: range) -> Federation:
    """The block of an npz or Parquet federation: planned from the record indices, features
    by row."""
    req = read_request(cfg)
    npz = str(cfg.dataset.name) == "npz"
    if not req.path or (npz and not isinstance(req.features, str)):
        return _whole_then_block(cfg, None, owners)

    def plan(path: str) -> tuple[Records, RowReader]:
        read: Callable[..., tuple[Records, RowReader]] = read_npz_plan if npz else read_parquet_plan
        return read(
            path,
            features=str(req.features) if npz else req.features,
            label=req.label,
            user=req.user,
            owner=req.owner,
            meta=tuple(req.meta),
            classes=req.classes,
        )

    train, rows = plan(req.path)
    test, test_rows = plan(req.test_path) if req.test_path else (None, None)
    classes = input_spec(cfg)[1]
    train = replace(train, classes=classes)  # the labels checked against the declaration
    test = None if test is None else replace(test, classes=classes)
    held_out = test is None  # dataset.test_fraction: test records are training-file rows
    train, test = _group(cfg, train, test)
    check_public(cfg, train)
    fed = _layout(cfg, train, test).block(owners.start, owners.stop)
    shape, _classes, tokens = input_spec(cfg)
    none = np.zeros((0, *shape), dtype=np.int64 if tokens else np.float32)  # no other's row read

    def read(src: RowReader, idx: np.ndarray) -> np.ndarray:
        return src.rows(idx) if len(idx) else none

    x = read(rows, fed.x.numpy())
    x_test = read(rows if held_out or test_rows is None else test_rows, fed.x_test.numpy())
    # the declared shape and feature type, on the block's features (declared_inputs' checks)
    declared_inputs(cfg, _as_records(x, fed, rows.path), None)
    fed.x, fed.x_test = torch.from_numpy(x), torch.from_numpy(x_test)
    return fed


def _as_records(x: np.ndarray, fed: Federation, source: str) -> Records:
    """The block's features as records (for ``declared_inputs``' checks only)."""
    y = fed.y.numpy()
    return Records(x, y, np.zeros(len(y), dtype=np.int64), None, int(fed.num_classes), {}, source)
