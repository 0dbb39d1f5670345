"""A lost Ray actor or node is an owner failure; an exception in fedudp's ClientApp is a bug
(issue 52, docs/engines.md#failures; ``fedudp.flower.cluster``).

The error replies are made by Flower's own Simulation Runtime worker
(``flwr.server.superlink.fleet.vce.vce_api.worker``) from real exceptions: Ray's
``ActorDiedError`` / ``ActorUnavailableError`` / ``NodeDiedError`` / ``WorkerCrashedError`` raised
by the backend, and a ``ClientAppException`` (what Flower raises for any exception inside the
ClientApp) wrapped as Ray delivers it. ``FlowerTransport._exchange`` must record the first kind
as failed owners with a short reason and raise on the second. The weakened twin of the
classification (a ClientApp exception taken as infrastructure) is caught. The backend test
drives ``SurvivingRayBackend`` over fake actors: after one actor is lost, later messages go to
the live ones (Flower's own pool would hand the dead actor out again: that twin is caught), and
with none left every message fails at once.
"""

from __future__ import annotations

import threading
import time
from queue import Queue

import pytest
import ray
from flwr.app import Context, Message, RecordDict
from flwr.clientapp.client_app import ClientAppException
from flwr.common.constant import ErrorCode
from flwr.server.superlink.fleet.vce import vce_api

import fedudp.flower.cluster as cluster
import fedudp.flower.ray_backend as ray_backend
from fedudp.build import RunSettings
from fedudp.config import ConfigError
from fedudp.flower.server_app import FlowerTransport


@pytest.fixture(autouse=True)
def server_identity():
    """The run id Flower's runtime sets before messages are made (restored afterwards)."""
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


class _Store:
    def retrieve_context(self, run_id):
        return Context(
            run_id=run_id,
            node_id=7,
            node_config={"partition-id": 0},
            state=RecordDict(),
            run_config={},
        )

    def update_context(self, run_id, context):
        pass


class _Raising:
    """A backend whose ``process_message`` raises ``exc`` (as Flower's would)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def process_message(self, message, context):
        raise self.exc


def _request(node: int = 7) -> Message:
    msg = Message(RecordDict(), dst_node_id=node, message_type="train", group_id="2")
    msg.metadata.__dict__["_message_id"] = f"m{node}"
    msg.metadata.__dict__["_run_id"] = 1
    return msg


def flower_error_reply(exc: BaseException) -> Message:
    """The reply Flower's Simulation Runtime worker makes when its backend raises ``exc``."""
    ins, res, stop = Queue(), Queue(), threading.Event()
    ins.put(_request())

    class _Metrics:
        def add_clientapp_runtime(self, s):
            stop.set()

    th = threading.Thread(
        target=vce_api.worker, args=(ins, res, {7: _Store()}, _Raising(exc), stop, _Metrics())
    )
    th.start()
    th.join(10)
    reply = res.get(timeout=1)
    assert reply.has_error()
    return reply


def client_app_bug() -> BaseException:
    """A ``ClientAppException`` as ``ray.get`` raises it: a ``RayTaskError`` of that class."""
    try:
        raise ClientAppException("ZeroDivisionError: division by zero (ActorDiedError)")
    except ClientAppException as e:
        return ray.exceptions.RayTaskError("run", "traceback", e).as_instanceof_cause()


RAY_LOSSES = {
    "ActorDiedError": lambda: ray.exceptions.ActorDiedError(),
    "ActorUnavailableError": lambda: ray.exceptions.ActorUnavailableError("node lost", b"a" * 16),
    "NodeDiedError": lambda: ray.exceptions.NodeDiedError("the node died"),
    "WorkerCrashedError": lambda: ray.exceptions.WorkerCrashedError(),
}


# -- the classification ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(RAY_LOSSES))
def test_a_ray_loss_is_read_as_infrastructure(name):
    reply = flower_error_reply(RAY_LOSSES[name]())
    assert reply.error.code == ErrorCode.UNKNOWN
    why = cluster.lost(reply.error.code, str(reply.error.reason))
    assert why is not None and why.startswith(f"ray: {name}") and "\n" not in why


