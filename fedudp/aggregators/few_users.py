"""Esfandiari, Mirrokni, Narayanan [ESF, seed 002]: private mean estimation with few users,
robust to a corrupted fraction (docs/algorithms.md#few-users).

* ``dp_estimate_1``: DP-Estimate-1 (Algorithm 1, Theorem 6), the polynomial-time rejection
  sampler for the density ∝ exp(ε min(f(p), 2n/3)) on the union of the balls B(x_i, ρ),
  ρ = κ r sqrt(d), with the garbage bucket and a Geometric(1/N) number of tries (the
  geometric stop is part of the privacy proof, Lemma 18: never a fixed loop cap). Tries
  run in vectorized batches; the first success in try order is returned, exactly as the
  sequential loop would. All weights in log space (no overflow at n = 10^4).
* ``dp_estimate_2``: DP-Estimate-2 (Corollary 7): k independent copies, coordinate-wise
  median of the non-garbage outputs.
* ``FewUsersAggregator`` (``aggregator=few_users``): user level (Theorem 9): applied to the
  users' vectors with radius r' = τ (the users' concentration radius; [ESF] r' = 10 r/√m),
  optionally on ``estimator.blocks`` blocks of a random Hadamard rotation (Theorem 8, the
  FJL + blocks variant), each block with radius 10 τ sqrt(log(d'n/β)/d') · sqrt(d_b).
  Garbage (no estimate) is mapped to the zero vector, i.e. "no update" (post-processing).

Privacy (unit: user, or owner; replace-one; every unit every round). DP-Estimate-1 called
with (ε1, δ1) is (4ε1, 4δ1)-DP (the stopping layer's (3ε1, 3δ1) and the sampler's (ε1, δ1) in
[ESF]'s proof), valid only if the acceptance
probability never exceeds 1 and e^{ε1(1-2n/3)} N <= δ1 — both checked at construction (a
configuration that breaks them is refused). k copies x b blocks x T rounds compose by basic
composition (``ApproxDp``): ε1 = ε/(4kbT), δ1 = δ/(4kbT). The paper's Θ(·) splits have no
constants, so there is no separate closed form; both accounting modes use these.
"""

from __future__ import annotations

import math
import numbers
from typing import cast

import torch

from fedudp.aggregators.base import (
    BETA,
    BOUND,
    TAU,
    Aggregate,
    Option,
    ParameterError,
    RowsAggregator,
    register,
)
from fedudp.aggregators.plain_values import (
    check_at_least,
    check_budget,
    check_count,
    check_dim,
    check_fraction,
    check_positive,
    check_sampling,
    concentration_radius,
    need,
)
from fedudp.aggregators.rows import CohortRows, as_cohort, chunks_bytes
from fedudp.privacy.accountant import ApproxDp
from fedudp.privacy.mechanisms import RandomRotation, next_pow2, rotated_coordinate_radius
from fedudp.protocol.contributions import Sampling

__all__ = [
    "ball_counts",
    "check_privacy_conditions",
    "dp_estimate_1",
    "dp_estimate_2",
    "FewUsersAggregator",
    "log_accept",
    "min_users",
    "rotated_block",
    "uniform_in_balls",
]


def uniform_in_balls(centers: torch.Tensor, radius: float, *, rng: torch.Generator) -> torch.Tensor:
    """One uniform point in each ball B(center, radius) (docs/algorithms.md#uniform-point-in-a-ball).
    The offsets are drawn and scaled on the CPU generator, then moved to the centers' device
    (``engine_opts.device``): the same seed, the same offsets bit for bit.

    Parameters
    ----------
    centers : torch.Tensor
        [b, d].
    radius : float
        The balls' radius.
    rng : torch.Generator
        The generator.

    Returns
    -------
    torch.Tensor
        [b, d].
    """
    b, d = centers.shape
    g = torch.randn(b, d, generator=rng, dtype=centers.dtype)
    g = g / torch.linalg.vector_norm(g, dim=1, keepdim=True).clamp(min=1e-300)
    u = torch.rand(b, 1, generator=rng, dtype=centers.dtype) ** (1.0 / d)
    return centers + (radius * u * g).to(centers.device)


