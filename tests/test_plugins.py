"""Your own estimator, data reader and training algorithm, each from one module of yours, used
from the ``fedudp`` command line through ``plugins=[...]`` (docs/architecture.md#plugins).

The three modules are written to a temporary folder on ``sys.path`` (as a user's package
would be installed); each registers itself when imported, and nothing in fedudp names them.
Two command-line runs (in this process, ``fedudp.cli.main``) finish: the reader's federation
with the estimator, and the algorithm on a planned federation with the same estimator. The
release used them: the ledger names the estimator, its noise is the one its option asked for,
the users are the file's, the algorithm's summary is in summary.json."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from fedudp import cli
from fedudp.aggregators import REGISTRY, GaussianAggregator, Sampling
from fedudp.algorithms import ALGORITHMS
from fedudp.config import config_from_overrides
from fedudp.data.readers import READERS
from fedudp.errors import ConfigError

ESTIMATOR = '''
"""A clip + Gaussian whose noise multiplier is ``inflate`` times the calibrated one."""
import dp_accounting
import torch

from fedudp.aggregators import Aggregate, Option, register
from fedudp.aggregators.base import ClippedSumAggregator
from fedudp.aggregators.plain_values import calibrate


@register
class InflatedGaussian(ClippedSumAggregator):
    name = "plugin_inflated_gaussian"
    inputs = ("clip", "epsilon", "delta", "rounds", "sampling")
    options = (Option("inflate", 1.0, float, help="noise multiplier factor (>= 1)"),)

    def __init__(self, clip, noise_multiplier, sampling):
        self.clip, self.noise_multiplier, self.sampling = clip, noise_multiplier, sampling

    @classmethod
    def calibrated(cls, *, clip, epsilon, delta, rounds, sampling, inflate):
        event = lambda z: dp_accounting.PoissonSampledDpEvent(
            sampling.rate, dp_accounting.GaussianDpEvent(z)
        )
        return cls(clip, inflate * calibrate(event, epsilon, delta, rounds), sampling)

    def release(self, c, *, rng):
        noise = torch.randn(c.total.shape, generator=rng, dtype=torch.float64)
        mean = (c.total.to(torch.float64) + self.noise_std * noise) / self.sampling.expected_cohort
        return Aggregate(mean=mean.to(c.total.dtype), users_used=c.count, diagnostics={})

    def dp_event(self):
        return dp_accounting.PoissonSampledDpEvent(
            self.sampling.rate, dp_accounting.GaussianDpEvent(self.noise_multiplier)
        )
'''

READER = '''
"""Records from a text file: one line per record, ``user label f0 f1 f2 f3``."""
import numpy as np

from fedudp.data.readers import register
from fedudp.data.records import from_arrays
from fedudp.errors import ConfigError


def read(request):
    if not request.path:
        raise ConfigError("dataset.path: dataset.name=plugin_lines reads a file; set it")
    rows = np.loadtxt(request.path, ndmin=2)
    user, y, x = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64), rows[:, 2:]
    return from_arrays(x.astype(np.float32), y, user, classes=request.classes,
                       source=request.path), None


register("plugin_lines", read, inputs=lambda request: ((4,), 3, False))
'''

ALGORITHM = '''
"""Full-cohort gradient steps of a fixed size, released by the plugin's estimator."""
import numpy as np

from fedudp.aggregators import Sampling
from fedudp.algorithms import Requirements, Setup, register
from fedudp.algorithms.schedule import AlgorithmPlan, Phase

REQUIRES = Requirements(methods=("full_dp",), aggregator="plugin_inflated_gaussian")


def setup(ctx):
    n = ctx.n_users
    sampling = Sampling(1.0, n)
    agg = ctx.estimator("plugin_inflated_gaussian", sampling, ctx.rounds)
    step = ctx.params.step_size or 0.5
    plan = AlgorithmPlan(
        [Phase(ctx.rounds, agg, step, radius=ctx.params.radius)],
        n,
        False,
        sampler=lambda round_: np.ones(n, dtype=bool),
    )
    return Setup(agg, plan, sampling, {"step": step, "users": n}, ["plugin_full_steps: q = 1"])


