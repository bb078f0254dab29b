"""grpo_jax: Group Relative Policy Optimization for language models in JAX."""

__version__ = "0.1.0"
