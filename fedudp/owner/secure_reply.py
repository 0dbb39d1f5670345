"""The owners' side of a distributed mechanism (``privacy.placement=distributed``;
docs/algorithms.md#distributed-dp-under-secure-aggregation).

Each surviving owner encodes its sampled users' shared vectors with the round's public
``SecureEncoding`` (``fedudp.secure.share.owner_share``, through
``fedudp.secure.encoding.encode_owner``: clip each user's vector, rotate,
scale, round *each user's* vector on its own stream, sum, add the owner's integer noise share,
reduce mod 2^bits) and masks the result with the pairwise masks of every owner in the round's
roster (``fedudp.secure.masks``); the survivors then reveal their pair seeds with the owners
that dropped, so that the billboard can remove those masks. Nothing else leaves the owners: the
billboard's code receives the masked shares, the roster and the reveals
(``fedudp.protocol.contributions.MaskedShare``).

Sampling: the owners draw the users' Poisson coins themselves (``fedudp.secure.public.
owner_sample``, each user's coin on its own stream keyed by (round, its stable id)); the
billboard asks every user, so it never learns who was sampled and the amplification by
sampling the ledger composes holds against it. The count of sampled users each reply carries
is not sent: the counts (sampled, clipped, non-finite, raised users) and the modular wraps are
the simulator's observations, returned beside the reply and written to ``metrics.jsonl`` as
``sim_*`` by engine=local, never handed to the billboard (under an untrusted server a count of
users is data); the release's divisor is the public q·N.

Randomness: a user's rounding is keyed by (round, its stable id) and an owner's share by
(round, its global id) (``Purpose.ROUNDING``, ``Purpose.SHARE_NOISE``: from OS entropy under
``privacy.randomness=secure``), so a neighbour federation without one user leaves every other
user's rounded vector and every noise share as they were. The public rotation is keyed by
(seed, round) (``fedudp.secure.public.round_signs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedudp.data.federation import Federation
from fedudp.owner.isolate import isolated_vectors
from fedudp.privacy.mechanisms import row_norms64
from fedudp.protocol.contributions import Constraint, Contribution, MaskedShare, Reveal
from fedudp.protocol.messages import OwnerReply
from fedudp.randomness import Randomness
from fedudp.secure.encoding import wraps
from fedudp.secure.masks import MaskKeys
from fedudp.secure.public import owner_sample, round_signs
from fedudp.secure.share import owner_share

if TYPE_CHECKING:
    from fedudp.owner.owners import Owners, Params

__all__ = ["owner_randomness", "secure_reply"]


def owner_randomness(owners: Owners) -> Randomness:
    """The owners' randomness: the run seed, secure where ``privacy.randomness=secure``.

    Parameters
    ----------
    owners : Owners
        The owners (their public training settings carry the seed and the mode).

    Returns
    -------
    Randomness
        Seeded or secure.
    """
    seed = owners.training.user.seed
    return Randomness.secure(seed) if owners.training.secure_randomness else Randomness.seeded(seed)


def secure_reply(
    owners: Owners,
    fed: Federation,
    shared: Params,
    personal: Params,
    users: np.ndarray,
    round_: int,
    constraint: Constraint,
    *,
    keys: MaskKeys,
    roster: Sequence[int],
    dropped: Sequence[int] = (),
    randomness: Randomness | None = None,
    count_wraps: bool = True,
) -> tuple[OwnerReply, dict[str, int]]:
    """The masked shares of this federation's surviving owners for their sampled ``users``.

    Parameters
    ----------
    owners : Owners
        The owners' kernels.
    fed : Federation
        The owners here (all of them on engine=local, one on engine=flower).
    shared, personal : Params
        The broadcast; every owner's personal parameters, stacked.
    users : np.ndarray
        The sampled users present here (indices into ``fed``).
    round_ : int
        The round.
    constraint : Constraint
        The round's constraint; ``constraint.secure`` is the encoding.
    keys : MaskKeys
        The owners' pairwise seeds.
    roster : sequence of int
        The global ids of every owner asked this round (the masks' peers).
    dropped : sequence of int, default ()
        Global ids of roster owners that dropped (they send nothing; the survivors here reveal
        their pair seeds with them).
    randomness : Randomness or None, default None
        The owners' randomness (None: ``owner_randomness(owners)``).
    count_wraps : bool, default True
        ``fed`` holds every surviving owner (engine=local): count the coordinates of the
        unreduced sum outside the modular range (a simulator observation).

    Returns
    -------
    tuple of (OwnerReply, dict)
        The reply: one masked share per surviving owner here, the roster and the reveals, and
        no count (a user whose vector is not finite or whose step raised contributes nothing,
        as a removed user). The simulator's observations, which never reach the billboard:
        ``sim_sampled_users``, ``sim_clipped_users``, ``sim_nonfinite_users``,
        ``sim_raised_users`` and, with ``count_wraps``, ``sim_modular_wraps``.
    """
    enc = constraint.secure
    assert enc is not None  # a distributed round
    rand = owner_randomness(owners) if randomness is None else randomness
    gone = {int(d) for d in dropped}
    peers = [int(o) for o in roster]
    gids = np.asarray(fed.owner_ids, dtype=np.int64)
    live = np.array([int(g) not in gone for g in gids], dtype=bool)
    users = np.asarray(users, dtype=np.int64)
    users = users[live[fed.user_owner[users]]]  # a dropped owner computes nothing
    # the owners' own Poisson sample (the billboard asked every user: it learns nobody's coin)
    users = users[owner_sample(fed.user_ids[users], enc.rate, rand, round_)]
    rows: dict[int, list[tuple[int, np.ndarray]]] = {}
    failed = clipped = 0
    chunks, raised = isolated_vectors(owners, fed, shared, personal, users, round_, True)
    for us, G in chunks:
        # the rows stay in the model's dtype until their owner's share (float64 there: an
        # exact widening, so the same numbers, without a second copy of every row held)
        A = G.detach().cpu().numpy()
        norms = row_norms64(torch.from_numpy(A))  # float64 norms decide the counts
        ok = torch.isfinite(norms).numpy()
        failed += int((~ok).sum())
        clipped += int((norms[torch.from_numpy(ok)] > enc.clip).sum())
        for i in np.flatnonzero(ok):
            u = int(us[i])
            rows.setdefault(int(fed.user_owner[u]), []).append((int(fed.user_ids[u]), A[i]))
    signs = round_signs(rand.seed, round_, enc.padded)
    shares, unreduced = [], np.zeros(enc.padded, dtype=np.int64)
    count = 0
    pairs: dict[tuple[int, int], np.ndarray] = {}  # each pair's mask expanded once here
    for j in np.flatnonzero(live):
        got = rows.get(int(j), [])
        ids = [uid for uid, _ in got]
        X = (
            np.stack([r for _, r in got]).astype(np.float64, copy=False)
            if got
            else np.zeros((0, enc.dim), dtype=np.float64)
        )
        gid = int(gids[j])
        masked, v = owner_share(X, ids, gid, enc, rand, round_, signs, keys, peers, pairs)
        unreduced += v
        count += len(got)
        shares.append(MaskedShare(gid, masked))
    reveals = tuple(
        Reveal(int(s.owner), d, keys.pair_seed(int(s.owner), d, round_))
        for s in shares
        for d in sorted(gone)
    )
    # what crosses to the billboard: the shares, the roster and the reveals, nothing counted
    # (under an untrusted server a count of sampled, clipped or failed users is data)
    c = Contribution(
        None,
        None,
        0,
        shares=tuple(shares),
        roster=tuple(sorted(peers)),
        reveals=reveals,
        round_=int(round_),
    )
    observed = {
        "sim_sampled_users": count,
        "sim_clipped_users": clipped,
        "sim_nonfinite_users": failed,
        "sim_raised_users": sum(r.users for r in raised),
    }
    if count_wraps:
        observed["sim_modular_wraps"] = wraps(unreduced, enc.bits)
    return OwnerReply(owners.spec.shared, c), observed
