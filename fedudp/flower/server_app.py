"""``engine=flower``: owners as Flower ``ClientApp``s, the round loop in a ``ServerApp``
(docs/architecture.md#engines).

A transport only: ``FlowerTransport`` sends each round's broadcast and the owners' sampled
units as Flower messages (one ``train`` message per SuperNode, i.e. per owner or per block
of ``engine_opts.owners_per_node`` owners (``fedudp.flower.blocks``), in every round of the
billboard, an empty unit list to an owner without sampled units, so that which owners fail
never depends on
the sample; in a round without a billboard, every owner when personal parameters are trained,
else none), checks the replies and
hands them to ``fedudp.billboard.rounds.run_rounds``; ``evaluate`` messages score the owners.
``execute`` starts ``flwr.simulation.run_simulation`` on Ray (client resources from
``engine_opts.num_cpus/num_gpus``, an existing cluster from ``engine_opts.address``), or
drives the grid that ``flwr run``'s ServerApp hands in.

Failures: an owner with no reply within ``engine_opts.timeout_s``, an ``OwnerFailure`` or a
Flower infrastructure error, or a reply that cannot be right (shape, counts, NaN/inf) is
excluded from that round and recorded with its reason. Any other exception raised inside an
owner is a bug in fedudp and stops the run. Accounting: the round's release still happened, so
the ledger composes its event unchanged; an excluded unit contributes exactly zero (the
denominator is the public q·N), which keeps the event valid for add/remove-one-unit adjacency
provided a failure depends only on the failing owner's infrastructure, not its data.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from collections.abc import Callable
from logging import WARNING
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Context, Message, RecordDict
from flwr.common import log
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

import fedudp.flower.client_app as flower_client
import fedudp.flower.cluster as cluster
import fedudp.flower.ray_watchdog as ray_watchdog
import fedudp.flower.wire as wire
from fedudp.billboard.rounds import Collected, Evaluation, RoundsResult, Transport
from fedudp.build import RunSettings
from fedudp.config import RunConfig, config_to_json
from fedudp.data.federation import Federation
from fedudp.flower.blocks import (
    block_failures,
    block_of_owner,
    block_units,
    mark_block,
    owner_blocks,
)
from fedudp.owner.owners import Owners, Params
from fedudp.protocol import checkpoint
from fedudp.protocol.contributions import (
    ConstraintSource,
    Contribution,
    Reveal,
    current_constraint,
)
from fedudp.protocol.messages import OwnerFailure, OwnerReply
from fedudp.stopping import StopFlag

__all__ = ["FlowerTransport", "execute", "final_status", "INFRASTRUCTURE"]

# Flower errors that say the owner's infrastructure failed (not fedudp's code)
INFRASTRUCTURE = {
    ErrorCode.MESSAGE_UNAVAILABLE,
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
    ErrorCode.NODE_UNAVAILABLE,
    ErrorCode.CLIENT_APP_CRASHED,
}


class FlowerTransport:
    """The round loop's transport over a Flower grid (``fedudp.billboard.rounds.Transport``).

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration (sent to the owners as JSON).
    settings : RunSettings
        Its settings (the reply timeout).
    owners : Owners
        The owner side (its dimensions and progress hook; the owners compute on the nodes).
    fed : Federation
        The federation (who holds which users).
    constraint : ConstraintSource
        The aggregator's constraint, asked each round.
    grid : flwr.serverapp.Grid
        Flower's grid.
    stop_flag : StopFlag or None
        SIGINT/SIGTERM as seen by the main thread.

    Raises
    ------
    RuntimeError
        Fewer Flower nodes than owners connect, or an owner's query fails.
    """

    poll_cap = 0.05  # the longest wait between two pulls for replies (``__init__`` sets it)

    def __init__(
        self,
        cfg: RunConfig,
        settings: RunSettings,
        owners: Owners,
        fed: Federation,
        constraint: ConstraintSource,
        grid: Grid,
        stop_flag: StopFlag | None = None,
    ) -> None:
        self.owners, self.fed, self.constraint, self.grid = owners, fed, constraint, grid
        # polling for replies: 5 ms at most in a simulation (in-process state), 50 ms against a
        # SuperLink over the network (``flwr run``)
        self.poll_cap = 0.005 if _in_process(grid) else 0.05
        self.stop_flag = stop_flag  # SIGINT/SIGTERM seen by the main thread (run_rounds polls it)
        self.cfg_json = config_to_json(cfg)
        self.timeout = settings.timeout_s
        self.connect_timeout = float(settings.connect_timeout_s)
        self.per_node = int(settings.owners_per_node)
        # the public plan: node k holds owners blocks[k] (one owner per node by default)
        self.blocks = owner_blocks(fed.num_owners, self.per_node)
        self.node_of_block: dict[int, int] = {}
        self.node_of_owner: dict[int, int] = {}
        self.owner_pids: dict[int, int] = {}
        self._save: tuple[int, Path] | None = None  # (round, folder): owners save their state
        self._resume: Path | None = None  # owners without state load it from here
        self._last_saved: tuple[int, Path] | None = None  # newest checkpoint: round, owners' folder
        self._unchanged: tuple[int, set[int]] = (0, set())  # (round, blocks Ray lost in train)
        self._connect()

    def _message(
        self, k: int, round_: int, kind: str, shared: Params | None, units: np.ndarray | None = None
    ) -> Message:
        """Node ``k``'s message (its block's owners; with one owner per node, owner ``k``)."""
        block = self.blocks[k]
        constraint = current_constraint(self.constraint)
        rec = wire.run_record(self.cfg_json, round_, block.start, units, constraint)
        if self.per_node > 1:
            mark_block(rec, block, self.fed.num_owners)
        if kind == "train" and self._save is not None and self._save[0] == round_:
            rec[wire.K_PERSONAL_OUT] = str(self._save[1])
        if self._resume is not None:
            rec[wire.K_PERSONAL_IN] = str(self._resume)
        content = RecordDict({wire.K_RUN: rec})
        if shared:
            content[wire.K_SHARED] = wire.params_to_record(shared)
        return Message(
            content, dst_node_id=self.node_of_block[k], message_type=kind, group_id=str(round_)
        )

    def _connect(self) -> None:
        """Wait for one SuperNode per block and ask each which block it is, each step within
        ``engine_opts.connect_timeout_s`` (the query's answer within the larger of it and
        ``engine_opts.timeout_s``)."""
        n, nb, limit = self.fed.num_owners, len(self.blocks), self.connect_timeout
        t_end = time.time() + limit
        while len(nodes := sorted(self.grid.get_node_ids())) < nb:
            self._check_stop()
            if time.time() > t_end:
                raise RuntimeError(
                    f"only {len(nodes)} Flower nodes connected within "
                    f"engine_opts.connect_timeout_s={limit:g}, {nb} needed "
                    f"(partition.num_owners={n}, engine_opts.owners_per_node={self.per_node}): "
                    "start more SuperNodes or raise engine_opts.connect_timeout_s"
                )
            time.sleep(0.2)
        msgs = [
            Message(
                RecordDict({wire.K_RUN: wire.run_record(self.cfg_json, 0, -1)}),
                dst_node_id=nid,
                message_type="query",
            )
            for nid in nodes
        ]
        wait = max(self.timeout or 0, limit)
        for rep in self.grid.send_and_receive(msgs, timeout=wait):
            if rep.has_error():
                raise RuntimeError(f"owner query failed: {rep.error.reason}")
            k = int(cast(int, rep.content[wire.K_REPLY]["owner"]))
            if not 0 <= k < nb:
                raise RuntimeError(
                    f"a Flower node has partition-id {k}, but there are {nb} blocks of "
                    f"engine_opts.owners_per_node={self.per_node} owners: start Flower with "
                    f"num-supernodes={nb}"
                )
            self.node_of_block[k] = rep.metadata.src_node_id
            for j in self.blocks[k]:
                self.node_of_owner[j] = rep.metadata.src_node_id
                self.owner_pids[j] = int(cast(int, rep.content[wire.K_REPLY]["pid"]))
        if missing := sorted(set(range(n)) - set(self.node_of_owner)):
            raise RuntimeError(
                f"no Flower node for owners {missing[:10]} (no answer to the first query "
                f"within engine_opts.connect_timeout_s={limit:g})"
            )

    def _exchange(
        self,
        msgs: dict[int, Message],
        round_: int,
        while_waiting: Callable[[], None] | None = None,
        stage: str = "owners",
    ) -> tuple[dict[int, Message], dict[int, str]]:
        """Push, run ``while_waiting``, pull until every reply or the timeout (polling from 2 ms,
        backing off to ``poll_cap``). Returns (replies, failure reasons) by owner. The replies so far
        go to the owners' progress hook (``Owners.on_progress``) as (stage, replied, sent)."""
        pending = set(self.grid.push_messages(list(msgs.values()))) if msgs else set()
        if pending:
            from fedudp.flower.ray_backend import wake  # the simulation looks at once

            wake()
        if while_waiting is not None:
            while_waiting()
        end = None if self.timeout is None else time.time() + float(self.timeout)
        got: list[Message] = []
        interval = 0.002
        while pending and (end is None or time.time() < end):
            self._check_stop()  # abandon the round: nothing of it is released
            new = list(self.grid.pull_messages(list(pending)))
            got.extend(new)
            pending.difference_update(m.metadata.reply_to_message_id for m in new)
            if new:
                self.owners.report_progress(stage, len(msgs) - len(pending), len(msgs))
            interval = 0.002 if new else min(interval * 1.5, self.poll_cap)
            if pending:
                time.sleep(interval)
        owner_of_node = {v: k for k, v in self.node_of_block.items()}  # node -> block
        replies = {owner_of_node[m.metadata.src_node_id]: m for m in got}
        failed = {
            j: f"timeout: no reply within engine_opts.timeout_s={self.timeout}"
            for j in msgs
            if j not in replies
        }
        for j, m in list(replies.items()):
            if not m.has_error():
                continue
            del replies[j]
            reason = str(m.error.reason)
            ray_lost = cluster.lost(m.error.code, reason)  # its actor or node lost: infrastructure
            if (
                ray_lost is None
                and m.error.code not in INFRASTRUCTURE
                and (OwnerFailure.TAG not in reason)
            ):
                raise RuntimeError(
                    f"owner {j} raised in round {round_} (a fedudp bug, not an "
                    f"owner failure): {reason.strip()}"
                )
            failed[j] = ray_lost or _short(reason)
        return replies, failed

    def train(self, shared: Params, cohort: np.ndarray | None, round_: int) -> Collected:
        units: dict[int, np.ndarray] = {}
        if cohort is not None and self.owners.spec.cohort_is_owners:
            units = {int(j): np.zeros(1, dtype=np.int64) for j in cohort}
        elif cohort is not None:
            cohort = self.fed.present(cohort, False)
            owner = self.fed.user_owner[cohort]
            units = {
                int(j): cohort[owner == j] - self.fed.owner_user_offsets[j]
                for j in np.unique(owner)
            }
        # every owner is asked in a round of the billboard (those without sampled units with an
        # empty list): which owners fail must not depend on the sample, since the fail-closed
        # rule (Billboard.withhold) reads it. One message per node: its block's units
        ask_all = self.owners.trains_personal or cohort is not None
        blocks = self.blocks
        targets = (
            range(len(blocks))
            if ask_all
            else sorted({int(k) for k in block_of_owner(blocks)[sorted(units)]})
        )
        offs, by_owner = self.fed.owner_user_offsets, self.owners.spec.cohort_is_owners
        sent = {  # each node's units (None: nothing asked back)
            k: None if cohort is None else block_units(units, blocks[k], offs, by_owner)
            for k in targets
        }
        msgs = {k: self._message(k, round_, "train", shared, sent[k]) for k in targets}
        got, failed = self._exchange(msgs, round_)
        # a node Ray lost returned no context: its owners' personal state is last round's
        self._unchanged = (round_, {k for k, r in failed.items() if r.startswith(cluster.LOST)})
        replies: dict[int, OwnerReply] = {}
        for k, m in sorted(got.items()) if cohort is not None else ():  # per_silo: acks
            try:
                owner, rep = wire.records_to_reply(m.content)
                n_sent = len(cast(np.ndarray, sent[k]))
                _check_reply(rep, owner, blocks[k], n_sent, self.owners.shared_dim)
                replies[k] = rep
            except (KeyError, ValueError, TypeError) as e:
                failed[k] = f"{type(e).__name__}: {e}"
        constraint = current_constraint(self.constraint)
        kept = [replies[k] for k in sorted(replies)]
        if constraint is not None and constraint.secure is not None and cohort is not None:
            kept = self._reveal(replies, failed, round_)
        # a failed node is a failure of every owner of its block, each with its units
        why = cluster.gone(failed, len(msgs))
        return Collected(kept, block_failures(failed, blocks, units), gone=why)

    def _reveal(
        self, replies: dict[int, OwnerReply], failed: dict[int, str], round_: int
    ) -> list[OwnerReply]:
        """SecAgg's unmasking step (simulated): the surviving owners are asked for their pair
        seeds with the owners that sent no share, so that the billboard can remove those
        masks; a survivor that does not reveal is dropped too (its reason in ``failed``) and the
        others are asked again for it. ``replies`` and ``failed`` are by node (its block of
        owners, each with its own share and seeds). Returns the replies whose shares stay in
        the sum, one more reply carrying the reveals."""
        n, blocks = self.fed.num_owners, self.blocks
        shares = dict(sorted(replies.items()))
        reveals: dict[tuple[int, int], Reveal] = {}
        for _ in range(n):
            live = {j for k in shares for j in blocks[k]}
            gone = sorted(set(range(n)) - live)
            ask = {
                k: sorted(d for d in gone if any((j, d) not in reveals for j in blocks[k]))
                for k in shares
            }
            ask = {k: ds for k, ds in ask.items() if ds}
            if not ask:
                break
            msgs = {k: self._reveal_message(k, ds, round_) for k, ds in ask.items()}
            got, lost = self._exchange(msgs, round_, stage="reveals")
            for k, m in got.items():
                try:
                    rs = wire.records_to_reveals(m.content)
                    want = {(j, d) for j in blocks[k] for d in ask[k]}
                    if {(r.survivor, r.dropped) for r in rs} != want or len(rs) != len(want):
                        raise ValueError("seeds for other owners than asked")
                    reveals.update({(r.survivor, r.dropped): r for r in rs})
                except (KeyError, ValueError, TypeError) as e:
                    lost[k] = f"reveal: {type(e).__name__}: {e}"
            for k, why in lost.items():
                failed[k] = f"reveal: {why}"
                shares.pop(k, None)
        kept = list(shares.values())
        if kept:
            c = kept[0].contribution
            live = {j for k in shares for j in blocks[k]}
            extra = Contribution(
                None,
                None,
                0,
                roster=c.roster,
                reveals=tuple(r for (s, _), r in sorted(reveals.items()) if s in live),
                round_=c.round_,
            )
            kept.append(OwnerReply(kept[0].param_names, extra))
        return kept

    def _reveal_message(self, k: int, dropped: list[int], round_: int) -> Message:
        """Node ``k`` asked for its owners' pair seeds with the ``dropped`` owners."""
        block = self.blocks[k]
        rec = wire.reveal_request(self.cfg_json, round_, block.start, dropped)
        if self.per_node > 1:
            mark_block(rec, block, self.fed.num_owners)
        return Message(
            RecordDict({wire.K_RUN: rec}),
            dst_node_id=self.node_of_block[k],
            message_type="query",
            group_id=str(round_),
        )

    def evaluate(
        self, shared: Params, round_: int, while_waiting: Callable[[], None] | None = None
    ) -> Evaluation:
        n, blocks = self.fed.num_owners, self.blocks
        msgs = {k: self._message(k, round_, "evaluate", shared) for k in range(len(blocks))}
        got, failed = self._exchange(msgs, round_, while_waiting, stage="evaluating")
        acc, loss = np.full(n, np.nan), np.full(n, np.nan)
        for k, m in got.items():
            rec: Any = m.content[wire.K_EVAL]
            b = blocks[k]
            if "accuracies" in rec:  # a block's, one per owner
                acc[b.start : b.stop] = [float(v) for v in rec["accuracies"]]
                loss[b.start : b.stop] = [float(v) for v in rec["losses"]]
            else:
                acc[b.start], loss[b.start] = float(rec["accuracy"]), float(rec["loss"])
        return Evaluation(acc, loss, block_failures(failed, blocks, {}))

    def personal(self) -> Params:
        return {}  # personal parameters stay with the owners (context.state)

    def info(self) -> dict:
        return {
            "flower_nodes": len(self.node_of_block),
            "ray_address": _ray_address(),
            "flower_worker_pids": sorted(set(self.owner_pids.values())),
        }

    def _check_stop(self) -> None:
        if self.stop_flag is not None:
            self.stop_flag.check()

    def _holders(self) -> list[int]:
        """Owners whose personal state changes (and so must be checkpointed)."""
        return list(range(self.fed.num_owners)) if self.owners.trains_personal else []

    def will_checkpoint(self, round_: int, folder: Path) -> None:
        """Round ``round_``'s train messages ask each owner to save its personal state to
        ``folder/owner-<j>.pt`` itself (atomically; it never crosses the wire)."""
        self._save = (round_, Path(folder))
        if self._holders():
            Path(folder).mkdir(parents=True, exist_ok=True)

    def checkpoint_state(self, round_: int) -> dict | None:
        """The owners who saved their state for ``round_``; None (no checkpoint this round)
        if one of them did not (it failed or timed out).

        A node whose train message Ray lost (its actor or node died: ``cluster.lost``) ran
        nothing Flower kept: where the newest checkpoint is last round's, its owners' personal
        state is still that checkpoint's, so the node's state file is copied from it into this
        round's folder (its bytes, never opened here: over anything the lost node may have
        written before it died; another blocking's files there: no checkpoint). A node that timed
        out or sent a bad reply may have advanced its state, and so may a lost node whose
        previous round was not checkpointed: no checkpoint."""
        folder = self._save[1] if self._save is not None and self._save[0] == round_ else None
        holders = self._holders()
        if not holders:
            return {"owners_saved": holders}
        if folder is None:
            return None
        lost_round, lost = self._unchanged
        if lost_round == round_ and lost:
            if self._last_saved is None or self._last_saved[0] != round_ - 1:
                return None
            for k in sorted(lost):
                # the node's own state file of last round, its bytes copied unread (the
                # server never opens an owner's personal state); none: no checkpoint
                block = self.blocks[k]
                name = (
                    checkpoint.owner_file(folder, block[0])
                    if len(block) == 1
                    else checkpoint.block_file(folder, block[0], block[-1])
                ).name
                before = Path(self._last_saved[1]) / name
                if not before.is_file():
                    return None
                for j in block:  # whatever the lost node wrote goes
                    path, _ = checkpoint.owner_state_files(folder).get(j, (None, 0))
                    if path is not None:
                        path.unlink(missing_ok=True)
                checkpoint.atomic_write(Path(folder) / name, before.read_bytes())
        if not set(holders) <= set(checkpoint.owner_state_files(folder)):
            return None
        self._last_saved = (round_, folder)
        return {"owners_saved": holders, "round": round_}

    def restore(self, state: dict, folder: Path) -> None:
        """Owners load their personal state from the checkpoint's folder on their first
        message (their ``context.state`` is empty in a new simulation); a checkpoint of
        engine=local holds the stacked rows itself: they are written there first."""
        restored = state.get("personal")
        if "personal" in state:  # engine=local's: its stacked rows, one file for every owner
            state = {"owners_saved": self._holders()}
            if state["owners_saved"]:
                n = self.fed.num_owners
                Path(folder).mkdir(parents=True, exist_ok=True)
                checkpoint.save_owners_personal(folder, range(n), cast(Params, restored))
        self._resume = Path(folder) if state["owners_saved"] else None
        if self._resume is not None and "round" in state:
            self._last_saved = (int(state["round"]), self._resume)


