"""What docs/flower-apps.md#distributed-dp-and-flowers-secagg says of Flower 1.42's SecAgg+
arithmetic, checked against the installed Flower: its quantization, weighting and unmasking
(the masks cancel mod ``modulus_range`` and are left out here) carry fedudp's reduced integer
messages exactly only with the quantizer at exactly 1 (``quantization_range = 2^b``,
``clipping_range = 2^(b-1)``), the weight neutralised (``num_examples = max_weight``) and the
integer sum recovered from Flower's float average by rounding; Flower's defaults (clipping 8,
2^22 levels, ``num_examples`` weights) do not: the check that passes the neutral setting fails
them (its twin).
"""

from __future__ import annotations

import numpy as np
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_combine,
    factor_extract,
    parameters_mod,
    parameters_multiply,
)
from flwr.common.secure_aggregation.quantization import dequantize, quantize

BITS, OWNERS, D = 16, 5, 64


def flower_round(messages, weights, clipping_range, quantization_range, modulus_range, max_w):
    """Flower's SecAgg+ arithmetic on each client's float parameters (secaggplus_mod.py,
    ``_collect_masked_vectors``: weight ratio, quantize, factor_combine, mod) and on their
    modular sum (secaggplus_workflow.py, ``unmask_stage``: factor_extract, dequantize, the
    offset and the inverse total ratio), without the masks (they cancel mod the modulus)."""
    total = None
    for m, w in zip(messages, weights):
        q_ratio = round(w / max_w * quantization_range)
        params = parameters_multiply([m], q_ratio / quantization_range)
        q = factor_combine(q_ratio, quantize(params, clipping_range, quantization_range))
        q = [a.astype(np.int64) for a in q]
        total = q if total is None else [a + b for a, b in zip(total, q)]
    total = parameters_mod(total, modulus_range)
    q_total, recon = factor_extract(total)
    (vec,) = dequantize(recon, clipping_range, quantization_range)
    vec += -(len(messages) - 1) * clipping_range
    vec *= quantization_range / q_total
    return vec  # Flower's weighted *average* of the parameters, float64


def carried_exactly(clipping_range, quantization_range, modulus_range, weights, max_w) -> bool:
    """Whether fedudp's sum mod 2^bits is recovered from Flower's average: the clients send
    their reduced messages centred (m - 2^(b-1), integers), the sum is n·average + n·2^(b-1)
    rounded, reduced mod 2^bits."""
    rng = np.random.default_rng(0)
    msgs = [rng.integers(0, 1 << BITS, D, dtype=np.int64) for _ in range(OWNERS)]
    half = 1 << (BITS - 1)
    avg = flower_round(
        [(m - half).astype(np.float64) for m in msgs],
        weights,
        clipping_range,
        quantization_range,
        modulus_range,
        max_w,
    )
    got = np.rint(avg * OWNERS + OWNERS * half).astype(np.int64) & ((1 << BITS) - 1)
    return bool(np.array_equal(got, sum(msgs) & ((1 << BITS) - 1)))


def test_secaggplus_carries_the_integer_messages_only_with_the_quantizer_at_one():
    neutral = [1000.0] * OWNERS  # num_examples = max_weight for every client
    assert carried_exactly(2.0 ** (BITS - 1), 1 << BITS, 1 << (BITS + 8), neutral, 1000.0)
    # twins: Flower's defaults (clipping_range 8, 2^22 levels, modulus 2^32), or the weights
    # left as the clients' num_examples, or one more level than 2^b: not exact
    assert not carried_exactly(8.0, 1 << 22, 1 << 32, neutral, 1000.0)
    assert not carried_exactly(
        2.0 ** (BITS - 1), 1 << BITS, 1 << (BITS + 8), [700.0, 300.0, 1000.0, 50.0, 999.0], 1000.0
    )
    assert not carried_exactly(2.0 ** (BITS - 1), (1 << BITS) + 1, 1 << (BITS + 8), neutral, 1000.0)
