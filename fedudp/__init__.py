"""fedudp: federated-learning simulation with user-level and joint differential privacy.

Flower and Ray read these at import time; with no network, telemetry and usage reporting stay
off. This is the one place they are set (every fedudp process, Ray workers included, imports
the package before anything else of it).
"""
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
