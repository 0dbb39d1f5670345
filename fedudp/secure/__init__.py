"""Distributed DP without a trusted server: the owners' encoding of their users' vectors into
integers mod 2^b with a discrete noise share each, and a simulated secure aggregation whose
billboard side sees only masked vectors and decodes their sum
(docs/algorithms.md#distributed-dp-under-secure-aggregation)."""

# the API is in the submodules: rotation, rounding, noise, masks, encoding
__all__: list[str] = []
