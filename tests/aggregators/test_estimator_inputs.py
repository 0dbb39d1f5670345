"""Estimators take the cohort matrix as a torch tensor or a numpy array, and refuse anything else
with a ``TypeError`` that says what they take."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.build import estimator as build_aggregator
from fedudp.aggregators.base import as_generator
from fedudp.config import config_from_overrides


def estimators():
    yield GaussianAggregator(clip=1.0, noise_multiplier=2.0, sampling=Sampling(1.0, 50))
    cfg = config_from_overrides(
        {
            "method": "full_dp",
            "aggregator": "winsorized",
            "dataset.num_records": 2000,
            "partition.num_owners": 4,
            "partition.records_per_user": 10,
            "train.rounds": 2,
        }
    )
    yield build_aggregator(cfg, Sampling(1.0, 200), 2, 6)


@pytest.mark.parametrize("agg", list(estimators()), ids=lambda a: a.name)
def test_numpy_and_torch_inputs_give_the_same_release(agg):
    n = agg.sampling.population
    X = np.random.default_rng(0).uniform(-0.3, 0.3, size=(n, 6))
    a = agg(X, rng=7).mean
    b = agg(torch.from_numpy(X), rng=torch.Generator().manual_seed(7)).mean
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert a.dtype == torch.float64 and a.shape == (6,)
    c = agg(X.round().astype(np.int64), rng=7).mean  # integers read as float64
    assert c.dtype == torch.float64


@pytest.mark.parametrize(
    "bad,err",
    [
        ("rows", TypeError),
        ([[0.0, 1.0]], TypeError),
        (np.array([["a", "b"]]), TypeError),
        (np.ones(6), ValueError),
    ],
)
def test_other_inputs_are_refused_with_what_an_estimator_takes(bad, err):
    agg = GaussianAggregator(clip=1.0, noise_multiplier=2.0, sampling=Sampling(1.0, 50))
    with pytest.raises(err, match="estimator takes"):
        agg(bad, rng=0)


def test_release_noise_is_unpredictable_without_a_seed():
    agg = GaussianAggregator(clip=1.0, noise_multiplier=2.0, sampling=Sampling(1.0, 50))
    X = np.zeros((50, 4))
    assert not torch.equal(agg(X).mean, agg(X).mean)
    with pytest.raises(TypeError, match="rng"):
        as_generator("seed")
