"""The one wire vocabulary of fedudp's Flower integration: every record key and the one codec
of ``ArrayRecord`` / ``ConfigRecord`` / ``MetricRecord`` contents, shared by the user-level DP
wrapper (``fedudp.flower.strategy``, ``fedudp.flower.mod``) and ``engine=flower``
(``fedudp.flower.server_app``, ``fedudp.flower.client_app``; docs/architecture.md#the-owner-boundary).

The wrapper and its mod (beside the app's own ``"arrays"`` / ``"config"``): ``K_DP`` (a
ConfigRecord in a training message: the round, the sampling rate, the constraint, N),
``K_CONTRIB`` (an ArrayRecord in a reply: ``"sum"`` [d] or ``"rows"`` [n, d]), ``K_COUNTS`` (a
MetricRecord in a reply: ``"count"``, ``"clipped"``, ``"users"``, ``"failed"``, ``"raised"``);
in a client's ``context.state`` only (never sent): ``K_PERSONAL``, ``K_USERS``; in the
``node_config`` of the app's training step: ``K_USER_ID``, ``K_CLIENT_PARTITION``,
``K_CLIENT_PARTITIONS``.

``engine=flower``: server -> owner ``K_RUN`` (config JSON, round, the owner's sampled units, the
aggregator's ``Constraint``; ``K_PERSONAL_OUT`` / ``K_PERSONAL_IN``: where an owner saves or
loads its personal state) and ``K_SHARED`` (the broadcast: shared parameters only); owner ->
server ``K_REPLY`` (counts), ``K_NAMES`` (the shared parameter names the vectors concatenate),
``K_VECTORS`` (``rows`` [n, d] or the clipped sum ``total`` [d]), or ``K_EVAL``. Personal
parameters have no key on the wire: they stay in the owner's ``context.state`` (``K_STATE``,
``K_STATE_RUN``).

The codec: ``to_numpy`` reads an ``Array``, ``to_record`` writes an ``ArrayRecord``
(``flat`` / ``unflat`` and ``params_to_record`` / ``record_to_params`` are built on the two).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any, cast

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedudp.protocol.contributions import Constraint, Contribution, MaskedShare, Reveal
from fedudp.protocol.messages import OwnerReply
from fedudp.secure.encoding import SecureEncoding

__all__ = [
    "K_DP",
    "K_CONTRIB",
    "K_COUNTS",
    "K_PERSONAL",
    "K_USERS",
    "K_USER_ID",
    "K_CLIENT_PARTITION",
    "K_CLIENT_PARTITIONS",
    "K_RUN",
    "K_SHARED",
    "K_REPLY",
    "K_SECURE",
    "K_REVEAL",
    "K_NAMES",
    "K_VECTORS",
    "K_EVAL",
    "K_STATE",
    "K_STATE_RUN",
    "K_PERSONAL_OUT",
    "K_PERSONAL_IN",
    "to_numpy",
    "to_record",
    "flat",
    "unflat",
    "is_personal",
    "params_to_record",
    "record_to_params",
    "error_reason",
    "user_metrics",
    "weighted_metrics",
    "run_record",
    "read_units",
    "reply_to_records",
    "reveal_request",
    "reveals_to_records",
    "records_to_reveals",
    "records_to_reply",
    "ack_record",
    "eval_record",
]

# -- the keys ------------------------------------------------------------------------------------
# the wrapper and its mod (the values are what a saved app or a client of another version reads)
K_DP = "fedudp.dp"  # ConfigRecord in a training message
K_CONTRIB = "fedudp.contribution"  # ArrayRecord in a reply: "sum" [d] or "rows" [n, d]
K_COUNTS = (
    "fedudp.counts"  # MetricRecord in a reply: "count", "clipped", "users", "failed", "raised"
)
K_PERSONAL = "fedudp.personal"  # ArrayRecord in a client's context.state (never sent)
K_USERS = "fedudp.users"  # ConfigRecord in a client's context.state: its users and N (not sent)
K_USER_ID = "fedudp.user-id"  # node_config of the app's training step: the user it trains
K_CLIENT_PARTITION = "fedudp.client-partition-id"  # node_config: the client's own partition-id
K_CLIENT_PARTITIONS = "fedudp.client-num-partitions"  # ... and num-partitions

# engine=flower
K_RUN = "fedudp.run"
K_SHARED = "fedudp.shared"
K_REPLY = "fedudp.reply"
K_SECURE = "fedudp.secure"  # ConfigRecord beside a masked share: its roster and round
K_REVEAL = "fedudp.reveal"  # ConfigRecord: a survivor's pair seeds with dropped owners
K_NAMES = "fedudp.names"
K_VECTORS = "fedudp.vectors"
K_EVAL = "fedudp.eval"
# an owner's context.state only: its personal parameters (the mod's key) and the run they are of
K_STATE = K_PERSONAL
K_STATE_RUN = "fedudp.personal_run"
# run-record keys: a folder where the owner saves its personal state this round (checkpoint),
# or loads it from when its context.state has none (a resumed run); file owner-<j>.pt
K_PERSONAL_OUT = "personal_out"
K_PERSONAL_IN = "personal_in"


# -- the codec -----------------------------------------------------------------------------------
def to_numpy(arr: Array) -> np.ndarray:
    """A Flower ``Array``'s values (read-only where they are a view of its bytes).

    ``arr.numpy()`` without parsing the .npy header for every array (numpy parses it with
    ``ast.literal_eval``, most of the mod's own time per user): the data of a C-ordered
    ``.npy`` are its last ``size · itemsize`` bytes; anything else goes through ``numpy()``.

    Parameters
    ----------
    arr : flwr.app.Array
        The array, as a record holds it.

    Returns
    -------
    numpy.ndarray
        Its values, of its dtype and shape.
    """
    try:
        dt = np.dtype(arr.dtype)
        shape = tuple(int(n) for n in arr.shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        data = arr.data
        head = bytes(data[: len(data) - nbytes][:256])
        if (
            arr.stype == "numpy.ndarray"
            and len(data) >= nbytes
            and head.startswith(b"\x93NUMPY")
            and b"'fortran_order': False" in head
            and repr(dt.str).encode() in head
        ):
            return np.frombuffer(
                data, dtype=dt, count=nbytes // max(dt.itemsize, 1), offset=len(data) - nbytes
            ).reshape(shape)
    except (TypeError, ValueError):
        pass
    return arr.numpy()


def to_record(arrays: Mapping[str, Any]) -> ArrayRecord:
    """An ArrayRecord of numpy arrays (or Flower ``Array``s), in the given key order.

    Parameters
    ----------
    arrays : Mapping[str, numpy.ndarray or torch.Tensor or flwr.app.Array]
        The values by name; an ``Array`` is kept as it is.

    Returns
    -------
    flwr.app.ArrayRecord
    """
    return ArrayRecord({k: _array(v) for k, v in arrays.items()})


def _array(v: Any) -> Array:
    """One value as a Flower ``Array``: an ``Array`` as it is, a tensor's contiguous values
    (its shape kept, 0-d included), anything else through ``numpy.ascontiguousarray``."""
    if isinstance(v, Array):
        return v
    if isinstance(v, torch.Tensor):
        return Array(v.detach().contiguous().numpy())
    return Array(np.ascontiguousarray(v))


def flat(arrays: ArrayRecord, names: Sequence[str]) -> torch.Tensor:
    """The arrays ``names`` of ``arrays`` concatenated, flattened, in float64.

    Parameters
    ----------
    arrays : flwr.app.ArrayRecord
    names : Sequence[str]
        The keys to concatenate, in order.

    Returns
    -------
    torch.Tensor
        One float64 vector (empty for no names).
    """
    return (
        torch.cat(
            [
                torch.from_numpy(np.array(to_numpy(arrays[k]), dtype=np.float64)).reshape(-1)
                for k in names
            ]
        )
        if names
        else torch.zeros(0, dtype=torch.float64)
    )


def unflat(vec: torch.Tensor, like: ArrayRecord, names: Sequence[str]) -> dict[str, np.ndarray]:
    """``flat``'s inverse: ``vec`` cut into the arrays ``names`` of ``like`` (their shapes and
    dtypes).

    Parameters
    ----------
    vec : torch.Tensor
        A vector as long as the arrays ``names`` together.
    like : flwr.app.ArrayRecord
        The record whose shapes and dtypes the pieces take.
    names : Sequence[str]
        The keys, in ``flat``'s order.

    Returns
    -------
    dict[str, numpy.ndarray]
    """
    out, i = {}, 0
    for k in names:
        ref = to_numpy(like[k])
        n = ref.size
        out[k] = vec[i : i + n].numpy().reshape(ref.shape).astype(ref.dtype)
        i += n
    return out


def is_personal(name: str, patterns: Sequence[str]) -> bool:
    """Whether parameter ``name`` is personal: it, or a module it is in, matches one of the
    fnmatch ``patterns``.

    Parameters
    ----------
    name : str
    patterns : Sequence[str]

    Returns
    -------
    bool
    """
    return any(
        fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns
    )


def params_to_record(params: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Torch parameters as an ArrayRecord (``to_record``).

    Parameters
    ----------
    params : Mapping[str, torch.Tensor]

    Returns
    -------
    flwr.app.ArrayRecord
    """
    return to_record(params)


