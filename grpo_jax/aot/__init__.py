"""A run's programs compiled ahead of time for a named TPU topology, on any host.

The parts of ``python -m grpo_jax.plan`` (docs/pods.md): ``topology`` (user names, chips,
libtpu), ``architectures`` (the shipped recipes' model sizes), ``programs`` (each program of
a run from abstract parameters), ``hlo_costs`` (FLOPs and collectives per step from the
compiled text), ``budget`` (what the memory plan says of each program, the roofline, the
settings that fit) and ``measure`` (compiling one program and reading XLA's figures).
"""
