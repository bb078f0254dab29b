"""Rollouts: sources of a step's batch, their rounds, episodes, scoring and staleness."""
