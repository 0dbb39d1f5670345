"""The configured estimator: its class, its declared requirements checked against the config,
and the instance calibrated with exactly the run values and options it declares; a refused
plain value reported under its config key."""

from __future__ import annotations

from typing import Any

from fedudp.aggregators import (
    REGISTRY,
    AdaptiveClipGaussian,
    Aggregator,
    GaussianAggregator,
    LocalDpSgdMean,
    Sampling,
)
from fedudp.aggregators.base import RUN_INPUTS, ParameterError
from fedudp.build.plan import planned_owner_records, planned_owner_users, records_per_unit
from fedudp.build.run_settings import placement
from fedudp.config import (
    Accounting,
    Calibration,
    ClipPolicy,
    ConfigError,
    Placement,
    RunConfig,
    resolved_aggregator,
)
from fedudp.privacy.accountant import BudgetError

__all__ = [
    "CONFIG_KEYS",
    "config_key",
    "config_message",
    "config_error",
    "estimator_class",
    "check_estimator",
    "estimator_values",
    "estimator_options",
    "estimator",
]

# -- estimators -----------------------------------------------------------------------------------
# the config key of each plain value an estimator or algorithm may name in a ParameterError
# (errors name the key): the run's values (RUN_INPUTS), a few parts of them, and every
# registered estimator's options (``estimator.<name>``, looked up when the error is raised)
CONFIG_KEYS = {
    **RUN_INPUTS,
    "sampling.rate": "train.sampling_rate",
    "sampling.population": "partition",
    "noise_multiplier": "privacy.noise_multiplier",
    "records_per_user": "partition.records_per_user",
}


def config_key(param: str) -> str:
    """The configuration key of a plain value's name (itself when there is none).

    Parameters
    ----------
    param : str
        A ``ParameterError``'s parameter name (``clip``, ``sampling.rate``, ``tau``, ...).

    Returns
    -------
    str
        Its dotted config key (``privacy.clip``, ``estimator.tau``), or ``param``.
    """
    if param in CONFIG_KEYS:
        return CONFIG_KEYS[param]
    if param in REGISTRY.options():
        return f"estimator.{param}"
    return param


_BUDGET = ("epsilon", "delta", "rounds")


def config_message(err: ParameterError) -> str:
    """``err``'s message with the parameter's name replaced by its config key
    (``"clip must be > 0, got 0"`` -> ``"privacy.clip must be > 0, got 0"``).

    Parameters
    ----------
    err : ParameterError
        The refused value's error.

    Returns
    -------
    str
        The message led by the config key.
    """
    key, text = config_key(err.param), str(err)
    if text.startswith(err.param + " "):
        return key + text[len(err.param) :]
    return f"{key}: {text}"


def config_error(
    err: ParameterError, name: str = "", sampling: Sampling | None = None
) -> ConfigError:
    """The ``ConfigError`` for a refused plain value: the key named, a budget that cannot be met
    a ``BudgetError``, a population too small for an estimator's proof a ``partition`` error.

    Parameters
    ----------
    err : ParameterError
        The refused value's error (a ``ConfigError`` in its ``facts["config"]`` is returned).
    name : str, default ""
        The estimator's name, for a population error.
    sampling : Sampling or None
        The units' sampling (its population n quoted).

    Returns
    -------
    ConfigError
        The error to raise (a ``BudgetError`` for epsilon, delta or rounds).
    """
    given = err.facts.get("config")
    if isinstance(given, ConfigError):
        return given
    if err.param == "sampling.population" and name:
        n = sampling.population if sampling is not None else "?"
        need = err.facts.get("need")
        head = (
            f"partition: aggregator={name} needs n >= {need} units, got n={n}"
            if need is not None
            else f"partition: aggregator={name} with n={n} units"
        )
        return ConfigError(
            f"{head}: {err.facts.get('detail') or str(err)}. Raise users or "
            "privacy.epsilon, or use aggregator=gaussian"
        )
    return (BudgetError if err.param in _BUDGET else ConfigError)(config_message(err))


def estimator_class(cfg: RunConfig) -> type[Aggregator]:
    """The configured estimator's class: owner-side DP-SGD's billboard mean under
    ``placement=local_dpsgd``, else the registered ``aggregator`` (auto: gaussian for the
    private methods, the plain mean otherwise).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    type[Aggregator]
        The estimator's class (``AdaptiveClipGaussian`` under ``clip_policy=adaptive``).

    Raises
    ------
    ConfigError
        Adaptive clipping with an estimator other than gaussian, or an unregistered name.
    """
    adaptive = ClipPolicy(cfg.privacy.clip_policy) == ClipPolicy.adaptive
    if placement(cfg) == Placement.local_dpsgd:
        return LocalDpSgdMean  # an adaptive clip is its own option (clip_policy)
    name = resolved_aggregator(cfg)
    if adaptive:
        if name not in (GaussianAggregator.name, AdaptiveClipGaussian.name):
            raise ConfigError(
                f"privacy.clip_policy: adaptive clipping adapts clip + Gaussian's "
                f"clip (aggregator=gaussian), not aggregator={name}; set "
                "privacy.clip_policy=fixed"
            )
        return AdaptiveClipGaussian
    if name not in REGISTRY:
        raise ConfigError(
            f"aggregator: {name} is not available in this build (available: {sorted(REGISTRY)})"
        )
    return REGISTRY[name]


