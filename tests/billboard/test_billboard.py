"""The guard of ``fedudp/billboard/server.py``: what the billboard server samples, releases, steps
and records (docs/architecture.md#one-round-as-data).

Billboards are built here from plain values (``GaussianAggregator`` / ``MeanAggregator`` with a
``Sampling``, a ``Ledger``, ``accountant_for``) and fed ``OwnerReply``s made by ``make_reply``,
as owners make them. Every expected number is computed without the billboard: the server step
by hand, epsilons by fresh accountants / dp-accounting on literal events, the noise's standard
deviation from its formula z·C/(q·N).
"""

from __future__ import annotations

import math
from dataclasses import asdict

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from fedudp.aggregators import GaussianAggregator, MeanAggregator, Sampling
from fedudp.protocol.contributions import Contribution
from fedudp.billboard.server import Billboard, ServerStep
from fedudp.protocol.checkpoint import CheckpointError, dump, load_bytes
from fedudp.protocol.messages import OwnerReply, make_reply
from fedudp.billboard.plan import Plan
from fedudp.privacy.accountant import ADJACENCY, ApproxDp, Ledger, accountant_for
from fedudp.randomness import Purpose, numpy_rng, torch_generator

ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
G = dp_accounting.GaussianDpEvent
DELTA = 1e-5


def shared_tensors() -> dict[str, torch.Tensor]:
    """Three named tensors of distinct values, in a deliberate (non-alphabetical) order."""
    return {
        "layer.weight": torch.arange(6.0).reshape(2, 3),
        "layer.bias": torch.tensor([10.0, 11.0]),
        "extra": torch.arange(20.0, 24.0).reshape(2, 2),
    }


D = 12  # 6 + 2 + 4
NAMES = ("layer.weight", "layer.bias", "extra")


def zeros_shared(d: int = D) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(d)}


def ledger(mechanism: str = "gaussian", target: float | None = None) -> Ledger:
    return Ledger(
        unit="user",
        adjacency=ADJACENCY,
        accounting="certified",
        guarantee="certified",
        mechanism=mechanism,
        accountant="pld",
        delta=DELTA,
        target_epsilon=target,
    )


def mean_board(
    shared=None, lr: float = 1.0, mode: str = "delta", population: int = 4, seed: int = 0
) -> Billboard:
    sampling = Sampling(1.0, population)
    return Billboard(
        shared if shared is not None else zeros_shared(),
        MeanAggregator(sampling),
        sampling,
        ledger("none"),
        seed=seed,
        step=ServerStep(lr, mode),
    )


def gaussian_board(
    z: float = 20.0,
    clip: float = 1.0,
    sampling: Sampling = Sampling(1.0, 8),
    seed: int = 0,
    target: float | None = None,
    shared=None,
    plan=None,
) -> Billboard:
    agg = GaussianAggregator(clip, z, sampling)
    acc = accountant_for(Billboard.first_event(agg, plan), None, target)
    return Billboard(
        shared if shared is not None else zeros_shared(),
        agg,
        sampling,
        ledger("gaussian", target),
        acc,
        seed=seed,
        step=ServerStep(1.0, "delta"),
        target_epsilon=target,
        delta=DELTA,
        plan=plan,
    )


def reply(board: Billboard, rows: torch.Tensor, aggregator=None) -> OwnerReply:
    agg = aggregator or board.aggregator
    return make_reply(rows, board.names, agg.constraint)


def fresh_epsilons(event, k: int, target: float | None = None, one_off=None) -> list[float]:
    """ε after 1..k releases of ``event`` from a fresh accountant (literal events)."""
    acc = accountant_for(event, None, target)
    if one_off is not None:
        acc.compose(one_off)
    out = []
    for _ in range(k):
        acc.compose(event)
        out.append(acc.epsilon(DELTA))
    return out


# -- the broadcast --------------------------------------------------------------------------------
def test_shared_params_round_trip_names_shapes_order_and_copy():
    src = shared_tensors()
    bb = mean_board(src)
    assert bb.names == NAMES and bb.dim == D
    # u is the concatenation in the given order (not sorted)
    assert torch.equal(bb.u, torch.cat([src[k].reshape(-1) for k in NAMES]))
    out = bb.shared_params()
    assert tuple(out) == NAMES
    for k in NAMES:
        assert out[k].shape == src[k].shape and torch.equal(out[k], src[k])
    out["layer.bias"].fill_(-1.0)  # a copy: the billboard's state does not move
    assert torch.equal(bb.shared_params()["layer.bias"], torch.tensor([10.0, 11.0]))


