"""Owner-side DP-SGD on the shared parameters (Huang et al. (001) §4;
docs/algorithms.md#owner-side-dp-sgd).

Every quantity of the schedule comes from owner j's *public capacity* M_j (its planned user
count, declared before any data is read), never from the users it actually holds: each step
Poisson-samples every user the owner holds, independently, at rate q_j = B_j/M_j (B_j =
min(B, M_j), the expected batch), takes each sampled user's gradient (the average over its
records) on the shared parameters, clips it to l2 norm C, adds N(0, (zC)^2 I) to the sum (drawn
in float64) and divides by B_j; ceil(M_j/B) steps per epoch, E epochs per round. The owner sends
the change of its shared parameters. Adding or removing one user of owner j changes only
whether that user's clipped gradient can enter a step's sum (q_j, the step count and the divisor
stay put), so it moves a step's pre-noise sum by at most C, and each step is a
``PoissonSampledDpEvent(q_j, GaussianDpEvent(z))`` for owner j's users under add/remove-one-user
adjacency. A sampled user whose gradient is not finite is dropped alone (factor 0, its row
zeroed before the sum, left out of an adaptive clip's count: ``mechanisms.finite_clip_factors``,
``counted``), as if absent, so it cannot turn its owner's whole delta into NaN. (A schedule read
from the actual count m_j would leak m_j: removing one user would
change the divisor, or the number of noisy steps when m_j crosses a multiple of B. ``fedudp-audit
--break schedule=data`` measures that leak.)

With an adaptive clip (``privacy.clip_policy=adaptive``, Andrew et al. 2021 applied per step;
docs/algorithms.md#adaptive-clipping), each step also releases the noisy unclipped count
``Σ (b_i - 1/2) + N(0, σ_b²)`` of its sampled users (b_i = 1[||g_i|| <= C], sensitivity 1/2,
noise keyed by (seed, round, epoch, step, owner) in its own stream); the owner reports the mean
of ``count / B_j + 1/2`` over its steps, and the billboard moves the next round's clip. The sum's
multiplier is then z_Δ, and the pair is one Gaussian of effective multiplier z (what is
accounted).

Per step, each owner's sampled users go through one batched forward/backward at that owner's
parameters, with exact per-record gradients from the layers' inputs and output gradients
(``fedudp.owner.per_sample``: Linear and Conv2d models, the paper CNN); for other models the
sampled users of all owners are one vmapped batch (in chunks of ``budget`` records), each at its
own owner's current parameters, with per-owner segment sums. Sampling and noise are keyed by (seed, round, epoch, step, owner id), so one
owner's shard (Flower) and all owners at once (local engine) give the same deltas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fedudp.aggregators.local_dpsgd import owner_rates
from fedudp.owner import ghost, local_sgd, per_sample
from fedudp.owner.kernels import Kernels
from fedudp.privacy.mechanisms import finite_clip_factors
from fedudp.randomness import Purpose, Randomness

__all__ = [
    "DpSgdSpec",
    "clipped_sums",
    "clipped_sums_and_counts",
    "counted",
    "dpsgd_deltas",
    "noisy_unclipped_fraction",
]

Params = local_sgd.Params


@dataclass(frozen=True)
class DpSgdSpec:
    """Public DP-SGD hyperparameters of the owners (one per run).

    Parameters
    ----------
    noise_multiplier : float
        z: the noise std on a step's sum is z * clip.
    clip : float
        C: the l2 bound of each sampled user's gradient.
    batch : int
        B: expected users per step.
    epochs : int
        E: epochs per round.
    lr : float
        The step size.
    seed : int
        The run's seed (sampling and noise streams).
    count_noise : float or None
        σ_b: an adaptive clip's noise on each step's count (None: a fixed clip).
    secure : bool
        ``privacy.randomness=secure``: the steps' user samples and noises from OS entropy, not
        the seed.
    kernels : Kernels
        The owner side's batched paths (``fedudp.owner.kernels``): ``ghost`` lets each step
        clip without per-user gradients where every shared layer is of a kind it covers and
        at least half the shared parameters take its Gram form (or no other batched path
        covers the model); off, per-record gradients (``per_sample``) or vmap, the reference
        paths. ``channels_last`` is handed to the per-record passes.
    """

    noise_multiplier: float
    clip: float
    batch: int
    epochs: int
    lr: float
    seed: int
    count_noise: float | None = None
    secure: bool = False
    kernels: Kernels = field(default_factory=Kernels)

    @property
    def randomness(self) -> Randomness:
        """The streams of the steps' samples and noises (seeded, or OS entropy)."""
        return Randomness(self.seed, Randomness.SECURE if self.secure else Randomness.SEEDED)


