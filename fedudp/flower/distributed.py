"""The server side of distributed DP inside a Flower app: ``UserLevelDP`` around a distributed
estimator (``DdgAggregator``/``SkellamAggregator``;
docs/flower-apps.md#distributed-dp-and-flowers-secagg; the client side is
``fedudp.flower.secure_mod``).

Each training message's ``fedudp.dp`` record carries the public encoding and the round's roster
(the node ids asked). Each client replies with one masked share (uint64 mod 2^bits) and its
counts; the strategy never sees a client's float vector. The survivors are the clients whose
share is well formed (public: which clients answered, never data); a round with fewer than
``min_owners`` of them is withheld (``ReleaseGate.withhold``). When some of the roster sent
nothing, the survivors are asked for their pair seeds with those clients (a second message
round, as engine=flower's ``FlowerTransport._reveal``: a ``train`` message carrying only the
request, since a Flower ``ClientApp`` routes a message through its mods only to a registered
function, and every app that trains registers ``train``); a survivor that does not
reveal is dropped too and the others are asked again. The estimator's ``release`` then sums the
shares, removes the dropped clients' masks and decodes only the sum; if that is impossible (a
seed missing) the round is withheld (fail closed). A released round is accounted at its
survivors (``dp_event_for``) through the ``ReleaseGate``.

Seeded simulation only (``SEEDED_ONLY``): the masks come from the run seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from fedudp.aggregators.base import Aggregator
from fedudp.aggregators.distributed import DistributedAggregator
from fedudp.flower.collect import Collected
from fedudp.flower.outcome import hand_over
from fedudp.flower.secure_mod import (
    K_REVEAL_ASK,
    SEEDED_ONLY,
    encoding_to_text,
    roster_bytes,
)
from fedudp.flower.wire import (
    K_CONTRIB,
    K_COUNTS,
    K_DP,
    K_SECURE,
    error_reason,
    flat,
    records_to_reveals,
    to_record,
    unflat,
    user_metrics,
)
from fedudp.protocol import ledger_file
from fedudp.protocol.contributions import Contribution, MaskedShare, Reveal
from fedudp.randomness import Randomness

__all__ = ["SecureRounds", "secure_rounds"]

SIMULATION_NOTE = (
    "fedudp.flower distributed: a seeded simulation of secure aggregation (pairwise masks from "
    "the run seed, survivors reveal pair seeds); a deployment needs SecAgg's key agreement"
)


def secure_rounds(
    aggregator: Aggregator, randomness: Randomness, min_owners: int
) -> SecureRounds | None:
    """The distributed rounds' state for a distributed estimator (None for any other).

    Parameters
    ----------
    aggregator : Aggregator
        The wrapper's estimator.
    randomness : Randomness
        The wrapper's randomness (seeded only, for a distributed estimator).
    min_owners : int
        The wrapper's fail-closed minimum of clients.

    Returns
    -------
    SecureRounds or None

    Raises
    ------
    ValueError
        Secure randomness (``SEEDED_ONLY``), another seed than the estimator's, or
        ``min_owners`` below the minimum of survivors the shares are calibrated for.
    """
    if not isinstance(aggregator, DistributedAggregator):
        return None
    if randomness.is_secure:
        raise ValueError(f"UserLevelDP: {SEEDED_ONLY}")
    if int(aggregator.seed) != int(randomness.seed):
        raise ValueError(
            f"UserLevelDP: seed={randomness.seed} but the estimator's public rotation is keyed "
            f"by seed={aggregator.seed}: calibrate it with the wrapper's seed"
        )
    if int(min_owners) < aggregator.min_owners:
        raise ValueError(
            f"UserLevelDP: min_owners={min_owners} but the estimator's noise shares are "
            f"calibrated for at least {aggregator.min_owners} surviving clients: pass "
            f"min_owners={aggregator.min_owners} (or more)"
        )
    return SecureRounds(aggregator, int(randomness.seed))


@dataclass
class _Shares:
    """A round's usable masked shares by roster position, with their clients' counts."""

    got: Collected = field(default_factory=Collected)
    shares: dict[int, MaskedShare] = field(default_factory=dict)
    held: dict[int, int] = field(default_factory=dict)  # declared users, by position
    parts: dict[int, Contribution] = field(default_factory=dict)  # counts, by position
    count: int = 0
    clipped: int = 0


class SecureRounds:
    """``UserLevelDP``'s distributed rounds: the roster and encoding sent, the shares read, the
    reveals asked, the release (see the module doc).

    Parameters
    ----------
    aggregator : DistributedAggregator
        The estimator (its ``encoding`` is sent; its ``release`` decodes the sum).
    seed : int
        The run seed (sent to the clients: a seeded simulation).
    """

    def __init__(self, aggregator: DistributedAggregator, seed: int) -> None:
        self.aggregator, self.seed = aggregator, int(seed)
        self.rosters: dict[int, tuple[int, ...]] = {}
        self.grid: Grid | None = None

    def configure(
        self, server_round: int, messages: Sequence[Message], dim: int, grid: Grid
    ) -> None:
        """Add the encoding and the roster to each training message's ``fedudp.dp`` record.

        Parameters
        ----------
        server_round : int
        messages : sequence of flwr.app.Message
            The round's training messages (their ``K_DP`` records already set).
        dim : int
            The model's shared values.
        grid : flwr.serverapp.Grid
            Kept for the reveals.

        Raises
        ------
        ValueError
            The encoding's dim is not the model's, a node asked twice, or more clients than
            the estimator's owners.
        """
        enc, agg = self.aggregator.encoding, self.aggregator
        if int(dim) != enc.dim:
            raise ValueError(
                f"UserLevelDP: the estimator's encoding is for dim={enc.dim} shared values, the "
                f"model's shared parameters are {dim}: calibrate it with dim={dim}"
            )
        nodes = sorted(int(m.metadata.dst_node_id) for m in messages)
        if len(set(nodes)) != len(nodes) or len(nodes) > agg.owners:
            raise ValueError(
                f"UserLevelDP: round {server_round} asks {len(nodes)} clients (distinct: "
                f"{len(set(nodes))}), the estimator is calibrated for {agg.owners} owners "
                "(owner_units): one message per client, at most that many"
            )
        self.grid, self.rosters[int(server_round)] = grid, tuple(nodes)
        text, roster = encoding_to_text(enc), roster_bytes(nodes)
        for m in messages:
            rec: Any = m.content[K_DP]
            rec["secure"], rec["roster"] = text, roster

    def aggregate(
        self,
        dp: Any,
        server_round: int,
        replies: Sequence[Message],
        sent: ArrayRecord,
        names: list[str],
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's release from the survivors' shares, or nothing (withheld).

        Parameters
        ----------
        dp : UserLevelDP
        server_round : int
        replies : sequence of flwr.app.Message
        sent : flwr.app.ArrayRecord
            The broadcast.
        names : list of str
            The shared parameters' names.

        Returns
        -------
        tuple[flwr.app.ArrayRecord or None, flwr.app.MetricRecord or None]
        """
        roster = self.rosters.pop(int(server_round))
        s = read_shares(replies, roster, self.aggregator, server_round)
        why = dp.gate.withhold(
            len(s.shares), s.got.held, s.got.failed, who="client", key="fedudp.train."
        )
        if why is not None:
            return None, dp._withhold(server_round, why, s.got)
        reveals = self.reveal(server_round, roster, s)
        why = dp.gate.withhold(
            len(s.shares), s.got.held, s.got.failed, who="client", key="fedudp.train."
        )
        if why is not None:
            return None, dp._withhold(server_round, why, s.got)
        survivors = sorted(s.shares)
        s.got.parts = [s.parts[j] for j in survivors]
        c = Contribution(
            None,
            None,
            s.count,
            s.clipped,
            shares=tuple(s.shares[j] for j in survivors),
            roster=tuple(range(len(roster))),
            reveals=tuple(reveals),
            round_=int(server_round),
        )
        try:
            agg = self.aggregator.release(c)
        except ValueError as e:  # fail closed: a mask that cannot be removed
            return None, dp._withhold(server_round, f"the sum cannot be unmasked: {e}", s.got)
        entry = dp.gate.record(
            server_round,
            self.aggregator.dp_event_for(survivor_count(survivors, roster)),
            self.aggregator,
            self.aggregator.sampling.rate,
            ledger_file.release_digest(agg),
            len(roster) - len(survivors),
        )
        assert entry.epsilon is not None  # composed by the distributed accountant
        new = flat(sent, names) + agg.mean.to(torch.float64)
        updated = unflat(new, sent, names)
        arrays = to_record({k: updated.get(k, sent[k]) for k in sent})
        return hand_over(dp, server_round, arrays, list(replies), s.got, c, entry.epsilon)

    def reveal(self, server_round: int, roster: tuple[int, ...], s: _Shares) -> list[Reveal]:
        """SecAgg's unmasking step (simulated): each survivor is asked for its pair seeds with
        the roster's clients that sent no share; one that does not reveal is dropped too (its
        users leave the fail-closed count) and the others are asked again for it.

        Parameters
        ----------
        server_round : int
        roster : tuple of int
            The round's node ids.
        s : _Shares
            The usable shares (survivors that fail to reveal are removed from it).

        Returns
        -------
        list of Reveal
            The remaining survivors' seeds with every dropped position.
        """
        got: dict[tuple[int, int], Reveal] = {}
        for _ in range(len(roster)):
            gone = sorted(set(range(len(roster))) - set(s.shares))
            ask = {j: [d for d in gone if (j, d) not in got] for j in sorted(s.shares)}
            ask = {j: ds for j, ds in ask.items() if ds}
            if not ask:
                break
            assert self.grid is not None  # kept by configure
            msgs = [
                Message(
                    RecordDict({K_REVEAL_ASK: self.ask_record(server_round, roster, ds)}),
                    dst_node_id=roster[j],
                    message_type="train",  # the app's train function (and its mods) exists
                    group_id=str(server_round),
                )
                for j, ds in ask.items()
            ]
            answers = {int(a.metadata.src_node_id): a for a in self.grid.send_and_receive(msgs)}
            for j, ds in ask.items():
                try:
                    rs = _reveals_of(answers.get(roster[j]), j, ds)
                except (KeyError, ValueError, TypeError) as e:
                    log(
                        WARNING,
                        "UserLevelDP round %s: client node %s dropped: reveal: %s",
                        server_round,
                        roster[j],
                        e,
                    )
                    s.shares.pop(j)
                    s.got.held -= s.held.pop(j)
                    s.got.failed += 1
                    continue
                got.update({(r.survivor, r.dropped): r for r in rs})
        return [r for (j, _), r in sorted(got.items()) if j in s.shares]

    def ask_record(
        self, server_round: int, roster: tuple[int, ...], dropped: list[int]
    ) -> ConfigRecord:
        """A reveal request: the round, the roster, the dropped positions, the seed."""
        return ConfigRecord(
            {
                "round": int(server_round),
                "roster": roster_bytes(roster),
                "dropped": np.asarray(dropped, dtype=np.int64).tobytes(),
                "seed": self.seed,
            }
        )


