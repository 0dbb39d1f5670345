"""The run configuration: its schema (``schema``), the schema's own checks (``validation``)
and its files and overrides (``files``); docs/architecture.md#configuration-and-outputs.

Importing it imports nothing of fedudp but the foundation modules (``fedudp.errors``,
``fedudp.plain``, ``fedudp.protocol.choices``): no plugin, no torch, no device query
(tests/test_config_path.py). ``validate`` reads the configuration's own values; the checks
that need the registered parts or the device are the builder's (``fedudp.build.checks``).
Constructing a ``RunConfig`` reads the registered estimators' option defaults
(``schema.estimator_defaults``), the one place the schema meets the registries.
"""

from __future__ import annotations

from fedudp.config.files import (
    check_known_keys,
    config_dict,
    config_from_json,
    config_from_overrides,
    config_to_json,
    register,
    unknown_key_message,
    with_schema_defaults,
)
from fedudp.config.schema import (
    HUANG_TABLE3,
    Accounting,
    AlgorithmConfig,
    AuditConfig,
    Calibration,
    CheckpointConfig,
    ClipPolicy,
    ColumnsConfig,
    DatasetConfig,
    EngineConfig,
    EngineName,
    KeepAfterFinish,
    Method,
    ModelConfig,
    OwnerRule,
    OwnerWeights,
    PartitionConfig,
    Placement,
    PrivacyConfig,
    PublicConfig,
    RandomnessMode,
    RunConfig,
    Scheme,
    SharedUpdate,
    TrackingConfig,
    TrackingKind,
    TrainConfig,
    Unit,
    UserRule,
    estimator_defaults,
    huang_table3,
    resolved_aggregator,
)
from fedudp.config.validation import coerce, validate
from fedudp.errors import ConfigError, DataError
from fedudp.plain import Choice, jsonable

__all__ = [
    "HUANG_TABLE3",
    "Accounting",
    "AlgorithmConfig",
    "AuditConfig",
    "Calibration",
    "CheckpointConfig",
    "Choice",
    "ClipPolicy",
    "ColumnsConfig",
    "ConfigError",
    "DataError",
    "DatasetConfig",
    "EngineConfig",
    "EngineName",
    "KeepAfterFinish",
    "Method",
    "ModelConfig",
    "OwnerRule",
    "OwnerWeights",
    "PartitionConfig",
    "Placement",
    "PrivacyConfig",
    "PublicConfig",
    "RandomnessMode",
    "RunConfig",
    "Scheme",
    "SharedUpdate",
    "TrackingConfig",
    "TrackingKind",
    "TrainConfig",
    "Unit",
    "UserRule",
    "check_known_keys",
    "coerce",
    "config_dict",
    "config_from_json",
    "config_from_overrides",
    "config_to_json",
    "estimator_defaults",
    "huang_table3",
    "jsonable",
    "register",
    "resolved_aggregator",
    "unknown_key_message",
    "validate",
    "with_schema_defaults",
]
