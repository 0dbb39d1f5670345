"""The accountant behind one seam (issue 50).

* Only ``fedudp/privacy/pld_fast.py`` reads dp-accounting's private names: an AST check over
  every module of ``fedudp/`` (attribute chains on names imported from dp_accounting, private
  names imported from it, subclasses of its classes, and accesses of the private attribute
  names dp-accounting's own source defines), with a weakened twin: a copy of the package with
  planted private accesses is caught, each one.
* ``engine="public"`` (dp-accounting's ``PLDAccountant``/``RdpAccountant`` ``compose`` and
  ``get_epsilon`` only) and the default ``fast`` engine agree on every event kind fedudp
  composes: to the last digit where they are the same computation (every epsilon up to
  ``EXACT_ROUNDS`` rounds of a run: both compose the same PLDs in the same order), and beyond
  ``EXACT_ROUNDS`` within ``LEDGER_TOL`` (the fast grid values carry a pessimistic trim of the
  FFT noise, ~1e-6 relative, and both read an upper envelope of the exact value off a grid of
  counts whose steps depend on those values: measured 1e-8 apart at 60 rounds).
* Each accountant ``accountant_for`` builds is an ``AccountantLike``.
"""

from __future__ import annotations

import ast
import functools
import shutil
from pathlib import Path

import dp_accounting
import pytest

import fedudp
from fedudp.aggregators.banded import cycle_event
from fedudp.aggregators.local_dpsgd import owner_round_event
from fedudp.aggregators.tree import run_event
from fedudp.privacy.accountant import (
    EXACT_ROUNDS,
    LEDGER_TOL,
    Accountant,
    ApproxDp,
    GroupAccountant,
    GroupConversion,
    Parallel,
    ParallelAccountant,
    accountant_for,
    event_epsilon,
)
from fedudp.privacy.protocol import AccountantLike

PACKAGE = Path(fedudp.__file__).parent
SEAM = Path("privacy") / "pld_fast.py"
G, P = dp_accounting.GaussianDpEvent, dp_accounting.PoissonSampledDpEvent
DELTA = 1e-5


# -- the private names: only in the seam -----------------------------------------------------------
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