def record_to_params(rec: ArrayRecord | Mapping[str, Array]) -> dict[str, torch.Tensor]:
    """An ArrayRecord as torch tensors (``to_numpy``, copied: writable, the record's own).

    Parameters
    ----------
    rec : flwr.app.ArrayRecord

    Returns
    -------
    dict[str, torch.Tensor]
    """
    return {k: torch.from_numpy(to_numpy(a).copy()) for k, a in rec.items()}


def error_reason(text: str | None, limit: int = 300) -> str:
    """A client's error reason on one line (the last non-empty lines of a traceback).

    Parameters
    ----------
    text : str or None
        The reason of a Flower ``Error``.
    limit : int, default 300
        The most characters kept.

    Returns
    -------
    str
    """
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    one = " | ".join(lines[-2:]) if lines else "?"
    return one if len(one) <= limit else one[:limit] + "..."


def user_metrics(reply: Message) -> tuple[float, dict[str, float]]:
    """(the user's weight: its ``num-examples``, else 1; the app's scalar training metrics).

    Parameters
    ----------
    reply : flwr.app.Message
        The app's reply to one training step (its ``"metrics"`` MetricRecord, if any).

    Returns
    -------
    tuple[float, dict[str, float]]
    """
    if "metrics" not in reply.content.metric_records:
        return 1.0, {}
    rec: Any = reply.content["metrics"]  # the app's MetricRecord
    vals = {
        k: float(v)
        for k, v in rec.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "num-examples"
    }
    return float(rec.get("num-examples", 1.0)), vals


