"""Federations: the records (``records``), the planned data sets (``federation``) and the readers
of natural-user formats, each registered in ``fedudp.data.readers.READERS`` when its module is
imported here (a new format: one module and its name in the import line below)."""

from fedudp.data import cifar, columnar, federation, hf, leaf  # noqa: F401  (their readers)

__all__: list[str] = []
