"""Benchmark: fedudp vs Apple's pfl-research 0.6.0 on user-level DP FedAvg (s/round, peak RSS).

Seconds per round and peak memory, each side in its own fresh process, the sides alternating.

The workload (identical on both sides):

* data: 10,000 MNIST training records as fedudp reads them for ``dataset.name=mnist
  dataset.num_records=10000 partition.scheme=iid`` (a seeded random 10,000 of the 60,000,
  standardized with the training pool's mean and std), cut into users of
  ``partition.records_per_user`` records (1: 10,000 users; 10: 1,000 users; ``--owners`` 500
  owners of 20 records, so every user holds exactly that many); the test records fedudp's
  owners hold (20 per owner: all 10,000 MNIST test records). This script builds fedudp's federation once per setting
  (``fedudp.build.federation``) and writes its users' records, the test records and the
  model's initial weights (``fedudp.build.model``, the run seed) to one ``.npz``: the pfl
  worker trains exactly these users from exactly these weights, and the fedudp worker checks
  that its own run loads the same records and weights (SHA-256);
* model: fedudp's paper CNN (``fedudp.models.cnn.PaperCNN``, the pfl side imports that class);
* algorithm: FedAvg with central clip + Gaussian noise, every user every round: each user one
  local epoch of minibatch SGD (batch 32, so one step for users of <= 32 records) at lr
  ``--lr``, its model delta clipped to l2 norm ``--clip``, the clipped deltas summed,
  N(0, (z * clip)^2) added per coordinate (z = ``--noise-multiplier``), divided by the number
  of users, added to the model with server lr 1 (fedudp: ``u += server_lr * mean``; pfl: the
  central ``torch.optim.SGD(lr=1)`` step on the negated mean).

fedudp: ``method=full_dp privacy.placement=server aggregator=auto`` (clip + Gaussian),
``train.sampling_rate=1.0``, ``privacy.noise_multiplier=z`` with ``privacy.epsilon=1e6`` so
the budget never stops the run, ``engine=local``, ``engine_opts.threads=1``, evaluation only
after the last round. pfl: ``scripts/benchmarks/bench_pfl_worker.py`` run with ``--pfl-python``
(``FederatedDataset``, ``PyTorchModel``, ``FederatedAveraging`` with ``NNAlgorithmParams`` /
``NNTrainHyperParams``, ``CentrallyAppliedPrivacyMechanism(GaussianMechanism(clip, z))``,
``SimulatedBackend``; see that file).

Measurement: every repetition of every side is a fresh subprocess running ``--rounds`` R
rounds; the sides alternate (fedudp, pfl, plain, fedudp, pfl, plain, ...), ``--reps`` repetitions each per
setting. Seconds per round are measured inside the worker around each round: fedudp's round
loop's own per-round ``seconds`` (sampling, the budget check, every user's local training,
clipping and summation, noise, the server update, the ledger), minus, for the last round, the
evaluation it runs inside that span (timed around ``LocalTransport.evaluate``); pfl's from
``on_train_begin`` / ``after_central_iteration`` (the span pfl's ``StopwatchCallback`` times:
sampling, every user's local training, clipping, summation, noise, averaging, the central
update). Round 1 (warm-up; pfl also evaluates every user before and after local training in
its iteration 0) is excluded; a repetition's s/round is the *mean* of rounds 2..R. Reported
per side and setting: the min and the median over repetitions, and the ratios pfl / fedudp of
the mins and of the medians. Peak memory: the worker's ``ru_maxrss`` from ``os.wait4`` (the
whole process: for fedudp that is reading and standardizing the 60,000-image pool before round
1); the summed RSS and the number of processes of the worker's session are also sampled from
/proc every 0.25 s, which gives the peak from round 1 to the end of the final evaluation
("rounds") and shows that neither side starts child processes (the count stays 1). This parent
process imports neither torch nor fedudp (the workload is written by a subprocess too): Linux
carries a child's RSS high-water mark across exec, so a child spawned from a large parent
would report the parent's RSS. One thread per side:
``OMP_NUM_THREADS=MKL_NUM_THREADS=1`` and ``torch.set_num_threads(1)`` in both workers
(fedudp: ``engine_opts.threads=1``). No network: both sides run in one process each.

The floor (``--sides``, on by default): a third side, ``plain``, runs the same rounds as a bare
PyTorch loop (``scripts/benchmarks/bench_pfl_plain_worker.py``, in fedudp's venv: every user in turn, the
global weights copied in, ``torch.optim.SGD`` over its minibatches, the difference clipped in
float64 and summed, float64 noise, the mean added; no sampling, screening, accounting or
bookkeeping). Its seconds per round are the obvious loop's compute: a framework gets below
it only by running the same arithmetic in cheaper kernels. The table gives each side's time
over the floor's (mins / medians).

The batched floors (``--sides ... opacus vmap``, on by default): the same rounds with every
user's one-step delta from one batched per-sample pass (``scripts/benchmarks/bench_pfl_floor_worker.py``,
fedudp's venv): ``opacus``, Opacus's ``GradSampleModule`` on ``PaperCNN(channels_last=False)``
(the export-safe layout) with each user's per-record rows summed; ``vmap``,
``torch.func.vmap(grad(loss))`` over users. They draw the plain side's noise, so ``--check``
compares them with plain to float rounding. Only for one-step users (records <= batch, one
epoch). Opacus is not a fedudp dependency (``.venv/bin/pip install opacus==1.6.0``): without it,
and without ``--pfl-python``, that side is skipped with a message. The table gives each side's
peak RSS at loading (its VmHWM when round 1 starts), over the rounds (sampled) and over the
whole run (``ru_maxrss``).

Same work: each worker prints the users trained per round (fedudp: the release's
``users_used``; pfl: its ``number of devices`` metric), the local steps per user (pfl: also
counted, calls of the model's ``loss`` per trained user) and the test accuracy after round R.
``--check`` (with a small z, e.g. ``--noise-multiplier 0.01 --rounds 2``) runs each side once
and compares the final weights: the two sides draw independent noise, so the gap should be a
few noise standard deviations (z * clip / users) and shrink with z, nothing more.

The pfl side needs pfl-research in a venv of its own (not fedudp's): ``--pfl-python`` or
``$PFL_PYTHON``, made by ``python3 -m venv VENV && VENV/bin/pip install torch==2.13.0
'pfl[pytorch]==0.6.0'``.

    PFL_PYTHON=VENV/bin/python .venv/bin/python scripts/benchmarks/bench_pfl.py --data-root DATA \\
        --rounds 5 --reps 7 --json docs/results/bench_pfl/bench.json
    PFL_PYTHON=VENV/bin/python .venv/bin/python scripts/benchmarks/bench_pfl.py --data-root DATA \\
        --check --noise-multiplier 0.01 --rounds 2 --json docs/results/bench_pfl/check.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from proctree import (
    session_tree,
    status_kib,
)  # scripts/benchmarks/proctree.py (this script's folder)

ROOT = Path(__file__).resolve().parents[2]
WORKER_PFL = Path(__file__).resolve().parent / "bench_pfl_worker.py"
WORKER_PLAIN = Path(__file__).resolve().parent / "bench_pfl_plain_worker.py"
WORKER_FLOOR = Path(__file__).resolve().parent / "bench_pfl_floor_worker.py"
PFL_VENV_HINT = "python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 'pfl[pytorch]==0.6.0'"
OPACUS_HINT = ".venv/bin/pip install opacus==1.6.0 (not a fedudp dependency)"
SIDES = ("fedudp", "pfl", "plain", "opacus", "vmap")
FLOORS = ("opacus", "vmap")  # compared with plain in --check: the same noise draws


# -- fedudp: the config ---------------------------------------------------------------------
def make_cfg(a, records_per_user: int, rounds: int):
    sys.path.insert(0, str(ROOT))
    from fedudp.config import RunConfig

    cfg = RunConfig()
    cfg.progress = False
    cfg.method = "full_dp"
    cfg.aggregator = "auto"  # clip + Gaussian for full_dp
    cfg.engine = "local"
    cfg.seed = a.seed
    cfg.privacy.placement = "server"
    cfg.privacy.unit = "user"
    cfg.privacy.clip = a.clip
    cfg.privacy.noise_multiplier = a.noise_multiplier
    cfg.privacy.epsilon = 1e6  # the budget never stops the run
    cfg.dataset.name = "mnist"
    cfg.dataset.root = a.data_root
    cfg.dataset.num_records = a.num_records
    cfg.model.name = "cnn"
    cfg.partition.num_owners = a.owners
    cfg.partition.records_per_user = records_per_user
    cfg.partition.scheme = "iid"
    cfg.train.rounds = rounds
    cfg.train.lr = a.lr
    cfg.train.batch_size = a.batch
    cfg.train.local_epochs = a.epochs
    cfg.train.sampling_rate = 1.0  # every user every round
    cfg.train.server_lr = a.server_lr
    cfg.train.eval_every = 10**6  # evaluate after the last round only
    cfg.engine_opts.threads = 1
    return cfg


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for arr in arrays:
        h.update(memoryview(arr).cast("B"))
    return h.hexdigest()[:16]


def _params_sha(params: dict) -> str:
    return _sha(*[params[k].detach().contiguous().numpy() for k in sorted(params)])


def prepare_workload(a) -> None:
    """fedudp's federation and initial weights for one setting, written for the pfl worker
    (``--workload``) with a description of it (``--out``). Runs as a subprocess so that the
    measuring parent stays small (a child's ``ru_maxrss`` starts from its parent's RSS at
    spawn time: the kernel carries the high-water mark across exec)."""
    import numpy as np
    from fedudp import build

    cfg = make_cfg(a, a.records_per_user, a.rounds)
    fed = build.federation(cfg)
    net = build.model(cfg)
    init = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    x, y = fed.x.contiguous().numpy(), fed.y.contiguous().numpy()
    np.savez(
        a.workload,
        x=x,
        y=y,
        user_offsets=fed.user_offsets,
        x_test=fed.x_test.numpy(),
        y_test=fed.y_test.numpy(),
        classes=np.int64(fed.num_classes),
        **{f"init/{k}": v.numpy() for k, v in init.items()},
    )
    sizes = fed.user_sizes()
    Path(a.out).write_text(
        json.dumps(
            {
                "records_per_user": a.records_per_user,
                "users": int(fed.num_users),
                "owners": int(fed.num_owners),
                "records": int(fed.num_records),
                "user_sizes": sorted({int(s) for s in sizes}),
                "test_records": int(len(fed.y_test)),
                "parameters": int(sum(v.numel() for v in init.values())),
                "data_sha": _sha(x, y),
                "init_sha": _params_sha(init),
            }
        )
    )


# -- fedudp: the worker ---------------------------------------------------------------------
def fedudp_worker(a) -> None:
    import numpy as np
    import torch
    from fedudp.billboard.rounds import summarize
    from fedudp.engines import local as local_engine
    from fedudp.run import execute, prepare

    torch.set_num_threads(1)
    eval_s: dict[int, float] = {}
    evaluate = local_engine.LocalTransport.evaluate

    def timed_evaluate(self, shared, round_, while_waiting=None):
        t0 = time.perf_counter()
        try:
            return evaluate(self, shared, round_, while_waiting)
        finally:
            eval_s[round_] = eval_s.get(round_, 0.0) + time.perf_counter() - t0

    local_engine.LocalTransport.evaluate = timed_evaluate  # timing only, same behaviour

    cfg = make_cfg(a, a.records_per_user, a.rounds)
    p = prepare(cfg)
    fed = p.fed
    init_sha = _params_sha(p.billboard.shared_params())
    data_sha = _sha(fed.x.contiguous().numpy(), fed.y.contiguous().numpy())
    rss_before, hwm_before = status_kib("VmRSS"), status_kib("VmHWM")
    infos: list[dict] = []
    wall0 = time.time()
    res = execute(p, infos.append)  # rounds 1..R, the test evaluation after round R
    wall1 = time.time()
    if res.stop_reason != "completed" or len(infos) != a.rounds:
        raise SystemExit(f"fedudp run stopped early: {res.stop_reason} {res.message}")
    acc = summarize(res.owner_accuracy, res.owner_loss, np.diff(fed.test_offsets))
    if a.final_params:
        np.savez(a.final_params, **{k: v.detach().numpy() for k, v in res.shared.items()})
    sizes = fed.user_sizes()
    steps = a.epochs * (-(-sizes // a.batch))
    Path(a.out).write_text(
        json.dumps(
            {
                "side": "fedudp",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "round_seconds": [i["seconds"] - eval_s.get(i["round"], 0.0) for i in infos],
                "round_seconds_with_eval": [i["seconds"] for i in infos],
                "eval_seconds": eval_s,
                "rounds_wall": [wall0, wall1],
                "users": int(fed.num_users),
                "records": int(fed.num_records),
                "users_per_round": [i.get("users_used") for i in infos],
                "cohort_per_round": [i.get("cohort") for i in infos],
                "clipped_fraction": [i.get("agg_clipped_fraction") for i in infos],
                "epsilon_after": infos[-1].get("epsilon"),
                "local_steps_per_user": {
                    "min": int(steps.min()),
                    "max": int(steps.max()),
                    "mean": float(steps.mean()),
                    "source": "ceil(records / batch) x epochs, fedudp.owner.local_sgd",
                },
                "final_accuracy": acc["accuracy_weighted"],
                "test_records": int(len(fed.y_test)),
                "data_sha": data_sha,
                "init_sha": init_sha,
                "rss_before_rounds_mib": rss_before / 1024,
                "hwm_before_rounds_mib": hwm_before / 1024,
            },
            indent=1,
        )
    )


# -- one measured subprocess ----------------------------------------------------------------
def child_env() -> dict:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        OPENBLAS_NUM_THREADS="1",
        FLWR_TELEMETRY_ENABLED="0",
        RAY_USAGE_STATS_ENABLED="0",
    )
    env.pop("PYTHONPATH", None)
    return env


def measure(cmd: list[str], log: Path) -> dict:
    """Run ``cmd`` (it writes its JSON to the path after ``--out``) in a session of its own:
    its ``ru_maxrss`` via ``os.wait4``; its session's summed RSS and process count sampled
    from /proc every 0.25 s (the peak over the whole run, and over its rounds)."""
    out = Path(cmd[cmd.index("--out") + 1])
    series: list[tuple[float, int, int]] = []
    done = threading.Event()
    t0 = time.perf_counter()
    with open(log, "w") as errf:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=errf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def sample() -> None:
            while not done.is_set():
                series.append((time.time(), *session_tree(proc.pid)))
                done.wait(0.25)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, ru = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        done.set()
        th.join()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{shlex.join(cmd)} failed ({proc.returncode}):\n{log.read_text()[-4000:]}"
        )
    res = json.loads(out.read_text())
    res.update(
        wall_seconds=wall,
        ru_maxrss_mib=ru.ru_maxrss / 1024,
        user_cpu_seconds=ru.ru_utime,
        sys_cpu_seconds=ru.ru_stime,
        sampled_peak_rss_mib=max((r for _, r, _ in series), default=0) / 2**20,
        max_processes=max((n for _, _, n in series), default=0),
    )
    if "rounds_wall" in res:
        w0, w1 = res["rounds_wall"]
        res["sampled_peak_rss_rounds_mib"] = (
            max((r for t, r, _ in series if w0 <= t <= w1), default=0) / 2**20
        )
    return res


def worker_cmd(
    side: str, a, rpu: int, workload: Path, out: Path, final_params: Path | None = None
) -> list[str]:
    common = [
        "--rounds",
        str(a.rounds),
        "--lr",
        str(a.lr),
        "--batch",
        str(a.batch),
        "--epochs",
        str(a.epochs),
        "--clip",
        str(a.clip),
        "--noise-multiplier",
        str(a.noise_multiplier),
        "--server-lr",
        str(a.server_lr),
        "--seed",
        str(a.seed),
        "--out",
        str(out),
    ]
    if final_params is not None:
        common += ["--final-params", str(final_params)]
    if side == "pfl":
        return [a.pfl_python, str(WORKER_PFL), "--workload", str(workload), *common]
    if side == "plain":
        return [sys.executable, str(WORKER_PLAIN), "--workload", str(workload), *common]
    if side in FLOORS:
        return [
            sys.executable,
            str(WORKER_FLOOR),
            "--mode",
            side,
            "--workload",
            str(workload),
            *common,
        ]
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        side,
        "--records-per-user",
        str(rpu),
        "--data-root",
        a.data_root,
        "--num-records",
        str(a.num_records),
        "--owners",
        str(a.owners),
        *(["--workload", str(workload)] if side == "prepare" else []),
        *common,
    ]


def per_rep(res: dict) -> float:
    """A repetition's seconds per round: the mean of rounds 2..R."""
    return statistics.mean(res["round_seconds"][1:])


