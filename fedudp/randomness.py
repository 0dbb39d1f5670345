"""Every random stream of a run, keyed by (run seed, purpose, ...) (ARCHITECTURE.md §3).

A stream depends only on the run seed, its purpose and its public keys (round, epoch, owner),
never on the engine, chunking or scheduling order. The purposes are listed here once.
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
    SYNTHETIC_TEACHER = 0x5EED   # the synthetic dataset's teacher
    PARTITION = 0xFA27      # owners' classes, record split, users


def numpy_rng(seed: int, purpose: Purpose, *keys: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), int(purpose), *map(int, keys)])


def torch_generator(seed: int, purpose: Purpose, *keys: int) -> torch.Generator:
    seq = np.random.SeedSequence([int(seed), int(purpose), *map(int, keys)])
    return torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))
