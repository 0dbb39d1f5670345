"""One release path: the privacy-critical rules of a release, written once
(docs/architecture.md#one-release-path).

A release passes the :class:`ReleaseGate`: before the round runs, the budget check (the next
event's ε at most the target, with a relative slack of ``BUDGET_SLACK`` for the last digits of
a calibration); once the owners answered, the fail-closed decision
(``fedudp.billboard.fail_closed.withhold_reason``: a withheld round composes nothing); after the
estimator released, the composition of the round's event into the accountant, the
``LedgerEntry`` and its append to the ledger and to the durable sink
(``fedudp.protocol.ledger_file.LedgerFile.append``) *before* the release leaves. fedudp's
billboard (``fedudp.billboard.server.Billboard``) and the Flower wrapper
(``fedudp.flower.UserLevelDP``) both hold one and keep no copy of these rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeAlias

from fedudp.billboard.fail_closed import withhold_reason
from fedudp.privacy.accountant import ApproxDp, Ledger, LedgerEntry, Parallel
from fedudp.privacy.protocol import AccountantLike

if TYPE_CHECKING:
    import dp_accounting

    from fedudp.aggregators.base import Aggregator

__all__ = ["BUDGET_SLACK", "Event", "ReleaseGate"]

# what a round releases, for the accountant: a dp-accounting event, a Parallel one, or a block
Event: TypeAlias = "dp_accounting.DpEvent | Parallel | ApproxDp"

# the budget's relative slack: a run calibrated to spend exactly its target ε reaches it up to
# the last digits of the accountant's arithmetic, and must not stop one round early for that
BUDGET_SLACK = 1e-9


@dataclass
class ReleaseGate:
    """The budget check, the fail-closed rule, the composition and the ledger of every release.

    Parameters
    ----------
    ledger : Ledger
        Where each release's ``LedgerEntry`` is appended, in order.
    accountant : AccountantLike or None
        What composes the events (``fedudp.privacy.accountant.accountant_for``,
        ``fedudp.privacy.protocol.AccountantLike``); None for a non-private release (no ε, no
        budget).
    delta : float or None
        The δ at which every ε is read.
    target_epsilon : float or None
        The budget: a release whose composition would exceed it is not made (None: no stop).
    min_owners, min_users : int
        The fail-closed minimum (``train.min_owners`` / ``train.min_users``,
        ``fedudp.train.min_owners`` / ``min_users`` for Flower): fewer answering owners, or
        fewer declared user slots among them, and the round releases nothing.
    sink : callable or None
        Called with each entry right after it is appended, before the release leaves (the
        durable ``ledger.jsonl``, ``fedudp.protocol.ledger_file.LedgerFile.append``); None:
        the ledger is kept in memory only.

    Notes
    -----
    The caller's order is: ``over_budget`` before the round (a stop is final), ``withhold``
    once the owners answered, then the estimator's release, then ``record`` before anything
    released leaves the server. Nothing here reads the contributions: every decision is taken
    from public numbers (the events, the declared minimum and capacities, the target).
    """

    ledger: Ledger
    accountant: AccountantLike | None
    delta: float | None
    target_epsilon: float | None = None
    min_owners: int = 1
    min_users: int = 1
    sink: Callable[[LedgerEntry], None] | None = field(default=None, repr=False)

    def compose_once(self, event: Event) -> None:
        """Compose a block spent once for the whole run, up front (an estimator's or a plan's
        one-off event: AboveThreshold's ε/2, failure probabilities that enter δ); it has no
        ledger entry of its own (the ledger's ``extra`` names it)."""
        acc, _ = self._private()
        acc.compose(event)

    def recompose(self, events: Sequence[Event | None]) -> float | None:
        """Compose again, in order, the events of releases already in a ledger (a checkpoint's,
        which the caller puts back into the ledger itself); returns the ε then (None for a
        non-private gate)."""
        if self.accountant is None:
            return None
        acc, _ = self._private()
        for event in events:
            if event is not None:
                acc.compose(event)
        return self.epsilon()

    def epsilon(self) -> float | None:
        """The ε of everything composed so far at ``delta`` (None for a non-private gate)."""
        if self.accountant is None:
            return None
        acc, delta = self._private()
        return float(acc.epsilon(delta))

    def epsilon_if(self, event: Event | None) -> float | None:
        """The ε if ``event`` were composed now, without composing it (None: non-private)."""
        if self.accountant is None or event is None:
            return None
        acc, delta = self._private()
        return float(acc.epsilon_if(event, delta))

    def over_budget(self, event: Event | None) -> str | None:
        """Why the next release of ``event`` must not be made (None: it may).

        Parameters
        ----------
        event : Event or None
            What the next release composes (None: a non-private round).

        Returns
        -------
        str or None
            ``"release would reach epsilon ... > target ..."`` when composing ``event``
            would take ε above ``target_epsilon · (1 + BUDGET_SLACK)``; None within budget, or
            without a target or an accountant.
        """
        if self.target_epsilon is None:
            return None
        eps = self.epsilon_if(event)
        if eps is None or eps <= self.target_epsilon * (1 + BUDGET_SLACK):
            return None
        return f"release would reach epsilon {eps:.4g} > target {self.target_epsilon:g}"

    def within_budget(self, event: Event | None) -> bool:
        """Whether the next release of ``event`` stays within the budget (``over_budget``)."""
        return self.over_budget(event) is None

    def withhold(
        self,
        answered_owners: int,
        slots: int,
        failed_owners: int,
        *,
        who: str = "owner",
        key: str = "train.",
    ) -> str | None:
        """Fail closed: why this round must release nothing (None: release).

        Parameters
        ----------
        answered_owners : int
            The owners (clients) that answered with a valid contribution.
        slots : int
            The declared user slots they hold (public capacities; never the sampled count).
        failed_owners : int
            How many failed (for the message only).
        who, key : str
            What an owner is called and the prefix of the minimum's config keys, in the message.

        Returns
        -------
        str or None
            ``fedudp.billboard.fail_closed.withhold_reason``'s reason; None to release. A
            withheld round composes nothing: the caller must not call ``record`` for it.
        """
        return withhold_reason(
            answered_owners,
            slots,
            failed_owners,
            self.min_owners,
            self.min_users,
            who=who,
            key=key,
        )

    def record(
        self,
        round_: int,
        event: Event | None,
        aggregator: Aggregator,
        sampling_rate: float,
        release_sha256: str | None,
        owners_failed: int | None = None,
    ) -> LedgerEntry:
        """Compose round ``round_``'s release and ledger it (memory, then the sink), before it
        leaves.

        Parameters
        ----------
        round_ : int
            The round.
        event : Event or None
            What the release composes (None: non-private, nothing composed).
        aggregator : Aggregator
            The estimator that released (its ``noise_multiplier`` and ``noise_std`` are
            ledgered).
        sampling_rate : float
            The public sampling rate q of the round.
        release_sha256 : str or None
            The SHA-256 of what the estimator released
            (``fedudp.protocol.ledger_file.release_digest``).
        owners_failed : int or None, default None
            How many owners failed in the round (None: no owners declared).

        Returns
        -------
        LedgerEntry
            The entry, with the ε (and the RDP cross-check) of everything composed with it.
        """
        entry = LedgerEntry(
            int(round_),
            str(event),
            aggregator.noise_multiplier,
            aggregator.noise_std,
            float(sampling_rate),
            None,
            None,
            release_sha256,
            owners_failed=owners_failed,
        )
        return self.append(entry, event)

    def append(self, entry: LedgerEntry, event: Event | None) -> LedgerEntry:
        """Compose ``event`` (when private), set ``entry``'s ε to that of everything composed,
        append it to the ledger and hand it to the sink; returns the entry as ledgered. A
        release made before a resume (``superseded``) enters here too: it was made."""
        if self.accountant is not None and event is not None:
            acc, delta = self._private()
            acc.compose(event)
            eps, rdp = float(acc.epsilon(delta)), acc.epsilon_rdp(delta)
            entry = replace(entry, epsilon=eps, epsilon_rdp=None if rdp is None else float(rdp))
        self.ledger.entries.append(entry)
        if self.sink is not None:  # durable before the release leaves (step, broadcast)
            self.sink(entry)
        return entry

    def _private(self) -> tuple[AccountantLike, float]:
        """The accountant and δ of a private gate (``ValueError`` naming what is missing)."""
        if self.accountant is None:
            raise ValueError("a private release needs an accountant (accountant_for)")
        if self.delta is None:
            raise ValueError("a private release needs its delta (privacy.delta)")
        return self.accountant, float(self.delta)
