"""``SurvivingRayBackend``: Flower's Ray backend, less the actors Ray has lost
(``fedudp.flower.cluster``'s module doc says why; ``using_backend`` installs it for one
simulation). It imports Ray and Flower's Ray backend, so it is imported only when a Flower
simulation starts.

* It starts as many actors as the *alive* nodes hold (Flower counts a dead node's resources
  too) and hands a message only to an actor Ray has started (``_admit_started``): one that
  cannot be placed (a node that died but is still listed alive, its CPUs counted) never takes
  a message, so nothing waits on it; one that Ray lost before it started is dropped.
* An actor Ray loses while it runs a message leaves the pool (Flower's would put it back, and
  every later message handed to it would fail at once); a replacement is started only where
  the cluster has the resources free now; with no actor left, started or starting, each
  message fails at once (``ClusterLost``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import flwr.simulation.ray_transport.ray_actor as ray_actor
import ray
from flwr.common.constant import PARTITION_ID_KEY
from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

import fedudp.flower.cluster as cluster

__all__ = ["SurvivingRayBackend", "using_backend", "wake"]

# set when the driver has pushed messages (``wake``): Flower's simulation thread that moves
# pushed messages to the workers looks for them every 0.1 s; while ``using_backend`` runs it
# looks at once when woken, and every 0.1 s otherwise, as before
_PUSHED = threading.Event()

# [True]: each node's messages go to one actor (``SurvivingRayBackend._take``), set by
# ``using_backend(pin=...)`` for a run with owners in blocks
_PIN = [False]


def wake() -> None:
    """Tell the simulation that the driver has just pushed messages (``using_backend``).

    A no-op outside a simulation (e.g. under ``flwr run``), where nothing waits on it.
    """
    _PUSHED.set()


class _WokenStop:
    """Flower's stop event as its message injector sees it: ``wait`` ends at the stop, or
    when ``wake`` is called, or after its timeout (the stop itself is checked each loop)."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop

    def is_set(self) -> bool:
        return self._stop.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        _PUSHED.wait(timeout)
        _PUSHED.clear()
        return self._stop.is_set()


def _injector(original: Any) -> Any:
    """Flower's ``add_messages_to_queue`` run with a ``_WokenStop``."""

    def add_messages_to_queue(state: Any, queue: Any, nodes_mapping: Any, f_stop: Any) -> None:
        original(state, queue, nodes_mapping, _WokenStop(f_stop))

    return add_messages_to_queue


# Ray's loss exceptions (``cluster.RAY_LOSSES``) that this Ray defines
_LOSSES: tuple[type[BaseException], ...] = tuple(
    cls
    for name in sorted(cluster.RAY_LOSSES)
    if isinstance(cls := getattr(ray.exceptions, name, None), type)
    and issubclass(cls, BaseException)
)


