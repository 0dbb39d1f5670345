"""``fedudp-audit``'s command line: its flags, and the checks of their numbers made before any
mechanism is built (a refused flag is one line naming it)."""

from __future__ import annotations

import argparse

from fedudp.errors import ConfigError
from fedudp.memory import check_arrays

__all__ = ["DESCRIPTION", "check_flags", "parser", "releases_per_trial"]

DESCRIPTION = "An empirical privacy audit of one configured release: ``fedudp-audit [overrides]``."


def parser() -> argparse.ArgumentParser:
    """``fedudp-audit``'s argument parser.

    Returns
    -------
    argparse.ArgumentParser
        The parser of the overrides and the audit's flags.
    """
    ap = argparse.ArgumentParser(prog="fedudp-audit", description=DESCRIPTION)
    _release_flags(ap)
    _audit_flags(ap)
    return ap


def _release_flags(ap: argparse.ArgumentParser) -> None:
    """The overrides and the flags of what is released: trials, length, rounds, ``--break``."""
    ap.add_argument(
        "overrides", nargs="*", help="fedudp config overrides (key=value, as for fedudp)"
    )
    ap.add_argument("--trials", type=int, default=100_000, help="releases on each neighbour")
    ap.add_argument(
        "--dim", type=int, default=8, help="length of the audited vectors (server side)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="releases the noise is calibrated for (default: train.rounds; the "
        "owner-side audit runs one round calibrated for train.rounds=1 unless "
        "overridden)",
    )
    ap.add_argument(
        "--break",
        dest="broken",
        default="",
        help="weaken the mechanism on purpose (the audit must catch it): noise=FACTOR "
        "(any factor > 0), clip=off (server side), schedule=data (local_dpsgd)",
    )


def _audit_flags(ap: argparse.ArgumentParser) -> None:
    """The flags of what is audited: owner sizes, natural users, sequences, seeds, pairs."""
    ap.add_argument(
        "--owner-users",
        default="",
        help="local_dpsgd: comma-separated owner sizes to audit, M (D: M users, D': "
        "M-1, public capacity M) or m:M (an owner below capacity: D holds m "
        "users, D' m-1, capacity M); default B//3 and B+1",
    )
    ap.add_argument(
        "--natural",
        type=int,
        default=None,
        metavar="K",
        help="local_dpsgd: natural users instead of the planned federation: users "
        "holding 1..K records each, built in memory from plain arrays "
        "(fedudp.from_arrays) with every public number declared (public.users, "
        "public.owner_capacity = M, public.records_per_user = K, "
        "dataset.classes, dataset.input_shape); with --owner-users m:M owner 0 "
        "holds m users below its capacity M, D' the same without one user",
    )
    ap.add_argument(
        "--sequence",
        type=int,
        default=None,
        help="releases per trial (server side): each trial is a fresh mechanism "
        "releasing this many times, audited as one sequence against the ε of as "
        "many releases; default: the run's rounds for dp_ftrl_tree, dp_mf_blt and "
        "dp_mf_banded, 1 otherwise",
    )
    ap.add_argument(
        "--dropped",
        type=int,
        default=0,
        help="distributed (ddgauss, skellam): owners that drop out of every audited round "
        "(the survivors reveal their pair seeds; the claim is the round's ε at its survivors)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the audit with seeds seed..seed+K-1 and count violations (on the "
        "unbroken mechanism: the false-alarm rate)",
    )
    ap.add_argument(
        "--pair",
        default="",
        choices=["", "paper_leak"],
        help="audit a built-in neighbouring pair through the configured release "
        "instead of a canary: paper_leak = the joint-DP paper-mode pair "
        "(overrides such as privacy.accounting=certified|paper apply to it)",
    )


def releases_per_trial(a: argparse.Namespace, run_rounds: int, linear_noise: bool) -> int:
    """``--sequence`` where given (0 is refused, never read as "not given"), else the run's
    rounds (``--rounds``, else ``train.rounds``) for a mechanism whose noise is correlated
    across rounds, else one release.

    Parameters
    ----------
    a : argparse.Namespace
        The parsed command line.
    run_rounds : int
        The run's ``train.rounds``.
    linear_noise : bool
        The mechanism's noise is correlated across rounds (a tree, a banded mechanism).

    Returns
    -------
    int
        Releases per trial.
    """
    if a.sequence is not None:
        return int(a.sequence)
    rounds = a.rounds if a.rounds is not None else run_rounds
    return int(rounds) if linear_noise else 1


def check_flags(a: argparse.Namespace, over: dict) -> str | None:
    """The command line's numbers, checked before any mechanism is built: the one-line reason
    a flag is refused (None: all fine). The releases an audit keeps (2 sides x trials x the
    released length, float64) must fit this machine's memory (``fedudp.models.footprint``);
    the released length is at least ``--dim`` on the server side and 1 owner-side, checked
    again once the sequence length is known.

    Parameters
    ----------
    a : argparse.Namespace
        The parsed command line.
    over : dict
        The config overrides.

    Returns
    -------
    str or None
        The one-line reason a flag is refused, or None.
    """
    for flag, value, least in (
        ("--trials", a.trials, 200),
        ("--dim", a.dim, 1),
        ("--repeat", a.repeat, 1),
        ("--sequence", a.sequence, 1),
        ("--rounds", a.rounds, 1),
        ("--natural", a.natural, 1),
        ("--dropped", a.dropped, 0),
    ):
        if value is not None and value < least:
            what = {
                "--trials": "releases per side",
                "--dim": "coordinate in the audited vectors",
                "--repeat": "audit (seed)",
                "--sequence": "release per trial",
                "--rounds": "round to calibrate the noise for",
                "--natural": "record per user",
                "--dropped": "owners (0: none drops)",
            }[flag]
            return f"{flag} {value}: at least {least} {what}"
    server = over.get("privacy.placement", "server") != "local_dpsgd" and not a.pair
    try:
        check_arrays(
            f"--trials {a.trials}" + (f" with --dim {a.dim}" if server else ""),
            2 * a.trials * (a.dim if server else 1),
            8,
            "lower --trials" + (" or --dim" if server else ""),
        )
    except ConfigError as e:
        return str(e)
    return None