def weighted_metrics(parts: Sequence[tuple[float, dict[str, float]]]) -> MetricRecord:
    """Each metric's mean over the parts that report it, weighted by their records; and the
    records in all (``num-examples``).

    Parameters
    ----------
    parts : Sequence[tuple[float, dict[str, float]]]
        (weight, metrics) pairs, as ``user_metrics`` returns them.

    Returns
    -------
    flwr.app.MetricRecord
    """
    total = sum(w for w, _ in parts)
    out: dict[str, Any] = {"num-examples": round(total)}
    for key in sorted({k for _, vals in parts for k in vals}):
        ws = [(w, vals[key]) for w, vals in parts if key in vals]
        wsum = sum(w for w, _ in ws)
        if wsum > 0:
            out[key] = sum(w * v for w, v in ws) / wsum
    return MetricRecord(out)


# -- engine=flower's records ---------------------------------------------------------------------
def run_record(
    cfg_json: str,
    round_: int,
    owner: int,
    units: np.ndarray | None = None,
    constraint: Constraint | None = None,
) -> ConfigRecord:
    """What an owner needs for one message besides the broadcast (``K_RUN``).

    Parameters
    ----------
    cfg_json : str
        The run's configuration (``config_to_json``): the owner builds its side from it.
    round_ : int
    owner : int
        The owner the message is for (-1: any, the query).
    units : numpy.ndarray or None
        Its sampled units (local user ids, or [0] for itself at owner level); None: nothing to
        send back.
    constraint : Constraint or None
        The aggregator's constraint, sent with ``units``.

    Returns
    -------
    flwr.app.ConfigRecord
    """
    rec: dict = {"cfg": cfg_json, "round": int(round_), "owner": int(owner)}
    if units is not None:
        rec["units"] = np.asarray(units, dtype=np.int64).tobytes()
        assert constraint is not None  # sent with the units
        fields = asdict(constraint)
        rec["rows"] = bool(fields.pop("rows"))
        secure = fields.pop("secure")
        if secure is not None:  # a distributed mechanism's public encoding, as JSON
            rec["secure"] = json.dumps(secure)
        rec.update({k: -1.0 if v is None else float(v) for k, v in fields.items()})  # -1: None
    return ConfigRecord(rec)


