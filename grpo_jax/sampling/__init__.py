"""Rollout engines behind one interface (``engines``): the static KV-cache sampler and the paged
engine, their draws and settings."""
