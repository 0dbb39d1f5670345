"""The public plan: counts and shapes known before any data is read (planned from the config,
or declared under ``public.*`` for a federation read from data)."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from fedudp.config import ConfigError, RunConfig, Unit, UserRule
from fedudp.data import federation as federation_mod
from fedudp.data.readers import READERS, DataReader, ReadRequest
from fedudp.plugins import load as load_plugins

__all__ = [
    "reader",
    "read_request",
    "natural",
    "declared",
    "planned_owner_records",
    "planned_owner_users",
    "planned_units",
    "planned_shape",
    "declares_inputs",
    "input_spec",
    "records_per_unit",
    "public_numbers",
    "check_planned_public",
]


# -- the public plan: counts known before any data is read ----------------------------------------
def reader(cfg: RunConfig) -> DataReader:
    """The registered data reader of ``dataset.name`` (``fedudp.data.readers.READERS``).

    Parameters
    ----------
    cfg : RunConfig
        The configuration (its ``plugins`` are loaded first).

    Returns
    -------
    DataReader
        The reader.

    Raises
    ------
    ConfigError
        No reader of that name is registered.
    """
    load_plugins(cfg.plugins)
    name = str(cfg.dataset.name)
    if name not in READERS:
        raise ConfigError(READERS.unknown(name))
    return READERS[name]


def read_request(cfg: RunConfig) -> ReadRequest:
    """The reader's plain values from ``dataset.*``, ``partition.*`` and the seed.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    ReadRequest
        Paths, splits, column names, the user rule and the seed.
    """
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
    """Whether the users (and owner sizes) come from the data (docs/your-data.md).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    bool
        The reader's ``natural``.

    Raises
    ------
    ConfigError
        An unknown ``dataset.name`` (``reader``).
    """
    return reader(cfg).natural


def declared(cfg: RunConfig, key: str) -> int:
    """A natural federation's declared public number ``public.<key>`` (``ConfigError`` if not
    declared; ``prepare`` first reads the data so that its message gives the data's value).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    key : str
        ``users``, ``owner_capacity`` or ``records_per_user``.

    Returns
    -------
    int
        The declared value.

    Raises
    ------
    ConfigError
        ``public.<key>`` is null.
    """
    v = getattr(cfg.public, key)
    if v is None:
        raise ConfigError(
            f"public.{key}: a federation read from data needs it declared "
            "(docs/your-data.md#public-numbers)"
        )
    return int(v)


def planned_owner_records(cfg: RunConfig) -> np.ndarray:
    """Each owner's public record count: floor/ceil(N/n) planned; for a natural federation
    the declared capacity times the declared records per user (an upper bound).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    numpy.ndarray
        ``[owners]`` int64 record counts.

    Raises
    ------
    ConfigError
        A natural federation's undeclared ``public.*`` (``declared``).
    """
    if natural(cfg):
        return np.full(
            cfg.partition.num_owners,
            declared(cfg, "owner_capacity") * declared(cfg, "records_per_user"),
            dtype=np.int64,
        )
    return federation_mod.planned_owner_records(cfg.dataset.num_records, cfg.partition.num_owners)


def planned_owner_users(cfg: RunConfig) -> np.ndarray:
    """Each owner's public user count: its records cut into users of records_per_user planned;
    for a natural federation the declared capacity ``public.owner_capacity``.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    numpy.ndarray
        ``[owners]`` int64 user counts.

    Raises
    ------
    ConfigError
        A natural federation's undeclared ``public.owner_capacity``.
    """
    if natural(cfg):
        return np.full(cfg.partition.num_owners, declared(cfg, "owner_capacity"), dtype=np.int64)
    return federation_mod.planned_owner_users(
        cfg.dataset.num_records, cfg.partition.num_owners, cfg.partition.records_per_user
    )


def planned_units(cfg: RunConfig) -> tuple[int, int]:
    """(owners, users) of the federation: planned, or declared (``public.users``).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    tuple of (int, int)
        The number of owners and of users.

    Raises
    ------
    ConfigError
        A natural federation's undeclared ``public.users``.
    """
    if natural(cfg):
        return int(cfg.partition.num_owners), declared(cfg, "users")
    users = planned_owner_users(cfg)
    return len(users), int(users.sum())


def planned_shape(cfg: RunConfig, records: Any = None) -> tuple[tuple[int, ...], int]:
    """(input shape, classes) of the configured dataset: public, known before any data is read
    (``input_spec``).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    records : Any, default None
        Accepted, not read.

    Returns
    -------
    tuple of (tuple of int, int)
        Each record's feature shape and the number of classes.

    Raises
    ------
    ConfigError
        As ``input_spec``.
    """
    return input_spec(cfg, records)[:2]


SYNTHETIC_CLASSES = 10  # dataset.classes=null on the synthetic data set


def declares_inputs(cfg: RunConfig) -> bool:
    """Whether the configuration declares the inputs (``dataset.classes``,
    ``dataset.input_shape``, ``dataset.tokens``): a reader with no ``inputs`` of its own (npz,
    parquet, hf, memory, most plugins).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    bool
        True where the reader declares no inputs of its own (never for synthetic).
    """
    return str(cfg.dataset.name) != "synthetic" and reader(cfg).inputs is None


def input_spec(cfg: RunConfig, records: Any = None) -> tuple[tuple[int, ...], int, bool]:
    """(input shape, classes, whether the inputs are token ids): public, never read from the
    data. A reader with ``inputs`` declares its own (synthetic: [features] and
    ``dataset.classes``, 10 when null); the others take ``dataset.input_shape``,
    ``dataset.classes`` and ``dataset.tokens`` (``ConfigError`` when one is missing;
    ``prepare`` first reads the data so that the message gives its value). ``records`` is
    accepted for callers that pass them and is not read.

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``dataset.*``).
    records : Any, default None
        Accepted, not read.

    Returns
    -------
    tuple of (tuple of int, int, bool)
        Each record's feature shape, the number of classes, whether the features are tokens.

    Raises
    ------
    ConfigError
        A declared value other than the reader's own, or a missing declaration.
    """
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
    owner capacity at owner level).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    int
        m, at least 1.

    Raises
    ------
    ConfigError
        A natural federation's undeclared ``public.*``.
    """
    if natural(cfg):
        m = declared(cfg, "records_per_user")
        return m * declared(cfg, "owner_capacity") if Unit(cfg.privacy.unit) == Unit.owner else m
    if Unit(cfg.privacy.unit) == Unit.owner:
        return max(1, cfg.dataset.num_records // max(1, cfg.partition.num_owners))
    return int(cfg.partition.records_per_user)


def public_numbers(cfg: RunConfig) -> dict:
    """The numbers the accountant treats as public, and where they come from (the ledger):
    the populations (upper bounds for a natural federation) and the model's input shape and
    classes (``input_spec``).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    dict
        ``users``, ``owners``, ``owner_capacity``, ``records_per_user``, ``classes``,
        ``input_shape``, ``tokens`` and ``source`` (where they come from).

    Raises
    ------
    ConfigError
        An undeclared public number or input (natural federations).
    """
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
    """A planned federation's ``public.*``, where set, must be the plan's.

    Parameters
    ----------
    cfg : RunConfig
        The configuration (nothing is checked for a natural federation).

    Raises
    ------
    ConfigError
        A declared ``public.*`` value other than the plan's.
    """
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