def test_a_client_app_exception_is_not_infrastructure():
    reply = flower_error_reply(client_app_bug())
    assert reply.error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert cluster.lost(reply.error.code, str(reply.error.reason)) is None
    plain = flower_error_reply(ValueError("ray.exceptions.ActorDiedError in a message"))
    assert plain.error.code == ErrorCode.UNKNOWN  # an error of the backend that is not Ray's
    assert cluster.lost(plain.error.code, str(plain.error.reason)) is None


def test_cluster_lost_is_infrastructure():
    reply = flower_error_reply(cluster.ClusterLost("every Ray actor of the simulation is lost"))
    assert cluster.lost(reply.error.code, str(reply.error.reason)).startswith("ray: ClusterLost")


class _Grid:
    """Replies prepared per destination node, all available at the first pull."""

    def __init__(self, replies: dict[int, Message]) -> None:
        self.replies, self.sent = replies, {}

    def push_messages(self, msgs):
        ids = []
        for m in msgs:
            mid = f"id{m.metadata.dst_node_id}"
            self.sent[mid] = m.metadata.dst_node_id
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        out = []
        for mid in ids:
            rep = self.replies[self.sent[mid]]
            rep.metadata.__dict__["_reply_to_message_id"] = mid
            rep.metadata.__dict__["_src_node_id"] = self.sent[mid]
            out.append(rep)
        return out


class _Owners:
    def report_progress(self, *a):
        pass


def exchange(replies: dict[int, Message]):
    """``FlowerTransport._exchange`` over blocks 0..n-1 on nodes 100.. (no Flower grid)."""
    t = object.__new__(FlowerTransport)
    nodes = {j: 100 + j for j in replies}
    t.grid, t.owners, t.stop_flag, t.timeout = (
        _Grid({nodes[j]: r for j, r in replies.items()}),
        _Owners(),
        None,
        5.0,
    )
    t.node_of_block = nodes
    t.node_of_owner = nodes
    msgs = {j: Message(RecordDict(), dst_node_id=nodes[j], message_type="train") for j in replies}
    return t._exchange(msgs, 2)


def ok_reply() -> Message:
    return Message(RecordDict(), reply_to=_request())


def bug_stops_the_run() -> bool:
    """The check: an exception in the ClientApp stops the run (True), a lost node does not."""
    replies = {0: ok_reply(), 1: flower_error_reply(RAY_LOSSES["ActorDiedError"]())}
    got, failed = exchange(replies)
    assert set(got) == {0} and failed[1].startswith("ray: ActorDiedError")
    try:
        exchange({0: ok_reply(), 1: flower_error_reply(client_app_bug())})
    except RuntimeError as e:
        return "a fedudp bug, not an owner failure" in str(e)
    return False


def test_exchange_records_a_lost_node_and_stops_on_a_bug():
    assert bug_stops_the_run()


def test_weakened_twin_client_app_exception_as_infrastructure_is_caught(monkeypatch):
    real = cluster.lost

    def twin(code, reason):  # an exception inside the ClientApp taken for a Ray loss too
        if code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION:
            return "ray: " + reason.splitlines()[0][:60]
        return real(code, reason)

    monkeypatch.setattr(cluster, "lost", twin)
    assert not bug_stops_the_run()


def test_a_round_whose_every_node_the_lost_cluster_failed_says_the_cluster_is_gone():
    whole = flower_error_reply(cluster.ClusterLost("every Ray actor of the simulation is lost"))
    died = flower_error_reply(ray.exceptions.ActorDiedError())
    lost_all = cluster.lost(whole.error.code, str(whole.error.reason))
    lost_one = cluster.lost(died.error.code, str(died.error.reason))
    assert lost_all is not None and lost_one is not None
    assert "resume=" in cluster.gone({0: lost_all, 1: lost_all}, 2)
    assert cluster.gone({0: lost_all, 1: lost_one}, 2) == ""  # an actor died: others may live
    assert cluster.gone({0: lost_all}, 2) == ""  # node 1 answered
    assert cluster.gone({}, 0) == ""


