"""Levy et al. [LEVY, seed 004] winsorized user-level mean estimation
(docs/algorithms.md#winsorized-mean).

* ``private_range``: PrivateRange (Alg. 6): exponential mechanism over bins of width 2τ of
  [-B, B] with score max(#below, #above), sampled run by run (at most 2n+1 runs of equal
  score per coordinate, Gumbel-max in log space) so the B/τ bins are never materialized;
  vectorized over independent coordinates.
* ``winsorized_mean_1d``: WinsorizedMean1D (Alg. 1): clip to [μ̂ - hτ, μ̂ + hτ], average,
  add Lap(4hτ/(nε)) (h = 2 in the paper; ``halfwidth_factor``).
* ``WinsorizedAggregator`` (``aggregator=winsorized``): WinsorizedMeanHighD (Alg. 2): random
  Hadamard rotation, per-coordinate WinsorizedMean1D at radius τ' = 10 τ sqrt(log(dn/γ)/d),
  inverse rotation. Used by every training method, this is Levy's Winsorized first-order
  optimization (Alg. 3) on the convex model: ``model.name=linear method=full_dp
  aggregator=winsorized train.shared_update=gradient``.

Unit: a user (or an owner with ``privacy.unit=owner``); adjacency **replace-one** with a
fixed public n (the papers' analysis): every unit participates (``train.sampling_rate=1``)
and missing rows (failed owners, NaN/inf) count as zero vectors, so n stays public.

Calibration (docs/algorithms.md#winsorized-mean). Per round and coordinate the release spends ε'/2 in
the exponential mechanism (pure: ``ZCDpEvent((ε'/2)^2/2)``) and ε'/2 in the Laplace noise
(``LaplaceDpEvent(2/ε')``: scale 4hτ'/(nε') over replace-one sensitivity 2hτ'/n), over the
d' = 2^ceil(log2 d) rotated coordinates, composed over the rounds with the RDP accountant.
``accountant``: ε' is the largest that meets (ε, δ) over the schedule. ``closed_form``: the
paper's ε' = ε_step / sqrt(8 d log(1/δ_step)) with ε_step = ε / (2 sqrt(2T log(2/δ))),
δ_step = δ/(2T) (advanced composition, [LEVY] Thm 10); the ledger then reports what the accountant
certifies for those constants.
"""
from __future__ import annotations

import math

import dp_accounting
import torch

from fedudp.aggregators.base import (Aggregate, RowsAggregator, Sampling, calibrate, check_budget,
                                     check_dim, check_fraction, check_positive, check_sampling,
                                     choice, concentration_radius, pad_to_population, register)
from fedudp.privacy.mechanisms import (RandomRotation, exponential_mechanism, laplace, next_pow2,
                                      pure_dp_event, rotated_coordinate_radius)


