"""``fedudp-audit``'s numbers are refused in one line before any mechanism runs (issue 49:
``--dim 0`` and ``--trials 100000000000`` were raw tracebacks, ``--repeat 0`` exited 0 with an
empty table, ``--sequence 0`` was taken for the default)."""

from __future__ import annotations

import argparse

import pytest

from fedudp.audit import cli as audit  # the command's module: the names ``main`` calls
from fedudp.audit import main


class Reached(Exception):
    """The audit of a mechanism started."""


@pytest.fixture
def no_audit(monkeypatch):
    """Every audit entry point raises ``Reached`` instead of auditing (nothing runs)."""

    def reached(*a, **k):
        raise Reached

    for name in ("audit", "audit_sequence", "audit_local_dpsgd", "audit_pair"):
        monkeypatch.setattr(audit, name, reached)


def _old_check(a: argparse.Namespace, over: dict) -> str | None:
    """The weakened twin: the command line's checks before issue 49 (--trials >= 200 only)."""
    return f"--trials {a.trials}: at least 200 releases per side" if a.trials < 200 else None


def _old_releases(a: argparse.Namespace, run_rounds: int, linear_noise: bool) -> int:
    """The weakened twin's ``--sequence``: 0 read as "not given" (``a.sequence or ...``)."""
    return a.sequence or (a.rounds or run_rounds if linear_noise else 1)


BAD = [
    (["--dim", "0"], "--dim 0: at least 1 "),
    (["--dim", "-3"], "--dim -3: at least 1 "),
    (["--repeat", "0"], "--repeat 0: at least 1 "),
    (["--sequence", "0"], "--sequence 0: at least 1 "),
    (["--rounds", "0"], "--rounds 0: at least 1 "),
    (["--trials", "100000000000"], "--trials 100000000000 with --dim 8: the releases it keeps"),
    (
        ["--trials", "100000000000", "privacy.placement=local_dpsgd"],
        "--trials 100000000000: the releases it keeps",
    ),
    (["--trials", "100"], "--trials 100: at least 200 "),
]


@pytest.mark.parametrize("argv,start", BAD)
def test_a_bad_number_is_one_line_naming_the_flag(capsys, no_audit, argv, start):
    assert main(["--trials", "1000", *argv] if argv[0] != "--trials" else argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"fedudp-audit: error: {start}"), err
    assert "\n" not in err and ("lower --trials" in err or "at least" in err)


@pytest.mark.parametrize("argv", [a for a, _ in BAD if a != ["--trials", "100"]])
def test_twin_with_the_old_checks_lets_each_reach_the_audit(monkeypatch, no_audit, argv):
    monkeypatch.setattr(audit, "check_flags", _old_check)
    monkeypatch.setattr(audit, "releases_per_trial", _old_releases)
    monkeypatch.setattr(audit, "check_arrays", lambda *a, **k: None)
    full = ["--trials", "1000", *argv] if argv[0] != "--trials" else argv
    if argv == ["--repeat", "0"]:  # the old behaviour: no audit at all, exit 0, empty table
        assert main(full) == 0
        return
    # each reaches an audit (--sequence 0 and --rounds 0 taken for "not given"), where --dim 0
    # fails with an IndexError and --trials 1e11 with a MemoryError (here: the stub)
    with pytest.raises(Reached):
        main(full)


def test_the_sequence_check_after_calibration_bounds_the_kept_releases(
    capsys, no_audit, monkeypatch
):
    # within --trials x --dim, but over memory with the 64 releases per trial of a sequence
    from fedudp import memory

    monkeypatch.setattr(memory, "memory_bytes", lambda device="cpu": 2 * 10_000 * 8 * 8 * 10)
    assert main(["--trials", "10000", "--sequence", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "fedudp-audit: error: --trials 10000 with --dim 8 and 64 release(s) per trial: "
    )
    with pytest.raises(Reached):  # 10 releases per trial fit
        main(["--trials", "10000", "--sequence", "10"])


def test_good_flags_reach_the_audit(no_audit):
    with pytest.raises(Reached):
        main(["--trials", "1000", "--sequence", "1", "--repeat", "2"])
