"""User-level DP mean estimators, one module each, registered by name
(docs/architecture.md#aggregator, docs/algorithms.md#user-level-mean-estimators).

Each estimator is built from plain values (``Cls(...)`` with final constants, or
``Cls.calibrated(epsilon=..., delta=..., rounds=..., sampling=..., ...)``). The config builder
(``fedudp.build.estimator``) picks the registered class for ``aggregator=<name>`` and passes
it the run values and options it declares, by keyword; ``privacy.placement=local_dpsgd`` (private methods) uses
``LocalDpSgdMean``: the noise is added inside the owners, the billboard only averages.

Adding an estimator: one new module with a ``@register``-ed ``Aggregator`` subclass: its
``calibrated`` classmethod, the run values it takes (``inputs``, from ``base.RUN_INPUTS``) and
its own options (``options``: ``Option(name, default, type)``, the config's ``estimator.<name>``),
which ``register`` checks against ``calibrated``'s keywords; built-in modules are imported below,
your own through ``plugins=[...]`` (docs/architecture.md#how-to-add-an-extension).
"""

from __future__ import annotations

# each estimator's module registers its class when imported, in the registry's order
# (outlier_removal before friendlycore, then winsorized)
from fedudp.aggregators import adaptive_clip as adaptive_clip
from fedudp.aggregators import banded as banded
from fedudp.aggregators import blt as blt
from fedudp.aggregators import distributed as distributed
from fedudp.aggregators import few_users as few_users
from fedudp.aggregators import gaussian as gaussian
from fedudp.aggregators import outlier as outlier

# isort: split
from fedudp.aggregators import friendlycore as friendlycore
from fedudp.aggregators import tree as tree
from fedudp.aggregators import winsorized as winsorized
from fedudp.aggregators.adaptive_clip import AdaptiveClipGaussian
from fedudp.aggregators.banded import BandedMatrixAggregator
from fedudp.aggregators.base import (
    REGISTRY,
    RUN_INPUTS,
    Aggregate,
    Aggregator,
    Option,
    ParameterError,
    register,
)
from fedudp.aggregators.blt import BltAggregator
from fedudp.aggregators.distributed import DdgAggregator, SkellamAggregator
from fedudp.aggregators.few_users import FewUsersAggregator
from fedudp.aggregators.friendlycore import FriendlyCoreAggregator
from fedudp.aggregators.gaussian import GaussianAggregator, MeanAggregator
from fedudp.aggregators.local_dpsgd import LocalDpSgdMean
from fedudp.aggregators.outlier import OutlierRemovalAggregator
from fedudp.aggregators.tree import TreeAggregator
from fedudp.aggregators.winsorized import WinsorizedAggregator
from fedudp.protocol.contributions import Constraint, Contribution, Sampling, clip_rows, finite_rows

__all__ = [
    "Aggregate",
    "Aggregator",
    "Constraint",
    "Contribution",
    "Sampling",
    "REGISTRY",
    "RUN_INPUTS",
    "Option",
    "register",
    "clip_rows",
    "finite_rows",
    "GaussianAggregator",
    "MeanAggregator",
    "LocalDpSgdMean",
    "WinsorizedAggregator",
    "OutlierRemovalAggregator",
    "FriendlyCoreAggregator",
    "FewUsersAggregator",
    "ParameterError",
    "AdaptiveClipGaussian",
    "TreeAggregator",
    "BandedMatrixAggregator",
    "BltAggregator",
    "DdgAggregator",
    "SkellamAggregator",
]
