"""The shared body of the two friend-count filters, ``outlier_removal``
(``fedudp.aggregators.outlier``) and ``friendlycore`` (``fedudp.aggregators.friendlycore``):
keep each unit with a probability set by its friend count, average the kept, add Gaussian noise
(``FilterGaussian``); the plain options both calibrate from, and the bounds both proofs use.

* ``filtered_mean``: keep each unit independently with p_j, average the kept (0 if none;
  summed in float64, a chunk of kept rows at a time).
* ``chernoff_count``: the Chernoff bound on the kept set's change under replace-one
  (each p_j moves by at most 6/n when one other unit changes: ``COUPLING_MEAN``).
* ``paper_sensitivity``: the seed's Δ ([ASI] Lemma 3.5 read with constant 1), for
  ``privacy.accounting=paper`` (heuristic).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedudp.aggregators.base import RowsAggregator
from fedudp.aggregators.friend_counts import friend_counts_bytes
from fedudp.aggregators.plain_values import (
    check_fraction,
    check_positive,
    check_sampling,
    choice,
    concentration_radius,
)
from fedudp.aggregators.rows import CohortRows, as_cohort
from fedudp.protocol.contributions import Sampling

__all__ = [
    "COUPLING_MEAN",
    "FilterGaussian",
    "chernoff_count",
    "default_filter_tau",
    "filter_options",
    "filtered_mean",
    "paper_sensitivity",
]

COUPLING_MEAN = 6.0  # Σ_j |p_j - p'_j| <= 6 (n-1)/n under replace-one


def filtered_mean(
    V: torch.Tensor | CohortRows, p: torch.Tensor, *, rng: torch.Generator
) -> tuple[torch.Tensor, int]:
    """Keep row j with probability p_j (independently); mean of the kept rows (0 if none), in
    the rows' dtype: summed in float64 from the kept rows, a chunk of them at a time.

    Parameters
    ----------
    V : torch.Tensor or CohortRows
        The rows.
    p : torch.Tensor
        The keep probabilities, [n].
    rng : torch.Generator
        The release's generator.

    Returns
    -------
    tuple of (torch.Tensor, int)
        The kept rows' mean and how many were kept.
    """
    rows = as_cohort(V)
    # privacy sampling on the CPU generator whatever the rows' device (engine_opts.device)
    keep = torch.rand(p.shape, generator=rng, dtype=torch.float64) < p.cpu()
    k = int(keep.sum())
    if k == 0:
        return torch.zeros(rows.d, dtype=rows.dtype, device=rows.device), 0
    total = rows.sum_rows(torch.nonzero(keep).squeeze(1).to(rows.device))
    return (total / k).to(rows.dtype), k


def chernoff_count(mean: float, zeta: float) -> int:
    """Smallest k >= mean with P(X >= k) <= zeta for X a sum of independent Bernoullis of total
    mean <= ``mean`` (Chernoff: P(X >= k) <= e^{-μ} (eμ/k)^k).

    Parameters
    ----------
    mean : float
        The Bernoullis' total mean bound.
    zeta : float
        ζ.

    Returns
    -------
    int
        k.
    """
    k = max(1, math.ceil(mean))
    while -mean + k * (1 + math.log(mean / k)) > math.log(zeta):
        k += 1
    return k


def default_filter_tau(bound: float, n: int, rounds: int, beta: float, m: int) -> float:
    """τ = G sqrt(log(2nT/γ)/m) (``filter_tau`` from plain values).

    Parameters
    ----------
    bound : float
        G, the a-priori bound.
    n : int
        The public n.
    rounds : int
        T.
    beta : float
        γ.
    m : int
        The records per unit.

    Returns
    -------
    float
        τ.
    """
    return bound * math.sqrt(math.log(2 * n * rounds / beta) / m)


def filter_options(
    bound: Any,
    tau: Any,
    records_per_unit: Any,
    beta: Any,
    accounting: Any,
    sampling: Any,
    rounds: int,
    name: str,
) -> tuple[float, bool]:
    """The plain options both filters share: (τ, paper accounting?).

    Parameters
    ----------
    bound, tau, records_per_unit, beta, accounting, sampling
        The filters' plain options (``OutlierRemovalAggregator.calibrated``).
    rounds : int
        T.
    name : str
        The estimator's name (for a rate-1 refusal).

    Returns
    -------
    tuple of (float, bool)
        τ, and whether the accounting is the paper's.

    Raises
    ------
    ParameterError
        A plain value out of range.
    """
    check_sampling(sampling, name)
    check_fraction("beta", beta)
    if bound is not None or tau is None:
        check_positive("bound", bound)
    paper = choice("accounting", accounting, ("certified", "paper")) == "paper"
    tau = concentration_radius(
        tau,
        lambda m: default_filter_tau(bound, sampling.population, rounds, beta, m),
        records_per_unit,
    )
    return tau, paper


def paper_sensitivity(tau: float, n: int, eps: float, delta: float, rounds: int) -> float:
    """[ASI] Lemma 3.5 read with constant 1: Δ = τ log(1/ζ')/n, ζ' = δ/(2(e^ε + 1 + T)).

    Parameters
    ----------
    tau : float
        τ.
    n : int
        The public n.
    eps, delta : float
        The target (ε, δ).
    rounds : int
        T.

    Returns
    -------
    float
        Δ.
    """
    zeta = delta / (2 * (math.exp(eps) + 1 + rounds))
    return tau * math.log(1 / zeta) / n


class FilterGaussian(RowsAggregator):
    """Shared body: friend counts, filter, Gaussian noise of std ``noise_std`` per coordinate.

    Parameters
    ----------
    tau : float
        The filter radius τ.
    noise_multiplier : float
        z = σ / Δ.
    delta_sens : float
        Δ.
    sampling : Sampling
        Rate 1 and the public n.
    min_users_required : int
        The n the estimator's proof or guarantee needs.

    Raises
    ------
    ValueError
        A sampling rate below 1.
    """

    noise_multiplier: float
    min_users_required: int

    def __init__(
        self,
        tau: float,
        noise_multiplier: float,
        delta_sens: float,
        sampling: Sampling,
        min_users_required: int,
    ) -> None:
        if sampling.rate < 1.0:
            raise ValueError(
                f"aggregator={self.name} is replace-one with a public n: it needs "
                "train.sampling_rate=1 (no amplification claimed)"
            )
        self.tau, self.sampling = float(tau), sampling
        self.noise_multiplier, self.sensitivity = float(noise_multiplier), float(delta_sens)
        self.min_users_required = int(min_users_required)

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.sensitivity

    def _cohort(self, G: torch.Tensor) -> CohortRows:
        return CohortRows(G, self.sampling.population, self.chunk_rows)  # missing: zero rows

    def _noisy(self, mean: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
        # drawn on the CPU generator, moved to the mean's device (engine_opts.device)
        noise = torch.randn(mean.shape, generator=rng, dtype=torch.float64)
        return (mean.to(torch.float64) + (self.noise_std * noise).to(mean.device)).to(mean.dtype)

    def working_bytes(self, rows: int, dim: int) -> int:
        return friend_counts_bytes(rows, dim, radii=2)

    def _diag(self, G: torch.Tensor, score: tuple[float, float], kept: int, passed: bool) -> dict:
        """``score``: its bracket (low, high); equal when it was computed exactly, else the
        exact score was not needed for the decision and ``score`` is None."""
        n = self.sampling.population
        low, high = score
        exact = low if low == high else None
        return {
            "score": exact,
            "score_fraction": None if exact is None else exact / n,
            "score_low": low,
            "score_high": high,
            "kept_fraction": kept / n,
            "concentration_check_failed": not passed,
            "cohort": int(G.shape[0]),
            "min_users_met": n >= self.min_users_required,
            "min_users_required": self.min_users_required,
        }
