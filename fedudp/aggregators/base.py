"""The contract every user-level DP mean estimator implements (docs/architecture.md#aggregator).

An *aggregator* runs on the billboard. Each round the owners apply its ``constraint`` to their
sampled units' vectors (the owner side, pfl-research's ``constrain_sensitivity``): estimators
that need the cohort matrix get each unit's row; clip+Gaussian and the plain mean get the sum
of the (clipped) rows and a count, which is the same privacy with a trusted billboard and far
less traffic. The billboard merges the owners' ``Contribution``s and calls ``release`` (the
server side: clip/rotate/filter, noise), then composes ``dp_event()`` into the ledger.

Everything a caller reads is declared on ``Aggregator``: the billboard, the ledger, the run
summary and the engines read nothing else. Each estimator registers under its ``name``
(``register``) and is built in one of two ways:

* ``Cls(...)``: the constructor takes the final constants (noise multipliers, radii) as given;
* ``Cls.calibrated(...)``: keyword-only *plain* values (epsilon, delta, rounds, a ``Sampling``,
  the public bounds and the estimator's options) -> calibrates, then calls the constructor. A bad
  value is a ``ParameterError`` (a ``ValueError``) whose message starts with the parameter's name.

The config builder (``fedudp.build.estimator``) passes to ``calibrated``, by keyword, exactly
what the estimator declares: the run values named in ``inputs`` (``RUN_INPUTS``) and its
``options`` (``estimator.<name>``), which ``register`` checks against ``calibrated``'s keywords
(nothing keeps a default unseen); it reads the class attributes an estimator declares about
itself (``calibrations``, ``fixed_noise``, ``replace_one``); estimators never see the config.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import dp_accounting
import numpy as np
import torch

from fedudp.privacy.accountant import (
    ADJACENCY,
    ApproxDp,
    GroupConversion,
)
from fedudp.protocol.contributions import Constraint, Contribution, Sampling
from fedudp.registry import Registry

__all__ = [
    "BETA",
    "BOUND",
    "COMMON_OPTIONS",
    "REGISTRY",
    "RUN_INPUTS",
    "TAU",
    "Aggregate",
    "Aggregator",
    "as_generator",
    "as_rows",
    "check_declarations",
    "check_noise_scale",
    "ClippedSumAggregator",
    "EstimatorRegistry",
    "Option",
    "ParameterError",
    "register",
    "RowsAggregator",
]


@dataclass
class Aggregate:
    """What one release returns.

    ``mean`` is the released estimate (d,). ``users_used`` counts the rows that entered
    the statistic. ``diagnostics`` are simulator observations (clipped / kept fractions,
    whether a concentration check failed): they are *not* part of the DP release and
    nothing that changes later releases may read them (docs/algorithms.md#what-is-released).
    ``halted``: an
    AboveThreshold said stop ([ASI] Alg. 2); the run ends after composing this release.

    Parameters
    ----------
    mean : torch.Tensor
        The released estimate, [d].
    users_used : int
        The rows that entered the statistic.
    diagnostics : dict, default {}
        Simulator observations, not part of the release.
    halted : bool, default False
        An AboveThreshold said stop.
    """

    mean: torch.Tensor
    users_used: int
    diagnostics: dict[str, Any] = field(default_factory=dict)
    halted: bool = False


class Aggregator(ABC):
    """User-level mean estimator on the billboard (docs/architecture.md#aggregator).

    Every attribute is declared here (below): the billboard, the ledger, the summary and the
    engines read nothing else. ``noise_multiplier`` and ``noise_std`` are None where no single
    Gaussian/Laplace multiplier describes the release.

    Attributes
    ----------
    name : str
        The ``aggregator=`` value.
    private : bool
        A release needs a DP ledger.
    needs_per_user_vectors : bool
        The owners send rows, not sums.
    adjacency : str
        The adjacency of the analysis.
    accountant : str
        How its events are composed (for the ledger).
    sampling : Sampling
        How units enter a release.
    guarantee : str
        ``certified``, or ``heuristic`` (a paper's unproven constant).
    noise_multiplier : float or None
        The release's noise multiplier, where one describes it.
    min_users_required : int or None
        The utility guarantee's minimum n.
    group : GroupConversion or None
        The group-privacy conversion where the events are record-level and the user-level ε
        comes from group privacy.
    """

    name: ClassVar[str]
    private: ClassVar[bool] = True
    needs_per_user_vectors: ClassVar[bool] = True
    adjacency: ClassVar[str] = ADJACENCY
    accountant: ClassVar[str] = (
        "dp_accounting.PLDAccountant (RDP cross-check; epsilon is RDP's "
        "where smaller, e.g. very long schedules)"
    )
    # declared for the config builder (checked before any work):
    calibrations: ClassVar[tuple[str, ...]] = ("accountant",)  # privacy.calibration values
    closed_form_note: ClassVar[str] = "has no closed form for this estimator"  # why not
    fixed_noise: ClassVar[bool] = False  # takes a given noise multiplier (with_noise_multiplier)
    replace_one: ClassVar[bool] = False  # analysed replace-one with a public n: rate 1 only
    # what ``calibrated`` takes, by keyword, every one of them (checked by ``register``): the
    # run's values it needs (names from ``RUN_INPUTS``, given by the config builder) and its own
    # options (``estimator.<name>`` in the config, typed, with their defaults); ``noise_inputs``:
    # what ``with_noise_multiplier`` takes besides the multiplier (``fixed_noise`` estimators)
    inputs: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[tuple[Option, ...]] = ()
    noise_inputs: ClassVar[tuple[str, ...]] = ()
    # the event of a release depends on how many owners answered (a distributed mechanism's
    # noise is the sum of the survivors' shares): the billboard composes
    # ``dp_event_for(answered)`` once the owners answered; ``dp_event()`` is the worst case
    survivor_event: ClassVar[bool] = False
    # the owners Poisson-sample their own users on streams the billboard never sees (the
    # billboard asks every user): amplification by sampling then holds against the billboard
    samples_on_owners: ClassVar[bool] = False
    # whom the guarantee trusts with the noise (the ledger's ``trust``)
    trust: ClassVar[str] = "server: trusted (central DP: the billboard adds the noise)"

    sampling: Sampling
    guarantee: str = "certified"
    noise_multiplier: float | None = None
    min_users_required: int | None = None
    group: GroupConversion | None = None
    # the release noise's factor beyond what is accounted: 1.0 always, except a deliberately
    # weakened mechanism for checking an audit (audit.noise_scale; clip + Gaussian only)
    noise_scale: float = 1.0

    @property
    def noise_std(self) -> float | None:
        """Standard deviation of the release noise per coordinate, where one exists."""
        return None

    def as_heuristic(self) -> Self:
        """A copy of this estimator whose ``guarantee`` is ``heuristic``: for a training
        algorithm that, in ``privacy.accounting=paper`` mode, follows a paper's unproven
        constant or sampling around an estimator whose own calibration is certified. This
        object is not changed; the copy shares its constants (call it before the first release)."""
        out = copy.copy(self)
        out.guarantee = "heuristic"
        return out

    @classmethod
    # (*args: Any, **values: Any): "any signature" to a type checker, so that each estimator
    # declares its own keyword-only parameters (called with keywords only, by the builder)
    def calibrated(cls, *args: Any, **values: Any) -> Aggregator:
        """Calibrate to (ε, δ) from keyword-only plain values, then construct (see the module
        doc). Each estimator declares its own parameters."""
        raise NotImplementedError(f"{cls.__name__} has no calibrated constructor")

    @classmethod
    def with_noise_multiplier(
        cls, noise_multiplier: float, *args: Any, **values: Any
    ) -> Aggregator:
        """Construct with a given noise multiplier (``fixed_noise`` estimators only).

        Parameters
        ----------
        noise_multiplier : float
            The noise multiplier z.
        *args, **values
            The estimator's other plain values.

        Returns
        -------
        Aggregator
            The estimator.

        Raises
        ------
        ParameterError
            The estimator calibrates its own noise (not ``fixed_noise``).
        """
        raise ParameterError(
            "noise_multiplier", f"noise_multiplier: {cls.__name__} calibrates its own noise"
        )

    @property
    def constraint(self) -> Constraint:
        """What owners do to their units' vectors (rows, or the clipped sum)."""
        return Constraint(rows=True)

    @abstractmethod
    def release(self, c: Contribution, *, rng: torch.Generator) -> Aggregate:
        """Release an estimate of the cohort's mean from the merged contribution."""

    def __call__(
        self, G: torch.Tensor | np.ndarray, *, rng: torch.Generator | int | None = None
    ) -> Aggregate:
        """Owner side and release in one call, on the cohort matrix ``G`` (n_units x d): a torch
        tensor or a numpy array of real numbers (integers are read as float64). ``rng``: the
        release's generator, or an int seed; None draws a fresh seed from the OS (the noise of a
        DP release must not be predictable). Any other input is a ``TypeError``."""
        return self.release(self.constraint.apply(as_rows(G)), rng=as_generator(rng))

    @abstractmethod
    def dp_event(self) -> dp_accounting.DpEvent | ApproxDp:
        """Exactly what one release released, for the accountant."""

    def dp_event_for(self, answered_owners: int) -> Any:
        """What one release released when ``answered_owners`` owners answered (public); the
        same as ``dp_event()`` unless the estimator declares ``survivor_event``.

        Parameters
        ----------
        answered_owners : int
            The owners that answered this round.

        Returns
        -------
        Any
            The release's event for the accountant.
        """
        return self.dp_event()

    def one_off_event(self) -> ApproxDp | None:
        """A block spent once per run (AboveThreshold's ε, failure probabilities in δ)."""
        return None

    def ledger_notes(self) -> list[str]:
        """What the ledger must say about this mechanism beyond unit, adjacency and events."""
        return []

    def checkpoint_state(self) -> dict:
        """State carried from one release to the next (a checkpoint saves it).
        Stateless estimators, whose randomness is the round's keyed generator, have none."""
        return {}

    def restore_checkpoint_state(self, state: dict) -> None:
        """Continue from ``checkpoint_state()``."""
        if state:
            raise ValueError(f"aggregator={self.name} keeps no state, got {sorted(state)}")


class ClippedSumAggregator(Aggregator):
    """An estimator on the cohort's clipped sum: the owners clip each unit's vector to
    ``self.clip`` and send the sum and a count (clip + Gaussian, adaptive clipping, DP-FTRL's
    tree). ``noise_std``: ``noise_multiplier · clip`` unless the estimator says otherwise.

    Attributes
    ----------
    clip : float
        The l2 clip norm of each unit's vector.
    noise_multiplier : float
        z: the noise on the clipped sum has std ``noise_multiplier · clip``.
    """

    needs_per_user_vectors: ClassVar[bool] = False
    clip: float
    noise_multiplier: float  # each clipped-sum estimator has one (calibrated or given)

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise on the *sum* (per coordinate)."""
        return self.noise_multiplier * self.clip

    @property
    def constraint(self) -> Constraint:
        """Owners send the sum of their units' vectors clipped to the current ``clip``."""
        return Constraint(rows=False, clip=self.clip)


class RowsAggregator(Aggregator):
    """An estimator on the cohort matrix (winsorized, outlier removal, few users).

    The rows are read in float64 chunks (``fedudp.aggregators.rows.CohortRows``): ``chunk_rows``
    rows per chunk of every pass, or None for as many as fit in ``rows.WORK_BYTES`` (the
    released values are the same up to the summation order of sums over rows).
    ``working_bytes(rows, dim)``: what one release needs on top of the rows themselves, for
    the pre-flight memory check (``fedudp.aggregators.memory``).

    Attributes
    ----------
    chunk_rows : int or None
        Rows per float64 chunk (None: as many as fit in ``rows.WORK_BYTES``).
    """

    needs_per_user_vectors: ClassVar[bool] = True
    adjacency: ClassVar[str] = "replace_one"
    chunk_rows: int | None = None

    def release(self, c: Contribution, *, rng: torch.Generator) -> Aggregate:
        assert c.rows is not None  # a rows estimator receives the rows
        return self.estimate(c.rows, rng=rng)

    @abstractmethod
    def estimate(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        """The estimator on the rows received (missing units count as zero rows)."""

    def working_bytes(self, rows: int, dim: int) -> int:
        """Peak bytes of one release beyond the [rows, dim] rows (float64 chunks)."""
        from fedudp.aggregators.rows import chunks_bytes

        return chunks_bytes() + 8 * rows


def as_rows(G: Any) -> torch.Tensor:
    """``G`` as a 2-D floating tensor (numpy arrays and integer tensors become float64); anything
    else is a ``TypeError`` saying what an estimator takes.

    Parameters
    ----------
    G : array-like
        The rows, [n, d] (a tensor or a numpy array).

    Returns
    -------
    torch.Tensor
        The rows as a 2-D floating tensor.

    Raises
    ------
    TypeError
        Anything else.
    """
    if isinstance(G, np.ndarray):
        if not (np.issubdtype(G.dtype, np.floating) or np.issubdtype(G.dtype, np.integer)):
            raise TypeError(
                f"an estimator takes a real matrix (n_units x d), got a numpy array of "
                f"dtype {G.dtype}"
            )
        G = torch.from_numpy(
            np.ascontiguousarray(
                G, dtype=np.float64 if not np.issubdtype(G.dtype, np.floating) else G.dtype
            )
        )
    if not isinstance(G, torch.Tensor):
        raise TypeError(
            f"an estimator takes a torch tensor or a numpy array (n_units x d), got "
            f"{type(G).__name__}"
        )
    if G.is_complex() or G.dtype == torch.bool:
        raise TypeError(f"an estimator takes a real matrix (n_units x d), got dtype {G.dtype}")
    if not G.is_floating_point():
        G = G.to(torch.float64)
    if G.dim() != 2:
        raise ValueError(f"an estimator takes a matrix (n_units x d), got shape {tuple(G.shape)}")
    return G


def as_generator(rng: Any) -> torch.Generator:
    """A release's generator: itself, a seeded one for an int, a fresh OS-seeded one for None.

    Parameters
    ----------
    rng : torch.Generator, int or None
        The generator, a seed, or None.

    Returns
    -------
    torch.Generator
        The release's generator.
    """
    if isinstance(rng, torch.Generator):
        return rng
    if rng is None:
        import secrets

        return torch.Generator().manual_seed(secrets.randbits(63))
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return torch.Generator().manual_seed(int(rng))
    raise TypeError(f"rng must be a torch.Generator, an int seed or None, got {type(rng).__name__}")


@dataclass(frozen=True)
class Option:
    """One option of an estimator, ``estimator.<name>`` in the configuration: its default, its
    type (float, int, bool or str; ``nullable``: null allowed) and a line of help. The config
    builder passes it to ``calibrated`` by keyword; an estimator declares it in ``options``.

    Parameters
    ----------
    name : str
        The option's name (``estimator.<name>``).
    default : Any
        Its default.
    type : type, default float
        float, int, bool or str.
    nullable : bool, default False
        Null allowed.
    help : str, default ""
        A line of help.
    """

    name: str
    default: Any
    type: type = float
    nullable: bool = False
    help: str = ""

    def value(self, given: Any) -> Any:
        """``given`` as this option's type (an int for a float option is widened); anything
        else is a ``ValueError`` saying what the option takes.

        Parameters
        ----------
        given : Any
            The configured value.

        Returns
        -------
        Any
            ``given`` as the option's type.

        Raises
        ------
        ValueError
            A value of another type.
        """
        if given is None and self.nullable:
            return None
        t = self.type
        ok = (isinstance(given, t) and not (t is not bool and isinstance(given, bool))) or (
            t is float and isinstance(given, int) and not isinstance(given, bool)
        )
        if not ok:
            kind = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}
            raise ValueError(
                f"must be {kind.get(t, t.__name__)}{' or null' if self.nullable else ''}, "
                f"got {given!r}"
            )
        return t(given)


# the estimators' options several of them (and the training algorithms) share
BOUND = Option("bound", 1.0, float, help="the public a-priori bound B on each unit's vector")
TAU = Option("tau", None, float, True, help="concentration radius (null: the estimator's own)")
BETA = Option("beta", 0.1, float, help="failure probability")
COMMON_OPTIONS = (BOUND, TAU, BETA)

# the run's values the config builder gives an estimator's ``calibrated`` (``inputs``), and the
# configuration key each comes from (an error about one names that key)
RUN_INPUTS = {
    "dim": "model",
    "epsilon": "privacy.epsilon",
    "delta": "privacy.delta",
    "rounds": "train.rounds",
    "sampling": "train.sampling_rate",
    "clip": "privacy.clip",
    "clip_policy": "privacy.clip_policy",
    "clip_quantile": "privacy.clip_quantile",
    "clip_lr": "privacy.clip_lr",
    "clip_count_noise": "privacy.clip_count_noise",
    "accounting": "privacy.accounting",
    "calibration": "privacy.calibration",
    "records_per_unit": "partition.records_per_user",
    "batch_size": "train.batch_size",
    "local_epochs": "train.local_epochs",
    "owner_units": "partition",
    "group_size": "partition.records_per_user",
    "noise_scale": "audit.noise_scale",
    "min_owners": "train.min_owners",
    "seed": "seed",
}


class EstimatorRegistry(Registry):
    """The estimators by ``aggregator=`` name; ``register`` checks each one's declarations.

    Parameters
    ----------
    kind, key : str
        As ``Registry``'s: what an entry is, and its configuration key."""

    def options(self) -> dict[str, Option]:
        """Every registered estimator's options (and the common ones) by name: the
        configuration's ``estimator.*`` keys and their defaults."""
        out = {o.name: o for o in COMMON_OPTIONS}
        for cls in self.values():
            out.update({o.name: o for o in cls.options})
        return out


REGISTRY: EstimatorRegistry = EstimatorRegistry("estimator", "aggregator")


def _keywords(fn: Callable[..., Any], skip: tuple[str, ...] = ()) -> set[str]:
    import inspect

    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.name not in skip and p.kind != p.VAR_KEYWORD}


def check_declarations(cls: type[Aggregator]) -> None:
    """An estimator's ``inputs``, ``options`` and ``noise_inputs`` are exactly what its
    ``calibrated`` (and ``with_noise_multiplier``) take: the builder passes every one of them by
    keyword and nothing else, so no parameter silently keeps its default. ``TypeError``.

    Raises
    ------
    TypeError
        When an input is not a run value, an option is declared differently, or they differ."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    unknown = [k for k in cls.inputs if k not in RUN_INPUTS]
    if unknown:
        raise TypeError(f"{where}.inputs: {unknown} are not run values (RUN_INPUTS)")
    known = {o.name: o for o in COMMON_OPTIONS}
    for o in cls.options:
        if o.name in RUN_INPUTS or known.get(o.name, o) != o:
            raise TypeError(f"{where}.options: {o.name!r} is declared differently elsewhere")
        if o.name in REGISTRY.options() and REGISTRY.options()[o.name] != o:
            raise TypeError(f"{where}.options: {o.name!r} is declared differently elsewhere")
    declared = set(cls.inputs) | {o.name for o in cls.options}
    takes = _keywords(cls.calibrated)
    if takes != declared:
        raise TypeError(
            f"{where}.calibrated takes {sorted(takes)}, its inputs and options declare "
            f"{sorted(declared)}"
        )
    if cls.fixed_noise:
        takes = _keywords(cls.with_noise_multiplier, ("noise_multiplier",))
        if takes != set(cls.noise_inputs) or not takes <= declared:
            raise TypeError(
                f"{where}.with_noise_multiplier takes {sorted(takes)}, noise_inputs declare "
                f"{sorted(cls.noise_inputs)} (a subset of its inputs and options)"
            )


def check_noise_scale(noise_scale: float) -> float:
    """An audit's weakening factor of the release noise: in (0, 1] (1: the accounted noise).

    Parameters
    ----------
    noise_scale : float
        The factor.

    Returns
    -------
    float
        The factor, checked.

    Raises
    ------
    ParameterError
        A factor outside (0, 1].
    """
    if not (isinstance(noise_scale, (int, float)) and 0 < noise_scale <= 1):
        raise ParameterError("noise_scale", f"noise_scale must be in (0, 1], got {noise_scale}")
    return float(noise_scale)


def register(cls: type[Aggregator]) -> type[Aggregator]:
    """Class decorator: ``aggregator=<cls.name>`` builds ``cls`` (its declarations checked).

    Parameters
    ----------
    cls : type of Aggregator
        The estimator.

    Returns
    -------
    type of Aggregator
        ``cls``, registered under ``cls.name``.

    Raises
    ------
    TypeError
        Declarations that do not match ``calibrated``'s keywords.
    """
    check_declarations(cls)
    REGISTRY.add(cls.name, cls)
    return cls


# -- plain-value construction: ``calibrated(...)`` and its errors --------------------------------
class ParameterError(ValueError):
    """``calibrated`` refuses a plain value (or a combination of them): the message names the
    parameter ``param`` (``"epsilon must be a finite number > 0, got -1"``); ``facts`` keeps the
    numbers behind it, so that the config builder can say the same with the config's keys.
    ``facts["config"]``, where present, is the exact ``ConfigError`` the config path raises (an
    unreachable budget's ``BudgetError``).

    Parameters
    ----------
    param : str
        The parameter the message names first.
    message : str
        The one-line message.
    **facts
        The numbers behind it.
    """

    def __init__(self, param: str, message: str, **facts: Any) -> None:
        super().__init__(message)
        self.param, self.facts = param, facts
