"""The seeds' training algorithms on the one round loop (docs/algorithms.md#training-algorithms),
one module each, chosen with ``algorithm.name`` (presets
``+experiment=levy_alg3|levy_alg4|asi_alg3|asi_alg4|huang_alg1|huang_alg2``).

An algorithm adds no round loop, owner computation or accountant of its own. Each module
registers itself (``register(name, REQUIRES, setup, check)`` at its end, in ``ALGORITHMS``, whose
names are the config's ``algorithm.name`` choices) and declares:

* ``REQUIRES``: a ``Requirements`` (engines, methods, the estimator its steps use, gradient
  updates, privacy units, equal owners), checked by the config builder before any work;
* ``check(ctx)``: its own parameters' checks on plain values (``ParameterError``);
* ``setup(ctx)``: from a ``Context`` of plain values, its estimators (built through
  ``ctx.estimator``, calibrated with the run's privacy settings), the billboard's ``Plan``
  (``fedudp.billboard.plan``: cohort per round, event per round, server step) and, where the
  algorithm changes the owner's computation, its ``OwnerHooks`` (``fedudp.owner.owners``:
  a user's gradient, the personal update). Nothing is patched after it is built.

Levy et al. Alg. 3 needs no module: it is ``model.name=linear method=full_dp
train.shared_update=gradient aggregator=winsorized`` (preset ``levy_alg3``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedudp.aggregators.base import Aggregator, ParameterError
from fedudp.billboard.plan import Plan
from fedudp.owner.owners import OwnerHooks
from fedudp.protocol.contributions import Sampling
from fedudp.registry import Registry

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "register",
    "AlgorithmParams",
    "Context",
    "Requirements",
    "Setup",
    "requirements",
    "check",
    "setup",
    "need",
    "split_rounds",
    "public_permutation",
]


@dataclass(frozen=True)
class Requirements:
    """What an algorithm needs from the rest of the run (checked by the config builder)."""

    methods: tuple[str, ...]
    aggregator: str  # the registered estimator its steps release with
    engines: tuple[str, ...] = ("local",)
    shared_update: str = "gradient"
    units: tuple[str, ...] = ("user", "record")
    equal_owners: bool = False  # every owner holds the same number of users


@dataclass(frozen=True)
class AlgorithmParams:
    """The algorithms' options (``algorithm.*``); ``None``: the paper's formula (each module's
    docstring gives it)."""

    step_size: float | None = None
    radius: float = 10.0
    lipschitz: float | None = None
    sigma: float | None = None
    smoothing_radius: float | None = None
    phases: int | None = None
    lam: float | None = None
    strong_convexity: float = 0.1
    smoothness: float = 1.0
    averaged: bool | None = None
    noise_personal: bool = False

    def check(self) -> None:
        """Ranges of every option (``ParameterError`` naming it)."""

        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ParameterError(name, f"{name} must be {rule}, got {getattr(self, name)}")

        need(self.step_size is None or self.step_size > 0, "step_size", "null or > 0")
        need(self.radius > 0, "radius", "> 0")
        need(self.lipschitz is None or self.lipschitz > 0, "lipschitz", "null or > 0")
        need(self.sigma is None or self.sigma > 0, "sigma", "null or > 0")
        need(
            self.smoothing_radius is None or self.smoothing_radius >= 0,
            "smoothing_radius",
            "null or >= 0",
        )
        need(self.phases is None or self.phases >= 1, "phases", "null or >= 1")
        need(self.lam is None or self.lam >= 0, "lam", "null or >= 0")
        need(self.strong_convexity > 0, "strong_convexity", "> 0")
        need(self.smoothness > 0, "smoothness", "> 0")


@dataclass(frozen=True)
class Context:
    """What an algorithm is set up from, all public and known before the data: its options, the
    run's budget and accounting mode, the schedule, the population (users of each owner,
    records per user), the shared and per-owner personal dimensions, the public bounds, and
    ``estimator(name, sampling, rounds, **overrides)``, which returns the registered estimator
    ``name`` calibrated with the run's privacy settings (``overrides``: e.g. the algorithm's
    own ``tau``)."""

    params: AlgorithmParams
    epsilon: float
    delta: float
    paper: bool  # privacy.accounting=paper
    rounds: int
    seed: int
    owner_users: np.ndarray  # users of each owner (public)
    records_per_user: int
    dim: int  # shared dimension
    clip: float
    bound: float
    tau: float | None
    beta: float
    estimator: Callable[..., Aggregator]
    method: str = "joint_dp"
    personal_dim: int = 0  # personal parameters of one owner

    @property
    def n_users(self) -> int:
        return int(self.owner_users.sum())

    @property
    def n_owners(self) -> int:
        return len(self.owner_users)

    @property
    def m(self) -> int:
        """Records per user."""
        return int(self.records_per_user)


@dataclass
class Setup:
    aggregator: Aggregator  # the billboard's (the first phase's where there are several)
    plan: Plan  # a fedudp.algorithms.schedule.AlgorithmPlan
    sampling: Sampling  # the billboard's units and rate
    summary: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    owner_hooks: OwnerHooks | None = None


@dataclass(frozen=True)
class Algorithm:
    """A registered training algorithm: its requirements, its ``setup`` and its own ``check``
    of the context's plain values (None: only the options' ranges)."""

    name: str
    requires: Requirements
    setup: Callable[[Context], Setup]
    check: Callable[[Context], None] | None = None


ALGORITHMS: Registry[Algorithm] = Registry("training algorithm", "algorithm.name")


def register(
    name: str,
    requires: Requirements,
    setup: Callable[[Context], Setup],
    check: Callable[[Context], None] | None = None,
) -> Algorithm:
    """Register a training algorithm as ``algorithm.name=<name>`` (one call at the end of its
    module)."""
    return ALGORITHMS.add(name, Algorithm(name, requires, setup, check))


def _module(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(ALGORITHMS.unknown(name))
    return ALGORITHMS[name]


def requirements(name: str) -> Requirements:
    return _module(name).requires


def check(name: str, ctx: Context) -> None:
    """The algorithm's own checks on plain values (``ParameterError``)."""
    ctx.params.check()
    fn = _module(name).check
    if fn is not None:
        fn(ctx)


def setup(name: str, ctx: Context) -> Setup:
    """The algorithm's estimators, plan and owner hooks."""
    check(name, ctx)
    s = _module(name).setup(ctx)
    s.summary = {"name": name, **s.summary}
    return s


def need(cond: bool, key: str, msg: str) -> None:
    """``ParameterError`` naming ``key`` (``train.rounds``, or one of the algorithm's options)."""
    if not cond:
        raise ParameterError(key, f"{key}: {msg}")


def split_rounds(total: int, parts: int, key: str = "rounds") -> list[int]:
    need(total >= parts, key, f"{total} rounds cannot be split over {parts} phases")
    base, extra = divmod(total, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def public_permutation(seed: int, n: int) -> np.ndarray:
    from fedudp.randomness import Purpose, numpy_rng

    return numpy_rng(seed, Purpose.SCHEDULE, 0).permutation(n)


# the built-in algorithms register themselves (after everything they import from here)
from fedudp.algorithms import asi_alg3, asi_alg4, huang_alg1, huang_alg2, levy_alg4  # noqa: E402,F401
