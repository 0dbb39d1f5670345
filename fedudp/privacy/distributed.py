"""Accounting of the distributed discrete Gaussian and Skellam mechanisms
(docs/algorithms.md#distributed-dp): the public face of two modules.

* ``fedudp.privacy.distributed_rdp``: the rounding bounds, τ, the RDP curves (Kairouz, Liu &
  Steinke 2021, Prop. 14; Agarwal, Kairouz & Liu 2021), Zhu–Wang's Poisson subsampling, the
  round's ``DistributedDpEvent`` and the conversion to (ε, δ) with dp-accounting.
* ``fedudp.privacy.distributed_calibration``: the local std for a target (ε, δ), the heuristic
  scale and their joint choice.

``fedudp.privacy.accountant.Accountant`` composes ``DistributedDpEvent``s (summed RDP curves).
"""

from __future__ import annotations

from fedudp.privacy.distributed_calibration import (
    calibrate_local_std,
    distributed_params,
    heuristic_scale,
)
from fedudp.privacy.distributed_rdp import (
    NOISES,
    RDP_ORDERS,
    DistributedDpEvent,
    ddg_rdp,
    ddg_tau,
    distributed_event,
    distributed_rdp_epsilon,
    rdp_epsilon,
    rounded_l1_bound,
    rounded_l2_bound,
    skellam_rdp,
    subsampled_rdp,
)

__all__ = [
    "NOISES",
    "RDP_ORDERS",
    "DistributedDpEvent",
    "calibrate_local_std",
    "ddg_rdp",
    "ddg_tau",
    "distributed_event",
    "distributed_params",
    "distributed_rdp_epsilon",
    "heuristic_scale",
    "rdp_epsilon",
    "rounded_l1_bound",
    "rounded_l2_bound",
    "skellam_rdp",
    "subsampled_rdp",
]
