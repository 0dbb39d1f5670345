"""The data readers, one registry (``READERS``) whose names are the config's ``dataset.name``
choices (docs/your-data.md, docs/architecture.md#how-to-add-an-extension).

Each format's module registers its reader with its format-specific rules (``register``; the
built-in formats' modules are imported by ``fedudp/data/__init__.py``, so that importing this
registry finds them):

* ``read(request)``: the (train, test) ``Records`` of a federation read from data, from a
  ``ReadRequest`` of plain values (the file or folder, the column names, the users' rule, the
  seed); users come from the data (or, for a format without users, from ``request.user_rule``);
* ``inputs(request)``: the (input shape, classes, token ids) the format declares for itself,
  public, never read from the data; None: the configuration declares them
  (``dataset.input_shape``, ``dataset.classes``, ``dataset.tokens``);
* ``test_without_users``: the test records belong to no user (CIFAR's test batch): each is its
  own user, dealt evenly over the owners;
* ``natural``: False for the planned data sets (synthetic, mnist, fashion_mnist), whose users
  and owners the configuration plans; those are built by ``fedudp.data.federation``.

Reading fails with a one-line ``DataError`` (or ``ConfigError``) naming the file or the key.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fedudp.data.records import Records
from fedudp.registry import Registry

__all__ = ["DataReader", "ReadRequest", "READERS", "register", "UNDECLARED", "fixed_inputs"]

# records are read with this class bound where the configuration declares the classes: the
# config builder then checks the labels against dataset.classes (or says what the data holds)
UNDECLARED = 2**62


@dataclass(frozen=True)
class ReadRequest:
    """What a reader reads with (the configuration's ``dataset.*`` and ``partition.*`` as plain
    values, given by the config builder).

    Attributes
    ----------
    name : str
        ``dataset.name``.
    path, test_path : str or None
        Training and test file (npz, parquet) or folder (hf).
    root : str
        The folder of femnist, shakespeare, cifar10 / cifar100.
    split, test_split : str, str or None
        The training and test splits' names.
    features, label, user, owner, meta : str, tuple of str or None
        ``dataset.columns.*``: the column names.
    classes : int
        ``dataset.classes``; ``UNDECLARED`` where the configuration declares none.
    coarse : bool
        cifar100: the 20 coarse labels.
    unknown_char : str or None
        shakespeare: the character that stands for unknown ones.
    user_rule, records_per_user, dirichlet_alpha, seed
        ``partition.*``: how users are formed for a format without users.
    """

    name: str  # dataset.name
    path: str | None = None  # a file (npz, parquet) or a folder (hf)
    test_path: str | None = None
    root: str = "data"  # a folder (femnist, shakespeare, cifar10 / cifar100)
    split: str = "train"
    test_split: str | None = "test"
    features: str | tuple[str, ...] = "x"  # dataset.columns.*
    label: str = "y"
    user: str = "user"
    owner: str | None = None
    meta: tuple[str, ...] = ()
    classes: int = UNDECLARED
    coarse: bool = False  # cifar100: the 20 coarse labels
    unknown_char: str | None = None  # shakespeare
    user_rule: str = "shuffle"  # a format without users: partition.user_rule
    records_per_user: int = 1
    dirichlet_alpha: float = 0.5
    seed: int = 0


Inputs = tuple[tuple[int, ...], int, bool]


@dataclass(frozen=True)
class DataReader:
    """A registered data reader (module doc).

    Attributes
    ----------
    name : str
        ``dataset.name``.
    read : callable or None
        ``ReadRequest`` in, (train ``Records``, test ``Records`` or None) out.
    inputs : callable or None
        The input shape, classes and whether inputs are tokens, from the request alone.
    test_without_users, natural : bool
        Its test records carry no users; its records come with natural users.
    """

    name: str
    read: Callable[[ReadRequest], tuple[Records, Records | None]] | None = None
    inputs: Callable[[ReadRequest], Inputs] | None = None
    test_without_users: bool = False
    natural: bool = True


READERS: Registry[DataReader] = Registry("data reader", "dataset.name")


def register(
    name: str,
    read: Callable[[ReadRequest], tuple[Records, Records | None]] | None = None,
    *,
    inputs: Callable[[ReadRequest], Inputs] | None = None,
    test_without_users: bool = False,
    natural: bool = True,
) -> DataReader:
    """Register a reader as ``dataset.name=<name>`` (one call in its module).

    Parameters
    ----------
    name
        The reader's name (an identifier).
    read
        The reader: a ``ReadRequest`` in, (train ``Records``, test ``Records`` or None) out.
    inputs
        What the reader declares before reading (input shape, classes), from the request alone.
    test_without_users
        Its test records carry no users.
    natural
        Its records come with natural users (not formed by ``partition.*``).

    Returns
    -------
    DataReader
        The registered reader.

    Raises
    ------
    ValueError
        A name that is not an identifier, or one registered with another reader.
    """
    return READERS.add(name, DataReader(name, read, inputs, test_without_users, natural))


def fixed_inputs(
    shape: tuple[int, ...], classes: int, tokens: bool = False
) -> Callable[[ReadRequest], Inputs]:
    """``inputs`` for a format that always has the same input shape and classes.

    Parameters
    ----------
    shape : tuple of int
        The input shape of one record.
    classes : int
        The number of classes.
    tokens : bool, default False
        The inputs are token ids.

    Returns
    -------
    callable
        A ``ReadRequest`` in, ``(shape, classes, tokens)`` out, whatever the request.
    """
    return lambda request: (tuple(shape), int(classes), bool(tokens))


# records handed to fedudp.simulate(records=...): no reader, the inputs declared in the config
register("memory")
