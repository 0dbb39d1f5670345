"""[ASI] randomized smoothing as an owner hook: Asi & Liu (seed 003_60e5b11bfa501c93.txt),
§4 Algorithm 3, the query q_t(Z) = (1/m) Σ_j ∇l(θ_t + y_j; z_j) with y_j ~ Unif(B(0, r))
drawn fresh for every record (docs/algorithms.md#asi-and-liu-algorithm-3).

``Smoothing(r, seed)`` is the ``OwnerHooks`` that Algorithms 3 and 4 give the owner component:
each user's shared vector is its smoothed mean gradient instead of the plain one. The
perturbations are public randomness keyed by (seed, round, the user's stable id), so they are
the same on every engine and do not depend on any other user's data.
"""

from __future__ import annotations

import numpy as np
import torch

from fedudp.data.federation import Federation
from fedudp.owner import local_sgd
from fedudp.owner.owners import OwnerHooks, Owners, Params
from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "uniform_ball",
    "Smoothing",
]


def uniform_ball(rng: np.random.Generator, k: int, d: int, radius: float) -> np.ndarray:
    """[k, d] points uniform in the l2 ball of ``radius``
    (docs/algorithms.md#uniform-point-in-a-ball), float64.

    Parameters
    ----------
    rng : np.random.Generator
        The randomness (public).
    k, d : int
        How many points; their dimension.
    radius : float
        The ball's radius.

    Returns
    -------
    np.ndarray
        Shape ``[k, d]``.
    """
    g = rng.standard_normal((k, d))
    u = rng.random((k, 1))
    return (
        radius * u ** (1.0 / d) * g / np.maximum(np.linalg.norm(g, axis=1, keepdims=True), 1e-300)
    )


class Smoothing(OwnerHooks):
    """Users' gradients at randomly smoothed shared parameters (radius ``radius``; 0: plain).

    Parameters
    ----------
    radius : float
        The smoothing radius r (0: plain gradients).
    seed : int
        Keys the perturbations (public randomness).
    """

    def __init__(self, radius: float, seed: int) -> None:
        self.radius, self.seed = float(radius), int(seed)

    def user_gradients(
        self,
        owners: Owners,
        fed: Federation,
        shared: Params,
        fr_unit: Params,
        fr_common: Params,
        sub: local_sgd.Units,
        user_ids: np.ndarray,
        round_: int,
    ) -> torch.Tensor | None:
        """[len(sub), d_shared]: each user's mean over its records z_j of grad l(u + y_j; z_j),
        y_j ~ Unif(B(0, r)) per record (float64)."""
        if self.radius <= 0:
            return None
        names, r, d = owners.spec.shared, self.radius, owners.shared_dim
        sizes = sub.sizes.astype(np.int64)
        rec = np.concatenate([np.arange(s, s + k) for s, k in zip(sub.starts, sizes)])
        of = np.repeat(np.arange(len(sub)), sizes)
        Y = torch.cat(
            [
                torch.from_numpy(
                    uniform_ball(
                        numpy_rng(self.seed, Purpose.SMOOTHING, round_, int(uid)), int(k), d, r
                    )
                )
                for uid, k in zip(user_ids, sizes)
            ]
        )
        base = local_sgd.flatten(local_sgd.expand(shared, len(rec)), names)
        # Y drawn in float64 on the CPU, moved to the owners' device (engine_opts.device)
        flat = (base.to(torch.float64) + Y.to(base.device)).to(base.dtype)
        trainable, i = {}, 0
        for k in names:
            n = shared[k].numel()
            trainable[k] = flat[:, i : i + n].reshape(len(rec), *shared[k].shape)
            i += n
        ones = np.ones(len(rec), dtype=np.int64)
        units = local_sgd.Units(rec, ones, np.zeros_like(ones), rec, ones)
        fr = local_sgd.select(fr_unit, of) if fr_unit else {}
        G = local_sgd.flatten(
            local_sgd.mean_gradients(owners.model, trainable, fr, fr_common, fed.x, fed.y, units),
            names,
        )
        out = torch.zeros(len(sub), d, dtype=G.dtype, device=G.device)
        out.index_add_(0, torch.from_numpy(of).to(G.device), G)
        return out / torch.from_numpy(np.maximum(sizes, 1)).to(G.device, G.dtype).unsqueeze(1)