@functools.cache
def dp_accounting_private_names() -> frozenset[str]:
    """Every private attribute, method and module-level name dp-accounting's source defines."""
    root = Path(dp_accounting.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                names.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and _private(node.name):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                if _private(node.id):
                    names.add(node.id)
    return frozenset(names)


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses(path: Path, theirs: frozenset[str]) -> list[str]:
    """``line: what`` for each use of a dp-accounting private name in the module at ``path``."""
    tree = ast.parse(path.read_text())
    aliases: set[str] = set()  # names bound to dp_accounting or something imported from it
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "dp_accounting":
                    aliases.add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dp_accounting"):
            for a in node.names:
                aliases.add(a.asname or a.name)
                if _private(a.name):
                    found.append(f"{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain_root = _root(node.value)
            if chain_root in aliases:
                found.append(f"{node.lineno}: {chain_root}...{node.attr}")
            elif node.attr in theirs and chain_root not in ("self", "cls"):
                found.append(f"{node.lineno}: .{node.attr} (a dp-accounting private name)")
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                if _root(base) in aliases:
                    found.append(f"{node.lineno}: class {node.name} subclasses dp-accounting")
    return found


def uses_outside_the_seam(package: Path) -> dict[str, list[str]]:
    theirs = dp_accounting_private_names()
    out = {}
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package) == SEAM:
            continue
        if found := private_uses(path, theirs):
            out[str(path.relative_to(package))] = found
    return out


def test_only_the_seam_reads_dp_accountings_private_names():
    assert {"_probs", "_pld", "_maybe_compose", "_MAX_PMF_SPARSE_SIZE"} <= (
        dp_accounting_private_names()
    )
    assert uses_outside_the_seam(PACKAGE) == {}
    # the seam itself does read them (the check looks where they are)
    seam = private_uses(PACKAGE / SEAM, dp_accounting_private_names())
    assert any("_probs" in s for s in seam) and any("subclasses" in s for s in seam)


def _not_python(folder: str, names: list[str]) -> list[str]:
    return [
        n for n in names if n == "__pycache__" or (Path(folder, n).is_file() and n[-3:] != ".py")
    ]


PLANTED = {
    "an alias chain": "from dp_accounting.pld import pld_pmf\nCAP = pld_pmf._MAX_PMF_SPARSE_SIZE\n",
    "a derived object": "def f(pmf):\n    return pmf._probs\n",
    "a private import": "from dp_accounting.pld.pld_pmf import _get_epsilon_for_delta\n",
    "a subclass": (
        "from dp_accounting.pld import pld_privacy_accountant\n"
        "class A(pld_privacy_accountant.PLDAccountant):\n    pass\n"
    ),
    "a swapped PLD": "def g(acc, cap):\n    acc._pld = cap\n",
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_weakened_twin_a_planted_private_access_is_caught(tmp_path, kind):
    copy = tmp_path / "fedudp"
    shutil.copytree(PACKAGE, copy, ignore=_not_python)
    target = copy / "privacy" / "accountant.py"
    target.write_text(target.read_text() + "\n\n" + PLANTED[kind])
    got = uses_outside_the_seam(copy)
    assert list(got) == [str(Path("privacy") / "accountant.py")], (kind, got)


# -- the public path agrees with the fast one -------------------------------------------------------
def _cases() -> dict[str, list[tuple]]:
    """Every event kind fedudp composes, as [(event, count), ...] runs (counts <= EXACT_ROUNDS)."""
    return {
        "gaussian": [(G(3.0), 5)],
        "sampled gaussian": [(P(0.01, G(2.0)), 20)],
        "self-composed": [(dp_accounting.SelfComposedDpEvent(P(0.05, G(2.0)), 3), 4)],
        "composed (laplace + sampled gaussian)": [
            (
                dp_accounting.ComposedDpEvent(
                    [dp_accounting.LaplaceDpEvent(20.0), P(0.01, G(2.0))]
                ),
                6,
            )
        ],
        "laplace": [(dp_accounting.LaplaceDpEvent(10.0), 8)],
        "zcdp (pure-DP steps, RDP)": [(dp_accounting.ZCDpEvent(0.01), 10)],
        "tree": [(run_event(2.0, 10, 4), 1)],
        "banded cycles": [
            (cycle_event(2.0, 0.1), 3),
            (dp_accounting.NoOpDpEvent(), 2),
            (cycle_event(2.0, 0.1), 3),
        ],
        "owner-side dp-sgd": [(owner_round_event(2.0, 0.05, 5), 4)],
        "approx-dp blocks": [(P(0.01, G(2.0)), 10), (ApproxDp(0.1, 1e-7), 2)],
        "sparse pld (huge noise)": [(P(0.2, G(1e4)), 5)],
    }


def _read(acc, nxt) -> tuple:
    return acc.epsilon(DELTA), acc.epsilon_rdp(DELTA), acc.epsilon_if(nxt, DELTA)


def _both(make, runs, nxt=None) -> tuple:
    out = []
    for engine in ("fast", "public"):
        acc = make(engine)
        for e, c in runs:
            acc.compose(e, c)
        out.append(_read(acc, runs[0][0] if nxt is None else nxt))
    return tuple(out)


INTERVAL = 1e-3  # a coarser grid than a run's: the same computation, faster


@pytest.mark.parametrize("name", sorted(_cases()))
def test_public_and_fast_engines_agree_to_the_last_digit(name):
    runs = _cases()[name]
    assert sum(c for _, c in runs) <= EXACT_ROUNDS  # exact, not the grid's envelope
    fast, public = _both(lambda eng: Accountant(INTERVAL, 5.0, eng), runs)
    assert fast == public and fast[0] > 0, (name, fast, public)


def test_public_and_fast_engines_agree_on_parallel_and_group_accountants():
    parts = Parallel((P(0.01, G(2.0)), owner_round_event(2.0, 0.05, 3)))
    fast, public = _both(lambda eng: ParallelAccountant(2, INTERVAL, 5.0, eng), [(parts, 4)])
    assert fast == public and fast[0] > 0
    group = GroupConversion.for_user_budget(3, 1.0, DELTA, "certified")
    fast, public = _both(
        lambda eng: GroupAccountant(Accountant(INTERVAL, 5.0, eng), group), [(P(0.01, G(2.0)), 6)]
    )
    assert fast == public and fast[0] > 0
    # accountant_for passes the engine on
    acc = accountant_for(P(0.01, G(2.0)), group, 1.0, engine="public")
    assert isinstance(acc, GroupAccountant) and acc.inner.engine == "public"


def test_public_engine_matches_dp_accountings_own_accountant():
    """The public engine is dp-accounting's public computation (no fedudp cache involved):
    its epsilon is ``PLDAccountant.compose(...).get_epsilon`` of the composed runs."""
    runs = _cases()["composed (laplace + sampled gaussian)"]
    acc = Accountant(INTERVAL, 5.0, "public")
    for e, c in runs:
        acc.compose(e, c)
    theirs = dp_accounting.pld.PLDAccountant(
        dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=INTERVAL
    )
    theirs.compose(dp_accounting.SelfComposedDpEvent(*runs[0]))
    assert acc.epsilon(DELTA) == min(
        theirs.get_epsilon(DELTA), acc.epsilon_rdp(DELTA) or float("inf")
    )


def test_a_weakened_twin_an_engine_with_a_lost_event_is_caught():
    """The agreement check would see an engine that drops a run's last release."""
    runs = _cases()["sampled gaussian"]
    fast, _ = _both(lambda eng: Accountant(INTERVAL, 5.0, eng), runs)
    twin = Accountant(INTERVAL, 5.0, "public")
    twin.compose(runs[0][0], runs[0][1] - 1)
    assert _read(twin, runs[0][0]) != fast


def test_an_unknown_engine_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="engine must be one of fast, public, got 'pubic'"):
        Accountant(1e-4, None, "pubic")


@pytest.mark.slow
def test_public_and_fast_engines_agree_within_the_ledger_tolerance_beyond_exact_rounds():
    """Beyond EXACT_ROUNDS both read a grid envelope: each is an upper bound within LEDGER_TOL of
    dp-accounting's direct epsilon, and they are within LEDGER_TOL of each other (~75 s)."""
    ev, rounds = P(0.01, G(1.0)), 60
    fast, public = _both(lambda eng: Accountant(1e-4, 5.0, eng), [(ev, rounds)])
    direct = event_epsilon(dp_accounting.SelfComposedDpEvent(ev, rounds), DELTA, 1e-4)
    assert direct is not None
    for value in (fast[0], public[0]):
        assert direct - 1e-12 <= value <= direct + LEDGER_TOL
    assert abs(fast[0] - public[0]) <= LEDGER_TOL and fast[1] == public[1]


def test_every_accountant_is_accountant_like():
    group = GroupConversion.for_user_budget(2, 1.0, DELTA, "certified")
    for acc in (
        accountant_for(G(2.0)),
        accountant_for(Parallel((G(2.0), G(3.0)))),
        accountant_for(G(2.0), group, 1.0),
    ):
        assert isinstance(acc, AccountantLike)
    assert not isinstance(object(), AccountantLike)  # the check is not vacuous
