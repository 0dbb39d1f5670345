"""Audits of the distributed mechanisms (``aggregator=ddgauss`` / ``skellam``,
``privacy.placement=distributed``): ``audit_distributed``, end to end as a round runs.

One trial is one round of the whole protocol: every surviving owner encodes its users with
``fedudp.secure.encoding.encode_owner`` (clip each user's vector, the round's public rotation,
scale, conditional rounding of *each user's* vector on a fresh stream, the sum, a fresh integer
noise share, reduction mod 2^bits), masks the result with fresh pairwise masks
(``MaskKeys(secrets.token_bytes(32), owners)``: new OS-entropy keys every trial), the last
``dropped`` owners of the roster send nothing and the survivors reveal their pair seeds with
them; the billboard side is the aggregator's own ``release`` (the secure sum, the dropped
owners' masks removed, the decoding, the public divisor q N). Nothing is reused across trials
but the public values (the rotation, the background users' vectors).

D and D' (add/remove one user): owner 0 (always a survivor) holds ``users_per_owner`` users and
a canary user at the clip norm along e_1 (included by Poisson sampling at the configured rate)
on D, and not on D'; every other owner holds ``users_per_owner`` users of a concentrated public
background. The statistic is each release's projection on the canary's direction; the lower
bound on ε is ``fedudp.privacy.audit_stats.audit_samples`` (the held-out threshold tests with
Clopper–Pearson bounds), at the ledger's δ, against the ε the ledger accounts for that one
round at its survivors, ``dp_event_for(survivors).epsilon(delta)``.

``--break noise=FACTOR`` multiplies the owners' noise shares by FACTOR while the claim stays
the accounted one (the weakened twin, as ``audit.noise_scale`` builds it).
"""

from __future__ import annotations

import copy
import dataclasses
import secrets
import time
from typing import TYPE_CHECKING

import numpy as np

from fedudp.audit.result import ALPHA, AuditResult, detection_power, parse_break

if TYPE_CHECKING:
    from fedudp.aggregators.distributed import DistributedAggregator

__all__ = ["USERS_PER_OWNER", "audit_distributed", "check_audit", "weaken_shares"]

#: the background users each owner holds in an audit trial (the canary's owner: one more on D)
USERS_PER_OWNER = 3
# the audited round (the public rotation's and the masks' round)
_ROUND = 1


def weaken_shares(agg: DistributedAggregator, factor: float) -> DistributedAggregator:
    """``--break noise=FACTOR`` for a distributed mechanism: a copy whose owners add FACTOR
    times their noise share, its ledger unchanged (the accounted std is the calibrated one).

    Parameters
    ----------
    agg : DistributedAggregator
        The configured mechanism (not changed).
    factor : float
        The noise factor (> 0).

    Returns
    -------
    DistributedAggregator
        The weakened copy.
    """
    twin = copy.copy(agg)
    twin.encoding = dataclasses.replace(agg.encoding, local_std=agg.encoding.local_std * factor)
    twin.noise_scale = agg.noise_scale * factor
    return twin


def check_audit(
    agg: DistributedAggregator, dropped: int, broken: str = "", users: int = USERS_PER_OWNER
) -> float | None:
    """The audit's plain values, refused in one line before any work.

    Parameters
    ----------
    agg : DistributedAggregator
        The mechanism.
    dropped : int
        ``--dropped``: owners that drop out of every audited round.
    broken : str, default ""
        ``--break``.
    users : int, default USERS_PER_OWNER
        Background users per owner.

    Returns
    -------
    float or None
        The ``--break noise`` factor (None: not broken).

    Raises
    ------
    ValueError
        Not a distributed mechanism, a ``--break`` other than noise, too many (or negative)
        dropped owners, a negative number of users.
    """
    from fedudp.aggregators.distributed import DistributedAggregator

    if not isinstance(agg, DistributedAggregator):
        raise ValueError(f"audit_distributed: {agg.name} is not a distributed mechanism")
    kind, factor = parse_break(broken)
    if kind not in ("", "noise"):
        raise ValueError(
            f"--break {broken}: the distributed mechanisms clip in the owners' encoding and "
            "their schedule is public; use --break noise=FACTOR"
        )
    survivors = agg.owners - int(dropped)
    if int(dropped) < 0 or survivors < agg.min_owners:
        raise ValueError(
            f"--dropped {dropped}: {survivors} of {agg.owners} owners would survive, below "
            f"train.min_owners={agg.min_owners} (the round is withheld: nothing to audit); "
            f"use 0..{agg.owners - agg.min_owners}"
        )
    if int(users) < 0:
        raise ValueError(f"users_per_owner={users}: at least 0 background users per owner")
    return factor


