"""``engine=flower``: the billboard as a Flower ``ServerApp`` over owner ``ClientApp``s (issue 4).

The ServerApp's "strategy" is the fedudp ``Billboard`` itself; the round mirrors
``LocalEngine.run`` step for step (ARCHITECTURE.md §3, §5):

1. budget check (stop cleanly before a release that would exceed the target epsilon);
2. the billboard's own seeded Poisson sample of units (never Flower's client sampler);
3. one ``train`` message per owner that has to act (all owners when personal parameters
   are trained, else only owners with sampled units), carrying the broadcast shared
   parameters, the owner's sampled user ids and the run configuration; each owner updates
   its personal parameters in ``context.state`` and replies with shared parts only;
4. the aggregator over the stacked per-user vectors (or the sums of clipped vectors), the
   ledger, the server step;
5. ``evaluate`` messages: every owner scores the new shared parameters with its own
   personal parameters.

Failed owners (an exception in the ClientApp, no reply within ``engine_opts.timeout_s``,
an undecodable reply) are excluded from that round's aggregate and counted in the round's
metrics (``failed_owners``; their sampled units are added to ``failed_units``); rows with
NaN/inf are dropped by ``make_reply`` on the owner and counted there. Accounting: the
round's release still happened, so the ledger composes the round's event unchanged; an
excluded unit contributes exactly zero to the clipped sum (whose denominator is the public
``q * N``), which keeps each unit's influence within the clip norm: the event stays valid
for add/remove-one-unit adjacency provided a failure depends only on the failing owner
(infrastructure faults; an owner whose *data* made it crash would tie its users' exclusion
together, which only ``privacy.unit=owner`` covers). Diagnostics are outside the release.

``run()`` launches ``flwr.simulation.run_simulation`` with the Ray backend: client
resources from ``engine_opts.num_cpus`` / ``num_gpus``; Ray ``init_args`` from
``engine_opts.address`` (an existing cluster, e.g. ``ray start --head``). Under
``flwr run .`` the ServerApp in ``flower_app`` hands its grid in via ``external_grid``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from flwr.app import ConfigRecord, Message, RecordDict  # noqa: E402

from fedudp.config import RunConfig, Unit  # noqa: E402
from fedudp.core.billboard import Billboard  # noqa: E402
from fedudp.core.messages import OwnerReply  # noqa: E402
from fedudp.core.methods import MethodSpec  # noqa: E402
from fedudp.data.federation import Federation  # noqa: E402
from fedudp.engines import flower_app as A  # noqa: E402
from fedudp.engines.local import EngineResult, _summarize  # noqa: E402

_EXTERNAL = threading.local()


@contextlib.contextmanager
def external_grid(grid) -> Iterator[None]:
    """Run ``FlowerEngine``s created inside this block on ``grid`` (``flwr run`` path)."""
    prev = getattr(_EXTERNAL, "grid", None)
    _EXTERNAL.grid = grid
    try:
        yield
    finally:
        _EXTERNAL.grid = prev


class FlowerEngine:
    """Same constructor and ``run`` contract as ``LocalEngine``."""

    def __init__(self, cfg: RunConfig, fed: Federation, model: nn.Module, spec: MethodSpec,
                 billboard: Billboard | None, out=None) -> None:
        self.cfg, self.fed, self.model, self.spec, self.billboard = cfg, fed, model, spec, billboard
        self.out = out
        wire = _copy_cfg(cfg)
        agg = billboard.aggregator if billboard is not None else None
        z = getattr(agg, "noise_multiplier", None)
        if z is not None:        # owners rebuild the aggregator without recalibrating
            wire.privacy.noise_multiplier = float(z)
        self.cfg_json = A.cfg_to_json(wire)
        self.timeout = getattr(cfg.engine_opts, "timeout_s", None)
        t = cfg.train
        pe = t.local_epochs if t.personal_epochs is None else t.personal_epochs
        self.trains_personal = bool(spec.personal) and pe > 0
        self.faults: dict[tuple[int, int], str] = {}   # (round, owner) -> fault (tests only)
        self.on_receive: Callable[[Message], None] | None = None   # inspection hook (tests)
        self.node_of_owner: dict[int, int] = {}
        self.owner_pids: dict[int, int] = {}
        self._result: EngineResult | None = None
        self.ray_address: str | None = None

    # -- messaging -----------------------------------------------------------------------
    def _run_record(self, round_: int, owner: int, **extra) -> ConfigRecord:
        rec = {"cfg": self.cfg_json, "round": int(round_)}
        fault = self.faults.get((round_, owner))
        if fault:
            rec["fault"] = fault
        rec.update(extra)
        return ConfigRecord(rec)

    def _exchange(self, grid, msgs: dict[int, Message],
                  while_waiting: Callable[[], None] | None = None) -> dict[int, Message]:
        """Send one message per owner, return the successful replies by owner.

        Like ``Grid.send_and_receive`` (push, then pull until every reply or the timeout),
        with two differences: ``while_waiting`` runs on the server while the owners work,
        and the pull interval starts at 2 ms and backs off to 50 ms (Flower's in-memory grid
        sleeps a fixed 100 ms between pulls, which adds up to that much idle per exchange).
        """
        if not msgs:
            if while_waiting is not None:
                while_waiting()
            return {}
        pending = set(grid.push_messages(list(msgs.values())))
        if while_waiting is not None:
            while_waiting()
        end = None if self.timeout is None else time.time() + float(self.timeout)
        replies: list[Message] = []
        interval = 0.002
        while pending:
            got = list(grid.pull_messages(list(pending)))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if not pending or (end is not None and time.time() >= end):
                break
            interval = 0.002 if got else min(interval * 1.5, 0.05)
            time.sleep(interval)
        owner_of_node = {v: k for k, v in self.node_of_owner.items()}
        out: dict[int, Message] = {}
        for rep in replies:
            if self.on_receive is not None:
                self.on_receive(rep)
            j = owner_of_node.get(rep.metadata.src_node_id)
            if j is None or rep.has_error():
                continue
            out[j] = rep
        return out

    def _connect(self, grid) -> None:
        n = self.fed.num_owners
        t_end = time.time() + 300
        while True:
            nodes = sorted(grid.get_node_ids())
            if len(nodes) >= n:
                break
            if time.time() > t_end:
                raise RuntimeError(f"only {len(nodes)} Flower nodes connected, "
                                   f"partition.num_owners={n} needed")
            time.sleep(0.2)
        msgs = [Message(RecordDict({A.K_RUN: self._run_record(0, -1)}), dst_node_id=nid,
                        message_type="query") for nid in nodes]
        replies = list(grid.send_and_receive(msgs, timeout=max(self.timeout or 0, 600)))
        for rep in replies:
            if self.on_receive is not None:
                self.on_receive(rep)
            if rep.has_error():
                raise RuntimeError(f"owner query failed: {rep.error.reason}")
            meta = rep.content[A.K_REPLY]
            j = int(meta["owner"])
            self.node_of_owner[j] = rep.metadata.src_node_id
            self.owner_pids[j] = int(meta["pid"])
        missing = sorted(set(range(n)) - set(self.node_of_owner))
        if missing:
            raise RuntimeError(f"no Flower node for owners {missing[:10]}")

    def _train(self, grid, shared: dict[str, torch.Tensor], round_: int, sampled: np.ndarray | None
               ) -> tuple[dict[int, OwnerReply], dict[int, int], list[int]]:
        """``sampled``: the billboard's cohort (unit ids) or None (no billboard)."""
        fed = self.fed
        per_owner: dict[int, np.ndarray] = {}
        contribute: dict[int, bool] = {}
        if sampled is not None:
            if self.spec.unit == Unit.owner:
                for j in sampled:
                    contribute[int(j)] = True
            else:
                owners = fed.user_owner[sampled]
                for j in np.unique(owners):
                    per_owner[int(j)] = sampled[owners == j] - fed.owner_user_offsets[j]
        targets = range(fed.num_owners) if self.trains_personal else \
            sorted(set(per_owner) | set(contribute))
        shared_rec = A.params_to_record(shared) if shared else None
        bb = self.billboard
        per_user = bool(bb is not None and bb.aggregator.needs_per_user_vectors)
        msgs = {}
        for j in targets:
            users = per_owner.get(j, np.zeros(0, dtype=np.int64)).astype(np.int64)
            run = self._run_record(round_, j, users=users.tobytes(),
                                   contribute=bool(contribute.get(j, False)), per_user=per_user)
            content = RecordDict({A.K_RUN: run})
            if shared_rec is not None:
                content[A.K_SHARED] = shared_rec
            msgs[j] = Message(content, dst_node_id=self.node_of_owner[j], message_type="train",
                              group_id=str(round_))
        got = self._exchange(grid, msgs)
        replies: dict[int, OwnerReply] = {}
        failed: list[int] = []
        for j in targets:
            rep = got.get(j)
            try:
                if rep is None:
                    raise ValueError("no reply")
                owner, r = A.records_to_reply(rep.content)
                if owner != j:
                    raise ValueError("reply from the wrong owner")
                _check_reply(r, self.billboard, units_sent=1 if contribute.get(j) else
                             len(per_owner.get(j, ())))
                replies[j] = r
            except Exception:   # noqa: BLE001  (a failed owner is excluded, never fatal)
                failed.append(j)
        units = {j: (1 if contribute.get(j) else len(per_owner.get(j, ()))) for j in targets}
        return replies, units, failed

    def _evaluate(self, grid, shared: dict[str, torch.Tensor], round_: int,
                  while_waiting: Callable[[], None] | None = None
                  ) -> tuple[np.ndarray, np.ndarray, int]:
        n = self.fed.num_owners
        shared_rec = A.params_to_record(shared) if shared else None
        msgs = {}
        for j in range(n):
            content = RecordDict({A.K_RUN: self._run_record(round_, j)})
            if shared_rec is not None:
                content[A.K_SHARED] = shared_rec
            msgs[j] = Message(content, dst_node_id=self.node_of_owner[j], message_type="evaluate",
                              group_id=str(round_))
        got = self._exchange(grid, msgs, while_waiting)
        acc, loss = np.full(n, np.nan), np.full(n, np.nan)
        for j, rep in got.items():
            m = rep.content[A.K_EVAL]
            acc[j], loss[j] = float(m["accuracy"]), float(m["loss"])
        return acc, loss, n - len(got)

    # -- rounds (mirrors LocalEngine.run) ------------------------------------------------
    def serve(self, grid, on_round: Callable[[dict], None] | None = None) -> EngineResult:
        cfg, bb = self.cfg, self.billboard
        self._connect(grid)
        self.ray_address = _ray_address()
        rounds, stop = 0, "completed"
        history: list[dict] = []
        acc = loss = None
        shared = bb.shared_params() if bb is not None else {}
        sizes = np.diff(self.fed.test_offsets)
        budget_ok: bool | None = None   # next round's budget check, computed while owners evaluate

        def check_budget() -> None:
            nonlocal budget_ok
            budget_ok = bb.within_budget() if bb is not None else True

        for r in range(1, cfg.train.rounds + 1):
            t0 = time.perf_counter()
            if budget_ok is None:
                check_budget()
            ok, budget_ok = budget_ok, None
            if not ok:
                stop = "budget"
                break
            info: dict = {"round": r}
            cohort = np.flatnonzero(bb.sample(r)) if bb is not None else None
            replies, units, failed_owners = self._train(grid, shared, r, cohort)
            info["failed_owners"] = len(failed_owners)
            if bb is not None:
                order = [replies[j] for j in sorted(replies)]
                failed = sum(rep.failed for rep in order) + sum(units[j] for j in failed_owners)
                if bb.aggregator.needs_per_user_vectors:
                    rows = [rep.vectors for rep in order if rep.vectors is not None and len(rep.vectors)]
                    G = torch.cat([v.to(bb.u.dtype) for v in rows]) if rows else \
                        torch.zeros(0, bb.dim, dtype=bb.u.dtype)
                    agg = bb.release_matrix(G, r)
                else:
                    total = torch.zeros(bb.dim, dtype=bb.u.dtype)
                    for rep in order:
                        if rep.clipped_sum is not None and rep.count:
                            total = total + rep.clipped_sum.to(total.dtype)
                    agg = bb.release_sums(total, sum(rep.count for rep in order),
                                          sum(rep.clipped for rep in order), r)
                shared = bb.shared_params()
                info.update(cohort=int(len(cohort)), failed_units=failed,
                            users_used=agg.users_used,
                            **{f"agg_{k}": v for k, v in agg.diagnostics.items()})
                if bb.ledger.entries:
                    info["epsilon"] = bb.ledger.entries[-1].epsilon
                if agg.halted:
                    rounds, stop = r, "halted"
                    info["seconds"] = time.perf_counter() - t0
                    history.append(info)
                    if on_round:
                        on_round(info)
                    break
            rounds = r
            if r % cfg.train.eval_every == 0 or r == cfg.train.rounds:
                acc, loss, eval_failed = self._evaluate(
                    grid, shared, r, check_budget if r < cfg.train.rounds else None)
                info.update(_summarize(acc, loss, sizes))
                info["failed_eval_owners"] = eval_failed
            info["seconds"] = time.perf_counter() - t0
            history.append(info)
            if on_round:
                on_round(info)
        if acc is None or (history and "accuracy_mean" not in history[-1]):
            acc, loss, _ = self._evaluate(grid, shared, rounds)
        # personal parameters stay with the owners (context.state): the server has none
        res = EngineResult(shared, {}, acc, loss, rounds, stop, history)
        res.extra = {"flower_nodes": len(self.node_of_owner), "ray_address": self.ray_address,
                     "flower_worker_pids": sorted(set(self.owner_pids.values()))}
        return res

    # -- launch ----------------------------------------------------------------------------
    def backend_config(self) -> dict:
        eo = self.cfg.engine_opts
        init_args: dict = {}
        if eo.address:
            init_args["address"] = str(eo.address)
        return {"client_resources": {"num_cpus": float(eo.num_cpus), "num_gpus": float(eo.num_gpus)},
                "init_args": init_args}

    def run(self, on_round: Callable[[dict], None] | None = None, progress=None) -> EngineResult:
        grid = getattr(_EXTERNAL, "grid", None)
        if grid is not None:
            return self.serve(grid, on_round)
        address = self.cfg.engine_opts.address
        if not address or str(address).split(":")[0] in ("127.0.0.1", "localhost"):
            _loopback_only()
        from flwr.serverapp import ServerApp
        from flwr.simulation import run_simulation

        app = ServerApp()

        @app.main()
        def _main(grid, context) -> None:   # noqa: ANN001
            self._result = self.serve(grid, on_round)

        run_simulation(server_app=app, client_app=A.client_app,
                       num_supernodes=self.fed.num_owners, backend_name="ray",
                       backend_config=self.backend_config())
        if self._result is None:
            raise RuntimeError("the Flower simulation ended without a result (see the log above)")
        return self._result


