"""The GRPO objective: its settings, log-probs, advantages, policy terms and losses."""
