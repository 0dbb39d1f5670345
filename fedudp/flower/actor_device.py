"""An engine=flower actor's device (docs/engines.md#gpus): its owners' kernels on the GPU Ray
gives it, everything it keeps or sends on the CPU.

With ``engine_opts.device=cuda`` (and ``engine_opts.num_gpus > 0``, the schema's rule) the
driver builds on the CPU (``fedudp.build.device``) and each actor builds its owners and its
block's federation on ``cuda``: Ray sets an actor's ``CUDA_VISIBLE_DEVICES`` to the GPU(s) it
reserved for it, so ``cuda`` is the actor's own GPU. What crosses the actor's boundary stays as
with the CPU: the broadcast arrives as CPU arrays and is moved to the device (``on_device``);
the reply's vectors (``cpu_reply``), the personal parameters kept in ``context.state`` and
written to checkpoints (``on_cpu``) leave as CPU tensors, so the wire format is unchanged and
any engine or device can resume a checkpoint. Noise is never drawn here (the billboard's, on
the CPU in float64).

An actor whose torch sees no CUDA device (a node without a CUDA build of torch or a driver)
raises ``OwnerFailure`` (``actor_device``): its owners are excluded from the round and recorded
with that reason under the fail-closed rule, as any failure of an owner's infrastructure (it
depends on the node, never on the data). A cluster with no GPU at all is refused before any
work (``fedudp.flower.cluster.preflight``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

from fedudp.protocol.messages import OwnerFailure, OwnerReply

__all__ = ["actor_device", "on_device", "on_cpu", "cpu_reply"]


def actor_device(device: str) -> torch.device:
    """``engine_opts.device``, where this actor builds its owners
    (``fedudp.build.owners(cfg, actor=True)``), checked against what torch sees here.

    Parameters
    ----------
    device : str
        The run's ``engine_opts.device`` (cpu, cuda or cuda:0 with engine=flower).

    Returns
    -------
    torch.device
        ``cpu``, or ``cuda`` (the actor's first visible GPU).

    Raises
    ------
    OwnerFailure
        ``device`` is a CUDA device this actor's torch does not see.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen <= (dev.index or 0):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise OwnerFailure(
            f"engine_opts.device={device}: torch in this Flower actor (pid "
            f"{os.getpid()}, CUDA_VISIBLE_DEVICES={visible}) sees {seen} CUDA device(s); "
            "install a CUDA build of torch on its node, or use engine_opts.device=cpu"
        )
    return dev


def on_device(params: Mapping[str, torch.Tensor], dev: torch.device) -> dict[str, torch.Tensor]:
    """``params`` on ``dev`` (the same tensors where they are there already).

    Parameters
    ----------
    params : Mapping[str, torch.Tensor]
        The broadcast, or personal parameters read from the wire, the state or a checkpoint.
    dev : torch.device
        The owners' device (``Owners.device``).

    Returns
    -------
    dict[str, torch.Tensor]
    """
    return {k: v.to(dev) for k, v in params.items()}


def on_cpu(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``params`` on the CPU (``.cpu()``: the same tensors where they are there already), for
    ``context.state``, a checkpoint's state file or the wire.

    Parameters
    ----------
    params : Mapping[str, torch.Tensor]

    Returns
    -------
    dict[str, torch.Tensor]
    """
    return {k: v.detach().cpu() for k, v in params.items()}


def cpu_reply(rep: OwnerReply) -> OwnerReply:
    """The reply with its vectors (``rows``, ``total``) on the CPU, as the wire carries them (a
    distributed mechanism's masked shares are numpy already).

    Parameters
    ----------
    rep : OwnerReply
        The owners' reply, its vectors on their device.

    Returns
    -------
    OwnerReply
        A copy whose vectors are CPU tensors (the same values; ``rep`` itself without vectors).
    """
    c = rep.contribution
    if c.rows is None and c.total is None:
        return rep
    moved = dataclasses.replace(
        c,
        rows=None if c.rows is None else c.rows.detach().cpu(),
        total=None if c.total is None else c.total.detach().cpu(),
    )
    return dataclasses.replace(rep, contribution=moved)
