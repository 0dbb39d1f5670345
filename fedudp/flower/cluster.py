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
* ``SurvivingRayBackend``: it builds as many actors as the *alive* nodes hold (Flower counts a
  dead node's resources too, so a run resumed after a node loss would wait forever on an actor
  that cannot be placed). Flower's ``RayBackend`` puts an actor back into its pool after any
  error, a dead one included, so every later message it is handed fails at once (and takes
  the place of a live actor). This backend drops an actor Ray has lost, starts a replacement
  only where the cluster has the resources free now (never one that would wait to be
  scheduled), and lets the messages wait for the actors still alive; when none is left each
  message fails at once (``ClusterLost``, an owner failure too). ``using_backend`` installs it
  for one simulation.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator
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
    "using_backend",
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


# -- while it runs: a lost actor leaves the pool -------------------------------------------------
def _surviving_backend_class() -> type:
    """``SurvivingRayBackend``, defined on first use (it subclasses Flower's ``RayBackend``,
    which imports Ray)."""
    import ray
    from flwr.common.constant import PARTITION_ID_KEY
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool, ClientAppActor

    losses: tuple[type[BaseException], ...] = tuple(
        cls
        for name in sorted(RAY_LOSSES)
        if isinstance(cls := getattr(ray.exceptions, name, None), type)
        and issubclass(cls, BaseException)
    )

    class SurvivingRayBackend(RayBackend):
        """Flower's Ray backend, less the actors Ray has lost (see the module doc)."""

        def build(self, app_fn: Any) -> None:
            # as many actors as the *alive* nodes hold: Flower counts a dead node's resources
            # too. An actor joins the pool only once Ray has started it (``_admit``): one that
            # cannot be placed (a node that died but is still listed alive, its resources
            # counted) never takes a message, so no message waits on it.
            pool = BasicActorPool(
                actor_type=ClientAppActor,
                client_resources=self.client_resources,
                actor_kwargs=self.actor_kwargs,
            )
            res = self.client_resources
            n = actors_fit(float(res["num_cpus"]), float(res.get("num_gpus", 0)), _alive_nodes())
            n = max(1, min(n, pool.actors_capacity))
            self.pool, self.app_fn = pool, app_fn
            self._idle = threading.Condition()
            self._alive = 0  # actors started and not lost
            self._pending: dict[Any, Any] = {}  # readiness ref -> actor not yet started
            self._stop = threading.Event()
            for _ in range(n):
                self._start_actor()
            pool.num_actors = n  # Flower runs this many worker threads
            self._admitter = threading.Thread(
                target=self._admit, name="fedudp-ray-admit", daemon=True
            )
            self._admitter.start()

        def _start_actor(self) -> None:
            actor = self._pool().create_actor_fn()
            with self._idle:
                self._pending[actor.__ray_ready__.remote()] = actor

        def _admit(self) -> None:
            _admit_started(self)

        def _pool(self) -> Any:
            if self.pool is None or self.app_fn is None:
                raise ValueError("the Ray backend is not built")
            return self.pool

        def process_message(self, message: Any, context: Any) -> tuple[Any, Any]:
            actor = self._take()
            try:
                ref = actor.run.remote(
                    self.app_fn, message, str(context.node_config[PARTITION_ID_KEY]), context
                )
                _, out, updated = ray.get(ref)
            except losses:
                self._lose(actor)
                raise
            except BaseException:
                self._give_back(actor)
                raise
            self._give_back(actor)
            return out, updated

        def _take(self) -> Any:
            pool = self._pool()
            with self._idle:
                while not pool.pool:
                    if self._alive <= 0 and not self._pending:
                        raise ClusterLost(
                            "every Ray actor of the simulation is lost (no alive node left)"
                        )
                    self._idle.wait(0.5)
                return pool.pool.pop()

        def _give_back(self, actor: Any) -> None:
            with self._idle:
                self._pool().pool.append(actor)
                self._idle.notify()

        def _lose(self, actor: Any) -> None:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            with self._idle:
                self._alive -= 1
                self._idle.notify_all()
            if _free_now(self.client_resources):  # a replacement only where one fits now
                self._start_actor()

        def terminate(self) -> None:
            self._stop.set()
            with self._idle:
                pending = list(self._pending.values())
                self._pending.clear()
            for actor in pending:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            super().terminate()

    return SurvivingRayBackend


def _admit_started(b: Any) -> None:
    """``SurvivingRayBackend``'s admission thread: move each actor Ray has started into the
    pool, drop one Ray lost before it started, until the backend terminates."""
    import ray

    while not b._stop.is_set():
        with b._idle:
            refs = list(b._pending)
        if not refs:
            b._stop.wait(0.2)
            continue
        try:
            ready, _ = ray.wait(refs, num_returns=1, timeout=0.5)
        except Exception:  # noqa: BLE001  (Ray shut down under us: the run is over)
            return
        for ref in ready:
            with b._idle:
                actor = b._pending.pop(ref, None)
            if actor is None:  # terminated meanwhile
                continue
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001  (never started, e.g. its node died: not pooled)
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
                with b._idle:
                    b._idle.notify_all()
                continue
            with b._idle:
                b._alive += 1
                b._pool().pool.append(actor)
                b._idle.notify_all()


def _free_now(resources: dict[str, float]) -> bool:
    """Whether one more actor of ``resources`` fits on an alive node now (not: once scheduled)."""
    import ray

    with contextlib.suppress(Exception):
        need_c = float(resources.get("num_cpus", 1))
        need_g = float(resources.get("num_gpus", 0))
        free = ray.available_resources()
        return float(free.get("CPU", 0)) >= need_c and float(free.get("GPU", 0)) >= need_g
    return False


@contextlib.contextmanager
def using_backend() -> Iterator[None]:
    """Flower's simulation uses ``SurvivingRayBackend`` while the block runs (its Ray backend
    is looked up by module attribute when the simulation starts)."""
    import flwr.server.superlink.fleet.vce.backend.raybackend as raybackend

    original = raybackend.RayBackend
    setattr(raybackend, "RayBackend", _surviving_backend_class())  # noqa: B010
    try:
        yield
    finally:
        setattr(raybackend, "RayBackend", original)  # noqa: B010
