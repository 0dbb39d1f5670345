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
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np
import torch


class Purpose(IntEnum):
    USER_ORDER = 1          # a user's record order in local SGD (shared vectors)
    PERSONAL_ORDER = 2      # an owner's record order in its personal update
    OWNER_ORDER = 3         # an owner's record order in standard FedAvg (all its records)
    DPSGD_SAMPLE = 4        # an owner's Poisson sample of its users at one DP-SGD step
    DPSGD_NOISE = 5         # an owner's Gaussian noise at one DP-SGD step
    SAMPLE = 11             # the billboard's Poisson sample of units
    NOISE = 12              # the billboard's release noise
    SMOOTHING = 13          # [ASI] Alg. 3 smoothing perturbations (per round, user)
    SCHEDULE = 14           # an algorithm's public cohort schedule (phases, owner/record per step)
    PERSONAL_NOISE = 15     # [HUANG] Alg. 1 full-DP baseline: an owner's personal-block noise
    CANARY = 16             # a canary unit's fixed random direction (audit.canaries)
    CANARY_SAMPLE = 17      # the billboard's Poisson sample of the canaries
    DPSGD_COUNT_NOISE = 18  # an owner's noise on a DP-SGD step's unclipped count (adaptive clip)
    SYNTHETIC_TEACHER = 0x5EED   # the synthetic dataset's teacher
    PARTITION = 0xFA27      # owners' classes, record split, users


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
    Purpose.SCHEDULE: ("round",),        # round 0 (never a training round): the run's public split
    Purpose.PERSONAL_NOISE: ("round", "owner"),
    Purpose.CANARY: ("canary",),
    Purpose.CANARY_SAMPLE: ("round",),
    Purpose.DPSGD_COUNT_NOISE: ("round", "epoch", "step", "owner"),
    Purpose.SYNTHETIC_TEACHER: (),
    Purpose.PARTITION: (),
}
if set(KEYS) != set(Purpose):       # a new purpose must declare its keys here
    raise RuntimeError("fedudp.randomness.KEYS misses "
                       f"{sorted(p.name for p in set(Purpose) - set(KEYS))}")

_WORD = 1 << 32


def entropy(seed: int, purpose: Purpose, *keys: int) -> list[int]:
    """``[seed, purpose, *keys]``, checked: the purpose's key count (``KEYS``) and one 32-bit word
    per value (``ValueError`` naming the purpose and its keys otherwise)."""
    purpose = Purpose(purpose)
    names = KEYS[purpose]
    if len(keys) != len(names):
        raise ValueError(f"randomness: Purpose.{purpose.name} takes {len(names)} key(s) "
                         f"({', '.join(names) or 'none'}), got {len(keys)}: {tuple(map(int, keys))}")
    words = [int(seed), int(purpose), *map(int, keys)]
    for name, w in zip(("seed", "purpose", *names), words):
        if not 0 <= w < _WORD:
            raise ValueError(f"randomness: Purpose.{purpose.name} {name}={w} is outside "
                             "[0, 2**32) (each key must be one 32-bit word)")
    return words


def numpy_rng(seed: int, purpose: Purpose, *keys: int) -> np.random.Generator:
    return np.random.default_rng(entropy(seed, purpose, *keys))


def torch_generator(seed: int, purpose: Purpose, *keys: int) -> torch.Generator:
    seq = np.random.SeedSequence(entropy(seed, purpose, *keys))
    return torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))
