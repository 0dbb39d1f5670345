"""The keyed random streams (fedudp/randomness.py): every purpose declares one fixed number of
keys, the stream constructors enforce it, distinct keys of one purpose give distinct streams
(numpy's SeedSequence pads short entropy with zeros, so a key count that varied could alias
``[seed, p, 1]`` with ``[seed, p, 1, 0]``), the streams are the ones the code always drew, and
every call site in the tree passes its purpose's key count."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from fedudp.randomness import (
    KEYS,
    PROTECTING,
    Purpose,
    Randomness,
    entropy,
    numpy_rng,
    torch_generator,
)

ROOT = Path(__file__).resolve().parent.parent
MAKERS = {"numpy_rng": numpy_rng, "torch_generator": torch_generator}


def draw(maker: str, seed: int, purpose: Purpose, *keys: int) -> tuple:
    if maker == "numpy_rng":
        return tuple(numpy_rng(seed, purpose, *keys).integers(0, 2**62, 4).tolist())
    return tuple(
        torch.randint(0, 2**62, (4,), generator=torch_generator(seed, purpose, *keys)).tolist()
    )


def test_every_purpose_declares_its_keys():
    assert set(KEYS) == set(Purpose)
    for p, names in KEYS.items():
        assert isinstance(names, tuple) and all(isinstance(n, str) and n for n in names), p
        assert len(set(names)) == len(names), p
    assert len({int(p) for p in Purpose}) == len(Purpose)  # one entropy word per purpose
    assert all(0 <= int(p) < 2**32 for p in Purpose)


def test_short_entropy_aliases_in_numpy():
    """The hazard the fixed key counts avoid: trailing zeros vanish under SeedSequence's padding."""
    a = np.random.default_rng([0, int(Purpose.NOISE), 1]).random(4)
    b = np.random.default_rng([0, int(Purpose.NOISE), 1, 0]).random(4)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("maker", sorted(MAKERS))
@pytest.mark.parametrize("purpose", list(Purpose), ids=lambda p: p.name)
def test_wrong_key_count_is_refused(maker, purpose):
    arity = len(KEYS[purpose])
    MAKERS[maker](7, purpose, *([1] * arity))  # the declared count works
    for count in {0, max(arity - 1, 0), arity + 1, arity + 2} - {arity}:
        with pytest.raises(ValueError, match=rf"Purpose\.{purpose.name} takes {arity} key") as e:
            MAKERS[maker](7, purpose, *([1] * count))
        for name in KEYS[purpose]:
            assert name in str(e.value)


@pytest.mark.parametrize("maker", sorted(MAKERS))
@pytest.mark.parametrize("purpose", list(Purpose), ids=lambda p: p.name)
def test_distinct_keys_give_distinct_streams(maker, purpose):
    """All key tuples over {0, 1, 2} (trailing zeros included), and the tuple one shorter with its
    trailing zero dropped refused rather than aliased."""
    arity = len(KEYS[purpose])
    tuples = list(itertools.product((0, 1, 2), repeat=arity))
    streams = {draw(maker, 3, purpose, *k) for k in tuples}
    assert len(streams) == len(tuples)
    if arity:
        assert draw(maker, 3, purpose, *([1] * (arity - 1)), 0) != draw(
            maker, 3, purpose, *([1] * arity)
        )
        with pytest.raises(ValueError):
            MAKERS[maker](3, purpose, *([1] * (arity - 1)), 0, 0)  # the aliasing longer call
    else:
        with pytest.raises(ValueError):
            MAKERS[maker](3, purpose, 0)


@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_purposes_and_seeds_give_distinct_streams(maker):
    """All-zero keys (the padding-prone case) of every purpose, under two seeds."""
    streams = {draw(maker, s, p, *([0] * len(KEYS[p]))) for p in Purpose for s in (0, 1)}
    assert len(streams) == 2 * len(Purpose)


@pytest.mark.parametrize("bad", [-1, 2**32, 2**40])
def test_each_value_is_one_32_bit_word(bad):
    with pytest.raises(ValueError, match="outside"):
        numpy_rng(0, Purpose.NOISE, bad)
    with pytest.raises(ValueError, match="seed"):
        torch_generator(bad, Purpose.NOISE, 1)
    numpy_rng(0, Purpose.NOISE, 2**32 - 1)
    numpy_rng(np.int64(5), Purpose.DPSGD_NOISE, np.int64(1), 0, np.uint32(2), 3)  # numpy ints


