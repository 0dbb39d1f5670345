"""The audit of owner-side DP-SGD (``privacy.placement=local_dpsgd``): the real owner path
(``Owners.owner_deltas``) on owner 0 of a configured federation, D with its users and D' without
its first user (the canary: features scaled up and the label that maximizes its gradient, so
its gradient is clipped); one round. ``natural_records`` builds a natural-user federation
(users of 1..K records) in memory from plain arrays, every public number declared.

With an adaptive clip (``privacy.clip_policy=adaptive``) the owner releases, beside its delta,
the mean of its steps' noisy unclipped fractions (``Owners.owner_deltas``'s ``fractions``): the
audited release is the pair, scored on the linear discriminant (the two parts carry noise of
different scales).

``natural=K``: a natural-user federation instead of the planned synthetic one
(``natural_records``: users of 1..K records, built in memory from plain arrays, every public
number declared; owner 0 holds ``users`` users below its declared capacity M). The owner's
capacity, q and step count are then the prepared run's own (from ``public.owner_capacity``,
checked to be M), D' is ``Federation.without_user`` of the canary, and the claim is re-checked
on D' prepared from the arrays without the canary: the same capacity, noise multiplier and ε
(nothing public read from the data).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fedudp.audit.result import (
    ALPHA,
    AuditResult,
    detection_power,
    one_release_epsilon,
    parse_break,
)

if TYPE_CHECKING:
    from fedudp.build import Prepared
    from fedudp.data.federation import Federation
    from fedudp.data.records import Records
    from fedudp.protocol.contributions import Constraint

__all__ = ["AUDIT_DPSGD", "audit_local_dpsgd", "natural_records"]

# the owner-side audit's configuration (the command line's overrides apply over it)
AUDIT_DPSGD = {
    "method": "full_dp",
    "privacy.placement": "local_dpsgd",
    "train.rounds": 1,
    "progress": False,
    "dataset.name": "synthetic",
    "dataset.features": 6,
    "dataset.classes": 3,
    "partition.scheme": "iid",
    "partition.num_owners": 4,
    "partition.records_per_user": 1,
    "engine_opts.float64": True,
}


def _replicate(f: Federation, k: int, first_id: int) -> Federation:
    """``k`` copies of the one-owner federation ``f`` as one federation, owner ids
    ``first_id, first_id + 2, ...`` (every copy draws its own DP-SGD randomness)."""
    from fedudp.data.federation import Federation

    users, recs = f.num_users, f.num_records
    offs = (f.user_offsets[:-1][None, :] + recs * np.arange(k)[:, None]).ravel()
    return Federation(
        x=f.x.repeat(k, *[1] * (f.x.dim() - 1)),
        y=f.y.repeat(k),
        user_offsets=np.append(offs, k * recs).astype(np.int64),
        user_owner=np.repeat(np.arange(k), users).astype(np.int64),
        owner_user_offsets=(users * np.arange(k + 1)).astype(np.int64),
        x_test=f.x_test[:0],
        y_test=f.y_test[:0],
        test_offsets=np.zeros(k + 1, np.int64),
        num_classes=f.num_classes,
        owner_classes=None,
        owner_ids=(first_id + 2 * np.arange(k)).astype(np.int64),
        user_ids=np.tile(f.user_ids, k),
    )


def _make_canary(p: Prepared, shard: Federation) -> float:
    """Turn the shard's first user into a worst-case canary, in place: the label that maximizes
    its mean gradient's norm at the broadcast parameters, and its features scaled up (never down)
    until that norm is twice the clip, so that its gradient is clipped to C at every step while
    its logits stay small (a canary whose logits explode would point its later gradients
    anywhere). Returns the norm over the clip."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call, grad

    owners = p.owners
    names = owners.spec.shared
    assert p.billboard is not None and p.aggregator is not None  # a private method
    at = {
        **dict(owners.model.named_parameters()),
        **owners.public_personal,
        **p.billboard.shared_params(),
    }
    at = {k: v.detach() for k, v in at.items()}
    r0, r1 = int(shard.user_offsets[0]), int(shard.user_offsets[1])

    def norm_of(x: torch.Tensor, c: int) -> float:
        y = torch.full((r1 - r0,), c, dtype=shard.y.dtype)
        g = grad(lambda sh: F.cross_entropy(functional_call(owners.model, {**at, **sh}, (x,)), y))(
            {n: at[n] for n in names}
        )
        return float(
            torch.linalg.vector_norm(torch.cat([g[n].reshape(-1) for n in names]).to(torch.float64))
        )

    clip = float(cast(Any, p.aggregator).clip)  # local_dpsgd's clip
    label = max(range(shard.num_classes), key=lambda c: norm_of(shard.x[r0:r1], c))
    shard.y[r0:r1] = label
    for _ in range(60):
        norm = norm_of(shard.x[r0:r1], label)
        if norm >= 2 * clip:
            break
        shard.x[r0:r1] = shard.x[r0:r1] * min(10.0, 2.2 * clip / max(norm, 1e-12))
    return norm / clip


