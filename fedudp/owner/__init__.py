"""The owner side of joint DP: what each data owner runs on its own users' records.

Its modules are imported by name (``fedudp.owner.owners``, ``fedudp.owner.kernels``, ...);
the package itself exports nothing.
"""

__all__: list[str] = []