def read_units(run: ConfigRecord) -> tuple[np.ndarray, Constraint] | None:
    """``run_record``'s units and constraint, read back.

    Parameters
    ----------
    run : flwr.app.ConfigRecord
        A ``K_RUN`` record.

    Returns
    -------
    tuple[numpy.ndarray, Constraint] or None
        None when the message asks for nothing back (no units).
    """
    if "units" not in run:
        return None
    # our own wire format: each key's type is the one owner_message wrote (a ConfigRecord's
    # values are typed as the union of every type a record may hold)
    rec: Any = run
    opt: dict[str, Any] = {
        f.name: None if float(rec[f.name]) < 0 else float(rec[f.name])
        for f in fields(Constraint)
        if f.name not in ("rows", "secure")
    }
    if "secure" in rec:
        opt["secure"] = SecureEncoding(**json.loads(str(rec["secure"])))
    return np.frombuffer(rec["units"], dtype=np.int64), Constraint(rows=bool(rec["rows"]), **opt)


def reply_to_records(rep: OwnerReply, owner: int, seconds: float) -> RecordDict:
    """An owner's reply as records (``K_REPLY``, ``K_NAMES``, ``K_VECTORS``).

    Parameters
    ----------
    rep : OwnerReply
        The owner's clipped contribution and counts.
    owner : int
    seconds : float
        How long the owner took (diagnostic).

    Returns
    -------
    flwr.app.RecordDict
    """
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
            rd[K_VECTORS] = to_record({key: t})
    if c.roster:  # a distributed mechanism: the masked share(s) (uint64), roster and round
        sec: dict = {
            "roster": np.asarray(c.roster, dtype=np.int64).tobytes(),
            "round": int(cast(int, c.round_)),
        }
        if len(c.shares) == 1:
            (share,) = c.shares
            rd[K_VECTORS] = ArrayRecord({"share": Array(np.ascontiguousarray(share.vector))})
        else:  # a block of owners (engine_opts.owners_per_node): one share per owner
            stacked = np.stack([s.vector for s in c.shares])
            rd[K_VECTORS] = ArrayRecord({"shares": Array(np.ascontiguousarray(stacked))})
            sec["owners"] = np.asarray([s.owner for s in c.shares], dtype=np.int64).tobytes()
        rd[K_SECURE] = ConfigRecord(sec)
    return rd


def records_to_reply(rd: RecordDict) -> tuple[int, OwnerReply]:
    """``reply_to_records`` read back.

    Parameters
    ----------
    rd : flwr.app.RecordDict
        An owner's reply content.

    Returns
    -------
    tuple[int, OwnerReply]
        (the owner, its reply).

    Raises
    ------
    KeyError
        A record or a count is missing (the owner is then failed).
    """
    # our own wire format (reply_to_records): each key's type is the one written there
    meta: Any = rd[K_REPLY]
    names: tuple[str, ...] = tuple(n for n in cast(Any, rd[K_NAMES])["names"] if n)
    arrays: Any = rd.get(K_VECTORS, {})
    got = record_to_params({k: arrays[k] for k in ("rows", "total") if k in arrays})
    if K_SECURE in rd:  # a masked share (or a block's, one per owner)
        sec: Any = rd[K_SECURE]
        if "owners" in sec:
            vecs = arrays["shares"].numpy()
            who = np.frombuffer(sec["owners"], dtype=np.int64)
            if vecs.dtype != np.uint64 or vecs.ndim != 2 or len(vecs) != len(who):
                raise ValueError(f"a block's shares must be uint64 [owners, d], got {vecs.shape}")
            shares = tuple(MaskedShare(int(o), v) for o, v in zip(who, vecs, strict=True))
        else:
            vec = arrays["share"].numpy()
            if vec.dtype != np.uint64 or vec.ndim != 1:
                raise ValueError(
                    f"a masked share must be a uint64 vector, got {vec.dtype}{vec.shape}"
                )
            shares = (MaskedShare(int(meta["owner"]), vec),)
        c = Contribution(
            None,
            None,
            int(meta["count"]),
            int(meta["clipped"]),
            shares=shares,
            roster=tuple(int(o) for o in np.frombuffer(sec["roster"], dtype=np.int64)),
            round_=int(sec["round"]),
        )
        return int(meta["owner"]), OwnerReply(names, c, int(meta["failed"]))
    c = Contribution(
        got.get("rows"),
        got.get("total"),
        int(meta["count"]),
        int(meta["clipped"]),
        fraction_sum=float(meta.get("fraction_sum", 0.0)),
        fraction_reports=int(meta.get("fraction_reports", 0)),
    )
    return int(meta["owner"]), OwnerReply(names, c, int(meta["failed"]))


