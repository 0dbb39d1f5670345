"""The simulated federation: owners -> users -> records, laid out for vectorized rounds.

Records are stored owner by owner and, within an owner, user by user, so every user's
records are one contiguous slice ``x[user_offsets[u]:user_offsets[u+1]]`` and every owner's
users are ``owner_user_offsets[j]..owner_user_offsets[j+1]``. Users are data, not objects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fedudp.data import partition
from fedudp.data.idx import load_idx_dataset
from fedudp.data.readers import fixed_inputs, register
from fedudp.data.synthetic import synthetic_pool
from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "IMAGE_SHAPE",
    "IMAGE_CLASSES",
    "Federation",
    "Pool",
    "planned_owner_records",
    "planned_owner_users",
    "synthetic",
    "pixel_stats",
    "image_pool",
    "partition_pool",
]


@dataclass
class Federation:
    """The planned data set of a run: its records laid out user by user, owner by owner.

    Records of user ``u`` are ``x[user_offsets[u]:user_offsets[u + 1]]``; users of owner ``o``
    are ``owner_user_offsets[o]:owner_user_offsets[o + 1]`` (``user_owner`` names each user's
    owner). Built by ``synthetic``, ``partition_pool`` or ``fedudp.data.natural``.

    Parameters
    ----------
    x, y
        The training records' features and int64 labels, user by user.
    user_offsets
        ``[U + 1]`` offsets of each user's records in ``x``.
    user_owner
        ``[U]`` the owner of each user.
    owner_user_offsets
        ``[O + 1]`` offsets of each owner's users.
    x_test, y_test
        The test records, owner by owner.
    test_offsets
        ``[O + 1]`` offsets of each owner's test records.
    num_classes
        The number of classes.
    owner_classes
        The classes each owner was given (label-skewed partitions), or None.
    owner_ids
        The global id of each owner here (None: ``0..O-1``).
    user_ids
        A stable identity per user (the pool index of its first record), which keys the user's
        own randomness and does not move when another user is added or removed (None:
        ``0..U-1``).
    """

    x: torch.Tensor
    y: torch.Tensor
    user_offsets: np.ndarray
    user_owner: np.ndarray
    owner_user_offsets: np.ndarray
    x_test: torch.Tensor
    y_test: torch.Tensor
    test_offsets: np.ndarray
    num_classes: int
    owner_classes: list[np.ndarray] | None
    # global id of each owner here (None given: 0..n-1). Typed as the array it is once
    # constructed: __post_init__ replaces a None, so readers never see one
    owner_ids: np.ndarray = None  # type: ignore[assignment]
    # a stable identity per user (the pool index of its first record): it keys the user's own
    # randomness, and does not move when another user is added or removed (None given: 0..U-1)
    user_ids: np.ndarray = None  # type: ignore[assignment]  # as owner_ids: set in __post_init__

    def __post_init__(self) -> None:
        if self.owner_ids is None:
            self.owner_ids = np.arange(self.num_owners, dtype=np.int64)
        if self.user_ids is None:
            self.user_ids = np.arange(self.num_users, dtype=np.int64)

    @property
    def num_owners(self) -> int:
        return len(self.owner_user_offsets) - 1

    @property
    def num_users(self) -> int:
        return len(self.user_owner)

    @property
    def num_records(self) -> int:
        return int(self.x.shape[0])

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x.shape[1:])

    @property
    def owner_offsets(self) -> np.ndarray:
        return self.user_offsets[self.owner_user_offsets]

    def user_sizes(self) -> np.ndarray:
        return np.diff(self.user_offsets)

    def owner_sizes(self) -> np.ndarray:
        return np.diff(self.owner_offsets)

    def present(self, cohort: np.ndarray, owners: bool = False) -> np.ndarray:
        """The sampled units of ``cohort`` (indices into the public population, which may
        declare more users than the data holds) that exist here: users below ``num_users``
        (``owners``: below ``num_owners``). An absent unit contributes nothing, as a removed
        user does."""
        cohort = np.asarray(cohort)
        return cohort[cohort < (self.num_owners if owners else self.num_users)]

    def owner(self, j: int) -> Federation:
        """Owner ``j``'s shard as a one-owner federation (what a Flower ClientApp holds)."""
        u0, u1 = self.owner_user_offsets[j], self.owner_user_offsets[j + 1]
        r0, r1 = self.user_offsets[u0], self.user_offsets[u1]
        t0, t1 = self.test_offsets[j], self.test_offsets[j + 1]
        return Federation(
            x=self.x[r0:r1],
            y=self.y[r0:r1],
            user_offsets=self.user_offsets[u0 : u1 + 1] - r0,
            user_owner=np.zeros(u1 - u0, dtype=np.int64),
            owner_user_offsets=np.array([0, u1 - u0], dtype=np.int64),
            x_test=self.x_test[t0:t1],
            y_test=self.y_test[t0:t1],
            test_offsets=np.array([0, t1 - t0], dtype=np.int64),
            num_classes=self.num_classes,
            owner_classes=None if self.owner_classes is None else [self.owner_classes[j]],
            owner_ids=self.owner_ids[j : j + 1].copy(),
            user_ids=self.user_ids[u0:u1].copy(),
        )

    def block(self, a: int, b: int) -> Federation:
        """Owners ``a..b-1`` as a federation of their own (what a Flower SuperNode holding a
        block of owners computes; ``block(j, j + 1)`` is ``owner(j)``).

        Parameters
        ----------
        a, b : int
            The block's first owner and one past its last (``0 <= a < b <= num_owners``).

        Returns
        -------
        Federation
            Their records, users and test records in the same order, their global owner ids
            and their users' stable ids.
        """
        u0, u1 = int(self.owner_user_offsets[a]), int(self.owner_user_offsets[b])
        r0, r1 = int(self.user_offsets[u0]), int(self.user_offsets[u1])
        t0, t1 = int(self.test_offsets[a]), int(self.test_offsets[b])
        return Federation(
            x=self.x[r0:r1],
            y=self.y[r0:r1],
            user_offsets=self.user_offsets[u0 : u1 + 1] - r0,
            user_owner=self.user_owner[u0:u1] - a,
            owner_user_offsets=self.owner_user_offsets[a : b + 1] - u0,
            x_test=self.x_test[t0:t1],
            y_test=self.y_test[t0:t1],
            test_offsets=self.test_offsets[a : b + 1] - t0,
            num_classes=self.num_classes,
            owner_classes=None if self.owner_classes is None else self.owner_classes[a:b],
            owner_ids=self.owner_ids[a:b].copy(),
            user_ids=self.user_ids[u0:u1].copy(),
        )

    def without_user(self, u: int) -> Federation:
        """The neighbouring federation without user ``u`` (its records removed; every other user
        keeps its records, owner and identity): add/remove-one-user adjacency."""
        r0, r1 = int(self.user_offsets[u]), int(self.user_offsets[u + 1])
        keep = np.r_[0:r0, r1 : self.num_records]
        offs = np.delete(self.user_offsets, u + 1)
        offs[u + 1 :] -= r1 - r0
        owner = int(self.user_owner[u])
        ou = self.owner_user_offsets.copy()
        ou[owner + 1 :] -= 1
        return Federation(
            self.x[keep],
            self.y[keep],
            offs,
            np.delete(self.user_owner, u),
            ou,
            self.x_test,
            self.y_test,
            self.test_offsets,
            self.num_classes,
            self.owner_classes,
            self.owner_ids.copy(),
            np.delete(self.user_ids, u),
        )

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> Federation:
        """Floating features in ``dtype`` (the model's), in place; integer features (token ids)
        stay integers. ``device``: the record tensors moved there too (``engine_opts.device``,
        engine=local; the offsets stay numpy). Returns self."""
        if self.x.is_floating_point():
            self.x, self.x_test = self.x.to(dtype), self.x_test.to(dtype)
        if device is not None:
            self.x, self.y = self.x.to(device), self.y.to(device)
            self.x_test, self.y_test = self.x_test.to(device), self.y_test.to(device)
        return self


