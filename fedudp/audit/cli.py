"""``fedudp-audit [overrides]``: the command (``main``), dispatching to the billboard-side
audit, the sequence audit, the owner-side DP-SGD audit or a built-in neighbouring pair, one row
per audit (``fedudp.audit.report``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, cast

from fedudp.audit.distributed import audit_distributed, check_audit
from fedudp.audit.flags import check_flags, parser, releases_per_trial
from fedudp.audit.local_dpsgd import AUDIT_DPSGD, audit_local_dpsgd
from fedudp.audit.report import TABLE_HEAD, details, finish, row
from fedudp.audit.result import AuditResult, parse_break
from fedudp.audit.sequence import LINEAR_NOISE, SEQUENCE_AUDITED, audit_sequence
from fedudp.audit.server import audit, audit_pair
from fedudp.memory import check_arrays

# torch, the estimators and the accountant (dp_accounting, scipy) are imported where they are used:
# `fedudp-audit --help` and a bad argument answer without them
if TYPE_CHECKING:
    from collections.abc import Callable

    from fedudp.aggregators.base import Aggregator
    from fedudp.aggregators.distributed import DistributedAggregator

__all__ = ["main"]


def _error(message: str) -> int:
    print(f"fedudp-audit: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """Run ``fedudp-audit``: the configured release audited on two neighbouring datasets.

    Parameters
    ----------
    argv : list of str or None, default None
        The command line (None: ``sys.argv[1:]``).

    Returns
    -------
    int
        The exit status: 0 consistent with the ledger, 1 a violation, 2 a refused flag or
        configuration (one line on stderr naming it).
    """
    a = parser().parse_args(argv)
    err = _error
    try:
        over = dict(o.split("=", 1) for o in a.overrides)
    except ValueError:
        return err("overrides are key=value")
    try:
        parse_break(a.broken)
    except ValueError as e:
        return err(str(e))
    bad = check_flags(a, over)
    if bad:
        return err(bad)
    if over.get("engine_opts.device", "cpu") != "cpu":
        return err(
            f"engine_opts.device={over['engine_opts.device']}: the audit runs on the CPU only "
            "(its canaries and replicated owners are built there); drop the override"
        )
    if a.pair:
        if a.broken:
            return err("--break applies to the canary audit, not to --pair")
        return _main_pair(a, over)
    from fedudp.config import ConfigError

    try:
        placement = over.get("privacy.placement", "server")
        if a.dropped and placement != "distributed":
            raise ValueError(
                "--dropped: owner dropouts are audited for privacy.placement=distributed "
                "(aggregator=ddgauss or skellam)"
            )
        if placement == "local_dpsgd":
            return _main_local_dpsgd(a, over)
        if a.natural is not None:
            raise ValueError(
                "--natural: the natural-user audit is owner-side DP-SGD's "
                "(privacy.placement=local_dpsgd)"
            )
        results = _main_server(a, over)
    except (ConfigError, ValueError) as e:
        return err(str(e).splitlines()[0])
    return finish(results, a.repeat, a.broken, a.seed)


def _main_server(a: argparse.Namespace, over: dict) -> list[AuditResult]:
    """The billboard-side audit of the configured aggregator (one release, or a sequence),
    repeated over the seeds; the table printed as it goes."""
    from fedudp import build
    from fedudp.config import ConfigError, config_from_overrides
    from fedudp.protocol.contributions import Sampling

    cfg = config_from_overrides({"method": "full_dp", **over})
    s = build.check(cfg).settings
    spec = build.method(cfg, build.model(cfg))
    if not spec.private:
        raise ConfigError("method: the audit needs a private method (full_dp or joint_dp)")
    n_owners, n_users = build.planned_units(cfg)
    population = n_owners if spec.cohort_is_owners else n_users

    def make() -> Aggregator:
        return build.estimator(
            cfg, Sampling(s.sampling_rate, population), a.rounds or s.rounds, a.dim
        )

    first = make()
    if getattr(first, "survivor_event", False):  # ddgauss, skellam: one round of the protocol
        return _main_distributed(a, first, s.delta)
    releases = releases_per_trial(a, s.rounds, first.name in LINEAR_NOISE)
    if releases < 1:
        raise ValueError(f"--sequence {releases}: at least one release per trial")
    if releases > 64:
        raise ValueError(
            f"--sequence {releases}: at most 64 releases per trial; set "
            "--sequence (or train.rounds) lower"
        )
    # the releases kept: trials x (releases x dim) float64 numbers per side
    check_arrays(
        f"--trials {a.trials} with --dim {a.dim} and {releases} release(s) per trial",
        2 * a.trials * releases * a.dim,
        8,
        "lower --trials or --dim",
    )
    print(TABLE_HEAD)
    delta = s.delta
    assert delta is not None  # a private method's
    if releases > 1 or first.name in SEQUENCE_AUDITED:

        def one(seed: int) -> AuditResult:
            return audit_sequence(make(), a.dim, a.trials, releases, delta, seed, a.broken, s.bound)

    else:

        def one(seed: int) -> AuditResult:
            return audit(make(), a.dim, a.trials, delta, seed, a.broken, s.bound)

    return _repeat(one, list(range(a.seed, a.seed + a.repeat)))


def _main_distributed(
    a: argparse.Namespace, first: Aggregator, delta: float | None
) -> list[AuditResult]:
    """A distributed mechanism (``fedudp.audit.distributed``): one round per trial, the last
    ``--dropped`` owners dropping out, repeated over the seeds."""
    if a.sequence not in (None, 1):
        raise ValueError("--sequence: the distributed audit releases one round per trial")
    assert delta is not None  # a private method's
    agg = cast("DistributedAggregator", first)  # its survivor_event says so (not changed)
    check_audit(agg, a.dropped, a.broken)
    print(TABLE_HEAD)

    def one(seed: int) -> AuditResult:
        return audit_distributed(agg, a.trials, delta, seed, a.broken, dropped=a.dropped)

    return _repeat(one, list(range(a.seed, a.seed + a.repeat)))


def _main_pair(a: argparse.Namespace, over: dict) -> int:
    """``--pair paper_leak``: the paper-mode leak pair (``fedudp.leak``)."""
    from fedudp.config import ConfigError
    from fedudp.leak import clipped_sums, leak_config

    try:
        pair = clipped_sums(leak_config(**over))
    except (ConfigError, ValueError) as e:
        print(f"fedudp-audit: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    s = pair.prepared.settings
    print(
        f"pair: {a.pair} (privacy.accounting={s.accounting}): adding the canary user "
        f"moves the clipped sum by {pair.moved:.2f} C (the accountant assumes at most 1 C)"
    )
    r = audit_pair(
        pair.prepared.aggregator, pair.with_user, pair.without_user, a.trials, s.delta, a.seed
    )
    from fedudp.build import run_guarantee

    r.claim_heuristic = run_guarantee(pair.prepared.spec, pair.prepared.aggregator) == "heuristic"
    print(TABLE_HEAD)
    print(row(r, f"{r.mechanism} ({a.pair}, {s.accounting})"))
    print("\n".join(details(r)))
    return 1 if r.violation else 0


def _repeat(run_one: Callable[[int], AuditResult], seeds: list[int]) -> list[AuditResult]:
    out = []
    for s in seeds:
        r = run_one(s)
        print(row(r, f"{r.mechanism} (seed {s})"), flush=True)
        out.append(r)
    return out


def _main_local_dpsgd(a: argparse.Namespace, over: dict) -> int:
    from fedudp.config import config_from_overrides

    batch = config_from_overrides({**AUDIT_DPSGD, **over}).train.batch_size
    try:
        sizes = (
            [tuple(int(v) for v in m.split(":")) for m in a.owner_users.split(",")]
            if a.owner_users
            else [(max(2, batch // 3),), (batch + 1,)]
        )
        if any(len(m) not in (1, 2) for m in sizes):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"--owner-users {a.owner_users}: comma-separated integers M or pairs m:M"
        ) from None
    if a.sequence not in (None, 1):
        raise ValueError("--sequence: the owner-side audit releases one round per trial")
    if a.rounds:
        over = {**over, "train.rounds": a.rounds}
    print(TABLE_HEAD)
    results = []
    for m in sizes:

        def one(s: int, m: tuple[int, ...] = m) -> AuditResult:
            return audit_local_dpsgd(
                over, m[0], a.trials, s, a.broken, capacity=m[-1], natural=a.natural
            )

        results += _repeat(one, list(range(a.seed, a.seed + a.repeat)))
    return finish(results, a.repeat, a.broken, a.seed)
