"""Benchmark: the privacy ledger's cost per round (docs/results/ledger/README.md).

One round of the ledger is what the billboard asks the accountant for every round
(fedudp/billboard/server.py): ``epsilon_if`` (the budget check before the round), ``compose``,
``epsilon`` and ``epsilon_rdp`` (the ledger entry after it). The event is the one of
``fedudp +experiment=huang_alg1``: a Poisson-sampled Gaussian at q = 1/2000 (one record of 2,000)
with the noise multiplier calibrated for (1.0, 1e-5) over 4,000 rounds, on the PLD grid 1e-4.

* before: ``OldAccountant`` below, a faithful copy of the accountant as it was (every question
  recomputed on a fresh dp-accounting PLD accountant from the whole composition). It keeps no
  state between questions, so the cost of round k is measured directly: an accountant holding
  k - 1 rounds, then round k, timed (min and median over ``--reps`` repetitions).
* after: ``fedudp.privacy.accountant.Accountant`` (as ``accountant_for`` builds it, the target
  as threshold). Its work is front-loaded on some rounds (the grid), so the cost per round is
  amortized: rounds 1..K from an empty accountant and cold caches, total time / K (min and
  median over ``--reps`` repetitions).
* peak memory: ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` of a separate process per side.

    .venv/bin/python scripts/benchmarks/bench_ledger.py                 # the table (Markdown) on stdout
    .venv/bin/python scripts/benchmarks/bench_ledger.py --reps 5 --rounds 10 100 1000 4000

Times are wall clock (``time.perf_counter``) and CPU time of the process
(``time.process_time``): the machine may be shared, CPU time is the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

Q = 1 / 2000  # huang_alg1: one record of m n = 2,000, Poisson-sampled
TARGET, DELTA, ROUNDS = 1.0, 1e-5, 4000
INTERVAL = 1e-4  # fedudp.privacy.accountant.pld_interval(1.0)
# calibrate_noise_multiplier(PoissonSampled(1/2000, Gaussian(z)), 1.0, 1e-5, 4000); --calibrate
# recomputes it
Z = 0.6129660146601268
RELATION = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def event(z: float = Z) -> dp_accounting.DpEvent:
    return dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(z))


# -- BEFORE: a faithful copy of fedudp/privacy/accountant.py's Accountant before the change -------
# (runs of identical events as SelfComposedDpEvent, every epsilon on a fresh PLDAccountant; the
# ApproxDp blocks, which this benchmark does not use, left out)
def _old_event_epsilon(event, delta, interval=1e-4, rdp_only=False):
    if event is None:
        return 0.0 if delta >= 0 else math.inf
    if delta <= 0:
        return math.inf
    if not rdp_only:
        acc = pld_privacy_accountant.PLDAccountant(RELATION, value_discretization_interval=interval)
        if acc.supports(event):
            acc.compose(event)
            return float(acc.get_epsilon(delta))
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=RELATION)
    if not acc.supports(event):
        return None
    acc.compose(event)
    return float(acc.get_epsilon(delta))


class OldAccountant:
    """BEFORE (uncached): fedudp's Accountant as it was, blocks aside."""

    def __init__(self, pld_interval: float = 1e-4) -> None:
        self.pld_interval = pld_interval
        self.runs: list[list] = []

    def compose(self, event, count: int = 1) -> None:
        if self.runs and self.runs[-1][0] == event:
            self.runs[-1][1] += count
        else:
            self.runs.append([event, count])

    def _composed(self, extra=None, count: int = 1):
        runs = [list(r) for r in self.runs]
        if extra is not None:
            if runs and runs[-1][0] == extra:
                runs[-1][1] += count
            else:
                runs.append([extra, count])
        parts = [dp_accounting.SelfComposedDpEvent(e, c) for e, c in runs]
        return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)

    def epsilon(self, delta: float) -> float:
        if not self.runs:
            return 0.0
        return float(_old_event_epsilon(self._composed(), delta, self.pld_interval))

    def epsilon_rdp(self, delta: float):
        if not self.runs:
            return 0.0
        return _old_event_epsilon(self._composed(), delta, self.pld_interval, rdp_only=True)

    def epsilon_if(self, event, delta: float, count: int = 1) -> float:
        return float(_old_event_epsilon(self._composed(event, count), delta, self.pld_interval))


# -- the measurements ------------------------------------------------------------------------------
def one_round(acc, ev) -> tuple[float, float, float]:
    """(wall s, cpu s, epsilon) of one ledger round on ``acc``."""
    w, c = time.perf_counter(), time.process_time()
    acc.epsilon_if(ev, DELTA)
    acc.compose(ev)
    eps = acc.epsilon(DELTA)
    acc.epsilon_rdp(DELTA)
    return time.perf_counter() - w, time.process_time() - c, eps


