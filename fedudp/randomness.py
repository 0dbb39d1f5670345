"""Every random stream of a run, keyed by (run seed, purpose, ...)
(docs/architecture.md#randomness).

A stream depends only on the run seed, its purpose and its public keys (round, epoch, owner),
never on the engine, chunking or scheduling order. The purposes are listed here once, each with
its keys (``KEYS``): one fixed number of keys per purpose, checked by ``numpy_rng`` and
``torch_generator``.

Why fixed: a stream's seed is numpy's ``SeedSequence([seed, purpose, *keys])``, which pads an
entropy list shorter than its 4-word pool with zeros, so ``[0, 12, 1]`` and ``[0, 12, 1, 0]`` are
the same stream. With one key count per purpose and every value one 32-bit word (0 <= value <
2**32; a larger int would become several words), two calls of one purpose with different keys
always give different entropy lists of the same length, and two purposes differ in their second
word.

Seeded or secure (``Randomness``): a seeded stream is a function of the run seed, which is public
wherever a message or a config carries it (a Flower run config, a client's ConfigRecord, a
published ``config.yaml``), so whoever knows the seed can regenerate the noise and the sample and
remove them from a release: right for a reproducible simulation, wrong for a deployment.
``Randomness.secure(seed)`` draws every PROTECTING purpose (release noise and privacy sampling,
``PROTECTING``) from fresh OS entropy instead (``secrets.randbits``: 128 bits per numpy stream,
64 per torch generator, the most ``torch.Generator.manual_seed`` takes), never from the seed, keys
or anything a message carries; the other purposes (record orders, partition, schedules, canary
directions, ...) stay seeded and reproducible. The key counts are checked in both modes.
"""

from __future__ import annotations

import secrets
from enum import IntEnum

import numpy as np
import torch

__all__ = [
    "Purpose",
    "KEYS",
    "PROTECTING",
    "entropy",
    "numpy_rng",
    "torch_generator",
    "secure_numpy_rng",
    "secure_torch_generator",
    "Randomness",
]


class Purpose(IntEnum):
    """What a stream is for: the second word of its key (``entropy``).

    Attributes
    ----------
    USER_ORDER, PERSONAL_ORDER, OWNER_ORDER : int
        Record orders: a user's in local SGD, an owner's personal update's, standard FedAvg's.
    DPSGD_SAMPLE, DPSGD_NOISE, DPSGD_COUNT_NOISE : int
        An owner's DP-SGD step: its Poisson sample of users, its noise, its count's noise.
    SAMPLE, NOISE : int
        The billboard's Poisson sample of units and its release noise.
    SMOOTHING, SCHEDULE, PERSONAL_NOISE : int
        Alg. 3's smoothing, an algorithm's public schedule, Alg. 1's personal-block noise.
    CANARY, CANARY_SAMPLE : int
        A canary's fixed direction; the billboard's sample of the canaries.
    ROTATION, ROUNDING, SHARE_NOISE, DROPOUT, MASKS : int
        The distributed mechanisms' public rotation, a user's stochastic rounding, an owner's
        integer noise share, the simulated owner dropouts, the owners' mask secret (seeded).
    USER_SAMPLE : int
        An owner's Poisson coin for one of its users under a distributed mechanism (the
        billboard does not sample there).
    SYNTHETIC_TEACHER, PARTITION : int
        The synthetic dataset's teacher; the owners' classes, record split and users.
    """

    USER_ORDER = 1  # a user's record order in local SGD (shared vectors)
    PERSONAL_ORDER = 2  # an owner's record order in its personal update
    OWNER_ORDER = 3  # an owner's record order in standard FedAvg (all its records)
    DPSGD_SAMPLE = 4  # an owner's Poisson sample of its users at one DP-SGD step
    DPSGD_NOISE = 5  # an owner's Gaussian noise at one DP-SGD step
    SAMPLE = 11  # the billboard's Poisson sample of units
    NOISE = 12  # the billboard's release noise
    SMOOTHING = 13  # [ASI] Alg. 3 smoothing perturbations (per round, user)
    SCHEDULE = 14  # an algorithm's public cohort schedule (phases, owner/record per step)
    PERSONAL_NOISE = 15  # [HUANG] Alg. 1 full-DP baseline: an owner's personal-block noise
    CANARY = 16  # a canary unit's fixed random direction (audit.canaries)
    CANARY_SAMPLE = 17  # the billboard's Poisson sample of the canaries
    DPSGD_COUNT_NOISE = 18  # an owner's noise on a DP-SGD step's unclipped count (adaptive clip)
    ROTATION = 19  # the distributed mechanisms' public random rotation (per round)
    ROUNDING = 20  # a user's conditional stochastic rounding (distributed mechanisms)
    SHARE_NOISE = 21  # an owner's integer noise share (distributed mechanisms)
    DROPOUT = 22  # the simulated owner dropouts of a round (train.owner_dropout)
    MASKS = 23  # the owners' pairwise-mask secret in a seeded simulation (never the billboard's)
    USER_SAMPLE = 24  # an owner's Poisson coin for one of its users (distributed mechanisms)
    SYNTHETIC_TEACHER = 0x5EED  # the synthetic dataset's teacher
    PARTITION = 0xFA27  # owners' classes, record split, users


