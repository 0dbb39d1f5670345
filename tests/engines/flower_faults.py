"""Test-only fault injection for ``engine=flower`` (never in the production handlers).

Server side: ``inject(monkeypatch, faults)`` adds ``"fault"`` to the run record of the messages
for (round, owner) pairs. Owner side: ``faulty_client_app()`` is the production ClientApp's
handlers behind ``fault_mod``, a Flower mod that acts on that key:

* ``raise``: the owner fails its train step with an ``OwnerFailure`` (infrastructure-like);
* ``bug``: the owner raises a plain ``ZeroDivisionError`` (a fedudp bug: the run must stop);
* ``sleep:S``: the owner answers after S seconds (past ``engine_opts.timeout_s``);
* ``nan``: the owner's reply carries non-finite shared vectors (rejected on the billboard).
"""

from __future__ import annotations

import sys
import time

import numpy as np
import ray.cloudpickle
from flwr.app import Array, ArrayRecord
from flwr.clientapp import ClientApp

from fedudp.protocol.messages import OwnerFailure
import fedudp.flower.client_app as flower_client
import fedudp.flower.wire as flower_wire


def fault_mod(msg, context, call_next):
    run = msg.content[flower_wire.K_RUN] if flower_wire.K_RUN in msg.content else None
    fault = str(run["fault"]) if run is not None and "fault" in run else ""
    kind = msg.metadata.message_type
    if kind == "train" and fault == "raise":
        raise OwnerFailure("injected failure")
    if kind == "train" and fault == "bug":
        raise ZeroDivisionError("injected bug")
    if kind == "train" and fault.startswith("sleep:"):
        time.sleep(float(fault.split(":", 1)[1]))
    reply = call_next(msg, context)
    if kind == "train" and fault == "nan" and flower_wire.K_VECTORS in reply.content:
        rec = reply.content[flower_wire.K_VECTORS]
        reply.content[flower_wire.K_VECTORS] = ArrayRecord(
            {
                k: Array(np.full(a.numpy().shape, np.nan, dtype=a.numpy().dtype))
                for k, a in rec.items()
            }
        )
    return reply


def faulty_client_app() -> ClientApp:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers lack tests/
    app = ClientApp(mods=[fault_mod])
    app.query()(flower_client.query)
    app.train()(flower_client.train)
    app.evaluate()(flower_client.evaluate)
    return app


def inject(monkeypatch, faults: dict[tuple[int, int], str]) -> None:
    """Owner-side faults for (round, owner) pairs, through the test-only ClientApp."""
    orig = flower_wire.run_record

    def run_record(cfg_json, round_, owner, *a, **k):
        rec = orig(cfg_json, round_, owner, *a, **k)
        if (round_, owner) in faults:
            rec["fault"] = faults[(round_, owner)]
        return rec

    monkeypatch.setattr(flower_wire, "run_record", run_record)
    monkeypatch.setattr(flower_client, "client_app", faulty_client_app())


class SendRecorder:
    """A server grid that keeps every reply of ``send_and_receive`` in ``got`` (the keyword form
    Flower's strategies use: ``send_and_receive(messages=..., timeout=...)``)."""

    def __init__(self, grid, got: list) -> None:
        self._grid, self._got = grid, got

    def __getattr__(self, name):
        return getattr(self._grid, name)

    def send_and_receive(self, messages, timeout=None):
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self._got.extend(replies)
        return replies
