"""Hydra entry point: config -> federation -> engine -> outputs (ARCHITECTURE.md §6).

``fedudp method=joint_dp privacy.epsilon=1 -m partition.num_owners=4,16,64``. One call is
one run; each run writes to its Hydra output folder: ``config.yaml`` (resolved),
``metrics.jsonl`` (one line per round, appended as it happens), ``owners.csv``,
``ledger.json`` and ``summary.json``.
"""
from __future__ import annotations

import csv
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fedudp.aggregators import Sampling, build_aggregator  # noqa: E402
from fedudp.config import (Accounting, ConfigError, DatasetName, EngineName, RunConfig,  # noqa: E402
                           Unit, resolved_aggregator, validate)
from fedudp.core.billboard import Billboard  # noqa: E402
from fedudp.core.methods import method_spec  # noqa: E402
from fedudp.data.federation import build_federation  # noqa: E402
from fedudp.data.idx import check_available  # noqa: E402
from fedudp.models import build_model  # noqa: E402
from fedudp.privacy.accountant import ADJACENCY, Ledger  # noqa: E402

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "value") and not isinstance(x, (int, float, str)):
        return x.value
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    if isinstance(x, str) and hasattr(x, "value"):
        return x.value
    return x


def config_dict(cfg: RunConfig) -> dict:
    return _jsonable(asdict(cfg))


def estimator_report(aggregator, res) -> dict:
    """Failures as signals (issue 3): an unmet theoretical minimum number of users is a
    warning (privacy holds for any n), an AboveThreshold halt a clean stop at a round."""
    out: dict = {}
    need = getattr(aggregator, "min_users_required", None)
    if need is not None:
        n = aggregator.sampling.population
        out.update(min_users_met=bool(n >= need), min_users_required=int(need), units=int(n))
        if n < need:
            import warnings
            warnings.warn(f"aggregator={aggregator.name}: n={n} units is below the theoretical "
                          f"minimum {need} for its utility guarantee (privacy still holds)")
    if res.stop_reason == "halted":
        out["halted_at_round"] = int(res.rounds_completed)
    return out


def run_guarantee(spec, aggregator) -> str:
    """The method's guarantee, downgraded to heuristic when the aggregator's own accounting
    follows a paper's unproven constant (``privacy.accounting=paper``)."""
    if getattr(aggregator, "guarantee", None) == "heuristic":
        return "heuristic"
    return spec.guarantee


def make_ledger(cfg: RunConfig, spec, aggregator) -> Ledger:
    p = cfg.privacy
    private = spec.private
    notes = ["diagnostics (clipped fraction, cohort, failures) and owners.csv are simulator "
             "observations outside the DP release",
             "epsilon certifies the idealized mechanism; seeded randomness is a simulation"]
    if spec.feedback and spec.unit == Unit.user:
        notes.append("paper mode: shared vectors are computed at each owner's own personal "
                     "parameters (trained without noise on all its users), which the per-user "
                     "accounting ignores (ALGORITHMS.md §3.2 caveat): guarantee is heuristic")
    if Unit(p.unit) == Unit.record:
        notes.append("records_per_user=1: each user is one record, so user level is record level")
    unit = Unit(p.unit).value if private else None
    adjacency = getattr(aggregator, "adjacency", ADJACENCY)
    return Ledger(unit=unit, adjacency=adjacency if private else None,
                  accounting=Accounting(p.accounting).value if private else None,
                  guarantee=run_guarantee(spec, aggregator), mechanism=aggregator.name if aggregator else "none",
                  accountant=getattr(aggregator, "accountant",
                                     "dp_accounting.PLDAccountant (RDP cross-check)") if private else None,
                  delta=p.delta if private else None,
                  target_epsilon=p.epsilon if private else None, notes=notes)


def prepare(cfg: RunConfig, out: Path | None = None):
    """Federation, model, method spec, aggregator, ledger, billboard and engine of a validated
    config (what ``run`` drives; tests use it to look inside an engine)."""
    fed = build_federation(cfg)
    model = build_model(cfg, fed.input_shape, fed.num_classes)
    if cfg.engine_opts.float64:
        model = model.double()
        fed.x, fed.x_test = fed.x.double(), fed.x_test.double()
    for p_ in model.parameters():
        p_.requires_grad_(False)
    spec = method_spec(cfg, model)

    billboard = aggregator = None
    if spec.communicates:
        population = fed.num_owners if spec.unit == Unit.owner else fed.num_users
        sampling = Sampling(cfg.train.sampling_rate, population)
        dim = sum(p.numel() for k, p in model.named_parameters() if k in spec.shared)
        aggregator = build_aggregator(cfg, sampling, cfg.train.rounds, dim)
    ledger = make_ledger(cfg, spec, aggregator)
    if spec.communicates:
        params = dict(model.named_parameters())
        billboard = Billboard({k: params[k].detach() for k in spec.shared}, spec.shared,
                              aggregator, sampling, ledger, cfg.seed, cfg.train.server_lr,
                              cfg.train.shared_update.value if hasattr(cfg.train.shared_update, "value")
                              else str(cfg.train.shared_update),
                              cfg.privacy.epsilon if spec.private else None, cfg.privacy.delta)
        if spec.private and not billboard.within_budget():
            raise ConfigError(f"privacy.epsilon={cfg.privacy.epsilon}: even one round with noise "
                              f"multiplier {getattr(aggregator, 'noise_multiplier', None)} exceeds it")

    if EngineName(cfg.engine) == EngineName.flower:
        from fedudp.engines.flower import FlowerEngine  # issue 4
        engine = FlowerEngine(cfg, fed, model, spec, billboard, out)
    else:
        from fedudp.engines.local import LocalEngine
        engine = LocalEngine(cfg, fed, model, spec, billboard)
    return fed, model, spec, aggregator, ledger, billboard, engine


