"""The embedded default dataset: a synthetic labelled pool, no download needed.

In the spirit of FedProx's Synthetic(alpha, beta) (Li et al. 2020) but as a *pool* so the
same partition schemes apply as for MNIST: features x ~ N(v_c, I) around a class-dependent
centre mixed with a shared Gaussian background, labels from a fixed random softmax teacher
(``signal`` sets how separable). Heterogeneity between owners then comes from the partition
(``paper_classes``: each owner sees at most ``classes_per_owner`` classes; ``dirichlet``), so
a personal head (label skew) and collaboration (the shared teacher needs many records) both
matter.
"""

from __future__ import annotations

import numpy as np

from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "synthetic_pool",
]

TRAIN_SPLIT, TEST_SPLIT = 1, 2  # the two draws' stream keys (under the run seed)


def synthetic_pool(
    features: int, classes: int, n_train: int, n_test: int, signal: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train_x float32 [n,features], train_y int64, test_x, test_y), all from ``seed``.

    Parameters
    ----------
    features, classes : int
        Feature and class counts.
    n_train, n_test : int
        Training and test record counts.
    signal : float
        The teacher's logit scale.
    seed : int
        The run's seed.

    Returns
    -------
    tuple of numpy.ndarray
        ``(train_x, train_y, test_x, test_y)``.
    """
    rng = numpy_rng(seed, Purpose.SYNTHETIC_TEACHER)
    teacher = rng.standard_normal((features, classes)) * signal / np.sqrt(features)
    bias = rng.standard_normal(classes) * 0.5

    def draw(n: int, r: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        x = r.standard_normal((n, features))
        logits = x @ teacher + bias
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        u = r.random((n, 1))
        y = (p.cumsum(1) < u).sum(1).clip(max=classes - 1)
        return x.astype(np.float32), y.astype(np.int64)

    tx, ty = draw(n_train, np.random.default_rng([seed, TRAIN_SPLIT]))
    vx, vy = draw(n_test, np.random.default_rng([seed, TEST_SPLIT]))
    return tx, ty, vx, vy