def compare_final(fedudp_npz: Path, pfl_npz: Path, workload: Path, sigma: float) -> dict:
    """max |w_fedudp - w_pfl| over all parameters, against max |w_fedudp - w_init| and in
    units of ``sigma``, the std of the noise in one round's noisy mean (z * clip / users): the
    two sides draw independent noise, so with nothing else different the gap is a few sigma
    (max over the coordinates of a sum of 2R independent draws) and scales with z."""
    import numpy as np

    f, p, w = np.load(fedudp_npz), np.load(pfl_npz), np.load(workload)
    diff = max(float(np.abs(f[k] - p[k]).max()) for k in f.files)
    moved = max(float(np.abs(f[k] - w[f"init/{k}"]).max()) for k in f.files)
    return {
        "max_abs_diff_fedudp_pfl": diff,
        "max_abs_move_from_init": moved,
        "noise_std_of_mean": sigma,
        "max_abs_diff_in_noise_std": diff / sigma,
    }


# -- main -----------------------------------------------------------------------------------
def _machine() -> dict:
    cpu, mem = "?", 0
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
        mem = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal:")
        )
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "mem_gib": round(mem / 2**20, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def _opacus_version() -> str | None:
    """opacus's version in this (fedudp's) Python, None where it is not installed."""
    r = subprocess.run(
        [sys.executable, "-c", "import opacus; print(opacus.__version__)"],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=ROOT,
    )
    return r.stdout.strip() if r.returncode == 0 else None


def _versions(python: str, fedudp: bool) -> dict:
    mods = "torch, numpy" + ("" if fedudp else ", pfl")
    code = (
        f"import json, {mods}; print(json.dumps({{'torch': torch.__version__, "
        f"'numpy': numpy.__version__" + ("" if fedudp else ", 'pfl': pfl.__version__") + "}))"
    )
    r = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, env=child_env(), cwd=ROOT
    )
    if r.returncode != 0:
        err = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        raise SystemExit(
            f"bench_pfl.py: error: {python} cannot import {mods} ({err})"
            + ("" if fedudp else f"; make pfl's venv with: {PFL_VENV_HINT}")
        )
    return json.loads(r.stdout)