def survivor_count(survivors: Sequence[int], roster: Sequence[int]) -> int:
    """The survivors a round is accounted at: the clients whose shares were summed (public:
    which answered), never the roster.

    Parameters
    ----------
    survivors : sequence of int
        The positions whose shares the release summed.
    roster : sequence of int
        The round's node ids.

    Returns
    -------
    int
    """
    return len(survivors)


def _reveals_of(answer: Message | None, j: int, asked: list[int]) -> list[Reveal]:
    """Survivor ``j``'s seeds, exactly those asked (else ``ValueError``)."""
    if answer is None:
        raise ValueError("no answer")
    if answer.has_error():
        raise ValueError(f"error {answer.error.code}: {error_reason(answer.error.reason)}")
    rs = records_to_reveals(answer.content)
    if sorted(r.dropped for r in rs) != sorted(asked) or any(r.survivor != j for r in rs):
        raise ValueError("seeds for other clients than asked")
    return rs


def _share_failure(
    r: Message, roster: tuple[int, ...], padded: int, bits: int, round_: int
) -> str | None:
    """Why reply ``r`` carries no usable masked share (None: it does)."""
    if r.has_error():
        return f"error {r.error.code}: {error_reason(r.error.reason)}"
    if any(k not in r.content for k in (K_CONTRIB, K_COUNTS, K_SECURE)):
        return f"no {K_CONTRIB} / {K_COUNTS} / {K_SECURE} in the reply (user_level_mod's share)"
    counts: Any = r.content[K_COUNTS]
    if any(k not in counts for k in ("users", "count", "clipped")):
        return f"{K_COUNTS} lacks users / count / clipped (a user_level_mod older than this server)"
    node = int(r.metadata.src_node_id)
    sec: Any = r.content[K_SECURE]
    if node not in roster or int(sec["owner"]) != roster.index(node):
        return f"node {node} answers as position {sec['owner']} of a roster it is not at"
    if int(sec["round"]) != int(round_):
        return f"a share of round {sec['round']}"
    rec: Any = r.content[K_CONTRIB]
    if "share" not in rec:
        return f"{K_CONTRIB} holds no 'share'"
    v = rec["share"].numpy()
    if v.dtype != np.uint64 or v.shape != (padded,) or (v.size and int(v.max()) >> bits):
        return f"the share must be uint64 [{padded}] mod 2^{bits}, got {v.dtype}{v.shape}"
    return None