def _check_reply(rep: OwnerReply, bb: Billboard | None, units_sent: int) -> None:
    """Reject (-> failed owner) a reply whose shape, counts or values cannot be right."""
    if bb is None:
        return
    if rep.count + rep.failed > units_sent:
        raise ValueError("more units than were sampled")
    for t in (rep.vectors, rep.clipped_sum):
        if t is None:
            continue
        if t.shape[-1] != bb.dim or not bool(torch.isfinite(t).all()):
            raise ValueError("bad shared vector")
    if rep.count and rep.vectors is None and rep.clipped_sum is None:
        raise ValueError("no vectors")


def _loopback_only() -> None:
    """Keep a local Ray on 127.0.0.1 (Ray otherwise advertises the host's network address).

    Ray resolves a loopback node address to a reachable one unless its single-machine
    mode is on (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when Ray is imported, and by
    worker processes from the environment). Set it unless the user chose otherwise.
    """
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] in ("0", "false"):
        consts.ENABLE_RAY_CLUSTER = False


def _ray_address() -> str | None:
    """The GCS address of the Ray cluster the simulation runs on (None outside Ray)."""
    try:
        import ray
        if ray.is_initialized():
            return str(ray.get_runtime_context().gcs_address)
    except Exception:   # noqa: BLE001  (diagnostic only)
        pass
    return None


def _copy_cfg(cfg: RunConfig) -> RunConfig:
    import copy
    return copy.deepcopy(cfg)
