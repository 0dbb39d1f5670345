"""A run's folder: whether it holds this very configuration's run (finished, resumable, or
another run's), its output files, its checkpointer and a resumed run's start
(docs/usage.md#checkpoint-and-resume). Plain values in: the configuration is compared as a
dict (``fedudp.config.config_dict``), never read field by field."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedudp import tracking
from fedudp.build import Prepared, RunSettings
from fedudp.config import (
    ConfigError,
    RunConfig,
    config_dict,
    jsonable,
    with_schema_defaults,
)
from fedudp.privacy.accountant import LedgerEntry
from fedudp.protocol import checkpoint as checkpoints
from fedudp.protocol import ledger_file

if TYPE_CHECKING:
    from fedudp.billboard.rounds import RoundsResult
    from fedudp.data.federation import Federation

__all__ = [
    "OUTPUT_FILES",
    "same_config",
    "saved_config",
    "comparable",
    "config_differences",
    "finished_summary",
    "output_folder",
    "start_outputs",
    "identity",
    "same_identity",
    "checkpointer",
    "check_resumable",
    "resume_from",
    "releases_after",
    "ledger_head",
    "write_owners",
    "to_yaml",
]


def same_config(out: Path, cfg: RunConfig) -> bool | None:
    """Whether ``out/config.yaml`` is this config (what ``comparable`` drops aside: how a run
    is shown and scheduled, the engine included, not the experiment, though a thread count, a
    GPU or the engine can move float rounding); None if there is none (an unreadable one counts
    as another run's).

    Parameters
    ----------
    out : Path
        A run folder.
    cfg : RunConfig
        This run's configuration.

    Returns
    -------
    bool or None
        True: the same experiment; False: another (or unreadable); None: no config.yaml.
    """
    path = out / "config.yaml"
    if not path.is_file():
        return None
    try:
        theirs = saved_config(path)
    except Exception:  # noqa: BLE001
        return False
    return comparable(theirs) == comparable(config_dict(cfg))


def saved_config(path: Path) -> dict:
    """A run's saved config.yaml with the current schema's defaults for keys it predates
    (``config.with_schema_defaults``).

    Parameters
    ----------
    path : Path
        The config.yaml file.

    Returns
    -------
    dict
        The config as plain values.
    """
    from omegaconf import OmegaConf

    return with_schema_defaults(OmegaConf.load(path))


def comparable(d: Any) -> Any:
    """A config dict without what changes how a run is shown, scheduled, checkpointed, tracked
    or resumed, not what it computes (``progress``, ``engine`` and every ``engine_opts`` key but
    ``float64``, ``checkpoint``, ``tracking``, ``resume``): a run checkpointed on one engine
    resumes on the other (a cluster's run on one machine), as the engines give the same numbers
    (tests/engines), a thread count, a GPU or another engine moving float rounding at most.

    Parameters
    ----------
    d : Any
        A config dict (anything else comes back as it is).

    Returns
    -------
    Any
        A copy without those keys.
    """
    if not isinstance(d, dict):
        return d
    drop = ("progress", "checkpoint", "tracking", "resume", "engine")
    d = {k: v for k, v in d.items() if k not in drop}
    if isinstance(d.get("engine_opts"), dict):  # all but float64 (equivalence mode)
        d["engine_opts"] = {k: v for k, v in d["engine_opts"].items() if k == "float64"}
    return d


def config_differences(out: Path, cfg: RunConfig) -> list[str]:
    """Dotted keys where ``out/config.yaml`` and ``cfg`` differ (``comparable`` parts).

    Parameters
    ----------
    out : Path
        A run folder holding config.yaml.
    cfg : RunConfig
        This run's configuration.

    Returns
    -------
    list of str
        The differing keys, sorted (``train.rounds``, ...).
    """
    theirs = comparable(saved_config(out / "config.yaml"))
    mine = comparable(config_dict(cfg))

    def diff(a: Any, b: Any, prefix: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [
                k
                for key in sorted(set(a) | set(b))
                for k in diff(a.get(key), b.get(key), f"{prefix}{key}.")
            ]
        return [] if a == b else [prefix.rstrip(".")]

    return diff(theirs, mine, "")


def finished_summary(cfg: RunConfig, out_dir: str | Path) -> dict | None:
    """summary.json of a run of this very config that already finished in ``out_dir`` (a
    re-run sweep skips it), else None. ``progress`` does not count; a run that stopped
    ``interrupted`` or ``failed`` has not finished.

    Parameters
    ----------
    cfg : RunConfig
        This run's configuration.
    out_dir : str or Path
        The run folder.

    Returns
    -------
    dict or None
        summary.json's content, or None (no finished run of this config, unreadable JSON).
    """
    out = Path(out_dir)
    if not (out / "summary.json").is_file() or not same_config(out, cfg):
        return None
    try:
        summary = json.loads((out / "summary.json").read_text())
    except json.JSONDecodeError:
        return None
    return None if summary.get("stop_reason") in ("interrupted", "failed") else summary


OUTPUT_FILES = (
    "config.yaml",
    "metrics.jsonl",
    "ledger.jsonl",
    "ledger.json",
    "owners.csv",
    "summary.json",
)


def output_folder(out_dir: str | Path, cfg: RunConfig) -> Path:
    """The run's folder, writable. A folder holding another configuration's run is refused (runs
    are never mixed); an unfinished run of this very configuration is cleared and redone.

    Parameters
    ----------
    out_dir : str or Path
        The run folder (created if needed).
    cfg : RunConfig
        This run's configuration.

    Returns
    -------
    Path
        The folder.

    Raises
    ------
    ConfigError
        The folder holds another run, or cannot be written.
    """
    out = Path(out_dir)
    same = same_config(out, cfg)
    if same is False:
        raise ConfigError(
            f"{out}: holds the outputs of another run (its config.yaml differs); "
            "choose another output folder (hydra.run.dir=...)"
        )
    for name in OUTPUT_FILES if same else ():
        (out / name).unlink(missing_ok=True)
    if same:
        checkpoints.remove_all(out)
        tracking.clear(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".fedudp_write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{out}: cannot write the run's outputs there ({e.strerror or e})"
        ) from None
    return out


def ledger_head(p: Prepared) -> dict:
    """ledger.jsonl's head line: the ledger without its entries and what they give.

    Parameters
    ----------
    p : Prepared
        The prepared run (its ledger).

    Returns
    -------
    dict
        The head line's content.
    """
    return ledger_file.head(p.ledger)


def start_outputs(
    cfg: RunConfig,
    out_dir: str | Path,
    resume: str | None,
    p: Prepared,
    metrics_path: Path,
) -> tuple[Path, checkpoints.Checkpointer, ledger_file.LedgerFile, int | None]:
    """The run folder, its checkpointer, the durable writer of ledger.jsonl (the billboard's
    ledger sink) and the round a resumed run starts from. A new run (``resume`` unset) writes
    its config.yaml, an empty metrics.jsonl and ledger.jsonl's head line; a resumed one
    continues from its newest usable checkpoint (``resume_from``).

    Parameters
    ----------
    cfg : RunConfig
        The run's configuration.
    out_dir : str or Path
        The run folder.
    resume : str or None
        The folder being resumed (set: continue there).
    p : Prepared
        The prepared run.
    metrics_path : Path
        metrics.jsonl (emptied for a new run).

    Returns
    -------
    tuple of (Path, Checkpointer, LedgerFile, int or None)
        The folder, its checkpointer, ledger.jsonl's writer, the round resumed from (None: new).

    Raises
    ------
    ConfigError
        ``output_folder``'s or ``resume_from``'s errors.
    """
    ledger_path = Path(out_dir) / "ledger.jsonl"
    if resume:
        out = Path(out_dir)
        ckpt, written = resume_from(out, cfg, p)
        resumed = ckpt.resumed
        assert resumed is not None  # resume_from sets the checkpoint it resumes from
        return out, ckpt, ledger_file.LedgerFile(ledger_path, written), int(resumed["round"])
    out = output_folder(out_dir, cfg)
    (out / "config.yaml").write_text(to_yaml(config_dict(cfg)))
    metrics_path.write_text("")
    ledger_file.write(ledger_path, ledger_head(p), [])
    return out, checkpointer(out, cfg, p.settings), ledger_file.LedgerFile(ledger_path), None


def identity(cfg: RunConfig) -> str:
    """What a checkpoint must have been written by: this configuration (``comparable``).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    str
        Its comparable part as JSON (keys sorted).
    """
    return json.dumps(comparable(config_dict(cfg)), sort_keys=True)


def same_identity(cfg: RunConfig) -> Callable[[str], bool]:
    """A checkpoint's identity read through the current schema's defaults (as ``saved_config``
    reads an old config.yaml) equals this configuration's.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    Callable[[str], bool]
        Whether a checkpoint's identity (``identity``'s JSON) is this configuration.
    """
    mine = comparable(config_dict(cfg))

    def same(identity: str) -> bool:
        from omegaconf import OmegaConf

        try:
            merged = OmegaConf.merge(
                OmegaConf.structured(RunConfig), OmegaConf.create(json.loads(identity))
            )
            theirs = jsonable(OmegaConf.to_container(merged, enum_to_str=True))
        except Exception:  # noqa: BLE001  (a key the schema no longer has: not this run)
            return False
        return comparable(theirs) == mine

    return same


def checkpointer(out: Path, cfg: RunConfig, s: RunSettings) -> checkpoints.Checkpointer:
    """The run's checkpointer in ``out``: every ``checkpoint.every``-th round, the newest
    ``checkpoint.keep`` kept (``s``: the run's settings), written by this configuration.

    Parameters
    ----------
    out : Path
        The run folder.
    cfg : RunConfig
        The configuration (the checkpoints' identity).
    s : RunSettings
        The run's settings.

    Returns
    -------
    Checkpointer
        The checkpointer.
    """
    return checkpoints.Checkpointer(
        out,
        s.checkpoint_every,
        s.checkpoint_keep,
        identity(cfg),
        same_identity=same_identity(cfg),
    )


def check_resumable(out: Path, cfg: RunConfig) -> None:
    """``resume=<folder>`` must name a run folder of this very configuration.

    Parameters
    ----------
    out : Path
        The folder to resume.
    cfg : RunConfig
        This run's configuration.

    Raises
    ------
    ConfigError
        No config.yaml there, or another configuration's (the differing keys named).
    """
    if not (out / "config.yaml").is_file():
        raise ConfigError(f"resume={out}: not a fedudp run folder (no config.yaml there)")
    if not same_config(out, cfg):
        keys = config_differences(out, cfg) if (out / "config.yaml").is_file() else []
        raise ConfigError(
            f"resume={out}: that run's configuration differs from this one"
            + (f" in {', '.join(keys[:5])}" if keys else "")
            + f"; resume with the same overrides (see {out / 'config.yaml'})"
        )


def resume_from(out: Path, cfg: RunConfig, p: Prepared) -> tuple[checkpoints.Checkpointer, int]:
    """Load the newest usable checkpoint in ``out`` (reporting each unusable one on stderr),
    cut metrics.jsonl back to its round and account for every release ledger.jsonl holds
    after it (``releases_after``); returns the checkpointer and the number of entries
    ledger.jsonl then holds.

    Parameters
    ----------
    out : Path
        The run folder.
    cfg : RunConfig
        The configuration.
    p : Prepared
        The prepared run (its ledger and billboard).

    Returns
    -------
    tuple of (Checkpointer, int)
        The checkpointer (its ``resumed`` state set) and ledger.jsonl's entry count.

    Raises
    ------
    ConfigError
        No usable checkpoint, or releases that cannot be accounted.
    """
    ckpt = checkpointer(out, cfg, p.settings)
    state = ckpt.load_latest()
    if state is None:
        raise ConfigError(
            f"resume={out}: no usable checkpoint (ckpt-*.pt) in that folder; "
            "run again without resume= to start it afresh"
        )
    history = json.loads(state["history"])
    entries = releases_after(out, state, p)
    lines = [json.dumps(jsonable(h)) for h in history]
    checkpoints.atomic_write(out / "metrics.jsonl", "".join(x + "\n" for x in lines).encode())
    ledger_file.write(out / "ledger.jsonl", ledger_head(p), entries)
    for name in ("ledger.json", "owners.csv", "summary.json"):  # rewritten at the end
        (out / name).unlink(missing_ok=True)
    return ckpt, len(entries)


def releases_after(out: Path, state: dict, p: Prepared) -> list[LedgerEntry]:
    """The ledger a run resumed from checkpoint ``state`` starts with. Every release the
    killed run made is in its ledger.jsonl (durable before it left), also those after the
    checkpoint, whose rounds are computed again: a secure run's (fresh noise and sample) are
    each composed, marked ``superseded`` (the checkpoint's billboard recomposes them, so the
    budget check and ε count them; the run may stop earlier) and the head's
    ``extra.resumes`` says how many; a seeded run's are handed to the billboard, which
    composes any that its re-done round does not release again identically
    (``Billboard.rereleases``). ledger.jsonl is then the checkpoint's entries and these.

    Parameters
    ----------
    out : Path
        The run folder (its ledger.jsonl).
    state : dict
        The checkpoint's state (its ``billboard`` entries and ``round``; updated in place).
    p : Prepared
        The prepared run (its ledger's ``extra.resumes`` set).

    Returns
    -------
    list of LedgerEntry
        The checkpoint's entries and the releases after it that are composed.

    Raises
    ------
    ConfigError
        ledger.jsonl does not agree with the checkpoint.
    """
    board = state["billboard"]
    if board is None:
        return []
    entries = [LedgerEntry(**e) for e in board["entries"]]
    secure = p.billboard is not None and p.billboard.randomness.is_secure
    try:
        got = ledger_file.after_checkpoint(out / "ledger.jsonl", entries, state["round"], secure)
        old_head, _ = ledger_file.read(out / "ledger.jsonl")
    except ValueError as e:
        raise ConfigError(f"resume={out}: {e}; its releases cannot be accounted") from None
    resumes = list((old_head.get("extra") or {}).get("resumes", []))
    if got.record is not None:
        resumes.append(got.record)
        checkpoints.warn(f"resume={out}: {got.record['note']}")
    if resumes:
        p.ledger.extra["resumes"] = resumes
    board["entries"] = board["entries"] + [checkpoints.plain(asdict(e)) for e in got.composed]
    board["rereleases"] = [checkpoints.plain(asdict(e)) for e in got.rereleases]
    return entries + got.composed


def write_owners(path: Path, fed: Federation, res: RoundsResult) -> None:
    """Write owners.csv: one row per owner (records, users, test records, accuracy, loss).

    Parameters
    ----------
    path : Path
        The file written.
    fed : Federation
        The federation (each owner's counts and classes).
    res : RoundsResult
        The round loop's result (each owner's final accuracy and loss).
    """
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            ["owner", "train_records", "users", "test_records", "accuracy", "loss", "classes"]
        )
        for j in range(fed.num_owners):
            cls = " ".join(map(str, fed.owner_classes[j])) if fed.owner_classes is not None else ""
            w.writerow(
                [
                    j,
                    int(fed.owner_sizes()[j]),
                    int(fed.owner_user_offsets[j + 1] - fed.owner_user_offsets[j]),
                    int(fed.test_offsets[j + 1] - fed.test_offsets[j]),
                    f"{res.owner_accuracy[j]:.6f}",
                    f"{res.owner_loss[j]:.6f}",
                    cls,
                ]
            )


def to_yaml(d: dict) -> str:
    """A config dict as YAML (config.yaml's text).

    Parameters
    ----------
    d : dict
        The config (``config_dict``).

    Returns
    -------
    str
        The YAML.
    """
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(d))
