"""The choices both sides of the protocol and the configuration share (``fedudp.config``
imports them from here, so that nothing below the config builder imports the configuration):
the method, the privacy unit, where the noise is added, what the owners send for the shared
parameters and how the billboard weights owner-level updates. Standard library only."""

from __future__ import annotations

from fedudp.plain import Choice

__all__ = ["Method", "Unit", "Placement", "SharedUpdate", "OwnerWeights"]


class Method(Choice):
    joint_dp = "joint_dp"
    full_dp = "full_dp"
    fedavg = "fedavg"
    per_silo = "per_silo"


class Unit(Choice):
    """The privacy unit."""

    user = "user"
    record = "record"
    owner = "owner"


class Placement(Choice):
    """Where the noise is added: on the billboard, or in the owners (DP-SGD)."""

    server = "server"
    local_dpsgd = "local_dpsgd"


class SharedUpdate(Choice):
    """What the owners send for the shared parameters: a model delta or a gradient."""

    delta = "delta"
    gradient = "gradient"


class OwnerWeights(Choice):
    """How the billboard averages owner-level updates (fedavg, owner-side DP-SGD)."""

    uniform = "uniform"
    size = "size"