# The public keys of each purpose, in order (names for messages; the count is what is checked).
# "user" is a user's stable id (the pool index of its first record), "owner" the global owner id.
KEYS: dict[Purpose, tuple[str, ...]] = {
    Purpose.USER_ORDER: ("round", "epoch", "user"),
    Purpose.PERSONAL_ORDER: ("round", "epoch", "owner"),
    Purpose.OWNER_ORDER: ("round", "epoch", "owner"),
    Purpose.DPSGD_SAMPLE: ("round", "epoch", "step", "owner"),
    Purpose.DPSGD_NOISE: ("round", "epoch", "step", "owner"),
    Purpose.SAMPLE: ("round",),
    Purpose.NOISE: ("round",),
    Purpose.SMOOTHING: ("round", "user"),
    Purpose.SCHEDULE: ("round",),  # round 0 (never a training round): the run's public split
    Purpose.PERSONAL_NOISE: ("round", "owner"),
    Purpose.CANARY: ("canary",),
    Purpose.CANARY_SAMPLE: ("round",),
    Purpose.DPSGD_COUNT_NOISE: ("round", "epoch", "step", "owner"),
    Purpose.ROTATION: ("round",),
    Purpose.ROUNDING: ("round", "user"),
    Purpose.SHARE_NOISE: ("round", "owner"),
    Purpose.DROPOUT: ("round",),
    Purpose.MASKS: (),
    Purpose.USER_SAMPLE: ("round", "user"),
    Purpose.SYNTHETIC_TEACHER: (),
    Purpose.PARTITION: (),
}
if set(KEYS) != set(Purpose):  # a new purpose must declare its keys here
    raise RuntimeError(
        f"fedudp.randomness.KEYS misses {sorted(p.name for p in set(Purpose) - set(KEYS))}"
    )

# The purposes whose secrecy the DP guarantee rests on (noise and privacy sampling): drawn from OS
# entropy under ``Randomness.secure``. CANARY / CANARY_SAMPLE are the auditor's own units, SCHEDULE
# a public cohort schedule (cyclic groups; a paper mode's fixed owner), SMOOTHING a utility
# perturbation: not protecting, so they stay seeded.
PROTECTING: frozenset[Purpose] = frozenset(
    {
        Purpose.DPSGD_SAMPLE,
        Purpose.DPSGD_NOISE,
        Purpose.DPSGD_COUNT_NOISE,
        Purpose.SAMPLE,
        Purpose.NOISE,
        Purpose.PERSONAL_NOISE,
        Purpose.ROUNDING,
        Purpose.SHARE_NOISE,
        Purpose.USER_SAMPLE,
    }
)

_WORD = 1 << 32


def entropy(seed: int, purpose: Purpose, *keys: int) -> list[int]:
    """The entropy of one stream: ``[seed, purpose, *keys]``, checked.

    Parameters
    ----------
    seed
        The run's seed (one 32-bit word).
    purpose
        What the stream is for (``Purpose``).
    keys
        The purpose's keys (``KEYS[purpose]``: e.g. the round, a user's stable id), one 32-bit
        word each.

    Returns
    -------
    list of int
        The words a ``SeedSequence`` is built from.

    Raises
    ------
    ValueError
        The wrong number of keys for the purpose, or a value outside [0, 2**32) (naming the
        purpose and its keys).
    """
    purpose = Purpose(purpose)
    names = KEYS[purpose]
    if len(keys) != len(names):
        raise ValueError(
            f"randomness: Purpose.{purpose.name} takes {len(names)} key(s) "
            f"({', '.join(names) or 'none'}), got {len(keys)}: {tuple(map(int, keys))}"
        )
    words = [int(seed), int(purpose), *map(int, keys)]
    for name, w in zip(("seed", "purpose", *names), words):
        if not 0 <= w < _WORD:
            raise ValueError(
                f"randomness: Purpose.{purpose.name} {name}={w} is outside "
                "[0, 2**32) (each key must be one 32-bit word)"
            )
    return words


