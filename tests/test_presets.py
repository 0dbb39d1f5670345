"""Every preset under conf/experiment/ runs as shipped (``fedudp +experiment=<name>``).

The presets are discovered by glob, so a new one is covered without touching this file. Each is
composed with Hydra exactly as the CLI composes it, then:

* validated in full as shipped: ``run.prepare`` (the schema's checks, the estimator's and the
  algorithm's own checks, the calibration over the shipped schedule, the phases, the data at the
  shipped population);
* started through ``run.run`` (the CLI's path: output folder, metrics, ledger, summary) and
  stopped after ``ROUNDS`` rounds, as an interrupted run is.

Synthetic-data presets run exactly as shipped (same population, schedule and calibration; only
the first rounds are executed). Presets that read real MNIST / Fashion-MNIST IDX files read a
small generated dataset in the real IDX format instead (``conftest.tiny_mnist``); they are
validated as shipped on it, then started with fewer records and one local epoch (their shipped
rounds are one CNN DP-SGD pass over 10,000 records per epoch, minutes on two cores). Method,
aggregator, algorithm, estimator, privacy, partition and model settings and the schedule are
never overridden. Starting an IDX preset with more than ``SLOW_OWNERS`` owners (one DP-SGD step
per owner per round: huang_table2's 256 owners, ~35 s) is marked slow; its shipped config is
still validated in the default run.
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import tiny_mnist
from fedudp import build
from fedudp import run as run_module
from fedudp.config import RunConfig, register
from fedudp.data.readers import READERS
from formats import write_cifar10, write_cifar100, write_femnist, write_shakespeare
from fedudp.stopping import RunInterrupted
from fedudp.cli import CONF_DIR
from fedudp.run import prepare, run

PRESETS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
ROUNDS = 2  # rounds each preset is started for
IDX_TRAIN, IDX_TEST = 20_000, 2_000  # the generated IDX dataset (the presets take 10,000 records)
IDX_RECORDS = 128  # records an IDX preset is started with (at least one per owner)
SLOW_OWNERS = 64  # IDX presets with more owners are started under -m slow only


def compose_preset(name: str, *overrides: str) -> RunConfig:
    """The RunConfig ``fedudp +experiment=<name> <overrides>`` runs (``run.preflight``'s and
    Hydra's composition)."""
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_object(
            compose(config_name="config", overrides=[f"+experiment={name}", *overrides])
        )


def reads_idx(cfg: RunConfig) -> bool:
    return cfg.dataset.name in ("mnist", "fashion_mnist")


def reads_natural(cfg: RunConfig) -> bool:
    return READERS[cfg.dataset.name].natural


# the natural-user presets read small files written in their published formats (tests/formats.py)
NATURAL_WRITERS = {
    "femnist": lambda root: write_femnist(
        root, [5, 12, 3, 30, 8, 2, 17, 9, 4, 21, 6, 11, 7, 3, 14, 10, 5, 8, 25, 6]
    ),
    "shakespeare": lambda root: write_shakespeare(root, [6, 2, 14, 9, 3, 20, 5, 11, 7, 4]),
    "cifar10": lambda root: write_cifar10(root, per_batch=200, test=100),
    "cifar100": lambda root: write_cifar100(root, train=1000, test=100),
}


def start_overrides(cfg: RunConfig) -> list[str]:
    """What is shrunk to start a preset within the test's time: nothing for synthetic data; for
    IDX data fewer records (the same owners and records per user) and one local epoch."""
    if not reads_idx(cfg):
        return []
    records = max(IDX_RECORDS, cfg.partition.num_owners * cfg.partition.records_per_user)
    return [f"dataset.num_records={records}", "train.local_epochs=1"]


def stop_after(monkeypatch, rounds: int) -> None:
    """``run.run`` stops after ``rounds`` rounds, as on SIGINT (outputs written, stop_reason
    ``interrupted``)."""
    execute = run_module.execute

    def limited(p, on_round=None, *args, **kwargs):
        def hook(info: dict) -> None:
            if on_round is not None:
                on_round(info)
            if info["round"] >= rounds:
                raise RunInterrupted(signal.SIGINT)

        return execute(p, hook, *args, **kwargs)

    monkeypatch.setattr(run_module, "execute", limited)


@pytest.fixture(scope="module")
def idx_root(tmp_path_factory) -> Path:
    """A small MNIST-format IDX dataset; the folder holds the files directly, so it serves
    ``dataset.name=mnist`` and ``fashion_mnist`` alike (the loader also looks in root itself)."""
    return tiny_mnist(tmp_path_factory.mktemp("idx"), n_train=IDX_TRAIN, n_test=IDX_TEST) / "mnist"


def shipped_preset(name: str, request) -> tuple[RunConfig, list[str]]:
    """The preset as shipped (``progress=false`` aside) and the overrides that point an IDX
    preset at the generated dataset, or a natural-user preset at files generated in its format
    with the public numbers declared (the data's own, as the first run prints them)."""
    cfg = compose_preset(name, "progress=false")
    if reads_natural(cfg):
        root = request.getfixturevalue("tmp_path_factory").mktemp(name)
        NATURAL_WRITERS[cfg.dataset.name](root)
        data = ["progress=false", f"dataset.root={root}"]
        have = build.natural_numbers(build.natural_records(compose_preset(name, *data))[0])
        data += [f"public.{k}={have[k]}" for k in ("users", "owner_capacity", "records_per_user")]
        return compose_preset(name, *data), data
    if not reads_idx(cfg):
        return cfg, ["progress=false"]
    data = ["progress=false", f"dataset.root={request.getfixturevalue('idx_root')}"]
    return compose_preset(name, *data), data


def _preset_keys(name: str) -> tuple[object, object]:
    """(dataset.name, partition.num_owners) as the preset's YAML sets them (its ``defaults``
    presets first, then its own keys); None where it does not set one."""
    text = yaml.safe_load((Path(CONF_DIR) / "experiment" / f"{name}.yaml").read_text()) or {}
    dataset = owners = None
    for parent in text.get("defaults") or []:
        if parent != "_self_":
            dataset, owners = _preset_keys(str(parent))
    dataset = (text.get("dataset") or {}).get("name", dataset)
    owners = (text.get("partition") or {}).get("num_owners", owners)
    return dataset, owners


def _slow(name: str) -> bool:
    """An IDX preset with many owners: its started run still does one CNN DP-SGD step per owner
    per round (~20 s a round at 256 owners on two cores). Read from the preset's YAML at
    collection (composing every preset there cost each xdist worker ~4 s), the schema's
    defaults for what it does not set; ``test_preset_is_valid_as_shipped`` checks the answer
    against the composed config."""
    try:
        dataset, owners = _preset_keys(name)
    except (OSError, yaml.YAMLError):  # the test reports it
        return False
    base = RunConfig()
    dataset = base.dataset.name if dataset is None else dataset
    owners = base.partition.num_owners if owners is None else owners
    if not isinstance(owners, int):  # an interpolation: not read here
        return False
    return str(getattr(dataset, "value", dataset)) in ("mnist", "fashion_mnist") and (
        owners > SLOW_OWNERS
    )


def test_presets_are_discovered():
    assert len(PRESETS) >= 10 and {"levy_alg4", "asi_alg4", "huang_table1"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_valid_as_shipped(name, request):
    """The shipped config, prepared in full: schema, estimator and algorithm checks, the
    calibration over the shipped schedule, the phases, the data at the shipped population."""
    cfg, _ = shipped_preset(name, request)
    assert _slow(name) == (reads_idx(cfg) and cfg.partition.num_owners > SLOW_OWNERS)
    p = prepare(cfg)
    if reads_natural(cfg):
        assert p.fed.num_users == cfg.public.users
    else:
        assert p.fed.num_records == cfg.dataset.num_records
    assert p.fed.num_owners == cfg.partition.num_owners and p.fed.num_users > 0


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if _slow(n) else n for n in PRESETS]
)
def test_preset_starts(name, tmp_path, monkeypatch, request):
    """Started the CLI's way (``run.run``) and stopped after ROUNDS rounds: synthetic presets as
    shipped, IDX presets with fewer records and one local epoch."""
    shipped, data = shipped_preset(name, request)
    shrink = start_overrides(shipped)
    cfg = compose_preset(name, *data, *shrink) if shrink else shipped
    for key in ("method", "aggregator", "algorithm", "estimator", "privacy", "partition", "model"):
        assert getattr(cfg, key) == getattr(shipped, key), key  # only data volume and E shrunk
    assert cfg.train.rounds == shipped.train.rounds > ROUNDS
    stop_after(monkeypatch, ROUNDS)
    s = run(cfg, tmp_path)
    assert s["stop_reason"] == "interrupted" and s["rounds_completed"] == ROUNDS, s["stop_message"]
    assert s["method"] == cfg.method.value and s["num_owners"] == cfg.partition.num_owners
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == list(range(1, ROUNDS + 1))
    if s["target_epsilon"] is not None:  # a private method
        assert 0 < s["epsilon"] <= s["target_epsilon"] * (1 + 1e-6)
        ledger = json.loads((tmp_path / "ledger.json").read_text())
        assert len(ledger["entries"]) == ROUNDS
    if cfg.algorithm.name != "none":
        assert s["algorithm"]["name"] == cfg.algorithm.name
    evaluated = [m["accuracy_mean"] for m in metrics if "accuracy_mean" in m]
    assert all(math.isfinite(a) for a in evaluated)


def test_levy_alg4_preset_takes_the_papers_phases_capped_at_one_user():
    """levy_alg4's ``algorithm.phases: null``: the paper's P = ceil(log2(G n sqrt(m) ε/(σ d))) is
    12 at the preset's n = 4000 (n/2^12 < 1 user), so P = floor(log2 n) = 11; where the paper's
    P fits (or is explicit), it is unchanged."""
    from fedudp.algorithms.levy_alg4 import default_phases

    cfg = compose_preset("levy_alg4", "progress=false")
    assert cfg.algorithm.phases is None
    p = prepare(cfg)
    algo = p.algorithm.summary
    assert (algo["phases_paper"], algo["phases"]) == (12, 11)
    assert [ph.units.size for ph in p.algorithm.plan.phases] == [4000 // 2**t for t in range(1, 12)]
    assert any("capped at P = 11" in n for n in p.ledger.notes)
    assert default_phases(5, 4000, 30) == 5 and default_phases(12, 4096, 30) == 12
    assert default_phases(12, 4000, 8) == 8 and default_phases(3, 1, 30) == 1
