"""The distributed mechanisms' per-run and per-round values both sides derive alike: the
public rotation's signs (keyed by the run seed and the round, as the billboard's broadcast is
public) and the owners' pairwise-mask secret (docs/threat-model.md#distributed-dp).

The mask secret is the owners' alone: ``privacy.randomness=secure`` draws it from OS entropy
once per run on the owner side (the billboard's code is never given it; it learns only the
pair seeds survivors reveal for a dropped owner); a seeded simulation derives it from the run
seed, reproducibly, which whoever knows the seed can recompute (a simulation, as the ledger's
randomness line says).
"""

from __future__ import annotations

import secrets

import numpy as np

from fedudp.randomness import Purpose, Randomness, numpy_rng

__all__ = ["mask_secret", "owner_sample", "round_signs"]


def round_signs(seed: int, round_: int, padded: int) -> np.ndarray:
    """The random ±1 signs of round ``round_``'s public rotation (``fedudp.secure.rotation``).

    Parameters
    ----------
    seed : int
        The run seed (public: the rotation protects nothing, it flattens the vectors).
    round_ : int
        The round.
    padded : int
        The padded dimension D (a power of two).

    Returns
    -------
    numpy.ndarray
        float64 [D] of ±1.
    """
    from fedudp.secure.rotation import rotation_signs

    return rotation_signs(numpy_rng(seed, Purpose.ROTATION, round_), padded)


def mask_secret(randomness: Randomness) -> bytes:
    """The owners' pairwise-mask secret for one run (32 bytes).

    Parameters
    ----------
    randomness : Randomness
        The run's randomness: secure draws 32 bytes of OS entropy (``secrets.token_bytes``),
        seeded derives them from the run seed.

    Returns
    -------
    bytes
        The secret, from which ``fedudp.secure.masks.MaskKeys`` derives each pair's seeds.
    """
    if randomness.is_secure:
        return secrets.token_bytes(32)
    return numpy_rng(randomness.seed, Purpose.MASKS).bytes(32)


def owner_sample(
    user_ids: np.ndarray, rate: float, randomness: Randomness, round_: int
) -> np.ndarray:
    """Which of an owner's users enter round ``round_``: a Poisson coin per user at ``rate``,
    each from the stream keyed by (round, that user's stable id) (``Purpose.USER_SAMPLE``:
    OS entropy under ``privacy.randomness=secure``). Drawn by the owners, never by the
    billboard, so that amplification by sampling holds against it; one user's coin does not
    depend on any other user.

    Parameters
    ----------
    user_ids : numpy.ndarray
        The users' stable ids.
    rate : float
        The Poisson rate q (1: every user, no coin drawn).
    randomness : Randomness
        The owners' randomness.
    round_ : int
        The round.

    Returns
    -------
    numpy.ndarray
        bool, one per user: True where the user is in the round.
    """
    ids = np.asarray(user_ids, dtype=np.int64)
    if rate >= 1.0:
        return np.ones(len(ids), dtype=bool)
    coins = [randomness.numpy_rng(Purpose.USER_SAMPLE, round_, int(u)).random() for u in ids]
    return np.asarray(coins, dtype=np.float64) < float(rate)
