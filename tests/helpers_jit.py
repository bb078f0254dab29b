"""Test references as compiled programs: run eagerly, JAX compiles each operation of a model
or loss on its own, on first sight of each shape, which made up most of some tests' time."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.objective import logprobs

# logprobs.completion_logps(graphdef, params, prompt_tokens, prompt_mask, tokens, mask,
# temperature, *, chunk_size=0, group_size=1), one program per graphdef, shape and option.
completion_logps = jax.jit(
    logprobs.completion_logps, static_argnums=(0, 6), static_argnames=("chunk_size", "group_size")
)


@functools.partial(jax.jit, static_argnums=0)
def _scores(graphdef, state, tokens, mask):
    return nnx.merge(graphdef, state).scores(tokens, mask)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def logits(model, tokens) -> np.ndarray:
    """``model(tokens)`` as one compiled program per model structure and input shape (eagerly,
    a forward pass compiles each of its operations on its own)."""
    graphdef, state = nnx.split(model)
    return np.asarray(_logits(graphdef, state, jnp.asarray(tokens)))


def scores(model, tokens, mask):
    """A reward model's ``scores(tokens, mask)`` as one compiled program per shape."""
    graphdef, state = nnx.split(model)
    return _scores(graphdef, state, tokens, mask)


def central_differences(f, x, h: float = 1e-6) -> np.ndarray:
    """(f(x + h e_i) - f(x - h e_i)) / 2h for every element i of ``x``.

    The 2 x size evaluations are one jitted, vmapped program instead of as many eager
    calls (each of which dispatches, and on first sight compiles, op by op).
    """
    n = x.size
    steps = h * jnp.eye(n, dtype=x.dtype).reshape(n, *x.shape)
    fv = jax.jit(jax.vmap(f))
    return np.asarray((fv(x + steps) - fv(x - steps)) / (2 * h)).reshape(x.shape)