def natural_records(
    owners: int, users: int, capacity: int, max_records: int, features: int, classes: int, seed: int
) -> tuple[Records, dict[str, Any]]:
    """A natural-user federation as plain arrays, through ``fedudp.from_arrays``: owner 0 holds
    ``users`` users, every other owner ``capacity``; user i of an owner holds
    ``max_records - i % max_records`` records (unequal counts 1..max_records; owner 0's first
    user, the canary, the most). Features uniform in [0, 1), labels uniform over ``classes``;
    the owner column is given.

    Parameters
    ----------
    owners : int
        The number of owners.
    users : int
        Owner 0's users.
    capacity : int
        Every other owner's users (the public capacity of each).
    max_records : int
        The most records a user holds (the public ``public.records_per_user``).
    features : int
        The features per record.
    classes : int
        The number of labels.
    seed : int
        The arrays' seed.

    Returns
    -------
    tuple of (Records, dict)
        The ``Records`` and the public declarations (the run's own ``public.*``,
        ``dataset.classes``, ``dataset.input_shape`` and owner count: upper bounds that owner
        0, below its capacity, does not reach).
    """
    import fedudp

    rng = np.random.default_rng(seed)
    counts, user, owner = [], [], []
    for o in range(owners):
        for i in range(users if o == 0 else capacity):
            n = max_records - i % max_records
            counts.append(n)
            user += [f"o{o:03d}u{i:05d}"] * n
            owner += [o] * n
    total = int(sum(counts))
    x = rng.random((total, features)).astype(np.float32)
    y = rng.integers(0, classes, total).astype(np.int64)
    records = fedudp.from_arrays(
        x, y, np.array(user), np.array(owner, dtype=np.int64), classes=classes
    )
    declared = {
        "dataset.name": "memory",
        "partition.owner_rule": "given",
        "partition.num_owners": owners,
        "public.users": owners * capacity,
        "public.owner_capacity": capacity,
        "public.records_per_user": max_records,
        "dataset.classes": classes,
        "dataset.input_shape": [features],
        "dataset.test_fraction": 0.0,
    }
    return records, declared


def audit_local_dpsgd(
    overrides: dict,
    users: int,
    trials: int,
    seed: int = 0,
    broken: str = "",
    chunk: int = 2000,
    capacity: int | None = None,
    natural: int | None = None,
) -> AuditResult:
    """Owner-side DP-SGD's release (owner 0's noisy delta after one round) on D (``users``
    users) and D' (its first user removed), through the real owner path; ``trials`` releases per
    side, each with its own DP-SGD randomness. ``capacity``: the owner's public capacity M
    (default ``users``); M > ``users`` audits an owner holding fewer users than it declared
    (the schedule, q = min(B, M)/M and the divisor follow M on both sides). An adaptive clip
    and ``natural``: the module docstring.

    Parameters
    ----------
    overrides : dict
        Config overrides over ``AUDIT_DPSGD``.
    users : int
        Owner 0's users on D (at least 2).
    trials : int
        Releases per side.
    seed : int, default 0
        The run's and the audit's seed.
    broken : str, default ""
        ``--break``: ``noise=FACTOR`` or ``schedule=data``.
    chunk : int, default 2000
        Owner copies run at once.
    capacity : int or None, default None
        The owner's public capacity M (None: ``users``).
    natural : int or None, default None
        Natural users of 1..``natural`` records instead of the planned federation.

    Returns
    -------
    AuditResult
        The claim, the lower bound and the audit's power (``canary_norm``: the canary's
        gradient norm over the clip).

    Raises
    ------
    ValueError
        A flag that does not apply (``--break clip=off``, fewer than 2 users, M below the users,
        ``--natural`` below 1).
    ConfigError
        A configuration the audit cannot run (group privacy, not ``local_dpsgd``, an owner
        that does not hold the users asked for, a public number read from the data).
    """
    t0 = time.perf_counter()
    kind, factor = parse_break(broken)
    cap_m = _owner_capacity(kind, users, capacity)
    over, records, records_without = _audit_config(overrides, users, cap_m, seed, natural)
    p, claimed, shard = _prepared_owner(over, records, records_without, users, cap_m, natural)
    ratio = _make_canary(p, shard)
    neighbour = shard.without_user(0)
    assert p.aggregator is not None  # checked: local_dpsgd
    constraint = _weakened(p.aggregator.constraint, kind, factor)
    outs = _owner_releases(p, shard, neighbour, constraint, users, cap_m, trials, chunk, kind)
    return _owner_result(
        p, outs, constraint, claimed, ratio, users, cap_m, trials, natural, broken, t0
    )


