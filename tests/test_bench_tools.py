"""The benchmarks' measuring tools: ``scripts/benchmarks/proctree.py`` (memory and CPU time of a process
tree) and ``scripts/benchmarks/plot_bench_flower.py`` (the figure of ``bench_flower.py --json``), and
``bench_flower.py``'s refusal of a side it does not know, before any run starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))

BUSY = (
    "import subprocess, sys, time\n"
    "def spin(s):\n"
    "    t = time.process_time()\n"
    "    while time.process_time() - t < s:\n"
    "        pass\n"
    "spin(0.6)\n"
    "subprocess.run([sys.executable, '-c', 'import time\\nt = time.process_time()\\n"
    "while time.process_time() - t < 0.6: pass\\ntime.sleep(0.5)'])\n"
)


def test_session_sample_reads_the_cpu_seconds_of_every_process_of_the_tree():
    """A parent that spins 0.6 CPU seconds, then a child that spins 0.6 more and sleeps: the
    samples (largest reading per pid) hold both processes and about 1.2 CPU seconds, a process
    that has ended but is not yet reaped adds CPU time but no memory, and a process outside the
    session is not read."""
    from proctree import session_sample

    proc = subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
    cpu: dict[int, float] = {}
    most = 0
    while proc.poll() is None:
        rss, count, by_pid = session_sample(proc.pid)
        if not by_pid:  # it ended between poll() and the read (a loaded machine): poll again
            continue
        # a zombie (ended, not yet reaped) is read for CPU but has no memory and is not counted
        assert count <= len(by_pid) and (rss > 0) == (count > 0)
        most = max(most, count)
        for pid, sec in by_pid.items():
            cpu[pid] = max(cpu.get(pid, 0.0), sec)
        time.sleep(0.05)
    assert most == 2 and len(cpu) == 2 and proc.pid in cpu
    assert 1.0 <= sum(cpu.values()) <= 2.5
    assert session_sample(proc.pid) == (0, 0, {})  # gone: nothing left to read


def test_session_sample_reads_an_unreaped_process_for_cpu_but_not_memory():
    """A process that has exited but is not yet reaped (a zombie) gives its CPU time and
    neither a count nor RSS: the state a loaded machine shows between a child's exit and its
    parent's wait."""
    from proctree import session_sample

    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    stat = Path(f"/proc/{proc.pid}/stat")
    deadline = time.time() + 30
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.time() < deadline, "the child did not exit"
        time.sleep(0.01)
    rss, count, by_pid = session_sample(proc.pid)
    assert (rss, count) == (0, 0) and list(by_pid) == [proc.pid] and by_pid[proc.pid] >= 0.0
    proc.wait()
    assert session_sample(proc.pid) == (0, 0, {})


def test_plot_of_bench_flower_results(tmp_path):
    rows = [
        {"n": 512, "config": c, "min": m, "median": m * 1.05, "busy_cores": b, "pinned_cpus": None}
        for c, m, b in [("plain", 16.0, 1.5), ("local@2:fedavg:none", 1.8, 2.0)]
    ]
    res = tmp_path / "r.json"
    res.write_text(json.dumps(rows))
    out = tmp_path / "f.png"
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmarks" / "plot_bench_flower.py"),
            str(res),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmarks" / "plot_bench_flower.py"),
            str(bad),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1] == (
        f"plot_bench_flower.py: error: {bad} is not a bench_flower.py --json file; run "
        "scripts/benchmarks/bench_flower.py with --json first"
    )


@pytest.mark.parametrize("config", ["local@0:fedavg:none", "fedudp@2:fedavg:none"])
def test_bench_flower_refuses_an_unknown_side_before_running(config):
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "benchmarks" / "bench_flower.py"),
            "--configs",
            config,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"bench_flower.py: error: --configs {config}: expected plain[@C]")


def _bench_gpu(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "benchmarks" / "bench_gpu.py"), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_bench_gpu_help_runs():
    p = _bench_gpu("--help")
    assert p.returncode == 0 and "--cases" in p.stdout and "winsorized" in p.stdout


def test_bench_gpu_refuses_an_unknown_case_before_running():
    p = _bench_gpu("--cases", "cnn512,foo")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("bench_gpu.py: error: --cases cnn512,foo")


def test_bench_gpu_without_cuda_says_so_in_one_line_and_exits_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    p = _bench_gpu("--reps", "1")
    assert p.returncode == 2
    out = p.stdout.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("no CUDA device: ")
