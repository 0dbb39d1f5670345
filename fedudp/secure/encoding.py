"""One owner's message of distributed DP and the billboard's decoding of the secure sum.

The owner clips each sampled user's vector to ``clip``, rotates it (:mod:`.rotation`), scales
it by ``scale``, rounds **each user's** row conditionally (:mod:`.rounding`), sums its users'
integer rows, adds its integer noise share (:mod:`.noise`) and reduces mod ``2^bits``
(Kairouz, Liu & Steinke 2021, Algorithm 1; Agarwal, Kairouz & Liu 2021). The caller masks the
result (:mod:`.masks`). The billboard decodes only the unmasked sum: centre it, divide by the
scale and unrotate. The encoding's parameters (:class:`SecureEncoding`) are public: the
privacy layer computes ``rounded_bound`` and ``local_std`` from the declared budget, and
nothing here reads the data to choose them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedudp.errors import ConfigError
from fedudp.secure.masks import centered
from fedudp.secure.noise import NOISE_KINDS, noise_share
from fedudp.secure.rotation import padded_dim, rotate_into, unrotate
from fedudp.secure.rounding import ConditionalRounder

__all__ = [
    "FLOAT_EXACT",
    "SecureEncoding",
    "decode_sum",
    "encode_owner",
    "reduce_mod",
    "wraps",
]

#: the largest magnitude the float path may reach: every integer up to 2^52 is a float64
FLOAT_EXACT = 2.0**52
# the integer noise share must stay well inside the float path: its std at most this
_SHARE_STD_LIMIT = FLOAT_EXACT / 64.0
# rows transformed and rounded together: about this many values
_BLOCK_VALUES = 1 << 20


def _positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"SecureEncoding.{name} = {value}: must be a finite number > 0")


@dataclass(frozen=True)
class SecureEncoding:
    """The public parameters of one round's encoding (small and serializable).

    Parameters
    ----------
    noise
        ``"ddgauss"`` (distributed discrete Gaussian) or ``"skellam"``.
    clip
        The l2 clip ``C`` of each user's vector (float domain).
    scale
        ``1/gamma``: the float-to-integer scale.
    bits
        The modulus ``2^bits``, ``2 <= bits <= 62``.
    beta
        The conditional rounding's ``beta`` in ``[0, 1)``.
    local_std
        The owner's noise-share std in the float domain (the integer share's is
        ``local_std * scale``).
    dim
        The shared vector's length ``d`` (rotated at ``D = padded_dim(d)``).
    rounded_bound
        The l2 bound of one user's rounded vector, integer domain
        (``privacy.distributed.rounded_l2_bound``).
    rate
        The users' Poisson sampling rate q, drawn by the owners themselves on each user's own
        stream (the billboard does not learn who was sampled); 1: every user.

    Raises
    ------
    ConfigError
        A one-line error naming the field for an impossible value, and naming ``scale`` if
        the float path could lose exactness (``C*scale + sqrt(D)``, ``rounded_bound`` or
        ``64 * local_std * scale`` above ``2^52``).
    """

    noise: str
    clip: float
    scale: float
    bits: int
    beta: float
    local_std: float
    dim: int
    rounded_bound: float
    rate: float = 1.0

    def __post_init__(self) -> None:
        if self.noise not in NOISE_KINDS:
            raise ConfigError(
                f"SecureEncoding.noise = {self.noise!r}: must be one of {', '.join(NOISE_KINDS)}"
            )
        _positive("clip", self.clip)
        _positive("scale", self.scale)
        _positive("rounded_bound", self.rounded_bound)
        if not (math.isfinite(self.rate) and 0.0 < self.rate <= 1.0):
            raise ConfigError(f"SecureEncoding.rate = {self.rate}: must be in (0, 1]")
        if (
            isinstance(self.bits, bool)
            or not isinstance(self.bits, int)
            or not 2 <= self.bits <= 62
        ):
            raise ConfigError(f"SecureEncoding.bits = {self.bits!r}: must be an integer in [2, 62]")
        if not (math.isfinite(self.beta) and 0.0 <= self.beta < 1.0):
            raise ConfigError(f"SecureEncoding.beta = {self.beta}: must be in [0, 1)")
        if not (math.isfinite(self.local_std) and self.local_std >= 0.0):
            raise ConfigError(f"SecureEncoding.local_std = {self.local_std}: must be >= 0")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ConfigError(f"SecureEncoding.dim = {self.dim!r}: must be an integer >= 1")
        reach = self.clip * self.scale + math.sqrt(self.padded)
        if reach > FLOAT_EXACT or self.rounded_bound > FLOAT_EXACT:
            raise ConfigError(
                f"SecureEncoding.scale = {self.scale:g}: clip*scale + sqrt(D) = {reach:g} "
                f"(rounded_bound {self.rounded_bound:g}) exceeds 2^52, where float64 stops "
                "being exact; lower the scale"
            )
        if self.local_std * self.scale > _SHARE_STD_LIMIT:
            raise ConfigError(
                f"SecureEncoding.scale = {self.scale:g}: the integer share's std "
                f"local_std*scale = {self.local_std * self.scale:g} exceeds 2^52/64; lower the scale"
            )

    @property
    def padded(self) -> int:
        """``D = padded_dim(dim)``: the rotated (and transmitted) length."""
        return padded_dim(self.dim)


def reduce_mod(v: np.ndarray, bits: int) -> np.ndarray:
    """Integers reduced mod ``2^bits``.

    Parameters
    ----------
    v
        int64 values.
    bits
        The modulus exponent, ``2 <= bits <= 62``.

    Returns
    -------
    numpy.ndarray
        uint64 in ``[0, 2^bits)`` (two's complement makes ``&`` the reduction of negatives).
    """
    return (np.asarray(v, dtype=np.int64) & np.int64((1 << int(bits)) - 1)).astype(np.uint64)


def _clip_factors(rows: np.ndarray, clip: float) -> np.ndarray:
    """Each row's factor ``min(1, clip / ||row||)``, the norms in float64."""
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
    return np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))


