"""``engine=local``: every owner in one process, batched with ``torch.func`` (ARCHITECTURE.md §5).

Owners' personal parameters are stacked ``[n_owners, ...]``; the sampled users' shared vectors
are computed in chunks of at most ``engine_opts.chunk_records`` records with ``vmap`` (no
Python loop over users or records). With ``chunk_records=1``-sized chunks, one thread and
float64 it is the reference for the engine-equivalence test.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn as nn

from fedudp.config import RunConfig, SharedUpdate, Unit
from fedudp.core import owner as O
from fedudp.core.billboard import Billboard
from fedudp.core.messages import OwnerReply, make_reply
from fedudp.core.methods import MethodSpec
from fedudp.data.federation import Federation


@dataclass
class EngineResult:
    shared: dict[str, torch.Tensor]
    personal: dict[str, torch.Tensor]
    owner_accuracy: np.ndarray
    owner_loss: np.ndarray
    rounds_completed: int
    stop_reason: str
    history: list[dict] = field(default_factory=list)


def user_units(fed: Federation, users: np.ndarray) -> O.Units:
    owners = fed.user_owner[users]
    oo = fed.owner_offsets
    return O.Units(fed.user_offsets[users], np.diff(fed.user_offsets)[users], owners,
                   oo[owners], np.diff(oo)[owners])


def owner_units(fed: Federation, owners: np.ndarray) -> O.Units:
    oo = fed.owner_offsets
    starts, sizes = oo[owners], np.diff(oo)[owners]
    return O.Units(starts, sizes, owners, starts, sizes)


AUTO_CHUNK_CONV, AUTO_CHUNK_DENSE = 512, 8192


def chunk_budget(requested: int, model: nn.Module) -> int:
    """``engine_opts.chunk_records`` (0: auto). Auto: 512 records per vmapped step for models with
    convolutions (per-owner conv weights become grouped convolutions, whose CPU backward slows
    down with the group count: scripts/bench_local.py measured 1.2-1.5x of a plain loop at 512
    vs 2.2-3x at 8192), 8192 for dense models (fewer, larger matmuls win)."""
    if requested:
        return int(requested)
    conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return AUTO_CHUNK_CONV if conv else AUTO_CHUNK_DENSE


def chunks(sizes: np.ndarray, budget: int, per_unit_cap: int | None = None) -> Iterator[np.ndarray]:
    """Consecutive index groups whose padded size (count x max size) stays within ``budget``.

    ``per_unit_cap``: count each unit as at most this many records. Local SGD gathers one
    batch per unit per step, so with ``per_unit_cap=batch_size`` the budget bounds the records
    in one vmapped step (what sets speed and memory there), not the units' total sizes.
    """
    if per_unit_cap is not None:
        sizes = np.minimum(sizes, max(int(per_unit_cap), 1))
    i, n = 0, len(sizes)
    while i < n:
        j, mx = i + 1, int(sizes[i])
        while j < n and (j - i + 1) * max(mx, int(sizes[j])) <= budget:
            mx = max(mx, int(sizes[j]))
            j += 1
        yield np.arange(i, j)
        i = j


def _select(params: dict[str, torch.Tensor], idx: np.ndarray) -> dict[str, torch.Tensor]:
    t = torch.from_numpy(idx)
    return {k: v[t] for k, v in params.items()}


class LocalEngine:
    def __init__(self, cfg: RunConfig, fed: Federation, model: nn.Module, spec: MethodSpec,
                 billboard: Billboard | None) -> None:
        self.cfg, self.fed, self.model, self.spec, self.billboard = cfg, fed, model, spec, billboard
        t = cfg.train
        self.user_spec = O.LocalSpec(cfg.seed, t.lr, t.batch_size, t.local_epochs)
        pe = t.local_epochs if t.personal_epochs is None else t.personal_epochs
        self.personal_spec = O.LocalSpec(cfg.seed, t.lr, t.batch_size, pe)
        self.mode = SharedUpdate(t.shared_update).value
        self.budget = chunk_budget(cfg.engine_opts.chunk_records, model)
        init = dict(model.named_parameters())
        n = fed.num_owners
        # x_pub: the public (seeded, data-independent) initial personal parameters
        self.public_personal = {k: init[k].detach().clone() for k in spec.personal}
        self.personal = {k: v.unsqueeze(0).expand(n, *v.shape).clone()
                         for k, v in self.public_personal.items()}
        self.all_owners = np.arange(n)
        self.replies: list[OwnerReply] = []   # last round's replies (for boundary tests)

    # -- owner side --------------------------------------------------------------------
    def _personal_round(self, shared: dict[str, torch.Tensor], round_: int) -> None:
        if not self.spec.personal or self.personal_spec.epochs == 0:
            return
        units = owner_units(self.fed, self.all_owners)
        new = {k: v.clone() for k, v in self.personal.items()}
        for sel in chunks(units.sizes, self.budget, self.personal_spec.batch_size):
            out = O.personal_update(self.model, shared, _select(self.personal, sel), self.fed.x,
                                    self.fed.y, units.subset(sel), self.personal_spec, round_)
            for k in new:
                new[k][torch.from_numpy(sel)] = out[k].detach()
        self.personal = new

    def _user_vectors(self, shared: dict[str, torch.Tensor], users: np.ndarray, round_: int
                      ) -> Iterator[tuple[np.ndarray, torch.Tensor]]:
        """Yield (users, [len, d]) chunks of per-user shared vectors."""
        units = user_units(self.fed, users)
        cap = self.user_spec.batch_size if self.mode == "delta" else None   # gradient: all at once
        for sel in chunks(units.sizes, self.budget, cap):
            sub = units.subset(sel)
            if self.spec.feedback and self.spec.personal:
                src, batched = _select(self.personal, sub.owners), True
            else:
                src, batched = self.public_personal, False
            G = O.user_shared_vectors(self.model, shared, src, batched, self.fed.x, self.fed.y,
                                      sub, self.user_spec, self.mode, round_, self.spec.shared)
            yield users[sel], G.detach()

    def _replies(self, shared: dict[str, torch.Tensor], cohort: np.ndarray, round_: int
                 ) -> list[OwnerReply]:
        agg = self.billboard.aggregator
        names = self.spec.shared
        if self.spec.unit == Unit.owner:
            owners = cohort
            users = np.concatenate([np.arange(self.fed.owner_user_offsets[j],
                                              self.fed.owner_user_offsets[j + 1]) for j in owners]) \
                if len(owners) else np.zeros(0, dtype=np.int64)
            d = self.billboard.dim
            sums = torch.zeros(self.fed.num_owners, d, dtype=self.billboard.u.dtype)
            for us, G in self._user_vectors(shared, users, round_):
                sums.index_add_(0, torch.from_numpy(self.fed.user_owner[us]), G.to(sums.dtype))
            counts = torch.from_numpy(np.bincount(self.fed.user_owner[users],
                                                  minlength=self.fed.num_owners)).to(sums.dtype)
            rows = sums[torch.from_numpy(owners)] / counts[torch.from_numpy(owners)].clamp(min=1).unsqueeze(1)
            return [make_reply(rows, names, agg)]
        return [make_reply(G, names, agg) for _, G in self._user_vectors(shared, cohort, round_)]

    # -- rounds ------------------------------------------------------------------------
    def evaluate(self, shared: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        fed = self.fed
        sizes = np.diff(fed.test_offsets)
        acc, loss = np.zeros(fed.num_owners), np.zeros(fed.num_owners)
        for sel in chunks(np.maximum(sizes, 1), max(self.budget, int(sizes.max(initial=1)))):
            offs = fed.test_offsets[sel[0]:sel[-1] + 2]
            a, lo = O.evaluate_owners(self.model, shared, _select(self.personal, sel),
                                      fed.x_test, fed.y_test, offs)
            acc[sel], loss[sel] = a, lo
        return acc, loss

    def run(self, on_round: Callable[[dict], None] | None = None,
            progress: Callable[[int], None] | None = None) -> EngineResult:
        cfg, bb = self.cfg, self.billboard
        rounds, stop = 0, "completed"
        history: list[dict] = []
        acc = loss = None
        shared = bb.shared_params() if bb is not None else {}
        for r in range(1, cfg.train.rounds + 1):
            t0 = time.perf_counter()
            if bb is not None and not bb.within_budget():
                stop = "budget"
                break
            self._personal_round(shared, r)
            info: dict = {"round": r}
            if bb is not None:
                cohort = np.flatnonzero(bb.sample(r))
                replies = self._replies(shared, cohort, r)
                self.replies = replies
                failed = sum(rep.failed for rep in replies)
                if bb.aggregator.needs_per_user_vectors:
                    G = torch.cat([rep.vectors for rep in replies]) if replies else \
                        torch.zeros(0, bb.dim)
                    agg = bb.release_matrix(G, r)
                else:
                    total = sum((rep.clipped_sum for rep in replies), torch.zeros(bb.dim, dtype=bb.u.dtype))
                    agg = bb.release_sums(total, sum(rep.count for rep in replies),
                                          sum(rep.clipped for rep in replies), r)
                shared = bb.shared_params()
                info.update(cohort=int(len(cohort)), failed_units=failed,
                            users_used=agg.users_used, **{f"agg_{k}": v for k, v in agg.diagnostics.items()})
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
                acc, loss = self.evaluate(shared)
                info.update(_summarize(acc, loss, np.diff(self.fed.test_offsets)))
            info["seconds"] = time.perf_counter() - t0
            history.append(info)
            if on_round:
                on_round(info)
            if progress:
                progress(r)
        if acc is None or (history and "accuracy_mean" not in history[-1]):
            acc, loss = self.evaluate(shared)
        return EngineResult(shared, self.personal, acc, loss, rounds, stop, history)


def _summarize(acc: np.ndarray, loss: np.ndarray, sizes: np.ndarray) -> dict:
    ok = sizes > 0
    w = sizes[ok] / sizes[ok].sum()
    return {"loss": float(np.mean(loss[ok])), "accuracy_mean": float(np.mean(acc[ok])),
            "accuracy_std": float(np.std(acc[ok])), "accuracy_weighted": float(np.sum(w * acc[ok]))}


summarize = _summarize
