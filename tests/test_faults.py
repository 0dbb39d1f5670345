"""The fault matrix: SIGKILL / SIGINT then resume, damaged checkpoints, bad data.

The bar for resume is bit for bit: a run killed after round k (k drawn from a seeded RNG) and
resumed ends with the same shared and personal parameters, ledger, metrics (timings aside)
and summary (wall time aside) as the uninterrupted run. ``tests/kill_run.py`` is the process
that SIGKILLs itself at a chosen point; the Flower cases are marked slow.
"""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import interrupt_after, tiny_cfg, tiny_mnist, write_idx
from fedudp.config import ConfigError, DataError
from fedudp.protocol import checkpoint
from fedudp.flower.ray_watchdog import ray_descendants
from fedudp.run import run

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
ROUNDS = 6
# joint_dp with Poisson sampling: personal parameters, sampling and noise all in play
# finished runs keep their checkpoints here (checkpoint.keep_after_finish=all): the tests compare
# the final checkpoint of a resumed run with that of the uninterrupted one
KW = {
    "train.rounds": ROUNDS,
    "train.sampling_rate": 0.5,
    "privacy.noise_multiplier": 2.0,
    "privacy.epsilon": 50.0,
    "checkpoint.keep_after_finish": "all",
    # one torch thread in every process (the killed child, the resumed and reference runs in
    # the test worker, whose thread count an earlier test may have set): a seeded re-release is
    # bit-identical only at the same thread count, and the ledger compares its SHA-256
    "engine_opts.threads": 1,
}
TIMINGS = ("seconds",)


def _cfg(**kw):
    return tiny_cfg("joint_dp", **{k.replace(".", "__"): v for k, v in {**KW, **kw}.items()})


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _final_state(folder: Path, rounds: int = ROUNDS) -> dict:
    """The checkpoint written after the last round (checkpoint.every=1)."""
    return checkpoint.load_file(checkpoint.ckpt_path(folder, rounds))