class SurvivingRayBackend(RayBackend):
    """Flower's Ray backend, less the actors Ray has lost (see the module doc); constructed by
    Flower's simulation as its ``RayBackend`` is (``using_backend``), from its backend
    configuration."""

    def build(self, app_fn: Any) -> None:
        """Start the actors the alive nodes hold; each joins the pool once Ray has started it.

        Parameters
        ----------
        app_fn : callable
            Flower's ClientApp factory.
        """
        pool = ray_actor.BasicActorPool(
            actor_type=ray_actor.ClientAppActor,
            client_resources=self.client_resources,
            actor_kwargs=self.actor_kwargs,
        )
        res = self.client_resources
        fit = cluster.actors_fit(
            float(res["num_cpus"]), float(res.get("num_gpus", 0)), cluster._alive_nodes()
        )
        n = max(1, min(fit, pool.actors_capacity))
        self.pool, self.app_fn = pool, app_fn
        self._idle = threading.Condition()
        self._alive = 0  # actors started and not lost
        self._pending: dict[Any, Any] = {}  # readiness ref -> actor not yet started
        self._stop = threading.Event()
        # node -> actor by slot (``_PIN``): slot k holds the k-th started actor (None: not yet
        # started, or lost); the busy ones run a message
        self._slots: list[Any] = [None] * n
        self._busy: set[int] = set()
        for _ in range(n):
            self._start_actor()
        pool.num_actors = n  # Flower runs this many worker threads
        self._admitter = threading.Thread(
            target=_admit_started, args=(self,), name="fedudp-ray-admit", daemon=True
        )
        self._admitter.start()

    def _start_actor(self) -> None:
        actor = self._pool().create_actor_fn()
        with self._idle:
            self._pending[actor.__ray_ready__.remote()] = actor

    def _pool(self) -> Any:
        if self.pool is None or self.app_fn is None:
            raise ValueError("the Ray backend is not built")
        return self.pool

    def process_message(self, message: Any, context: Any) -> tuple[Any, Any]:
        """Run ``message`` on a started actor; an actor Ray lost meanwhile leaves the pool.

        Parameters
        ----------
        message : flwr.app.Message
        context : flwr.app.Context

        Returns
        -------
        tuple
            (reply, updated context).
        """
        actor = self._take(int(context.node_config[PARTITION_ID_KEY]))
        try:
            ref = actor.run.remote(
                self.app_fn, message, str(context.node_config[PARTITION_ID_KEY]), context
            )
            _, out, updated = ray.get(ref)
        except _LOSSES:
            self._lose(actor)
            raise
        except BaseException:
            self._give_back(actor)
            raise
        self._give_back(actor)
        return out, updated

    def _take(self, partition: int) -> Any:
        """A started, idle actor for node ``partition``: with ``_PIN`` the node's slot's actor
        (the next started slot's while it has none), so that an actor keeps the blocks of its
        nodes only; else any idle one."""
        pool = self._pool()
        with self._idle:
            while True:
                if self._alive <= 0 and not self._pending:
                    raise cluster.ClusterLost(
                        "every Ray actor of the simulation is lost (no alive node left)"
                    )
                actor = self._route(partition) if _PIN[0] else None
                if actor is not None and id(actor) not in self._busy:
                    pool.pool.remove(actor)
                    break
                if not _PIN[0] and pool.pool:
                    actor = pool.pool.pop()
                    break
                self._idle.wait(0.5)
            self._busy.add(id(actor))
            return actor

    def _route(self, partition: int) -> Any:
        """The actor of ``partition``'s slot, or of the next slot that has one (None: none
        started yet)."""
        n = len(self._slots)
        for i in range(n):
            actor = self._slots[(partition + i) % n]
            if actor is not None:
                return actor
        return None

    def _give_back(self, actor: Any) -> None:
        with self._idle:
            self._busy.discard(id(actor))
            self._pool().pool.append(actor)
            self._idle.notify_all()

    def _lose(self, actor: Any) -> None:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        with self._idle:
            self._alive -= 1
            self._busy.discard(id(actor))
            self._slots = [None if a is actor else a for a in self._slots]
            self._idle.notify_all()
        if _free_now(self.client_resources):  # a replacement only where one fits now
            self._start_actor()

    def terminate(self) -> None:
        """Stop admitting, kill the actors not yet started, then Flower's own terminate."""
        self._stop.set()
        with self._idle:
            pending = list(self._pending.values())
            self._pending.clear()
        for actor in pending:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        super().terminate()


def _admit_started(b: SurvivingRayBackend) -> None:
    """The admission thread: move each actor Ray has started into the pool, drop one Ray lost
    before it started, until the backend terminates."""
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
                empty = [k for k, a in enumerate(b._slots) if a is None]
                if empty:
                    b._slots[empty[0]] = actor
                b._idle.notify_all()


def _free_now(resources: dict[str, float]) -> bool:
    """Whether one more actor of ``resources`` fits on an alive node now (not: once scheduled)."""
    with contextlib.suppress(Exception):
        need_c = float(resources.get("num_cpus", 1))
        need_g = float(resources.get("num_gpus", 0))
        free = ray.available_resources()
        return float(free.get("CPU", 0)) >= need_c and float(free.get("GPU", 0)) >= need_g
    return False


@contextlib.contextmanager
def using_backend(pin: bool = False) -> Iterator[None]:
    """Flower's simulation uses ``SurvivingRayBackend`` while the block runs (its Ray backend
    is looked up by module attribute when the simulation starts), and its message injector
    looks for pushed messages as soon as the driver says it pushed some (``wake``) rather than
    at its next 0.1 s tick (a short round waited for that tick twice: docs/results/cluster).

    Parameters
    ----------
    pin : bool, default False
        Each node's messages to one actor (slot ``partition % actors``; a lost actor's nodes
        to the next slot's): with owners in blocks an actor then builds and keeps only its
        nodes' blocks (Flower's pool hands a message to any idle actor, so every actor came
        to hold every block).

    Yields
    ------
    None
    """
    import flwr.server.superlink.fleet.vce.backend.raybackend as raybackend
    import flwr.server.superlink.fleet.vce.vce_api as vce_api

    original = raybackend.RayBackend, vce_api.add_messages_to_queue
    _PIN[0] = bool(pin)
    setattr(raybackend, "RayBackend", SurvivingRayBackend)  # noqa: B010
    setattr(vce_api, "add_messages_to_queue", _injector(original[1]))  # noqa: B010
    try:
        yield
    finally:
        _PIN[0] = False
        setattr(raybackend, "RayBackend", original[0])  # noqa: B010
        setattr(vce_api, "add_messages_to_queue", original[1])  # noqa: B010
