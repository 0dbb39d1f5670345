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

from fedudp.randomness import KEYS, Purpose, entropy, numpy_rng, torch_generator

ROOT = Path(__file__).resolve().parent.parent
MAKERS = {"numpy_rng": numpy_rng, "torch_generator": torch_generator}


def draw(maker: str, seed: int, purpose: Purpose, *keys: int) -> tuple:
    if maker == "numpy_rng":
        return tuple(numpy_rng(seed, purpose, *keys).integers(0, 2 ** 62, 4).tolist())
    return tuple(torch.randint(0, 2 ** 62, (4,), generator=torch_generator(seed, purpose, *keys)).tolist())


def test_every_purpose_declares_its_keys():
    assert set(KEYS) == set(Purpose)
    for p, names in KEYS.items():
        assert isinstance(names, tuple) and all(isinstance(n, str) and n for n in names), p
        assert len(set(names)) == len(names), p
    assert len({int(p) for p in Purpose}) == len(Purpose)          # one entropy word per purpose
    assert all(0 <= int(p) < 2 ** 32 for p in Purpose)


def test_short_entropy_aliases_in_numpy():
    """The hazard the fixed key counts avoid: trailing zeros vanish under SeedSequence's padding."""
    a = np.random.default_rng([0, int(Purpose.NOISE), 1]).random(4)
    b = np.random.default_rng([0, int(Purpose.NOISE), 1, 0]).random(4)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("maker", sorted(MAKERS))
@pytest.mark.parametrize("purpose", list(Purpose), ids=lambda p: p.name)
def test_wrong_key_count_is_refused(maker, purpose):
    arity = len(KEYS[purpose])
    MAKERS[maker](7, purpose, *([1] * arity))                      # the declared count works
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
        assert draw(maker, 3, purpose, *([1] * (arity - 1)), 0) != draw(maker, 3, purpose, *([1] * arity))
        with pytest.raises(ValueError):
            MAKERS[maker](3, purpose, *([1] * (arity - 1)), 0, 0)   # the aliasing longer call
    else:
        with pytest.raises(ValueError):
            MAKERS[maker](3, purpose, 0)


@pytest.mark.parametrize("maker", sorted(MAKERS))
def test_purposes_and_seeds_give_distinct_streams(maker):
    """All-zero keys (the padding-prone case) of every purpose, under two seeds."""
    streams = {draw(maker, s, p, *([0] * len(KEYS[p]))) for p in Purpose for s in (0, 1)}
    assert len(streams) == 2 * len(Purpose)


@pytest.mark.parametrize("bad", [-1, 2 ** 32, 2 ** 40])
def test_each_value_is_one_32_bit_word(bad):
    with pytest.raises(ValueError, match="outside"):
        numpy_rng(0, Purpose.NOISE, bad)
    with pytest.raises(ValueError, match="seed"):
        torch_generator(bad, Purpose.NOISE, 1)
    numpy_rng(0, Purpose.NOISE, 2 ** 32 - 1)
    numpy_rng(np.int64(5), Purpose.DPSGD_NOISE, np.int64(1), 0, np.uint32(2), 3)   # numpy ints


def test_streams_are_the_ones_drawn_before_the_check():
    """The check changes no stream: the entropy is still [seed, purpose, *keys]."""
    for p in Purpose:
        keys = list(range(1, len(KEYS[p]) + 1))
        assert entropy(11, p, *keys) == [11, int(p), *keys]
        want = np.random.default_rng([11, int(p), *keys]).random(3)
        np.testing.assert_array_equal(numpy_rng(11, p, *keys).random(3), want)
        seq = np.random.SeedSequence([11, int(p), *keys])
        g = torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1)))
        assert torch.equal(torch.randn(3, generator=torch_generator(11, p, *keys)), torch.randn(3, generator=g))


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
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if fn not in MAKERS or not node.args or any(isinstance(a, ast.Starred) for a in node.args):
                continue
            # a module function (seed, Purpose.X, *keys), or a Randomness method (Purpose.X, *keys)
            for at in (1, 0) if isinstance(node.func, ast.Attribute) else (1,):
                p = node.args[at] if len(node.args) > at else None
                if (isinstance(p, ast.Attribute) and isinstance(p.value, ast.Name)
                        and p.value.id == "Purpose"):
                    out.append((str(f.relative_to(ROOT)), node.lineno, fn, Purpose[p.attr],
                                len(node.args) - at - 1))
                    break
    return out


def test_every_call_site_passes_its_purposes_keys():
    sites = _call_sites()
    assert len(sites) >= 15                    # the scan sees the tree's call sites
    assert {p for *_, p, _ in sites} >= set(Purpose) - {Purpose.PERSONAL_ORDER, Purpose.OWNER_ORDER,
                                                         Purpose.USER_ORDER}   # those pass a variable
    bad = [f"{f}:{line} {fn}(seed, Purpose.{p.name}, ...) passes {n} keys, KEYS says {KEYS[p]}"
           for f, line, fn, p, n in sites if n != len(KEYS[p])]
    assert not bad, "\n".join(bad)
