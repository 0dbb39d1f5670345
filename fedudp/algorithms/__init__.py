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
    """What an algorithm needs from the rest of the run (checked by the config builder).

    Attributes
    ----------
    methods : tuple[str, ...]
        The ``method`` values it runs under.
    aggregator : str
        The registered estimator its steps release with.
    engines : tuple[str, ...], default ("local",)
        The engines it runs on.
    shared_update : str, default "gradient"
        The owners' shared update it needs.
    units : tuple[str, ...], default ("user", "record")
        The privacy units it supports.
    equal_owners : bool, default False
        Whether every owner must hold the same number of users.
    """

    methods: tuple[str, ...]
    aggregator: str  # the registered estimator its steps release with
    engines: tuple[str, ...] = ("local",)
    shared_update: str = "gradient"
    units: tuple[str, ...] = ("user", "record")
    equal_owners: bool = False  # every owner holds the same number of users


@dataclass(frozen=True)
class AlgorithmParams:
    """The algorithms' options (``algorithm.*``); ``None``: the paper's formula (each module's
    docstring gives it).

    Attributes
    ----------
    step_size, lipschitz, sigma, smoothing_radius : float or None
        Step size η, Lipschitz constant G, noise scale σ, smoothing radius r (None: the paper's).
    radius : float, default 10.0
        R, the radius of the parameter ball.
    phases : int or None
        How many phases (None: the paper's).
    lam : float or None
        λ of the public regulariser (None: the paper's).
    strong_convexity, smoothness : float
        μ (default 0.1) and H (default 1.0).
    averaged : bool or None
        Return the averaged iterate (None: the algorithm's default).
    noise_personal : bool, default False
        Noise the personal blocks too (the full-DP baseline).
    """

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
    own ``tau``).

    Attributes
    ----------
    params : AlgorithmParams
        The algorithm's options.
    epsilon, delta : float
        The run's target (ε, δ).
    paper : bool
        ``privacy.accounting=paper``.
    rounds, seed : int
        The schedule's rounds; the run's seed.
    owner_users : np.ndarray
        Users of each owner (public), shape ``[owners]``.
    records_per_user : int
        Records per user (m).
    dim, personal_dim : int
        The shared dimension; one owner's personal dimension (default 0).
    clip, bound : float
        The clipping norm and the public bound.
    tau : float or None
        The configured winsorization radius τ (None: the algorithm's own).
    beta : float
        The estimator's failure probability.
    estimator : Callable[..., Aggregator]
        ``estimator(name, sampling, rounds, **overrides)``: a calibrated registered estimator.
    method : str, default "joint_dp"
        The run's ``method``.
    """

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
    """What an algorithm's ``setup`` returns.

    Attributes
    ----------
    aggregator : Aggregator
        The billboard's estimator (the first phase's where there are several).
    plan : Plan
        A ``fedudp.algorithms.schedule.AlgorithmPlan``.
    sampling : Sampling
        The billboard's units and rate.
    summary : dict
        The algorithm's entry in summary.json.
    notes : list[str]
        Notes for the run's record.
    owner_hooks : OwnerHooks or None
        The owners' hooks (smoothing, personal steps), None: the plain owners.
    """

    aggregator: Aggregator  # the billboard's (the first phase's where there are several)
    plan: Plan  # a fedudp.algorithms.schedule.AlgorithmPlan
    sampling: Sampling  # the billboard's units and rate
    summary: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    owner_hooks: OwnerHooks | None = None


@dataclass(frozen=True)
class Algorithm:
    """A registered training algorithm: its requirements, its ``setup`` and its own ``check``
    of the context's plain values (None: only the options' ranges).

    Attributes
    ----------
    name : str
        Its ``algorithm.name``.
    requires : Requirements
        What it needs from the run.
    setup : Callable[[Context], Setup]
        Builds its estimators, plan and owner hooks.
    check : Callable[[Context], None] or None
        Its own checks (``ParameterError``).
    """

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
    module).

    Parameters
    ----------
    name : str
        The ``algorithm.name`` it answers to.
    requires : Requirements
        What it needs from the run.
    setup : Callable[[Context], Setup]
        Builds its estimators, plan and owner hooks.
    check : Callable[[Context], None], optional
        Its own checks of the context.

    Returns
    -------
    Algorithm
        The registered entry.
    """
    return ALGORITHMS.add(name, Algorithm(name, requires, setup, check))


def _module(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(ALGORITHMS.unknown(name))
    return ALGORITHMS[name]


def requirements(name: str) -> Requirements:
    """What the registered algorithm ``name`` needs from the run.

    Parameters
    ----------
    name : str
        An ``algorithm.name``.

    Returns
    -------
    Requirements

    Raises
    ------
    ValueError
        When no algorithm is registered as ``name``.
    """
    return _module(name).requires


def check(name: str, ctx: Context) -> None:
    """The algorithm's own checks on plain values (``ParameterError``).

    Parameters
    ----------
    name : str
        An ``algorithm.name``.
    ctx : Context
        The run's public values.

    Raises
    ------
    ParameterError
        When an option is out of range or the algorithm's own check fails.
    ValueError
        When no algorithm is registered as ``name``.
    """
    ctx.params.check()
    fn = _module(name).check
    if fn is not None:
        fn(ctx)


def setup(name: str, ctx: Context) -> Setup:
    """The algorithm's estimators, plan and owner hooks.

    Parameters
    ----------
    name : str
        An ``algorithm.name``.
    ctx : Context
        The run's public values.

    Returns
    -------
    Setup
        With ``summary["name"]`` set to ``name``.

    Raises
    ------
    ParameterError
        When the checks (``check``) or the algorithm's setup reject the context.
    ValueError
        When no algorithm is registered as ``name``.
    """
    check(name, ctx)
    s = _module(name).setup(ctx)
    s.summary = {"name": name, **s.summary}
    return s


def need(cond: bool, key: str, msg: str) -> None:
    """``ParameterError`` naming ``key`` (``train.rounds``, or one of the algorithm's options).

    Parameters
    ----------
    cond : bool
        The condition that must hold.
    key, msg : str
        The option it names; the message after it.

    Raises
    ------
    ParameterError
        When ``cond`` is false.
    """
    if not cond:
        raise ParameterError(key, f"{key}: {msg}")


def split_rounds(total: int, parts: int, key: str = "rounds") -> list[int]:
    """``total`` rounds split over ``parts`` phases, the later phases one longer where uneven.

    Parameters
    ----------
    total, parts : int
        The rounds and the phases.
    key : str, default "rounds"
        The option the error names.

    Returns
    -------
    list[int]
        Each phase's rounds, summing to ``total``.

    Raises
    ------
    ParameterError
        When ``total`` < ``parts``.
    """
    need(total >= parts, key, f"{total} rounds cannot be split over {parts} phases")
    base, extra = divmod(total, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def public_permutation(seed: int, n: int) -> np.ndarray:
    """A public permutation of ``n`` units keyed by ``seed`` (``Purpose.SCHEDULE``).

    Parameters
    ----------
    seed, n : int
        The run's seed; how many units.

    Returns
    -------
    np.ndarray
        A permutation of ``0..n-1``.
    """
    from fedudp.randomness import Purpose, numpy_rng

    return numpy_rng(seed, Purpose.SCHEDULE, 0).permutation(n)


# the built-in algorithms register themselves (after everything they import from here)
from fedudp.algorithms import asi_alg3, asi_alg4, huang_alg1, huang_alg2, levy_alg4  # noqa: E402,F401
