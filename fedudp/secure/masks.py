"""Simulated secure aggregation: pairwise additive masks mod 2^bits (Bonawitz et al. 2017).

Each pair of owners ``i < j`` shares a seed per round; owner ``i`` adds the seed's expansion
``m_ij`` (uniform mod ``2^bits``) to its message and owner ``j`` subtracts it, so the masks
cancel in the sum of all messages while each single message is uniform mod ``2^bits`` to
anyone without the seeds. If an owner drops out after the masks were fixed, its partners'
masks with it no longer cancel: the survivors reveal their pair seeds with the dropped owner
and the billboard removes those masks (:meth:`SecureSum.unmask`).

What is simulated: the pair seeds come from one secret (``MaskKeys``, HMAC-SHA256 of the pair
and round) held on the owners' side of the simulation instead of a Diffie–Hellman key agreement
between each pair; the survivors' reveal is a callback instead of Shamir shares of the seeds;
and SecAgg's self-mask (which protects a slow owner wrongly declared dropped) is omitted. A
deployment needs those pieces (e.g. Flower's SecAgg+). The only primitives used are the standard
library's HMAC-SHA256 and SHAKE-256.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "MaskKeys",
    "SecureSum",
    "centered",
    "expand",
    "mask",
    "owner_mask",
]

_TAG = b"fedudp-mask"


def _modulus_mask(bits: int) -> np.uint64:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 62:
        raise ValueError(f"bits = {bits!r}: the modulus 2^bits needs an integer 2 <= bits <= 62")
    return np.uint64((1 << int(bits)) - 1)


def _check_reduced(v: np.ndarray, bits: int, who: str) -> np.ndarray:
    v = np.asarray(v)
    if v.dtype != np.uint64 or v.ndim != 1:
        raise ValueError(
            f"{who}: expected a 1-D uint64 vector mod 2^{bits}, not {v.dtype}{v.shape}"
        )
    if v.size and int(v.max()) >> int(bits):
        raise ValueError(f"{who}: a value is not reduced mod 2^{bits}")
    return v


class MaskKeys:
    """The owners' pairwise mask seeds, derived from one 32-byte secret.

    The billboard side never holds this object; it sees only the seeds the survivors reveal
    for a dropped owner (:meth:`SecureSum.unmask`).

    Parameters
    ----------
    secret
        32 bytes (``secrets.token_bytes(32)`` in secure mode, a seed-derived value in seeded
        simulation).
    owners
        The number of owners; owners are ``0 .. owners - 1``.

    Raises
    ------
    ValueError
        If the secret is not 32 bytes or ``owners < 1``.
    """

    def __init__(self, secret: bytes, owners: int) -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) != 32:
            raise ValueError("MaskKeys: the secret must be 32 bytes (secrets.token_bytes(32))")
        if int(owners) < 1:
            raise ValueError(f"MaskKeys: owners must be >= 1, not {owners}")
        self._secret = bytes(secret)
        self.owners = int(owners)

    def __repr__(self) -> str:  # never show the secret
        return f"MaskKeys(owners={self.owners})"

    def pair_seed(self, i: int, j: int, round_: int) -> bytes:
        """The seed owners ``i`` and ``j`` share in round ``round_``.

        Parameters
        ----------
        i
            One owner.
        j
            Another owner (the order of ``i`` and ``j`` does not matter).
        round_
            The round (>= 0).

        Returns
        -------
        bytes
            ``HMAC-SHA256(secret, "fedudp-mask" || min(i,j) || max(i,j) || round)`` (32 bytes;
            the integers as 8-byte big-endian words).

        Raises
        ------
        ValueError
            If ``i == j`` or an index is out of range.
        """
        i, j, r = int(i), int(j), int(round_)
        if i == j or not (0 <= i < self.owners and 0 <= j < self.owners) or r < 0:
            raise ValueError(f"pair_seed: owners {i}, {j} (of {self.owners}), round {r}")
        msg = _TAG + struct.pack(">QQQ", min(i, j), max(i, j), r)
        return hmac.new(self._secret, msg, hashlib.sha256).digest()


def expand(seed: bytes, dim: int, bits: int) -> np.ndarray:
    """A seed's mask: ``dim`` values uniform mod ``2^bits`` from SHAKE-256.

    Parameters
    ----------
    seed
        A pair seed (:meth:`MaskKeys.pair_seed`).
    dim
        The vector length.
    bits
        The modulus exponent, ``2 <= bits <= 62``.

    Returns
    -------
    numpy.ndarray
        uint64 ``[dim]``: SHAKE-256's output read as little-endian 64-bit words, each reduced
        mod ``2^bits`` (exactly uniform: ``2^bits`` divides ``2^64``).

    Raises
    ------
    ValueError
        If ``bits`` or ``dim`` is out of range.
    """
    m = _modulus_mask(bits)
    if int(dim) < 0:
        raise ValueError(f"expand: dim must be >= 0, not {dim}")
    raw = hashlib.shake_256(bytes(seed)).digest(8 * int(dim))
    return np.frombuffer(raw, dtype="<u8") & m  # a new (writable) uint64 array


def owner_mask(
    keys: MaskKeys,
    owner: int,
    peers: Sequence[int],
    round_: int,
    dim: int,
    bits: int,
    cache: dict[tuple[int, int], np.ndarray] | None = None,
) -> np.ndarray:
    """Owner ``owner``'s total mask: ``sum_{j>owner} m_{owner,j} - sum_{j<owner} m_{j,owner}``.

    Parameters
    ----------
    keys
        The owners' keys.
    owner
        This owner.
    peers
        The round's owners the masks are set up with (``owner`` itself, if listed, is skipped).
    round_
        The round.
    dim
        The vector length.
    bits
        The modulus exponent.
    cache
        Several owners of one round in one process (engine=local): each pair's expansion is
        kept here by the first of its two owners and taken out by the second, so it is computed
        once instead of twice (both would derive the same values from their shared seed).

    Returns
    -------
    numpy.ndarray
        uint64 ``[dim]`` mod ``2^bits``.
    """
    m = _modulus_mask(bits)
    total = np.zeros(int(dim), dtype=np.uint64)
    for j in sorted({int(p) for p in peers} - {int(owner)}):
        pair = (min(int(owner), j), max(int(owner), j))
        if cache is not None and pair in cache:
            e = cache.pop(pair)
        else:
            e = expand(keys.pair_seed(owner, j, round_), dim, bits)
            if cache is not None:
                cache[pair] = e
        if j > owner:
            total += e  # uint64 arithmetic wraps mod 2^64, a multiple of 2^bits
        else:
            total -= e
    return total & m


def mask(
    vec: np.ndarray,
    keys: MaskKeys,
    owner: int,
    peers: Sequence[int],
    round_: int,
    bits: int,
    cache: dict[tuple[int, int], np.ndarray] | None = None,
) -> np.ndarray:
    """An owner's masked message: ``(vec + owner_mask) mod 2^bits``.

    Parameters
    ----------
    vec
        The owner's reduced vector, uint64 ``[dim]`` in ``[0, 2^bits)``.
    keys
        The owners' keys.
    owner
        This owner.
    peers
        The round's owners the masks are set up with.
    round_
        The round.
    bits
        The modulus exponent.

    cache
        ``owner_mask``'s pair cache (several owners of a round in one process).

    Returns
    -------
    numpy.ndarray
        uint64 ``[dim]`` mod ``2^bits``.

    Raises
    ------
    ValueError
        If ``vec`` is not a reduced uint64 vector.
    """
    m = _modulus_mask(bits)
    vec = _check_reduced(vec, bits, "mask")
    return (vec + owner_mask(keys, owner, peers, round_, vec.shape[0], bits, cache)) & m


class SecureSum:
    """The billboard side of secure aggregation: the sum mod ``2^bits`` of masked messages.

    The masked messages are added as they arrive and not kept; :meth:`unmask` removes the
    masks of dropped owners and returns the sum.

    Parameters
    ----------
    bits
        The modulus exponent, ``2 <= bits <= 62``.
    dim
        The message length.
    """

    def __init__(self, bits: int, dim: int) -> None:
        self._m = _modulus_mask(bits)
        self.bits = int(bits)
        self.dim = int(dim)
        self._total = np.zeros(self.dim, dtype=np.uint64)
        self._owners: set[int] = set()
        self._done = False

    @property
    def owners(self) -> frozenset[int]:
        """The owners whose messages were added."""
        return frozenset(self._owners)

    def add(self, owner: int, masked: np.ndarray) -> None:
        """Add one owner's masked message.

        Parameters
        ----------
        owner
            The sending owner (each at most once).
        masked
            uint64 ``[dim]`` mod ``2^bits``.

        Raises
        ------
        ValueError
            If the owner already sent, the sum was unmasked, or the message is malformed.
        """
        if self._done:
            raise ValueError("SecureSum.add: the sum was already unmasked")
        if int(owner) in self._owners:
            raise ValueError(f"SecureSum.add: owner {owner} already sent its message")
        masked = _check_reduced(masked, self.bits, "SecureSum.add")
        if masked.shape[0] != self.dim:
            raise ValueError(f"SecureSum.add: length {masked.shape[0]}, expected {self.dim}")
        self._total = (self._total + masked) & self._m
        self._owners.add(int(owner))

    def unmask(
        self,
        dropped: Sequence[int],
        survivors: Sequence[int],
        revealed: Callable[[int, int], bytes],
        round_: int,
    ) -> np.ndarray:
        """Remove each survivor's masks with each dropped owner and return the sum.

        Parameters
        ----------
        dropped
            The owners the masks were set up with that sent nothing.
        survivors
            The owners that sent (exactly those added).
        revealed
            ``revealed(survivor, dropped_owner)``: the pair seed the survivor reveals (in
            simulation, ``keys.pair_seed(s, d, round_)``).
        round_
            The round (documentation of the call; the seeds carry it).

        Returns
        -------
        numpy.ndarray
            uint64 ``[dim]``: the sum of the survivors' unmasked vectors mod ``2^bits``.

        Raises
        ------
        ValueError
            If the survivors are not exactly the owners added, a dropped owner also sent, or
            the sum was already unmasked.
        """
        if self._done:
            raise ValueError("SecureSum.unmask: the sum was already unmasked")
        surv = {int(s) for s in survivors}
        drop = {int(d) for d in dropped}
        if surv != self._owners:
            raise ValueError(
                f"SecureSum.unmask: survivors {sorted(surv)} are not the owners that sent "
                f"{sorted(self._owners)}"
            )
        if surv & drop:
            raise ValueError(f"SecureSum.unmask: owners {sorted(surv & drop)} sent and dropped")
        total = self._total
        for s in sorted(surv):
            for d in sorted(drop):
                e = expand(revealed(s, d), self.dim, self.bits)
                if d > s:  # s added m_{s,d}
                    total -= e
                else:  # s subtracted m_{d,s}
                    total += e
        self._done = True
        self._total = total & self._m
        return self._total.copy()


def centered(v: np.ndarray, bits: int) -> np.ndarray:
    """Values mod ``2^bits`` as the integers in ``[-2^(bits-1), 2^(bits-1))``.

    Parameters
    ----------
    v
        uint64 values in ``[0, 2^bits)``.
    bits
        The modulus exponent.

    Returns
    -------
    numpy.ndarray
        int64 of ``v``'s shape.
    """
    _modulus_mask(bits)
    x = np.asarray(v, dtype=np.uint64).astype(np.int64)
    half = np.int64(1 << (int(bits) - 1))
    return np.where(x >= half, x - np.int64(1 << int(bits)), x)
