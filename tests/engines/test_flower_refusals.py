"""``fedudp.flower`` never sends in the clear, never noises twice, and says how a run ended.

* A training message without ``UserLevelDP``'s record: the mod trains nothing and replies with
  an error naming the missing wrapper, never the app's plain update (twin: the old mod, which
  passed the message to the app, sends the app's model).
* Flower's own DP stacked with fedudp's is refused with one line naming it: a
  ``DifferentialPrivacy*`` wrapper inside ``UserLevelDP`` (at construction) or around it (at
  the first ``configure_train``, before any message), Flower's DP mods after ``user_level_mod``
  in the ClientApp (``fixedclipping_mod``, ``adaptiveclipping_mod``, ``LocalDpMod``), another
  wrapper's ``clipping_norm`` key in the training message. Twins: each check switched off, the
  stack runs.
* The run's outcome: some rounds withheld is a warning naming them and the ledger's
  ``outcome``; none released (every round withheld, or the budget stopped training before
  round 1) is ``RunFailed`` (the ServerApp's run ends failed). Twin: no outcome, no failure.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import LocalDpMod, adaptiveclipping_mod, fixedclipping_mod
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)

import fedudp.flower.mod as flower_mod
import fedudp.flower.strategy as flower_strategy
from fedudp.aggregators import GaussianAggregator, Sampling
from fedudp.flower import K_CONTRIB, K_DP, RunFailed, UserLevelDP, user_level_mod

sys.path.insert(0, str(Path(__file__).parent))
from test_flower_bad_users import (  # noqa: E402  (the in-process harness)
    CLIENTS,
    DIM,
    PER,
    App,
    LocalGrid,
    arrays_of,
    run,
    server_identity,  # noqa: F401  (the fixture)
)

N = CLIENTS * PER


def train_message(kind: str = "train") -> Message:
    """A training message as ``UserLevelDP`` sends it (with ``K_DP``; every user sampled)."""
    from test_flower_mod import server_message
    from test_flower_mod import train_message as tm

    return server_message(tm({"w": np.zeros(DIM, np.float32)}, 1, 1.0, N, 1.0).content, kind)


def context() -> Context:
    return Context(
        run_id=1,
        node_id=1,
        node_config={"partition-id": 0, "num-partitions": CLIENTS},
        state=RecordDict(),
        run_config={},
    )


def sent_in_clear(reply: Message) -> bool:
    """The reply carries a model or a contribution (anything but an error)."""
    return not reply.has_error() and bool(reply.content.array_records)


# -- never in the clear ---------------------------------------------------------------------------
class OldMod(flower_mod._UserLevelMod):
    """Weakened (the hole): a training message without ``fedudp.dp`` goes to the app."""

    def __call__(self, msg, context, call_next):
        if K_DP not in msg.content:
            return self.pass_through(msg, context, call_next)
        return super().__call__(msg, context, call_next)


def test_a_training_message_without_the_wrapper_is_refused():
    msg = train_message()
    del msg.content[K_DP]
    calls = []

    def app(m, c):
        calls.append(1)
        return App(None)(m, c)

    reply = user_level_mod(users_per_client=PER)(msg, context(), app)
    assert not sent_in_clear(reply) and not calls
    assert reply.has_error() and "UserLevelDP" in reply.error.reason
    assert "no 'fedudp.dp' record" in reply.error.reason and "\n" not in reply.error.reason
    # a train message of a named action ("train.<name>") too
    msg2 = train_message("train.custom")
    del msg2.content[K_DP]
    assert user_level_mod(users_per_client=PER)(msg2, context(), app).has_error() and not calls
    # the twin sends the app's plain model
    weak = OldMod(PER, (), None, None, True)(msg, context(), app)
    assert sent_in_clear(weak)


def test_fedudp_under_a_plain_fedavg_server_releases_nothing_in_the_clear():
    """The configuration mistake of issue 49: clients with the mod, a server without the wrapper.
    Every client refuses (one line each); Flower's FedAvg aggregates nothing."""
    grid = LocalGrid(user_level_mod(users_per_client=PER), App(None))
    res = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1).start(
        grid=grid,
        initial_arrays=arrays_of({"w": np.zeros(DIM, np.float32)}),
        num_rounds=1,
        train_config=ConfigRecord({"lr": 0.1}),
    )
    replies = [rep for _, _, rep in grid.replies]
    assert len(replies) == CLIENTS and not any(sent_in_clear(r) for r in replies)
    assert all("UserLevelDP" in r.error.reason for r in replies)
    assert len(res.arrays) == 0  # Flower's result: no model (the run itself ends completed)