def test_streams_are_the_ones_drawn_before_the_check():
    """The check changes no stream: the entropy is still [seed, purpose, *keys]."""
    for p in Purpose:
        keys = list(range(1, len(KEYS[p]) + 1))
        assert entropy(11, p, *keys) == [11, int(p), *keys]
        want = np.random.default_rng([11, int(p), *keys]).random(3)
        np.testing.assert_array_equal(numpy_rng(11, p, *keys).random(3), want)
        seq = np.random.SeedSequence([11, int(p), *keys])
        g = torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))
        assert torch.equal(
            torch.randn(3, generator=torch_generator(11, p, *keys)), torch.randn(3, generator=g)
        )


def _call_sites() -> list[tuple[str, int, str, Purpose, int]]:
    """(file, line, maker, purpose, keys passed) of every numpy_rng/torch_generator call with a
    literal ``Purpose.X`` and no *args, in fedudp/, scripts/ and tests/ (module functions and
    ``Randomness`` methods alike)."""
    out = []
    files = [f for d in ("fedudp", "scripts", "tests") for f in sorted((ROOT / d).rglob("*.py"))]
    for f in files:
        if f.name in ("randomness.py", Path(__file__).name):
            continue
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if not isinstance(node, ast.Call):
                continue
            fn = (
                node.func.attr
                if isinstance(node.func, ast.Attribute)
                else getattr(node.func, "id", None)
            )
            if (
                fn not in MAKERS
                or not node.args
                or any(isinstance(a, ast.Starred) for a in node.args)
            ):
                continue
            # a module function (seed, Purpose.X, *keys), or a Randomness method (Purpose.X, *keys)
            for at in (1, 0) if isinstance(node.func, ast.Attribute) else (1,):
                p = node.args[at] if len(node.args) > at else None
                if (
                    isinstance(p, ast.Attribute)
                    and isinstance(p.value, ast.Name)
                    and p.value.id == "Purpose"
                ):
                    out.append(
                        (
                            str(f.relative_to(ROOT)),
                            node.lineno,
                            fn,
                            Purpose[p.attr],
                            len(node.args) - at - 1,
                        )
                    )
                    break
    return out


def test_every_call_site_passes_its_purposes_keys():
    sites = _call_sites()
    assert len(sites) >= 15  # the scan sees the tree's call sites
    assert {p for *_, p, _ in sites} >= set(Purpose) - {
        Purpose.PERSONAL_ORDER,
        Purpose.OWNER_ORDER,
        Purpose.USER_ORDER,
    }  # those pass a variable
    bad = [
        f"{f}:{line} {fn}(seed, Purpose.{p.name}, ...) passes {n} keys, KEYS says {KEYS[p]}"
        for f, line, fn, p, n in sites
        if n != len(KEYS[p])
    ]
    assert not bad, "\n".join(bad)


# -- seeded or secure (Randomness) ----------------------------------------------------------------
def _draw_with(rand, maker: str, purpose: Purpose, *keys: int) -> tuple:
    if maker == "numpy_rng":
        return tuple(rand.numpy_rng(purpose, *keys).integers(0, 2**62, 4).tolist())
    return tuple(
        torch.randint(0, 2**62, (4,), generator=rand.torch_generator(purpose, *keys)).tolist()
    )


@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_secure_protecting_streams_differ_between_constructions_and_the_rest_stay_seeded(maker):
    """Two ``Randomness.secure(7)`` (and two calls of one): every PROTECTING purpose differs
    (64 random bits drawn 4 times: equal by chance with probability ~2**-256); every other
    purpose is exactly the seeded stream of seed 7, as ``Randomness.seeded(7)`` and the module
    functions draw it."""
    assert PROTECTING >= {Purpose.SAMPLE, Purpose.NOISE, Purpose.DPSGD_SAMPLE, Purpose.DPSGD_NOISE}
    a, b, seeded = Randomness.secure(7), Randomness.secure(7), Randomness.seeded(7)
    for p in Purpose:
        keys = list(range(1, len(KEYS[p]) + 1))
        want = draw(maker, 7, p, *keys)
        assert _draw_with(seeded, maker, p, *keys) == want
        if p in PROTECTING:
            assert a.protects(p) and not seeded.protects(p)
            got = {
                _draw_with(a, maker, p, *keys),
                _draw_with(a, maker, p, *keys),
                _draw_with(b, maker, p, *keys),
                want,
            }
            assert len(got) == 4, p
        else:
            assert _draw_with(a, maker, p, *keys) == _draw_with(b, maker, p, *keys) == want, p


