"""The privacy layer: mechanisms, events, the accountant (``accountant``, behind one seam to
dp-accounting), calibration, the ledger and the labels of every reported ε. Import from the
modules (``fedudp.privacy.accountant``, ``fedudp.privacy.mechanisms``, ...); the package itself
exports nothing."""

__all__: list[str] = []
