"""``engine=flower`` on a Ray cluster: its resources checked before any work, and a lost actor
or node treated as an owner failure (docs/engines.md#failures).

* ``preflight(settings, device)`` starts (or joins, ``engine_opts.address``) the Ray that
  Flower's simulation then uses, and refuses in one line (``ConfigError``: exit status 2) a
  request no node can hold: ``engine_opts.num_cpus`` / ``num_gpus`` above every alive node's,
  a GPU on a cluster without one. With ``engine_opts.device=cuda`` (which needs
  ``num_gpus > 0``, ``fedudp.config.validation``) each actor computes its owners' kernels on
  the GPU Ray gives it (``fedudp.flower.actor_device``); without it ``num_gpus`` only reserves
  GPUs. The driver itself builds and computes on the CPU, and noise is drawn in float64 on the
  CPU in every engine (docs/engines.md#gpus). It runs before Flower's threads start, so a
  refused run leaves no thread behind that keeps the process up.
* ``lost(code, reason)`` reads a Flower error reply: Flower's Ray backend reports an exception
  raised *by Ray* while it ran a message (its actor's worker or node died, or became
  unreachable) with ``ErrorCode.UNKNOWN`` and the reason ``<class 'ray.exceptions.X'>:<'…'>``;
  those ``X`` (``RAY_LOSSES``) are infrastructure, an owner failure under the fail-closed rule.
  An exception raised in fedudp's own ``ClientApp`` arrives as
  ``CLIENT_APP_RAISED_EXCEPTION`` and stays a bug.
* ``fedudp.flower.ray_backend.SurvivingRayBackend`` (its own module: it imports Ray and
  Flower's Ray backend): Flower's ``RayBackend`` puts an actor back into its pool after any
  error, a dead one included, so every later message it is handed fails at once (and takes
  the place of a live actor), and it counts a dead node's resources. That backend starts the
  actors the *alive* nodes hold, hands messages only to actors Ray has started, drops an actor
  Ray has lost, starts a replacement only where the cluster has the resources free now, and
  when none is left each message fails at once (``ClusterLost``, an owner failure too; a round
  in which every node failed so says the cluster is gone, ``gone``).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

from fedudp.build import RunSettings
from fedudp.errors import ConfigError

__all__ = [
    "LOST",
    "RAY_LOSSES",
    "ClusterLost",
    "gone",
    "lost",
    "preflight",
    "check_resources",
    "actors_fit",
    "ray_init_args",
]

LOST = "ray: "  # how an owner failure that Ray lost begins (``lost``)

# exceptions Ray raises when a worker, an actor, its node or its objects are gone: the owner's
# infrastructure failed, not its code (ray.exceptions; their subclasses are named here too)
RAY_LOSSES = frozenset(
    {
        "RayActorError",
        "ActorDiedError",
        "ActorUnavailableError",
        "ActorUnschedulableError",
        "NodeDiedError",
        "WorkerCrashedError",
        "LocalRayletDiedError",
        "ObjectLostError",
        "ObjectFetchTimedOutError",
        "OwnerDiedError",
        "ObjectReconstructionFailedError",
        "ObjectReconstructionFailedMaxAttemptsExceededError",
        "ObjectReconstructionFailedLineageEvictedError",
        "OutOfMemoryError",
    }
)

_UNKNOWN = 0  # flwr.common.constant.ErrorCode.UNKNOWN: an exception the backend raised itself
_REASON = re.compile(r"\s*<class '([\w.]+)'>:<'")


class ClusterLost(RuntimeError):
    """Every actor of the simulation is lost: no alive node of the cluster can run an owner."""


def lost(code: int, reason: str) -> str | None:
    """The short reason of a Flower error reply that says Ray lost the owner's worker or node.

    Parameters
    ----------
    code : int
        The reply's ``error.code`` (``flwr.common.constant.ErrorCode``).
    reason : str
        Its ``error.reason``.

    Returns
    -------
    str or None
        ``"ray: <exception>: <first line>"`` for a Ray loss (or ``ClusterLost``); None for
        anything else, an exception raised inside the ``ClientApp`` in particular.
    """
    if int(code) != _UNKNOWN:
        return None
    m = _REASON.match(reason)
    if m is None:
        return None
    module, _, name = m.group(1).rpartition(".")
    ray_loss = module == "ray.exceptions" and name in RAY_LOSSES
    if not ray_loss and m.group(1) != f"{__name__}.{ClusterLost.__name__}":
        return None
    text = reason[m.end() :].strip().rstrip("'>").strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    return f"{LOST}{name}: {first[:160]}" if first else f"{LOST}{name}"


def gone(reasons: dict[int, str], asked: int) -> str:
    """Why no owner can answer again, or '' : every one of the ``asked`` messages of a round
    failed because every Ray actor of the simulation is lost (``ClusterLost``).

    Parameters
    ----------
    reasons : dict of int to str
        The round's failure reasons by node (``lost``'s for Ray losses).
    asked : int
        How many messages the round sent.

    Returns
    -------
    str
    """
    cluster_lost = f"{LOST}{ClusterLost.__name__}"
    if asked == 0 or len(reasons) < asked:
        return ""
    if not all(r.startswith(cluster_lost) for r in reasons.values()):
        return ""
    return (
        "every Ray actor of the simulation is lost (no alive node left); resume= on another "
        "cluster or with engine=local"
    )


# -- before any work: the cluster can hold what the run asks for ---------------------------------
def ray_init_args(settings: RunSettings) -> dict[str, Any]:
    """``ray.init``'s arguments for a run: the cluster of ``engine_opts.address`` or a new local
    Ray of this run's own (``"local"``: never a stale cluster named in
    ``/tmp/ray/ray_current_cluster``, which ``ray.init``'s default would join).

    Parameters
    ----------
    settings : RunSettings

    Returns
    -------
    dict
    """
    return {"address": str(settings.address) if settings.address else "local"}


def preflight(settings: RunSettings, device: str = "cpu") -> None:
    """Start or join the run's Ray and check that it can hold one owner's actor (on a GPU
    under ``device=cuda``).

    Ray stays initialized for Flower's simulation (its backend then skips ``ray.init``); the
    workers get this process's ``sys.path`` as ``PYTHONPATH``, as Flower's own start gives
    them. On a refusal Ray is shut down before the error is raised.

    Parameters
    ----------
    settings : RunSettings
        ``engine_opts.num_cpus``, ``num_gpus`` and ``address``.
    device : str, default "cpu"
        ``engine_opts.device``: where each actor computes its owners' kernels.

    Raises
    ------
    ConfigError
        One line naming the key and what the cluster has.
    """
    import ray

    if not ray.is_initialized():
        path = os.pathsep.join(sys.path)
        if os.environ.get("PYTHONPATH"):
            path = f"{path}{os.pathsep}{os.environ['PYTHONPATH']}"
        os.environ["PYTHONPATH"] = path
        ray.init(
            runtime_env={"env_vars": {"PYTHONPATH": path}},
            include_dashboard=False,
            **ray_init_args(settings),
        )
    try:
        check_resources(settings, _alive_nodes(), device)
    except ConfigError:
        ray.shutdown()
        raise


def check_resources(
    settings: RunSettings, nodes: list[dict[str, float]], device: str = "cpu"
) -> int:
    """How many owner actors the alive nodes hold (each on one node, as Ray places actors).

    Parameters
    ----------
    settings : RunSettings
        ``engine_opts.num_cpus`` and ``num_gpus``: one actor's resources.
    nodes : list of dict
        Each alive node's resources (``ray.nodes()``'s ``Resources``: ``CPU``, ``GPU``, …).
    device : str, default "cpu"
        ``engine_opts.device``: ``cuda`` needs an alive node with a GPU.

    Returns
    -------
    int
        The number of actors, at least 1.

    Raises
    ------
    ConfigError
        No node holds one actor, or ``device`` is a GPU and no alive node has one (the
        message names the key and the cluster's resources).
    """
    cpus, gpus = float(settings.num_cpus), float(settings.num_gpus)
    have_c = [float(n.get("CPU", 0)) for n in nodes]
    have_g = [float(n.get("GPU", 0)) for n in nodes]
    where = (
        f"the Ray cluster's {len(nodes)} node(s) have CPU {_amounts(have_c)}, "
        f"GPU {_amounts(have_g)}"
    )
    on_gpu = str(device).startswith("cuda")
    if on_gpu and not any(g > 0 for g in have_g):
        raise ConfigError(
            f"engine_opts.device={device}: no alive node of the Ray cluster has a GPU ({where}); "
            "use engine_opts.device=cpu with engine_opts.num_gpus=0, or join a cluster with "
            "GPUs (engine_opts.address)"
        )
    fit = actors_fit(cpus, gpus, nodes)
    if fit > 0:
        return fit
    if gpus > 0 and not any(g >= gpus for g in have_g):
        raise ConfigError(
            f"engine_opts.num_gpus={gpus:g}: no node has that many GPUs ({where}); "
            + (
                "lower engine_opts.num_gpus (a fraction shares a GPU)"
                if on_gpu
                else "set engine_opts.num_gpus=0 (without engine_opts.device=cuda the Flower "
                "engine only reserves GPUs)"
            )
            + " or join a cluster with GPUs (engine_opts.address)"
        )
    raise ConfigError(
        f"engine_opts.num_cpus={cpus:g}"
        + (f" with engine_opts.num_gpus={gpus:g}" if gpus > 0 else "")
        + f": no node holds one owner's actor ({where}); lower engine_opts.num_cpus"
    )


def actors_fit(cpus: float, gpus: float, nodes: list[dict[str, float]]) -> int:
    """How many actors of ``cpus`` CPUs and ``gpus`` GPUs the ``nodes`` hold, node by node.

    Parameters
    ----------
    cpus, gpus : float
        One actor's resources.
    nodes : list of dict
        Each node's resources (``CPU``, ``GPU``).

    Returns
    -------
    int
    """
    fit = 0
    for n in nodes:
        c, g = float(n.get("CPU", 0)), float(n.get("GPU", 0))
        k = int(c // cpus) if cpus > 0 else 1 << 30
        if gpus > 0:
            k = min(k, int(g // gpus))
        fit += k
    return fit


def _alive_nodes() -> list[dict[str, float]]:
    """The resources of the cluster's alive nodes (``ray.nodes()`` lists dead ones too)."""
    import ray

    return [n.get("Resources") or {} for n in ray.nodes() if n.get("Alive", True)]


def _amounts(xs: list[float]) -> str:
    return "/".join(f"{x:g}" for x in xs) if xs else "none"
