"""Lower bounds on ε from samples of a mechanism's output on two neighbouring datasets.

A privacy audit runs a release many times on D and on a neighbour D' and asks how distinguishable
the two output distributions are. This module turns the two samples into lower bounds on the ε
that the release can satisfy at a given δ, each holding with probability at least 1 - α:

* ``threshold_bound``: distribution-free. On a selection fold every rejection region {s > t} and {s < t} over a grid of thresholds, in both
  orientations (D against D' and D' against D), is scored by its Clopper–Pearson bound; the single
  best region is then tested once on a separate test fold, so no correction for the number of regions
  is needed. Valid for any mechanism.
* ``gaussian_dp_bound``: parametric, near-optimal for Gaussian releases. If the statistic is
  N(m, s²) on D and N(m', s²) on D', the pair is μ-GDP-tight with μ = |m - m'|/s (Dong, Roth and
  Su 2019). A one-sided lower confidence bound on μ is turned into ε at δ by dp-accounting's
  Gaussian privacy loss distribution with ``pessimistic_estimate=False`` (an optimistic estimate:
  a lower bound stays a lower bound). It is used only where the release is Gaussian by
  construction (the caller says so) and the samples do not reject it (normality and equal
  variances); otherwise it is skipped and said so.

Scores: the projection of each release on the direction the two sides' means differ along (a
shift of the mean), and the squared distance from D''s mean (a change of spread). Directions
and centres are estimated on a fold of their own (the first 20% of each side's releases), the
regions selected on the next 30%, and every bound computed on the last 50%. ``audit_samples`` runs every applicable
bound at α divided by their number (Bonferroni) and reports the largest.

This module knows no aggregator, owner or run: it sees arrays.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "clopper_pearson",
    "threshold_bound",
    "gaussian_mu_for_epsilon",
    "gaussian_epsilon",
    "GaussianFit",
    "gaussian_fit",
    "Bound",
    "SampleAudit",
    "audit_samples",
    "power_gaussian",
    "power_threshold",
]


def clopper_pearson(k: np.ndarray, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided (lower, upper) Clopper–Pearson bounds, each at level 1 - ``alpha``, on a
    binomial proportion with ``k`` successes of ``n``.

    Parameters
    ----------
    k : numpy.ndarray
        Success counts.
    n : int
        Trials.
    alpha : float
        Each bound's error probability.

    Returns
    -------
    tuple of numpy.ndarray
        (lower, upper) bounds on the proportion, shaped as ``k``.
    """
    from scipy.stats import beta

    k = np.asarray(k, dtype=np.float64)
    lo = np.where(k > 0, beta.ppf(alpha, np.maximum(k, 1e-300), n - k + 1), 0.0)
    hi = np.where(k < n, beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1e-300)), 1.0)
    return np.nan_to_num(lo, nan=0.0), np.nan_to_num(hi, nan=1.0)


def _region_epsilons(
    x: np.ndarray, y: np.ndarray, thresholds: np.ndarray, delta: float, alpha: float
) -> np.ndarray:
    """[4, T]: the ε lower bound log((P_x[S] - δ)/P_y[S]) with Clopper–Pearson bounds, for
    S = {s > t} and {s < t}, with x as the first and as the second distribution."""
    xs, ys = np.sort(x), np.sort(y)
    above_x = len(xs) - np.searchsorted(xs, thresholds, side="right")
    above_y = len(ys) - np.searchsorted(ys, thresholds, side="right")
    below_x = np.searchsorted(xs, thresholds, side="left")
    below_y = np.searchsorted(ys, thresholds, side="left")
    out = np.zeros((4, len(thresholds)))
    for r, (kp, np_, kq, nq) in enumerate(
        (
            (above_x, len(xs), above_y, len(ys)),
            (below_x, len(xs), below_y, len(ys)),
            (above_y, len(ys), above_x, len(xs)),
            (below_y, len(ys), below_x, len(xs)),
        )
    ):
        p_lo, _ = clopper_pearson(kp, np_, alpha)
        _, q_hi = clopper_pearson(kq, nq, alpha)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.log((p_lo - delta) / q_hi)
        out[r] = np.where((p_lo - delta > 0) & (q_hi > 0), e, 0.0)
    return np.maximum(out, 0.0)