def assert_same_run(a: Path, b: Path, rounds: int = ROUNDS) -> None:
    """Two run folders hold the same run, bit for bit (wall-clock timings aside)."""
    for name in ("ledger.jsonl", "ledger.json", "owners.csv", "config.yaml"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ma, mb = _lines(a / "metrics.jsonl"), _lines(b / "metrics.jsonl")
    assert [m["round"] for m in mb] == list(range(1, rounds + 1))
    strip = [{k: v for k, v in m.items() if k not in TIMINGS} for m in ma]
    assert strip == [{k: v for k, v in m.items() if k not in TIMINGS} for m in mb]
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    facts = ("seconds", "ray_address", "flower_worker_pids")  # of the process, not the run
    assert {k: v for k, v in sa.items() if k not in facts} == {
        k: v for k, v in sb.items() if k not in facts
    }
    assert sb["stop_reason"] == "completed" and sb["epsilon"] == sa["epsilon"]
    fa, fb = _final_state(a, rounds), _final_state(b, rounds)
    assert (fa["billboard"] is None) == (fb["billboard"] is None)
    if fa["billboard"] is not None:
        assert torch.equal(fa["billboard"]["u"], fb["billboard"]["u"])
    if "personal" in fa["transport"]:  # engine=local
        pa, pb = fa["transport"]["personal"], fb["transport"]["personal"]
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    else:  # engine=flower: the owners' own files
        assert fa["transport"] == fb["transport"]
        for j in fa["transport"]["owners_saved"]:
            pa, pb = (
                checkpoint.load_file(checkpoint.owner_file(checkpoint.owners_dir(d, rounds), j))[
                    "personal"
                ]
                for d in (a, b)
            )
            assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("reference")
    s = run(_cfg(), out)
    assert s["stop_reason"] == "completed" and s["rounds_completed"] == ROUNDS
    return out


def _kill(out: Path, round_: int, phase: str) -> None:
    args = [f"{k}={json.dumps(v)}" for k, v in KW.items()]
    p = subprocess.run(
        [sys.executable, str(HERE / "kill_run.py"), str(out), str(round_), phase, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]


_interrupt_after = interrupt_after


def test_sigkill_after_a_random_round_then_resume_is_the_uninterrupted_run(reference, tmp_path):
    rng = np.random.default_rng(2026)
    k = int(rng.integers(2, ROUNDS))  # the kill point, drawn seeded
    phase = str(rng.choice(["before_checkpoint", "after_checkpoint", "mid_checkpoint"]))
    _kill(tmp_path, k, phase)
    assert not (tmp_path / "summary.json").exists()  # killed: no handler ran
    assert checkpoint.rounds_on_disk(tmp_path)[0] == (k if phase == "after_checkpoint" else k - 1)
    s = run(_cfg(resume=str(tmp_path)), "ignored")
    assert s["rounds_completed"] == ROUNDS
    assert_same_run(reference, tmp_path)
    assert not list(tmp_path.glob(".ckpt-*.tmp*")) or phase == "mid_checkpoint"
    assert checkpoint.rounds_on_disk(tmp_path) == [ROUNDS, ROUNDS - 1]  # the last two kept


def test_sigint_gives_interrupted_with_all_files_and_resumes_exactly(
    reference, tmp_path, monkeypatch
):
    _interrupt_after(monkeypatch, 3)
    s = run(_cfg(), tmp_path)
    monkeypatch.undo()
    assert s["stop_reason"] == "interrupted" and s["rounds_completed"] == 3
    for name in ("summary.json", "ledger.json", "ledger.jsonl", "metrics.jsonl", "owners.csv"):
        assert (tmp_path / name).is_file()
    assert [m["round"] for m in _lines(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    again = run(_cfg(resume=str(tmp_path)), "ignored")
    assert again["rounds_completed"] == ROUNDS and "skipped" not in again
    assert_same_run(reference, tmp_path)
    assert run(_cfg(resume=str(tmp_path)), "ignored")["skipped"]  # finished: not redone


@pytest.mark.parametrize(
    "method,kw",
    [
        ("per_silo", {}),
        ("fedavg", {}),
        (
            "full_dp",
            {"privacy.unit": "owner", "privacy.noise_multiplier": 2.0, "privacy.epsilon": 50.0},
        ),
        (
            "full_dp",
            {
                "privacy.placement": "local_dpsgd",
                "privacy.noise_multiplier": 2.0,
                "privacy.epsilon": 50.0,
            },
        ),
        # adaptive clipping: the clip norm is state carried from one round to the next
        (
            "full_dp",
            {
                "privacy.clip_policy": "adaptive",
                "privacy.clip": 0.05,
                "privacy.noise_multiplier": 2.0,
                "privacy.epsilon": 50.0,
            },
        ),
        # DP-FTRL: the tree's held node noises are state, interrupted in the middle of a tree
        (
            "full_dp",
            {
                "aggregator": "dp_ftrl_tree",
                "train.sampling_rate": 0.25,
                "privacy.noise_multiplier": 2.0,
                "privacy.epsilon": 50.0,
            },
        ),
        # owner-side DP-SGD's adaptive clip is the billboard's state
        (
            "full_dp",
            {
                "privacy.placement": "local_dpsgd",
                "privacy.clip_policy": "adaptive",
                "privacy.clip": 0.05,
                "privacy.noise_multiplier": 2.0,
                "privacy.epsilon": 50.0,
            },
        ),
        # banded matrix factorization: the last b - 1 noise vectors are state, cut mid-cycle
        (
            "full_dp",
            {
                "aggregator": "dp_mf_banded",
                "train.sampling_rate": 0.25,
                "privacy.noise_multiplier": 2.0,
                "privacy.epsilon": 50.0,
            },
        ),
        # distributed DP with dropouts: each round's event is its survivors' (issue 51)
        (
            "joint_dp",
            {
                "privacy.placement": "distributed",
                "train.min_owners": 2,
                "train.owner_dropout": 0.3,
            },
        ),
    ],
)
def test_every_method_resumes_exactly(tmp_path, monkeypatch, method, kw):
    """No billboard (per_silo), a non-private one (fedavg), owner-level units, and per-owner
    DP-SGD accounting (a Parallel event: one accountant per owner)."""

    def cfg(**more):
        return tiny_cfg(
            method,
            **{
                k.replace(".", "__"): v
                for k, v in {
                    "train.rounds": 4,
                    "checkpoint.keep_after_finish": "all",
                    **kw,
                    **more,
                }.items()
            },
        )

    run(cfg(), tmp_path / "ref")
    _interrupt_after(monkeypatch, 2)
    assert run(cfg(), tmp_path / "run")["stop_reason"] == "interrupted"
    monkeypatch.undo()
    assert run(cfg(resume=str(tmp_path / "run")), "ignored")["rounds_completed"] == 4
    assert_same_run(tmp_path / "ref", tmp_path / "run", 4)


def _interrupted_at_4(tmp_path, monkeypatch) -> Path:
    _interrupt_after(monkeypatch, 4)
    assert run(_cfg(), tmp_path)["stop_reason"] == "interrupted"
    monkeypatch.undo()
    assert checkpoint.rounds_on_disk(tmp_path) == [4, 3]
    return tmp_path


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_reported_and_the_previous_one_used(
    reference, tmp_path, monkeypatch, capsys, damage
):
    out = _interrupted_at_4(tmp_path, monkeypatch)
    bad = checkpoint.ckpt_path(out, 4)
    data = bytearray(bad.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    bad.write_bytes(
        bytes(
            data[: len(data) // 3] if damage == "truncate" else b"" if damage == "empty" else data
        )
    )
    capsys.readouterr()
    s = run(_cfg(resume=str(out)), "ignored")
    err = capsys.readouterr().err
    assert f"checkpoint {bad} is unusable" in err
    assert s["rounds_completed"] == ROUNDS
    assert_same_run(reference, out)


def test_no_usable_checkpoint_is_a_one_line_error(tmp_path, monkeypatch):
    overrides = {
        "method": "fedavg",
        "dataset.num_records": 400,
        "partition.num_owners": 4,
        "train.rounds": 6,
        "progress": False,
    }
    from fedudp.config import config_from_overrides

    _interrupt_after(monkeypatch, 2)
    assert run(config_from_overrides(overrides), tmp_path)["stop_reason"] == "interrupted"
    monkeypatch.undo()
    for r in checkpoint.rounds_on_disk(tmp_path):
        checkpoint.ckpt_path(tmp_path, r).write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="no usable checkpoint"):
        run(config_from_overrides({**overrides, "resume": str(tmp_path)}), "ignored")
    args = [f"{k}={v}" for k, v in overrides.items()] + [f"resume={tmp_path}"]
    p = subprocess.run(
        [sys.executable, "-m", "fedudp.run", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("fedudp: error: ")]
    assert len(errors) == 1 and "no usable checkpoint" in errors[0] and str(tmp_path) in errors[0]
    assert sum("ckpt-000002.pt is unusable" in ln for ln in p.stderr.splitlines()) == 1
    assert (tmp_path / ".hydra").is_dir()  # Hydra's folder is the resumed run's own


def test_resume_refuses_another_configuration_and_a_non_run_folder(tmp_path, monkeypatch):
    out = _interrupted_at_4(tmp_path / "run", monkeypatch)
    with pytest.raises(ConfigError, match=r"configuration differs from this one in train\.lr"):
        run(_cfg(resume=str(out), **{"train.lr": 0.1}), "ignored")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a fedudp run folder"):
        run(_cfg(resume=str(tmp_path / "empty")), "ignored")
    s = run(_cfg(resume=str(out), **{"checkpoint.every": 2}), "ignored")  # cadence may change
    assert s["rounds_completed"] == ROUNDS


def test_a_checkpoint_written_before_a_key_existed_still_resumes():
    """A checkpoint's identity lacking a key added since (at its default) is the same run; one
    with another value is not."""
    from fedudp.run_folder import identity as _identity
    from fedudp.run_folder import same_identity as _same_identity

    cfg = _cfg()
    old = json.loads(_identity(cfg))
    del old["privacy"]["group_privacy"]  # as written before the key existed
    assert _same_identity(cfg)(json.dumps(old))
    old["train"]["lr"] = 0.123
    assert not _same_identity(cfg)(json.dumps(old))
    old["train"]["no_such_key"] = 1
    assert not _same_identity(cfg)(json.dumps(old))


def test_checkpoint_every_zero_writes_none_and_a_fresh_run_clears_old_ones(tmp_path, monkeypatch):
    out = _interrupted_at_4(tmp_path, monkeypatch)
    s = run(_cfg(**{"checkpoint.every": 0}), out)  # same run, not resumed: started afresh
    assert s["rounds_completed"] == ROUNDS and checkpoint.rounds_on_disk(out) == []


def test_outlier_removal_state_survives_a_checkpoint():
    """The one stateful estimator: its AboveThreshold (noisy threshold, queries, RNG) is saved."""
    from fedudp.protocol.contributions import Sampling
    from fedudp.aggregators.outlier import OutlierRemovalAggregator
    from fedudp.randomness import Purpose, torch_generator

    def make():
        return OutlierRemovalAggregator(0.5, 1.0, 0.1, Sampling(1.0, 200), 1.0, 10, 1e-6, 1)

    G = torch.randn(200, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.01
    a = make()
    a.estimate(G, rng=torch_generator(0, Purpose.NOISE, 1))
    state = checkpoint.load_bytes(checkpoint.dump({"agg": a.checkpoint_state()}))["agg"]
    b = make()
    b.restore_checkpoint_state(state)
    ra = a.estimate(G, rng=torch_generator(0, Purpose.NOISE, 2))
    rb = b.estimate(G, rng=torch_generator(0, Purpose.NOISE, 2))
    assert torch.equal(ra.mean, rb.mean) and a.at.queries == b.at.queries == 2
    assert a.at.rng.get_state().equal(b.at.rng.get_state())


# -- bad data: each case a one-line DataError naming the file, before any round --------------
def _bad(root: Path, case: str) -> str:
    d = root / "mnist"
    if case == "wrong_magic":
        f = d / "t10k-images-idx3-ubyte"
        raw = bytearray(f.read_bytes())
        raw[2:4] = b"\x09\x99"
        f.write_bytes(bytes(raw))
        return "t10k-images-idx3-ubyte: not an IDX image/label file (magic"
    if case == "truncated_idx":
        f = d / "t10k-images-idx3-ubyte"
        f.write_bytes(f.read_bytes()[:-100])
        return "t10k-images-idx3-ubyte: IDX image payload"
    if case == "truncated_gz":
        f = d / "train-images-idx3-ubyte.gz"
        f.write_bytes(f.read_bytes()[:-200])
        return "train-images-idx3-ubyte.gz: "
    if case == "labels_shorter":
        write_idx(d / "t10k-labels-idx1-ubyte", np.zeros(150, dtype=np.uint8), gz=False)
        return "t10k-labels-idx1-ubyte: 150 labels for 200 images"
    if case == "label_out_of_range":
        with gzip.open(d / "train-labels-idx1-ubyte.gz", "rb") as fh:
            y = np.frombuffer(fh.read(), dtype=np.uint8, offset=8).copy()
        y[5] = 12
        write_idx(d / "train-labels-idx1-ubyte", y)
        return r"train-labels-idx1-ubyte.gz: label 12 at index 5 is outside [0, 10)"
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case", ["wrong_magic", "truncated_idx", "truncated_gz", "labels_shorter", "label_out_of_range"]
)
@pytest.mark.parametrize("scheme", ["paper_classes", "iid"])
def test_bad_data_is_a_one_line_error_naming_the_file(tmp_path, case, scheme):
    root = tiny_mnist(tmp_path / "data", n_train=600, n_test=200)
    expected = _bad(root, case)
    cfg = tiny_cfg(
        "fedavg",
        **{
            "dataset__name": "mnist",
            "dataset__root": str(root),
            "dataset__num_records": 400,
            "partition__scheme": scheme,
        },
    )
    with pytest.raises(DataError) as e:
        run(cfg, tmp_path / "out")
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_bad_data_on_the_command_line(tmp_path):
    root = tiny_mnist(tmp_path / "data", n_train=600, n_test=200)
    _bad(root, "truncated_gz")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedudp.run",
            "method=fedavg",
            "dataset.name=mnist",
            f"dataset.root={root}",
            "dataset.num_records=400",
            "partition.num_owners=4",
            f"hydra.run.dir={tmp_path / 'out'}",
            "progress=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert (
        len(lines) == 1
        and lines[0].startswith("fedudp: error: ")
        and "train-images-idx3-ubyte.gz" in lines[0]
    )


# -- engine=flower (slow: Ray starts in each process) ------------------------------------------
FLOWER = {
    "engine": "flower",
    "dataset.num_records": 120,
    "dataset.features": 20,
    "engine_opts.chunk_records": 1,
    "engine_opts.threads": 1,
    "engine_opts.float64": True,
    "train.rounds": 4,
}
ENV = dict(
    os.environ,
    PYTHONUNBUFFERED="1",
    OMP_NUM_THREADS="1",
    MKL_NUM_THREADS="1",
    FLWR_TELEMETRY_ENABLED="0",
    RAY_USAGE_STATS_ENABLED="0",
)


def _run_watching(
    args: list[str], stop=None, timeout: float = 600
) -> tuple[subprocess.Popen, dict, str]:
    """Run ``args`` (its own session), recording its Ray processes; ``stop(proc)`` may act on it
    (it returns True once it has). Returns (process, {pid: start time} seen, stderr)."""
    proc = subprocess.Popen(
        args,
        cwd=ROOT,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    seen: dict[int, int] = {}
    import threading

    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    t_end, acted = time.time() + timeout, False
    while proc.poll() is None and time.time() < t_end:
        seen.update(ray_descendants(proc.pid))
        if stop is not None and not acted:
            acted = stop(proc)
        time.sleep(0.2)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    reader.join(10)
    return proc, seen, "".join(err)


def _assert_ray_gone(seen: dict[int, int], within_s: float = 30.0) -> None:
    """Every Ray process the run started has exited within ``within_s`` seconds."""
    from fedudp.flower.ray_watchdog import _alive

    assert seen, "the run started no Ray process?"
    t_end = time.time() + within_s
    while time.time() < t_end and any(_alive(p, t) for p, t in seen.items()):
        time.sleep(0.5)
    left = [p for p, t in seen.items() if _alive(p, t)]
    assert not left, f"Ray processes still alive {within_s:.0f} s after the run: {left}"


def _kill_args(out: Path, round_: int, phase: str, **kw) -> list[str]:
    pairs = [f"{k}={json.dumps(v)}" for k, v in {**KW, **FLOWER, **kw}.items()]
    return [sys.executable, str(HERE / "kill_run.py"), str(out), str(round_), phase, *pairs]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_flower_sigkill_after_a_random_round_then_resume_is_the_uninterrupted_run(tmp_path):
    rounds = FLOWER["train.rounds"]
    ref, _, err = _run_watching(_kill_args(tmp_path / "ref", 0, "none"))
    assert ref.returncode == 0, err[-3000:]
    rng = np.random.default_rng(2027)
    k = int(rng.integers(2, rounds))
    phase = str(rng.choice(["before_checkpoint", "after_checkpoint"]))
    killed, seen, err = _run_watching(_kill_args(tmp_path / "run", k, phase))
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    _assert_ray_gone(seen)  # SIGKILL: the watchdog ends Ray's processes
    again, seen, err = _run_watching(
        _kill_args(tmp_path / "run", 0, "none", resume=str(tmp_path / "run"))
    )
    assert again.returncode == 0, err[-3000:]
    assert_same_run(tmp_path / "ref", tmp_path / "run", rounds)
    _assert_ray_gone(seen)


def _same_experiment(a: Path, b: Path) -> None:
    """Two run folders of one experiment on two engines: the same rounds, accuracy, ε, ledger
    events and final shared parameters (equivalence mode: to float rounding; the released
    bytes' hash, of the sums' float order, aside)."""
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    for k in ("stop_reason", "rounds_completed", "accuracy_mean", "epsilon", "releases_made"):
        assert sa[k] == sb[k], k
    la, lb = (
        [{k: v for k, v in e.items() if k != "release_sha256"} for e in _lines(d / "ledger.jsonl")]
        for d in (a, b)
    )
    assert la == lb
    ua, ub = (_final_state(d, sa["rounds_completed"])["billboard"]["u"] for d in (a, b))
    assert torch.allclose(ua.double(), ub.double(), rtol=0, atol=1e-10)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("first,then", [("local", "flower"), ("flower", "local")])
def test_a_run_checkpointed_on_one_engine_resumes_on_the_other(tmp_path, first, then):
    """A cluster's run resumed on one machine, and back (issue 52): the checkpoint's personal
    state is the local engine's stacked rows or the Flower owners' own files, either read by
    the other engine; the resumed run is the uninterrupted one."""
    rounds = FLOWER["train.rounds"]
    ref, _, err = _run_watching(_kill_args(tmp_path / "ref", 0, "none", engine="local"))
    assert ref.returncode == 0, err[-3000:]
    killed, _, err = _run_watching(
        _kill_args(tmp_path / "run", 2, "after_checkpoint", engine=first)
    )
    assert killed.returncode == -signal.SIGKILL, err[-3000:]
    again, _, err = _run_watching(
        _kill_args(tmp_path / "run", 0, "none", engine=then, resume=str(tmp_path / "run"))
    )
    assert again.returncode == 0, err[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["engine"] == then
    assert [m["round"] for m in _lines(tmp_path / "run" / "metrics.jsonl")] == list(
        range(1, rounds + 1)
    )
    _same_experiment(tmp_path / "ref", tmp_path / "run")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "sig,code,group", [(signal.SIGINT, 130, True), (signal.SIGTERM, 143, False)]
)
def test_flower_signal_stops_within_seconds_with_every_file_and_no_ray_left(
    tmp_path, sig, code, group
):
    """SIGINT as a terminal sends it (the whole process group: Ray's processes block SIGINT);
    SIGTERM as ``kill``, ``timeout`` or a container stop send it (the driver). A SIGTERM to the
    whole group also kills Ray's own processes at once, and Ray's core worker then aborts the
    driver: no summary.json then, but metrics, ledger and checkpoints of the completed rounds
    are there and the run resumes (README, Checkpoint and resume)."""
    metrics, sent = tmp_path / "metrics.jsonl", {}

    def stop(proc) -> bool:
        if metrics.is_file() and len(_lines(metrics)) >= 2:
            sent["t"] = time.time()
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
            return True
        return False

    args = [
        sys.executable,
        "-m",
        "fedudp.run",
        "engine=flower",
        "method=joint_dp",
        "train.rounds=500",
        "dataset.num_records=120",
        "dataset.features=20",
        "partition.num_owners=4",
        "privacy.noise_multiplier=5",
        "privacy.epsilon=100",
        f"hydra.run.dir={tmp_path}",
        "progress=false",
    ]
    proc, seen, err = _run_watching(args, stop)
    assert "t" in sent, err[-3000:]
    assert time.time() - sent["t"] < 20 and proc.returncode == code, err[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["stop_reason"] == "interrupted" and s["signal"] == sig
    assert [m["round"] for m in _lines(metrics)] == list(range(1, s["rounds_completed"] + 1))
    led = _lines(tmp_path / "ledger.jsonl")[1:]
    assert (
        len(led)
        == s["rounds_completed"]
        == len(json.loads((tmp_path / "ledger.json").read_text())["entries"])
    )
    assert (tmp_path / "owners.csv").is_file()
    assert [ln for ln in err.splitlines() if ln.startswith("fedudp: interrupted: ")]
    _assert_ray_gone(seen)


# -- load: estimators that need the cohort's rows fit in memory or refuse before work ---------
def test_rows_estimator_refuses_before_work_when_its_rows_do_not_fit(tmp_path, monkeypatch):
    from fedudp.aggregators import memory

    assert memory.cohort_rows(1.0, 60_000) == 60_000
    assert 0.01 * 60_000 < memory.cohort_rows(0.01, 60_000) < 0.02 * 60_000
    # full MNIST, paper CNN, full_dp: 60,000 rows of 44,628 coordinates (float32), and their
    # copy while the owners assemble them (the estimators read them in float64 chunks)
    assert memory.rows_bytes(60_000, 44_628, 4) >= 2 * 60_000 * 44_628 * 4
    monkeypatch.setattr(memory, "available_bytes", lambda: 64 * 1024)
    cfg = tiny_cfg("full_dp", aggregator="winsorized", **{"train__rounds": 1})
    with pytest.raises(
        ConfigError, match=r"aggregator=winsorized: its per-unit rows need about .* GiB"
    ):
        run(cfg, tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()
    run(tiny_cfg("full_dp", **{"train__rounds": 1}), tmp_path / "sums")  # gaussian: sums, fits