def numpy_rng(seed: int, purpose: Purpose, *keys: int) -> np.random.Generator:
    """The numpy generator of one stream (``entropy``'s words as its seed sequence).

    Parameters
    ----------
    seed, purpose, keys
        As ``entropy``.

    Returns
    -------
    numpy.random.Generator
        The stream.
    """
    return np.random.default_rng(entropy(seed, purpose, *keys))


def torch_generator(seed: int, purpose: Purpose, *keys: int) -> torch.Generator:
    """The torch generator of one stream, seeded from ``entropy``'s seed sequence (63 bits).

    Parameters
    ----------
    seed, purpose, keys
        As ``entropy``.

    Returns
    -------
    torch.Generator
        The stream (on the CPU).
    """
    seq = np.random.SeedSequence(entropy(seed, purpose, *keys))
    return torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))


def secure_numpy_rng() -> np.random.Generator:
    """A numpy generator from 128 bits of fresh OS entropy (nothing of the run in it).

    Returns
    -------
    np.random.Generator
    """
    return np.random.default_rng(np.random.SeedSequence(secrets.randbits(128)))


def secure_torch_generator() -> torch.Generator:
    """A torch generator seeded from 64 bits of fresh OS entropy (``manual_seed`` takes 64).

    Returns
    -------
    torch.Generator
        On the CPU.
    """
    return torch.Generator().manual_seed(secrets.randbits(64))


class Randomness:
    """Where a run's streams come from: ``Randomness.seeded(seed)`` (every stream keyed by the
    seed: reproducible, a simulation) or ``Randomness.secure(seed)`` (the ``PROTECTING``
    purposes from OS entropy, a fresh stream per call, the rest keyed by the seed).

    Parameters
    ----------
    seed
        The run's seed (one 32-bit word).
    mode
        ``"seeded"`` or ``"secure"``.

    Raises
    ------
    ValueError
        Another mode, or a seed outside [0, 2**32).
    """

    SEEDED, SECURE = "seeded", "secure"

    def __init__(self, seed: int, mode: str = SEEDED) -> None:
        if mode not in (self.SEEDED, self.SECURE):
            raise ValueError(f"randomness: mode must be 'seeded' or 'secure', got {mode!r}")
        if not 0 <= int(seed) < _WORD:
            raise ValueError(f"randomness: seed={seed} is outside [0, 2**32)")
        self.seed, self.mode = int(seed), mode

    @classmethod
    def seeded(cls, seed: int) -> Randomness:
        return cls(seed, cls.SEEDED)

    @classmethod
    def secure(cls, seed: int = 0) -> Randomness:
        return cls(seed, cls.SECURE)

    @property
    def is_secure(self) -> bool:
        return self.mode == self.SECURE

    @property
    def ledger_name(self) -> str:
        """What the ledger says: ``seeded (simulation)`` or ``secure``."""
        return "secure" if self.is_secure else "seeded (simulation)"

    def protects(self, purpose: Purpose) -> bool:
        """True where this purpose's stream comes from OS entropy."""
        return self.is_secure and Purpose(purpose) in PROTECTING

    def numpy_rng(self, purpose: Purpose, *keys: int) -> np.random.Generator:
        words = entropy(self.seed, purpose, *keys)  # the key count checked either way
        return secure_numpy_rng() if self.protects(purpose) else np.random.default_rng(words)

    def torch_generator(self, purpose: Purpose, *keys: int) -> torch.Generator:
        if self.protects(purpose):
            entropy(self.seed, purpose, *keys)
            return secure_torch_generator()
        return torch_generator(self.seed, purpose, *keys)

    def __repr__(self) -> str:
        return f"Randomness({self.seed}, {self.mode!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Randomness) and (self.seed, self.mode) == (other.seed, other.mode)

    def __hash__(self) -> int:
        return hash((self.seed, self.mode))