# -- Flower's DP stacked with fedudp's ----------------------------------------------------------
def agg() -> GaussianAggregator:
    return GaussianAggregator(0.5, 1.0, Sampling(0.5, N))


@pytest.mark.parametrize(
    "wrapper",
    [
        DifferentialPrivacyServerSideFixedClipping,
        DifferentialPrivacyClientSideFixedClipping,
        DifferentialPrivacyServerSideAdaptiveClipping,
        DifferentialPrivacyClientSideAdaptiveClipping,
    ],
)
def test_a_flower_dp_wrapper_inside_is_refused_at_construction(wrapper, monkeypatch):
    def inner():
        fixed = "Fixed" in wrapper.__name__
        kw = {"noise_multiplier": 1.0 if fixed else 0.01, "num_sampled_clients": CLIENTS}
        kw |= {"clipping_norm": 1.0} if fixed else {"initial_clipping_norm": 1.0}
        return wrapper(FedAvg(), **kw)

    with pytest.raises(ValueError, match=rf"Flower's {wrapper.__name__} is stacked inside"):
        UserLevelDP(inner(), agg(), delta=1e-5)
    monkeypatch.setattr(flower_strategy, "stacked_strategy", lambda s: None)  # twin: it runs
    UserLevelDP(inner(), agg(), delta=1e-5)


def test_a_flower_dp_wrapper_around_is_refused_before_any_message(monkeypatch):
    def start():
        grid = LocalGrid(user_level_mod(users_per_client=PER), App(None))
        s = DifferentialPrivacyClientSideFixedClipping(
            UserLevelDP(
                FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
                agg(),
                delta=1e-5,
                randomness="seeded",
            ),
            noise_multiplier=1.0,
            clipping_norm=1.0,
            num_sampled_clients=CLIENTS,
        )
        try:
            s.start(grid=grid, initial_arrays=arrays_of({"w": np.zeros(DIM, np.float32)}))
        except Exception as e:  # noqa: BLE001  (the test reads it)
            return grid, e
        return grid, None

    grid, e = start()
    assert isinstance(e, ValueError) and not grid.replies  # refused before any message
    assert "DifferentialPrivacyClientSideFixedClipping is stacked around" in str(e)
    # twin: the check switched off, the messages go out (each client then refuses the outer
    # wrapper's clipping_norm key: tested below)
    monkeypatch.setattr(flower_strategy, "outer_wrapper", lambda me: None)
    grid, e = start()
    assert grid.replies


def train_fn_app(mods) -> ClientApp:
    app = ClientApp(mods=mods)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return App(None)(msg, context)

    return app


@pytest.mark.parametrize(
    ("mod", "name"),
    [
        (fixedclipping_mod, "fixedclipping_mod"),
        (adaptiveclipping_mod, "adaptiveclipping_mod"),
        (LocalDpMod(1.0, 1.0, 1.0, 1e-5), "LocalDpMod"),
    ],
)
def test_a_flower_dp_mod_after_user_level_mod_is_refused(mod, name, monkeypatch):
    app = train_fn_app([user_level_mod(users_per_client=PER), mod])
    reply = app(train_message(), context())
    assert reply.has_error() and f"Flower's {name} is stacked after user_level_mod" in (
        reply.error.reason
    )
    monkeypatch.setattr(flower_mod, "stacked_mods", lambda call_next: None)  # twin
    weak = train_fn_app([user_level_mod(users_per_client=PER), mod])(train_message(), context())
    if name == "LocalDpMod":  # a second noise on every user's update, sent
        assert sent_in_clear(weak) and K_CONTRIB in weak.content
    else:  # Flower's mod fails each user (no clipping_norm): all dropped, nothing caught
        assert not weak.has_error()