def _thresholds(x: np.ndarray, y: np.ndarray, count: int = 400) -> np.ndarray:
    pooled = np.concatenate([x, y])
    n = len(pooled)
    # dense in both tails, where (ε, δ) at small δ is decided: quantiles spaced in log(tail mass)
    tail = np.geomspace(1.0 / n, 0.5, count // 2)
    return np.unique(np.quantile(pooled, np.concatenate([tail, 1.0 - tail])))


def threshold_bound(
    d_select: np.ndarray,
    dp_select: np.ndarray,
    d_test: np.ndarray,
    dp_test: np.ndarray,
    delta: float,
    alpha: float,
) -> tuple[float, str]:
    """Distribution-free lower bound on ε (probability ≥ 1 - ``alpha``): the best rejection
    region of the selection samples, tested once on the test samples. Returns (ε, the region).

    Parameters
    ----------
    d_select, dp_select : numpy.ndarray
        Scores on D and D' ``[n]`` that select the region.
    d_test, dp_test : numpy.ndarray
        Held-out scores on D and D' that test it.
    delta : float
        The δ of the bound.
    alpha : float
        The bound's error probability.

    Returns
    -------
    tuple of (float, str)
        The ε lower bound (0.0 if no region separates) and the region in words.
    """
    ts = _thresholds(d_select, dp_select)
    sel = _region_epsilons(d_select, dp_select, ts, delta, alpha)
    r, i = np.unravel_index(int(np.argmax(sel)), sel.shape)
    if sel[r, i] <= 0:
        return 0.0, "no region separates the selection samples"
    eps = float(_region_epsilons(d_test, dp_test, ts[i : i + 1], delta, alpha)[r, 0])
    first, second = ("D", "D'") if r < 2 else ("D'", "D")
    side = ">" if r % 2 == 0 else "<"
    return eps, f"score {side} {ts[i]:.6g}, P_{first}[S] against P_{second}[S]"


def gaussian_mu_for_epsilon(epsilon: float, delta: float) -> float:
    """The μ of the Gaussian mechanism (sensitivity 1, std 1/μ) whose (ε, δ) curve passes through
    (``epsilon``, ``delta``), by bisection on dp-accounting's optimistic Gaussian PLD. The
    bracket starts at ±2% around μ-GDP's closed form (Dong, Roth and Su 2019, Corollary 2.13:
    δ(ε) = Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2)), which only saves PLD evaluations: the bracket is
    checked with the PLD and widened to [1e-3, 20] if it does not hold.

    Parameters
    ----------
    epsilon, delta : float
        The point of the curve.

    Returns
    -------
    float
        μ, to a relative 1e-5 (the bracket's lower end), within [1e-3, 20].
    """
    lo, hi = 1e-3, 20.0
    guess = _closed_form_mu(epsilon, delta)
    if guess is not None and 1e-3 < guess / 1.02 and guess * 1.02 < 20.0:
        a, b = guess / 1.02, guess * 1.02
        if gaussian_epsilon(a, delta) < epsilon <= gaussian_epsilon(b, delta):
            lo, hi = a, b
    while hi / lo > 1 + 1e-5:
        mid = math.sqrt(lo * hi)
        if gaussian_epsilon(mid, delta) < epsilon:
            lo = mid
        else:
            hi = mid
    return lo


def _closed_form_mu(epsilon: float, delta: float) -> float | None:
    """μ whose μ-GDP curve passes through (ε, δ) in closed form (a starting bracket only)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    def gap(mu: float) -> float:
        return (
            norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2)
        ) - delta

    try:
        return float(brentq(gap, 1e-3, 20.0, xtol=1e-9))
    except ValueError:
        return None


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε at δ of μ-GDP: dp-accounting's Gaussian privacy loss distribution (std 1/μ, sensitivity
    1), optimistic estimate, so that a lower bound on μ gives a lower bound on ε.

    Parameters
    ----------
    mu : float
        The GDP parameter μ (<= 0: no loss).
    delta : float
        The δ at which ε is read.

    Returns
    -------
    float
        ε >= 0.
    """
    if mu <= 0:
        return 0.0
    return _gaussian_epsilon(round(float(mu), 12), float(delta))


@functools.lru_cache(maxsize=4096)
def _gaussian_epsilon(mu: float, delta: float) -> float:
    from dp_accounting.pld import privacy_loss_distribution as pld

    dist = pld.from_gaussian_mechanism(
        1.0 / mu,
        sensitivity=1.0,
        pessimistic_estimate=False,
        value_discretization_interval=1e-4,
        use_connect_dots=False,
    )
    return max(0.0, float(dist.get_epsilon_for_delta(delta)))


@dataclass
class GaussianFit:
    """The Gaussian-DP fit of two score samples (``gaussian_fit``).

    Attributes
    ----------
    mu_hat, mu_lower : float
        μ̂ and its lower confidence bound.
    standard_error : float
        The standard error of μ̂.
    model_ok : bool
        Neither normality nor equal variances is rejected.
    why : str
        Why the model is rejected, or that it is not.
    """

    mu_hat: float
    mu_lower: float
    standard_error: float
    model_ok: bool
    why: str


def gaussian_fit(
    d: np.ndarray, dp: np.ndarray, alpha: float, check_alpha: float = 0.001
) -> GaussianFit:
    """μ̂ = |mean_D - mean_D'| / pooled std and its one-sided (1 - ``alpha``) lower confidence
    bound (normal approximation of the standardized mean difference). ``model_ok`` is False when
    either side rejects normality (D'Agostino–Pearson) or the two variances differ (Levene's
    test), each at ``check_alpha``: then the fit says nothing and is not used.

    Parameters
    ----------
    d, dp : numpy.ndarray
        Scores on D and D' ``[n]``.
    alpha : float
        The lower bound's error probability.
    check_alpha : float, default 0.001
        The level of the normality and variance tests.

    Returns
    -------
    GaussianFit
        The fit.
    """
    from scipy.stats import levene, norm, normaltest

    n1, n2 = len(d), len(dp)
    s = math.sqrt(((n1 - 1) * d.var(ddof=1) + (n2 - 1) * dp.var(ddof=1)) / (n1 + n2 - 2))
    mu = abs(float(d.mean() - dp.mean())) / s if s > 0 else math.inf
    se = math.sqrt(1 / n1 + 1 / n2 + mu * mu / (2 * (n1 + n2)))
    lower = max(0.0, mu - float(norm.ppf(1 - alpha)) * se)
    why = []
    for name, v in (("D", d), ("D'", dp)):
        if normaltest(v).pvalue < check_alpha:
            why.append(f"{name} is not normal (D'Agostino-Pearson p < {check_alpha:g})")
    if levene(d, dp).pvalue < check_alpha:
        why.append(f"the variances differ (Levene p < {check_alpha:g})")
    return GaussianFit(mu, lower, se, not why, "; ".join(why) or "normal, equal variances")


@dataclass
class Bound:
    """One ε lower bound of an audit (``SampleAudit.bounds``).

    Attributes
    ----------
    statistic : str
        The score it is computed on.
    method : str
        ``"threshold (held-out)"`` or ``"Gaussian-DP fit"``.
    epsilon : float
        The bound.
    detail : str
        The region or the fit, in words.
    """

    statistic: str
    method: str
    epsilon: float
    detail: str


@dataclass
class SampleAudit:
    """Every bound tried on the samples, the reported one (their maximum) and the level.

    Attributes
    ----------
    bounds : list of Bound
        Every bound tried.
    alpha : float
        The joint error probability.
    tests : int
        The bounds the level is split over (Bonferroni).
    separation : GaussianFit
        The main projection's standardized mean difference (test halves).
    gaussian_used : bool
        The Gaussian-DP fit is among ``bounds``.
    notes : list of str
        Remarks (a Gaussian fit not used, and why).
    best, lower_bound : Bound, float
        The largest bound and its ε (properties).
    """

    bounds: list[Bound]
    alpha: float
    tests: int  # bounds the level is split over (Bonferroni)
    separation: GaussianFit  # the projection's standardized mean difference (test halves)
    gaussian_used: bool = False  # the Gaussian-DP fit is among ``bounds``
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Bound:
        return max(self.bounds, key=lambda b: b.epsilon)

    @property
    def lower_bound(self) -> float:
        return self.best.epsilon


_PROJECTION = "projection on the mean shift"
_DISCRIMINANT = "linear discriminant (covariance-whitened mean shift)"


def _discriminant_direction(d: np.ndarray, dp: np.ndarray) -> np.ndarray:
    """Fisher's linear discriminant Σ̂⁻¹(m̂_D - m̂_D'), unit norm: Σ̂ the two sides' pooled
    covariance. Where both sides are Gaussian with one covariance (a correlated-noise sequence of
    releases, or a pair of releases with different noise scales) the projection on it is the
    likelihood-ratio statistic, so it is the optimal linear test; a small ridge (1e-9 of the mean
    variance) keeps Σ̂ invertible."""
    diff = d.mean(0) - dp.mean(0)
    cov = 0.5 * (np.cov(d, rowvar=False) + np.cov(dp, rowvar=False))
    cov = np.atleast_2d(cov)
    ridge = 1e-9 * max(float(np.trace(cov)) / len(cov), 1e-300)
    w = np.linalg.solve(cov + ridge * np.eye(len(cov)), diff)
    norm = np.linalg.norm(w)
    return w / norm if norm > 0 else np.eye(d.shape[1])[0]


def _scores(
    d: np.ndarray, dp: np.ndarray, fit: int, discriminant: bool = False
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per statistic, the scores of all releases on D and D' ([n] each), from a direction and a
    centre estimated on the first ``fit`` releases of each side (which are then not scored for a
    bound: a direction fitted to the same releases would inflate their separation).
    ``discriminant``: the direction is the linear discriminant instead of the plain mean shift."""
    d, dp = d.reshape(len(d), -1), dp.reshape(len(dp), -1)
    centre = dp[:fit].mean(0)
    dist = (((d - centre) ** 2).sum(1), ((dp - centre) ** 2).sum(1))
    if discriminant:
        w = _discriminant_direction(d[:fit], dp[:fit])
        return {_DISCRIMINANT: (d @ w, dp @ w), "squared distance from the D' mean": dist}
    diff = d[:fit].mean(0) - dp[:fit].mean(0)
    norm = np.linalg.norm(diff)
    direction = diff / norm if norm > 0 else np.eye(d.shape[1])[0]
    return {_PROJECTION: (d @ direction, dp @ direction), "squared distance from the D' mean": dist}


def audit_samples(
    d: np.ndarray,
    dp: np.ndarray,
    delta: float,
    alpha: float = 0.01,
    gaussian: bool = False,
    discriminant: bool = False,
) -> SampleAudit:
    """Lower bounds on ε from releases on D (``d``, [n, dim] or [n]) and D' (``dp``), jointly at
    level 1 - ``alpha`` (Bonferroni over the bounds tried). The releases of each side are split
    in three folds: the first 20% fit the direction and the centre of the scores, the next 30%
    select each threshold test's region, the last 50% test it (and fit the Gaussian model).
    ``gaussian``: the release is Gaussian with the same covariance on D and D' by construction
    (e.g. an unsampled Gaussian mechanism), so the Gaussian-DP fit on the projection is tried
    too (and kept only if the samples do not reject the model). ``discriminant``: score the
    projection on the linear discriminant (``_discriminant_direction``) instead of the plain mean
    shift, for releases whose coordinates carry noise of different scales or correlated noise (a
    whole sequence of releases flattened into one vector).

    Parameters
    ----------
    d, dp : numpy.ndarray
        Releases on D and D', ``[n, dim]`` or ``[n]``.
    delta : float
        The δ of the bounds.
    alpha : float, default 0.01
        The joint error probability.
    gaussian, discriminant : bool, default False
        Try the Gaussian-DP fit; score on the linear discriminant.

    Returns
    -------
    SampleAudit
        The bounds.

    Raises
    ------
    ValueError
        Fewer than 200 releases per side.
    """
    n = min(len(d), len(dp))
    if n < 200:
        raise ValueError(f"audit: {n} releases per side are too few (need >= 200)")
    fit, half = n // 5, n // 2
    scores = _scores(
        np.asarray(d[:n], np.float64), np.asarray(dp[:n], np.float64), fit, discriminant
    )
    main = _DISCRIMINANT if discriminant else _PROJECTION
    tests = len(scores) + (1 if gaussian else 0)
    a = alpha / tests
    bounds = []
    for name, (sd, sdp) in scores.items():
        eps, region = threshold_bound(sd[fit:half], sdp[fit:half], sd[half:], sdp[half:], delta, a)
        bounds.append(Bound(name, "threshold (held-out)", eps, region))
    sd, sdp = scores[main]
    fitted = gaussian_fit(sd[half:], sdp[half:], a)
    out = SampleAudit(bounds, alpha, tests, fitted)
    if gaussian:
        if fitted.model_ok:
            bounds.append(
                Bound(
                    main,
                    "Gaussian-DP fit",
                    gaussian_epsilon(fitted.mu_lower, delta),
                    f"mu = {fitted.mu_hat:.4f} (lower {fitted.mu_lower:.4f}, se "
                    f"{fitted.standard_error:.4f}; {fitted.why})",
                )
            )
            out.gaussian_used = True
        else:
            out.notes.append(f"Gaussian-DP fit not used: {fitted.why}")
    return out


def power_gaussian(
    claimed_epsilon: float,
    delta: float,
    mu: float,
    releases_per_side: int,
    alpha: float,
    tests: int = 3,
) -> float:
    """The largest noise factor f (< 1: the noise cut to f times the audited noise) that the
    Gaussian-DP fit detects with probability ≥ 1/2 at ``releases_per_side`` releases per side
    (half of them tested), for a release whose measured μ is ``mu``: μ/f - z·se > μ(claim).

    Parameters
    ----------
    claimed_epsilon, delta : float
        The claimed (ε, δ).
    mu : float
        The measured μ of the release.
    releases_per_side : int
        Releases on each of D and D'.
    alpha : float
        The joint error probability.
    tests : int, default 3
        The bounds the level is split over.

    Returns
    -------
    float
        f in (0, 1].
    """
    from scipy.stats import norm

    target = gaussian_mu_for_epsilon(claimed_epsilon, delta)
    m = releases_per_side - releases_per_side // 2
    z = float(norm.ppf(1 - alpha / tests))
    # se depends on μ/f only weakly; two fixed-point passes
    f = 1.0
    for _ in range(3):
        se = math.sqrt(2 / m + (mu / f) ** 2 / (4 * m))
        f = mu / (target + z * se) if target + z * se > 0 else 1.0
    return min(f, 1.0)


def power_threshold(
    claimed_epsilon: float,
    delta: float,
    mu: float,
    releases_per_side: int,
    alpha: float,
    tests: int = 2,
) -> float:
    """The largest noise factor f that the distribution-free threshold test detects with
    probability about 1/2, were the projection Gaussian with separation μ/f: the expected
    Clopper–Pearson bound at the best threshold, with the test half's expected counts, exceeds
    the claim. (A planning number: the bound itself assumes nothing.)

    Parameters
    ----------
    claimed_epsilon, delta : float
        The claimed (ε, δ).
    mu : float
        The measured μ of the projection.
    releases_per_side : int
        Releases on each of D and D'.
    alpha : float
        The joint error probability.
    tests : int, default 2
        The bounds the level is split over.

    Returns
    -------
    float
        f in [0, 1] (0.0: not even f = 0.01 is detected).
    """
    from scipy.stats import norm

    m = releases_per_side - releases_per_side // 2
    a = alpha / tests
    ts = np.linspace(0.0, 8.0, 400)

    def expected_bound(f: float) -> float:
        shift = mu / f
        p = norm.sf(ts - shift)  # D: N(shift, 1) above t
        q = norm.sf(ts)  # D': N(0, 1) above t
        lo, _ = clopper_pearson(np.floor(p * m), m, a)
        _, hi = clopper_pearson(np.ceil(q * m), m, a)
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.where(lo - delta > 0, np.log((lo - delta) / hi), 0.0)
        return float(np.max(e))

    if expected_bound(1.0) > claimed_epsilon:
        return 1.0
    lo, hi = 0.01, 1.0
    if expected_bound(lo) <= claimed_epsilon:
        return 0.0
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        if expected_bound(mid) > claimed_epsilon:
            lo = mid
        else:
            hi = mid
    return lo
