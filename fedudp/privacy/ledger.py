"""The privacy ledger of a run: what the ε certifies, and every release (``ledger.json``).

``Ledger`` records, per round, what was released: unit, adjacency, sigma, epsilon so far
(one ``LedgerEntry`` per release). Reading a ledger file back is
``fedudp.protocol.ledger_file``; the ledger's ε recomputed from its events is
``fedudp.privacy.ledger_epsilon``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Ledger", "LedgerEntry"]


@dataclass
class LedgerEntry:
    """One release in the ledger (a line of ``ledger.jsonl``, an entry of ``ledger.json``).

    Attributes
    ----------
    round : int
        The round that released.
    event : str
        The dp-accounting event composed for it, as text.
    noise_multiplier : float or None
        The release's noise multiplier z (None where no single multiplier describes it).
    noise_std : float or None
        The standard deviation of the noise added to the released sum.
    sampling_rate : float
        The privacy units' Poisson sampling rate q of the round.
    epsilon : float or None
        ε of everything released so far, at the ledger's δ (PLD; None without DP).
    epsilon_rdp : float or None
        The same from RDP, the cross-check.
    release_sha256 : str or None
        SHA-256 of the released values (a seeded resume shows a re-release identical by it;
        post-processing of the release, nothing more). None where not recorded.
    superseded : bool
        A release made before a resume whose round was computed again
        (docs/usage.md#checkpoint-and-resume): it was made, so it is composed (``epsilon``
        counts it), but the run continued from the release computed after it.
    owners_failed : int or None
        How many owners of the round failed (a fault, a timeout, a lost node: the fail-closed
        rule released from the others; their reasons are in metrics.jsonl). None where the
        run declares no owners (a Flower strategy over the app's clients).
    """

    round: int
    event: str
    noise_multiplier: float | None
    noise_std: float | None
    sampling_rate: float
    epsilon: float | None
    epsilon_rdp: float | None
    release_sha256: str | None = None
    superseded: bool = False
    owners_failed: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The entry as a ledger line: the optional fields only where they are set."""
        d = asdict(self)
        if d["release_sha256"] is None:
            del d["release_sha256"]
        if not d["superseded"]:
            del d["superseded"]
        if d["owners_failed"] is None:
            del d["owners_failed"]
        return d


@dataclass
class Ledger:
    """Per-run privacy record (``ledger.json``): what the ε certifies, and every release.

    Attributes
    ----------
    unit : str
        The privacy unit: ``user``, ``record`` or ``owner``.
    adjacency : str
        The neighbouring relation of the analysis (add/remove one unit, or replace-one with a
        public n).
    accounting : str
        ``certified`` or ``paper`` (``privacy.accounting``).
    guarantee : str
        ``certified`` (a proven bound) or ``heuristic``; ``none`` without DP.
    mechanism : str
        The estimator's name (``gaussian``, ``winsorized``, ...; ``none`` without DP).
    accountant : str
        How the events are composed (dp-accounting's PLD with an RDP cross-check, ...).
    delta : float
        The δ at which every ε is reported.
    target_epsilon : float or None
        The budget: a round whose release would exceed it is not run.
    notes : list of str
        What else the guarantee rests on (public numbers, assumptions).
    entries : list of LedgerEntry
        One per release, in order.
    extra : dict
        Declared public numbers and mechanism-specific records (``extra["public"]``, ...).
    randomness : str
        Where the release noise and the privacy sampling came from: ``seeded (simulation)``
        (keyed by the run seed) or ``secure`` (OS entropy).
    trust : str or None
        Whom the guarantee trusts with the noise (the mechanism's placement):
        ``server: trusted (central DP)``, ``server: sees owner-side DP-SGD's noisy updates``
        or ``server: untrusted (secure aggregation)``; None without DP.
    """

    # unit, adjacency, accounting, accountant and delta are None for a run without DP
    unit: str | None
    adjacency: str | None
    accounting: str | None
    guarantee: str
    mechanism: str
    accountant: str | None
    delta: float | None
    target_epsilon: float | None
    notes: list[str] = field(default_factory=list)
    entries: list[LedgerEntry] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # where the release noise and the privacy sampling came from (fedudp.randomness.Randomness):
    # "seeded (simulation)" (keyed by the run seed) or "secure" (OS entropy)
    randomness: str = "seeded (simulation)"
    trust: str | None = None

    @property
    def epsilon(self) -> float | None:
        """ε after the last release (0 for a private run before any; None without DP)."""
        return self.entries[-1].epsilon if self.entries else (0.0 if self.private else None)

    @property
    def private(self) -> bool:
        """Whether the run is differentially private (a mechanism other than ``none``)."""
        return self.mechanism != "none"

    def to_dict(self) -> dict[str, Any]:
        """The ledger as ``ledger.json`` holds it (ε, its kind and the released rounds added)."""
        d = asdict(self)
        d["entries"] = [e.as_dict() for e in self.entries]
        d["epsilon"] = self.epsilon
        # beside the number, what it is: a proven bound (certified) or not (heuristic)
        d["epsilon_kind"] = self.guarantee if self.private else None
        # the rounds whose release the run continued from; every entry (superseded ones, made
        # before a resume and computed again, included) is a release composed into epsilon
        d["rounds_released"] = sum(not e.superseded for e in self.entries)
        return d