def check_estimator(cfg: RunConfig) -> None:
    """What an estimator declares about itself, checked against the config before any work:
    the calibrations it supports, whether it takes a fixed noise multiplier, whether it is
    analysed replace-one (every unit every round).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Raises
    ------
    ConfigError
        An unsupported calibration, a fixed noise multiplier it does not take, or sampling
        below 1 for a replace-one estimator (or ``estimator_class``'s errors).
    """
    cls = estimator_class(cfg)
    if not cls.private:
        return
    cal = Calibration(cfg.privacy.calibration).value
    if cal not in cls.calibrations:
        raise ConfigError(
            f"privacy.calibration: closed_form {cls.closed_form_note}; use accountant"
        )
    if cfg.privacy.noise_multiplier is not None and not cls.fixed_noise:
        raise ConfigError(
            f"privacy.noise_multiplier: only aggregator=gaussian (and "
            f"placement=local_dpsgd) take a fixed noise multiplier; "
            f"aggregator={cls.name} calibrates its own noise, leave it null"
        )
    if cls.replace_one and cfg.train.sampling_rate < 1.0:
        raise ConfigError(
            f"train.sampling_rate: aggregator={cls.name} is analysed replace-one "
            "with a public n (every unit, every round); set train.sampling_rate=1"
        )


def estimator_values(cfg: RunConfig, sampling: Sampling, rounds: int, dim: int) -> dict:
    """The run's values an estimator may take (``RUN_INPUTS``, every one), read from the
    config; an estimator's ``inputs`` pick from them.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    sampling : Sampling
        The units' sampling (rate, population).
    rounds, dim : int
        The number of releases, and the dimension of each released vector.

    Returns
    -------
    dict
        Every ``RUN_INPUTS`` name to its value.
    """
    p, t = cfg.privacy, cfg.train
    group = bool(p.group_privacy)
    values = {
        "dim": dim,
        "epsilon": p.epsilon,
        "delta": p.delta,
        "rounds": rounds,
        "sampling": sampling,
        "clip": p.clip,
        "clip_policy": ClipPolicy(p.clip_policy).value,
        "clip_quantile": p.clip_quantile,
        "clip_lr": p.clip_lr,
        "clip_count_noise": p.clip_count_noise,
        "accounting": Accounting(p.accounting).value,
        "calibration": Calibration(p.calibration).value,
        "records_per_unit": records_per_unit(cfg) if cfg.estimator["tau"] is None else None,
        "batch_size": t.batch_size,
        "local_epochs": t.local_epochs,
        "owner_units": planned_owner_records(cfg) if group else planned_owner_users(cfg),
        "group_size": int(cfg.partition.records_per_user) if group else None,
        "noise_scale": float(cfg.audit.noise_scale),
        "min_owners": int(t.min_owners),
        "seed": int(cfg.seed),
    }
    assert values.keys() == RUN_INPUTS.keys()  # the builder gives every declared run value
    return values


def estimator_options(cfg: RunConfig, cls: type[Aggregator]) -> dict:
    """The estimator's declared options (``cls.options``), each read from
    ``estimator.<name>`` as its declared type; a value of the wrong type is a ``ConfigError``
    naming the key.

    Parameters
    ----------
    cfg : RunConfig
        The configuration (``estimator.*``).
    cls : type[Aggregator]
        The estimator's class.

    Returns
    -------
    dict
        Each declared option's name to its typed value (its default where not given).

    Raises
    ------
    ConfigError
        A value of the wrong type, naming ``estimator.<name>``.
    """
    out = {}
    for opt in cls.options:
        given = cfg.estimator.get(opt.name, opt.default)
        try:
            out[opt.name] = opt.value(given)
        except ValueError as e:
            raise ConfigError(f"estimator.{opt.name}: aggregator={cls.name} {e}") from None
    return out


def estimator(
    cfg: RunConfig,
    sampling: Sampling,
    rounds: int,
    dim: int,
    *,
    name: str | None = None,
    **overrides: Any,
) -> Aggregator:
    """The configured estimator (or the registered ``name``), calibrated over ``rounds``
    releases of ``dim``-vectors. Built with explicit keyword arguments: exactly the run values
    the class declares (``inputs``) and its options (``options``, from ``estimator.*``);
    ``overrides`` replace some of them (a training algorithm's own τ), and one the class does
    not declare is a ``TypeError``. A fixed ``privacy.noise_multiplier`` goes to the class's
    ``with_noise_multiplier`` with its ``noise_inputs``.

    Parameters
    ----------
    cfg : RunConfig
        The configuration.
    sampling : Sampling
        The units' sampling (rate, population).
    rounds, dim : int
        The number of releases and each vector's dimension.
    name : str or None
        A registered estimator's name (None: the configured one, checked first).
    **overrides : Any
        Values replacing declared inputs or options.

    Returns
    -------
    Aggregator
        The calibrated estimator.

    Raises
    ------
    ConfigError
        The config's estimator checks, no shared parameter for a per-user estimator, or a
        refused value (a ``BudgetError`` for an unreachable budget).
    TypeError
        An override the class does not declare.
    """
    cls = REGISTRY[name] if name is not None else estimator_class(cfg)
    if name is None:
        check_estimator(cfg)
    if cls.needs_per_user_vectors and dim < 1:
        raise ConfigError(f"aggregator={cls.name} needs at least one shared parameter")
    run = estimator_values(cfg, sampling, rounds, dim)
    declared = {k: run[k] for k in cls.inputs} | estimator_options(cfg, cls)
    unknown = sorted(set(overrides) - set(declared))
    if unknown:
        raise TypeError(f"estimator {cls.name} takes no {unknown} (it declares {sorted(declared)})")
    values = declared | overrides
    fixed = cfg.privacy.noise_multiplier if cls.private and cls.fixed_noise else None
    try:
        if fixed is not None:
            kwargs = {k: values[k] for k in cls.noise_inputs}
            return cls.with_noise_multiplier(noise_multiplier=fixed, **kwargs)
        return cls.calibrated(**values)
    except ParameterError as err:
        raise config_error(err, cls.name, sampling) from None
