"""The billboard: the server side of joint DP. ``server.Billboard`` releases a user-level DP mean
of the owners' contributions each round through the one release path (``release.ReleaseGate``);
``rounds`` is the round loop every engine runs. Import from the modules; the package itself
exports nothing."""

__all__: list[str] = []