def run(cfg: RunConfig, out_dir: str | os.PathLike) -> dict:
    """One fedudp run; returns summary.json's content."""
    t_start = time.perf_counter()
    validate(cfg)
    if DatasetName(cfg.dataset.name) != DatasetName.synthetic:
        check_available(DatasetName(cfg.dataset.name).value, cfg.dataset.root, cfg.dataset.download)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.engine_opts.threads:
        torch.set_num_threads(cfg.engine_opts.threads)
    (out / "config.yaml").write_text(_to_yaml(config_dict(cfg)))

    fed, model, spec, aggregator, ledger, billboard, engine = prepare(cfg, out)

    metrics_path = out / "metrics.jsonl"
    metrics_path.write_text("")
    bar = _progress(cfg)

    def on_round(info: dict) -> None:
        with open(metrics_path, "a") as f:
            f.write(json.dumps(_jsonable(info)) + "\n")
        if bar is not None:
            bar.update(1)
            post = {"acc": info.get("accuracy_mean"), "eps": info.get("epsilon")}
            bar.set_postfix({k: f"{v:.3f}" for k, v in post.items() if v is not None})

    try:
        res = engine.run(on_round=on_round)
    finally:
        if bar is not None:
            bar.close()
    _write_owners(out / "owners.csv", fed, res)
    (out / "ledger.json").write_text(json.dumps(_jsonable(ledger.to_dict()), indent=2))
    sizes = np.diff(fed.test_offsets)
    from fedudp.engines.local import summarize
    summ = summarize(res.owner_accuracy, res.owner_loss, sizes)
    summary = {
        "method": cfg.method.value if hasattr(cfg.method, "value") else cfg.method,
        "aggregator": resolved_aggregator(cfg).value,
        "engine": EngineName(cfg.engine).value,
        "accuracy_mean": summ["accuracy_mean"], "accuracy_std": summ["accuracy_std"],
        "accuracy_weighted": summ["accuracy_weighted"], "loss": summ["loss"],
        "epsilon": ledger.epsilon if spec.private else None,
        "epsilon_rdp": ledger.entries[-1].epsilon_rdp if (spec.private and ledger.entries) else None,
        "target_epsilon": cfg.privacy.epsilon if spec.private else None,
        "delta": cfg.privacy.delta if spec.private else None,
        "unit": ledger.unit, "adjacency": ledger.adjacency, "accounting": ledger.accounting,
        "guarantee": run_guarantee(spec, aggregator) if spec.private else "none",
        "noise_multiplier": getattr(aggregator, "noise_multiplier", None) if spec.private else None,
        "rounds_completed": res.rounds_completed, "rounds_planned": cfg.train.rounds,
        "stop_reason": res.stop_reason,
        "num_owners": fed.num_owners, "num_users": fed.num_users, "num_records": fed.num_records,
        "shared_dim": billboard.dim if billboard is not None else 0,
        "seconds": time.perf_counter() - t_start,
    }
    summary.update(getattr(res, "extra", {}) or {})
    summary.update(estimator_report(aggregator, res))
    (out / "summary.json").write_text(json.dumps(_jsonable(summary), indent=2))
    return summary


def _write_owners(path: Path, fed, res) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["owner", "train_records", "users", "test_records", "accuracy", "loss", "classes"])
        for j in range(fed.num_owners):
            cls = " ".join(map(str, fed.owner_classes[j])) if fed.owner_classes is not None else ""
            w.writerow([j, int(fed.owner_sizes()[j]),
                        int(fed.owner_user_offsets[j + 1] - fed.owner_user_offsets[j]),
                        int(fed.test_offsets[j + 1] - fed.test_offsets[j]),
                        f"{res.owner_accuracy[j]:.6f}", f"{res.owner_loss[j]:.6f}", cls])


def _to_yaml(d: dict) -> str:
    from omegaconf import OmegaConf
    return OmegaConf.to_yaml(OmegaConf.create(d))


def _progress(cfg: RunConfig):
    if not cfg.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=cfg.train.rounds, desc=f"{_v(cfg.method)}", file=sys.stderr, leave=False)


def _v(x: Any) -> str:
    return x.value if hasattr(x, "value") else str(x)


def _hydra_main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    from fedudp.config import register

    register()

    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
    def _main(dcfg: DictConfig) -> float | None:
        cfg: RunConfig = OmegaConf.to_object(dcfg)
        try:
            summary = run(cfg, HydraConfig.get().runtime.output_dir)
        except (ConfigError, FileNotFoundError) as e:
            print(f"fedudp: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        acc = summary["accuracy_mean"]
        eps = summary["epsilon"]
        print(f"[{summary['method']}] accuracy {acc:.4f} ± {summary['accuracy_std']:.4f}"
              f"  epsilon {'n/a' if eps is None else f'{eps:.3f}'}"
              f"  rounds {summary['rounds_completed']}  ({summary['seconds']:.1f}s)")
        return acc

    _main()


def multirun_flag_first(argv: list[str]) -> list[str]:
    """Hydra's parser rejects overrides on both sides of ``-m``; move the flag to the front so
    that ``fedudp method=joint_dp -m partition.num_owners=4,16,64`` works as documented."""
    flags = [a for a in argv if a in ("-m", "--multirun")]
    return flags[:1] + [a for a in argv if a not in ("-m", "--multirun")]


def main() -> None:
    sys.argv[1:] = multirun_flag_first(sys.argv[1:])
    _hydra_main()


if __name__ == "__main__":
    main()