def _in_process(grid: Any) -> bool:
    """Whether ``grid`` is the simulation's in-process grid (Flower's ``InMemoryGrid``)."""
    try:
        from flwr.superlink.grid.inmemory_grid import InMemoryGrid
    except ImportError:  # another Flower layout: poll as over the network
        return False
    return isinstance(grid, InMemoryGrid)


def _short(reason: str) -> str:
    """The line of a Flower error reason that says what failed (no Ray traceback)."""
    lines = [ln.strip() for ln in reason.splitlines() if ln.strip()]
    tagged = [ln for ln in lines if OwnerFailure.TAG in ln]
    line = tagged[-1][tagged[-1].index(OwnerFailure.TAG) :] if tagged else (lines or ["?"])[-1]
    return line.rstrip("'>")


def _check_reply(rep: OwnerReply, owner: int, block: range, units_sent: int, dim: int) -> None:
    """Reject (-> failed owners of the block) a reply whose origin, shape, counts or values
    cannot be right."""
    c = rep.contribution
    expected = block.start
    if owner != expected:
        raise ValueError(f"reply from owner {owner}, expected {expected}")
    if c.count + rep.failed > units_sent:
        raise ValueError(f"{c.count + rep.failed} units replied, {units_sent} sampled")
    for t in (c.rows, c.total):
        if t is not None and (t.shape[-1] != dim or not bool(torch.isfinite(t).all())):
            raise ValueError("shared vector of the wrong length or not finite")
    if c.shares and [s.owner for s in c.shares] != list(block):
        raise ValueError("a distributed reply must carry one masked share per owner of its node")
    if c.count and c.rows is None and c.total is None and not c.shares:
        raise ValueError("units counted but no vectors")
    if not 0 <= c.fraction_reports <= len(block) or not math.isfinite(c.fraction_sum):
        raise ValueError("an owner's adaptive-clip report is not one finite fraction")


