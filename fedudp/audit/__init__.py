"""An empirical privacy audit of one configured release: ``fedudp-audit [overrides]``.

The configured mechanism releases many times on two neighbouring datasets D and D', and
``fedudp.privacy.audit_stats`` turns the two samples into a lower bound on ε at the ledger's δ
(probability ≥ 99% jointly over the bounds tried), printed beside the ε the accountant claims for
one release. A lower bound above the claim is a violation: the mechanism releases less noise, or
lets one unit move it further, than it is accounted for.

What is audited:

* the billboard's release (``privacy.placement=server``, the default): the configured aggregator,
  built and calibrated exactly as a run builds it, on ``--dim``-vectors; D holds a worst-case
  *canary* unit (at the clip norm, or at the bound for the replace-one estimators, along e_1), D'
  does not (add/remove) or holds it at the opposite extreme (replace-one). Every release is the
  aggregator's own owner side (``constraint``) and billboard side (``release``) with a fresh seeded
  generator, the canary included by Poisson sampling at the configured rate;
* owner-side DP-SGD (``privacy.placement=local_dpsgd``): the real owner path
  (``Owners.owner_deltas``) on owner 0 of a configured federation whose owners hold ``M`` users
  each (their public capacity), D with all ``M``, D' without its first user (the canary: features
  scaled up and the label that maximizes its gradient, so its gradient is clipped); one round.
  ``--owner-users`` picks the M's (``m:M``: an owner holding m users below its public capacity
  M, D' m - 1, the schedule following M on both sides); ``--natural K``: natural users of
  1..K records each instead, built in memory from plain arrays with every public number declared
  (``natural_records``), the owner's capacity, q and steps the prepared run's own; the default pairs are one owner below the batch B and one
  crossing a multiple of B (``B//3`` and ``B+1``: 10 → 9 and 33 → 32 at B = 32);
* ``--pair paper_leak``: the joint-DP paper-mode leak pair (``fedudp.leak``);
* the distributed mechanisms (``aggregator=ddgauss`` / ``skellam``, ``privacy.placement=
  distributed``; ``audit_distributed``): one round of the whole protocol per trial, every
  owner encoding its users with fresh rounding and noise streams and masking with fresh
  pairwise keys, the last ``--dropped`` owners dropping out (the survivors reveal), the
  billboard's secure sum and decoding; D's owner 0 holds a canary user at the clip norm, D''s
  does not; the claim is the round's ε at its survivors.

Stateful and sequential mechanisms (``audit_sequence``): every trial starts from a fresh copy of
the configured aggregator (never one reused across trials: an adaptive clip carried from trial
to trial drifts, 1.0 to 4e-261 over 50,000 releases, and the audit then measured that drift,
not the mechanism). ``--sequence T`` makes one trial T releases of that fresh copy, on D (the
canary present in every round it takes part in: a tree's unit in the first round of every tree,
the leaf in the most nodes; a banded mechanism's in the first round of every cycle, sampled at
the group rate; Poisson at the rate otherwise) or D' (absent); the statistic sees the whole
released sequence (T × dim numbers, plus an adaptive clip's noisy unclipped count per round),
scored on the linear discriminant, the likelihood-ratio direction of correlated Gaussian noise
(the tree's prefix-sum noise, the banded C̃⁻¹ζ). The claim is the ledger's ε for the same T
releases. ``dp_ftrl_tree`` and ``dp_mf_banded`` default to T = the run's rounds (at most 64);
``gaussian_adaptive`` to T = 1, each release centred by the background's clipped sum and
count at the public current clip and scaled by its noise (exactly Gaussian residuals at
sampling rate 1). Owner-side DP-SGD with ``privacy.clip_policy=adaptive`` audits the owner's
release as it is sent: its noisy delta and its mean noisy unclipped fraction.

Tests: the distribution-free threshold test with its region chosen on a held-out half, on the
projection along the mean shift and on the squared distance from D''s mean; and, where the release
is Gaussian by construction (an unsampled Gaussian release, or one DP-SGD step with every user
in it), a Gaussian-DP fit of the projection, near-optimal there. The audit prints its power: the
noise cut it would detect at the given number of releases.

``--break`` weakens the mechanism on purpose, to show that the audit catches it:
``noise=FACTOR`` (any factor; the noise is multiplied by it; an adaptive clip's update and count
noises both), ``clip=off`` (server-side release:
the owners send unclipped vectors and the canary is 10 times the clip norm) and
``schedule=data`` (owner-side DP-SGD: the sampling rate, step count and divisor taken from the
users each neighbour actually holds: a schedule read from the data).

Power: for the robust estimators the certified sensitivity (a worst case over all datasets) far
exceeds one unit's influence on a typical cohort, so their audit bound stays well below the claim
and says little (it is said).

The package, one module per part: ``result`` (what an audit returns, the ledger's claim, the
``--break`` weakenings), ``server`` (the billboard's release: ``audit``, ``audit_pair``),
``sequence`` (stateful and sequential mechanisms: ``audit_sequence``), ``distributed``
(the distributed mechanisms under secure aggregation: ``audit_distributed``), ``local_dpsgd``
(owner-side DP-SGD: ``audit_local_dpsgd``, ``natural_records``), ``report`` (the printed
table), ``flags`` (the command line and its checks) and ``cli`` (``main``, the console script
``fedudp-audit``).
"""

from __future__ import annotations

from fedudp.audit.cli import main
from fedudp.audit.distributed import audit_distributed
from fedudp.audit.local_dpsgd import AUDIT_DPSGD, audit_local_dpsgd, natural_records
from fedudp.audit.result import (
    ALPHA,
    NOISE_BREAKABLE,
    AuditResult,
    one_release_epsilon,
    parse_break,
    releases_epsilon,
    weaken,
)
from fedudp.audit.sequence import LINEAR_NOISE, SEQUENCE_AUDITED, audit_sequence, canary_rounds
from fedudp.audit.server import audit, audit_pair

__all__ = [
    "ALPHA",
    "AUDIT_DPSGD",
    "LINEAR_NOISE",
    "NOISE_BREAKABLE",
    "SEQUENCE_AUDITED",
    "AuditResult",
    "audit",
    "audit_distributed",
    "audit_local_dpsgd",
    "audit_pair",
    "audit_sequence",
    "canary_rounds",
    "main",
    "natural_records",
    "one_release_epsilon",
    "parse_break",
    "releases_epsilon",
    "weaken",
]