# the image data sets' (MNIST, Fashion-MNIST) input shape and classes, known before loading
IMAGE_SHAPE = (1, 28, 28)
IMAGE_CLASSES = 10


@dataclass(frozen=True)
class Pool:
    """Training and test records a federation is cut from (features, int64 labels).

    Attributes
    ----------
    train_x, test_x : numpy.ndarray
        Training and test features (private data), or uint8 images ``[N, rows, cols]``.
    train_y, test_y : numpy.ndarray
        Their int64 labels ``[N]``.
    classes : int
        The number of classes.
    levels : numpy.ndarray or None
        Byte images: ``levels[v]`` is the float32 feature of pixel value v.
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    classes: int
    # byte images (``image_pool``): ``train_x``/``test_x`` stay uint8 [N, rows, cols] and
    # ``levels[v]`` is the float32 feature of pixel value v; None: the x arrays are the features
    levels: np.ndarray | None = None

    def features(self, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """The features of records ``idx`` of ``x`` (``train_x`` or ``test_x``). Byte images are
        converted here, only the records a run uses: ``levels`` looked up, a channel dim added."""
        if self.levels is None:
            return np.ascontiguousarray(x[idx])
        # indexed as the whole standardized pool was before (``levels[x][:, None][idx]``): the
        # same values and the same strides (4 bytes on the one-wide channel dim). torch picks
        # its convolution kernels by strides, and another layout of the same values (the view's
        # stride 0, say) changes the float rounding of every round after
        images = self.levels[x[idx]][:, None]
        return images[np.arange(len(images))]


def planned_owner_records(num_records: int, num_owners: int) -> np.ndarray:
    """Each owner's record count, known before loading the data.

    Parameters
    ----------
    num_records
        The records to partition (N).
    num_owners
        The owners (n).

    Returns
    -------
    numpy.ndarray
        floor/ceil(N/n) per owner.
    """
    return partition.owner_sizes(num_records, num_owners)


def planned_owner_users(num_records: int, num_owners: int, records_per_user: int) -> np.ndarray:
    """Each owner's user count, known before loading the data: owner sizes are floor/ceil(N/n)
    for every scheme, and owners are cut into users of ``records_per_user``.

    Parameters
    ----------
    num_records
        The records to partition (N).
    num_owners
        The owners (n).
    records_per_user
        The records of each user.

    Returns
    -------
    numpy.ndarray
        The users of each owner.
    """
    return -(-partition.owner_sizes(num_records, num_owners) // records_per_user)


def synthetic(
    features: int, classes: int, pool_train: int, pool_test: int, signal: float, seed: int
) -> Pool:
    """The seeded synthetic pool (``fedudp.data.synthetic``).

    Parameters
    ----------
    features, classes
        The features per record and the classes.
    pool_train, pool_test
        The pool's training and test records.
    signal
        How separable the classes are.
    seed
        The pool's seed.

    Returns
    -------
    Pool
        The pool.
    """
    tx, ty, vx, vy = synthetic_pool(features, classes, pool_train, pool_test, signal, seed)
    return Pool(tx, ty, vx, vy, int(classes))


def _pairwise_sum(part: Callable[[int, int], np.ndarray], start: int, n: int) -> np.float64:
    """numpy's float64 sum of ``part(start, n)`` over ``[start, start + n)`` in numpy's own order:
    ``np.add.reduce`` on a contiguous array is one pairwise sum that halves ``n`` (rounded down
    to a multiple of 8) down to blocks of 128, so summing the halves of that tree separately,
    each below 2**16 elements by numpy itself, gives the whole array's sum bit for bit."""
    if n <= 1 << 16:
        return np.add.reduce(part(start, n))
    half = n // 2
    half -= half % 8
    return _pairwise_sum(part, start, half) + _pairwise_sum(part, start + half, n - half)