# -- sampling -------------------------------------------------------------------------------------
def test_sample_is_a_deterministic_poisson_mask_keyed_by_seed_and_round():
    q, N, R = 0.3, 2000, 40
    a, b = mean_board(seed=7), mean_board(seed=7)
    a.sampling = b.sampling = Sampling(q, N)
    other = mean_board(seed=8)
    other.sampling = Sampling(q, N)
    masks = np.stack([a.sample(r) for r in range(1, R + 1)])
    assert masks.dtype == bool and masks.shape == (R, N)
    # the same (seed, round) gives the same mask, whatever was sampled before or on which board
    for r in (R, 3, 17, 3):
        assert np.array_equal(b.sample(r), masks[r - 1])
        # the documented stream: Purpose.SAMPLE keyed by (seed, round)
        assert np.array_equal(masks[r - 1], numpy_rng(7, Purpose.SAMPLE, r).random(N) < q)
    assert not np.array_equal(masks[0], masks[1])
    assert not np.array_equal(other.sample(1), masks[0])
    # about q·N members: each round within 5 sd of Binomial(N, q), the average within 5 se
    sd = math.sqrt(N * q * (1 - q))
    counts = masks.sum(1)
    assert np.all(np.abs(counts - q * N) < 5 * sd)
    assert abs(counts.mean() - q * N) < 5 * sd / math.sqrt(R)
    # every unit is sampled independently at rate q (inclusion frequency over rounds)
    assert abs(masks.mean() - q) < 5 * math.sqrt(q * (1 - q) / (R * N))
    # rate 1: every unit, every round
    c = mean_board(population=9)
    for r in (1, 2, 50):
        m = c.sample(r)
        assert m.dtype == bool and m.shape == (9,) and m.all()


# -- the step -------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,sign", [("delta", +1.0), ("gradient", -1.0)])
def test_release_of_the_plain_mean_steps_u_exactly(mode, sign):
    u0 = torch.tensor([1.0, -2.0, 0.5, 4.0])
    bb = mean_board({"w": u0.clone()}, lr=0.5, mode=mode, population=4)
    rows = torch.tensor(
        [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [-1.0, 0.0, 1.0, 2.0], [3.0, 3.0, 3.0, 2.0]]
    )
    # two owners' replies (sums and counts), merged by the billboard
    agg = bb.release([reply(bb, rows[:1]), reply(bb, rows[1:])], 1)
    mean = torch.tensor([2.0, 2.75, 3.5, 4.0])  # rows.mean(0), exact in binary
    assert torch.equal(agg.mean, mean) and agg.users_used == 4
    assert torch.equal(bb.u, u0 + sign * 0.5 * mean)
    assert torch.equal(bb.shared_params()["w"], u0 + sign * 0.5 * mean)
    # a non-private release is recorded, without an event or epsilon
    (e,) = bb.ledger.entries
    assert (e.round, e.event, e.epsilon, e.epsilon_rdp, e.sampling_rate) == (
        1,
        "None",
        None,
        None,
        1.0,
    )
    assert bb.accountant is None and bb.epsilon_after_round() is None and bb.within_budget()
    assert bb.next_round == 2
    # ServerStep itself
    assert torch.equal(ServerStep(0.5, mode)(u0, mean), u0 + sign * 0.5 * mean)


