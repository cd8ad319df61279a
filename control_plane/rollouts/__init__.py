"""Rollouts: the state machine, staged membership, desired-state resolution, change feed."""
