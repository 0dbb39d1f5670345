"""DP-FTRL with tree aggregation (``aggregator=dp_ftrl_tree``): noise correlated across rounds.

Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep) Learning without
Sampling or Shuffling", ICML 2021 (arXiv:2103.00039), DP-FTRL with the tree restarted every
``k`` rounds (their Appendix D accounting). Not one of the seeds; docs/algorithms.md#dp-ftrl-tree.

**Participation** (public, declared, never read from the data): each unit gets one of k groups
from the run's seed (``numpy_rng(seed, SCHEDULE, 0).integers(k, size=N)``: unit i's group
depends on i alone, so adding or removing a unit moves no other), and round r trains the group
(r - 1) mod k. So every unit contributes to at most one round of each k-round tree: the
assumption dp-accounting's ``SingleEpochTreeAggregationDpEvent`` rests on. k = 1 /
``train.sampling_rate``, which must be an integer; a Poisson sample, which can take a unit twice
in one tree, is never used with this mechanism.

**Release.** Round t of a tree adds the cohort's clipped sum x_t (each unit's vector clipped to C)
to the leaves of a binary tree; every completed dyadic interval of rounds is a node carrying
its own noise N(0, (zC)² I), drawn once. The noisy prefix sum S̃_t = Σ_{s<=t} x_s + (the noise of
the O(log t) nodes that tile [1, t]) is what DP-FTRL releases; the billboard steps with its
increment (S̃_t - S̃_{t-1}) / (N / k), so that the shared parameters after round t are θ at the
tree's start plus server_lr · S̃_t / (N/k) (FTRL from that point; post-processing of the prefix
sums). The increment needs only the noise of the node completed at t minus that of the nodes it
replaces in the tiling: at most ceil(log2(k + 1)) vectors are held.

**Sensitivity and event.** A unit is in one leaf per tree, which lies in at most
D = ceil(log2(k + 1)) completed nodes; adding or removing it moves each of them by the same
vector of norm at most C. The nodes carry independent noise zC, so one tree is exactly a Gaussian
mechanism of l2 sensitivity C·sqrt(D): ``GaussianDpEvent(z / sqrt(D))`` under add/remove-one,
which the PLD accountant composes. dp-accounting's own event for it,
``SingleEpochTreeAggregationDpEvent(z, k)``, is RDP-only and defined under its REPLACE_SPECIAL
relation (a record replaced by the zero record, which is what removing a unit from its public
leaf does); its RDP, α·D / (2z²), is that of ``GaussianDpEvent(z / sqrt(D))`` at every order, and
the tests check the two agree. One event per tree, composed at the tree's first round (the whole
tree's cost is checked against the budget before it starts; its other rounds are
``NoOpDpEvent``). The last tree may be shorter (T mod k rounds).
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import torch

from fedudp.aggregators.base import Aggregate, ClippedSumAggregator, ParameterError, register
from fedudp.aggregators.plain_values import calibrate, check_budget, check_positive, check_sampling
from fedudp.protocol.contributions import Contribution, Sampling
from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "CyclicParticipation",
    "run_event",
    "tree_depth",
    "tree_event",
    "tree_size",
    "TreeAggregator",
]


def tree_size(rate: float) -> int:
    """k = 1 / rate, the rounds of one tree (a ``ParameterError`` naming sampling if not whole).

    Parameters
    ----------
    rate : float
        The sampling rate.

    Returns
    -------
    int
        k.

    Raises
    ------
    ParameterError
        1 / rate is not whole.
    """
    k = round(1.0 / float(rate))
    if k < 1 or abs(k * float(rate) - 1.0) > 1e-9:
        raise ParameterError(
            "sampling",
            f"sampling rate {rate:g}: aggregator=dp_ftrl_tree trains "
            "each unit once every k rounds, k = 1 / train.sampling_rate, which "
            "must be a whole number (e.g. 0.25 for k = 4)",
        )
    return k


def tree_depth(steps: int) -> int:
    """The most completed nodes one leaf lies in, in a tree of ``steps`` leaves.

    Parameters
    ----------
    steps : int
        The tree's leaves.

    Returns
    -------
    int
        The depth.
    """
    return math.ceil(math.log2(steps + 1))


def tree_event(noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    """One tree of ``steps`` rounds: the Gaussian of multiplier z / sqrt(depth) (module doc).

    Parameters
    ----------
    noise_multiplier : float
        z per node.
    steps : int
        The tree's rounds.

    Returns
    -------
    dp_accounting.DpEvent
        The tree's event.
    """
    return dp_accounting.GaussianDpEvent(noise_multiplier / math.sqrt(tree_depth(steps)))


def run_event(noise_multiplier: float, rounds: int, k: int) -> dp_accounting.DpEvent:
    """All of a run's trees (composed; each unit at most once per tree): the full trees as one
    ``SelfComposedDpEvent`` (as the ledger composes them: one event, not one per tree, so 1e6
    trees cost what one does), then the shorter last one.

    Parameters
    ----------
    noise_multiplier : float
        z per node.
    rounds : int
        T.
    k : int
        Rounds per tree.

    Returns
    -------
    dp_accounting.DpEvent
        The run's event.
    """
    full, rest = divmod(int(rounds), int(k))
    parts = (
        [dp_accounting.SelfComposedDpEvent(tree_event(noise_multiplier, k), full)] if full else []
    )
    if rest:
        parts.append(tree_event(noise_multiplier, rest))
    return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)


class CyclicParticipation:
    """The billboard's plan (the hooks of ``fedudp.billboard.plan.Plan``) for a tree: unit i trains in
    the rounds r with (r - 1) mod k = group[i]; the tree's event at its first round, nothing at
    the others; the aggregator's release and the plain server step.

    Parameters
    ----------
    agg : TreeAggregator
        The tree.
    seed : int
        The groups' seed.
    """

    def __init__(self, agg: TreeAggregator, seed: int) -> None:
        self.agg = agg
        self.group = numpy_rng(seed, Purpose.SCHEDULE, 0).integers(
            0, agg.k, size=agg.sampling.population
        )

    def sample(self, round_: int) -> np.ndarray:
        """The units of round ``round_``: its group.

        Parameters
        ----------
        round_ : int
            The round, from 1.

        Returns
        -------
        numpy.ndarray
            Bool mask over the units.
        """
        return self.group == (round_ - 1) % self.agg.k

    def event(self, round_: int) -> dp_accounting.DpEvent:
        """The round's event (``agg.round_event``).

        Parameters
        ----------
        round_ : int
            The round.

        Returns
        -------
        dp_accounting.DpEvent
            The event.
        """
        return self.agg.round_event(round_)

    def one_off(self) -> None:
        return None

    def aggregator(self, round_: int) -> None:
        """No aggregator of the plan's own: the billboard's releases (None).

        Parameters
        ----------
        round_ : int
            The round.
        """
        return None

    def step(self, u: torch.Tensor, mean: torch.Tensor | None, round_: int) -> None:
        """No server step of the plan's own: the billboard's plain step (None).

        Parameters
        ----------
        u : torch.Tensor
            The shared update.
        mean : torch.Tensor or None
            The released mean.
        round_ : int
            The round.
        """
        return None

    def checkpoint_state(self) -> dict:
        return {}

    def restore_checkpoint_state(self, state: dict) -> None:
        if state:
            raise ValueError(f"cyclic participation keeps no state, got {sorted(state)}")


@register
class TreeAggregator(ClippedSumAggregator):
    """DP-FTRL's tree-aggregated noise on the cohort's clipped sums (module doc).

    Parameters
    ----------
    clip : float
        The l2 clip norm C.
    noise_multiplier : float
        z per tree node.
    sampling : Sampling
        The cohort's rate 1/k (k rounds per tree) and population.
    rounds : int
        The run's rounds T.
    """

    name = "dp_ftrl_tree"
    inputs = ("clip", "epsilon", "delta", "rounds", "sampling")
    noise_inputs = ("clip", "sampling", "rounds")
    private = True
    fixed_noise = True
    closed_form_note = "has no closed form for tree aggregation (the accountant calibrates it)"

    def __init__(
        self, clip: float, noise_multiplier: float, sampling: Sampling, rounds: int
    ) -> None:
        check_positive("clip", clip)
        check_positive("noise_multiplier", noise_multiplier)
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.sampling = sampling
        self.k = tree_size(sampling.rate)
        self.rounds = int(rounds)
        self._t = 0  # rounds done in the current tree
        self._stack: list[tuple[int, torch.Tensor]] = []  # (node size, its noise), the tiling

    @classmethod
    def calibrated(
        cls, *, clip: float, epsilon: float, delta: float, rounds: int, sampling: Sampling
    ) -> TreeAggregator:
        """The smallest per-node noise multiplier z whose trees over ``rounds`` meet (ε, δ).

        Parameters
        ----------
        clip : float
            The l2 clip norm C.
        epsilon, delta : float
            The target (ε, δ) over the run.
        rounds : int
            T.
        sampling : Sampling
            Rate 1/k (the cyclic cohorts) and population.

        Returns
        -------
        TreeAggregator
            The calibrated estimator.

        Raises
        ------
        ParameterError
            A plain value out of range (a rate that is not 1/k), or an unreachable target.
        """
        check_sampling(sampling)
        check_budget(epsilon, delta, rounds)
        check_positive("clip", clip)
        k = tree_size(sampling.rate)
        # the event is the whole run's (its trees): calibrated as one release of it
        z = calibrate(lambda s: run_event(s, rounds, k), epsilon, delta, 1, run_rounds=rounds)
        return cls(clip, z, sampling, rounds)

    @classmethod
    def with_noise_multiplier(
        cls, noise_multiplier: float, *, clip: float, sampling: Sampling, rounds: int
    ) -> TreeAggregator:
        """with_noise_multiplier.

        Parameters
        ----------
        noise_multiplier : float
            z per node.
        clip, sampling, rounds
            As for ``calibrated``.

        Returns
        -------
        TreeAggregator
            The estimator.
        """
        check_sampling(sampling)
        check_positive("clip", clip)
        check_positive("noise_multiplier", noise_multiplier)
        return cls(clip, noise_multiplier, sampling, rounds)

    def participation(self, seed: int) -> CyclicParticipation:
        """The billboard's plan: cyclic cohorts and one event per tree.

        Parameters
        ----------
        seed : int
            The cohorts' seed.

        Returns
        -------
        CyclicParticipation
            The plan.
        """
        return CyclicParticipation(self, seed)

    def round_event(self, round_: int) -> dp_accounting.DpEvent:
        """The whole tree's event at its first round, ``NoOpDpEvent`` at its other rounds.

        Parameters
        ----------
        round_ : int
            The round, from 1.

        Returns
        -------
        dp_accounting.DpEvent
            The round's event.
        """
        if (round_ - 1) % self.k:
            return dp_accounting.NoOpDpEvent()
        steps = min(self.k, self.rounds - round_ + 1) if round_ <= self.rounds else self.k
        return tree_event(self.noise_multiplier, steps)

    def dp_event(self) -> dp_accounting.DpEvent:
        """Round 1's event (a full tree's); the billboard asks ``round_event`` per round."""
        return self.round_event(1)

    def noise_increment(self, dim: int, rng: torch.Generator) -> torch.Tensor:
        """Advance the tree by one leaf: the noise of the prefix sum at t minus that at t - 1
        (float64): the node completed at t, less the nodes it replaces in the tiling.

        Parameters
        ----------
        dim : int
            The vectors' length.
        rng : torch.Generator
            The release's generator.

        Returns
        -------
        torch.Tensor
            The [dim] float64 noise increment.
        """
        if self._t == self.k:  # restart: a new tree
            self._t, self._stack = 0, []
        self._t += 1
        low = self._t & -self._t  # the node completed at t: 'low' leaves
        fresh = self.noise_std * torch.randn(dim, generator=rng, dtype=torch.float64)
        out = fresh.clone()
        while self._stack and self._stack[-1][0] < low:
            out -= self._stack.pop()[1]
        self._stack.append((low, fresh))
        return out

    def release(self, c: Contribution, *, rng: torch.Generator) -> Aggregate:
        total = c.total
        assert total is not None  # a clipped-sum estimator receives the sum
        # drawn and held on the CPU (float64), moved to the sum's device (engine_opts.device)
        inc = self.noise_increment(int(total.numel()), rng).reshape(total.shape).to(total.device)
        mean = ((total.to(torch.float64) + inc) / self.sampling.expected_cohort).to(total.dtype)
        diag = {
            "clipped_fraction": (c.clipped / c.count) if c.count else 0.0,
            "cohort": c.count,
            "tree_round": self._t,
            "tree_nodes_held": len(self._stack),
        }
        return Aggregate(mean=mean, users_used=c.count, diagnostics=diag)

    def ledger_notes(self) -> list[str]:
        return [
            f"DP-FTRL tree aggregation (Kairouz et al. 2021): participation is cyclic, not "
            f"Poisson: each unit is in one public group of k={self.k} (seeded), trained once "
            f"every k rounds, so at most once per k-round tree; per-node noise multiplier "
            f"{self.noise_multiplier:.6g} (std {self.noise_std:.6g}), depth "
            f"{tree_depth(self.k)}; each tree is one Gaussian of multiplier z/sqrt(depth) (the "
            "same RDP as dp-accounting's SingleEpochTreeAggregationDpEvent), composed at the "
            "tree's first round; the denominator is the public N/k"
        ]

    def checkpoint_state(self) -> dict:
        return {
            "t": self._t,
            "sizes": [s for s, _ in self._stack],
            "noises": [v.clone() for _, v in self._stack],
        }

    def restore_checkpoint_state(self, state: dict) -> None:
        if set(state) != {"t", "sizes", "noises"}:
            raise ValueError(f"aggregator={self.name}: unexpected state {sorted(state)}")
        self._t = int(state["t"])
        self._stack = [
            (int(s), v.to(torch.float64)) for s, v in zip(state["sizes"], state["noises"])
        ]