# -- the backend: a lost actor leaves the pool -----------------------------------------------------
class _Actor:
    def __init__(self, name: str, dead: bool = False) -> None:
        self.name, self.dead = name, dead
        self.run = self

    def remote(self, app_fn, message, cid, context):
        return (self, cid)


class _Pool:
    def __init__(self, actors) -> None:
        self.pool, self.num_actors = list(actors), len(actors)
        self.create_actor_fn = lambda: pytest.fail("no replacement: the cluster has no room")


def backend(actors, twin: bool = False):
    cls = ray_backend.SurvivingRayBackend
    if twin:  # Flower's pool: the lost actor goes back into the pool

        class Twin(cls):
            def _lose(self, actor):
                self._give_back(actor)

        cls = Twin
    b = object.__new__(cls)
    b.pool, b.app_fn, b.client_resources = _Pool(actors), (lambda: None), {"num_cpus": 1}
    b._idle, b._alive, b._pending = threading.Condition(), len(actors), {}
    b._slots, b._busy = list(actors), set()
    return b


@pytest.fixture
def fake_ray(monkeypatch):
    def get(ref):
        actor, cid = ref
        if actor.dead:
            raise ray.exceptions.ActorDiedError()
        return cid, f"reply by {actor.name}", "ctx"

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    monkeypatch.setattr(ray_backend, "_free_now", lambda resources: False)


def later_messages_recover(b) -> bool:
    """After the lost actor's message failed, do the next messages all succeed?"""
    ctx = Context(
        run_id=1, node_id=1, node_config={"partition-id": 3}, state=RecordDict(), run_config={}
    )
    with pytest.raises(ray.exceptions.ActorDiedError):
        b.process_message(_request(), ctx)  # the pool hands out its last actor: the dead one
    outs = []
    for _ in range(4):
        try:
            outs.append(b.process_message(_request(), ctx)[0])
        except ray.exceptions.RayActorError:
            return False
    return outs == ["reply by live"] * 4


def test_a_lost_actor_leaves_the_pool(fake_ray):
    b = backend([_Actor("live"), _Actor("dead", dead=True)])
    assert later_messages_recover(b)
    assert b._alive == 1 and [a.name for a in b.pool.pool] == ["live"]


def test_weakened_twin_dead_actor_back_in_the_pool_is_caught(fake_ray):
    assert not later_messages_recover(
        backend([_Actor("live"), _Actor("dead", dead=True)], twin=True)
    )


def test_with_no_actor_left_messages_fail_at_once(fake_ray):
    b = backend([_Actor("dead", dead=True)])
    ctx = Context(
        run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={}
    )
    with pytest.raises(ray.exceptions.ActorDiedError):
        b.process_message(_request(), ctx)
    t0 = time.time()
    with pytest.raises(cluster.ClusterLost):
        b.process_message(_request(), ctx)
    assert time.time() - t0 < 2


# -- the backend: an actor takes messages only once Ray has started it ---------------------------
class _Starting(_Actor):
    """An actor Ray places (``starts``), never places (a node that died but is still listed
    alive: it waits forever), or loses before it starts (``died``)."""

    def __init__(self, name: str, starts: bool = True, died: bool = False) -> None:
        super().__init__(name)
        self.starts, self.died = starts or died, died
        self.__ray_ready__ = self

    def remote(self, *args):
        return ("ready", self) if not args else (self, args[2])


