"""The resumable loop of the result scripts that append one JSON line per finished job.

Used by ``audit_sequences.py`` and ``privacy_audit_table.py`` (this folder): each job's result is
appended to a JSON-lines file as soon as it finishes and the Markdown table is rewritten from
every line so far, so an interrupted script, run again, skips what is done and loses at most
the job it was running. Not a command of its own (standard library only).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path


def read_lines(runs: Path) -> list[dict]:
    """The finished jobs recorded in ``runs`` (a JSON-lines file), in order; [] if it is absent."""
    return [json.loads(x) for x in runs.read_text().splitlines()] if runs.exists() else []


def run_resumable(
    runs: Path,
    table: Path,
    jobs: Iterable[tuple[Hashable, Callable[[], dict]]],
    key: Callable[[dict], Hashable],
    render: Callable[[list[dict]], str],
    echo: bool = False,
) -> list[dict]:
    """Run each ``(k, job)`` whose ``k`` no recorded line has (``key(line)``), append its result
    to ``runs`` and rewrite ``table`` with ``render(all lines)`` after each; the table is
    written once more at the end (also when there is nothing to run). Returns every line."""
    done = read_lines(runs)
    have = {key(d) for d in done}
    for k, job in jobs:
        if k in have:
            continue
        d = job()
        if echo:
            print(json.dumps(d), flush=True)
        with runs.open("a") as f:
            f.write(json.dumps(d) + "\n")
        done.append(d)
        have.add(k)
        table.write_text(render(done))
    table.write_text(render(done))
    return done
