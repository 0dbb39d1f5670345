"""Which batched kernels the owner side may take: one explicit, public setting per path.

Every path computes the same values as the reference path it replaces, up to float rounding
(summation order, float32 products formed in another order); none changes what is sampled,
clipped, counted or released. They are choices of speed and memory, made from public numbers
only (the model's layer kinds and shapes, the users' record counts), never from data. The
owner side's settings (``fedudp.owner.settings.OwnerTraining.kernels``) hold one ``Kernels``;
the owners hand it on to owner-side DP-SGD (``fedudp.owner.dpsgd.DpSgdSpec.kernels``) and
to the per-record passes (``channels_last``). The defaults are what every run takes; tests set
a path off to compare it with its reference. Measured costs: docs/benchmarks.md.

The records per chunk of the one-step and ghost paths (``ONE_STEP_RECORDS``, ``GHOST_RECORDS``,
``GHOST_RECORDS_CONV``) bound memory; they change the chunks, not the values.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GHOST_RECORDS", "GHOST_RECORDS_CONV", "ONE_STEP_RECORDS", "Kernels"]

# records per one-step chunk: its vectors, per-record weight gradients and their clipped copy
# are the chunk's memory (about 0.7 MiB a record for the paper CNN)
ONE_STEP_RECORDS = 128
# records per ghost chunk: no [users, d] matrix is held, only activations, output gradients and
# the chunk's per-layer Grams or per-user weight gradients; a model with convolutions holds
# much more per record (its activations, per-record convolution weight gradients): 128, as
# ONE_STEP_RECORDS
GHOST_RECORDS = 512
GHOST_RECORDS_CONV = 128


@dataclass(frozen=True)
class Kernels:
    """The owner side's batched-kernel choices (all on by default: what a run takes).

    Parameters
    ----------
    ghost : bool
        Clip users without building their vectors (``fedudp.owner.ghost``: squared norms in
        float64 from the layers' inputs and output gradients, the clipped sum as one weighted
        weight-gradient pass), where every shared layer is of a kind it covers and the model's
        shapes make it the cheaper batched path. Taken by the server placement's one-step
        users of a clipped sum and by owner-side DP-SGD's steps. False: their vectors (or
        per-record gradients) built, clipped with float64 norms and summed, the reference path.
    one_step : bool
        A user's (or an ``owner_sgd`` owner's) vector that is one SGD step or a mean gradient
        at the broadcast from one batched forward/backward per chunk
        (``fedudp.owner.one_step``). False: every such unit through ``fedudp.owner.local_sgd``
        (vmapped, or the per-unit loop), the reference path.
    channels_last : bool
        On the CPU, the per-record passes (``fedudp.owner.per_sample.weighted_layer_grads``)
        take every shared convolution's output in channels-last memory format where a probe
        on a public example batch found the model's forward gives the same output that way.
        False: the model's own layout.

    Notes
    -----
    Every choice computes the same released values up to float rounding; the tests compare
    each path with its reference (tests/owner/test_ghost.py, test_one_step.py,
    test_per_sample.py) and the record-independence probe checks every kernel
    (``fedudp.owner.independence``).
    """

    ghost: bool = True
    one_step: bool = True
    channels_last: bool = True
