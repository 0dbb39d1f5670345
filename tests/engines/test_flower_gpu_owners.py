"""engine=flower with ``engine_opts.device=cuda``: the owners' kernels on each actor's GPU, the
driver on the CPU (docs/engines.md#gpus).

No GPU here: what can be checked on a CPU is checked, and only that. The rules (a one-line
``ConfigError`` for ``device=cuda`` without ``num_gpus``, for ``cuda:N`` with N > 0, for a
cluster whose alive nodes hold no GPU: fake node lists); where each side builds its owners (a
spy on ``fedudp.build.owner_side._place``, the one place the owners' model is moved: the
driver's ``cpu``, the actor's ``cuda`` read from the run configuration it receives); an actor
whose torch sees no CUDA device is an owner failure, not a bug; what leaves an actor (its
reply's vectors, its personal state) goes through ``.cpu()``, checked with a tensor that
refuses ``.numpy()`` off the CPU as a CUDA tensor does. A whole run of the Flower engine in
this process (its transport, the real ClientApp, a grid written here) ties them together.
Each check has a weakened twin it catches. The GPU path itself is not run here (see the docs
for the command that runs it on a GPU machine).
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest
import torch
from flwr.app import Context, Error, Message, Metadata, RecordDict
from flwr.app.message.message import make_message
from flwr.common.constant import ErrorCode

import fedudp.build.owner_side as owner_side
import fedudp.flower.actor_device as actor_device
import fedudp.flower.client_app as client_app
import fedudp.flower.cluster as cluster
import fedudp.flower.server_app as server_app
from conftest import tiny_cfg
from fedudp.build import RunSettings, prepare, settings
from fedudp.build.checks import check_config
from fedudp.config import ConfigError, config_from_json, config_to_json, validate
from fedudp.protocol.contributions import Contribution
from fedudp.protocol.messages import OwnerFailure, OwnerReply
from fedudp.run import run

NO_CUDA = not torch.cuda.is_available()
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def gpu_cfg(method: str = "joint_dp", **kw):
    """tiny_cfg on engine=flower, each actor's owners on ``cuda`` with a GPU reserved."""
    base = {"engine": "flower", "engine_opts.device": "cuda", "engine_opts.num_gpus": 1.0}
    return tiny_cfg(method, **{k.replace(".", "__"): v for k, v in {**base, **kw}.items()})


@pytest.fixture(autouse=True)
def server_identity():
    """What Flower's ServerApp runtime sets before ``main`` (a message made on the server
    reads its run id from it), restored afterwards."""
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


@pytest.fixture(autouse=True)
def fresh_actor_caches():
    """The ClientApp's per-process caches (one run at a time) emptied around each test."""
    client_app._CACHE.clear()
    client_app._BLOCKS.clear()
    yield
    client_app._CACHE.clear()
    client_app._BLOCKS.clear()


@pytest.fixture
def placed(monkeypatch):
    """Every device the owners' model is moved to (``owner_side._place``); the model stays on
    the CPU (no GPU here), so whatever was built computes on the CPU."""
    seen: list[torch.device] = []

    def spy(net, where):
        seen.append(torch.device(where))
        net.to(CPU)

    monkeypatch.setattr(owner_side, "_place", spy)
    return seen


# -- the configuration's rules -----------------------------------------------------------------
def test_cuda_on_flower_needs_num_gpus_in_one_line():
    with pytest.raises(ConfigError) as e:
        validate(gpu_cfg(**{"engine_opts.num_gpus": 0.0}))
    msg = str(e.value)
    assert msg.startswith("engine_opts.device=cuda with engine=flower needs engine_opts.num_gpus")
    assert "engine_opts.num_gpus=1" in msg and "engine_opts.device=cpu" in msg and "\n" not in msg