def read_shares(
    replies: Sequence[Message],
    roster: tuple[int, ...],
    aggregator: DistributedAggregator,
    round_: int,
) -> _Shares:
    """The round's usable shares (failed clients logged) and counts."""
    enc, out = aggregator.encoding, _Shares()
    for r in replies:
        try:
            why = _share_failure(r, roster, enc.padded, enc.bits, round_)
        except (KeyError, TypeError, ValueError) as e:  # a malformed record fails its client
            why = f"{type(e).__name__}: {e}"
        j = roster.index(int(r.metadata.src_node_id)) if why is None else -1
        if why is None and j in out.shares:
            why = "a second share"
        if why is not None:
            out.got.failed += 1
            log(
                WARNING,
                "UserLevelDP round %s: client node %s failed: %s",
                round_,
                r.metadata.src_node_id,
                why,
            )
            continue
        counts: Any = r.content[K_COUNTS]
        out.shares[j] = MaskedShare(j, r.content[K_CONTRIB]["share"].numpy().copy())  # type: ignore[union-attr]
        out.held[j] = int(counts["users"])
        out.got.held += int(counts["users"])
        out.got.nonfinite += int(counts.get("failed", 0))
        out.got.raised += int(counts.get("raised", 0))
        out.count += int(counts["count"])
        out.clipped += int(counts["clipped"])
        out.parts[j] = Contribution(None, None, int(counts["count"]))
        if "metrics" in r.content.metric_records:
            out.got.train_metrics.append(user_metrics(r))
    return out