def encode_owner(
    rows: np.ndarray,
    enc: SecureEncoding,
    signs: np.ndarray,
    rounding_rngs: Sequence[np.random.Generator],
    noise_rng: np.random.Generator,
    *,
    reduced: bool = True,
) -> np.ndarray:
    """One owner's unmasked message: its users' clipped, rotated, rounded rows plus its share.

    Parameters
    ----------
    rows
        float ``[n, dim]``, finite: the owner's sampled users' vectors (``n = 0`` allowed: the
        message is the noise share alone).
    enc
        The round's encoding.
    signs
        The round's rotation signs, float64 ``[enc.padded]``.
    rounding_rngs
        ``n`` generators, row ``i`` rounded with ``rounding_rngs[i]`` (the user's stream).
    noise_rng
        The owner's noise-share stream.
    reduced
        ``False`` returns the unreduced int64 sum (the simulator's wrap diagnostic,
        :func:`wraps`); ``reduce_mod(v, enc.bits)`` of it is the message.

    Returns
    -------
    numpy.ndarray
        uint64 ``[enc.padded]`` mod ``2^bits`` (int64 if ``reduced=False``).

    Raises
    ------
    ValueError
        If the rows are not finite ``[n, dim]``, the generators or signs do not match, or the
        integer sum could overflow int64.
    RuntimeError
        If a row cannot be rounded within its bound (:func:`conditional_round`).
    """
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != enc.dim:
        raise ValueError(f"encode_owner: rows must be [n, {enc.dim}], not shape {rows.shape}")
    if not np.all(np.isfinite(rows)):
        raise ValueError("encode_owner: the rows must be finite (NaN or inf found)")
    n, D = rows.shape[0], enc.padded
    if len(rounding_rngs) != n:
        raise ValueError(f"encode_owner: {len(rounding_rngs)} rounding generators for {n} rows")
    if np.shape(signs) != (D,):
        raise ValueError(f"encode_owner: signs must be [{D}], not shape {np.shape(signs)}")
    if (n + 1) * enc.rounded_bound >= 2.0**62:
        raise ValueError(f"encode_owner: {n} rows of norm {enc.rounded_bound:g} overflow int64")
    total = np.zeros(D, dtype=np.int64)
    step = max(1, _BLOCK_VALUES // D)
    buf = np.empty((min(step, n), D), dtype=np.float64)
    gains = _clip_factors(rows, enc.clip) * enc.scale
    rounder = ConditionalRounder(D, enc.rounded_bound)
    for s in range(0, n, step):
        z = rotate_into(rows[s : s + step], signs, buf[: min(step, n - s)], gains[s : s + step])
        rounder.add_rows(z, rounding_rngs[s : s + step], total)
    total += noise_share(enc.noise, D, enc.local_std * enc.scale, noise_rng)
    return reduce_mod(total, enc.bits) if reduced else total


def decode_sum(total: np.ndarray, enc: SecureEncoding, signs: np.ndarray) -> np.ndarray:
    """The billboard's decoding: centre the unmasked sum, divide by the scale, unrotate.

    Parameters
    ----------
    total
        The unmasked sum, uint64 ``[enc.padded]`` mod ``2^bits``.
    enc
        The round's encoding.
    signs
        The round's rotation signs.

    Returns
    -------
    numpy.ndarray
        float64 ``[enc.dim]``: the noisy sum of the clipped vectors (the estimator divides by
        its public denominator).

    Raises
    ------
    ValueError
        If ``total`` is not ``[enc.padded]``.
    """
    total = np.asarray(total, dtype=np.uint64)
    if total.shape != (enc.padded,):
        raise ValueError(f"decode_sum: total must be [{enc.padded}], not shape {total.shape}")
    y = centered(total, enc.bits).astype(np.float64) / enc.scale
    return unrotate(y, signs, enc.dim)


def wraps(unreduced_sum: np.ndarray, bits: int) -> int:
    """The coordinates a modular wrap corrupts: true sums outside ``[-2^(bits-1), 2^(bits-1))``.

    Parameters
    ----------
    unreduced_sum
        The integer sum of the owners' unreduced messages (int64).
    bits
        The modulus exponent.

    Returns
    -------
    int
        How many coordinates decode wrongly.
    """
    v = np.asarray(unreduced_sum, dtype=np.int64)
    half = 1 << (int(bits) - 1)
    return int(np.count_nonzero((v < -half) | (v >= half)))