def _owner_result(
    p: Prepared,
    outs: dict[str, np.ndarray],
    constraint: Constraint,
    claimed: float,
    ratio: float,
    users: int,
    cap_m: int,
    trials: int,
    natural: int | None,
    broken: str,
    t0: float,
) -> AuditResult:
    """The owner-side audit's bounds on the two samples ``outs``, its power and its result."""
    kind, factor = parse_break(broken)
    adaptive = constraint.dpsgd_count_noise is not None
    samples, gaussian = _owner_samples(p, outs, cap_m, kind, adaptive)
    delta = p.settings.delta
    assert delta is not None  # a private method
    power = (
        detection_power(samples, claimed, delta, trials, factor or 1.0, gaussian)
        if kind != "schedule=data"
        else None
    )
    name = (
        f"local_dpsgd{' adaptive' if adaptive else ''}"
        f"{f', natural users (1..{natural} records)' if natural is not None else ''}, "
        f"owner of {users} -> {users - 1} "
        f"users{'' if cap_m == users else f' (capacity {cap_m})'}, "
        f"B={p.owners.training.user.batch_size}"
    )
    from fedudp.build import run_guarantee

    res = AuditResult(
        name,
        "add_or_remove_one",
        trials,
        delta,
        claimed,
        samples,
        ratio,
        broken,
        time.perf_counter() - t0,
        power,
        gaussian,
        claim_heuristic=run_guarantee(p.spec, p.aggregator) == "heuristic",
    )
    return res


def _owner_capacity(kind: str, users: int, capacity: int | None) -> int:
    """The owner's public capacity M, the flags checked: one line naming the flag."""
    if kind == "clip=off":
        raise ValueError(
            "--break clip=off applies to the server-side release; use noise=FACTOR "
            "or schedule=data for privacy.placement=local_dpsgd"
        )
    if users < 2:
        raise ValueError(f"--owner-users {users}: the owner needs at least 2 users")
    cap_m = users if capacity is None else int(capacity)
    if cap_m < users:
        raise ValueError(
            f"--owner-users {users}:{cap_m}: the capacity M must be at least the "
            "users the owner holds"
        )
    return cap_m


def _audit_config(
    overrides: dict, users: int, cap_m: int, seed: int, natural: int | None
) -> tuple[dict, Records | None, Records | None]:
    """The audit's overrides, and with ``natural`` the natural-user records on D and on D'
    (the same arrays without the canary's records, through the public API)."""
    over = {**AUDIT_DPSGD, **overrides, "seed": seed}
    records = records_without = None
    if natural is not None:
        if natural < 1:
            raise ValueError(f"--natural {natural}: users hold at least 1 record")
        records, declared = natural_records(
            int(over["partition.num_owners"]),
            users,
            cap_m,
            natural,
            int(over.get("dataset.features", 6)),
            int(over.get("dataset.classes", 3)),
            seed,
        )
        for k in (
            "dataset.features",
            "partition.scheme",
            "partition.records_per_user",
            "dataset.num_records",
        ):
            over.pop(k, None)
        over = {**over, **declared}
        # D' through the public API: the same arrays without the canary's records
        keep = records.user != records.user[0]
        assert records.owner is not None  # natural_records groups the users
        import fedudp

        records_without = fedudp.from_arrays(
            records.x[keep],
            records.y[keep],
            records.user[keep],
            records.owner[keep],
            classes=records.classes,
        )
    else:
        rpu = int(over.get("partition.records_per_user", 1))
        over["dataset.num_records"] = int(over["partition.num_owners"]) * cap_m * rpu
    return over, records, records_without


