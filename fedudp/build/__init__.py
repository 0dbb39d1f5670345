"""The config builder: the one package that reads a ``RunConfig``'s fields and turns them into
objects (docs/architecture.md#the-config-builder), one module per phase.

Every other module takes plain Python values: estimators (``calibrated(epsilon=..., ...)``),
the owner component (``Owners(model, method, training, budget, hooks)``), the billboard, the
models, the federation and the training algorithms. The builder maps the configuration's keys
onto those values, decides the method and the noise placement once (``method``,
``placement``), reports a bad value as a ``ConfigError`` naming the config key, and assembles a
run (``prepare``). Nothing here computes: each part's arithmetic and its own parameter checks
live with the part.

The phases, in the order a run takes them:

- ``checks``: every check of a run, each once (``check_config``: plugins, the schema's
  ``validate``, the registered names, the CUDA device, and the run's plain settings;
  ``check_run``: the estimator, the training algorithm, the randomness, the planned public
  numbers, the data files' presence);
- ``run_settings``: the plain settings (``RunSettings``), the placement, the randomness;
- ``plan``: the public plan (counts and shapes known before any data is read);
- ``data``: the federation (a natural one's records read, checked and grouped);
- ``estimators``: the calibrated estimator and its refusals under their config keys;
- ``owner_side``: the model (built, checked, probed), the method and the owner component;
- ``algorithm_setup``: a seed's training algorithm;
- ``guarantee``: the guarantee, the ledger's head, the audit options;
- ``assemble``: ``prepare``, the whole run before its first round.
"""

from __future__ import annotations

from fedudp.build.algorithm_setup import algorithm_context, algorithm_error, check_algorithm
from fedudp.build.assemble import Prepared, prepare
from fedudp.build.checks import (
    Checked,
    check,
    check_config,
    check_device,
    check_names,
    check_randomness,
    check_run,
)
from fedudp.build.data import (
    check_public,
    declared_inputs,
    federation,
    natural_numbers,
    natural_records,
)
from fedudp.build.estimators import (
    CONFIG_KEYS,
    check_estimator,
    config_error,
    config_key,
    config_message,
    estimator,
    estimator_class,
    estimator_options,
    estimator_values,
)
from fedudp.build.guarantee import check_audit, ledger, run_guarantee, warn_min_users
from fedudp.build.owner_side import (
    _footprint_units as _footprint_units,
)
from fedudp.build.owner_side import (
    builtin_model,
    device,
    method,
    model,
    owner_training,
    owners,
    probe_model,
)
from fedudp.build.owner_side import (
    make_model as make_model,  # (tests patch the model factory's module, owner_side)
)
from fedudp.build.plan import (
    check_planned_public,
    declared,
    declares_inputs,
    input_spec,
    natural,
    planned_owner_records,
    planned_owner_users,
    planned_shape,
    planned_units,
    public_numbers,
    read_request,
    reader,
    records_per_unit,
)
from fedudp.build.run_settings import RunSettings, placement, randomness, settings

__all__ = [
    "CONFIG_KEYS",
    "Checked",
    "Prepared",
    "RunSettings",
    "algorithm_context",
    "algorithm_error",
    "builtin_model",
    "check",
    "check_algorithm",
    "check_audit",
    "check_config",
    "check_device",
    "check_estimator",
    "check_names",
    "check_planned_public",
    "check_public",
    "check_randomness",
    "check_run",
    "config_error",
    "config_key",
    "config_message",
    "declared",
    "declared_inputs",
    "declares_inputs",
    "device",
    "estimator",
    "estimator_class",
    "estimator_options",
    "estimator_values",
    "federation",
    "input_spec",
    "ledger",
    "method",
    "model",
    "natural",
    "natural_numbers",
    "natural_records",
    "owner_training",
    "owners",
    "placement",
    "planned_owner_records",
    "planned_owner_users",
    "planned_shape",
    "planned_units",
    "prepare",
    "probe_model",
    "public_numbers",
    "randomness",
    "read_request",
    "reader",
    "records_per_unit",
    "run_guarantee",
    "settings",
    "warn_min_users",
]
