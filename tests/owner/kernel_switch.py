"""Runs whose owners take chosen batched paths: ``Kernels`` given to every ``Owners`` built.

A run's owners are built by the builder from the run's configuration, which has no key for the
batched paths (they change only speed and float rounding): the default ``Kernels()`` is what
every run takes. A test comparing a path with its reference runs the same configuration with
``owners_take(monkeypatch, Kernels(...))``: each ``Owners`` built from then on (either engine)
receives that explicit setting in its ``OwnerTraining``.
"""

from __future__ import annotations

import dataclasses

from fedudp.owner.kernels import Kernels
from fedudp.owner.owners import Owners

HONEST_INIT = Owners.__init__


def owners_take(monkeypatch, kernels: Kernels) -> None:
    """Every ``Owners`` built while ``monkeypatch`` holds is given ``kernels``."""

    def init(self, model, spec, training, budget, hooks=None):
        training = dataclasses.replace(training, kernels=kernels)
        HONEST_INIT(self, model, spec, training, budget, hooks)

    monkeypatch.setattr(Owners, "__init__", init)