def _prepared_owner(
    over: dict,
    records: Records | None,
    records_without: Records | None,
    users: int,
    cap_m: int,
    natural: int | None,
) -> tuple[Prepared, float, Federation]:
    """The prepared run, its claim for one release and owner 0's shard holding ``users``
    users; with ``natural`` the claim re-checked on D' prepared without the canary."""
    from fedudp.build import prepare
    from fedudp.config import ConfigError, config_from_overrides

    p = prepare(config_from_overrides(over), records=records)
    if p.owners.training.dpsgd_records:
        raise ConfigError(
            "privacy.group_privacy: the owner-side audit removes one user; audit "
            "without group privacy"
        )
    if p.aggregator is None or p.aggregator.name != "local_dpsgd":
        raise ConfigError(
            "privacy.placement: the owner-side audit needs privacy.placement="
            "local_dpsgd and a private method"
        )
    agg, delta = p.aggregator, p.settings.delta
    assert agg is not None and delta is not None  # checked above: local_dpsgd, private
    claimed = one_release_epsilon(agg, delta)
    shard = p.fed.owner(0)
    if natural is not None:
        # the run's own public capacity of owner 0 (declared, not counted) and its claim on D'
        capacities = p.owners.training.dpsgd_capacity
        assert capacities is not None  # declared by the audit
        have = int(capacities[int(shard.owner_ids[0])])
        if shard.num_users != users or have != cap_m:
            raise ConfigError(
                f"public.owner_capacity: owner 0 holds {shard.num_users} users "
                f"at capacity {have}; the audit asked for {users} at {cap_m}"
            )
        q_ = prepare(config_from_overrides(over), records=records_without)
        assert q_.aggregator is not None
        if (
            q_.owners.training.dpsgd_capacity != p.owners.training.dpsgd_capacity
            or q_.aggregator.noise_multiplier != agg.noise_multiplier
            or one_release_epsilon(q_.aggregator, delta) != claimed
            or q_.fed.owner(0).num_users != users - 1
        ):
            raise ConfigError(
                "public.owner_capacity: the run without the canary user has "
                "another public schedule or claim (a number read from the data)"
            )
    elif shard.num_users != cap_m:
        raise ConfigError(
            f"dataset.num_records: owner 0 holds {shard.num_users} users, the "
            f"audit asked for {cap_m}"
        )
    for u in range(shard.num_users - 1, users - 1, -1):  # below capacity: the last users leave
        shard = shard.without_user(u)
    return p, claimed, shard


def _weakened(constraint: Constraint, kind: str, factor: float | None) -> Constraint:
    """``--break noise=FACTOR`` on the owners' DP-SGD: both its noises times the factor."""
    if kind == "noise":
        dpsgd_noise, count_noise = constraint.dpsgd_noise, constraint.dpsgd_count_noise
        assert factor is not None and dpsgd_noise is not None  # noise=FACTOR on DP-SGD
        constraint = dataclasses.replace(
            constraint,
            dpsgd_noise=dpsgd_noise * factor,
            dpsgd_count_noise=(None if count_noise is None else count_noise * factor),
        )
    return constraint


def _owner_releases(
    p: Prepared,
    shard: Federation,
    neighbour: Federation,
    constraint: Constraint,
    users: int,
    cap_m: int,
    trials: int,
    chunk: int,
    kind: str,
) -> dict[str, np.ndarray]:
    """``trials`` releases of owner 0 on D (``shard``) and on D' (``neighbour``), ``chunk``
    owner copies at a time: side -> [trials, dim] (an adaptive clip's noisy fraction last)."""
    import torch

    owners = p.owners
    adaptive = constraint.dpsgd_count_noise is not None
    # the public capacity of every simulated owner (ids: D even, D' odd); schedule=data gives
    # each neighbour the count it holds (a schedule read from the data)
    cap = np.full(2 * trials, cap_m, dtype=np.int64)
    if kind == "schedule=data":
        cap[0::2] = users
        cap[1::2] = users - 1
    owners.training = dataclasses.replace(owners.training, dpsgd_capacity=tuple(cap.tolist()))
    assert p.billboard is not None  # a private method
    shared = p.billboard.shared_params()
    outs = {}
    for side, f, parity in (("D", shard, 0), ("D'", neighbour, 1)):
        parts = []
        for a in range(0, trials, chunk):
            n_k = min(chunk, trials - a)
            rep = _replicate(f, n_k, 2 * a + parity)
            personal = owners.initial_personal(n_k)
            fractions = np.zeros(n_k) if adaptive else None
            delta_k = (
                owners.owner_deltas(rep, shared, personal, np.arange(n_k), 1, constraint, fractions)
                .to(torch.float64)
                .numpy()
            )
            if adaptive:  # the owner's release: its delta and its mean noisy fraction
                assert fractions is not None  # adaptive: the owners report them
                delta_k = np.concatenate([delta_k, fractions[:, None]], axis=1)
            parts.append(delta_k)
        outs[side] = np.concatenate(parts)
    return outs


def _owner_samples(
    p: Prepared, outs: dict[str, np.ndarray], cap_m: int, kind: str, adaptive: bool
) -> tuple[Any, bool]:
    """The bounds on the two samples, and whether the release is Gaussian by construction
    (one DP-SGD step with every user in it: same covariance on D and D')."""
    from fedudp.owner.dpsgd import owner_rates
    from fedudp.privacy.audit_stats import audit_samples

    q, steps = owner_rates(np.array([cap_m]), p.owners.training.user.batch_size)
    gaussian = (
        float(q[0]) >= 1.0
        and int(steps[0]) * p.owners.training.user.epochs == 1
        and kind != "schedule=data"
    )
    delta = p.settings.delta
    assert delta is not None  # a private method
    samples = audit_samples(
        outs["D"], outs["D'"], delta, ALPHA, gaussian=gaussian, discriminant=adaptive
    )
    return samples, gaussian
