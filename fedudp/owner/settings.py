"""The owner side's settings: every public number and choice ``Owners`` trains with.

Built once per run by the builder (``fedudp.build``) from the run's configuration; nothing below
the builder reads the configuration itself. Everything here is public (declared before any
data is read).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedudp.owner.kernels import Kernels
from fedudp.owner.local_sgd import LocalSpec
from fedudp.protocol.choices import OwnerWeights

__all__ = ["OwnerTraining"]


@dataclass(frozen=True)
class OwnerTraining:
    """Public hyperparameters of the owner side.

    Parameters
    ----------
    user : LocalSpec
        Users' (and owners') local SGD.
    personal : LocalSpec
        The personal update's local SGD.
    mode : str
        Whether a user's vector is its ``delta`` or its mean ``gradient``.
    owner_weights : str
        How owner-level updates are weighted: ``uniform`` or ``size``.
    dpsgd_records : bool
        ``privacy.group_privacy``: owner-side DP-SGD samples and clips records, not users.
    dpsgd_capacity : tuple of int or None
        Owner-side DP-SGD (``owner_dpsgd``): each owner's public capacity, indexed by global
        owner id, in DP-SGD units (users; records with ``dpsgd_records``). The sampling rate,
        the step count and the divisor come from it, never from the data
        (``fedudp.owner.dpsgd``).
    public_owner_records : tuple of int or None
        Each owner's public record count (global owner id): the ``owner_weights=size``
        weights of owner-side DP-SGD's deltas (the actual counts would be data the billboard
        reads).
    sort_users : bool
        Users of unequal sizes (natural federations): vmap the cohort in chunks of users
        sorted by record count, so a chunk's steps follow its largest user with little
        padding; rows are handed on in the cohort's order (docs/benchmarks.md).
    secure_randomness : bool
        ``privacy.randomness=secure``: owner-side DP-SGD's sampling and noise from OS entropy.
    kernels : Kernels
        The batched paths the owners may take (``fedudp.owner.kernels``); every choice computes
        the same values up to float rounding.
    """

    user: LocalSpec
    personal: LocalSpec
    mode: str
    owner_weights: str = OwnerWeights.uniform.value
    dpsgd_records: bool = False
    dpsgd_capacity: tuple[int, ...] | None = None
    public_owner_records: tuple[int, ...] | None = None
    sort_users: bool = False
    secure_randomness: bool = False
    kernels: Kernels = field(default_factory=Kernels)