register("plugin_full_steps", REQUIRES, setup)
'''


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """The three modules on sys.path, forgotten (and unregistered) afterwards."""
    folder = tmp_path / "mine"
    folder.mkdir()
    names = {"my_estimator": ESTIMATOR, "my_reader": READER, "my_algorithm": ALGORITHM}
    for name, text in names.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(folder))
    yield folder
    for name in names:
        sys.modules.pop(name, None)
    REGISTRY.remove("plugin_inflated_gaussian")
    READERS.remove("plugin_lines")
    ALGORITHMS.remove("plugin_full_steps")


def fedudp_cli(monkeypatch, out: Path, *args: str) -> dict:
    """``fedudp <args>`` in this process; the run folder's summary."""
    argv = ["fedudp", *args, f"hydra.run.dir={out}", "progress=false"]
    monkeypatch.setattr(sys, "argv", argv)
    cli.main()
    return json.loads((out / "summary.json").read_text())


def test_an_estimator_and_a_reader_of_ones_own_run_from_the_cli(
    user_modules, tmp_path, monkeypatch
):
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(24), 2)  # 24 users of 2 records
    lines = np.column_stack([users, users % 3, rng.normal(size=(48, 4))])
    data = tmp_path / "records.txt"
    np.savetxt(data, lines)
    assert "plugin_lines" not in READERS  # nothing registered before the run imports them

    s = fedudp_cli(
        monkeypatch,
        tmp_path / "natural",
        "plugins=[my_estimator,my_reader]",
        "dataset.name=plugin_lines",
        f"dataset.path={data}",
        "partition.num_owners=4",
        "public.users=24",
        "public.owner_capacity=24",
        "public.records_per_user=2",
        "method=full_dp",
        "aggregator=plugin_inflated_gaussian",
        "+estimator.inflate=2.0",
        "train.rounds=2",
        "privacy.epsilon=2.0",
    )
    assert s["stop_reason"] == "completed" and s["rounds_completed"] == 2
    ledger = json.loads((tmp_path / "natural" / "ledger.json").read_text())
    assert ledger["mechanism"] == "plugin_inflated_gaussian"
    # the reader's users, and the inputs it declares for itself
    public = ledger["extra"]["public"]
    assert public["input_shape"] == [4] and public["classes"] == 3
    assert (s["num_users"], s["num_owners"]) == (24, 4) and s["dataset"] == "plugin_lines"
    # the option reached the estimator: twice the noise of the same calibration
    plain = GaussianAggregator.calibrated(
        clip=1.0, epsilon=2.0, delta=1e-5, rounds=2, sampling=Sampling(1.0, 24)
    )
    assert OmegaConf.load(tmp_path / "natural" / "config.yaml").estimator.inflate == 2.0
    assert s["noise_multiplier"] == pytest.approx(2 * plain.noise_multiplier, rel=1e-6)


def test_an_algorithm_of_ones_own_runs_from_the_cli_with_ones_own_estimator(
    user_modules, tmp_path, monkeypatch
):
    assert "plugin_full_steps" not in ALGORITHMS
    s = fedudp_cli(
        monkeypatch,
        tmp_path / "algorithm",
        "plugins=[my_estimator,my_algorithm]",
        "algorithm.name=plugin_full_steps",
        "aggregator=plugin_inflated_gaussian",
        "method=full_dp",
        "train.shared_update=gradient",
        "model.name=linear",
        "dataset.num_records=64",
        "partition.num_owners=4",
        "train.rounds=2",
    )
    assert s["stop_reason"] == "completed" and s["rounds_completed"] == 2
    ledger = json.loads((tmp_path / "algorithm" / "ledger.json").read_text())
    assert ledger["mechanism"] == "plugin_inflated_gaussian"
    assert ledger["extra"]["algorithm"] == {"name": "plugin_full_steps", "step": 0.5, "users": 64}


def test_a_plugin_that_cannot_be_imported_is_one_line_naming_the_key():
    cfg = config_from_overrides({"plugins": ["no_such_module_of_mine"], "progress": False})
    from fedudp import build

    with pytest.raises(ConfigError, match=r"^plugins: no module 'no_such_module_of_mine'"):
        build.check(cfg)


def test_unregistered_names_list_the_registries_choices():
    from fedudp import build

    for key, value in (
        ("dataset.name", "nonesuch"),
        ("algorithm.name", "nonesuch"),
        ("model.name", "nonesuch"),
        ("aggregator", "nonesuch"),
    ):
        with pytest.raises(ConfigError) as info:
            build.check(config_from_overrides({key: value}))
        msg = str(info.value)
        assert msg.startswith(f"{key}: no ") and "available:" in msg, msg
    with pytest.raises(ConfigError, match=r"^dataset\.name: .*cifar10.*synthetic"):
        build.check(config_from_overrides({"dataset.name": "nonesuch"}))
    with pytest.raises(ConfigError, match=r"^estimator\.nonesuch: no registered estimator"):
        build.check(config_from_overrides({"estimator.nonesuch": 1.0}))


def test_an_installed_entry_point_is_loaded_before_the_config_is_checked(user_modules, monkeypatch):
    """A package's ``fedudp.plugins`` entry point registers its reader with no ``plugins`` key
    (the installed metadata is stood in for: ``importlib.metadata.entry_points``)."""
    import importlib.metadata

    from fedudp import build, plugins

    ep = importlib.metadata.EntryPoint("mine", "my_reader", plugins.GROUP)
    seen = []

    def entry_points(*, group):
        seen.append(group)
        return [ep] if group == plugins.GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(plugins, "_entry_points_loaded", False)
    assert "plugin_lines" not in READERS
    cfg = config_from_overrides({"dataset.name": "plugin_lines", "dataset.path": "x.txt"})
    build.check(cfg)  # validate loads the entry points first: the name is known
    assert seen == [plugins.GROUP] and "plugin_lines" in READERS
    assert build.input_spec(cfg) == ((4,), 3, False)  # the inputs the reader declares