def reveal_request(cfg_json: str, round_: int, owner: int, dropped: Sequence[int]) -> ConfigRecord:
    """A survivor asked for its pair seeds with the owners that dropped (``K_RUN``).

    Parameters
    ----------
    cfg_json : str
        The run's configuration.
    round_ : int
        The round whose masks are removed.
    owner : int
        The survivor.
    dropped : sequence of int
        The owners of the round's roster that sent no share.

    Returns
    -------
    flwr.app.ConfigRecord
    """
    return ConfigRecord(
        {
            "cfg": cfg_json,
            "round": int(round_),
            "owner": int(owner),
            "reveal": np.asarray(list(dropped), dtype=np.int64).tobytes(),
        }
    )


def reveals_to_records(owner: int, reveals: Sequence[Reveal]) -> RecordDict:
    """A survivor's revealed pair seeds (``K_REVEAL``).

    Parameters
    ----------
    owner : int
        The survivor.
    reveals : sequence of Reveal
        Its seeds with the dropped owners.

    Returns
    -------
    flwr.app.RecordDict
    """
    rd = RecordDict()
    rec: dict = {
        "owner": int(owner),
        "dropped": np.asarray([r.dropped for r in reveals], dtype=np.int64).tobytes(),
        "seeds": b"".join(r.seed for r in reveals),
    }
    if any(r.survivor != owner for r in reveals):  # a block's survivors
        rec["survivors"] = np.asarray([r.survivor for r in reveals], dtype=np.int64).tobytes()
    rd[K_REVEAL] = ConfigRecord(rec)
    return rd


def records_to_reveals(rd: RecordDict) -> list[Reveal]:
    """``reveals_to_records`` read back (32-byte seeds).

    Parameters
    ----------
    rd : flwr.app.RecordDict
        A survivor's reply to a reveal request.

    Returns
    -------
    list of Reveal
        Its seeds.
    """
    rec: Any = rd[K_REVEAL]
    dropped = np.frombuffer(rec["dropped"], dtype=np.int64)
    seeds = bytes(rec["seeds"])
    if len(seeds) != 32 * len(dropped):
        raise ValueError("a reveal must carry one 32-byte seed per dropped owner")
    survivors = (
        np.frombuffer(rec["survivors"], dtype=np.int64)
        if "survivors" in rec
        else np.full(len(dropped), int(rec["owner"]), dtype=np.int64)
    )
    if len(survivors) != len(dropped):
        raise ValueError("a reveal must name one survivor per seed")
    return [
        Reveal(int(s), int(d), seeds[32 * i : 32 * (i + 1)])
        for i, (s, d) in enumerate(zip(survivors, dropped, strict=True))
    ]


def ack_record(owner: int) -> RecordDict:
    """per_silo's reply to a train message: nothing but who answered.

    Parameters
    ----------
    owner : int

    Returns
    -------
    flwr.app.RecordDict
    """
    return RecordDict(
        {
            K_REPLY: MetricRecord(
                {"owner": int(owner), "count": 0, "clipped": 0, "failed": 0, "seconds": 0.0}
            )
        }
    )


def eval_record(owner: int, accuracy: float, loss: float, examples: int) -> RecordDict:
    """An owner's evaluation (``K_EVAL``).

    Parameters
    ----------
    owner : int
    accuracy, loss : float
        On its test shard, with its own personal parameters.
    examples : int
        Its test records.

    Returns
    -------
    flwr.app.RecordDict
    """
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
