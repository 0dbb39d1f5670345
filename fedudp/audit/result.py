"""What one audit returns, and the pieces every audit shares: the ledger's claim for the
audited releases, the ``--break`` weakenings, and the audit's power."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedudp.aggregators.base import Aggregator
    from fedudp.privacy.audit_stats import SampleAudit

__all__ = [
    "ALPHA",
    "NOISE_BREAKABLE",
    "AuditResult",
    "detection_power",
    "is_stateful",
    "one_release_epsilon",
    "parse_break",
    "releases_epsilon",
    "weaken",
]

# the audit's level: every lower bound it prints holds with probability >= 99%, jointly over the
# bounds tried, so a correct mechanism is flagged in at most 1% of audits (a false alarm)
ALPHA = 0.01


@dataclass
class AuditResult:
    """One audit: the mechanism, its claim and the lower bound the two samples give.

    Parameters
    ----------
    mechanism : str
        What was audited (the aggregator's name, with the audit's own details).
    adjacency : str
        The adjacency of the claim (``add_or_remove_one`` or ``replace_one``).
    trials : int
        Releases per side.
    delta : float
        The ledger's δ.
    claimed_epsilon : float
        The accountant's ε for the audited release(s).
    samples : SampleAudit
        ``fedudp.privacy.audit_stats.audit_samples``'s bounds on the two samples.
    canary_norm : float
        The canary's norm (owner-side DP-SGD: its gradient norm over the clip).
    broken : str
        The ``--break`` applied ("" for none).
    seconds : float
        The audit's wall time.
    power : dict of str to float or None, default None
        The noise factors detected with probability about 1/2 (None: not computed).
    gaussian_by_construction : bool, default False
        The release is Gaussian by construction (the Gaussian-DP fit was tried).
    claim_heuristic : bool, default False
        The claimed ε is the paper's heuristic accounting's.
    """

    mechanism: str
    adjacency: str
    trials: int
    delta: float
    claimed_epsilon: float
    samples: SampleAudit
    canary_norm: float
    broken: str
    seconds: float
    power: dict[str, float] | None = None
    gaussian_by_construction: bool = False
    claim_heuristic: bool = False  # the claimed ε is the paper's heuristic accounting's

    @property
    def lower_bound(self) -> float:
        """The best ε lower bound (99%, jointly over the bounds tried)."""
        return self.samples.lower_bound

    @property
    def violation(self) -> bool:
        """The lower bound exceeds the claim: less private than the ledger says."""
        return self.lower_bound > self.claimed_epsilon * (1 + 1e-9)

    @property
    def low_power(self) -> bool:
        """No violation, and the bound is below half the claim (the audit says little)."""
        return not self.violation and self.lower_bound < 0.5 * self.claimed_epsilon


def one_release_epsilon(agg: Aggregator, delta: float) -> float:
    """The accountant's ε of one release of ``agg`` (its one-off block included).

    Parameters
    ----------
    agg : Aggregator
        The mechanism.
    delta : float
        The ledger's δ.

    Returns
    -------
    float
        ε at ``delta``.
    """
    from fedudp.privacy.accountant import Accountant, Parallel, ParallelAccountant, pld_interval

    event = agg.dp_event()
    acc = (
        ParallelAccountant(len(event.parts), pld_interval(1.0))
        if isinstance(event, Parallel)
        else Accountant(pld_interval(1.0))
    )
    once = agg.one_off_event()
    if once is not None:
        acc.compose(once)
    acc.compose(event)
    return acc.epsilon(delta)


def releases_epsilon(agg: Aggregator, delta: float, releases: int) -> float:
    """The accountant's ε of the first ``releases`` releases of a fresh ``agg`` (its one-off
    block once, then round r's event for r = 1..releases: a tree's or a banded mechanism's whole
    event at the first round of each tree or cycle, as a run's ledger composes them).

    Parameters
    ----------
    agg : Aggregator
        The mechanism (a template: it is not changed).
    delta : float
        The ledger's δ.
    releases : int
        The releases composed.

    Returns
    -------
    float
        ε at ``delta``.
    """
    from fedudp.privacy.accountant import Accountant, pld_interval

    if releases == 1 and not hasattr(agg, "round_event"):
        return one_release_epsilon(agg, delta)
    acc = Accountant(pld_interval(1.0))
    once = agg.one_off_event()
    if once is not None:
        acc.compose(once)
    for r in range(1, int(releases) + 1):
        acc.compose(agg.round_event(r) if hasattr(agg, "round_event") else agg.dp_event())
    return acc.epsilon(delta)


def is_stateful(agg: Aggregator) -> bool:
    """The aggregator carries state from one release to the next (an adaptive clip, a tree's or
    a banded mechanism's noise history): each audit trial must start from a fresh copy.

    Parameters
    ----------
    agg : Aggregator
        The mechanism.

    Returns
    -------
    bool
        True where its checkpoint state is not empty or it has a per-round event.
    """
    return bool(agg.checkpoint_state()) or hasattr(agg, "round_event")


def parse_break(broken: str) -> tuple[str, float | None]:
    """Read ``--break``: ``""``, ``noise=FACTOR`` (FACTOR > 0), ``clip=off`` or
    ``schedule=data``.

    Parameters
    ----------
    broken : str
        The flag's value.

    Returns
    -------
    tuple of (str, float or None)
        (kind, factor): kind ``""``, ``"noise"``, ``"clip=off"`` or ``"schedule=data"``; the
        factor of ``noise=FACTOR``, else None.

    Raises
    ------
    ValueError
        Another value, or a noise factor that is not a number > 0 (one line naming the flag).
    """
    if not broken:
        return "", None
    if broken.startswith("noise="):
        try:
            f = float(broken.split("=", 1)[1])
        except ValueError:
            f = -1.0
        if not f > 0:
            raise ValueError(
                f"--break {broken}: the noise factor must be a number > 0, e.g. noise=0.7"
            )
        return "noise", f
    if broken in ("clip=off", "schedule=data"):
        return broken, None
    raise ValueError(f"--break {broken}: use noise=FACTOR, clip=off or schedule=data")


NOISE_BREAKABLE = (
    "gaussian",
    "outlier_removal",
    "friendlycore",  # noise = multiplier × sensitivity
    "gaussian_adaptive",
    "dp_ftrl_tree",
    "dp_mf_banded",
    "dp_mf_blt",
)


def weaken(agg: Aggregator, factor: float) -> None:
    """``--break noise=FACTOR``: every noise of ``agg`` times ``factor``, in place (an adaptive
    clip's update and count noises both, so its effective multiplier is ``factor`` × z).

    Parameters
    ----------
    agg : Aggregator
        One of ``NOISE_BREAKABLE``, changed in place.
    factor : float
        The noise factor.

    Raises
    ------
    ValueError
        ``agg`` is not one of ``NOISE_BREAKABLE``.
    """
    if agg.name not in NOISE_BREAKABLE:
        raise ValueError(f"--break noise applies to {', '.join(NOISE_BREAKABLE)}")
    mech: Any = agg  # one of NOISE_BREAKABLE: its noise attributes, by name
    mech.noise_multiplier = mech.noise_multiplier * factor
    if agg.name == "gaussian_adaptive":
        mech.update_multiplier *= factor
        mech.count_noise *= factor


def detection_power(
    samples: SampleAudit, claimed: float, delta: float, trials: int, factor: float, gaussian: bool
) -> dict[str, float]:
    """Noise factors f detected with probability about 1/2 (the noise cut to f× the configured
    noise). A Gaussian release's separation is the one its claim implies (μ of μ-GDP at the
    claimed (ε, δ)); otherwise the projection's measured separation, rescaled to the configured
    noise, stands in for it (a planning number).

    Parameters
    ----------
    samples : SampleAudit
        The audit's samples' bounds.
    claimed : float
        The claimed ε.
    delta : float
        The ledger's δ.
    trials : int
        Releases per side.
    factor : float
        The ``--break noise`` factor applied (1.0: none).
    gaussian : bool
        The release is Gaussian by construction.

    Returns
    -------
    dict of str to float
        ``threshold`` (the threshold test's factor) and, for a Gaussian release, ``gaussian``.
    """
    from fedudp.privacy.audit_stats import gaussian_mu_for_epsilon, power_gaussian, power_threshold

    mu = (
        gaussian_mu_for_epsilon(claimed, delta)
        if gaussian
        else samples.separation.mu_hat * (factor if factor else 1.0)
    )
    tests = samples.tests
    out = {"threshold": power_threshold(claimed, delta, mu, trials, ALPHA, tests)}
    if gaussian:
        out["gaussian"] = power_gaussian(claimed, delta, mu, trials, ALPHA, tests)
    return out
