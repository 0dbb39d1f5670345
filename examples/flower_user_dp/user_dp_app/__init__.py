"""A small Flower PyTorch app with user-level DP added by fedudp.flower (see README.md)."""
