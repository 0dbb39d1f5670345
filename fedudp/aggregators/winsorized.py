"""Levy et al. [LEVY, seed 004] winsorized user-level mean estimation
(docs/algorithms.md#winsorized-mean).

* ``private_range``: PrivateRange (Alg. 6), the private centre
  (``fedudp.aggregators.private_range``).
* ``winsorized_mean_1d``: WinsorizedMean1D (Alg. 1): clip to [μ̂ - hτ, μ̂ + hτ], average,
  add Lap(4hτ/(nε)) (h = 2 in the paper; ``halfwidth_factor``).
* ``WinsorizedAggregator`` (``aggregator=winsorized``): WinsorizedMeanHighD (Alg. 2): random
  Hadamard rotation, per-coordinate WinsorizedMean1D at radius τ' = 10 τ sqrt(log(dn/γ)/d),
  inverse rotation. The rotated rows are never held whole (``winsorized_mean_rows``): the
  cohort's rows stay as the owners sent them and two passes rotate float64 chunks of them,
  the first storing each rotated entry's PrivateRange bin (one byte where there are at most
  256 bins), the second summing the clipped entries. Used by every training method, this is Levy's Winsorized first-order
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

from fedudp.aggregators.base import BETA, BOUND, TAU, Aggregate, RowsAggregator, register
from fedudp.aggregators.plain_values import (
    calibrate,
    check_budget,
    check_dim,
    check_fraction,
    check_positive,
    check_sampling,
    choice,
    concentration_radius,
)
from fedudp.aggregators.private_range import (
    bin_dtype,
    counts_suffice,
    private_range,
    range_block,
)
from fedudp.aggregators.rows import CohortRows
from fedudp.aggregators.winsorized_passes import clipped_sums, first_pass, rotated_blocks
from fedudp.privacy.mechanisms import (
    RandomRotation,
    laplace,
    next_pow2,
    pure_dp_event,
    rotated_coordinate_radius,
)
from fedudp.protocol.contributions import Sampling

__all__ = [
    "COUNT_BINS",
    "ROTATE_BLOCK",
    "closed_form_eps_coord",
    "default_tau",
    "min_users",
    "winsorized_bytes",
    "winsorized_mean_1d",
    "winsorized_mean_rows",
    "winsorized_round_event",
    "winsorized_sum",
    "WinsorizedAggregator",
]


def winsorized_mean_1d(
    X: torch.Tensor,
    tau: float,
    bound: float,
    eps: float,
    *,
    rng: torch.Generator,
    halfwidth_factor: float = 2.0,
    n_public: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """WinsorizedMean1D per column of ``X`` [n, k] (eps-DP per column, replace-one).

    ``n_public`` (default: the rows) is the public n the clipped sum is divided by.

    Parameters
    ----------
    X : torch.Tensor
        The columns, [n, k].
    tau : float
        τ.
    bound : float
        B.
    eps : float
        ε per column.
    rng : torch.Generator
        The release's generator.
    halfwidth_factor : float, default 2.0
        h.
    n_public : int or None, default None
        The divisor.

    Returns
    -------
    tuple of (torch.Tensor, dict)
        The noisy means [k] and the diagnostics.
    """
    return winsorized_mean_rows(
        CohortRows(X),
        tau,
        bound,
        eps,
        rng=rng,
        halfwidth_factor=halfwidth_factor,
        n_public=n_public,
    )


ROTATE_BLOCK = 32  # rows per rotated block: three float64 blocks of 2^15 values stay in cache
COUNT_BINS = 8  # at most this many bins: pass 1 counts them per column instead of storing them


def winsorized_mean_rows(
    rows: CohortRows,
    tau: float,
    bound: float,
    eps: float,
    *,
    rng: torch.Generator,
    rotation: RandomRotation | None = None,
    halfwidth_factor: float = 2.0,
    n_public: int | None = None,
    chunk_elems: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """WinsorizedMean1D per column of the cohort's rows, rotated by ``rotation`` if given
    (WinsorizedMeanHighD's inner step), in two passes over blocks of rows:

    1. each block (``ROTATE_BLOCK`` rows, or the cohort's ``chunk``) is rotated in float64
       into reused buffers (``RandomRotation.rotate_block``) and its entries' PrivateRange
       bins v = floor((Y + B)/(2τ)) taken: with at most ``COUNT_BINS`` bins only their counts
       per column are kept (#{v >= j} per j: the same float64 arithmetic, floor(x) >= j iff
       x >= j), otherwise the bins are stored (``bin_dtype``, [k, n]); PrivateRange then runs on
       the counts or the bins in the same column blocks, with the same draws, as on a whole
       matrix;
    2. each block is rotated again, clipped to [μ̂ ± hτ] and summed (float64); Laplace noise.
       Where no entry lies outside [μ̂ ± hτ] (pass 1 keeps each column's float64 min and max)
       the clipped sums are pass 1's plain column sums: pass 2 is skipped.

    The rows past the received ones are zero vectors whose rotation is exactly zero: they are
    counted, not rotated. Memory: three float64 blocks, the counts (or the bins: n k bytes at
    most 2^8 bins), never the rotated n x k matrix. Same values as ``winsorized_mean_1d`` on
    the whole rotated matrix up to the summation order of the sums (for float32 rows the
    rotated values themselves are exact: float32 values times ±1 summed over at most 2^29
    terms fit float64's mantissa).

    Parameters
    ----------
    rows : CohortRows
        The cohort's rows (and its virtual zero rows up to the public n).
    tau : float
        The PrivateRange bin half-width τ.
    bound : float
        The public bound B on each (rotated) entry.
    eps : float
        The ε of each column (ε/2 PrivateRange, ε/2 Laplace).
    rng : torch.Generator
        The release's generator.
    rotation : RandomRotation or None, default None
        The random rotation applied first (None: the columns as they are).
    halfwidth_factor : float, default 2.0
        h: the clip to [μ̂ ± hτ].
    n_public : int or None, default None
        The public n the clipped sums are divided by (None: the rows).
    chunk_elems : int or None, default None
        Segment weights per PrivateRange block (None: ``private_range.RANGE_ELEMS``).

    Returns
    -------
    tuple of (torch.Tensor, dict)
        The noisy means [k] and the diagnostics (clipped fraction, Laplace scale, centre).
    """
    n = rows.n
    n_pub = int(n_public or n)
    k = rotation.dp if rotation is not None else rows.d
    dev = rows.device
    step = min(rows.chunk or ROTATE_BLOCK, max(1, rows.received))
    blocks = rotated_blocks(rows, rotation, step, k)
    X, total, low, high = first_pass(blocks, rows, k, tau, bound, step, COUNT_BINS)
    mu = private_range(X, tau, bound, eps / 2, rng=rng, chunk_elems=chunk_elems)
    half = halfwidth_factor * tau
    lo, hi = (mu - half).to(dev), (mu + half).to(dev)
    if bool(((low >= lo) & (high <= hi)).all()):
        # nothing to clip (the usual case: τ' bounds the spread): the clipped sums are the
        # sums of pass 1, the same values in the same order; no second rotation
        stat, outside = total, 0
    else:
        stat, outside = clipped_sums(blocks, n - rows.received, lo, hi, k, dev)
    frac = outside / (n * k) if n * k else 0.0
    scale = 4 * halfwidth_factor * tau / (n_pub * eps)  # (2hτ/n) / (eps/2)
    out_ = stat.cpu() / n_pub + laplace((k,), scale, rng=rng)
    return out_, {"clipped_fraction": frac, "laplace_scale": scale, "center": mu}


def winsorized_sum(
    X: torch.Tensor, center: torch.Tensor, halfwidth: float
) -> tuple[torch.Tensor, float]:
    """The pre-noise statistic: column sums of X clipped to [center ± halfwidth]. Replacing
    one row moves each column by at most 2·halfwidth (the sensitivity the Laplace noise uses).

    Parameters
    ----------
    X : torch.Tensor
        The columns, [n, k].
    center : torch.Tensor
        μ̂, [k].
    halfwidth : float
        hτ.

    Returns
    -------
    tuple of (torch.Tensor, float)
        The clipped column sums and the fraction clipped.
    """
    lo, hi = center - halfwidth, center + halfwidth
    clipped = torch.minimum(torch.maximum(X, lo), hi)
    frac = float(((X < lo) | (X > hi)).to(torch.float64).mean()) if X.numel() else 0.0
    return clipped.sum(0), frac


def winsorized_bytes(
    rows: int, dim: int, tau_coord: float, bound: float, chunk_elems: int | None = None
) -> int:
    """Peak bytes of one WinsorizedMeanHighD release beyond the rows: the stored bins (only
    above ``COUNT_BINS`` bins; their counts otherwise), three float64 blocks of
    ``ROTATE_BLOCK`` rotated rows and a bool block, and one PrivateRange block (its int64 words,
    or a dozen [cols, 2n+1] arrays in the sorted form above ``HISTOGRAM_BINS``).

    Parameters
    ----------
    rows : int
        The cohort's rows.
    dim : int
        The rotated width.
    tau_coord : float
        τ'.
    bound : float
        B.
    chunk_elems : int or None, default None
        PrivateRange's block size.

    Returns
    -------
    int
        Bytes.
    """
    k = next_pow2(dim)
    nbins = max(1, math.ceil(bound / tau_coord))
    if nbins <= COUNT_BINS and counts_suffice(nbins, rows):
        bins = 2 * 8 * nbins * k
    else:
        bins = rows * k * torch.empty((), dtype=bin_dtype(tau_coord, bound)).element_size()
    cols = range_block(rows, chunk_elems)
    per_col = 8 if counts_suffice(nbins, rows) else 12 * 8
    block = per_col * min(k, cols) * (2 * rows + 1)
    return bins + 25 * ROTATE_BLOCK * k + block + 8 * 8 * k


def min_users(coords: int, eps_coord: float, bound: float, tau_coord: float, gamma: float) -> int:
    """Users PrivateRange needs on every coordinate: [LEVY] Thm 1's n ≳ (8/ε') log(B/τ')
    with a union bound over the d' coordinates (log(d' B/(τ' γ))); Thm 2's
    24 sqrt(d log(1/δ))/ε · log(d²B/(τγ)) is this with the paper's ε'.

    Parameters
    ----------
    coords : int
        The rotated coordinates d'.
    eps_coord : float
        ε'.
    bound : float
        B.
    tau_coord : float
        τ'.
    gamma : float
        γ.

    Returns
    -------
    int
        The n.
    """
    return math.ceil(8 / eps_coord * max(1.0, math.log(coords * bound / (tau_coord * gamma))))


def default_tau(bound: float, n: int, m: int, gamma: float) -> float:
    """[LEVY] Corollary 1: user averages of m samples of norm ≤ B concentrate within
    τ = B sqrt(log(2n/γ)/(2m)).

    Parameters
    ----------
    bound : float
        B.
    n : int
        The public n.
    m : int
        The records per user.
    gamma : float
        γ.

    Returns
    -------
    float
        τ.
    """
    return bound * math.sqrt(math.log(2 * n / gamma) / (2 * m))


@register
class WinsorizedAggregator(RowsAggregator):
    """``aggregator=winsorized``: WinsorizedMeanHighD on the billboard (see module docstring).

    Parameters
    ----------
    dim : int
        The vectors' length d.
    tau : float
        The users' concentration radius τ.
    bound : float
        The a-priori l2 bound B of each vector.
    eps_coord : float
        ε' per rotated coordinate and release.
    sampling : Sampling
        Rate 1 and the public n.
    gamma : float, default 0.1
        The rotation radius' failure probability.
    halfwidth_factor : float, default 2.0
        h: the clip to [μ̂ ± hτ'].
    min_users_required : int or None, default None
        The utility guarantee's minimum n.

    Raises
    ------
    ValueError
        When the sampling rate is below 1 (replace-one with a public n).
    """

    name = "winsorized"
    inputs = ("dim", "epsilon", "delta", "rounds", "sampling", "records_per_unit", "calibration")
    options = (BOUND, TAU, BETA)
    replace_one = True
    calibrations = ("accountant", "closed_form")
    accountant = "dp_accounting.RdpAccountant (ZCDpEvent for the exponential mechanism)"

    def __init__(
        self,
        dim: int,
        tau: float,
        bound: float,
        eps_coord: float,
        sampling: Sampling,
        gamma: float = 0.1,
        halfwidth_factor: float = 2.0,
        min_users_required: int | None = None,
    ) -> None:
        if sampling.rate < 1.0:
            raise ValueError(
                "aggregator=winsorized is replace-one with a public n: it needs "
                "train.sampling_rate=1 (no amplification claimed)"
            )
        self.dim, self.dp = int(dim), next_pow2(int(dim))
        self.tau, self.bound, self.eps_coord = float(tau), float(bound), float(eps_coord)
        self.sampling, self.gamma, self.h = sampling, float(gamma), float(halfwidth_factor)
        n = sampling.population
        self.tau_coord = rotated_coordinate_radius(self.tau, self.dp, n, gamma)
        self.min_users_required = min_users_required
        self.noise_multiplier = 2.0 / self.eps_coord  # Laplace scale / sensitivity

    @classmethod
    def calibrated(
        cls,
        *,
        dim: int,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        bound: float,
        tau: float | None = None,
        records_per_unit: int | None = None,
        beta: float = 0.1,
        calibration: str = "accountant",
    ) -> WinsorizedAggregator:
        """WinsorizedMeanHighD on ``dim``-vectors of l2 norm <= ``bound`` for ``rounds`` releases
        over all ``sampling.population`` units (rate 1) meeting (ε, δ).

        ``tau``: the users' concentration radius; None derives [LEVY] Corollary 1's
        bound·sqrt(log(2n/β)/(2m)) from ``records_per_unit`` m. ``beta``: the failure
        probability γ of the rotation's radius and of τ. ``calibration``: ``"accountant"`` (the
        largest per-coordinate ε' the RDP accountant certifies) or ``"closed_form"`` (the paper's
        ε', [LEVY] Thm 10).

        Parameters
        ----------
        dim : int
            The vectors' length.
        epsilon, delta : float
            The target (ε, δ) over the run.
        rounds : int
            T.
        sampling : Sampling
            Rate 1 and the public n.
        bound : float
            B.
        tau : float or None, default None
            τ (None: derived from ``records_per_unit``).
        records_per_unit : int or None, default None
            m.
        beta : float, default 0.1
            γ.
        calibration : {"accountant", "closed_form"}, default "accountant"
            How ε' is set.

        Returns
        -------
        WinsorizedAggregator
            The calibrated estimator.

        Raises
        ------
        ParameterError
            A plain value out of range, or an unreachable target.
        """
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
        rows = CohortRows(G, n, self.chunk_rows)  # missing units: zero rows (never stored)
        rot = RandomRotation(self.dim, rng=rng)
        # per rotated coordinate |Y_j| <= ||X||_2 <= B (the l2 bound), docs/algorithms.md#winsorized-mean;
        # the rotated rows exist one float64 chunk at a time (two passes: range, clipped sum)
        est, diag = winsorized_mean_rows(
            rows,
            self.tau_coord,
            self.bound,
            self.eps_coord,
            rng=rng,
            rotation=rot,
            halfwidth_factor=self.h,
            n_public=n,
        )
        mean = rot.invert(est).to(G.device, G.dtype)  # on the rows' device (engine_opts.device)
        info = {
            "clipped_fraction": diag["clipped_fraction"],
            "cohort": int(G.shape[0]),
            "tau_coord": self.tau_coord,
            "eps_coord": self.eps_coord,
        }
        if self.min_users_required is not None:
            info.update(
                min_users_met=n >= self.min_users_required,
                min_users_required=self.min_users_required,
            )
        return Aggregate(mean=mean, users_used=int(G.shape[0]), diagnostics=info)

    def dp_event(self) -> dp_accounting.DpEvent:
        return winsorized_round_event(self.eps_coord, self.dp)

    def working_bytes(self, rows: int, dim: int) -> int:
        return winsorized_bytes(rows, dim, self.tau_coord, self.bound)


def winsorized_round_event(eps_coord: float, coords: int) -> dp_accounting.DpEvent:
    """One WinsorizedMeanHighD call: per coordinate an ε'/2 exponential mechanism and an
    ε'/2 Laplace mechanism (noise multiplier 2/ε'), over ``coords`` coordinates.

    Parameters
    ----------
    eps_coord : float
        ε'.
    coords : int
        d'.

    Returns
    -------
    dp_accounting.DpEvent
        The composed events.
    """
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(pure_dp_event(eps_coord / 2), coords),
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.LaplaceDpEvent(2.0 / eps_coord), coords
            ),
        ]
    )


def closed_form_eps_coord(eps: float, delta: float, rounds: int, dim: int) -> float:
    """[LEVY] Alg. 3 / Alg. 2 constants (docs/algorithms.md#winsorized-mean): per-step
    ε_s = ε/(2 sqrt(2T log(2/δ))),
    δ_s = δ/(2T); per coordinate ε_s / sqrt(8 d log(1/δ_s)). One call (T = 1 and no step
    split) uses ε / sqrt(8 d log(1/δ)).

    Parameters
    ----------
    eps, delta : float
        The target (ε, δ).
    rounds : int
        T.
    dim : int
        d'.

    Returns
    -------
    float
        ε'.
    """
    if rounds == 1:
        eps_s, delta_s = eps, delta
    else:
        eps_s = eps / (2 * math.sqrt(2 * rounds * math.log(2 / delta)))
        delta_s = delta / (2 * rounds)
    return eps_s / math.sqrt(8 * dim * math.log(1 / delta_s))