def private_range(X: torch.Tensor, tau: float, bound: float, eps: float, *,
                  rng: torch.Generator, chunk_elems: int = 1 << 22) -> torch.Tensor:
    """PrivateRange per column of ``X`` [n, k]: the sampled bin centers μ̂ [k] (eps-DP each).

    Bins: l = ceil(B/τ) consecutive bins of width 2τ over [-B, B]; X_i is mapped to its bin
    (values outside [-B, B] to the end bins). Score of a bin x: c(x) = max(#{X' < x}, #{X' > x})
    (sensitivity 1 under replace-one); P(x) ∝ exp(-eps c(x) / 2). Columns are processed in
    blocks of about ``chunk_elems`` segment weights (memory stays O(chunk), not O(n k)).
    """
    n, k = X.shape
    out = torch.empty(k, dtype=torch.float64)
    cols = max(1, chunk_elems // (2 * n + 1))
    for c0 in range(0, k, cols):
        out[c0:c0 + cols] = _private_range_rows(X[:, c0:c0 + cols].T.contiguous(), tau, bound, eps, rng)
    return out


def _private_range_rows(Xr: torch.Tensor, tau: float, bound: float, eps: float,
                        rng: torch.Generator) -> torch.Tensor:
    """PrivateRange for each row of ``Xr`` [k, n] (one independent instance per row)."""
    k, n = Xr.shape
    dt = torch.float64
    nbins = max(1, math.ceil(bound / tau))
    b = torch.floor((Xr.to(dt) + bound) / (2 * tau)).clamp(0, nbins - 1).to(torch.int64)
    s, _ = torch.sort(b, dim=1)                                    # [k, n]
    # segments per row: n occupied bins (first occurrence only), n-1 gaps, before, after
    left = torch.searchsorted(s, s, right=False)
    right = torch.searchsorted(s, s, right=True)
    first = torch.ones_like(s, dtype=torch.bool)
    first[:, 1:] = s[:, 1:] != s[:, :-1]
    occ_len = first.to(dt)
    occ_cost = torch.maximum(left, n - right).to(dt)
    gap_len = (s[:, 1:] - s[:, :-1] - 1).clamp(min=0).to(dt)       # [k, n-1]
    idx = torch.arange(1, n, dtype=dt).unsqueeze(0)
    gap_cost = torch.maximum(idx, n - idx).expand_as(gap_len)
    pre_len, post_len = s[:, :1].to(dt), (nbins - 1 - s[:, -1:]).to(dt)
    lens = torch.cat([occ_len, gap_len, pre_len, post_len], dim=1)  # [k, 2n+1]
    costs = torch.cat([occ_cost, gap_cost, torch.full_like(pre_len, n),
                       torch.full_like(post_len, n)], dim=1)
    logw = torch.where(lens > 0, torch.log(lens.clamp(min=1)) - eps * costs / 2,
                       torch.full_like(lens, -math.inf))
    seg = exponential_mechanism(logw, rng=rng).unsqueeze(1)        # [k, 1]
    starts = torch.cat([s, s[:, :-1] + 1, torch.zeros_like(s[:, :1]), s[:, -1:] + 1], dim=1)
    start = starts.gather(1, seg).squeeze(1)
    length = lens.gather(1, seg).squeeze(1)
    u = torch.rand(k, generator=rng, dtype=dt)
    pick = start + torch.floor(u * length).to(torch.int64).clamp(max=(length - 1).to(torch.int64))
    return -bound + (pick.to(dt) + 0.5) * 2 * tau


def winsorized_mean_1d(X: torch.Tensor, tau: float, bound: float, eps: float, *,
                       rng: torch.Generator, halfwidth_factor: float = 2.0,
                       n_public: int | None = None) -> tuple[torch.Tensor, dict]:
    """WinsorizedMean1D per column of ``X`` [n, k] (eps-DP per column, replace-one).

    ``n_public`` (default: the rows) is the public n the clipped sum is divided by.
    """
    n = int(n_public or X.shape[0])
    X = X.to(torch.float64)
    mu = private_range(X, tau, bound, eps / 2, rng=rng)
    stat, frac = winsorized_sum(X, mu, halfwidth_factor * tau)
    scale = 4 * halfwidth_factor * tau / (n * eps)            # (2hτ/n) / (eps/2)
    out = stat / n + laplace((X.shape[1],), scale, rng=rng)
    return out, {"clipped_fraction": frac, "laplace_scale": scale, "center": mu}


def winsorized_sum(X: torch.Tensor, center: torch.Tensor, halfwidth: float
                   ) -> tuple[torch.Tensor, float]:
    """The pre-noise statistic: column sums of X clipped to [center ± halfwidth]. Replacing
    one row moves each column by at most 2·halfwidth (the sensitivity the Laplace noise uses)."""
    lo, hi = center - halfwidth, center + halfwidth
    clipped = torch.minimum(torch.maximum(X, lo), hi)
    frac = float(((X < lo) | (X > hi)).to(torch.float64).mean()) if X.numel() else 0.0
    return clipped.sum(0), frac


def min_users(coords: int, eps_coord: float, bound: float, tau_coord: float, gamma: float) -> int:
    """Users PrivateRange needs on every coordinate: [LEVY] Thm 1's n ≳ (8/ε') log(B/τ')
    with a union bound over the d' coordinates (log(d' B/(τ' γ))); Thm 2's
    24 sqrt(d log(1/δ))/ε · log(d²B/(τγ)) is this with the paper's ε'."""
    return math.ceil(8 / eps_coord * max(1.0, math.log(coords * bound / (tau_coord * gamma))))


def default_tau(bound: float, n: int, m: int, gamma: float) -> float:
    """[LEVY] Corollary 1: user averages of m samples of norm ≤ B concentrate within
    τ = B sqrt(log(2n/γ)/(2m))."""
    return bound * math.sqrt(math.log(2 * n / gamma) / (2 * m))


@register
class WinsorizedAggregator(RowsAggregator):
    """``aggregator=winsorized``: WinsorizedMeanHighD on the billboard (see module docstring)."""

    name = "winsorized"
    replace_one = True
    calibrations = ("accountant", "closed_form")
    accountant = "dp_accounting.RdpAccountant (ZCDpEvent for the exponential mechanism)"

    def __init__(self, dim: int, tau: float, bound: float, eps_coord: float, sampling: Sampling,
                 gamma: float = 0.1, halfwidth_factor: float = 2.0,
                 min_users_required: int | None = None) -> None:
        if sampling.rate < 1.0:
            raise ValueError("aggregator=winsorized is replace-one with a public n: it needs "
                             "train.sampling_rate=1 (no amplification claimed)")
        self.dim, self.dp = int(dim), next_pow2(int(dim))
        self.tau, self.bound, self.eps_coord = float(tau), float(bound), float(eps_coord)
        self.sampling, self.gamma, self.h = sampling, float(gamma), float(halfwidth_factor)
        n = sampling.population
        self.tau_coord = rotated_coordinate_radius(self.tau, self.dp, n, gamma)
        self.min_users_required = min_users_required
        self.noise_multiplier = 2.0 / self.eps_coord      # Laplace scale / sensitivity

    @classmethod
    def calibrated(cls, *, dim: int, epsilon: float, delta: float, rounds: int,
                   sampling: Sampling, bound: float, tau: float | None = None,
                   records_per_unit: int | None = None, beta: float = 0.1,
                   calibration: str = "accountant") -> "WinsorizedAggregator":
        """WinsorizedMeanHighD on ``dim``-vectors of l2 norm <= ``bound`` for ``rounds`` releases
        over all ``sampling.population`` units (rate 1) meeting (ε, δ).

        ``tau``: the users' concentration radius; None derives [LEVY] Corollary 1's
        bound·sqrt(log(2n/β)/(2m)) from ``records_per_unit`` m. ``beta``: the failure
        probability γ of the rotation's radius and of τ. ``calibration``: ``"accountant"`` (the
        largest per-coordinate ε' the RDP accountant certifies) or ``"closed_form"`` (the paper's
        ε', [LEVY] Thm 10)."""
        check_dim(dim)
        check_budget(epsilon, delta, rounds)
        check_sampling(sampling, cls.name)
        check_positive("bound", bound)
        check_fraction("beta", beta)
        calibration = choice("calibration", calibration, ("accountant", "closed_form"))
        n, coords = sampling.population, next_pow2(dim)
        tau = concentration_radius(tau, lambda m: default_tau(bound, n, m, beta), records_per_unit)
        if calibration == "closed_form":
            eps_coord = closed_form_eps_coord(epsilon, delta, rounds, coords)
        else:
            z = calibrate(lambda z: winsorized_round_event(1.0 / z, coords), epsilon, delta, rounds)
            eps_coord = 1.0 / z
        agg = cls(dim, tau, bound, eps_coord, sampling, gamma=beta)
        agg.min_users_required = min_users(coords, eps_coord, bound, agg.tau_coord, beta)
        return agg

    def estimate(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        n = self.sampling.population
        X = pad_to_population(G.to(torch.float64), n)
        rot = RandomRotation(self.dim, rng=rng)
        Y = rot.rotate(X)
        # per rotated coordinate |Y_j| <= ||X||_2 <= B (the l2 bound), docs/algorithms.md#winsorized-mean
        est, diag = winsorized_mean_1d(Y, self.tau_coord, self.bound, self.eps_coord, rng=rng,
                                       halfwidth_factor=self.h, n_public=n)
        mean = rot.invert(est).to(G.dtype)
        info = {"clipped_fraction": diag["clipped_fraction"], "cohort": int(G.shape[0]),
                "tau_coord": self.tau_coord, "eps_coord": self.eps_coord}
        if self.min_users_required is not None:
            info.update(min_users_met=n >= self.min_users_required,
                        min_users_required=self.min_users_required)
        return Aggregate(mean=mean, users_used=int(G.shape[0]), diagnostics=info)

    def dp_event(self) -> dp_accounting.DpEvent:
        return winsorized_round_event(self.eps_coord, self.dp)


def winsorized_round_event(eps_coord: float, coords: int) -> dp_accounting.DpEvent:
    """One WinsorizedMeanHighD call: per coordinate an ε'/2 exponential mechanism and an
    ε'/2 Laplace mechanism (noise multiplier 2/ε'), over ``coords`` coordinates."""
    return dp_accounting.ComposedDpEvent([
        dp_accounting.SelfComposedDpEvent(pure_dp_event(eps_coord / 2), coords),
        dp_accounting.SelfComposedDpEvent(dp_accounting.LaplaceDpEvent(2.0 / eps_coord), coords)])


def closed_form_eps_coord(eps: float, delta: float, rounds: int, dim: int) -> float:
    """[LEVY] Alg. 3 / Alg. 2 constants (docs/algorithms.md#winsorized-mean): per-step
    ε_s = ε/(2 sqrt(2T log(2/δ))),
    δ_s = δ/(2T); per coordinate ε_s / sqrt(8 d log(1/δ_s)). One call (T = 1 and no step
    split) uses ε / sqrt(8 d log(1/δ))."""
    if rounds == 1:
        eps_s, delta_s = eps, delta
    else:
        eps_s = eps / (2 * math.sqrt(2 * rounds * math.log(2 / delta)))
        delta_s = delta / (2 * rounds)
    return eps_s / math.sqrt(8 * dim * math.log(1 / delta_s))