def bench_before(rounds: list[int], reps: int) -> dict:
    ev, out = event(), {}
    for k in rounds:
        walls, cpus = [], []
        for _ in range(reps):
            acc = OldAccountant(INTERVAL)
            acc.compose(ev, k - 1)
            w, c, eps = one_round(acc, ev)
            walls.append(w)
            cpus.append(c)
        out[k] = {"wall": walls, "cpu": cpus, "epsilon": eps}
    return out


def _cold() -> None:
    """Forget every cache the accountant module keeps (a fresh process's state)."""
    from fedudp.privacy.accountant import forget_all

    forget_all()


def bench_after(rounds: list[int], reps: int) -> dict:
    from fedudp.privacy.accountant import accountant_for

    ev, out = event(), {}
    top = max(rounds)
    per = {k: {"wall": [], "cpu": [], "max_wall": []} for k in rounds}
    for _ in range(reps):
        _cold()
        acc = accountant_for(ev, None, TARGET)
        wall = cpu = worst = 0.0
        for r in range(1, top + 1):
            w, c, eps = one_round(acc, ev)
            wall, cpu, worst = wall + w, cpu + c, max(worst, w)
            if r in per:
                per[r]["wall"].append(wall / r)
                per[r]["cpu"].append(cpu / r)
                per[r]["max_wall"].append(worst)
                per[r]["epsilon"] = eps
    out.update(per)
    return out


def direct_epsilon(k: int, z: float = Z) -> float:
    """What the ledger must match: a fresh PLDAccountant on SelfComposedDpEvent(event, k)."""
    acc = pld_privacy_accountant.PLDAccountant(RELATION, value_discretization_interval=INTERVAL)
    acc.compose(dp_accounting.SelfComposedDpEvent(event(z), k))
    return float(acc.get_epsilon(DELTA))


def _child(side: str, rounds: list[int], reps: int) -> None:
    res = bench_before(rounds, reps) if side == "before" else bench_after(rounds, reps)
    res = {str(k): v for k, v in res.items()}
    res["maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(res))


def _run_child(side: str, rounds: list[int], reps: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        side,
        "--reps",
        str(reps),
        "--rounds",
        *map(str, rounds),
    ]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _ms(xs: list[float]) -> str:
    return f"{1e3 * min(xs):.2f} / {1e3 * statistics.median(xs):.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, nargs="+", default=[10, 100, 1000, 4000])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="recompute the noise multiplier (and time the calibration)",
    )
    p.add_argument("--child", choices=["before", "after"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        _child(a.child, a.rounds, a.reps)
        return
    if a.calibrate:
        from fedudp.privacy.accountant import calibrate_noise_multiplier

        w = time.perf_counter()
        z = calibrate_noise_multiplier(event, TARGET, DELTA, ROUNDS)
        print(
            f"calibrated z = {z!r} in {time.perf_counter() - w:.1f} s wall "
            f"(the constant here: {Z!r})\n"
        )
    start = time.perf_counter()
    before = _run_child("before", a.rounds, a.reps)
    after = _run_child("after", a.rounds, a.reps)
    print(
        f"event: PoissonSampledDpEvent({Q:g}, GaussianDpEvent({Z!r})), delta {DELTA:g}, "
        f"PLD grid {INTERVAL:g}, target epsilon {TARGET:g}; {a.reps} repetitions\n"
    )
    print(
        "| rounds K | before: round K, ms (min / median), wall | before: CPU ms (min) "
        "| after: per round over 1..K, ms (min / median), wall | after: CPU ms (min) "
        "| after: slowest round, ms (median) | epsilon after K (after) | after - direct |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k in a.rounds:
        b, f = before[str(k)], after[str(k)]
        direct = direct_epsilon(k)
        print(
            f"| {k} | {_ms(b['wall'])} | {1e3 * min(b['cpu']):.1f} | {_ms(f['wall'])} | "
            f"{1e3 * min(f['cpu']):.2f} | {1e3 * statistics.median(f['max_wall']):.0f} | "
            f"{f['epsilon']:.6f} | {f['epsilon'] - direct:+.2e} |"
        )
    print(
        f"\npeak memory (ru_maxrss): before {before['maxrss_mb']:.0f} MB, "
        f"after {after['maxrss_mb']:.0f} MB"
    )
    eps_before = ", ".join(f"{before[str(k)]['epsilon']:.6f}" for k in a.rounds)
    print(f"before: epsilon at K = {eps_before} (the direct computation)")
    print(f"benchmark wall time: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
