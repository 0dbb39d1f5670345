"""The Python entry point: ``fedudp.simulate``.

    import fedudp
    res = fedudp.simulate({"method": "joint_dp", "train.rounds": 3, "partition.num_owners": 8})
    res.epsilon, res.epsilon_kind, res.history[-1]["accuracy_mean"], res.shared["shared.weight"]

``simulate`` takes a ``RunConfig`` or a mapping of dotted config keys (the command line's
``key=value`` overrides, as Python values), validates it (a ``ConfigError`` naming the key),
runs it on the configured engine and returns a ``SimulationResult``: the per-round history, the
ledger, ε and what kind of number it is, the final shared parameters and each owner's personal
parameters. With ``out=<folder>`` it also writes the run folder the command line writes
(config.yaml, metrics.jsonl, ledger.jsonl, ledger.json, owners.csv, summary.json, checkpoints)
and, with ``{"tracking": "mlflow"}`` or ``"tensorboard"``, logs the run there too
(docs/tracking.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedudp.config import ConfigError, RunConfig, config_from_overrides
from fedudp.privacy.labels import epsilon_kind

if TYPE_CHECKING:  # not imported at run time: dp_accounting is slow to import
    from fedudp.privacy.accountant import Ledger


@dataclass
class SimulationResult:
    """What one simulated run produced (returned by ``simulate``).

    Attributes
    ----------
    config : RunConfig
        The resolved configuration the run used.
    stop_reason : str
        ``completed``, ``budget`` (the next release would exceed ε), ``halted`` (outlier
        removal's AboveThreshold), ``diverged`` or ``interrupted``.
    rounds_completed : int
        Rounds run to the end (each released once).
    history : list of dict
        One dict per round, as the lines of ``metrics.jsonl``: loss, accuracy (mean, std,
        weighted over owners), ε so far, seconds, cohort size, users used, ...
    ledger : Ledger or dict
        Every release with its event, noise and ε so far; a run finished before (read back from
        its folder) gives ``ledger.json``'s dict.
    epsilon : float or None
        ε spent at the ledger's δ; None without DP.
    epsilon_kind : str or None
        ``certified`` (a proven bound), ``heuristic`` (``privacy.accounting=paper``) or None
        (no DP).
    delta : float or None
        The ledger's δ.
    shared : dict of str to torch.Tensor
        The final shared parameters (None for a run read back).
    personal : dict of str to torch.Tensor
        Each owner's final personal parameters, stacked over owners (``[owners, ...]``).
    owner_accuracy : numpy.ndarray
        Each owner's final test accuracy on its own data with its own personal parameters.
    summary : dict
        ``summary.json``'s content.
    out : Path or None
        The run folder, when one was written (``out=``).
    """

    config: RunConfig
    stop_reason: str  # completed | budget | halted | diverged | interrupted
    rounds_completed: int
    history: list[dict]  # one dict per round (metrics.jsonl's lines)
    ledger: Ledger | dict[str, Any]  # the Ledger (every release); ledger.json read back
    # (a dict) for a run finished before
    epsilon: float | None  # ε spent at the ledger's δ; None without DP
    epsilon_kind: str | None  # certified | heuristic | None (no DP)
    delta: float | None
    # the final shared parameters; None when read back from a finished run's folder
    shared: dict[str, torch.Tensor] | None
    # each owner's personal parameters, [owners, ...]; None when read back
    personal: dict[str, torch.Tensor] | None
    owner_accuracy: np.ndarray  # final test accuracy of each owner
    summary: dict = field(default_factory=dict)  # summary.json's content
    out: Path | None = None  # the run folder, when one was written

    @property
    def accuracy(self) -> float | None:
        """Mean over owners of the final test accuracy (``summary["accuracy_mean"]``)."""
        return self.summary.get("accuracy_mean")


def _config(config: RunConfig | Mapping[str, Any] | None) -> RunConfig:
    if config is None:
        return config_from_overrides({"progress": False})
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, Mapping):
        return config_from_overrides({"progress": False, **dict(config)})
    raise TypeError(
        f"simulate: config must be a RunConfig or a mapping of dotted keys "
        f"(e.g. {{'train.rounds': 3}}), got {type(config).__name__}"
    )


def simulate(
    config: RunConfig | Mapping[str, Any] | None = None,
    *,
    out: str | Path | None = None,
    model: Any = None,
    records: Any = None,
) -> SimulationResult:
    """Run one simulation and return what it produced, in memory.

    The run ``fedudp key=value ...`` makes, by the same runner (``fedudp.run.run_with_result``):
    the config checked once before any work; the history, ledger, ε and parameters come back.

    Parameters
    ----------
    config : RunConfig or Mapping[str, Any] or None
        A ``RunConfig``, or a mapping of dotted keys over the defaults
        (``{"method": "fedavg", "train.lr": 0.1}``); None: the defaults.
    out : str or Path or None
        A folder to write the run's files into (``config.yaml``, ``metrics.jsonl``,
        ``ledger.json``, ``summary.json``, ...), as the command line does; None: nothing is
        written. A folder that already holds a finished run of this very config is not run
        again: its summary and history are read back and the parameters are None.
    model : torch.nn.Module or None
        Your own model (copied; its initial parameters are the run's; ``model.personal``
        patterns name joint DP's personal layers); ``engine=local``.
    records : Records or tuple of Records or None
        Your own federation in memory (``dataset.name=memory``, docs/your-data.md): a
        ``fedudp.Records`` (``fedudp.from_arrays(x, y, user, owner)``) or a (train, test) pair.

    Returns
    -------
    SimulationResult
        The per-round history, the ledger, ε and what kind of number it is, the final shared
        parameters and each owner's personal parameters.

    Raises
    ------
    ConfigError
        A bad key or value (named), an unreachable (ε, δ), or ``tracking`` without ``out``;
        before any round.
    TypeError
        ``config`` is neither a ``RunConfig`` nor a mapping.

    Examples
    --------
    ```python
    import fedudp

    res = fedudp.simulate({"method": "joint_dp", "privacy.epsilon": 1.0,
                           "train.rounds": 3, "partition.num_owners": 8,
                           "dataset.num_records": 800})
    print(f"epsilon {res.epsilon:.3f} ({res.epsilon_kind})")  # epsilon 1.000 (certified)
    ```
    """
    from fedudp.run import run_with_result

    if records is not None and not isinstance(config, RunConfig):
        # records given: the in-memory data set, unless the mapping names another (refused)
        config = {"dataset.name": "memory", **dict(config or {})}
    cfg = _config(config)
    # the runner fedudp.run.run uses: one check of the config, one prepared run (out=None: in
    # memory, no file)
    summary, res, p, folder = run_with_result(cfg, out, model_object=model, records=records)
    if res is None or p is None:  # finished before: read back what the folder holds
        assert folder is not None  # (only a run folder holds a finished run)
        return _read_back(cfg, summary, folder)
    return SimulationResult(
        cfg,
        res.stop_reason,
        res.rounds_completed,
        list(res.history),
        p.ledger,
        summary["epsilon"],
        epsilon_kind(summary),
        summary.get("delta"),
        *(dict(res.shared), dict(res.personal), np.asarray(res.owner_accuracy)),
        summary,
        folder,
    )


def _read_back(cfg: RunConfig, summary: dict, folder: Path) -> SimulationResult:
    """The result of a run that had finished in ``folder`` before: its history, ledger and
    summary read back, no parameters."""
    import json

    history = [
        json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]
    ledger = json.loads((folder / "ledger.json").read_text())
    return SimulationResult(
        cfg,
        summary["stop_reason"],
        summary["rounds_completed"],
        history,
        ledger,
        summary["epsilon"],
        epsilon_kind(summary),
        summary.get("delta"),
        None,
        None,
        np.array([]),
        summary,
        folder,
    )


__all__ = ["simulate", "SimulationResult", "RunConfig", "ConfigError", "config_from_overrides"]
