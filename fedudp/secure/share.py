"""One owner's masked share under a distributed mechanism, written once for every path that
sends one: fedudp's own engines (``fedudp.owner.secure_reply``) and a Flower app's client mod
(``fedudp.flower.secure_mod``).

The owner encodes its sampled users' vectors with the round's public ``SecureEncoding``
(``fedudp.secure.encoding.encode_owner``: clip, rotate, scale, round each user's vector on
the stream keyed by (round, that user's stable id), sum, add the owner's integer noise share
from the stream keyed by (round, the owner's id)), reduces the sum mod 2^bits and masks it with
the pairwise masks of the round's roster (``fedudp.secure.masks.mask``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedudp.randomness import Purpose, Randomness
from fedudp.secure.encoding import SecureEncoding, encode_owner, reduce_mod
from fedudp.secure.masks import MaskKeys, mask

__all__ = ["owner_share"]


def owner_share(
    rows: np.ndarray,
    user_ids: Sequence[int],
    owner: int,
    enc: SecureEncoding,
    randomness: Randomness,
    round_: int,
    signs: np.ndarray,
    keys: MaskKeys,
    peers: Sequence[int],
    cache: dict[tuple[int, int], np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """An owner's masked share and its unreduced integer message.

    Parameters
    ----------
    rows : numpy.ndarray
        float64 ``[n, enc.dim]``, finite: the owner's sampled users' vectors (unclipped:
        ``encode_owner`` clips each to ``enc.clip``); ``n = 0`` sends the noise share alone.
    user_ids : sequence of int
        The users' stable ids, one per row (their rounding streams' keys).
    owner : int
        The owner's id in the roster (its noise share's key and its masks' index).
    enc : SecureEncoding
        The round's public encoding.
    randomness : Randomness
        The owners' randomness (seeded: keyed by the run seed; secure: OS entropy).
    round_ : int
        The round.
    signs : numpy.ndarray
        The round's public rotation signs (``fedudp.secure.public.round_signs``).
    keys : MaskKeys
        The owners' pairwise seeds.
    peers : sequence of int
        The round's roster (the owners the masks are set up with).
    cache : dict or None, default None
        ``fedudp.secure.masks.owner_mask``'s pair cache, shared by the owners of one round in
        one process (each pair's mask expanded once).

    Returns
    -------
    tuple of numpy.ndarray
        (the masked share, uint64 ``[enc.padded]`` mod 2^bits; the unreduced int64 message,
        for the simulator's wrap diagnostic only: it never leaves the owner).

    Raises
    ------
    ValueError
        ``rows`` and ``user_ids`` disagree, or ``encode_owner``'s own checks fail.
    """
    ids = [int(u) for u in user_ids]
    if len(ids) != int(np.shape(rows)[0]):
        raise ValueError(f"owner_share: {len(ids)} user ids for {np.shape(rows)[0]} rows")
    unreduced = encode_owner(
        rows,
        enc,
        signs,
        [randomness.numpy_rng(Purpose.ROUNDING, round_, uid) for uid in ids],
        randomness.numpy_rng(Purpose.SHARE_NOISE, round_, int(owner)),
        reduced=False,
    )
    reduced = reduce_mod(unreduced, enc.bits)
    return mask(reduced, keys, int(owner), peers, round_, enc.bits, cache), unreduced
