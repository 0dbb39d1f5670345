"""The owner's whole message and the billboard's decoding, end to end with the masks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedudp.errors import ConfigError
from fedudp.secure.encoding import SecureEncoding, decode_sum, encode_owner, reduce_mod, wraps
from fedudp.secure.masks import MaskKeys, SecureSum, mask
from fedudp.secure.rotation import rotation_signs

OWNERS = list(range(5))
USERS = {0: 7, 1: 0, 2: 12, 3: 1, 4: 5}  # an owner with no sampled user sends its noise only


def enc_for(noise="ddgauss", local_std=0.0, bits=32, d=1000, scale=256.0, clip=1.0):
    D = 1 << (d - 1).bit_length()
    return SecureEncoding(noise, clip, scale, bits, 0.0, local_std, d, clip * scale + math.sqrt(D))


def data(d, seed=0):
    rng = np.random.default_rng(seed)
    return {o: rng.standard_normal((n, d)) * rng.uniform(0.01, 0.1, (n, 1)) for o, n in
            USERS.items()}  # fmt: skip


def run_round(enc, rows, round_=3, dropped=(), noise_seed=0):
    """Encode, mask, secure-sum, unmask, decode; also the unreduced total (for wraps)."""
    signs = rotation_signs(np.random.default_rng([round_]), enc.padded)
    keys = MaskKeys(bytes(range(32)), len(OWNERS))
    agg = SecureSum(enc.bits, enc.padded)
    unreduced = np.zeros(enc.padded, dtype=np.int64)
    survivors = [o for o in OWNERS if o not in dropped]
    for o in survivors:
        rr = [np.random.default_rng([round_, o, u]) for u in range(len(rows[o]))]
        nr = np.random.default_rng([noise_seed, round_, o])
        v = encode_owner(rows[o], enc, signs, rr, nr, reduced=False)
        unreduced += v
        agg.add(o, mask(reduce_mod(v, enc.bits), keys, o, OWNERS, round_, enc.bits))
    total = agg.unmask(list(dropped), survivors, lambda s, d: keys.pair_seed(s, d, round_), round_)
    return decode_sum(total, enc, signs), unreduced, survivors


def clipped_sum(rows, owners, clip):
    out = 0.0
    for o in owners:
        x = rows[o]
        norms = np.linalg.norm(x, axis=1, keepdims=True)
        out = out + (x * np.minimum(1.0, clip / np.maximum(norms, 1e-300))).sum(axis=0)
    return out


@pytest.mark.parametrize("dropped", [(), (2,), (0, 3)])
def test_noiseless_round_decodes_the_sum_of_clipped_rows(dropped):
    d = 1000
    enc = enc_for(d=d, clip=0.3)
    rows = data(d)
    rows[2][4] *= 100.0  # clipped
    got, unreduced, survivors = run_round(enc, rows, dropped=dropped)
    want = clipped_sum(rows, survivors, enc.clip)
    users = sum(USERS[o] for o in survivors)
    assert wraps(unreduced, enc.bits) == 0
    # each user's rounded row is within sqrt(D) (integer domain) of its scaled rotated row
    assert np.linalg.norm(got - want) <= users * math.sqrt(enc.padded) / enc.scale
    # and, the users' rounding errors being independent with variance <= 1/4 a coordinate:
    assert np.linalg.norm(got - want) <= 1.5 * math.sqrt(users * enc.padded / 4) / enc.scale


@pytest.mark.parametrize("noise", ["ddgauss", "skellam"])
def test_noise_variance_of_the_decoded_sum(noise):
    d, std = 4000, 0.3
    enc = enc_for(noise, std, d=d, scale=64.0)
    rows = data(d, 1)
    noisy, _, _ = run_round(enc, rows, noise_seed=1)
    clean, _, _ = run_round(enc_for(noise, 0.0, d=d, scale=64.0), rows)  # same rounding draws
    var = float(np.var(noisy - clean))
    want = len(OWNERS) * std * std
    assert abs(var - want) < 5 * want * math.sqrt(2 / d)


def test_wraps_counts_the_corrupted_coordinates():
    d = 512
    enc = enc_for(d=d, bits=6, scale=200.0)  # the sum reaches well past +-2^5
    rows = data(d, 2)
    got, unreduced, survivors = run_round(enc, rows)
    half = 1 << (enc.bits - 1)
    n_wraps = wraps(unreduced, enc.bits)
    assert n_wraps == int(np.sum((unreduced < -half) | (unreduced >= half))) > 0
    assert wraps(np.array([-33, -32, 31, 32, 0]), 6) == 2
    want = clipped_sum(rows, survivors, enc.clip)
    assert np.linalg.norm(got - want) > 0.5 * np.linalg.norm(want)  # the wrap corrupts it


def test_message_is_reduced_and_n_zero_is_noise_only():
    enc = enc_for(local_std=0.5, bits=12, d=100)
    signs = rotation_signs(np.random.default_rng(0), enc.padded)
    v = encode_owner(np.zeros((0, 100)), enc, signs, [], np.random.default_rng(1))
    assert v.dtype == np.uint64 and v.shape == (enc.padded,) and int(v.max()) < 1 << 12
    u = encode_owner(np.zeros((0, 100)), enc, signs, [], np.random.default_rng(1), reduced=False)
    np.testing.assert_array_equal(reduce_mod(u, 12), v)
    assert np.std(u / enc.scale) == pytest.approx(0.5, rel=0.2)


def test_bad_rows_raise():
    enc = enc_for(d=10)
    signs = rotation_signs(np.random.default_rng(0), enc.padded)
    bad = np.ones((2, 10))
    bad[1, 3] = np.nan
    with pytest.raises(ValueError, match="finite"):
        encode_owner(bad, enc, signs, [np.random.default_rng(0)] * 2, np.random.default_rng(1))
    with pytest.raises(ValueError, match=r"\[n, 10\]"):
        encode_owner(np.ones((2, 9)), enc, signs, [], np.random.default_rng(1))
    with pytest.raises(ValueError, match="generators"):
        encode_owner(np.ones((2, 10)), enc, signs, [], np.random.default_rng(1))


@pytest.mark.parametrize(
    ("field", "value"),
    [("noise", "gauss"), ("clip", 0.0), ("scale", -1.0), ("bits", 1), ("bits", 63),
     ("beta", 1.0), ("local_std", -0.1), ("dim", 0), ("rounded_bound", math.inf)],
)  # fmt: skip
def test_impossible_settings_name_the_field(field, value):
    good = dict(noise="ddgauss", clip=1.0, scale=10.0, bits=16, beta=0.1, local_std=1.0, dim=10,
                rounded_bound=20.0)  # fmt: skip
    with pytest.raises(ConfigError, match=rf"^SecureEncoding\.{field} ") as e:
        SecureEncoding(**{**good, field: value})
    assert "\n" not in str(e.value)


def test_float_path_overflow_names_scale():
    with pytest.raises(ConfigError, match=r"^SecureEncoding\.scale .*2\^52"):
        SecureEncoding("skellam", 1.0, 2.0**52, 62, 0.0, 0.0, 10, 1.0)
    with pytest.raises(ConfigError, match=r"^SecureEncoding\.scale .*std"):
        SecureEncoding("skellam", 1.0, 2.0**20, 62, 0.0, 2.0**40, 10, 2.0**21)
    assert SecureEncoding("skellam", 1.0, 2.0**20, 62, 0.0, 1.0, 10, 2.0**21).padded == 16