def test_cuda_index_above_0_is_refused_on_flower():
    with pytest.raises(ConfigError) as e:
        validate(gpu_cfg(**{"engine_opts.device": "cuda:1"}))
    msg = str(e.value)
    assert msg.startswith("engine_opts.device=cuda:1: with engine=flower an actor sees only")
    assert "use engine_opts.device=cuda" in msg and "\n" not in msg


@pytest.mark.parametrize("dev", ["cuda", "cuda:0"])
def test_cuda_with_num_gpus_is_accepted_and_the_driver_needs_no_gpu(dev):
    cfg = gpu_cfg(**{"engine_opts.device": dev, "engine_opts.num_gpus": 0.5})
    check_config(cfg)  # no "torch sees no CUDA device" here: the driver computes on the CPU


@pytest.mark.skipif(not NO_CUDA, reason="torch sees a CUDA device here")
def test_the_local_engine_still_needs_cuda_in_this_process():
    with pytest.raises(ConfigError, match=r"^engine_opts\.device=cuda: torch sees no CUDA"):
        check_config(tiny_cfg("full_dp", **{"engine_opts__device": "cuda"}))


# -- preflight: the cluster has a GPU ----------------------------------------------------------
def run_settings(**kw) -> RunSettings:
    return settings(gpu_cfg(**kw))


def test_a_cluster_without_a_gpu_is_refused_for_cuda_in_one_line():
    nodes = [{"CPU": 2.0}, {"CPU": 4.0}]
    with pytest.raises(ConfigError) as e:
        cluster.check_resources(run_settings(), nodes, "cuda")
    msg = str(e.value)
    assert msg.startswith("engine_opts.device=cuda: no alive node of the Ray cluster has a GPU")
    assert "CPU 2/4, GPU 0/0" in msg and "\n" not in msg
    assert cluster.check_resources(run_settings(), [{"CPU": 2.0}, {"CPU": 2.0, "GPU": 1.0}]) == 1
    # more GPUs per actor than a node has: the num_gpus key, what to lower
    with pytest.raises(ConfigError, match=r"^engine_opts\.num_gpus=2: no node has that many"):
        cluster.check_resources(
            run_settings(**{"engine_opts.num_gpus": 2.0}), [{"CPU": 4, "GPU": 1}], "cuda"
        )


def preflight_refuses(nodes: list[dict], monkeypatch) -> bool:
    """The check: ``preflight`` on a joined Ray whose ``ray.nodes()`` are ``nodes`` refuses
    ``device=cuda`` (True) and shuts that Ray down (no process left waiting)."""
    import ray

    down: list[bool] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(ray, "shutdown", lambda: down.append(True))
    try:
        cluster.preflight(run_settings(), "cuda")
    except ConfigError as e:
        return "no alive node of the Ray cluster has a GPU" in str(e) and down == [True]
    return False


DEAD_GPU_NODE = [
    {"Alive": False, "Resources": {"CPU": 4.0, "GPU": 1.0}},  # the GPU node died
    {"Alive": True, "Resources": {"CPU": 2.0}},
]


def test_preflight_refuses_cuda_when_only_a_dead_node_had_a_gpu(monkeypatch):
    assert preflight_refuses(DEAD_GPU_NODE, monkeypatch)


def test_weakened_twin_counting_dead_nodes_is_caught(monkeypatch):
    import ray

    monkeypatch.setattr(cluster, "_alive_nodes", lambda: [n["Resources"] for n in ray.nodes()])
    assert not preflight_refuses(DEAD_GPU_NODE, monkeypatch)


def test_execute_hands_the_device_to_preflight(monkeypatch):
    got: list[str] = []

    def refuse(eo, device="cpu"):
        got.append(device)
        raise ConfigError("stop before any work")

    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setattr(cluster, "preflight", refuse)
    cfg = gpu_cfg(**{"engine_opts.address": "127.0.0.1:1"})  # joined: no watchdog started
    with pytest.raises(ConfigError, match="stop before any work"):
        server_app.execute(cfg, settings(cfg), None, None, None, lambda t: None)
    assert got == ["cuda"]


