"""A run's length is said before it is spent (fedudp.notices; issue 49: 1e9 rounds at q = 0.01
calibrated and then started a run of 1e9 rounds without a word). The decisions are tested with
fake speeds; one tiny run checks the wiring (before round 1, after the second round)."""

from __future__ import annotations

import json

import pytest

from conftest import tiny_cfg
from fedudp import notices, tracking
from fedudp.notices import duration_text, rounds_notice, speed_notice
from fedudp.run import run


def test_the_rounds_notice_names_the_key_above_the_bound():
    assert rounds_notice(100_000) is None
    text = rounds_notice(1_000_000_000)
    assert text is not None and "\n" not in text
    assert text.startswith("train.rounds=1000000000: this run has 1,000,000,000 rounds to go")
    assert "Lower train.rounds" in text
    # a resumed run counts the rounds it has left
    assert rounds_notice(150_000, done=60_000) is None
    assert rounds_notice(150_000, done=40_000) is not None


@pytest.mark.parametrize(
    "rounds,at,seconds,expected",
    [
        (1_000_000_000, 2, 0.35, "about 11.1 years"),  # the issue's run at its measured speed
        (1_000, 2, 100.0, "about 1.16 days"),  # 998 rounds of 100 s
        (1_000, 2, 80.0, None),  # 998 x 80 s = 22.2 hours: within a day
        (10, 10, 1e6, None),  # nothing left
    ],
)
def test_the_speed_notice_decides_from_the_rounds_left(rounds, at, seconds, expected):
    got = speed_notice(rounds, at, seconds)
    if expected is None:
        assert got is None
    else:
        assert got is not None and expected in got and got.startswith(f"train.rounds={rounds}:")
        assert f"the {rounds - at:,} rounds left" in got and "more than 1 day" in got


def _twin_speed_notice(rounds, round_, seconds, limit=None):
    """The weakened twin: the round's own time against the bound, not the rounds left."""
    limit = notices.LONG_RUN_SECONDS if limit is None else limit
    return "slow" if seconds > limit else None


def _flags_the_issues_run(notice_fn) -> None:
    got = notice_fn(1_000_000_000, 2, 0.35)  # 1e9 rounds of 0.35 s
    assert got is not None and "years" in got
    assert notice_fn(1_000, 2, 80.0) is None  # 22 hours


def test_twin_ignoring_the_rounds_left_is_caught():
    _flags_the_issues_run(speed_notice)
    with pytest.raises(AssertionError):
        _flags_the_issues_run(_twin_speed_notice)


def test_durations_read():
    assert [duration_text(s) for s in (30, 90, 3600, 86_400, 5e7)] == [
        "30 seconds",
        "1.5 minutes",
        "1 hour",
        "1 day",
        "1.58 years",
    ]


def test_a_run_says_both_before_round_1_and_after_its_second(tmp_path, monkeypatch):
    monkeypatch.setattr(notices, "LONG_RUN_ROUNDS", 2)
    monkeypatch.setattr(notices, "LONG_RUN_SECONDS", 0.0)
    said: list[tuple[str, int]] = []
    metrics = tmp_path / "metrics.jsonl"

    def warn(message):  # each notice with the rounds metrics.jsonl holds when it is said
        n = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        said.append((message, n))

    monkeypatch.setattr(tracking, "warn", warn)
    s = run(tiny_cfg("full_dp", train__rounds=3, progress=False), tmp_path)
    assert s["rounds_completed"] == 3
    (before, n0), (after, n2) = said
    assert n0 == 0 and before.startswith("train.rounds=3: this run has 3 rounds to go")
    seconds = json.loads(metrics.read_text().splitlines()[1])["seconds"]
    assert n2 == 2 and after.startswith(f"train.rounds=3: round 2 took {seconds:.3g} s")
    assert "the 1 round left would take" in after