def _span(xs: list[float]) -> str:
    lo, hi = min(xs), max(xs)
    return f"{lo:.4f}" if f"{lo:.4f}" == f"{hi:.4f}" else f"{lo:.4f}–{hi:.4f}"


def _table(summary: list[dict], settings: list[dict]) -> str:
    lines = [
        "| setting | side | users/round | local steps/user | s/round min | s/round median "
        "| pfl / fedudp, mins / medians | side / plain, mins / medians "
        "| side / fedudp, mins / medians "
        "| peak RSS MiB loading | peak RSS MiB rounds | peak RSS MiB whole run "
        "| final test accuracy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary:
        info = next(s for s in settings if s["records_per_user"] == row["records_per_user"])
        for side in (sd for sd in SIDES if sd in row):
            s = row[side]
            st = s["local_steps_per_user"]
            steps = f"{st['min']}" if st["min"] == st["max"] else f"{st['min']}–{st['max']}"
            ratio = (
                f"**{row['ratio_of_mins']:.2f} / {row['ratio_of_medians']:.2f}**"
                if side == "pfl"
                else ""
            )
            floor = (
                f"{s['vs_plain_mins']:.2f} / {s['vs_plain_medians']:.2f}"
                if "vs_plain_mins" in s
                else ""
            )
            vs_fedudp = (
                f"{s['min'] / row['fedudp']['min']:.2f} / "
                f"{s['median'] / row['fedudp']['median']:.2f}"
            )
            rpu = row["records_per_user"]
            lines.append(
                f"| {rpu} record{'s' if rpu > 1 else ''}/user, {info['users']:,} users | {side} "
                f"| {', '.join(str(u) for u in s['users_per_round'])} | {steps} "
                f"| {s['min']:.3f} | {s['median']:.3f} | {ratio} | {floor} | {vs_fedudp} "
                f"| {s['hwm_before_rounds_mib_max']:.0f} "
                f"| {s['sampled_peak_rss_rounds_mib_max']:.0f} | {s['peak_rss_mib_max']:.0f} "
                f"| {_span(s['final_accuracy'])} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data-root",
        default=os.environ.get("FEDUDP_DATA"),
        help="folder holding mnist/ IDX files (default: $FEDUDP_DATA)",
    )
    ap.add_argument(
        "--pfl-python",
        default=os.environ.get("PFL_PYTHON"),
        help="the Python of a venv with pfl-research 0.6.0 (default: $PFL_PYTHON)",
    )
    ap.add_argument(
        "--records-per-user",
        type=int,
        nargs="+",
        default=[1, 10],
        help="the settings (partition.records_per_user)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="rounds per repetition (2..R counted)")
    ap.add_argument("--reps", type=int, default=7, help="repetitions per side and setting")
    ap.add_argument("--num-records", type=int, default=10_000)
    ap.add_argument("--owners", type=int, default=500, help="partition.num_owners")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--noise-multiplier", type=float, default=1.0)
    ap.add_argument("--server-lr", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES,
        default=list(SIDES),
        help="which sides run (fedudp always; pfl: where --pfl-python is given; plain: the "
        "bare PyTorch loop of scripts/benchmarks/bench_pfl_plain_worker.py, the floor; "
        "opacus, vmap: the batched per-sample floors of "
        "scripts/benchmarks/bench_pfl_floor_worker.py, opacus where it is installed)",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="no timing: one run per side and setting, final weights compared "
        "(use a tiny --noise-multiplier, e.g. 1e-9: both sides then compute "
        "the same model up to float rounding)",
    )
    ap.add_argument("--json", help="write every run and the summary here")
    ap.add_argument("--markdown", help="write the table here")
    ap.add_argument("--worker", choices=["prepare", "fedudp"], help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--final-params", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if not a.data_root:
        raise SystemExit(
            "bench_pfl.py: error: --data-root <folder with mnist/ IDX files> is "
            "required (or set FEDUDP_DATA)"
        )
    if a.worker:
        sys.path.insert(0, str(ROOT))
        a.records_per_user = a.records_per_user[0]
        prepare_workload(a) if a.worker == "prepare" else fedudp_worker(a)
        return
    if a.rounds < 2 or a.reps < 1:
        raise SystemExit("bench_pfl.py: error: --rounds must be >= 2 and --reps >= 1")
    wanted = set(a.sides) | {"fedudp"}
    skipped: dict[str, str] = {}
    if "pfl" in wanted and not a.pfl_python:
        skipped["pfl"] = (
            "no --pfl-python PATH (or $PFL_PYTHON): the Python of a venv with pfl-research, "
            f"made by: {PFL_VENV_HINT}"
        )
    # this process imports neither torch nor fedudp: a child's ru_maxrss starts from the
    # parent's RSS at spawn time, so the parent stays small
    vers: dict = {"fedudp_side": _versions(sys.executable, True)}
    if "opacus" in wanted:
        ov = _opacus_version()
        if ov is None:
            skipped["opacus"] = f"opacus is not installed in {sys.executable}: {OPACUS_HINT}"
        else:
            vers["fedudp_side"]["opacus"] = ov
    sides = tuple(sd for sd in SIDES if sd in wanted and sd not in skipped)
    for sd, why in skipped.items():
        print(f"bench_pfl.py: side {sd} skipped: {why}", flush=True)
    if "pfl" in sides:
        vers["pfl_side"] = _versions(a.pfl_python, False)
    machine = _machine()
    load_start = os.getloadavg()
    reps = 1 if a.check else a.reps
    print(
        f"sides {', '.join(sides)}: fedudp (torch {vers['fedudp_side']['torch']})"
        + (
            f" vs pfl {vers['pfl_side']['pfl']} (torch {vers['pfl_side']['torch']})"
            if "pfl_side" in vers
            else ""
        )
        + f"; {machine['cpu']}, {machine['cpus']} CPUs; "
        f"load average {load_start[0]:.2f}; {a.rounds} rounds per repetition (rounds 2..R "
        f"counted, mean), {reps} rep(s) per side, sides alternating, one thread each"
        + ("; CHECK run (final weights compared)" if a.check else ""),
        flush=True,
    )
    t_all = time.perf_counter()
    runs: list[dict] = []
    settings: list[dict] = []
    checks: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_pfl_") as tmp:
        tmpd = Path(tmp)
        for rpu in a.records_per_user:
            workload = tmpd / f"workload_rpu{rpu}.npz"
            prep_out = tmpd / f"workload_rpu{rpu}.json"
            measure(worker_cmd("prepare", a, rpu, workload, prep_out), tmpd / "prepare.log")
            info = json.loads(prep_out.read_text())
            settings.append(info)
            print(
                f"setting: {rpu} record(s) per user: {info['users']} users of "
                f"{info['user_sizes']} records over {info['owners']} owners, "
                f"{info['test_records']} test records, {info['parameters']} parameters",
                flush=True,
            )
            for rep in range(reps):
                for side in sides:
                    out = tmpd / f"{side}_{rpu}_{rep}.json"
                    fin = tmpd / f"{side}_{rpu}_final.npz" if a.check else None
                    res = measure(
                        worker_cmd(side, a, rpu, workload, out, fin), tmpd / f"{side}.log"
                    )
                    if side == "fedudp" and (res["data_sha"], res["init_sha"]) != (
                        info["data_sha"],
                        info["init_sha"],
                    ):
                        raise SystemExit(
                            "fedudp's run loaded other records or weights than the "
                            "workload file holds"
                        )
                    res["users_per_round"] = [int(u) for u in res["users_per_round"]]
                    res.update(records_per_user=rpu, rep=rep + 1, s_per_round=per_rep(res))
                    runs.append(res)
                    print(
                        f"  rpu={rpu} rep {rep + 1} {side:6s}: {res['s_per_round']:7.3f} s/round "
                        f"(rounds {' '.join(f'{s:.2f}' for s in res['round_seconds'])}), "
                        f"users/round {res['users_per_round'][-1]}, local steps/user "
                        f"{res['local_steps_per_user']['mean']:g}"
                        + (
                            f" (counted {res['local_steps_per_user']['counted']:g})"
                            if "counted" in res["local_steps_per_user"]
                            else ""
                        )
                        + f", acc "
                        f"{res['final_accuracy']:.4f}, peak RSS {res['ru_maxrss_mib']:.0f} MiB "
                        f"(rounds {res['sampled_peak_rss_rounds_mib']:.0f}), "
                        f"{res['max_processes']} process(es), {res['wall_seconds']:.0f} s",
                        flush=True,
                    )
            if a.check:
                sigma = a.noise_multiplier * a.clip * a.server_lr / info["users"]
                c = {"records_per_user": rpu, "noise_std_of_mean": sigma}
                # fedudp against pfl and plain (independent noise draws: a few sigma apart);
                # the batched floors against plain (the same noise draws: float rounding)
                pairs = [("fedudp", sd) for sd in ("pfl", "plain") if sd in sides]
                pairs += [("plain", sd) for sd in FLOORS if sd in sides and "plain" in sides]
                for ref, sd in pairs:
                    cp = compare_final(
                        tmpd / f"{ref}_{rpu}_final.npz",
                        tmpd / f"{sd}_{rpu}_final.npz",
                        workload,
                        sigma,
                    )
                    if sd == "pfl":  # the original keys
                        c.update(cp)
                    c[f"{ref}_vs_{sd}"] = {
                        "max_abs_diff": cp["max_abs_diff_fedudp_pfl"],
                        "max_abs_diff_in_noise_std": cp["max_abs_diff_in_noise_std"],
                        "max_abs_move_from_init": cp["max_abs_move_from_init"],
                    }
                    print(
                        f"  final weights: max |{ref} - {sd}| = "
                        f"{cp['max_abs_diff_fedudp_pfl']:.3g} = "
                        f"{cp['max_abs_diff_in_noise_std']:.3g} sigma (sigma = z C / users = "
                        f"{sigma:.3g}); max |{ref} - init| = {cp['max_abs_move_from_init']:.3g}",
                        flush=True,
                    )
                checks.append(c)
    wall = time.perf_counter() - t_all
    load_end = os.getloadavg()

    summary = []
    for rpu in a.records_per_user:
        row: dict = {"records_per_user": rpu}
        for side in sides:
            rs = [r for r in runs if r["records_per_user"] == rpu and r["side"] == side]
            per = [r["s_per_round"] for r in rs]
            row[side] = {
                "s_per_round": per,
                "min": min(per),
                "median": statistics.median(per),
                "peak_rss_mib_max": max(r["ru_maxrss_mib"] for r in rs),
                "peak_rss_mib_median": statistics.median(r["ru_maxrss_mib"] for r in rs),
                "sampled_peak_rss_rounds_mib_max": max(
                    r["sampled_peak_rss_rounds_mib"] for r in rs
                ),
                "hwm_before_rounds_mib_max": max(r["hwm_before_rounds_mib"] for r in rs),
                # the process's own peak before round 1 (VmHWM when the rounds start: for
                # fedudp, reading and standardizing the data), the loading column
                "max_processes": max(r["max_processes"] for r in rs),
                "users_per_round": sorted({u for r in rs for u in r["users_per_round"]}),
                "local_steps_per_user": rs[0]["local_steps_per_user"],
                "final_accuracy": [r["final_accuracy"] for r in rs],
            }
        if "pfl" in row:
            row["ratio_of_mins"] = row["pfl"]["min"] / row["fedudp"]["min"]
            row["ratio_of_medians"] = row["pfl"]["median"] / row["fedudp"]["median"]
        if "plain" in row:  # each side's seconds over the bare loop's
            for side in sides:
                row[side]["vs_plain_mins"] = row[side]["min"] / row["plain"]["min"]
                row[side]["vs_plain_medians"] = row[side]["median"] / row["plain"]["median"]
        summary.append(row)

    table = _table(summary, settings)
    print("\n" + table)
    print(
        f"\nwall time {wall:.0f} s; load average {load_start[0]:.2f} at the start, "
        f"{load_end[0]:.2f} at the end",
        flush=True,
    )
    if a.markdown:
        Path(a.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(a.markdown).write_text(table + "\n")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(
            json.dumps(
                {
                    "command": shlex.join(sys.argv),
                    "args": {
                        k: v
                        for k, v in vars(a).items()
                        if k not in ("worker", "out", "workload", "final_params")
                    },
                    "versions": vers,
                    "machine": machine,
                    "load_average_start": load_start,
                    "load_average_end": load_end,
                    "sides": list(sides),
                    "skipped_sides": skipped,
                    "wall_seconds": wall,
                    "settings": settings,
                    "checks": checks,
                    "summary": summary,
                    "runs": runs,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
