"""``UserLevelDP.from_run_config``'s arguments from Flower's run config alone
(``[tool.flwr.app.config]`` / ``--run-config``), under the run-config contract
(``fedudp.flower.contract``, docs/flower-apps.md#the-run-config-contract): the estimator,
calibrated by fedudp's config builder, and the wrapper's other settings.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from fedudp.aggregators.base import Aggregator
from fedudp.flower.log_setup import root_placeholder
from fedudp.flower.wire import is_personal
from fedudp.randomness import Randomness

__all__ = ["wrapper_arguments"]


def wrapper_arguments(
    run_config: Mapping[str, Any], initial_arrays: ArrayRecord, personal: Sequence[str]
) -> tuple[Aggregator, dict[str, Any], float | None]:
    """The estimator and the ``UserLevelDP`` keyword arguments a run config declares.

    ε, δ and N (``fedudp.public.users``) are required, T comes from ``num-server-rounds`` (or
    ``fedudp.train.rounds``; both must agree), every other ``fedudp.*`` key is optional with its
    default. Randomness is ``secure`` unless set (the wrapper's default, unlike fedudp's own
    engines). The estimator is calibrated by fedudp's config builder over the shared
    parameters of ``initial_arrays`` (those not matching ``personal``).

    Parameters
    ----------
    run_config : Mapping[str, Any]
        ``context.run_config``.
    initial_arrays : flwr.app.ArrayRecord
        The initial model.
    personal : Sequence[str]
        The personal parameters' patterns.

    Returns
    -------
    tuple[Aggregator, dict[str, Any], float or None]
        The estimator, the constructor's other keyword arguments (``delta``,
        ``target_epsilon``, ``seed``, ``randomness``, ``min_owners``, ``min_users``, ``rounds``,
        ``expected_update_norm``), and a per-user-rows estimator's declared bound B (None for
        another estimator).

    Raises
    ------
    RunConfigError
        An unknown key, a wrong type, a missing required key (named as a run-config key).
    """
    from fedudp import build
    from fedudp.config import config_from_overrides
    from fedudp.flower.contract import (
        RunConfigError,
        as_run_config_error,
        checked,
        config_overrides,
    )
    from fedudp.protocol.contributions import Sampling

    # the contract (fedudp/flower/contract.py): an unknown key, a wrong type, a missing
    # epsilon / delta / N, two different numbers of rounds: an error naming the key
    values = checked(run_config)
    over = config_overrides(values)
    secure = "fedudp.privacy.randomness" not in run_config  # the wrapper's default: secure
    if values.get("fedudp.privacy.placement") == "distributed":
        if "fedudp.clients" not in values:
            raise RunConfigError(
                'fedudp.clients: required with fedudp.privacy.placement = "distributed": '
                "declare the number of clients that may send a share"
            )
        over["partition.num_owners"] = values["fedudp.clients"]
    # the app's own data: its public numbers are the declared ones (records per user: 1
    # unless declared, for the estimators that derive a radius from it)
    over = {"dataset.name": "memory", "public.owner_capacity": over["public.users"], **over}
    dim = sum(
        int(np.prod(initial_arrays[k].shape))
        for k in initial_arrays
        if not is_personal(k, personal)
    )
    # (root_placeholder: dp-accounting's absl warnings configure no root logger)
    try:  # the builder's errors name fedudp config keys: named here as run-config keys
        with root_placeholder():
            cfg = config_from_overrides({"method": "full_dp", **over})
            s = build.check(cfg).settings
            agg = build.estimator(
                cfg, Sampling(s.sampling_rate, build.planned_units(cfg)[1]), s.rounds, dim
            )
    except ValueError as e:
        raise as_run_config_error(e) from None
    mode = Randomness.SECURE if secure else s.randomness
    assert s.delta is not None  # the run-config contract requires fedudp.privacy.delta
    kwargs = {
        "delta": float(s.delta),
        "target_epsilon": s.target_epsilon,
        "seed": s.seed,
        "randomness": Randomness(s.seed, mode),
        "min_owners": s.min_owners,
        "min_users": s.min_users,
        "rounds": int(values["rounds"]),
        "expected_update_norm": values.get("fedudp.expected-update-norm"),
    }
    # per-user rows: the rows' declared bound B
    bound = float(values["fedudp.estimator.bound"]) if agg.constraint.rows else None
    return agg, kwargs, bound
