"""Whole-run release statistics: what the billboard actually releases, round after
round, on both engines, against what the ledger accounts for.

* Noise: every round's released mean minus the noise-free mean of the contributions it received
  is N(0, (zC/(qN))^2) per coordinate, z C the ledger's noise std, fresh every round
  (consecutive rounds uncorrelated), the same on engine=local and engine=flower.
* Poisson cohorts (add/remove adjacency, docs/algorithms.md#privacy-units-and-adjacency): each
  unit enters a round with
  probability q, the cohort size has variance N q (1-q), rounds are independent; and on both
  engines the units whose vectors reach the billboard are exactly that sample's.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from conftest import tiny_cfg
from fedudp.protocol.contributions import Contribution
from fedudp.billboard.server import Billboard
from fedudp.run import run

Q = 0.3


def _record(monkeypatch) -> list[dict]:
    """Patch the billboard (it runs in this process on both engines) to record each release."""
    got: list[dict] = []
    orig = Billboard.release

    def release(self, replies, round_, answered=None):
        c = Contribution.merge(
            [r.contribution for r in replies],
            self.dim,
            torch.float64,
            self.aggregator.needs_per_user_vectors,
        )
        agg = orig(self, replies, round_, answered)
        noise = agg.mean.to(torch.float64) * self.sampling.expected_cohort - c.total
        got.append(
            {
                "round": round_,
                "noise": noise,
                "count": c.count,
                "sampled": int(self.sample(round_).sum()),
                "std": self.aggregator.noise_std,
                "z": self.aggregator.noise_multiplier,
                "expected": self.sampling.expected_cohort,
            }
        )
        return agg

    monkeypatch.setattr(Billboard, "release", release)
    return got


def _cfg(engine: str, rounds: int):
    return tiny_cfg(
        "full_dp",
        **{
            "engine": engine,
            "train.rounds": rounds,
            "train.sampling_rate": Q,
            "dataset.features": 40,
            "privacy.noise_multiplier": 2.0,
            "privacy.epsilon": 1000.0,
            "privacy.clip": 0.5,
            "engine_opts.float64": True,
            "engine_opts.threads": 1,
            "train.eval_every": rounds,
            # engine=flower: one Ray actor (2 CPUs on this machine) serves the 4 owners
            "engine_opts.num_cpus": 2.0,
        },
    )


@pytest.mark.parametrize(
    "engine", ["local", pytest.param("flower", marks=pytest.mark.timeout(300))]
)
def test_released_noise_is_the_ledgers_fresh_every_round_and_cohorts_are_the_sample(
    tmp_path, monkeypatch, engine
):
    rounds = 12
    got = _record(monkeypatch)
    s = run(_cfg(engine, rounds), tmp_path)
    assert s["rounds_completed"] == rounds and len(got) == rounds
    ledger = json.loads((tmp_path / "ledger.json").read_text())["entries"]
    N = s["num_users"]
    for g, e in zip(got, ledger):
        # the units whose vectors arrived are the billboard's Poisson sample, no more, no fewer
        assert g["count"] == g["sampled"]
        assert g["std"] == pytest.approx(e["noise_std"]) == pytest.approx(2.0 * 0.5)
        assert g["expected"] == pytest.approx(Q * N)
    noise = torch.stack([g["noise"] for g in got]) / got[0]["std"]  # standardised, [T, d]
    d = noise.shape[1]
    pooled = noise.flatten()
    # per-coordinate std zC (the released mean's: zC/(qN)) within 4 standard errors
    assert float(pooled.std()) == pytest.approx(1.0, abs=4 / math.sqrt(2 * pooled.numel()))
    assert abs(float(pooled.mean())) < 4 / math.sqrt(pooled.numel())
    # fresh each round: consecutive rounds' noise vectors uncorrelated, and no two rounds equal
    for a, b in zip(noise[:-1], noise[1:]):
        r = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert abs(r) < 4.5 / math.sqrt(d), r
    assert len({tuple(v[:4].tolist()) for v in noise}) == rounds


def test_poisson_cohorts_inclusion_rate_size_variance_and_independence():
    # the billboard's sampler, over many rounds (engine-independent: both engines take their
    # cohort from it, as the test above checks round by round)
    from fedudp.run import prepare

    R, N = 3000, 400
    bb = prepare(
        tiny_cfg(
            "full_dp",
            **{
                "train.sampling_rate": Q,
                "dataset.num_records": N,
                "train.rounds": R,
                "privacy.epsilon": 1e6,
            },
        )
    ).billboard
    assert bb.sampling.population == N
    S = np.stack([bb.sample(r) for r in range(1, R + 1)])  # [R, N] inclusion
    rate = S.mean(0)  # per unit
    se = math.sqrt(Q * (1 - Q) / R)
    assert np.all(np.abs(rate - Q) < 5 * se)  # every unit at rate q
    assert abs(S.mean() - Q) < 4 * math.sqrt(Q * (1 - Q) / (R * N))
    sizes = S.sum(1)
    var = N * Q * (1 - Q)
    assert sizes.var(ddof=1) == pytest.approx(var, rel=4 * math.sqrt(2 / (R - 1)))
    lag = np.corrcoef(sizes[:-1], sizes[1:])[0, 1]
    assert abs(lag) < 4 / math.sqrt(R)  # sizes independent
    both = (S[:-1] & S[1:]).mean()  # unit in rounds t, t+1
    assert both == pytest.approx(Q * Q, abs=5 * math.sqrt(Q * Q * (1 - Q * Q) / ((R - 1) * N)))
