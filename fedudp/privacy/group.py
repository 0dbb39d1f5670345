"""Group privacy: user level from record level (docs/algorithms.md#group-privacy).

``GroupConversion`` converts a record-level guarantee to the user level; ``GroupAccountant``
(``fedudp.privacy.accountant``) reads an accountant through it. Re-exported by
``fedudp.privacy.accountant``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GroupConversion"]


@dataclass(frozen=True)
class GroupConversion:
    """User level from record level by group privacy (docs/algorithms.md#group-privacy; Huang et al.
    (001) Lemma 3.6): a mechanism (ε', δ')-DP for one-record changes is, for the ``size`` = k
    records of one user, (kε', k·e^{(k−1)ε'}·δ')-DP (the standard form, ``form="certified"``)
    or, as Huang et al. write it, (kε', k·e^{kε'}·δ') (``form="paper"``).

    ``for_user_budget`` picks the record-level (ε/k, δ') that yields the user-level target:
    certified δ' = δ / (k·e^{(k−1)ε/k}), the exact inverse of the standard form (at k = 1 it is
    δ); paper δ' = δ·r/m = δ/k as in the paper, which by its own form only gives user-level
    (ε, e^ε·δ): heuristic."""

    size: int
    record_delta: float
    form: str = "certified"

    @classmethod
    def for_user_budget(cls, size: int, epsilon: float, delta: float, form: str) -> GroupConversion:
        """The conversion whose user-level guarantee is (``epsilon``, ``delta``) for groups of
        ``size`` records."""
        if size < 1:
            raise ValueError(f"group size must be >= 1, got {size}")
        if form not in ("certified", "paper"):
            raise ValueError(f"form must be certified or paper, got {form}")
        k = int(size)
        rd = delta / (k * math.exp((k - 1) * epsilon / k)) if form == "certified" else delta / k
        return cls(k, rd, form)

    def user_epsilon(self, record_epsilon: float) -> float:
        """The user-level ε of a record-level ``record_epsilon``: k times it."""
        return self.size * record_epsilon

    def record_epsilon(self, user_epsilon: float) -> float:
        """The record-level ε' whose conversion is ``user_epsilon`` (what the noise is
        calibrated to, and whose PLD grid the ledger accounts on)."""
        return user_epsilon / self.size

    def user_delta(self, record_epsilon: float) -> float:
        """The user-level δ that group privacy gives at record level (record_epsilon, δ')."""
        k, e = self.size, record_epsilon
        return k * math.exp(((k - 1) if self.form == "certified" else k) * e) * self.record_delta

    def __str__(self) -> str:
        return (
            f"GroupConversion(k={self.size}, record_delta={self.record_delta:.6g}, "
            f"form={self.form})"
        )