@pytest.fixture
def starting_ray(monkeypatch):
    never = threading.Event()

    def get(ref):
        actor = ref[1] if ref[0] == "ready" else ref[0]
        if not actor.starts:  # a message to an actor that is never placed waits (here: 3 s)
            never.wait(3)
            raise TimeoutError(f"waited on {actor.name}, which Ray never started")
        if ref[0] == "ready":
            if actor.died:
                raise ray.exceptions.ActorDiedError()
            return True
        if getattr(actor, "lost", False):  # its node died mid-run
            raise ray.exceptions.ActorDiedError()
        return ref[1], f"reply by {actor.name}", "ctx"

    def wait(refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r[1].starts]
        if not ready:
            time.sleep(timeout or 0)
        return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray_backend, "_free_now", lambda resources: False)


def built(actors, monkeypatch, twin: bool = False):
    """``SurvivingRayBackend.build`` over ``actors`` on a cluster listing two alive nodes."""
    import flwr.server.superlink.fleet.vce.backend.raybackend as raybackend
    import flwr.simulation.ray_transport.ray_actor as ray_actor

    made = iter(actors)

    class Pool:
        def __init__(self, **kw) -> None:
            self.pool, self.num_actors, self.actors_capacity = [], 0, len(actors)
            self.create_actor_fn = lambda: next(made)

        def add_actors_to_pool(self, n: int) -> None:  # Flower's: every actor in at once
            self.pool += [self.create_actor_fn() for _ in range(n)]
            self.num_actors += n

        def terminate_all_actors(self) -> None:
            self.pool.clear()

    monkeypatch.setattr(ray_actor, "BasicActorPool", Pool)
    monkeypatch.setattr(raybackend, "BasicActorPool", Pool)
    monkeypatch.setattr(cluster, "_alive_nodes", lambda: [{"CPU": 1.0}] * len(actors))
    cls = ray_backend.SurvivingRayBackend
    b = object.__new__(cls)
    b.client_resources, b.actor_kwargs = {"num_cpus": 1}, {}
    if twin:  # the weakened twin: Flower's build, every actor in the pool before it started
        raybackend.RayBackend.build(b, lambda: None)
        b._idle, b._alive, b._pending = threading.Condition(), len(actors), {}
        b._slots, b._busy = list(b.pool.pool), set()
    else:
        b.build(lambda: None)
    return b


def served_by(b, n: int, partitions=(0,)) -> list[str]:
    out = []
    for i in range(n):
        ctx = Context(
            run_id=1,
            node_id=1,
            node_config={"partition-id": partitions[i % len(partitions)]},
            state=RecordDict(),
            run_config={},
        )
        out.append(b.process_message(_request(), ctx)[0])
    return out


@pytest.mark.parametrize("pin", [True, False])
def test_with_blocks_each_node_is_served_by_one_actor(starting_ray, monkeypatch, pin):
    """Owners in blocks (``using_backend(pin=True)``): node k's messages go to one actor, so an
    actor builds and keeps only its nodes' blocks. The twin without pinning (Flower's pool: any
    idle actor) has an actor serve both nodes: caught."""
    monkeypatch.setattr(ray_backend, "_PIN", [pin])
    b = built([_Starting("a"), _Starting("b")], monkeypatch)
    try:
        deadline = time.time() + 2
        while b._alive < 2 and time.time() < deadline:
            time.sleep(0.02)
        got = served_by(b, 8, partitions=(0, 1))
        by_node = {k: set(got[k::2]) for k in (0, 1)}
        disjoint = len(by_node[0]) == len(by_node[1]) == 1 and not by_node[0] & by_node[1]
        assert disjoint == pin, by_node
    finally:
        b.terminate()


def test_an_actor_ray_never_places_takes_no_message(starting_ray, monkeypatch):
    """Resumed after a node loss, the dead node still listed alive: one actor is never placed.
    Every message goes to the started one; none waits on the other (the hang of issue 52)."""
    b = built([_Starting("placed"), _Starting("unplaceable", starts=False)], monkeypatch)
    try:
        t0 = time.time()
        assert served_by(b, 4) == ["reply by placed"] * 4
        assert time.time() - t0 < 2.5
        assert b._alive == 1 and len(b._pending) == 1
    finally:
        b.terminate()
    assert not b._pending