def execute(
    cfg: RunConfig,
    settings: RunSettings,
    owners: Owners,
    fed: Federation,
    constraint: ConstraintSource,
    drive: Callable[[Transport], RoundsResult],
    grid: Any = None,
) -> RoundsResult:
    """Run ``drive`` (the round loop) on Flower: on ``grid`` (``flwr run``), or in a simulation
    on Ray with one SuperNode per owner.

    Parameters
    ----------
    cfg : RunConfig
        Travels to the owners (as JSON), which build their side from it (``fedudp.build``).
    settings : RunSettings
        Ray's resources per owner, an existing cluster's address, the reply timeout.
    owners : Owners
    fed : Federation
    constraint : ConstraintSource
    drive : callable
        The round loop, ``drive(transport) -> RoundsResult``.
    grid : flwr.serverapp.Grid or None
        ``flwr run``'s grid; None: a simulation.

    Returns
    -------
    RoundsResult

    Raises
    ------
    RuntimeError
        The simulation ended without a result; an owner raised (a fedudp bug).
    """
    stop = StopFlag()
    if grid is not None:  # flwr run: this ServerApp may run outside the main thread
        with stop.catching():
            return final_status(
                drive(FlowerTransport(cfg, settings, owners, fed, constraint, grid, stop))
            )
    eo = settings
    if not eo.address or str(eo.address).split(":")[0] in ("127.0.0.1", "localhost"):
        _loopback_only()
    if not eo.address:  # the Ray this run starts ends with it, even after SIGKILL
        ray_watchdog.start()
    # Ray started (or joined) here and checked before Flower's threads start: a refused run
    # ends with one line and no thread left waiting (fedudp.flower.cluster)
    cluster.preflight(eo, str(cfg.engine_opts.device))
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    app, result, error = ServerApp(), [], []

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        try:
            result.append(
                drive(FlowerTransport(cfg, settings, owners, fed, constraint, grid, stop))
            )
        except BaseException as e:  # re-raised below: Flower only logs a ServerApp's error
            error.append(e)
            raise

    # The round loop runs in Flower's ServerApp thread, where no signal handler can be set: the
    # main thread records SIGINT/SIGTERM, the loop abandons its round, returns ``interrupted``,
    # and Flower then stops its runtime and Ray as after a finished run.
    from fedudp.flower.ray_backend import using_backend  # imports Ray and Flower's backend

    pin = settings.owners_per_node > 1  # an actor keeps only its nodes' blocks
    with stop.catching(), _keep_sigterm_handler(), using_backend(pin):
        run_simulation(
            server_app=app,
            client_app=flower_client.client_app,
            num_supernodes=len(owner_blocks(fed.num_owners, settings.owners_per_node)),
            backend_name="ray",
            backend_config=_backend_config(eo),
        )
    if error:
        raise error[0]
    if not result:
        raise RuntimeError("the Flower simulation ended without a result (see the log above)")
    return final_status(result[0])