# -- where each side builds --------------------------------------------------------------------
def driver_builds_on_cpu(placed: list[torch.device]) -> bool:
    """The check: ``prepare`` (the driver) of a device=cuda engine=flower run moves its owners'
    model to the CPU only, and its owners and federation live there."""
    pa = prepare(gpu_cfg("full_dp"))
    return (
        bool(placed)
        and all(d.type == "cpu" for d in placed)
        and pa.owners.device.type == "cpu"
        and pa.fed.x.device.type == "cpu"
    )


def test_the_driver_builds_on_the_cpu(placed):
    assert driver_builds_on_cpu(placed)


def test_weakened_twin_driver_on_the_gpu_is_caught(placed, monkeypatch):
    monkeypatch.setattr(owner_side, "device", lambda cfg, actor=False: torch.device("cuda"))
    assert not driver_builds_on_cpu(placed)


def pretend_the_actor_sees_a_gpu(monkeypatch) -> None:
    """The ClientApp's device check as on an actor with a visible GPU (the check itself:
    ``test_actor_device_checks_what_torch_sees``)."""
    monkeypatch.setattr(client_app, "actor_device", torch.device)


def test_actor_device_checks_what_torch_sees(monkeypatch):
    assert actor_device.actor_device("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert actor_device.actor_device("cuda") == CUDA
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(OwnerFailure, match="sees 0 CUDA device"):
        actor_device.actor_device("cuda")


def actor_builds_on_the_device(placed, monkeypatch, per_node: int) -> bool:
    """The check: the ClientApp, given only the run configuration's JSON, moves its owners'
    model to ``cuda`` (and its federation to the owners' device)."""
    pretend_the_actor_sees_a_gpu(monkeypatch)
    cfg_json = config_to_json(gpu_cfg(**{"engine_opts.owners_per_node": per_node}))
    if per_node == 1:
        owners, fed = client_app.owner_side(cfg_json)
    else:
        owners, fed = client_app.block_side(cfg_json, range(0, per_node))
    return placed == [CUDA] and fed.x.device == owners.device


@pytest.mark.parametrize("per_node", [1, 2])
def test_the_actor_builds_on_the_configured_device(placed, monkeypatch, per_node):
    assert actor_builds_on_the_device(placed, monkeypatch, per_node)


def test_weakened_twin_actor_building_as_the_driver_is_caught(placed, monkeypatch):
    from fedudp import build

    monkeypatch.setattr(client_app, "_build_owners", lambda j: build.owners(config_from_json(j)))
    assert not actor_builds_on_the_device(placed, monkeypatch, 2)


# -- an actor whose torch sees no GPU: an owner failure ----------------------------------------
@pytest.mark.skipif(not NO_CUDA, reason="torch sees a CUDA device here")
def test_an_actor_without_a_visible_gpu_fails_as_an_owner(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cfg_json = config_to_json(gpu_cfg(**{"engine_opts.owners_per_node": 2}))
    with pytest.raises(OwnerFailure) as e:
        client_app.block_side(cfg_json, range(0, 2))
    reason = str(e.value)
    assert reason.startswith(OwnerFailure.TAG) and "\n" not in reason
    assert "sees 0 CUDA device(s)" in reason and "CUDA_VISIBLE_DEVICES=)" in reason
    assert not client_app._CACHE  # nothing cached: the next message checks again
    # the driver records it as that block's failure and goes on (not "a fedudp bug")
    got, failed = exchange({0: ok_reply(), 1: raised_reply(e.value)})
    assert set(got) == {0} and failed[1].startswith(OwnerFailure.TAG)
    assert "sees 0 CUDA device(s)" in failed[1]


def test_weakened_twin_a_bare_error_for_a_missing_gpu_is_caught():
    """A missing GPU raised as a plain error (no ``OwnerFailure``) stops the run as a bug."""
    with pytest.raises(RuntimeError, match="a fedudp bug, not an owner failure"):
        exchange({0: ok_reply(), 1: raised_reply(RuntimeError("no CUDA device"))})


# -- what leaves an actor: CPU tensors ---------------------------------------------------------
class OnDevice(torch.Tensor):
    """A tensor as a CUDA one behaves at the wire: ``.numpy()`` refuses it; ``.cpu()`` gives a
    plain CPU tensor (and is recorded)."""

    moved: list[int] = []

    def numpy(self, *a, **k):  # what torch raises for a CUDA tensor
        raise TypeError("can't convert cuda:0 device type tensor to numpy")

    def cpu(self, *a, **k):
        OnDevice.moved.append(1)
        return torch.Tensor.cpu(self).as_subclass(torch.Tensor)


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.clone().as_subclass(OnDevice)


def reply_leaves_on_the_cpu() -> bool:
    """The check: the reply conversion hands the wire plain CPU tensors with the same values."""
    rows = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    rep = OwnerReply(("w",), Contribution(rows=on_device(rows), total=None, count=2))
    out = actor_device.cpu_reply(rep)
    r = out.contribution.rows
    return type(r) is torch.Tensor and r.device.type == "cpu" and torch.equal(r, rows)


def test_the_reply_is_moved_to_the_cpu():
    assert reply_leaves_on_the_cpu()
    assert OnDevice.moved  # through .cpu()


def test_weakened_twin_reply_left_on_the_device_is_caught(monkeypatch):
    monkeypatch.setattr(actor_device, "cpu_reply", lambda rep: rep)
    assert not reply_leaves_on_the_cpu()


# -- a whole run in this process: the driver, the real ClientApp, the device -------------------
class InProcessGrid:
    """The grid ``FlowerTransport`` drives, answered in this process by fedudp's ClientApp
    (``query``/``train``/``evaluate``), one context per node; an exception in the ClientApp
    becomes Flower's error reply, as Flower's runtime makes it."""

    def __init__(self, nodes: int) -> None:
        self.contexts = {
            100 + p: Context(
                run_id=1,
                node_id=100 + p,
                node_config={"partition-id": p, "num-partitions": nodes},
                state=RecordDict(),
                run_config={},
            )
            for p in range(nodes)
        }
        self.ids = itertools.count()
        self.replies: dict[str, Message] = {}
        self.answers: list[Message] = []

    def get_node_ids(self):
        return list(self.contexts)

    def _deliver(self, m: Message) -> tuple[str, Message]:
        dst, kind = m.metadata.dst_node_id, m.metadata.message_type
        mid = f"m{next(self.ids)}"
        meta = Metadata(
            run_id=1,
            message_id=mid,
            src_node_id=1,
            dst_node_id=dst,
            reply_to_message_id="",
            group_id=m.metadata.group_id,
            created_at=time.time(),
            ttl=3600.0,
            message_type=kind,
        )
        msg = make_message(meta, m.content)
        handler = {"query": client_app.query, "train": client_app.train}.get(
            kind, client_app.evaluate
        )
        try:
            rep = handler(msg, self.contexts[dst])
        except Exception as e:  # noqa: BLE001  (what Flower's runtime replies)
            rep = Message(error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(e)), reply_to=msg)
        self.answers.append(rep)
        return mid, rep

    def send_and_receive(self, msgs, timeout=None):
        return [self._deliver(m)[1] for m in msgs]

    def push_messages(self, msgs):
        ids = []
        for m in msgs:
            mid, rep = self._deliver(m)
            self.replies[mid] = rep
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def gpu_run_sends_cpu(tmp_path, monkeypatch, placed, name: str) -> bool:
    """The check: a device=cuda engine=flower run (2 blocks of 2 owners, personal parameters
    trained and checkpointed) driven in this process completes, the driver built on the CPU and
    the actor on ``cuda``, and what the actor keeps or sends is CPU data although what its
    owners computed (their reply, their personal parameters) is on the device: ``OnDevice``,
    which the wire refuses as it refuses a CUDA tensor. (The kernels run on the CPU here: a
    tensor that only claims a device cannot take the device's code paths inside them.)"""
    from fedudp.flower import wire
    from fedudp.protocol import checkpoint

    pretend_the_actor_sees_a_gpu(monkeypatch)
    real_reply, real_round = client_app.isolated_reply, client_app.Owners.personal_round

    def reply_on_device(*a, **k):
        rep = real_reply(*a, **k)
        c = rep.contribution
        moved = {
            k: on_device(t) for k, t in (("rows", c.rows), ("total", c.total)) if t is not None
        }
        return OwnerReply(rep.param_names, Contribution(**{**c.__dict__, **moved}), rep.failed)

    def round_on_device(self, *a, **k):
        return {k: on_device(v) for k, v in real_round(self, *a, **k).items()}

    monkeypatch.setattr(client_app, "isolated_reply", reply_on_device)
    monkeypatch.setattr(client_app.Owners, "personal_round", round_on_device)
    cfg = gpu_cfg(
        "joint_dp",
        **{
            "engine_opts.owners_per_node": 2,
            "train.rounds": 2,
            "checkpoint.keep_after_finish": "all",
        },
    )
    grid = InProcessGrid(2)
    try:
        summary = run(cfg, tmp_path / name, grid=grid)
    except RuntimeError as e:  # the wire refused a device tensor: a fedudp bug
        assert "can't convert cuda:0 device type tensor to numpy" in str(e)
        return False
    assert summary["stop_reason"] == "completed" and summary["rounds_completed"] == 2
    assert placed[0] == CPU and set(placed[1:]) == {CUDA}  # the driver, then the actor
    states = [c.state[wire.K_STATE] for c in grid.contexts.values() if wire.K_STATE in c.state]
    assert len(states) == 2  # both blocks keep their personal parameters
    for st in states:
        assert all(isinstance(wire.to_numpy(a), np.ndarray) for a in st.values())
    files = list((tmp_path / name).rglob("owners-*.pt"))
    assert files  # each block wrote its state file
    for f in files:
        saved = checkpoint.load_bytes(f.read_bytes())["personal"]
        if any(type(v) is not torch.Tensor or v.device.type != "cpu" for v in saved.values()):
            return False
    return True


@pytest.mark.timeout(120)
def test_a_gpu_run_in_process_builds_on_both_sides_and_keeps_cpu(tmp_path, monkeypatch, placed):
    assert gpu_run_sends_cpu(tmp_path, monkeypatch, placed, "gpu")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("twin", ["reply", "state"])
def test_weakened_twin_a_run_sending_device_tensors_is_caught(tmp_path, monkeypatch, placed, twin):
    if twin == "reply":
        monkeypatch.setattr(client_app, "cpu_reply", lambda rep: rep)
    else:
        monkeypatch.setattr(client_app, "on_cpu", lambda params: dict(params))
    assert not gpu_run_sends_cpu(tmp_path, monkeypatch, placed, twin)


# -- helpers: FlowerTransport._exchange over fake replies --------------------------------------
def _request() -> Message:
    meta = Metadata(
        run_id=1,
        message_id="req",
        src_node_id=1,
        dst_node_id=100,
        reply_to_message_id="",
        group_id="2",
        created_at=time.time(),
        ttl=3600.0,
        message_type="train",
    )
    return make_message(meta, RecordDict())


def ok_reply() -> Message:
    return Message(RecordDict(), reply_to=_request())


def raised_reply(e: BaseException) -> Message:
    """Flower's reply to a ClientApp that raised ``e``."""
    return Message(error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(e)), reply_to=_request())


# FlowerTransport._exchange over prepared replies, as the failure tests drive it
from test_flower_cluster_failures import exchange  # noqa: E402
