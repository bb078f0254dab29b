"""The parts of ``python -m grpo_jax.compare`` (docs/evaluation.md, "Comparing runs"):
``runs`` (evaluations read and runs grouped), ``rows`` (units, intervals, paired tests and
the tables' rows) and ``tables`` (the rows as Markdown and LaTeX, under their captions).
"""
