"""Pairwise masks: one owner's message looks uniform mod 2^b; the sum decodes exactly.

Uniformity: a message of ``M = 4096`` coordinates mod ``2^8`` is tested with a chi-square test
over the 256 residues (16 expected per bin) and a Kolmogorov–Smirnov test of the residues
spread uniformly over their unit cells, each at ``alpha = 0.01``; a message fails if either
test rejects. Over 200 independent rounds (fresh secrets and noise) the masked messages fail
at about the nominal rate (at most 8 of 200 allowed), while the same test catches, in at least
199 of 200 rounds (an empirical power of at least 0.99; 200 of 200 measured), the unmasked
message (an owner's noise-only share, discrete Gaussian of std 32, reduced mod 2^8: the most
spread honest message) and the half-masked twin (masks only with peers ``j > owner``) of the
last owner, which thereby sends its vector in the clear. A middle owner's half-masked message
is still uniform, but its masks do not cancel: the exact-sum test catches it.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import fedudp.secure.masks as masks
from fedudp.secure.encoding import reduce_mod
from fedudp.secure.masks import MaskKeys, SecureSum, centered, expand, mask, owner_mask
from fedudp.secure.noise import discrete_gaussian

BITS, M, ALPHA, TRIALS = 8, 4096, 0.01, 200
OWNERS = list(range(5))


def looks_uniform(msg: np.ndarray, jitter: np.random.Generator) -> bool:
    k = 1 << BITS
    c = np.bincount(msg.astype(np.int64), minlength=k)
    chi = stats.chisquare(c).pvalue
    u = (msg.astype(np.float64) + jitter.random(msg.shape[0])) / k  # uniform on [0,1) iff uniform
    ks = stats.kstest(u, "uniform").pvalue
    return chi > ALPHA and ks > ALPHA


def half_mask(keys, owner, peers, round_, dim, bits, cache=None):
    """Weakened twin: masks only with the peers above the owner."""
    up = [j for j in peers if j > owner]
    return (
        owner_mask(keys, owner, up + [owner], round_, dim, bits)
        if up
        else np.zeros(dim, dtype=np.uint64)
    )


def messages(kind: str):
    fails = 0
    jitter = np.random.default_rng(99)
    for t in range(TRIALS):
        rng = np.random.default_rng([5, t])
        vec = reduce_mod(discrete_gaussian(M, 32.0, rng), BITS)
        keys = MaskKeys(rng.bytes(32), 5)
        if kind == "masked":
            msg = mask(vec, keys, 4, OWNERS, t, BITS)
        elif kind == "unmasked":
            msg = vec
        else:
            msg = (vec + half_mask(keys, 4, OWNERS, t, M, BITS)) & np.uint64(255)
        fails += not looks_uniform(msg, jitter)
    return fails


def test_a_masked_message_is_uniform_and_the_test_has_power():
    assert messages("masked") <= 8
    assert messages("unmasked") >= TRIALS - 1
    assert messages("half") >= TRIALS - 1


def vectors(bits, dim, seed=0):
    rng = np.random.default_rng(seed)
    return {o: rng.integers(0, 1 << bits, dim, dtype=np.uint64) for o in OWNERS}


@pytest.mark.parametrize("bits", [2, 16, 62])
def test_the_masked_sum_is_the_sum_exactly(bits):
    dim, r = 1000, 7
    vecs = vectors(bits, dim)
    keys = MaskKeys(bytes(range(32)), 5)
    agg = SecureSum(bits, dim)
    for o in OWNERS:
        agg.add(o, mask(vecs[o], keys, o, OWNERS, r, bits))
    got = agg.unmask([], OWNERS, keys.pair_seed, r)
    want = sum(int(v[0]) for v in vecs.values()) % (1 << bits)
    assert got.dtype == np.uint64 and int(got[0]) == want
    exact = np.array([sum(int(vecs[o][i]) for o in OWNERS) % (1 << bits) for i in range(dim)])
    np.testing.assert_array_equal(got.astype(object), exact.astype(object))


def plus_plus(keys, owner, peers, round_, dim, bits, cache=None):
    """Weakened twin: both owners of a pair add the mask (it does not cancel)."""
    total = np.zeros(dim, dtype=np.uint64)
    for j in sorted(set(peers) - {owner}):
        total += expand(keys.pair_seed(owner, j, round_), dim, bits)
    return total & np.uint64((1 << bits) - 1)


@pytest.mark.parametrize("twin", [None, plus_plus, half_mask])
def test_a_mask_that_does_not_cancel_is_caught(monkeypatch, twin):
    bits, dim, r = 16, 500, 2
    if twin is not None:
        monkeypatch.setattr(masks, "owner_mask", twin)
    vecs = vectors(bits, dim, 1)
    keys = MaskKeys(bytes(32), 5)
    agg = SecureSum(bits, dim)
    for o in OWNERS:
        agg.add(o, mask(vecs[o], keys, o, OWNERS, r, bits))
    truth = (sum(vecs.values()) & np.uint64((1 << bits) - 1)).astype(np.uint64)
    same = np.array_equal(agg.unmask([], OWNERS, keys.pair_seed, r), truth)
    assert same if twin is None else not same


@pytest.mark.parametrize("forget", [False, True])
def test_dropped_owners_masks_are_removed_with_revealed_seeds(forget):
    bits, dim, r = 20, 777, 4
    vecs = vectors(bits, dim, 2)
    keys = MaskKeys(bytes(range(1, 33)), 5)
    dropped, survivors = [1, 3], [0, 2, 4]
    agg = SecureSum(bits, dim)
    for o in survivors:  # masks set up with every owner; 1 and 3 never send
        agg.add(o, mask(vecs[o], keys, o, OWNERS, r, bits))
    asked = []

    def revealed(s, d):
        asked.append((s, d))
        return keys.pair_seed(s, d, r)

    got = agg.unmask([] if forget else dropped, survivors, revealed, r)
    truth = sum(vecs[o] for o in survivors) & np.uint64((1 << bits) - 1)
    if forget:  # weakened twin: the dropped owners' pairs left masked
        assert not np.array_equal(got, truth)
    else:
        np.testing.assert_array_equal(got, truth)
        # only survivor–dropped seeds are revealed, never a pair of two survivors
        assert sorted(asked) == sorted((s, d) for s in survivors for d in dropped)


def test_keys_and_expansion():
    keys = MaskKeys(bytes(range(32)), 4)
    s = keys.pair_seed(1, 3, 0)
    assert s == keys.pair_seed(3, 1, 0) and len(s) == 32
    assert len({s, keys.pair_seed(1, 3, 1), keys.pair_seed(1, 2, 0)}) == 3
    assert MaskKeys(bytes(31) + b"x", 4).pair_seed(1, 3, 0) != s
    assert "secret" not in repr(keys) and bytes(range(32)).hex() not in repr(keys)
    e = expand(s, 10_000, 12)
    assert e.dtype == np.uint64 and int(e.max()) < 4096
    np.testing.assert_array_equal(e, expand(s, 10_000, 12))
    np.testing.assert_array_equal(expand(s, 100, 62)[:50] & np.uint64(4095), e[:50])
    with pytest.raises(ValueError, match="32 bytes"):
        MaskKeys(b"short", 3)
    with pytest.raises(ValueError, match="pair_seed"):
        keys.pair_seed(2, 2, 0)
    with pytest.raises(ValueError, match="bits"):
        expand(s, 4, 63)


def test_centered_and_secure_sum_checks():
    v = np.array([0, 1, 127, 128, 255], dtype=np.uint64)
    np.testing.assert_array_equal(centered(v, 8), [0, 1, 127, -128, -1])
    agg = SecureSum(8, 5)
    agg.add(0, v)
    with pytest.raises(ValueError, match="already sent"):
        agg.add(0, v)
    with pytest.raises(ValueError, match="not reduced"):
        agg.add(1, v + np.uint64(256))
    with pytest.raises(ValueError, match="survivors"):
        agg.unmask([], [0, 1], lambda s, d: b"", 0)
    keys = MaskKeys(bytes(32), 2)
    agg.unmask([1], [0], lambda s, d: keys.pair_seed(s, d, 0), 0)
    with pytest.raises(ValueError, match="already unmasked"):
        agg.add(1, v)
