"""The choices both sides of the protocol and the configuration share (``fedudp.config``
imports them from here, so that nothing below the config builder imports the configuration):
the method, the privacy unit, where the noise is added, what the owners send for the shared
parameters and how the billboard weights owner-level updates. Standard library only."""

from __future__ import annotations

from fedudp.plain import Choice

__all__ = ["Method", "Unit", "Placement", "SharedUpdate", "OwnerWeights"]


class Method(Choice):
    """The compared method (docs/algorithms.md: one algorithm, four configurations).

    Attributes
    ----------
    joint_dp : str
        The shared part released with DP, ``model.personal`` kept by each owner.
    full_dp : str
        Every parameter shared and released with DP.
    fedavg : str
        Every parameter shared, a plain mean (no privacy).
    per_silo : str
        Nothing shared: each owner trains alone.
    """

    joint_dp = "joint_dp"
    full_dp = "full_dp"
    fedavg = "fedavg"
    per_silo = "per_silo"


class Unit(Choice):
    """The privacy unit.

    Attributes
    ----------
    user, record, owner : str
        What one unit of privacy protects: a user's records, one record, an owner's users.
    """

    user = "user"
    record = "record"
    owner = "owner"


class Placement(Choice):
    """Where the noise is added: on the billboard, or in the owners (DP-SGD).

    Attributes
    ----------
    server : str
        The billboard's release noise.
    local_dpsgd : str
        DP-SGD in the owners.
    distributed : str
        Integer noise shares in the owners, summed under secure aggregation (the server is
        not trusted with the noise: ``aggregator=ddgauss`` or ``skellam``).
    """

    server = "server"
    local_dpsgd = "local_dpsgd"
    distributed = "distributed"


class SharedUpdate(Choice):
    """What the owners send for the shared parameters: a model delta or a gradient.

    Attributes
    ----------
    delta, gradient : str
        A model delta after local training; a gradient.
    """

    delta = "delta"
    gradient = "gradient"


class OwnerWeights(Choice):
    """How the billboard averages owner-level updates (fedavg, owner-side DP-SGD).

    Attributes
    ----------
    uniform, size : str
        Every owner alike; by its records (owner-side DP-SGD: its public records).
    """

    uniform = "uniform"
    size = "size"