def test_gaussian_noise_std_is_z_clip_over_qN_and_keyed_by_round():
    z, clip, q, N, d, seed = 5.0, 0.2, 0.25, 40, 4000, 3
    sampling = Sampling(q, N)
    bb = gaussian_board(z, clip, sampling, seed=seed, shared=zeros_shared(d))
    expected_std = z * clip / (q * N)  # 0.1: the divisor is the public q·N = 10
    steps, means = [], []
    for r in range(1, 7):
        before = bb.u.clone()
        # a fixed zero contribution from 3 sampled units (the realized cohort is not the divisor)
        agg = bb.release([reply(bb, torch.zeros(3, d))], r)
        step = (bb.u - before).double()
        steps.append(step)
        means.append(agg.mean)
        # exactly the round-keyed generator's draw (float64), times z·C / (q·N)
        noise = torch.randn(
            d, generator=torch_generator(seed, Purpose.NOISE, r), dtype=torch.float64
        )
        torch.testing.assert_close(agg.mean.double(), noise * expected_std, rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(step, noise * expected_std, rtol=1e-5, atol=1e-7)
        assert agg.users_used == 3
    x = torch.stack(steps)  # 6 rounds x 4000 coordinates = 24000 draws
    n = x.numel()
    # sample sd of n normals: relative standard error 1/sqrt(2n) = 0.46 %; 3 % is > 6 se.
    # Dividing by the realized cohort (3) instead would give 0.33: far outside.
    assert abs(float(x.std()) / expected_std - 1) < 0.03
    assert abs(float(x.mean())) < 5 * expected_std / math.sqrt(n)
    # every round draws fresh noise
    assert not torch.equal(x[0], x[1])
    # same (seed, round) -> same noise on another billboard; another seed -> other noise
    twin, other = (
        gaussian_board(z, clip, sampling, seed=s, shared=zeros_shared(d)) for s in (seed, seed + 1)
    )
    assert torch.equal(twin.release([reply(twin, torch.zeros(3, d))], 4).mean, means[3])
    assert not torch.equal(other.release([reply(other, torch.zeros(3, d))], 4).mean, means[3])
    assert bb.ledger.entries[-1].noise_std == pytest.approx(z * clip)  # std on the sum


def test_gaussian_release_clips_each_row_before_summing():
    bb = gaussian_board(z=0.0, clip=1.0, sampling=Sampling(1.0, 2), shared=zeros_shared(3))
    rows = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.3, 0.4]])  # norms 5 and 0.5
    agg = bb.release([reply(bb, rows)], 1)
    # clipped to [0.6, 0.8, 0] and unchanged, summed, divided by q·N = 2; no noise at z = 0
    torch.testing.assert_close(bb.u, torch.tensor([0.3, 0.55, 0.2]))
    assert agg.diagnostics["clipped_fraction"] == 0.5


# -- the ledger -----------------------------------------------------------------------------------
def test_each_release_appends_one_entry_with_independently_composed_epsilon():
    z, q, N = 5.0, 0.25, 8
    bb = gaussian_board(z, 1.0, Sampling(q, N), seed=1)
    event = dp_accounting.PoissonSampledDpEvent(0.25, G(5.0))  # literal: what one round is
    assert str(Billboard.first_event(bb.aggregator)) == str(event)
    eps = fresh_epsilons(event, 3)
    for r in range(1, 4):
        predicted = bb.epsilon_after_round()
        bb.release([reply(bb, torch.ones(2, D) * r)], r)
        assert len(bb.ledger.entries) == r
        e = bb.ledger.entries[-1]
        assert (e.round, e.event, e.noise_multiplier, e.noise_std, e.sampling_rate) == (
            r,
            str(event),
            5.0,
            5.0,
            0.25,
        )
        assert e.epsilon == eps[r - 1] == predicted
    # and straight from dp-accounting: r self-composed releases, PLD at the grid 1e-4 / RDP
    for r in (1, 3):
        pld = pld_privacy_accountant.PLDAccountant(ADD_REMOVE, value_discretization_interval=1e-4)
        pld.compose(dp_accounting.SelfComposedDpEvent(event, r))
        rdp = rdp_privacy_accountant.RdpAccountant(neighboring_relation=ADD_REMOVE)
        rdp.compose(dp_accounting.SelfComposedDpEvent(event, r))
        e = bb.ledger.entries[r - 1]
        assert e.epsilon == pytest.approx(pld.get_epsilon(DELTA), rel=1e-12)
        assert e.epsilon_rdp == pytest.approx(rdp.get_epsilon(DELTA), rel=1e-9)
    assert bb.ledger.epsilon == eps[-1]
    assert 0 < eps[0] < eps[1] < eps[2]