def pixel_stats(images: np.ndarray) -> tuple[np.float64, np.float64]:
    """``(images.mean(), images.std())`` of a uint8 array, bit for bit, without numpy's float64
    copy of the whole array: the sum of bytes is an exact integer (as it is in numpy's float64
    sum, below 2**53), and the squared deviations, one per byte value, are summed in numpy's
    pairwise order a block at a time (``_pairwise_sum``).

    Parameters
    ----------
    images : numpy.ndarray
        A uint8 array, any shape.

    Returns
    -------
    tuple of numpy.float64
        The mean and standard deviation of its values.

    Raises
    ------
    TypeError
        ``images`` is not uint8.
    ValueError
        The sum of its values reaches 2**53.
    """
    if images.dtype != np.uint8:
        raise TypeError(f"pixel_stats needs uint8 images, got {images.dtype}")
    flat = images.reshape(-1)
    n = np.intp(flat.size)
    step = 1 << 20
    total = sum(
        int(np.bincount(flat[i : i + step], minlength=256) @ np.arange(256, dtype=np.int64))
        for i in range(0, len(flat), step)
    )
    if total >= 2**53:  # numpy's float64 sum would round; this path would not match it
        raise ValueError("pixel_stats: more pixels than a float64 sum holds exactly")
    mean = np.float64(total) / n
    sq = np.square(np.arange(256, dtype=np.float64) - mean)  # numpy's (x - mean) ** 2 per byte
    dev = _pairwise_sum(lambda i, m: sq[flat[i : i + m]], 0, len(flat))
    return mean, np.sqrt(dev / n)


def image_pool(name: str, root: str, download: bool = False) -> Pool:
    """MNIST or Fashion-MNIST from IDX files under ``root``: scaled to [0, 1], standardized with
    the training pool's statistics, a channel dimension added (``Pool.features``).

    Parameters
    ----------
    name
        ``"mnist"`` or ``"fashion_mnist"``.
    root
        The folder of the IDX files (``load_idx_dataset``).
    download
        Fetch missing files first.

    Returns
    -------
    Pool
        The pool.
    """
    tx, ty, vx, vy = load_idx_dataset(name, root, download)
    mean, std = pixel_stats(tx)
    mean, std = mean / 255.0, std / 255.0
    # pixels are bytes: each of the 256 values is standardized once (the same float operations
    # as on the whole array, so the same float32 results) and only the records a run uses are
    # looked up (Pool.features), instead of float copies of the 60,000-image pool
    levels = np.arange(256, dtype=np.uint8)
    table = ((levels.astype(np.float32) / 255.0 - mean) / std).astype(np.float32)
    return Pool(tx, ty.astype(np.int64), vx, vy.astype(np.int64), IMAGE_CLASSES, levels=table)