def _backend_config(eo: RunSettings) -> dict:
    """Ray's client resources per owner and the cluster to run on."""
    return {
        "client_resources": {
            "num_cpus": float(eo.num_cpus),
            "num_gpus": float(eo.num_gpus),
        },
        # "local": a new Ray of this run's own, never a stale cluster named
        # in /tmp/ray/ray_current_cluster (ray.init's default would join it); used only where
        # Ray is not yet initialized (cluster.preflight initializes it first)
        "init_args": cluster.ray_init_args(eo),
    }


def final_status(res: RoundsResult) -> RoundsResult:
    """The ServerApp's log warns with a completed run's note (withheld rounds, rounds that
    released the noise alone: ``fedudp.billboard.rounds.completion_notes``, already the
    result's ``message`` and the summary's ``stop_message``); a run in which no round released
    already ends ``failed`` (``fedudp.billboard.rounds``).

    Parameters
    ----------
    res : RoundsResult

    Returns
    -------
    RoundsResult
        ``res`` itself.
    """
    if res.stop_reason == "completed" and res.message:
        log(WARNING, "fedudp: %s", res.message)
    return res


@contextlib.contextmanager
def _keep_sigterm_handler():
    """``ray.init`` (called by Flower in the main thread) replaces the driver's SIGTERM handler
    with ``sys.exit``, which would end the process mid-round with the ServerApp thread still
    running; keep fedudp's (``StopFlag``) while the simulation runs."""
    try:
        import ray._private.utils as ray_utils
    except ImportError:
        yield
        return
    original = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original


def _loopback_only() -> None:
    """Keep a local Ray on 127.0.0.1 (Ray otherwise advertises the host's network address):
    Ray's single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when Ray is imported
    and by its workers from the environment), unless the user chose otherwise."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    consts = sys.modules.get("ray._private.ray_constants")
    if consts is not None and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] in ("0", "false"):
        cast(Any, consts).ENABLE_RAY_CLUSTER = False  # Ray's module constant, set at import


def _ray_address() -> str | None:
    """The GCS address of the Ray cluster the simulation runs on (None outside Ray)."""
    try:
        import ray

        return str(ray.get_runtime_context().gcs_address) if ray.is_initialized() else None
    except Exception:  # noqa: BLE001  (diagnostic only)
        return None