def audit_distributed(
    agg: DistributedAggregator,
    trials: int,
    delta: float,
    seed: int = 0,
    broken: str = "",
    *,
    dropped: int = 0,
    users_per_owner: int = USERS_PER_OWNER,
    background: float = 0.1,
) -> AuditResult:
    """Audit one round of a distributed mechanism with ``trials`` runs of the protocol on each
    of D and D' (the module docstring).

    Parameters
    ----------
    agg : DistributedAggregator
        The configured ``ddgauss`` or ``skellam`` mechanism (not changed).
    trials : int
        Rounds per side (at least 200).
    delta : float
        The ledger's δ.
    seed : int, default 0
        The audit's seed (background, sampling, rounding and noise streams; the mask keys are
        fresh OS entropy every trial, and cancel).
    broken : str, default ""
        ``--break``: ``noise=FACTOR`` (the owners' shares times FACTOR).
    dropped : int, default 0
        Owners that drop out every trial (the last of the roster; the canary's owner 0
        survives); the survivors must reach ``min_owners``.
    users_per_owner : int, default USERS_PER_OWNER
        Background users per owner.
    background : float, default 0.1
        The background users' spread, as a fraction of the clip.

    Returns
    -------
    AuditResult
        The round's accounted ε at its survivors, the lower bound and the audit's power.

    Raises
    ------
    ValueError
        Not a distributed mechanism, a ``--break`` other than noise, too many dropped owners,
        or fewer than 200 trials.
    """
    from fedudp.privacy.audit_stats import audit_samples

    factor = check_audit(agg, dropped, broken, users_per_owner)
    t0 = time.perf_counter()
    survivors = agg.owners - int(dropped)
    claimed = agg.dp_event_for(survivors).epsilon(delta)
    mech = weaken_shares(agg, factor) if factor is not None else agg
    outs = _releases(mech, trials, seed, int(dropped), int(users_per_owner), background)
    samples = audit_samples(outs["D"], outs["D'"], delta, ALPHA)
    power = detection_power(samples, claimed, delta, trials, factor or 1.0, False)
    e = agg.encoding
    return AuditResult(
        f"{agg.name} ({e.bits} bits, {survivors} of {agg.owners} owners)",
        agg.adjacency,
        trials,
        delta,
        claimed,
        samples,
        e.clip,
        broken,
        time.perf_counter() - t0,
        power,
        False,
    )


def _releases(
    mech: DistributedAggregator,
    trials: int,
    seed: int,
    dropped: int,
    users: int,
    background: float,
) -> dict[str, np.ndarray]:
    """``trials`` rounds on D (the canary Poisson-sampled at the rate) and on D' (absent):
    side -> [trials], each round's release projected on the canary's direction."""
    e = mech.encoding
    g = np.random.default_rng([seed, 4])
    # the owners' users: a concentrated public cohort (fixed across trials)
    rows = background * e.clip * (g.random((mech.owners, users, e.dim)) - 0.5)
    canary = np.zeros(e.dim)
    canary[0] = e.clip
    direction = canary / np.linalg.norm(canary)
    rng = np.random.default_rng([seed, 5])
    outs = {}
    for side in ("D", "D'"):
        vals = np.empty(trials)
        for t in range(trials):
            present = bool(rng.random() < mech.sampling.rate) and side == "D"
            held = [rows[j] for j in range(mech.owners)]
            if present:
                held[0] = np.vstack([rows[0], canary[None]])
            vals[t] = float(_one_round(mech, held, dropped, rng) @ direction)
        outs[side] = vals
    return outs


def _one_round(
    mech: DistributedAggregator, held: list[np.ndarray], dropped: int, rng: np.random.Generator
) -> np.ndarray:
    """One round of the protocol: the survivors' encoded, masked shares (fresh rounding and
    noise streams, fresh mask keys), their reveals for the dropped owners, the billboard's
    ``release``; the released mean [dim]."""
    from fedudp.protocol.contributions import Contribution, MaskedShare, Reveal
    from fedudp.secure.encoding import encode_owner
    from fedudp.secure.masks import MaskKeys, mask
    from fedudp.secure.public import round_signs

    e = mech.encoding
    roster = tuple(range(mech.owners))
    gone = roster[mech.owners - dropped :]
    keys = MaskKeys(secrets.token_bytes(32), mech.owners)
    signs = round_signs(mech.seed, _ROUND, e.padded)
    shares, count, clipped = [], 0, 0
    for j in roster[: mech.owners - dropped]:
        X = held[j]
        streams = rng.spawn(len(X) + 1)  # each user's rounding, then the owner's noise share
        v = encode_owner(X, e, signs, streams[:-1], streams[-1])
        shares.append(MaskedShare(j, mask(v, keys, j, roster, _ROUND, e.bits)))
        count += len(X)
        clipped += int(np.count_nonzero(np.sqrt(np.einsum("ij,ij->i", X, X)) > e.clip))
    reveals = tuple(
        Reveal(s.owner, d, keys.pair_seed(s.owner, d, _ROUND)) for s in shares for d in gone
    )
    c = Contribution(
        None,
        None,
        count,
        clipped,
        shares=tuple(shares),
        roster=roster,
        reveals=reveals,
        round_=_ROUND,
    )
    return mech.release(c).mean.numpy()