def log_accept(f: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """log of (1/3)(n/f) exp(ε (min(f, 2n/3) - 2n/3)).

    Parameters
    ----------
    f : torch.Tensor
        The ball counts.
    n : int
        The public n.
    eps : float
        ε.

    Returns
    -------
    torch.Tensor
        The log acceptance probabilities.
    """
    f = f.to(torch.float64)
    return (
        math.log(n / 3)
        - torch.log(f)
        + eps * (torch.minimum(f, torch.tensor(2 * n / 3, dtype=torch.float64)) - 2 * n / 3)
    )


def check_privacy_conditions(n: int, eps: float, delta: float, tries: float) -> None:
    """Raise ValueError when DP-Estimate-1's proof does not apply: an acceptance probability
    above 1 for some count f ∈ [1, n], or e^{ε(1-2n/3)} N > δ (Lemma 18).

    Parameters
    ----------
    n : int
        The public n.
    eps, delta : float
        (ε1, δ1).
    tries : float
        N.

    Raises
    ------
    ValueError
        The proof does not apply.
    """
    f = torch.arange(1, n + 1)
    worst = float(log_accept(f, n, eps).max())
    if worst > 0:
        raise ValueError(
            f"acceptance probability exp({worst:.3g}) > 1 at n={n}, ε={eps:.3g}: "
            "too few users for DP-Estimate-1"
        )
    if eps * (1 - 2 * n / 3) + math.log(tries) > math.log(delta):
        raise ValueError(
            f"e^(ε(1-2n/3))·N > δ at n={n}, ε={eps:.3g}, N={tries:g}, δ={delta:.3g} "
            "(Lemma 18): too few users for the geometric stop"
        )


def min_users(eps: float, delta: float, tries: float) -> int:
    """Smallest n for which ``check_privacy_conditions`` passes (doubling then bisection).

    Parameters
    ----------
    eps, delta : float
        (ε1, δ1).
    tries : float
        N.

    Returns
    -------
    int
        The n.
    """

    def ok(n):
        try:
            check_privacy_conditions(n, eps, delta, tries)
            return True
        except ValueError:
            return False

    hi = 2
    while not ok(hi):
        hi *= 2
        if hi > 1 << 40:
            raise ValueError("no n satisfies DP-Estimate-1's conditions")
    lo = hi // 2
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def dp_estimate_1(
    X: torch.Tensor | CohortRows,
    radius: float,
    eps: float,
    delta: float,
    tries: float,
    *,
    rng: torch.Generator,
    batch: int = 64,
) -> tuple[torch.Tensor | None, dict]:
    """DP-Estimate-1 on the rows of ``X`` [n, d] with ball radius ``radius`` (= κ r sqrt(d)).

    Returns (estimate, info) with estimate None for garbage (G1: the garbage bucket was
    drawn and kept; G2: the geometric number of tries ran out). (4ε, 4δ)-DP (caller's split).
    ``X``: a tensor or ``CohortRows``; each batch's friend counts f compare float64 distances
    to the rows one float64 chunk at a time (the same values as on a whole float64 copy).

    Parameters
    ----------
    X : torch.Tensor or CohortRows
        The rows.
    radius : float
        The ball radius.
    eps, delta : float
        (ε1, δ1).
    tries : float
        N.
    rng : torch.Generator
        The generator.
    batch : int, default 64
        Candidate points per batch.

    Returns
    -------
    tuple of (torch.Tensor or None, dict)
        The estimate (None: garbage) and the diagnostics.
    """
    rows = as_cohort(X)
    n = rows.n
    # X ~ Geometric(1/N) on {1, 2, ...}
    u = float(torch.rand((), generator=rng, dtype=torch.float64))
    budget = 1 if tries <= 1 else max(1, math.ceil(math.log1p(-u) / math.log1p(-1.0 / tries)))
    # P(garbage index) = 1 / (1 + (δ/4) e^{2εn/3}) = sigmoid(log(4/δ) - 2εn/3)
    p_garbage = float(
        torch.sigmoid(torch.tensor(math.log(4 / delta) - 2 * eps * n / 3, dtype=torch.float64))
    )
    sq = torch.empty(n, dtype=torch.float64, device=rows.device)
    for s, B in rows.chunks():
        sq[s : s + len(B)] = (B * B).sum(1)
    done = 0
    while done < budget:
        b = min(batch, budget - done)
        garbage = torch.rand(b, generator=rng, dtype=torch.float64) < p_garbage
        keep_garbage = torch.rand(b, generator=rng, dtype=torch.float64) < 1 / 3
        idx = torch.randint(0, n, (b,), generator=rng)
        P = uniform_in_balls(rows.take(idx), radius, rng=rng)
        f = ball_counts(P, rows, sq, radius).clamp(min=1)  # p lies in its own ball
        u_acc = torch.rand(b, generator=rng, dtype=torch.float64)
        acc = torch.log(u_acc) < log_accept(f.cpu(), n, eps)  # decided on the CPU
        stop = torch.where(garbage, keep_garbage, acc)
        if bool(stop.any()):
            j = int(torch.nonzero(stop)[0])
            info = {"tries": done + j + 1, "budget": budget}
            if bool(garbage[j]):
                return None, info | {"garbage": "G1"}
            return P[j], info | {"garbage": None, "friends": int(f[j])}
        done += b
    return None, {"tries": budget, "budget": budget, "garbage": "G2"}


def ball_counts(P: torch.Tensor, rows: CohortRows, sq: torch.Tensor, radius: float) -> torch.Tensor:
    """For each point of ``P`` [b, d] (float64), the rows within ``radius``: float64
    ||p||² + ||x||² - 2<p,x> against one chunk of rows at a time (``sq``: the rows' ||x||²).

    Parameters
    ----------
    P : torch.Tensor
        [b, d] float64 points.
    rows : CohortRows
        The rows.
    sq : torch.Tensor
        The rows' float64 squared norms.
    radius : float
        The radius.

    Returns
    -------
    torch.Tensor
        [b] counts.
    """
    pp = (P * P).sum(1, keepdim=True)
    f = torch.zeros(P.shape[0], dtype=torch.int64, device=P.device)
    for s, B in rows.chunks():
        d2 = pp + sq[None, s : s + len(B)] - 2 * P @ B.T
        f += (d2 <= radius * radius).sum(1)
    return f


def rotated_block(rows: CohortRows, rot: RandomRotation, c0: int, c1: int) -> torch.Tensor:
    """Columns ``c0..c1-1`` of the rotated rows [n, c1-c0] (float64), rotating one chunk of
    rows at a time (the whole rotated matrix is never held).

    Parameters
    ----------
    rows : CohortRows
        The rows.
    rot : RandomRotation
        The rotation.
    c0, c1 : int
        The columns.

    Returns
    -------
    torch.Tensor
        [n, c1 - c0] float64.
    """
    out = torch.empty(rows.n, c1 - c0, dtype=torch.float64, device=rows.device)
    for s, B in rows.chunks(rows.rows_per_chunk(rot.dp)):
        out[s : s + len(B)] = rot.rotate(B)[:, c0:c1]
    return out


def dp_estimate_2(
    X: torch.Tensor | CohortRows,
    radius: float,
    eps: float,
    delta: float,
    tries: float,
    copies: int,
    *,
    rng: torch.Generator,
) -> tuple[torch.Tensor | None, dict]:
    """DP-Estimate-2: coordinate-wise median of the non-garbage outputs of ``copies`` runs of
    DP-Estimate-1 (each called with (eps, delta); the caller composes the copies).

    Parameters
    ----------
    X : torch.Tensor or CohortRows
        The rows.
    radius : float
        The ball radius.
    eps, delta : float
        (ε1, δ1) per run.
    tries : float
        N.
    copies : int
        The runs.
    rng : torch.Generator
        The generator.

    Returns
    -------
    tuple of (torch.Tensor or None, dict)
        The median (None: every run garbage) and the diagnostics.
    """
    outs, garbage = [], 0
    for _ in range(copies):
        p, _info = dp_estimate_1(X, radius, eps, delta, tries, rng=rng)
        if p is None:
            garbage += 1
        else:
            outs.append(p)
    if not outs:
        return None, {"garbage_copies": garbage}
    return torch.stack(outs).median(0).values, {"garbage_copies": garbage}


@register
class FewUsersAggregator(RowsAggregator):
    """``aggregator=few_users``: [ESF] DP-Estimate-2 at user level, optionally on rotated blocks.

    Parameters
    ----------
    dim : int
        The vectors' length.
    tau : float
        The users' concentration radius.
    eps, delta : float
        (ε1, δ1) of each DP-Estimate-1 run.
    rounds : int
        T.
    sampling : Sampling
        Rate 1 and the public n.
    copies : int, default 1
        Runs of DP-Estimate-1 (their median).
    blocks : int, default 1
        Rotated blocks (a power of two).
    kappa : float, default 1.0
        κ, the ball radius multiplier.
    tries : float, default 1000.0
        N, the expected tries.
    beta : float, default 0.1
        The rotation's failure probability.
    """

    name = "few_users"
    min_users_required: int
    inputs = ("dim", "epsilon", "delta", "rounds", "sampling", "records_per_unit")
    options = (
        BOUND,
        TAU,
        BETA,
        Option("copies", 1, int, help="copies of DP-Estimate-1 (their median)"),
        Option("blocks", 1, int, help="rotated blocks (a power of two; 1: no rotation)"),
        Option("kappa", 1.0, float, help="the ball radius multiplier"),
        Option("tries", 1000.0, float, help="expected tries N of the geometric stop"),
    )
    replace_one = True
    closed_form_note = (
        "is not available: [ESF]'s splits are Θ(·) without constants; "
        "aggregator=few_users uses the proof's (ε/4, δ/4) per copy and basic "
        "composition"
    )
    accountant = (
        "basic composition of ESF's (4ε1, 4δ1) blocks (ApproxDp; no dp-accounting event exists)"
    )

    def __init__(
        self,
        dim: int,
        tau: float,
        eps: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        copies: int = 1,
        blocks: int = 1,
        kappa: float = 1.0,
        tries: float = 1000.0,
        beta: float = 0.1,
    ) -> None:
        if sampling.rate < 1.0:
            raise ValueError(
                "aggregator=few_users is replace-one with a public n: it needs "
                "train.sampling_rate=1"
            )
        self.dim, self.tau, self.sampling = int(dim), float(tau), sampling
        self.copies, self.blocks, self.kappa, self.tries = (
            int(copies),
            int(blocks),
            float(kappa),
            float(tries),
        )
        self.rotate = self.blocks > 1
        self.dp = next_pow2(self.dim) if self.rotate else self.dim
        if self.rotate and (self.blocks & (self.blocks - 1) or self.blocks > self.dp):
            raise ValueError(f"estimator.blocks must be a power of two <= {self.dp}, got {blocks}")
        parts = self.copies * self.blocks * int(rounds)
        self.eps1, self.delta1 = eps / (4 * parts), delta / (4 * parts)
        n = sampling.population
        self.min_users_required = min_users(self.eps1, self.delta1, self.tries)
        check_privacy_conditions(n, self.eps1, self.delta1, self.tries)
        db = self.dp // self.blocks
        if self.rotate:  # per-block l2 radius after rotation (Lemma 2 per coordinate x sqrt(d_b))
            r_b = rotated_coordinate_radius(self.tau, self.dp, n, beta) * math.sqrt(db)
        else:
            r_b = self.tau
        self.radius = self.kappa * r_b * math.sqrt(db)

    @classmethod
    def calibrated(
        cls,
        *,
        dim: int,
        epsilon: float,
        delta: float,
        rounds: int,
        sampling: Sampling,
        bound: float | None = None,
        tau: float | None = None,
        records_per_unit: int | None = None,
        copies: int = 1,
        blocks: int = 1,
        kappa: float = 1.0,
        tries: float = 1000.0,
        beta: float = 0.1,
    ) -> FewUsersAggregator:
        """[ESF] DP-Estimate-2 for ``rounds`` releases over all ``sampling.population`` units
        (rate 1) meeting (ε, δ) by basic composition: ε1 = ε/(4·copies·blocks·rounds), likewise δ1.
        The derived ``tau``: [ESF]'s 10·bound/sqrt(m).

        Parameters
        ----------
        dim : int
            The vectors' length.
        epsilon, delta : float
            The target (ε, δ).
        rounds : int
            T.
        sampling : Sampling
            Rate 1 and the public n.
        bound, tau, records_per_unit
            The radius (None: derived from ``bound`` and m).
        copies, blocks, kappa, tries, beta
            As for the class (``blocks``: a power of two <= dim's; > 1: Hadamard rotation, one
            estimate per block).

        Returns
        -------
        FewUsersAggregator
            The calibrated estimator.

        Raises
        ------
        ParameterError
            A plain value out of range, or a population too small for DP-Estimate-1's conditions.
        """
        _check_options(dim, epsilon, delta, rounds, sampling, cls.name, copies, blocks, kappa)
        check_at_least("tries", tries, 1)
        check_fraction("beta", beta)
        if bound is not None or tau is None:
            check_positive("bound", bound)
        # the default radius is used only when tau is None: bound was checked above then
        tau = concentration_radius(
            tau, lambda m: 10 * cast(float, bound) / math.sqrt(m), records_per_unit
        )
        n = sampling.population
        try:
            return cls(
                dim,
                tau,
                epsilon,
                delta,
                rounds,
                sampling,
                copies=copies,
                blocks=blocks,
                kappa=kappa,
                tries=tries,
                beta=beta,
            )
        except ValueError as err:  # DP-Estimate-1's privacy conditions (too few units)
            raise ParameterError(
                "sampling.population",
                f"sampling.population={n} is too small for few_users at "
                f"epsilon={epsilon:g} over rounds={rounds} x copies={copies} x blocks={blocks}: "
                f"{err}",
                detail=str(err),
            ) from None

    def estimate(self, G: torch.Tensor, *, rng: torch.Generator) -> Aggregate:
        n = self.sampling.population
        rows = CohortRows(G, n, self.chunk_rows)  # missing units: zero rows (never stored)
        rot = RandomRotation(self.dim, rng=rng) if self.rotate else None
        db = (rot.dp if rot is not None else self.dim) // self.blocks
        est, garbage = [], 0
        for b in range(self.blocks):
            # one block of the rotated rows at a time (float64, n x d'/blocks)
            Y = (
                rows
                if rot is None
                else CohortRows(rotated_block(rows, rot, b * db, (b + 1) * db), n, self.chunk_rows)
            )
            p, _info = dp_estimate_2(
                Y, self.radius, self.eps1, self.delta1, self.tries, self.copies, rng=rng
            )
            del Y
            if p is None:
                garbage += 1
                p = torch.zeros(db, dtype=torch.float64, device=G.device)
            est.append(p)
        y = torch.cat(est)
        mean = rot.invert(y) if rot is not None else y
        diag = {
            "garbage_blocks": garbage,
            "blocks": self.blocks,
            "radius": self.radius,
            "cohort": int(G.shape[0]),
            "min_users_met": n >= self.min_users_required,
            "min_users_required": self.min_users_required,
        }
        # garbage in every block: no update this round (post-processing of the release)
        return Aggregate(mean=mean.to(G.dtype), users_used=n, diagnostics=diag)

    def working_bytes(self, rows: int, dim: int) -> int:
        """One block of the rotated rows (float64) when rotating, the norms and the chunks."""
        block = rows * (self.dp // self.blocks) * 8 if self.rotate else 0
        return block + 16 * rows + chunks_bytes()

    def dp_event(self) -> ApproxDp:
        """One round: copies x blocks runs of DP-Estimate-1, each (4ε1, 4δ1)-DP."""
        k = self.copies * self.blocks
        return ApproxDp(4 * self.eps1 * k, 4 * self.delta1 * k)


def _integer_power_of_two(x: object) -> bool:
    if not isinstance(x, numbers.Integral) or isinstance(x, bool):
        return False
    v = int(x)
    return v >= 1 and not v & (v - 1)


def _check_options(
    dim: int,
    epsilon: float,
    delta: float,
    rounds: int,
    sampling: Sampling,
    name: str,
    copies: int,
    blocks: int,
    kappa: float,
) -> None:
    """``FewUsersAggregator.calibrated``'s plain values, checked in order (a ``ParameterError``
    naming the first one refused)."""
    check_dim(dim)
    check_budget(epsilon, delta, rounds)
    check_sampling(sampling, name)
    check_count("copies", copies)
    dp = next_pow2(int(dim))
    need(
        _integer_power_of_two(blocks) and (blocks == 1 or blocks <= dp),
        "blocks",
        f"must be a power of two <= {dp}",
        blocks,
    )
    check_positive("kappa", kappa)
