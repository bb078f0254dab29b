"""The run: the one training loop and everything that sees the whole RunConfig."""
