"""The paper-mode leak of joint DP as a neighbouring pair
(docs/algorithms.md#certified-vs-paper-accounting).

Huang et al. (001) account each step as if a user's shared vector depended only on that user's
records. In ``privacy.accounting=paper`` the shared vectors are computed at the owner's own
personal parameters, trained without noise on *all* its users; adding one user moves those
personal parameters, hence every other user's vector of that owner. This module builds the
pair that shows it, with the project's own owner component:

linear model; 4 owners × 20 users × 10 records, one class per owner; one user of owner 0
relabelled to another class (so it pulls its owner's personal bias); 20 personal epochs; clip
C = 0.05, near the vectors' size; one round, every user. D holds that user, D' does not
(add/remove-one-user adjacency). ``clipped_sums`` gives the owner side's clipped sums on both
(the billboard adds the noise). In ``certified`` mode the vectors are computed at the public
personal value, so the sums differ by at most C; in ``paper`` mode by ≈ 15 C.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedudp.config import ConfigError, RunConfig, config_from_overrides

__all__ = [
    "leak_config",
    "LeakPair",
    "clipped_sums",
]

if TYPE_CHECKING:
    from fedudp.protocol.contributions import Contribution

_PAIR = {
    "method": "joint_dp",
    "progress": False,
    "dataset.name": "synthetic",
    "dataset.features": 12,
    "dataset.num_records": 800,
    "dataset.pool_train": 20000,
    "dataset.pool_test": 200,
    "partition.num_owners": 4,
    "partition.records_per_user": 10,
    "partition.classes_per_owner": 1,
    "train.personal_epochs": 20,
    "train.batch_size": 10,
    "train.rounds": 1,
    "privacy.clip": 0.05,
    "privacy.epsilon": 1.0,
    "privacy.delta": 1e-5,
    "engine_opts.float64": True,
}


def leak_config(**overrides: Any) -> RunConfig:
    """The pair's configuration. The pair runs on the CPU only (``engine_opts.device`` other than
    ``cpu`` is refused).

    Parameters
    ----------
    overrides
        Dotted keys, e.g. ``privacy.accounting``.

    Returns
    -------
    RunConfig
        The configuration.

    Raises
    ------
    ConfigError
        When ``engine_opts.device`` is not ``cpu``, or an override is invalid.
    """
    if str(overrides.get("engine_opts.device", "cpu")) != "cpu":
        raise ConfigError(
            f"engine_opts.device={overrides['engine_opts.device']}: the leak pair runs on the "
            "CPU only; drop the override"
        )
    return config_from_overrides({**_PAIR, **overrides})


@dataclass
class LeakPair:
    """The owner side's output on D (with the canary user) and D' (without).

    Attributes
    ----------
    with_user, without_user : Contribution
        The clipped sums on D and D'.
    clip : float
        The clipping norm C.
    prepared : Any
        The ``fedudp.run.Prepared`` of the pair (its aggregator, ledger, config).
    """

    with_user: Contribution
    without_user: Contribution
    clip: float
    prepared: Any  # fedudp.run.Prepared (its aggregator, ledger, config)

    @property
    def moved(self) -> float:
        """‖S(D) − S(D')‖ in units of C: the pair's real sensitivity (≤ 1 when isolation holds)."""
        a, b = self.with_user.total, self.without_user.total
        assert a is not None and b is not None  # clipped sums of users' vectors
        diff = a.to(torch.float64) - b.to(torch.float64)
        return float(torch.linalg.vector_norm(diff)) / self.clip


def clipped_sums(cfg: RunConfig) -> LeakPair:
    """The owner side's contributions on both neighbours of the pair of the module doc.

    Parameters
    ----------
    cfg
        The pair's configuration (``leak_config``).

    Returns
    -------
    LeakPair
        Every user's shared vector, clipped by the aggregator's constraint and summed, on each
        neighbour.
    """
    from fedudp.build import prepare

    p = prepare(cfg)
    assert p.billboard is not None and p.aggregator is not None  # a joint_dp run's
    fed, owners, shared = p.fed, p.owners, p.billboard.shared_params()
    u = int(fed.owner_user_offsets[0])  # owner 0's first user: the canary
    r0, r1 = fed.user_offsets[u], fed.user_offsets[u + 1]
    fed.y[r0:r1] = (fed.y[r0] + 1) % fed.num_classes  # relabelled to another class
    constraint = p.aggregator.constraint

    def contribution(f):
        personal = owners.personal_round(f, shared, owners.initial_personal(f.num_owners), 1)
        G = torch.cat(
            [g for _, g in owners.user_vectors(f, shared, personal, np.arange(f.num_users), 1)]
        )
        return constraint.apply(G)

    assert constraint.clip is not None  # a clipping constraint
    return LeakPair(contribution(fed), contribution(fed.without_user(u)), float(constraint.clip), p)