@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_secure_streams_still_check_their_keys(maker):
    rand = Randomness.secure(3)
    for p in (Purpose.NOISE, Purpose.DPSGD_NOISE, Purpose.USER_ORDER):
        with pytest.raises(ValueError, match=rf"Purpose\.{p.name} takes"):
            getattr(rand, maker)(p, *([1] * (len(KEYS[p]) + 1)))
    with pytest.raises(ValueError, match="seeded' or 'secure"):
        Randomness(1, "fast")


def test_secure_noise_is_float64_standard_normal():
    """A secure torch generator draws the same distribution (float64 noise, as the estimators
    ask for): 20,000 draws have mean ~0 and std ~1."""
    x = torch.randn(
        20_000, dtype=torch.float64, generator=Randomness.secure().torch_generator(Purpose.NOISE, 1)
    )
    assert x.dtype == torch.float64
    assert abs(float(x.mean())) < 0.05 and abs(float(x.std()) - 1) < 0.05


def test_billboard_secure_sample_and_noise_are_not_the_seeds():
    """The billboard's Poisson sample and noise generator under ``Randomness.secure``: not the
    seeded ones (which a holder of the seed regenerates), and different across two billboards
    built alike; the ledger says which."""
    from fedudp.aggregators import GaussianAggregator, Sampling
    from fedudp.billboard.server import Billboard
    from fedudp.privacy.accountant import ADJACENCY, Ledger, accountant_for

    def board(rand):
        s = Sampling(0.5, 64)
        agg = GaussianAggregator(1.0, 1.0, s)
        led = Ledger(
            unit="user",
            adjacency=ADJACENCY,
            accounting="certified",
            guarantee="certified",
            mechanism="gaussian",
            accountant="pld",
            delta=1e-5,
            target_epsilon=None,
        )
        return Billboard(
            {"w": torch.zeros(8)},
            agg,
            s,
            led,
            accountant_for(agg.dp_event()),
            seed=5,
            randomness=rand,
        )

    seeded, sec1, sec2 = board(None), board(Randomness.secure(5)), board(Randomness.secure(5))
    assert seeded.ledger.to_dict()["randomness"] == "seeded (simulation)"
    assert sec1.ledger.to_dict()["randomness"] == "secure"
    want = np.random.default_rng([5, int(Purpose.SAMPLE), 1]).random(64) < 0.5
    np.testing.assert_array_equal(seeded.sample(1), want)
    assert not np.array_equal(sec1.sample(1), want) and not np.array_equal(
        sec1.sample(1), sec2.sample(1)
    )
    noise = lambda bb: torch.randn(8, dtype=torch.float64, generator=bb.noise_generator(1))  # noqa: E731
    assert torch.equal(
        noise(seeded),
        torch.randn(8, dtype=torch.float64, generator=torch_generator(5, Purpose.NOISE, 1)),
    )
    assert not torch.equal(noise(sec1), noise(seeded)) and not torch.equal(noise(sec1), noise(sec2))


def test_privacy_randomness_in_the_config_and_the_ledger():
    """``privacy.randomness`` goes through the builder: the ledger line, the owners' DP-SGD flag,
    and the one-line refusals where a plan draws privacy randomness from the seed."""
    from conftest import tiny_cfg
    from fedudp import build
    from fedudp.aggregators import Sampling
    from fedudp.config import ConfigError

    cfg = tiny_cfg("full_dp")
    assert build.settings(cfg).randomness == "seeded" and not build.randomness(cfg).is_secure
    cfg = tiny_cfg("full_dp", **{"privacy.randomness": "secure"})
    build.check(cfg)
    assert build.randomness(cfg) == Randomness.secure(int(cfg.seed))
    assert build.owner_training(cfg).secure_randomness
    spec_led = build.ledger(
        cfg, build.method(cfg, build.model(cfg)), build.estimator(cfg, Sampling(1.0, 160), 3, 10)
    )
    assert spec_led.to_dict()["randomness"] == "secure"
    assert any("OS entropy" in n for n in spec_led.notes)
    for over, match in (
        ({"aggregator": "dp_mf_banded"}, "aggregator=dp_mf_banded"),
        ({"algorithm.name": "huang_alg2"}, "algorithm.name=huang_alg2"),
    ):
        with pytest.raises(ConfigError, match=rf"^privacy\.randomness=secure: not with .*{match}"):
            build.check_randomness(tiny_cfg("full_dp", **{"privacy.randomness": "secure", **over}))
    build.check_randomness(tiny_cfg("full_dp", aggregator="dp_mf_banded"))  # seeded: fine