def clipped_sums_and_counts(
    G: torch.Tensor | Sequence[torch.Tensor], owner_row: torch.Tensor, owners: int, clip: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``clipped_sums``, with the counts of unclipped and of finite rows.

    A row whose float64 norm is not finite is dropped (``mechanisms.finite_clip_factors``):
    zeroed before the product, so it adds exactly zero and counts neither as clipped nor as
    unclipped.

    Parameters
    ----------
    G, owner_row, owners, clip
        As in ``clipped_sums``.

    Returns
    -------
    tuple of Tensor
        ([owners, d] the clipped sums; [owners] float64: how many of each owner's finite rows
        were *not* clipped; [n] bool on the CPU: which rows are finite).
    """
    blocks = [G] if isinstance(G, torch.Tensor) else list(G)
    factor, was, ok = finite_clip_factors(blocks, clip)
    if not bool(ok.all()):  # NaN * 0 is NaN: the dropped rows are zeroed, not multiplied
        keep = ok.to(blocks[0].device).unsqueeze(1)
        blocks = [
            torch.where(keep, B, torch.zeros((), dtype=B.dtype, device=B.device)) for B in blocks
        ]
    n = blocks[0].shape[0]
    W = torch.zeros(owners, n, dtype=blocks[0].dtype, device=blocks[0].device)
    W[owner_row.to(W.device), torch.arange(n, device=W.device)] = factor
    kept = torch.zeros(owners, dtype=torch.float64).index_add_(  # on the CPU: a count
        0, owner_row.to(torch.int64).cpu(), (ok & ~was).to(torch.float64).cpu()
    )
    return torch.cat([W @ B for B in blocks], dim=1), kept, ok.cpu()


def counted(finite: np.ndarray) -> np.ndarray:
    """Which of a step's sampled units an adaptive clip's count ``Σ (b_i - 1/2)`` runs over.

    A dropped unit is absent from the count as from the sum; counted as sampled, its b_i = 0
    would move the count by 1/2 against the neighbour without it.

    Parameters
    ----------
    finite : np.ndarray
        [n] bool: which units' gradients have finite float64 norms.

    Returns
    -------
    np.ndarray
        [n] bool: the finite ones.
    """
    return finite


def noisy_unclipped_fraction(
    unclipped: float,
    sampled: int,
    expected_batch: float,
    count_noise: float,
    generator: torch.Generator,
) -> float:
    """One step's released count, as a fraction: (Σ_S (b_i - 1/2) + N(0, σ_b²)) / B_j + 1/2.

    Adding or removing a user moves the sum by 1/2.

    Parameters
    ----------
    unclipped : float
        Σ b_i: the sampled finite units within the clip.
    sampled : int
        The sampled units counted (``counted``).
    expected_batch : float
        B_j, the public expected batch.
    count_noise : float
        σ_b.
    generator : torch.Generator
        The step's count-noise stream (the noise is drawn in float64).

    Returns
    -------
    float
        The noisy fraction.
    """
    noise = float(torch.randn((), generator=generator, dtype=torch.float64))
    centred = float(unclipped) - 0.5 * int(sampled)
    return (centred + float(count_noise) * noise) / float(expected_batch) + 0.5


def clipped_sums(
    G: torch.Tensor | Sequence[torch.Tensor], owner_row: torch.Tensor, owners: int, clip: float
) -> torch.Tensor:
    """Per owner, the sum of its sampled users' gradients, each clipped to l2 norm ``clip``.

    The norms, which decide the clip, are computed in float64 (``mechanisms.clip_factors``).
    Adding or removing one user moves its owner's sum by at most ``clip``; a non-finite row
    adds exactly zero (dropped, as if absent). The sum is a matrix product with a
    [owners, rows] weight matrix holding each row's clip factor in its owner's line.

    Parameters
    ----------
    G : Tensor or Sequence of Tensor
        [n, d] the users' gradients, or row-aligned blocks [n, d_1], [n, d_2], ... read as one
        concatenated row.
    owner_row : Tensor
        [n] each row's owner (0 .. owners - 1).
    owners : int
        The number of owners.
    clip : float
        The l2 bound.

    Returns
    -------
    Tensor
        [owners, d] in ``G``'s dtype.
    """
    return clipped_sums_and_counts(G, owner_row, owners, clip)[0]


def _unflatten(flat: torch.Tensor, like: Params, names: tuple[str, ...]) -> Params:
    out, i = {}, 0
    for k in names:
        shape = like[k].shape[1:]
        n = int(np.prod(shape)) if len(shape) else 1
        out[k] = flat[:, i : i + n].reshape(flat.shape[0], *shape)
        i += n
    return out


def dpsgd_deltas(
    model: nn.Module,
    shared: Params,
    frozen_by_owner: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    user_starts: np.ndarray,
    user_sizes: np.ndarray,
    first_user: np.ndarray,
    users: np.ndarray,
    capacity: np.ndarray,
    owner_ids: np.ndarray,
    spec: DpSgdSpec,
    round_: int,
    names: tuple[str, ...],
    budget: int,
    progress: Callable[[int, int], None] | None = None,
    fractions: np.ndarray | None = None,
    dropped: np.ndarray | None = None,
) -> torch.Tensor:
    """The shared deltas of k owners after their DP-SGD epochs of this round (module doc).

    Parameters
    ----------
    model, shared : nn.Module, Params
        The model and the broadcast shared parameters (unbatched).
    frozen_by_owner, frozen_common : Params
        Each owner's personal parameters ([k, ...], paper mode) or {} with ``frozen_common``
        the public copy.
    x, y, user_starts, user_sizes : Tensor, Tensor, np.ndarray, np.ndarray
        The records, their labels, and each user's records in them.
    first_user, users : np.ndarray
        Owner i's users are ``first_user[i] .. first_user[i] + users[i]`` (indices into
        ``user_starts``); ``users[i]`` only says which users exist to be sampled.
    capacity, owner_ids : np.ndarray
        Each owner's public capacity M_i (the sampling rate, step count and divisor come
        from it) and global id (the streams' key).
    spec, round_, names, budget : DpSgdSpec, int, tuple of str, int
        The hyperparameters and kernels, the round, the shared parameters' order, the
        records per vmapped chunk.
    progress : callable or None
        ``progress(done, total)`` after each step; it changes nothing.
    fractions : np.ndarray or None
        [k] float64, with ``spec.count_noise``: filled with each owner's mean released
        unclipped fraction over its steps (``noisy_unclipped_fraction``).
    dropped : np.ndarray or None
        [k] int64, a diagnostic that stays on the owner: how many of each owner's users were
        dropped in some step for a non-finite gradient (exactly zero in the step's sum, out
        of an adaptive clip's count, as if absent; rate, steps, divisor and noise unchanged).

    Returns
    -------
    Tensor
        [k, d] each owner's change of its shared parameters.

    Raises
    ------
    ValueError
        ``capacity`` is not one value >= 1 per owner; an adaptive clip without ``fractions``.
    """
    k = len(users)
    capacity = np.asarray(capacity, dtype=np.int64)
    _check(capacity, k, spec, fractions)
    q, steps = owner_rates(capacity, spec.batch)
    expected = np.minimum(spec.batch, capacity)  # B_j = q_j M_j, public
    start = local_sgd.flatten(local_sgd.expand(shared, k), names)
    flat = start.clone()  # [k, d]: every owner's shared parameters
    params = _unflatten(flat, {n: shared[n].unsqueeze(0) for n in names}, names)  # views of flat
    batched, use_ghost = _kernel_choice(model, names, x, user_sizes, spec.kernels)
    rnd = _Round(
        model, flat, params, frozen_by_owner, frozen_common, x, y, user_starts, user_sizes,
        owner_ids, spec, round_, names, budget, expected, use_ghost,
    )  # fmt: skip
    rnd.run(first_user, users, q, steps, batched, progress)
    if spec.count_noise is not None:  # adaptive
        assert fractions is not None  # checked above
        fractions[:] = rnd.frac_sum / np.maximum(spec.epochs * steps, 1)
    if dropped is not None:
        dropped[:] = [len(b) for b in rnd.bad]
    return flat - start


def _check(capacity: np.ndarray, k: int, spec: DpSgdSpec, fractions: np.ndarray | None) -> None:
    """``dpsgd_deltas``' inputs: one public capacity >= 1 per owner; an adaptive clip's
    ``fractions``, one slot per owner."""
    if len(capacity) != k or (capacity < 1).any():
        raise ValueError(
            f"dpsgd_deltas: capacity needs one public capacity >= 1 per owner, "
            f"got {capacity!r} for {k} owners"
        )
    if spec.count_noise is not None and (fractions is None or len(fractions) != k):
        raise ValueError(
            "dpsgd_deltas: an adaptive clip (spec.count_noise) needs fractions, one slot per owner"
        )


def _sample(
    rand: Randomness, round_: int, e: int, s: int, owner_id: int, users: int, q: float
) -> np.ndarray:
    """The owner's users (positions among its ``users``) Poisson-sampled at rate ``q`` for step
    (e, s), from the stream keyed by (round, epoch, step, owner id)."""
    return np.flatnonzero(
        rand.numpy_rng(Purpose.DPSGD_SAMPLE, round_, e, s, owner_id).random(users) < q
    )


def _kernel_choice(
    model: nn.Module, names: tuple[str, ...], x: torch.Tensor, user_sizes: np.ndarray, k: Kernels
) -> tuple[bool, bool]:
    """(whether the steps run owner by owner through a batched kernel, whether that kernel is
    the ghost one): from the model's layer kinds and shapes and the largest user (public)."""
    batched = per_sample.supported(model, names)
    use_ghost = k.ghost and bool(len(user_sizes)) and ghost.supported(model, names)
    if use_ghost and batched:  # both batched: the cheaper by the model's shapes (public)
        largest = int(np.max(user_sizes))
        share = ghost.gram_share(model, tuple(x.shape[1:]), x.dtype, names, largest)
        use_ghost = share >= 0.5
    return batched or use_ghost, use_ghost


@dataclass
class _Round:
    """One ``dpsgd_deltas`` call's fixed inputs and its accumulators: the owners' flat shared
    parameters ``flat`` (updated in place, step by step), each owner's released-fraction sum
    ``frac_sum`` and each owner's users dropped this round ``bad``."""

    model: nn.Module
    flat: torch.Tensor
    params: Params
    frozen_by_owner: Params
    frozen_common: Params
    x: torch.Tensor
    y: torch.Tensor
    user_starts: np.ndarray
    user_sizes: np.ndarray
    owner_ids: np.ndarray
    spec: DpSgdSpec
    round_: int
    names: tuple[str, ...]
    budget: int
    expected: np.ndarray
    use_ghost: bool
    frac_sum: np.ndarray = field(init=False)
    bad: list[set[int]] = field(init=False)
    rand: Randomness = field(init=False)

    def __post_init__(self) -> None:
        k = self.flat.shape[0]
        self.frac_sum = np.zeros(k)
        self.bad = [set() for _ in range(k)]  # each owner's users dropped this round
        self.rand = self.spec.randomness

    def run(
        self,
        first_user: np.ndarray,
        users: np.ndarray,
        q: np.ndarray,
        steps: np.ndarray,
        batched: bool,
        progress: Callable[[int, int], None] | None,
    ) -> None:
        """Every epoch's steps: each active owner's users sampled at its rate ``q``, then one
        step owner by owner (``batched``) or vmapped over the step's users."""
        spec, rand, round_, owner_ids = self.spec, self.rand, self.round_, self.owner_ids
        total_steps = spec.epochs * int(steps.max(initial=0))
        for e in range(spec.epochs):
            for s in range(int(steps.max(initial=0))):
                active = np.flatnonzero(steps > s)
                picked = [
                    first_user[i] + _sample(rand, round_, e, s, owner_ids[i], int(users[i]), q[i])
                    for i in active
                ]
                if batched:  # owner by owner, one batched forward/backward (per_sample)
                    self.batched_step(e, s, active, picked)
                else:  # vmap over the step's users, each at its own owner's parameters
                    self.vmapped_step(e, s, active, picked)
                if progress is not None:
                    progress(e * int(steps.max(initial=0)) + s + 1, total_steps)

    def count_step(self, i: int | np.integer, kept: float, sampled: int, e: int, s: int) -> None:
        """Owner i's released unclipped fraction of step (e, s), added up (adaptive clip)."""
        spec = self.spec
        if spec.count_noise is not None:  # adaptive
            gen = self.rand.torch_generator(
                Purpose.DPSGD_COUNT_NOISE, self.round_, e, s, self.owner_ids[i]
            )
            self.frac_sum[i] += noisy_unclipped_fraction(
                kept, sampled, self.expected[i], spec.count_noise, gen
            )

    def noisy_step(self, i: int | np.integer, total: torch.Tensor, e: int, s: int) -> None:
        """Owner i's noisy update of step (e, s) from its clipped sum ``total``."""
        _noisy_step(
            self.flat[i], total, self.spec, self.expected[i], self.round_, e, s, self.owner_ids[i]
        )

    def batched_step(self, e: int, s: int, active: np.ndarray, picked: list[np.ndarray]) -> None:
        """Step (e, s), owner by owner: one batched forward/backward each (``_owner_step``)."""
        flat = self.flat
        for i, us in zip(active, picked):
            total, kept, ok = (
                _owner_step(
                    self.model,
                    self.params,
                    self.frozen_by_owner,
                    self.frozen_common,
                    self.x,
                    self.y,
                    self.user_starts[us],
                    self.user_sizes[us],
                    i,
                    self.names,
                    self.spec.clip,
                    self.use_ghost,
                    self.spec.kernels.channels_last,
                )
                if len(us)
                else (
                    torch.zeros(flat.shape[1], dtype=flat.dtype, device=flat.device),
                    0.0,
                    torch.ones(0, dtype=torch.bool),
                )
            )
            ok_np = ok.numpy()
            self.bad[i].update(int(u) for u in us[~ok_np])
            self.noisy_step(i, total, e, s)
            self.count_step(i, kept, int(counted(ok_np).sum()), e, s)

    def vmapped_step(self, e: int, s: int, active: np.ndarray, picked: list[np.ndarray]) -> None:
        """Step (e, s) vmapped over the step's users, each at its own owner's parameters, in
        chunks of ``budget`` records, with per-owner segment sums."""
        flat, k = self.flat, self.flat.shape[0]
        picked_users = np.concatenate(picked) if picked else np.zeros(0, np.int64)
        owner_row = (
            np.concatenate([np.full(len(us), i) for i, us in zip(active, picked)])
            if picked
            else np.zeros(0, np.int64)
        )
        sums = torch.zeros(k, flat.shape[1], dtype=flat.dtype, device=flat.device)
        kept_by_owner = torch.zeros(k, dtype=torch.float64)
        finite_by_owner = np.zeros(k, dtype=np.int64)
        sizes = self.user_sizes[picked_users]
        for sel in local_sgd.chunks(sizes, self.budget):
            u, r = picked_users[sel], owner_row[sel]
            us, ids = self.user_starts[u], self.owner_ids[r]
            units = local_sgd.Units(us, sizes[sel], ids, self.user_starts[u], sizes[sel])
            g = local_sgd.mean_gradients(
                self.model,
                local_sgd.select(self.params, r),
                local_sgd.select(self.frozen_by_owner, r),
                self.frozen_common,
                self.x,
                self.y,
                units,
            )
            got, kk, ok = clipped_sums_and_counts(
                [g[n].reshape(len(u), -1) for n in self.names],
                torch.from_numpy(r),
                k,
                self.spec.clip,
            )
            sums += got
            kept_by_owner += kk
            ok_np = ok.numpy()
            np.add.at(finite_by_owner, r[counted(ok_np)], 1)
            for uu, rr in zip(u[~ok_np], r[~ok_np]):
                self.bad[int(rr)].add(int(uu))
        for i in active:
            self.noisy_step(i, sums[i], e, s)
            self.count_step(i, float(kept_by_owner[i]), int(finite_by_owner[i]), e, s)


def _noisy_step(
    row: torch.Tensor,
    total: torch.Tensor,
    spec: DpSgdSpec,
    expected_batch: float,
    round_: int,
    epoch: int,
    step: int,
    owner_id: int,
) -> None:
    """One owner's DP-SGD update, in place on its flat shared parameters ``row``: the clipped
    sum ``total`` plus N(0, (zC)^2 I) drawn in float64 (keyed by round, epoch, step and owner),
    divided by the public expected batch q_j*M_j = min(B, M_j), cast to the parameters' dtype, times -lr."""
    noise = torch.randn(
        row.shape[0],
        dtype=torch.float64,
        generator=spec.randomness.torch_generator(
            Purpose.DPSGD_NOISE, round_, epoch, step, owner_id
        ),
    )
    # drawn on the CPU generator whatever the device (engine_opts.device), then moved
    update = (
        total.to(torch.float64) + (spec.noise_multiplier * spec.clip * noise).to(total.device)
    ) / float(expected_batch)
    row -= spec.lr * update.to(row.dtype)


def _owner_clipped_sum(*args: Any, **kw: Any) -> tuple[torch.Tensor, float]:
    """``_owner_step``'s (sum, unclipped count), without the finite mask."""
    total, kept, _ = _owner_step(*args, **kw)
    return total, kept


def _owner_step(
    model: nn.Module,
    params: Params,
    frozen_by_owner: Params,
    frozen_common: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    starts: np.ndarray,
    sizes: np.ndarray,
    i: int | np.integer,
    names: tuple[str, ...],
    clip: float,
    use_ghost: bool = False,
    channels_last: bool = True,
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """([d]: the sum of owner i's sampled users' clipped mean gradients, at owner i's parameters;
    how many finite ones were not clipped; [users] bool on the CPU: which users' gradients are
    finite). Each user's gradient is the mean of its records' (``per_sample``), then clipped to
    ``clip`` with float64 norms (``clipped_sums``); a user whose gradient is not finite (any of
    its records' is not) adds exactly zero (``mechanisms.finite_clip_factors``). ``use_ghost``:
    the norms and the clipped sum without per-user gradients (``ghost``; the same factors from
    the same float64 norms up to float rounding, a non-finite user's factor 0, its rows zeroed
    by ``GhostGradients.weighted_sum``)."""
    at = {
        **frozen_common,
        **{k: v[i] for k, v in frozen_by_owner.items()},
        **{k: v[i] for k, v in params.items()},
    }
    if use_ghost:
        gg = ghost.ghost_gradients(
            model, at, x, y, starts, sizes, names, 1.0, channels_last=channels_last
        )
        factor, was, ok = finite_clip_factors(
            torch.empty(gg.U, 0, dtype=gg.dtype, device=gg.sq.device), clip, gg.norms
        )
        return gg.weighted_sum(factor), float((ok & ~was).sum()), ok.cpu()
    rec = np.concatenate([np.arange(a, a + b) for a, b in zip(starts, sizes)])
    of = torch.from_numpy(np.repeat(np.arange(len(starts)), sizes)).to(x.device)
    g = per_sample.per_record_gradients(model, at, x[rec], y[rec], names, channels_last)
    blocks = []
    for n in names:
        flat = g[n].reshape(len(rec), -1)
        if len(rec) != len(starts):  # users of several records: their mean
            tot = torch.zeros(
                len(starts), flat.shape[1], dtype=flat.dtype, device=flat.device
            ).index_add_(0, of, flat)
            flat = tot / torch.from_numpy(sizes).to(flat.device, flat.dtype).unsqueeze(1)
        blocks.append(flat)
    total, kept, ok = clipped_sums_and_counts(
        blocks, torch.zeros(len(starts), dtype=torch.int64, device=blocks[0].device), 1, clip
    )
    return total[0], float(kept[0]), ok
