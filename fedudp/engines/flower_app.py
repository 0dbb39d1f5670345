"""The owner as a Flower ``ClientApp`` and the message codecs of ``engine=flower`` (issue 4).

One ``ClientApp`` instance is **one owner** (its Flower partition id is the owner id). It
rebuilds the federation deterministically from the run configuration the billboard sends
(cached per worker process), takes its own shard with ``Federation.owner(j)``, keeps its
personal parameters **only** in ``context.state`` (an ``ArrayRecord``), and runs exactly the
owner math of the local engine (``fedudp.core.owner``) on owner-local record offsets:

* ``@app.train()``: personal update on all its records (no noise), then, for its sampled
  users, the per-user shared vectors; the reply is ``make_reply``'s ``OwnerReply`` (per-user
  vectors for aggregators with ``needs_per_user_vectors``, else the sum of clipped vectors
  and a count), encoded by ``reply_to_records``. Nothing else leaves the owner.
* ``@app.evaluate()``: accuracy / loss on its test shard with the broadcast shared
  parameters and its own personal parameters.
* ``@app.query()``: which owner this node is (the server maps node ids to owners once).

``server_app`` is the ``flwr run .`` entry (``[tool.flwr.app.components]`` in pyproject): it
turns ``--run-config`` into a ``RunConfig`` (every key except ``output-dir`` is a dotted
fedudp override such as ``"train.rounds"=3``) and runs ``fedudp.run.run`` with the Flower
engine on the grid Flower hands it.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402

from fedudp.config import RunConfig, SharedUpdate, Unit  # noqa: E402
from fedudp.core import owner as O  # noqa: E402
from fedudp.core.messages import OwnerReply, make_reply  # noqa: E402
from fedudp.engines.local import chunk_budget  # noqa: E402

# record keys (the whole wire vocabulary of engine=flower)
K_RUN = "fedudp.run"          # ConfigRecord server -> owner: cfg json, round, sampled users, ...
K_SHARED = "fedudp.shared"    # ArrayRecord server -> owner: the broadcast (shared params only)
K_REPLY = "fedudp.reply"      # MetricRecord owner -> server: count, clipped, failed, owner
K_NAMES = "fedudp.names"      # ConfigRecord owner -> server: shared parameter names of the vectors
K_VECTORS = "fedudp.vectors"  # ArrayRecord owner -> server: "vectors" [n, d] or "clipped_sum" [d]
K_EVAL = "fedudp.eval"        # MetricRecord owner -> server: accuracy, loss, num-examples
K_STATE = "fedudp.personal"   # context.state only: the owner's personal parameters
K_STATE_META = "fedudp.personal_meta"


# ----------------------------------------------------------------------------------------
# configuration on the wire
def cfg_to_json(cfg: RunConfig) -> str:
    from fedudp.run import config_dict
    return json.dumps(config_dict(cfg), sort_keys=True)


def cfg_from_json(text: str) -> RunConfig:
    from omegaconf import OmegaConf
    # the structured schema turns strings back into the enums
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), json.loads(text)))


def cfg_from_overrides(overrides: dict[str, Any]) -> RunConfig:
    """``{"train.rounds": 3, "method": "fedavg"}`` -> a validated-schema ``RunConfig``."""
    from omegaconf import OmegaConf
    base = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(base, True)
    for k, v in overrides.items():
        OmegaConf.update(base, k, v, merge=True)   # unknown keys / bad values raise, naming the key
    return OmegaConf.to_object(base)


# ----------------------------------------------------------------------------------------
# OwnerReply <-> records (the serialization boundary the message-inspection test checks)
def reply_to_records(rep: OwnerReply, owner: int, seconds: float) -> RecordDict:
    rd = RecordDict()
    rd[K_REPLY] = MetricRecord({"owner": int(owner), "count": int(rep.count),
                                "clipped": int(rep.clipped), "failed": int(rep.failed),
                                "seconds": float(seconds)})
    rd[K_NAMES] = ConfigRecord({"names": list(rep.param_names) or [""]})
    if rep.vectors is not None:
        rd[K_VECTORS] = ArrayRecord({"vectors": Array(rep.vectors.detach().contiguous().numpy())})
    elif rep.clipped_sum is not None:
        rd[K_VECTORS] = ArrayRecord({"clipped_sum": Array(rep.clipped_sum.detach().contiguous().numpy())})
    return rd


def records_to_reply(rd: RecordDict) -> tuple[int, OwnerReply]:
    meta = rd[K_REPLY]
    names = tuple(n for n in rd[K_NAMES]["names"] if n)
    vec = clipped_sum = None
    if K_VECTORS in rd:
        arr = rd[K_VECTORS]
        if "vectors" in arr:
            vec = torch.from_numpy(arr["vectors"].numpy().copy())
        if "clipped_sum" in arr:
            clipped_sum = torch.from_numpy(arr["clipped_sum"].numpy().copy())
    return int(meta["owner"]), OwnerReply(names, vec, clipped_sum, int(meta["count"]),
                                          int(meta["clipped"]), int(meta["failed"]))


def params_to_record(params: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: Array(v.detach().contiguous().numpy()) for k, v in params.items()})


def record_to_params(rec: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in rec.items()}


# ----------------------------------------------------------------------------------------
# the owner's process-level environment (cached: one federation per worker process)
@dataclass
class OwnerEnv:
    cfg: RunConfig
    fed: Any
    model: torch.nn.Module
    spec: Any
    aggregator: Any
    user_spec: O.LocalSpec
    personal_spec: O.LocalSpec
    mode: str
    public_personal: dict[str, torch.Tensor]
    budget: int


_ENV: dict[str, OwnerEnv] = {}
_ENV_LOCK = threading.Lock()


def _env_key(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def owner_env(cfg_json: str) -> OwnerEnv:
    """Build (once per process and config) the federation, model and method split exactly as
    ``fedudp.run.run`` does; randomness is seeded, so every process gets the same."""
    key = _env_key(cfg_json)
    with _ENV_LOCK:
        env = _ENV.get(key)
        if env is not None:
            return env
        from fedudp.aggregators import Sampling, build_aggregator
        from fedudp.core.methods import method_spec
        from fedudp.data.federation import build_federation
        from fedudp.models import build_model

        cfg = cfg_from_json(cfg_json)
        if cfg.engine_opts.threads:
            torch.set_num_threads(cfg.engine_opts.threads)
        fed = build_federation(cfg)
        model = build_model(cfg, fed.input_shape, fed.num_classes)
        if cfg.engine_opts.float64:
            model = model.double()
            fed.x, fed.x_test = fed.x.double(), fed.x_test.double()
        for p in model.parameters():
            p.requires_grad_(False)
        spec = method_spec(cfg, model)
        aggregator = None
        if spec.communicates:
            population = fed.num_owners if spec.unit == Unit.owner else fed.num_users
            # the server put its calibrated noise multiplier into the config: no calibration here
            dim = sum(p.numel() for k, p in model.named_parameters() if k in spec.shared)
            aggregator = build_aggregator(cfg, Sampling(cfg.train.sampling_rate, population),
                                          cfg.train.rounds, dim)
        t = cfg.train
        pe = t.local_epochs if t.personal_epochs is None else t.personal_epochs
        init = dict(model.named_parameters())
        env = OwnerEnv(cfg, fed, model, spec, aggregator,
                       O.LocalSpec(cfg.seed, t.lr, t.batch_size, t.local_epochs),
                       O.LocalSpec(cfg.seed, t.lr, t.batch_size, pe),
                       SharedUpdate(t.shared_update).value,
                       {k: init[k].detach().clone() for k in spec.personal},
                       chunk_budget(cfg.engine_opts.chunk_records, model))
        _ENV.clear()       # one run per process at a time
        _ENV[key] = env
        return env


def _load_personal(env: OwnerEnv, context: Context, key: str) -> dict[str, torch.Tensor]:
    if K_STATE in context.state and context.state[K_STATE_META]["run"] == key:
        return record_to_params(context.state[K_STATE])
    return {k: v.clone() for k, v in env.public_personal.items()}


def _store_personal(context: Context, personal: dict[str, torch.Tensor], key: str) -> None:
    if personal:
        context.state[K_STATE] = params_to_record(personal)
        context.state[K_STATE_META] = ConfigRecord({"run": key})


def _partition(context: Context) -> int:
    return int(context.node_config["partition-id"])


def _apply_fault(run: ConfigRecord, stage: str) -> str:
    """Test-only failure injection requested by the server (``FlowerEngine.faults``)."""
    fault = str(run.get("fault", "")) if "fault" in run else ""
    if fault == f"raise-{stage}" or (fault == "raise" and stage == "train"):
        raise RuntimeError(f"injected failure ({fault})")
    if fault.startswith("sleep:") and stage == "train":
        time.sleep(float(fault.split(":", 1)[1]))
    return fault


# ----------------------------------------------------------------------------------------
# owner math (mirrors LocalEngine._personal_round / _user_vectors / _replies / evaluate)
def owner_personal_update(env: OwnerEnv, j: int, shared, personal, round_: int):
    if not env.spec.personal or env.personal_spec.epochs == 0:
        return personal
    od = env.fed.owner(j)
    n = int(od.x.shape[0])
    units = O.Units(np.array([0]), np.array([n]), np.array([j]), np.array([0]), np.array([n]))
    batched = {k: v.unsqueeze(0) for k, v in personal.items()}
    out = O.personal_update(env.model, shared, batched, od.x, od.y, units, env.personal_spec, round_)
    return {k: out[k][0].detach().clone() for k in personal}


def owner_user_vectors(env: OwnerEnv, j: int, shared, personal, users: np.ndarray, round_: int):
    """Yield [len, d] chunks of per-user shared vectors for local user ids ``users``."""
    from fedudp.engines.local import chunks
    od = env.fed.owner(j)
    n = int(od.x.shape[0])
    uo = od.user_offsets
    k = len(users)
    units = O.Units(uo[users], np.diff(uo)[users], np.full(k, j), np.zeros(k, dtype=np.int64),
                    np.full(k, n))
    for sel in chunks(units.sizes, env.budget):
        sub = units.subset(sel)
        if env.spec.feedback and env.spec.personal:
            src, batched = O.expand(personal, len(sub)), True
        else:
            src, batched = env.public_personal, False
        G = O.user_shared_vectors(env.model, shared, src, batched, od.x, od.y, sub,
                                  env.user_spec, env.mode, round_, env.spec.shared)
        yield G.detach()


class _PerUserRows:
    """The billboard asked for per-user vectors (its aggregator ``needs_per_user_vectors``)."""

    needs_per_user_vectors = True


def owner_reply(env: OwnerEnv, j: int, shared, personal, users: np.ndarray, round_: int,
                contribute: bool, fault: str = "", per_user: bool = False) -> OwnerReply:
    names = env.spec.shared
    # the server says which form it needs; otherwise the owner's copy of the aggregator
    # (same config, the server's noise multiplier) reduces its rows (sum of clipped + count)
    agg = _PerUserRows() if per_user else env.aggregator
    dtype = next(iter(shared.values())).dtype
    d = sum(int(v.numel()) for v in shared.values())
    if env.spec.unit == Unit.owner:
        if not contribute:
            return make_reply(torch.zeros(0, d, dtype=dtype), names, agg)
        od = env.fed.owner(j)
        s = torch.zeros(d, dtype=dtype)
        for G in owner_user_vectors(env, j, shared, personal, np.arange(od.num_users), round_):
            for row in G.to(dtype):
                s = s + row
        rows = (s / max(od.num_users, 1)).unsqueeze(0)
        if fault == "nan":
            rows = rows * float("nan")
        return make_reply(rows, names, agg)
    parts = list(owner_user_vectors(env, j, shared, personal, users, round_)) if len(users) else []
    G = torch.cat(parts) if parts else torch.zeros(0, d, dtype=dtype)
    if fault == "nan" and len(G):
        G = G.clone()
        G[0] = float("nan")
    return make_reply(G, names, agg)


# ----------------------------------------------------------------------------------------
client_app = ClientApp()


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    run = msg.content[K_RUN]
    env = owner_env(str(run["cfg"]))
    j = _partition(context)
    n = int(context.node_config.get("num-partitions", env.fed.num_owners))
    if n != env.fed.num_owners or not 0 <= j < n:
        raise ValueError(f"node has partition-id {j} of {n}, but partition.num_owners="
                         f"{env.fed.num_owners}: start Flower with num-supernodes equal to it")
    return Message(RecordDict({K_REPLY: MetricRecord({"owner": j, "pid": os.getpid()})}), reply_to=msg)


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    t0 = time.perf_counter()
    run = msg.content[K_RUN]
    fault = _apply_fault(run, "train")
    cfg_json = str(run["cfg"])
    env = owner_env(cfg_json)
    key = _env_key(cfg_json)
    j = _partition(context)
    round_ = int(run["round"])
    shared = record_to_params(msg.content[K_SHARED]) if K_SHARED in msg.content else {}
    personal = _load_personal(env, context, key)
    personal = owner_personal_update(env, j, shared, personal, round_)
    _store_personal(context, personal, key)
    if not env.spec.communicates:   # per_silo: nothing is sent but an empty acknowledgement
        rep = OwnerReply((), None, None, 0, 0, 0)
    else:
        users = np.frombuffer(run["users"], dtype=np.int64) if "users" in run else np.zeros(0, np.int64)
        rep = owner_reply(env, j, shared, personal, users, round_, bool(run["contribute"]), fault,
                          bool(run["per_user"]) if "per_user" in run else False)
    return Message(reply_to_records(rep, j, time.perf_counter() - t0), reply_to=msg)


@client_app.evaluate()
def _evaluate(msg: Message, context: Context) -> Message:
    run = msg.content[K_RUN]
    _apply_fault(run, "evaluate")
    cfg_json = str(run["cfg"])
    env = owner_env(cfg_json)
    j = _partition(context)
    shared = record_to_params(msg.content[K_SHARED]) if K_SHARED in msg.content else {}
    personal = _load_personal(env, context, _env_key(cfg_json))
    od = env.fed.owner(j)
    nt = int(od.x_test.shape[0])
    pers = {k: v.unsqueeze(0) for k, v in personal.items()}
    acc, loss = O.evaluate_owners(env.model, shared, pers, od.x_test, od.y_test, np.array([0, nt]))
    return Message(RecordDict({K_EVAL: MetricRecord({
        "owner": j, "accuracy": float(acc[0]), "loss": float(loss[0]), "num-examples": nt})}),
        reply_to=msg)


# ----------------------------------------------------------------------------------------
# `flwr run .` entry: the ServerApp builds the run from --run-config and drives fedudp.run
server_app = ServerApp()


@server_app.main()
def _server_main(grid: Grid, context: Context) -> None:
    from fedudp.config import EngineName
    from fedudp.engines import flower as F
    from fedudp.run import run as fedudp_run

    rc = dict(context.run_config)
    out_dir = os.path.abspath(str(rc.pop("output-dir", "outputs/flwr")))
    if int(rc.get("partition.num_owners", 0)) == 0:   # one owner per Flower SuperNode
        rc["partition.num_owners"] = _count_nodes(grid)
    cfg = cfg_from_overrides(rc)
    cfg.engine = EngineName.flower
    cfg.progress = False
    with F.external_grid(grid):
        summary = fedudp_run(cfg, out_dir)
    from flwr.common import log
    from logging import INFO
    log(INFO, "fedudp: %s accuracy %.4f epsilon %s rounds %s -> %s", summary["method"],
        summary["accuracy_mean"], summary["epsilon"], summary["rounds_completed"], out_dir)


def _count_nodes(grid: Grid, settle_s: float = 2.0, timeout_s: float = 300.0) -> int:
    """Number of connected SuperNodes, once it has stopped growing for ``settle_s``."""
    t_end = time.time() + timeout_s
    last, since = -1, time.time()
    while time.time() < t_end:
        n = len(list(grid.get_node_ids()))
        if n != last:
            last, since = n, time.time()
        elif n > 0 and time.time() - since >= settle_s:
            return n
        time.sleep(0.2)
    raise RuntimeError("no Flower SuperNodes connected")
