"""The configuration in and out: Hydra's ConfigStore, a composed node's keys, and one
vocabulary of (de)serialization for Hydra, the Flower wire and ``flwr run --run-config``
(json, dotted overrides, a saved config over the current schema's defaults)."""

from __future__ import annotations

from typing import Any, cast

from fedudp.config.schema import RunConfig, huang_table3
from fedudp.errors import ConfigError
from fedudp.plain import jsonable

__all__ = [
    "register",
    "unknown_key_message",
    "check_known_keys",
    "config_dict",
    "config_to_json",
    "config_from_json",
    "config_from_overrides",
    "with_schema_defaults",
]


def register() -> None:
    """Register the schema with Hydra and the ``huang_table3`` resolver with OmegaConf.

    Stores ``RunConfig`` as ``fedudp_schema`` in Hydra's ConfigStore and registers (replacing
    any earlier one) the ``${huang_table3:...}`` interpolation the Huang presets use.
    """
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="fedudp_schema", node=RunConfig)
    OmegaConf.register_new_resolver("huang_table3", huang_table3, replace=True)


def unknown_key_message(key: str) -> str:
    """The one line for a key the schema does not have (given with or without ``+``).

    Parameters
    ----------
    key : str
        The dotted key, e.g. ``train.roundz`` or ``model.kwargs.hidden``.

    Returns
    -------
    str
        The message: for ``model.kwargs.*`` how to add it with ``+``, else where your own
        settings go.
    """
    if key.startswith("model.kwargs."):  # a free-form dict: a new key needs Hydra's '+'
        return (
            f"{key}: a model argument is a new key of the free-form dict model.kwargs: "
            f"add it with '+' ({'+' + key}=...)"
        )
    return (
        f"{key}: unknown key (the config schema has no such setting, with or without '+'); "
        "your own model is model.target=package.module.Class and its own arguments go "
        "under model.kwargs, e.g. +model.kwargs.hidden=64"
    )


def check_known_keys(node: Any, prefix: str = "") -> None:
    """A composed config (an OmegaConf node) holds only the schema's keys: Hydra's ``+key=value``
    adds a key that ``RunConfig`` does not declare, and ``OmegaConf.to_object`` would then drop
    it silently (``+train.roundz=3`` ran with the default rounds). The free-form dict
    ``model.kwargs`` takes any key, and so does ``estimator`` (``validate`` checks its keys
    against the registered estimators' options). Raises a one-line ``ConfigError`` naming the first unknown
    key.

    Parameters
    ----------
    node : Any
        The composed config (an OmegaConf node); anything but a structured ``DictConfig`` is
        accepted as it is.
    prefix : str, default ""
        The dotted path of ``node`` (``"train."``), for the message.

    Raises
    ------
    ConfigError
        A key the node's schema does not declare (searched recursively).
    """
    import dataclasses

    from omegaconf import DictConfig, OmegaConf

    schema = OmegaConf.get_type(node)
    if not (isinstance(node, DictConfig) and dataclasses.is_dataclass(schema)):
        return  # a free-form dict (model.kwargs)
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        full = prefix + str(key)
        if key not in names:
            raise ConfigError(unknown_key_message(full))
        child = node._get_node(key)  # OmegaConf private API: no interpolation resolved
        if isinstance(child, DictConfig):
            check_known_keys(child, f"{full}.")


# -- (de)serialization: one vocabulary for Hydra, the Flower wire and `flwr run --run-config` --
def _effective_classes(d: Any) -> Any:
    """A config dict with ``dataset.classes`` null on a planned data set (synthetic, mnist,
    fashion_mnist) written as the 10 it means: runs saved before the key became optional
    (``classes: 10``) and runs saved after compare equal."""
    ds = d.get("dataset") if isinstance(d, dict) else None
    if (
        isinstance(ds, dict)
        and ds.get("classes") is None
        and str(ds.get("name", "synthetic")) in ("synthetic", "mnist", "fashion_mnist")
    ):
        d = {**d, "dataset": {**ds, "classes": 10}}
    return d


def config_dict(cfg: RunConfig) -> dict:
    """The configuration as a plain, JSON-able nested dict (enums as their values).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    dict
        Its sections as dicts; ``dataset.classes`` null on a planned data set is written as 10.
    """
    import dataclasses

    return _effective_classes(jsonable(dataclasses.asdict(cfg)))


def config_to_json(cfg: RunConfig) -> str:
    """The configuration as JSON (``config_dict``, keys sorted).

    Parameters
    ----------
    cfg : RunConfig
        The configuration.

    Returns
    -------
    str
        The JSON text; ``config_from_json`` reads it back.
    """
    import json

    return json.dumps(config_dict(cfg), sort_keys=True)


def config_from_json(text: str) -> RunConfig:
    """Inverse of ``config_to_json`` (the schema turns strings back into enums).

    Parameters
    ----------
    text : str
        JSON of a (possibly partial) configuration, merged over the schema's defaults.

    Returns
    -------
    RunConfig
        The configuration.
    """
    import json

    from omegaconf import OmegaConf

    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), json.loads(text))
    return cast(RunConfig, OmegaConf.to_object(merged))  # the structured schema's dataclass


def config_from_overrides(overrides: dict[str, Any]) -> RunConfig:
    """``{"train.rounds": 3, "method": "fedavg"}`` -> a ``RunConfig``; an unknown key or a bad
    value is a ``ConfigError`` naming the key.

    Parameters
    ----------
    overrides : dict of str to Any
        Dotted keys over the defaults, as Python values; ``tracking`` may be a kind
        (``"mlflow"``); ``model.kwargs.*`` and ``estimator.*`` take new keys.

    Returns
    -------
    RunConfig
        The defaults with the overrides applied (not yet validated: see ``validate``).

    Raises
    ------
    ConfigError
        An unknown key, or a value of the wrong type or outside an enum, naming the key.
    """
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import ConfigAttributeError, OmegaConfBaseException

    base = OmegaConf.structured(RunConfig)
    OmegaConf.set_struct(base, True)
    for k, v in overrides.items():
        if k == "tracking" and not isinstance(v, dict):  # tracking=mlflow, as on the command line
            k = "tracking.kind"
        try:
            if k.startswith(("model.kwargs", "estimator")):  # free-form dicts
                with open_dict(base.model.kwargs if k.startswith("model") else base.estimator):
                    OmegaConf.update(base, k, v, merge=True)
                continue
            OmegaConf.update(base, k, v, merge=True)
        except ConfigAttributeError:
            raise ConfigError(unknown_key_message(k)) from None
        except OmegaConfBaseException as e:
            raise ConfigError(f"{k}: {str(e).splitlines()[0]}") from None
    return cast(RunConfig, OmegaConf.to_object(base))  # the structured schema's dataclass


def with_schema_defaults(config: Any) -> dict:
    """A saved config (a dict or an OmegaConf node) over the current schema's defaults: a key
    added after the run was made, at its default, does not make an old run another run, and
    ``1`` and ``1.0`` compare equal. A config the schema cannot read (a key it no longer has)
    comes back as saved.

    Parameters
    ----------
    config : Any
        A saved config: a dict or an OmegaConf node.

    Returns
    -------
    dict
        The merged config as plain values (enums as strings), or the saved one as it is.
    """
    from omegaconf import OmegaConf

    node = config if OmegaConf.is_config(config) else OmegaConf.create(config)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), node)
        return _effective_classes(jsonable(OmegaConf.to_container(merged, enum_to_str=True)))
    except Exception:  # noqa: BLE001
        return cast(dict, OmegaConf.to_container(node))  # a saved config: a mapping