def test_within_budget_turns_false_exactly_before_the_round_that_would_exceed():
    event = G(5.0)  # rate 1: a plain Gaussian per round
    target = 1.2  # between ε after 2 and 3 rounds (checked below)
    eps = fresh_epsilons(event, 3, target)
    assert eps[1] < target < eps[2]
    bb = gaussian_board(5.0, 1.0, Sampling(1.0, 4), target=target)
    released = 0
    for r in range(1, 6):
        if not bb.within_budget():
            break
        bb.release([reply(bb, torch.ones(4, D))], r)
        released += 1
    assert released == 2 and len(bb.ledger.entries) == 2
    assert bb.ledger.entries[-1].epsilon == eps[1] <= target
    assert bb.epsilon_after_round() == eps[2] > target
    # a target equal to ε after 2 rounds still allows the 2nd round
    exact = gaussian_board(5.0, 1.0, Sampling(1.0, 4), target=eps[1])
    assert exact.within_budget()
    exact.release([reply(exact, torch.ones(4, D))], 1)
    assert exact.within_budget()
    exact.release([reply(exact, torch.ones(4, D))], 2)
    assert not exact.within_budget()


def test_private_aggregator_needs_an_accountant():
    s = Sampling(1.0, 4)
    with pytest.raises(ValueError, match="accountant"):
        Billboard(zeros_shared(), GaussianAggregator(1.0, 1.0, s), s, ledger(), seed=0)
    # a non-private one does not, and never composes
    bb = Billboard(zeros_shared(), MeanAggregator(s), s, ledger("none"), seed=0)
    assert bb.accountant is None and bb.event is None


# -- divergence -----------------------------------------------------------------------------------
def test_non_finite_step_marks_diverged_and_keeps_the_last_finite_u():
    bb = mean_board(zeros_shared(4), lr=1e30, mode="delta")
    bb.release([reply(bb, torch.ones(4, 4))], 1)
    u1 = bb.u.clone()
    assert torch.equal(u1, torch.full((4,), 1e30)) and not bb.diverged
    bb.release([reply(bb, torch.full((4, 4), 1e10))], 2)  # 1e30 + 1e40 overflows float32
    assert bb.diverged and torch.equal(bb.u, u1)
    assert len(bb.ledger.entries) == 2  # the release itself happened and is recorded
    # a reply that carries a NaN total (not made by make_reply) is a non-finite step too
    bad = OwnerReply(bb.names, Contribution(None, torch.full((4,), math.nan), 4))
    bb.release([bad], 3)
    assert bb.diverged and torch.equal(bb.u, u1)
    # "the last step would have made u non-finite": a finite step clears it
    bb.release([reply(bb, torch.ones(4, 4))], 4)
    assert not bb.diverged and torch.equal(bb.u, torch.full((4,), 2e30))


# -- checkpoints ----------------------------------------------------------------------------------
def released_board(rounds: int = 3, **kw) -> Billboard:
    bb = gaussian_board(**kw)
    for r in range(1, rounds + 1):
        bb.release([reply(bb, torch.arange(float(D)).repeat(3, 1) * 0.1 * r)], r)
    return bb


def test_state_restore_round_trips_u_ledger_and_epsilon_bit_for_bit():
    bb = released_board(3)
    state = load_bytes(dump(bb.state()))  # through a checkpoint's bytes
    fresh = gaussian_board()
    fresh.restore(state)
    assert torch.equal(fresh.u, bb.u) and fresh.diverged is False
    assert [asdict(e) for e in fresh.ledger.entries] == [asdict(e) for e in bb.ledger.entries]
    assert fresh.accountant.epsilon(DELTA) == bb.ledger.entries[-1].epsilon  # recomposed
    assert fresh.next_round == 4 and fresh.ledger.epsilon == bb.ledger.epsilon
    # and it continues exactly as the original does
    rows = torch.ones(2, D)
    a1 = bb.release([reply(bb, rows)], 4)
    a2 = fresh.release([reply(fresh, rows)], 4)
    assert torch.equal(a1.mean, a2.mean) and torch.equal(fresh.u, bb.u)
    assert asdict(fresh.ledger.entries[-1]) == asdict(bb.ledger.entries[-1])