def partition_pool(
    pool: Pool,
    *,
    num_owners: int,
    num_records: int,
    records_per_user: int,
    scheme: str = "paper_classes",
    classes_per_owner: int = 8,
    dirichlet_alpha: float = 0.5,
    test_per_owner: int | None = None,
    seed: int = 0,
    owners: range | None = None,
) -> Federation:
    """Partition ``num_records`` of the pool over ``num_owners`` owners by ``scheme``, each owner
    cut into users of ``records_per_user`` (all seeded).

    Parameters
    ----------
    pool
        The pool (``synthetic`` or ``image_pool``).
    num_owners, num_records, records_per_user
        The owners, the records partitioned, the records of each user.
    scheme, classes_per_owner, dirichlet_alpha
        ``paper_classes`` (each owner sees ``classes_per_owner`` classes), ``iid`` or
        ``dirichlet`` (concentration ``dirichlet_alpha``); docs/algorithms.md#data-partition.
    test_per_owner, seed
        Test records per owner (None: the scheme's default); the partition's seed.
    owners : range or None, default None
        A block of owners: the whole partition is planned (from the labels), then only the
        block's records are gathered (``Federation.block`` of the whole, exactly).

    Returns
    -------
    Federation
        The federation (or the block's); a split the data cannot give is a ``ValueError``.
    """
    tx, ty, vx, vy, classes = pool.train_x, pool.train_y, pool.test_x, pool.test_y, pool.classes
    n, N = num_owners, num_records
    rng = numpy_rng(seed, Purpose.PARTITION)
    test_per = test_per_owner or max(1, len(vy) // n)
    owner_classes = None
    if scheme == "paper_classes":
        train, test, owner_classes = partition.paper_classes(
            ty, vy, N, n, classes_per_owner, classes, test_per, rng
        )
    elif scheme == "iid":
        train, test = partition.iid(len(ty), len(vy), N, n, min(test_per, len(vy) // n), rng)
    elif scheme == "dirichlet":
        train, test, _ = partition.dirichlet(ty, vy, N, n, dirichlet_alpha, classes, test_per, rng)
    else:
        raise ValueError(f"unknown scheme {scheme!r} (paper_classes, iid, dirichlet)")

    rec_idx, user_offsets, user_owner, owner_user_offsets = [], [0], [], [0]
    for j, idx in enumerate(train):
        users = partition.assign_users(len(idx), records_per_user, rng)
        order = np.argsort(users, kind="stable")
        rec_idx.append(idx[order])
        counts = np.bincount(users, minlength=users.max() + 1)
        for c in counts:
            user_offsets.append(user_offsets[-1] + int(c))
            user_owner.append(j)
        owner_user_offsets.append(len(user_owner))
    rec = np.concatenate(rec_idx)
    tst = np.concatenate(test)
    offs = np.array(user_offsets, dtype=np.int64)
    plan = Federation(  # the plan: pool indices in place of features (labels are public here)
        x=torch.from_numpy(rec),
        y=torch.from_numpy(ty[rec]),
        user_offsets=offs,
        user_owner=np.array(user_owner, dtype=np.int64),
        owner_user_offsets=np.array(owner_user_offsets, dtype=np.int64),
        x_test=torch.from_numpy(tst),
        y_test=torch.from_numpy(vy[tst]),
        test_offsets=np.concatenate([[0], np.cumsum([len(t) for t in test])]).astype(np.int64),
        num_classes=classes,
        owner_classes=owner_classes,
        user_ids=rec[offs[:-1]].astype(np.int64),
    )
    if owners is not None:  # a block of owners: only its rows are gathered
        plan = plan.block(owners.start, owners.stop)
    plan.x = torch.from_numpy(pool.features(tx, plan.x.numpy()))
    plan.x_test = torch.from_numpy(pool.features(vx, plan.x_test.numpy()))
    return plan


# the planned data sets: users and owners planned from the configuration (``partition_pool``);
# synthetic's inputs are [dataset.features] and dataset.classes (the config builder's)
register("synthetic", natural=False)
register("mnist", inputs=fixed_inputs(IMAGE_SHAPE, IMAGE_CLASSES), natural=False)
register("fashion_mnist", inputs=fixed_inputs(IMAGE_SHAPE, IMAGE_CLASSES), natural=False)
