"""Trajectory transport between rollout workers and the trainer: shared-memory ring, staleness gate,
replay."""
from buffer.ring import Group, TrajectoryRing
from buffer.staleness import StalenessGate

__all__ = ["Group", "TrajectoryRing", "StalenessGate"]