def test_restore_refuses_a_state_whose_entries_differ_or_a_used_billboard():
    state = released_board(3).state()

    def tampered(fn):
        s = {**state, "entries": [dict(e) for e in state["entries"]]}
        fn(s)
        return s

    def other_event(s):
        s["entries"][1]["event"] = str(G(6.0))

    def other_epsilon(s):
        s["entries"][-1]["epsilon"] = s["entries"][-1]["epsilon"] * (1 + 1e-12)

    def missing_round(s):
        del s["entries"][0]

    for bad, match in (
        (other_event, "round 2 released"),
        (other_epsilon, "recomposed epsilon"),
        (missing_round, "rounds 1, 2"),
    ):
        with pytest.raises(CheckpointError, match=match):
            gaussian_board().restore(tampered(bad))
    # a configuration releasing another event (noise multiplier 6, not 20) refuses the ledger
    with pytest.raises(CheckpointError, match="round 1 released"):
        gaussian_board(z=6.0).restore(state)
    # shared parameters of another shape
    with pytest.raises(CheckpointError, match="shape"):
        gaussian_board(shared=zeros_shared(D + 1)).restore(state)
    # a billboard that already released is not fresh
    used = released_board(1)
    with pytest.raises(RuntimeError, match="fresh"):
        used.restore(state)
    assert len(used.ledger.entries) == 1


# -- a training algorithm's plan ------------------------------------------------------------------
class ScheduledPlan(Plan):
    """One unit per round, alternating events, a one-off block, an exact estimator in round 2
    and a projected step in round 3 (the documented hooks of fedudp.billboard.plan)."""

    def __init__(self, population: int, exact) -> None:
        self.population, self.exact = population, exact

    def sample(self, round_):
        m = np.zeros(self.population, dtype=bool)
        m[round_ % self.population] = True
        return m

    def event(self, round_):
        return G(5.0) if round_ % 2 else G(8.0)

    def one_off(self):
        return ApproxDp(0.05, 1e-7)

    def aggregator(self, round_):
        return self.exact if round_ == 2 else None

    def step(self, u, mean, round_):
        return (u + mean).clamp(-0.5, 0.5) if round_ == 3 else None


def test_plan_hooks_override_sample_event_aggregator_and_step():
    s = Sampling(1.0, 4)
    plan = ScheduledPlan(4, GaussianAggregator(1.0, 0.0, s))
    bb = gaussian_board(z=3.0, clip=1.0, sampling=s, plan=plan, shared=zeros_shared(4))
    assert Billboard.first_event(bb.aggregator, plan) == G(5.0)
    assert Billboard.first_event(bb.aggregator) == G(3.0)  # without a plan
    assert bb.ledger.extra["one_off_event"] == str(ApproxDp(0.05, 1e-7))
    for r in (1, 2, 3, 7):
        assert np.array_equal(bb.sample(r), np.arange(4) == r % 4)
    row = torch.full((1, 4), 1.0)  # norm 2: clipped to 1
    for r in (1, 2, 3):
        before = bb.u.clone()
        agg = bb.release([make_reply(row, bb.names, bb.aggregator.constraint)], r)
        if r == 1:  # the billboard's own step and its own (noisy, z = 3) aggregator
            torch.testing.assert_close(bb.u, before + agg.mean)
        if r == 2:  # the plan's exact aggregator: the clipped row / (q·N) = 0.5/4 each
            torch.testing.assert_close(agg.mean, torch.full((4,), 0.125))
            torch.testing.assert_close(bb.u, before + 0.125)
        if r == 3:  # the plan's step
            torch.testing.assert_close(bb.u, (before + agg.mean).clamp(-0.5, 0.5))
    assert float(bb.u.abs().max()) <= 0.5
    e = bb.ledger.entries
    assert [x.event for x in e] == [str(G(5.0)), str(G(8.0)), str(G(5.0))]
    assert [x.noise_multiplier for x in e] == [3.0, 0.0, 3.0]
    # epsilon: the one-off block (basic composition) plus the plan's events, composed afresh
    acc = accountant_for(G(5.0))
    acc.compose(ApproxDp(0.05, 1e-7))
    expect = []
    for ev in (G(5.0), G(8.0), G(5.0)):
        acc.compose(ev)
        expect.append(acc.epsilon(DELTA))
    assert [x.epsilon for x in e] == expect
    # round 1 literally: PLD of one Gaussian(5) at delta - 1e-7, plus 0.05
    pld = pld_privacy_accountant.PLDAccountant(ADD_REMOVE, value_discretization_interval=1e-4)
    pld.compose(dp_accounting.SelfComposedDpEvent(G(5.0), 1))
    assert e[0].epsilon == pytest.approx(pld.get_epsilon(DELTA - 1e-7) + 0.05, rel=1e-12)
    # a plan without checkpoint_state cannot be checkpointed
    with pytest.raises(CheckpointError, match="ScheduledPlan"):
        bb.state()
