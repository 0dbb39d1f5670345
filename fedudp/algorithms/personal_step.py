"""[HUANG] the personal move of Huang et al.'s Algorithms 1 and 2 as an owner hook (seed
001_40594ba3d5609f29.txt, Alg. 1 line 7 and App. B Alg. 2; docs/algorithms.md#huang-algorithm-1).

Instead of epochs of SGD over all of an owner's records, the owners of the round's sampled
units take one gradient step of size η on their personal parameters, over the sampled units'
records: x_j <- x_j - η (mean over owner j's sampled records of grad_x h(x_j, u, z)); every
other owner's x_j stays. No noise: personal parameters never leave their owner.

Alg. 1's full-DP baseline (``noise_std``): every owner's personal block also moves by
-η b_j every step, b_j ~ N(0, noise_std² I_k) drawn fresh in float64 from the run's keyed
randomness at (seed, PERSONAL_NOISE, round, global owner id), for every owner, sampled or not;
the std is the per-coordinate std of the shared step's released mean ("same σ"). The accounting
is the shared release's: this noise is extra.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from fedudp.data.federation import Federation
from fedudp.owner import local_sgd
from fedudp.owner.owners import OwnerHooks, Owners, Params, user_units
from fedudp.randomness import Purpose, numpy_rng

__all__ = [
    "PersonalStep",
]


class PersonalStep(OwnerHooks):
    """``cohort(round_)``: the round's sampled unit ids (the plan's public sample).

    Parameters
    ----------
    step : float
        The personal step size η.
    cohort : Callable[[int], np.ndarray]
        The round's sampled unit ids.
    seed : int
        Keys the personal noise.
    noise_std : float, optional
        The personal noise's standard deviation (None: no noise).
    """

    def __init__(
        self,
        step: float,
        cohort: Callable[[int], np.ndarray],
        seed: int,
        noise_std: float | None = None,
    ) -> None:
        self.step, self.cohort, self.seed = float(step), cohort, int(seed)
        self.noise_std = noise_std

    def personal_round(
        self, owners: Owners, fed: Federation, shared: Params, personal: Params, round_: int
    ) -> Params:
        units = np.asarray(self.cohort(round_), dtype=np.int64)
        noisy = bool(self.noise_std)
        if not owners.spec.personal or (not len(units) and not noisy):
            return personal
        new = {k: v.clone() for k, v in personal.items()}
        if len(units):
            self._gradient_step(owners, fed, shared, personal, units, new)
        if noisy:
            for k, b in self.noise(owners, fed, round_).items():
                new[k] = (new[k].to(torch.float64) - self.step * b).to(new[k].dtype)
        return new

    def noise(self, owners: Owners, fed: Federation, round_: int) -> dict[str, torch.Tensor]:
        """This round's b_j for every owner in ``fed`` (float64, stacked like the personal
        parameters), each from its own keyed stream: independent of which owners share a
        process."""
        assert self.noise_std is not None  # called when noisy
        std, names = float(self.noise_std), owners.spec.personal
        shapes = [tuple(owners.public_personal[k].shape) for k in names]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        draws = np.stack(
            [
                numpy_rng(self.seed, Purpose.PERSONAL_NOISE, round_, int(j)).standard_normal(
                    sum(sizes)
                )
                for j in fed.owner_ids
            ]
        )
        out, i = {}, 0
        for k, s, n in zip(names, shapes, sizes):
            # drawn in float64 on the CPU, then moved to the owners' device (engine_opts.device)
            noise = std * torch.from_numpy(draws[:, i : i + n]).reshape(len(fed.owner_ids), *s)
            out[k] = noise.to(owners.device)
            i += n
        return out

    def _gradient_step(
        self,
        owners: Owners,
        fed: Federation,
        shared: Params,
        personal: Params,
        units: np.ndarray,
        new: Params,
    ) -> None:
        """x_j -= η (owner j's sampled records' mean personal gradient), in ``new``."""
        who = fed.user_owner[units]
        grads = local_sgd.mean_gradients(
            owners.model,
            local_sgd.select(personal, who),
            {},
            dict(shared),
            fed.x,
            fed.y,
            user_units(fed, units),
        )
        dev = owners.device
        sizes = torch.from_numpy(np.diff(fed.user_offsets)[units].astype(np.float64)).to(dev)
        uniq, row = np.unique(who, return_inverse=True)
        idx = torch.from_numpy(row).to(dev)
        weight = torch.zeros(len(uniq), dtype=torch.float64, device=dev).index_add_(0, idx, sizes)
        for k, g in grads.items():
            flat = g.to(torch.float64).reshape(len(units), -1) * sizes.unsqueeze(1)
            tot = torch.zeros(len(uniq), flat.shape[1], dtype=torch.float64, device=dev).index_add_(
                0, idx, flat
            )
            step = (tot / weight.unsqueeze(1)).reshape(len(uniq), *g.shape[1:]).to(new[k].dtype)
            new[k][torch.from_numpy(uniq)] -= self.step * step
