"""The whole wire vocabulary of ``engine=flower``: record keys and codecs
(docs/architecture.md#the-owner-boundary).

Server -> owner: ``K_RUN`` (config JSON, round, the owner's sampled units, the aggregator's
``Constraint``) and ``K_SHARED`` (the broadcast: shared parameters only). Owner -> server:
``K_REPLY`` (counts), ``K_NAMES`` (the shared parameter names the vectors concatenate),
``K_VECTORS`` (``rows`` [n, d] or the clipped sum ``total`` [d]), or ``K_EVAL``. Personal
parameters have no key here; they stay in the owner's ``context.state``.
"""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from fedudp.aggregators.base import Constraint, Contribution
from fedudp.protocol.messages import OwnerReply

K_RUN = "fedudp.run"
K_SHARED = "fedudp.shared"
K_REPLY = "fedudp.reply"
K_NAMES = "fedudp.names"
K_VECTORS = "fedudp.vectors"
K_EVAL = "fedudp.eval"


def params_to_record(params: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: Array(v.detach().contiguous().numpy()) for k, v in params.items()})


def record_to_params(rec: ArrayRecord) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(a.numpy().copy()) for k, a in rec.items()}


def run_record(
    cfg_json: str,
    round_: int,
    owner: int,
    units: np.ndarray | None = None,
    constraint: Constraint | None = None,
) -> ConfigRecord:
    """What an owner needs for one message besides the broadcast. ``units``: its sampled units
    (local user ids, or [0] for itself at owner level); None: nothing to send back."""
    rec: dict = {"cfg": cfg_json, "round": int(round_), "owner": int(owner)}
    if units is not None:
        rec["units"] = np.asarray(units, dtype=np.int64).tobytes()
        assert constraint is not None  # sent with the units
        fields = asdict(constraint)
        rec["rows"] = bool(fields.pop("rows"))
        rec.update({k: -1.0 if v is None else float(v) for k, v in fields.items()})  # -1: None
    return ConfigRecord(rec)


def read_units(run: ConfigRecord) -> tuple[np.ndarray, Constraint] | None:
    if "units" not in run:
        return None
    # our own wire format: each key's type is the one owner_message wrote (a ConfigRecord's
    # values are typed as the union of every type a record may hold)
    rec: Any = run
    opt = {
        f.name: None if float(rec[f.name]) < 0 else float(rec[f.name])
        for f in fields(Constraint)
        if f.name != "rows"
    }
    return np.frombuffer(rec["units"], dtype=np.int64), Constraint(rows=bool(rec["rows"]), **opt)


def reply_to_records(rep: OwnerReply, owner: int, seconds: float) -> RecordDict:
    c = rep.contribution
    rd = RecordDict()
    rd[K_REPLY] = MetricRecord(
        {
            "owner": int(owner),
            "count": int(c.count),
            "clipped": int(c.clipped),
            "failed": int(rep.failed),
            "seconds": float(seconds),
            "fraction_sum": float(c.fraction_sum),
            "fraction_reports": int(c.fraction_reports),
        }
    )
    rd[K_NAMES] = ConfigRecord({"names": list(rep.param_names) or [""]})
    for key, t in (("rows", c.rows), ("total", c.total)):
        if t is not None:
            rd[K_VECTORS] = ArrayRecord({key: Array(t.detach().contiguous().numpy())})
    return rd


def records_to_reply(rd: RecordDict) -> tuple[int, OwnerReply]:
    # our own wire format (reply_to_records): each key's type is the one written there
    meta: Any = rd[K_REPLY]
    names: tuple[str, ...] = tuple(n for n in cast(Any, rd[K_NAMES])["names"] if n)
    arrays: Any = rd.get(K_VECTORS, {})
    got = {k: torch.from_numpy(arrays[k].numpy().copy()) for k in ("rows", "total") if k in arrays}
    c = Contribution(
        got.get("rows"),
        got.get("total"),
        int(meta["count"]),
        int(meta["clipped"]),
        fraction_sum=float(meta.get("fraction_sum", 0.0)),
        fraction_reports=int(meta.get("fraction_reports", 0)),
    )
    return int(meta["owner"]), OwnerReply(names, c, int(meta["failed"]))


def ack_record(owner: int) -> RecordDict:
    """per_silo's reply to a train message: nothing but who answered."""
    return RecordDict(
        {
            K_REPLY: MetricRecord(
                {"owner": int(owner), "count": 0, "clipped": 0, "failed": 0, "seconds": 0.0}
            )
        }
    )


def eval_record(owner: int, accuracy: float, loss: float, examples: int) -> RecordDict:
    return RecordDict(
        {
            K_EVAL: MetricRecord(
                {
                    "owner": int(owner),
                    "accuracy": float(accuracy),
                    "loss": float(loss),
                    "num-examples": int(examples),
                }
            )
        }
    )
