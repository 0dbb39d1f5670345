"""The run-config contract of ``fedudp.flower`` (docs/flower-apps.md#the-run-config-contract).

Every ``fedudp.*`` key a Flower app's run config (``[tool.flwr.app.config]`` of its
``pyproject.toml``, ``flwr run --run-config``) may carry, with its type, its default, whether the
app must declare it and what it means, is one ``RunKey`` in ``KEYS``; nothing else defines them.
``docs/flower-apps.md``'s table is ``markdown_table()`` (``python -m fedudp.flower.contract
table`` prints it; a test checks the docs against it).

* ``checked(run_config)``: the wrapper's side (``UserLevelDP.from_run_config``): an unknown
  ``fedudp.*`` key, a value of the wrong type, a missing required key and a number of training
  rounds that disagrees between ``num-server-rounds`` and ``fedudp.train.rounds`` are each a
  ``RunConfigError`` naming the key, before any calibration.
* ``check_app(app_dir, overrides)``: before ``flwr run``. Flower refuses a ``--run-config``
  override of a key the app does not declare with a bare ``[code: 15] Invalid run
  configuration.`` (its SuperLink logs the key; the CLI does not print it); this names the key
  and the line to add (``python -m fedudp.flower.contract check . --run-config "..."``).

Standard library only at import (flwr, the builder and the estimators are imported where used).
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "RunKey",
    "KEYS",
    "RunConfigError",
    "checked",
    "rounds_of",
    "check_app",
    "markdown_table",
]

REQUIRED = "required"
UNSET = None  # no default value: the behaviour the meaning describes


class RunConfigError(ValueError):
    """A run config that breaks the contract; the message starts with the key."""


@dataclass(frozen=True)
class RunKey:
    """One key of the contract. ``default``: ``REQUIRED`` (no default: the app must declare it),
    ``None`` (unset: the meaning says what happens), or the value used when it is absent.
    ``declare``: when the app must declare it in ``[tool.flwr.app.config]``. ``reader``: the
    side that reads it (``server``: ``UserLevelDP.from_run_config``; ``client``:
    ``user_level_mod``). ``config_key``: the fedudp config key it sets (None: read by
    ``fedudp.flower`` itself).

    Attributes
    ----------
    name : str
        The run-config key.
    type : type
        Its value's type.
    default : Any
        ``REQUIRED``, ``None`` or the default value.
    declare : str
        When the app must declare it.
    meaning : str
        What it does (the docs' table).
    reader : str
        ``server`` or ``client``.
    config_key : str or None
        The fedudp config key it sets.
    """

    name: str
    type: type
    default: Any
    declare: str
    meaning: str
    reader: str = "server"
    config_key: str | None = None

    @property
    def required(self) -> bool:
        return self.default == REQUIRED

    def default_text(self) -> str:
        if self.required:
            return "— (required)"
        if self.default is None:
            return "unset"
        if isinstance(self.default, str):
            return f'"{self.default}"'
        return repr(self.default)


TO_CHANGE = "to change the default"
ALWAYS = "yes"

KEYS: tuple[RunKey, ...] = (
    RunKey(
        "fedudp.privacy.epsilon",
        float,
        REQUIRED,
        ALWAYS,
        "Target ε of the user-level guarantee over the whole run: the noise is calibrated to it "
        "and training stops before a release that would exceed it.",
        config_key="privacy.epsilon",
    ),
    RunKey(
        "fedudp.privacy.delta",
        float,
        REQUIRED,
        ALWAYS,
        "δ of the guarantee (the ledger's δ).",
        config_key="privacy.delta",
    ),
    RunKey(
        "fedudp.public.users",
        int,
        REQUIRED,
        ALWAYS,
        "N, the number of users of the federation (public, declared; the estimator's "
        "population). An upper bound: the mod refuses only more users than N.",
        config_key="public.users",
    ),
    RunKey(
        "num-server-rounds",
        int,
        REQUIRED,
        "yes (or `fedudp.train.rounds`)",
        "T, the number of training rounds (Flower's own key): the noise is calibrated for T "
        "releases; `UserLevelDP.start(num_rounds=...)` must be given the same T.",
        config_key="train.rounds",
    ),
    RunKey(
        "fedudp.train.rounds",
        int,
        UNSET,
        "only without `num-server-rounds`",
        "T for an app without `num-server-rounds`; declared beside it, it must equal it.",
        config_key="train.rounds",
    ),
    RunKey(
        "fedudp.aggregator",
        str,
        "gaussian",
        TO_CHANGE,
        "The estimator: `gaussian` (clip + Gaussian), `gaussian_adaptive`, `winsorized`, "
        "`outlier_removal`, `friendlycore`, `few_users`, and under "
        '`fedudp.privacy.placement = "distributed"` `ddgauss` or `skellam` (requirements: '
        "[below](#what-each-estimator-needs)).",
        config_key="aggregator",
    ),
    RunKey(
        "fedudp.privacy.placement",
        str,
        "server",
        "for distributed DP",
        '`"server"`: the strategy adds the noise (a trusted server); `"distributed"`: each '
        "client adds a discrete noise share to its integer-encoded users' updates under "
        "simulated secure aggregation (`fedudp.aggregator` `ddgauss` or `skellam`, seeded "
        "randomness, `fedudp.train.min_owners` ≥ 2 the declared survivors).",
        config_key="privacy.placement",
    ),
    RunKey(
        "fedudp.clients",
        int,
        UNSET,
        "with distributed DP",
        "`ddgauss`/`skellam`: the number of clients that may send a share (public; the "
        "heuristic scale keeps all their noise shares within 2^bits; fedudp's "
        '`partition.num_owners`). Required under `fedudp.privacy.placement = "distributed"`, '
        "unused otherwise.",
    ),
    RunKey(
        "fedudp.estimator.bits",
        int,
        16,
        TO_CHANGE,
        "`ddgauss`/`skellam`: bits per coordinate of the modular sum (2^bits).",
        config_key="estimator.bits",
    ),
    RunKey(
        "fedudp.estimator.rounding_beta",
        float,
        math.exp(-0.5),
        TO_CHANGE,
        "`ddgauss`/`skellam`: conditional stochastic rounding's β (0: unconditional).",
        config_key="estimator.rounding_beta",
    ),
    RunKey(
        "fedudp.estimator.k_stddevs",
        float,
        4.0,
        TO_CHANGE,
        "`ddgauss`/`skellam`: standard deviations of the noisy sum kept within 2^bits (the "
        "heuristic scale).",
        config_key="estimator.k_stddevs",
    ),
    RunKey(
        "fedudp.estimator.scale",
        float,
        UNSET,
        "to fix the scale",
        "`ddgauss`/`skellam`: the scale 1/γ before rounding; unset: the heuristic (the largest "
        "that keeps `fedudp.estimator.k_stddevs` standard deviations within 2^bits).",
        config_key="estimator.scale",
    ),
    RunKey(
        "fedudp.privacy.clip",
        float,
        1.0,
        TO_CHANGE,
        "C, the l2 norm each user's model update is clipped to (clip + Gaussian; the initial "
        "clip of `gaussian_adaptive`; the rows' bound of the per-user-rows estimators is "
        "`fedudp.estimator.bound`).",
        config_key="privacy.clip",
    ),
    RunKey(
        "fedudp.privacy.noise_multiplier",
        float,
        UNSET,
        "to fix the noise",
        "z (clip + Gaussian): unset, calibrated to (ε, δ) over T rounds; set, used as given "
        "and training stops at ε.",
        config_key="privacy.noise_multiplier",
    ),
    RunKey(
        "fedudp.train.sampling_rate",
        float,
        1.0,
        TO_CHANGE,
        "q, each user's probability of taking part in a round (Poisson; public). The "
        "per-user-rows estimators need q = 1.",
        config_key="train.sampling_rate",
    ),
    RunKey(
        "fedudp.privacy.randomness",
        str,
        "secure",
        "for a seeded simulation",
        '`"secure"`: noise and sampling from OS entropy; `"seeded"`: both keyed by '
        "`fedudp.seed`, which every client then receives (simulations and tests only).",
        config_key="privacy.randomness",
    ),
    RunKey(
        "fedudp.seed",
        int,
        0,
        "for a seeded simulation",
        'The seed of `"seeded"` randomness.',
        config_key="seed",
    ),
    RunKey(
        "fedudp.train.min_owners",
        int,
        1,
        TO_CHANGE,
        "Fail closed: a round releases only if at least this many clients replied successfully.",
        config_key="train.min_owners",
    ),
    RunKey(
        "fedudp.train.min_users",
        int,
        1,
        TO_CHANGE,
        "Fail closed: ... and if those clients hold at least this many users (declared slots, "
        "never the sampled count).",
        config_key="train.min_users",
    ),
    RunKey(
        "fedudp.estimator.bound",
        float,
        1.0,
        TO_CHANGE,
        "B, the public bound on a user's update norm (per-user-rows estimators).",
        config_key="estimator.bound",
    ),
    RunKey(
        "fedudp.estimator.tau",
        float,
        UNSET,
        "to fix τ",
        "τ, the users' concentration radius (per-user-rows estimators); unset: derived from B "
        "and `fedudp.public.records_per_user`.",
        config_key="estimator.tau",
    ),
    RunKey(
        "fedudp.estimator.beta",
        float,
        0.1,
        TO_CHANGE,
        "β, the estimators' failure probability.",
        config_key="estimator.beta",
    ),
    RunKey(
        "fedudp.estimator.copies",
        int,
        1,
        TO_CHANGE,
        "`few_users`: copies of the median estimate.",
        config_key="estimator.copies",
    ),
    RunKey(
        "fedudp.estimator.blocks",
        int,
        1,
        TO_CHANGE,
        "`few_users`: rotated blocks (a power of two).",
        config_key="estimator.blocks",
    ),
    RunKey(
        "fedudp.estimator.kappa",
        float,
        1.0,
        TO_CHANGE,
        "`few_users`: the ball radius multiplier κ.",
        config_key="estimator.kappa",
    ),
    RunKey(
        "fedudp.estimator.tries",
        float,
        1000.0,
        TO_CHANGE,
        "`few_users`: expected tries of the geometric stop.",
        config_key="estimator.tries",
    ),
    RunKey(
        "fedudp.public.records_per_user",
        int,
        1,
        TO_CHANGE,
        "m, records per user (public), from which the per-user-rows estimators derive τ.",
        config_key="public.records_per_user",
    ),
    RunKey(
        "fedudp.privacy.clip_quantile",
        float,
        0.5,
        TO_CHANGE,
        "`gaussian_adaptive`: the quantile of the users' update norms the clip follows.",
        config_key="privacy.clip_quantile",
    ),
    RunKey(
        "fedudp.privacy.clip_lr",
        float,
        0.2,
        TO_CHANGE,
        "`gaussian_adaptive`: the clip's learning rate.",
        config_key="privacy.clip_lr",
    ),
    RunKey(
        "fedudp.expected-update-norm",
        float,
        UNSET,
        "to check utility against it",
        "A typical norm of the mean update the app expects (public, e.g. from a non-private "
        "run on public data); unset: C. Before round 1 the wrapper warns when the release "
        "noise's expected norm exceeds it.",
    ),
    RunKey(
        "fedudp.users-per-client",
        int,
        UNSET,
        "unless the mod gets `users_per_client=` or `users_of=`",
        "k, the users each client holds (client p: users p·k … p·k + k − 1); read by "
        "`user_level_mod`, over its `users_per_client=`.",
        reader="client",
    ),
)

BY_NAME = {k.name: k for k in KEYS}
ROUND_KEYS = ("num-server-rounds", "fedudp.train.rounds")


def _typed(key: RunKey, value: Any) -> Any:
    ok = (
        (key.type is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (key.type is int and isinstance(value, int) and not isinstance(value, bool))
        or (key.type is str and isinstance(value, str))
    )
    if not ok:
        raise RunConfigError(
            f"{key.name}: expected {key.type.__name__}, got {value!r} "
            f"({type(value).__name__}); {key.meaning}"
        )
    if key.type is float and not math.isfinite(float(value)):
        raise RunConfigError(f"{key.name}: must be finite, got {value!r}")
    return key.type(value)


def unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, list(BY_NAME), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return (
        f"{name}: not a fedudp.flower run-config key ({hint}the keys, their types and "
        "defaults: docs/flower-apps.md#the-run-config-contract, or "
        "`python -m fedudp.flower.contract table`)"
    )


def rounds_of(run_config: Mapping[str, Any]) -> int:
    """T: ``num-server-rounds`` (Flower's key) or ``fedudp.train.rounds``; both present and
    different, or neither, is a ``RunConfigError`` naming them.

    Parameters
    ----------
    run_config : Mapping[str, Any]

    Returns
    -------
    int

    Raises
    ------
    RunConfigError
    """
    got = {k: _typed(BY_NAME[k], run_config[k]) for k in ROUND_KEYS if k in run_config}
    if not got:
        raise RunConfigError(
            "num-server-rounds: required in the run config (the number of training rounds T "
            "the noise is calibrated for; or fedudp.train.rounds where the app has no "
            "num-server-rounds)"
        )
    if len(set(got.values())) > 1:
        raise RunConfigError(
            f"fedudp.train.rounds: {got['fedudp.train.rounds']} differs from num-server-rounds "
            f"= {got['num-server-rounds']} (one number of training rounds: drop "
            "fedudp.train.rounds, or set both alike)"
        )
    t = next(iter(got.values()))
    if t < 1:
        raise RunConfigError(f"{next(iter(got))}: must be >= 1, got {t}")
    return t


def checked(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The run config's contract keys, checked (see the module doc), with their defaults
    filled in where they have one; ``num-server-rounds`` / ``fedudp.train.rounds`` become
    ``rounds``. Keys not starting with ``fedudp.`` other than the rounds are the app's own and
    are not looked at.

    Parameters
    ----------
    run_config : Mapping[str, Any]
        Flower's run config (``context.run_config``).

    Returns
    -------
    dict[str, Any]
        The contract's values by key (``rounds`` included).

    Raises
    ------
    RunConfigError
        An unknown key, a wrong type, a missing required key, two different numbers of rounds.
    """
    rc = dict(run_config)
    for name in rc:
        if str(name).startswith("fedudp.") and name not in BY_NAME:
            raise RunConfigError(unknown_message(str(name)))
    for key in KEYS:
        if key.required and key.name not in ROUND_KEYS and key.name not in rc:
            raise RunConfigError(
                f"{key.name}: required in the run config ({key.meaning} There is no default: "
                f'declare it in [tool.flwr.app.config], e.g. "{key.name}" = ...)'
            )
    out: dict[str, Any] = {"rounds": rounds_of(rc)}
    for key in KEYS:
        if key.name in ROUND_KEYS:
            continue
        if key.name in rc:
            out[key.name] = _typed(key, rc[key.name])
        elif key.default is not None and not key.required:
            out[key.name] = key.default
    return out


def config_overrides(values: Mapping[str, Any]) -> dict[str, Any]:
    """fedudp config overrides (``{"privacy.epsilon": 2.0, ...}``) from ``checked``'s values."""
    over: dict[str, Any] = {}
    for k, v in values.items():
        key = BY_NAME[k].config_key if k in BY_NAME else None
        if key is not None:
            over[key] = v
    over["train.rounds"] = values["rounds"]
    return over


# fedudp config keys the builder names in its errors -> the run-config key to change
_CONFIG_TO_RUN = {
    k.config_key: k.name for k in KEYS if k.config_key and k.name != "fedudp.train.rounds"
}
_CONFIG_TO_RUN.update(
    {"partition": "fedudp.public.users", "public.owner_capacity": "fedudp.public.users"}
)


def as_run_config_error(e: Exception) -> RunConfigError:
    """A fedudp config builder's error (``"partition: aggregator=outlier_removal needs n >= 477
    units, ..."``) as a ``RunConfigError`` starting with the run-config key to change
    (``fedudp.public.users: ...``); an error naming no known key is kept as it is."""
    text = str(e)
    key, sep, rest = text.partition(": ")
    if sep and key in _CONFIG_TO_RUN:
        return RunConfigError(f"{_CONFIG_TO_RUN[key]}: {rest.strip()} (fedudp's {key})")
    return RunConfigError(text)


# -- before flwr run ----------------------------------------------------------------------------
def declared(app_dir: str | Path) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]``, flattened to dotted keys as Flower does."""
    import tomllib

    path = Path(app_dir) / "pyproject.toml"
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise RunConfigError(f"{path}: no pyproject.toml (the Flower app's folder?)") from None
    section = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})

    def flat(d: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            name = f"{prefix}{k}"
            out.update(flat(v, name + ".") if isinstance(v, dict) else {name: v})
        return out

    return flat(section)


def parse_overrides(overrides: str | list[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """``--run-config`` values as ``flwr run`` parses them (``"k=v k2=v2"``, several such
    strings, or a TOML file's path), or a dict."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    from flwr.common.config import parse_config_args

    items = [overrides] if isinstance(overrides, str) else list(overrides)
    return dict(parse_config_args(items))


def check_app(
    app_dir: str | Path, overrides: str | list[str] | Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What ``flwr run APP --run-config OVERRIDES`` would hand the ServerApp, checked before it
    runs: an override of a key the app does not declare (Flower's ``[code: 15] Invalid run
    configuration.``) and every contract error are a ``RunConfigError`` naming the key. Returns
    ``checked``'s values.

    Parameters
    ----------
    app_dir : str or Path
        The Flower app's folder (its ``pyproject.toml``).
    overrides : str, list[str], Mapping or None
        ``--run-config``'s overrides.

    Returns
    -------
    dict[str, Any]

    Raises
    ------
    RunConfigError
    """
    base = declared(app_dir)
    over = parse_overrides(overrides)
    for name in over:
        if str(name).startswith("fedudp.") and name not in BY_NAME:
            raise RunConfigError(unknown_message(str(name)))
        if name not in base:
            raise RunConfigError(
                f"{name}: not declared in [tool.flwr.app.config] of "
                f"{Path(app_dir) / 'pyproject.toml'}; flwr run refuses to override an "
                f'undeclared key ("[code: 15] Invalid run configuration."): declare it there '
                f'first, e.g. "{name}" = {_toml(over[name])}'
            )
    return checked({**base, **over})


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


# -- utility before round 1 ---------------------------------------------------------------------
TABLE_BEGIN = "<!-- run-config contract: generated by `python -m fedudp.flower.contract table` -->"
TABLE_END = "<!-- end of the generated table -->"


def markdown_table() -> str:
    """The contract as the Markdown table docs/flower-apps.md carries (between ``TABLE_BEGIN``
    and ``TABLE_END``).

    Returns
    -------
    str
    """
    rows = [
        "| key | type | default | declare in `[tool.flwr.app.config]` | read by | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for k in KEYS:
        rows.append(
            f"| `{k.name}` | {k.type.__name__} | {k.default_text()} | {k.declare} | "
            f"{'ClientApp (mod)' if k.reader == 'client' else 'ServerApp (wrapper)'} | "
            f"{k.meaning} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedudp.flower.contract table`` (the docs' table) or
    ``python -m fedudp.flower.contract check APP [--run-config "k=v ..."]...``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m fedudp.flower.contract")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("table", help="print the run-config contract as a Markdown table")
    c = sub.add_parser("check", help="check a Flower app's run config before flwr run")
    c.add_argument("app", nargs="?", default=".")
    c.add_argument("--run-config", "-c", action="append", default=None)
    a = p.parse_args(argv)
    if a.cmd == "table":
        print(markdown_table())
        return 0
    try:
        got = check_app(a.app, a.run_config)
    except RunConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"ok: {len(got) - 1} fedudp keys, T = {got['rounds']} rounds, "
        f"epsilon {got['fedudp.privacy.epsilon']}, N = {got['fedudp.public.users']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
