"""Distributed DP under secure aggregation: the distributed discrete Gaussian (``ddgauss``)
and Skellam (``skellam``) mechanisms (``privacy.placement=distributed``;
docs/algorithms.md#distributed-dp-under-secure-aggregation).

Owner side (``constraint``): the round's public ``SecureEncoding``; each surviving owner clips
each sampled user's shared vector to C, rotates it (a public randomized Hadamard rotation),
scales it by ``scale`` and rounds it on its own stream (conditional stochastic rounding with
β), sums its users' integer vectors, adds its integer noise share of std ``local_std · scale``
and masks the result mod 2^bits (``fedudp.owner.secure_reply``). Billboard side
(``release``): the masked shares are summed mod 2^bits, the masks of dropped owners removed
with the pair seeds the survivors reveal, and only the sum is decoded (centred, unscaled,
rotated back) and divided by the public ``q · N_users``. The billboard never sees one owner's
unmasked message, and never adds noise itself: the server is not trusted with it.

Accounting (``dp_event_for``): one round is a ``DistributedDpEvent`` of the survivors actually
answering (public: which owners answered, never data); the noise shares are calibrated for the
declared minimum ``train.min_owners`` of survivors, a round with fewer is withheld (fail
closed, ``fedudp.billboard.release.ReleaseGate``) and one with more is accounted at its count
(more shares, more noise, a smaller ε). Adjacency: add/remove one user.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from fedudp.aggregators.base import (
    Aggregate,
    Aggregator,
    Option,
    ParameterError,
    check_noise_scale,
    register,
)
from fedudp.aggregators.plain_values import check_budget, check_positive, check_sampling
from fedudp.privacy.distributed import (
    DistributedDpEvent,
    calibrate_local_std,
    distributed_event,
    rounded_l2_bound,
)
from fedudp.protocol.contributions import Constraint, Contribution, Sampling
from fedudp.secure.encoding import SecureEncoding, decode_sum
from fedudp.secure.masks import SecureSum
from fedudp.secure.public import round_signs
from fedudp.secure.rotation import padded_dim

__all__ = [
    "DistributedAggregator",
    "DdgAggregator",
    "SkellamAggregator",
    "TRUST",
    "heuristic_params",
]

TRUST = "server: untrusted (secure aggregation)"

BITS = Option("bits", 16, int, help="bits per coordinate of the modular sum (2^bits)")
ROUNDING_BETA = Option(
    "rounding_beta",
    math.exp(-0.5),
    float,
    help="conditional stochastic rounding's beta (Kairouz et al. 2021; 0: unconditional)",
)
K_STDDEVS = Option(
    "k_stddevs", 4.0, float, help="standard deviations of the noisy sum kept within 2^bits"
)
SCALE = Option(
    "scale", None, float, True, help="the scale 1/gamma before rounding (null: the heuristic)"
)


def heuristic_params(
    noise: str, bits: int, k: float, users: float, owners: int, common: dict, rho: float = 1.0
) -> tuple[float, float]:
    """The largest scale whose noisy sum keeps ``k`` standard deviations within 2^bits, and
    the shares' std calibrated at it: Kairouz et al. 2021's heuristic (Sec. 4.2/4.4, the
    sum's per-coordinate variance after the rotation bounded by ρ/D·(C·m)² for its signal,
    m/(4·scale²) for the rounding of its m users and n·σ² for the shares of n owners) with
    users and owners told apart: m = the expected users of a round (q N), n = every owner
    (the most shares a round sums), σ calibrated for the declared minimum of survivors.

    Parameters
    ----------
    noise : str
        ``ddgauss`` or ``skellam``.
    bits : int
        The modulus 2^bits.
    k : float
        The standard deviations to keep within the range.
    users : float
        The expected users of a round (q N).
    owners : int
        Every owner.
    common : dict
        ``calibrate_local_std``'s other keywords (ε, δ, rounds, clip, β, padded dim, the
        minimum of survivors, q).
    rho : float, default 1.0
        The rotation's flatness.

    Returns
    -------
    tuple of float
        (scale, the shares' std in the float domain).

    Raises
    ------
    ParameterError
        ``bits`` too few for the users' rounding at ``k`` standard deviations.
    """
    if not isinstance(bits, int) or not 2 <= bits <= 62:
        raise ParameterError("bits", f"bits must be an integer in [2, 62], got {bits!r}")
    check_positive("k_stddevs", k)
    m, n, D, C = max(float(users), 1.0), int(owners), int(common["dim"]), float(common["clip"])
    half = 2.0 ** (bits - 1)  # the sum must stay within ±2^(bits-1)
    room = (half / k) ** 2 - m / 4.0  # what the signal may take, times scale², at sigma 0
    if room <= 0:
        raise ParameterError(
            "bits",
            f"bits={bits} too small for about {m:.0f} users a round at k_stddevs={k:g} "
            "(their rounding alone wraps): raise estimator.bits or lower estimator.k_stddevs",
        )
    top = math.sqrt(room / (rho / D * (C * m) ** 2))

    def std(s: float) -> float:
        return calibrate_local_std(noise, scale=s, **common)

    def fits(s: float) -> bool:
        var = rho / D * (C * m) ** 2 + m / (4.0 * s * s) + n * std(s) ** 2
        return k * math.sqrt(var) * s <= half

    lo, hi = top, top
    while not fits(lo):
        hi, lo = lo, lo / 2.0
        if lo < top * 1e-12:
            raise ParameterError(
                "bits",
                f"bits={bits}: no scale keeps {k:g} standard deviations of the sum within "
                "2^bits at this noise: raise estimator.bits or lower estimator.k_stddevs",
            )
    if lo != top:
        while hi / lo > 1 + 1e-6:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, std(lo)


class DistributedAggregator(Aggregator):
    """A distributed mechanism: integer noise shares from the owners, secure aggregation.

    Parameters
    ----------
    encoding : SecureEncoding
        The owners' public encoding (its ``local_std`` is what the owners add: the accounted
        std times ``noise_scale``).
    sampling : Sampling
        The Poisson sampling of users (rate q, public population N: the divisor q N).
    min_owners : int
        The declared minimum of surviving owners the shares are calibrated for.
    owners : int
        Every owner (each is asked every round).
    seed : int
        The run seed (the public rotation is keyed by it and the round).
    accounted_std : float
        The share std the ledger accounts (float domain).
    scale_from : str, default "declared"
        ``heuristic`` or ``declared`` (for the ledger).
    noise_scale : float, default 1.0
        Below 1: a deliberately weakened mechanism (audits): the owners add that fraction.
    """

    noise: ClassVar[str]
    private = True
    needs_per_user_vectors = False
    accountant = (
        "RDP of the distributed mechanism (fedudp.privacy.distributed: Kairouz et al. 2021 "
        "Prop. 14 / Agarwal et al. 2021, Zhu-Wang subsampling), dp_accounting's conversion"
    )
    inputs = (
        "clip",
        "epsilon",
        "delta",
        "rounds",
        "sampling",
        "dim",
        "min_owners",
        "owner_units",
        "seed",
        "noise_scale",
    )
    options = (BITS, ROUNDING_BETA, K_STDDEVS, SCALE)
    survivor_event = True
    samples_on_owners = True
    trust = TRUST
    k_stddevs: float = 4.0  # the heuristic scale's standard deviations within 2^bits

    @property
    def wrap_probability(self) -> float:
        """2·Φ(−k): the heuristic per-coordinate chance that the noisy sum leaves the modular
        range (a sub-Gaussian sum at the heuristic scale; marked heuristic in the ledger)."""
        return math.erfc(self.k_stddevs / math.sqrt(2.0))

    def __init__(
        self,
        encoding: SecureEncoding,
        sampling: Sampling,
        min_owners: int,
        owners: int,
        seed: int,
        accounted_std: float,
        scale_from: str = "declared",
        noise_scale: float = 1.0,
    ) -> None:
        if not 2 <= int(min_owners) <= int(owners):
            raise ValueError(
                f"train.min_owners={min_owners}: a distributed mechanism needs at least 2 "
                f"surviving owners and at most the {owners} owners"
            )
        self.encoding = encoding
        self.sampling = sampling
        self.min_owners, self.owners, self.seed = int(min_owners), int(owners), int(seed)
        self.accounted_std = float(accounted_std)
        self.scale_from = scale_from
        self.noise_scale = check_noise_scale(noise_scale)

    @classmethod
    def calibrated(
        cls,
        *,
        clip: float,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        dim: int,
        min_owners: int,
        owner_units: list[int] | tuple[int, ...],
        seed: int,
        noise_scale: float = 1.0,
        bits: int = 16,
        rounding_beta: float = math.exp(-0.5),
        k_stddevs: float = 4.0,
        scale: float | None = None,
    ) -> DistributedAggregator:
        """The shares' std (and, with ``scale`` null, the scale) for ``rounds`` releases at
        (ε, δ) with ``min_owners`` survivors.

        Parameters
        ----------
        clip : float
            Each user's l2 clip norm C.
        epsilon, delta : float
            The run's target.
        rounds : int
            The releases the budget covers.
        sampling : Sampling
            The Poisson sampling of users.
        dim : int
            The shared vector's length d.
        min_owners : int
            The declared minimum of surviving owners (``train.min_owners``).
        owner_units : sequence of int
            The owners' declared capacities (their number is the roster's size).
        seed : int
            The run seed.
        noise_scale : float, default 1.0
            Below 1: a deliberately weakened mechanism (audits).
        bits : int, default 16
            The modulus 2^bits.
        rounding_beta : float, default exp(-0.5)
            Conditional rounding's β.
        k_stddevs : float, default 4
            Standard deviations of the noisy sum within the modular range (the heuristic scale).
        scale : float or None, default None
            The declared scale 1/γ (None: Kairouz et al.'s heuristic).

        Returns
        -------
        DistributedAggregator
            The calibrated mechanism.

        Raises
        ------
        ParameterError
            A plain value out of range, or bits too few for the owners and k.
        """
        check_sampling(sampling)
        check_budget(epsilon, delta, rounds)
        check_positive("clip", clip)
        if not (isinstance(rounding_beta, float) and 0.0 <= rounding_beta < 1.0):
            raise ParameterError(
                "rounding_beta", f"rounding_beta must be in [0, 1), got {rounding_beta!r}"
            )
        owners = len(owner_units)
        D = padded_dim(int(dim))
        common: dict[str, Any] = {
            "epsilon": epsilon,
            "delta": delta,
            "rounds": rounds,
            "clip": clip,
            "beta": rounding_beta,
            "dim": D,
            "owners": int(min_owners),
            "rate": sampling.rate,
        }
        try:
            if scale is None:
                s, std = heuristic_params(
                    cls.noise, bits, k_stddevs, sampling.expected_cohort, owners, common
                )
                how = "heuristic"
            else:
                check_positive("scale", scale)
                s, how = float(scale), "declared"
                std = calibrate_local_std(cls.noise, scale=s, **common)
        except ParameterError:
            raise
        except ValueError as e:  # the accountant cannot reach the target at these settings
            raise ParameterError("epsilon", f"epsilon={epsilon:g} unreachable: {e}") from None
        try:
            enc = SecureEncoding(
                noise=cls.noise,
                clip=float(clip),
                scale=float(s),
                bits=int(bits),
                beta=float(rounding_beta),
                local_std=float(std) * check_noise_scale(noise_scale),
                dim=int(dim),
                rounded_bound=rounded_l2_bound(float(clip) * float(s), float(rounding_beta), D),
                rate=float(sampling.rate),
            )
        except ValueError as e:  # the float path's exactness (one line naming the scale)
            raise ParameterError("scale", f"scale={s:g} ({how}) is unusable: {e}") from None
        out = cls(enc, sampling, min_owners, owners, seed, std, how, noise_scale)
        out.k_stddevs = float(k_stddevs)
        return out

    @property
    def noise_std(self) -> float:
        """The std per coordinate of the decoded sum's noise at the declared minimum of
        survivors (float domain)."""
        return self.accounted_std * math.sqrt(self.min_owners)

    @property
    def constraint(self) -> Constraint:
        """The owners send masked shares of their users' encoded vectors."""
        return Constraint(rows=False, clip=self.encoding.clip, secure=self.encoding)

    def dp_event(self) -> DistributedDpEvent:
        """The round at the declared minimum of survivors (the budget's worst case)."""
        return self.dp_event_for(self.min_owners)

    def dp_event_for(self, answered_owners: int) -> DistributedDpEvent:
        """The round as released when ``answered_owners`` owners' shares were summed.

        Parameters
        ----------
        answered_owners : int
            The owners that answered (public).

        Returns
        -------
        DistributedDpEvent
            The round's event (its shares' accounted std, the survivors' count).
        """
        e = self.encoding
        return distributed_event(
            self.noise,
            clip=e.clip,
            local_std=self.accounted_std,
            scale=e.scale,
            beta=e.beta,
            dim=e.padded,
            owners=int(answered_owners),
            rate=self.sampling.rate,
        )

    def release(self, c: Contribution, *, rng: torch.Generator | None = None) -> Aggregate:
        """Sum the masked shares mod 2^bits, remove the dropped owners' masks with the revealed
        pair seeds, decode the sum and divide by q N (no noise is added here)."""
        e = self.encoding
        survivors = [s.owner for s in c.shares]
        if len(set(survivors)) != len(survivors) or not set(survivors) <= set(c.roster):
            raise ValueError("distributed release: shares of owners outside the roster, or twice")
        dropped = sorted(set(c.roster) - set(survivors))
        secure = SecureSum(e.bits, e.padded)
        for s in c.shares:
            secure.add(s.owner, s.vector)
        seeds = {(r.survivor, r.dropped): r.seed for r in c.reveals}

        def revealed(survivor: int, gone: int) -> bytes:
            if (survivor, gone) not in seeds:
                raise ValueError(
                    f"distributed release: owner {survivor} revealed no seed for dropped owner "
                    f"{gone}; the sum cannot be unmasked"
                )
            return seeds[(survivor, gone)]

        assert c.round_ is not None  # shares are encoded for a round
        total = secure.unmask(dropped, survivors, revealed, c.round_)
        decoded = decode_sum(total, e, round_signs(self.seed, c.round_, e.padded))
        mean = torch.from_numpy(decoded / self.sampling.expected_cohort)
        # the billboard learns no count of users: only who answered
        return Aggregate(mean=mean, users_used=0, diagnostics={"survivors": len(survivors)})

    def ledger_notes(self) -> list[str]:
        e = self.encoding
        return [
            f"trust model: {TRUST}; simulated (pairwise masks from one owner-side secret, "
            "survivors reveal pair seeds; docs/threat-model.md)",
            f"{self.noise} shares: std {self.accounted_std:.6g} per owner (float domain), "
            f"calibrated for train.min_owners={self.min_owners} of {self.owners} owners; "
            "rounds accounted at their survivors",
            f"modular wrap probability per coordinate about 2*Phi(-k) = "
            f"{self.wrap_probability:.3g} at k_stddevs={self.k_stddevs:g} (heuristic: a "
            "sub-Gaussian sum; the simulator counts the actual wraps)"
            if self.scale_from == "heuristic"
            else "modular wraps: scale declared (estimator.scale), counted by the simulator",
            f"encoding: bits={e.bits}, scale={e.scale:.6g} ({self.scale_from}), "
            f"rounding beta={e.beta:.6g}, padded dim={e.padded}, "
            f"rounded l2 bound={e.rounded_bound:.6g}",
        ]


@register
class DdgAggregator(DistributedAggregator):
    """``aggregator=ddgauss``: the distributed discrete Gaussian (Kairouz, Liu & Steinke 2021).

    Parameters
    ----------
    encoding, sampling, min_owners, owners, seed, accounted_std, scale_from, noise_scale
        As ``DistributedAggregator``.
    """

    name = "ddgauss"
    noise = "ddgauss"


@register
class SkellamAggregator(DistributedAggregator):
    """``aggregator=skellam``: the distributed Skellam mechanism (Agarwal, Kairouz & Liu 2021).

    Parameters
    ----------
    encoding, sampling, min_owners, owners, seed, accounted_std, scale_from, noise_scale
        As ``DistributedAggregator``.
    """

    name = "skellam"
    noise = "skellam"
