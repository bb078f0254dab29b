"""The learner: the jitted update and the optimizer it steps."""
