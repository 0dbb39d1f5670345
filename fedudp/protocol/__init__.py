"""The protocol: what the owner side and the billboard exchange and keep (contributions and
their constraints, the messages of a round, the methods and choices of a run, checkpoints, the
ledger file). Import from the modules; the package itself exports nothing."""

__all__: list[str] = []