def test_another_wrappers_config_key_is_refused(monkeypatch):
    msg = train_message()
    msg.content["config"]["clipping_norm"] = 1.0
    reply = user_level_mod(users_per_client=PER)(msg, context(), App(None))
    assert reply.has_error() and "'clipping_norm'" in reply.error.reason
    monkeypatch.setattr(flower_mod, "foreign_keys", lambda configs: None)  # twin
    assert sent_in_clear(user_level_mod(users_per_client=PER)(msg, context(), App(None)))


# -- the run's outcome ----------------------------------------------------------------------------
class FlakyOnce:
    """Client 0 fails in round 1 only (its infrastructure): with min_owners = every client,
    round 1 is withheld and round 2 released."""

    def __init__(self) -> None:
        self.mod = user_level_mod(users_per_client=PER)

    def __call__(self, msg, context, call_next):
        if int(context.node_config["partition-id"]) == 0 and int(msg.content[K_DP]["round"]) == 1:
            raise ConnectionError("client 0's link dropped")
        return self.mod(msg, context, call_next)


class NoOutcome(UserLevelDP):
    """Weakened: the run's end says nothing (the old ``start``: only the withheld-everything
    case failed)."""

    def finish(self, num_rounds):
        return {}


def test_withheld_rounds_are_named_at_the_end(caplog):
    caplog.set_level(logging.WARNING)
    s, grid, released, metrics = run(FlakyOnce(), App(None), min_owners=CLIENTS)
    out = s.ledger.extra["outcome"]
    assert out["status"] == "completed, 1 of 2 rounds withheld"
    assert out["released"] == 1 and [r for r, _ in out["withheld"]] == [1]
    assert any("1 of 2 training rounds were withheld" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("cls", [UserLevelDP, NoOutcome])
def test_a_run_that_released_nothing_fails(cls):
    grid = LocalGrid(user_level_mod(users_per_client=PER), App(None))
    s = cls(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=1),
        agg(),
        delta=1e-5,
        target_epsilon=1e-6,  # the first release would exceed it: no training at all
        randomness="seeded",
    )
    init = arrays_of({"w": np.zeros(DIM, np.float32)})
    if cls is NoOutcome:  # the twin ends "completed" with nothing released
        s.start(grid=grid, initial_arrays=init, num_rounds=2)
        assert not s.ledger.entries and "outcome" not in s.ledger.extra
        return
    with pytest.raises(RunFailed, match=r"no training round released \(budget: round 1"):
        s.start(grid=grid, initial_arrays=init, num_rounds=2)
    assert s.ledger.extra["outcome"]["status"] == "failed: nothing released"


def test_a_clients_contribution_of_the_wrong_shape_or_nan_fails_that_client():
    from fedudp.flower.collect import bad_contribution as _bad_contribution
    from fedudp.flower.wire import to_record as _record

    assert _bad_contribution(_record({"sum": np.zeros(DIM)}), DIM) is None
    assert "shape (5,)" in _bad_contribution(_record({"sum": np.zeros(5)}), DIM)
    assert "not finite" in _bad_contribution(_record({"sum": np.full(DIM, np.nan)}), DIM)
    assert _bad_contribution(_record({"rows": np.zeros((0, DIM))}), DIM) is None
    assert "neither" in _bad_contribution(_record({"x": np.zeros(DIM)}), DIM)