def test_an_actor_lost_before_it_started_is_dropped(starting_ray, monkeypatch):
    b = built([_Starting("died", died=True), _Starting("placed")], monkeypatch)
    try:
        assert served_by(b, 3) == ["reply by placed"] * 3
        deadline = time.time() + 2
        while b._pending and time.time() < deadline:
            time.sleep(0.05)
        assert b._alive == 1 and not b._pending
    finally:
        b.terminate()


def test_weakened_twin_every_actor_in_the_pool_at_build_is_caught(starting_ray, monkeypatch):
    b = built([_Starting("placed"), _Starting("unplaceable", starts=False)], monkeypatch, True)
    with pytest.raises(TimeoutError, match="never started"):
        served_by(b, 4)


def test_with_blocks_a_lost_actors_nodes_go_to_the_next_slots_actor(starting_ray, monkeypatch):
    """Pinned (owners in blocks) and one actor lost mid-run: its message fails (an owner
    failure), and its node's later messages go to the surviving actor, with no wait."""
    monkeypatch.setattr(ray_backend, "_PIN", [True])
    a, b_ = _Starting("a"), _Starting("b")
    b = built([a, b_], monkeypatch)
    try:
        deadline = time.time() + 2
        while b._alive < 2 and time.time() < deadline:
            time.sleep(0.02)
        lost_slot = b._slots.index(b_)
        b_.lost = True
        with pytest.raises(ray.exceptions.ActorDiedError):
            served_by(b, 1, partitions=(lost_slot,))
        t0 = time.time()
        assert served_by(b, 6, partitions=(0, 1)) == ["reply by a"] * 6
        assert time.time() - t0 < 2 and b._slots.count(None) == 1 and b._alive == 1
    finally:
        b.terminate()


# -- resources before work ---------------------------------------------------------------------------
def settings(**kw) -> RunSettings:
    base = dict(
        method="joint_dp",
        private=True,
        placement="server",
        engine="flower",
        dataset="synthetic",
        seed=0,
        rounds=1,
        eval_every=1,
        target_epsilon=1.0,
        delta=1e-5,
        checkpoint_every=1,
        checkpoint_keep=1,
        resume=None,
        progress=False,
        threads=1,
        timeout_s=None,
        num_cpus=1.0,
        num_gpus=0.0,
        address=None,
        noise_personal=False,
        sampling_rate=1.0,
        bound=1.0,
        accounting="certified",
    )
    return RunSettings(**{**base, **kw})


def test_resources_that_no_node_holds_are_refused():
    nodes = [{"CPU": 1.0}, {"CPU": 2.0, "head_mark": 1.0}]
    assert cluster.check_resources(settings(), nodes) == 3
    with pytest.raises(ConfigError) as e:
        cluster.check_resources(settings(num_gpus=1.0), nodes)
    msg = str(e.value)
    assert msg.startswith("engine_opts.num_gpus=1: no node has that many GPUs") and "\n" not in msg
    assert "CPU 1/2, GPU 0/0" in msg
    with pytest.raises(ConfigError) as e:
        cluster.check_resources(settings(num_cpus=4.0), nodes)
    assert str(e.value).startswith("engine_opts.num_cpus=4: no node holds one owner's actor")
    assert cluster.check_resources(settings(num_gpus=0.5), [{"CPU": 4.0, "GPU": 1.0}]) == 2


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_gpu_the_cluster_lacks_ends_the_run_with_exit_2(tmp_path):
    """Before: a failed summary, then a process that never exited (Flower's ServerApp thread
    waiting on an actor pool that was never built). Now one line, exit status 2, promptly."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    t0 = time.time()
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "fedudp"),
            "engine=flower",
            "method=joint_dp",
            "engine_opts.num_gpus=1",
            "partition.num_owners=2",
            "dataset.num_records=40",
            "dataset.pool_train=200",
            "dataset.pool_test=40",
            "dataset.features=5",
            "train.rounds=1",
            "progress=false",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fedudp: error: engine_opts.num_gpus=1: no node has that many GPUs")
    assert time.time() - t0 < 200
