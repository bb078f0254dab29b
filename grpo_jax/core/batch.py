"""What a step's rollouts are once sampled and scored: the device batch the update consumes
(``RolloutBatch``) and what the host keeps of it (``HostRollout``).

The bottom layer of the package: every part that makes, moves, checkpoints or
consumes a batch (rollout sources, the staleness pipeline, the update) speaks these
types, and this module imports nothing from grpo_jax.

Shapes: N = B * G rows in aligned groups of G completions of one prompt, P padded
prompt length, T completion slots.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.core.sharding import batch_sharding

__all__ = ["HostRollout", "RolloutBatch", "batch_spec", "rollout_batch_shardings"]


@flax.struct.dataclass
class RolloutBatch:
    """One step's rollouts as the update consumes them: global arrays split over the batch axes.

    Rows come in aligned groups of G completions of one prompt (rows b*G ..
    b*G+G-1 share prompt b and group id b), as the sampler writes them.

    Attributes:
      prompt_tokens_NxP, prompt_mask_NxP: each row's left-padded prompt.
      tokens_NxT, mask_NxT: the completion, right-padded; the mask covers the
        sampled tokens up to and including EOS.
      old_logps_NxT: log-probs of the completion tokens under the policy
        that sampled them (pi_old: full softmax at the temperature), as the
        sampler recorded them; 0 where masked.
      behavior_logps_NxT: their log-probs under the distribution the sampler
        actually drew from (after top-k / top-p / min-p): equal to
        old_logps_NxT when no filter is on; 0 where masked.
      rewards_N: each row's weighted total reward.
      advantages_N: each row's group-normalised advantage.
      weights_N: per-row weight of the row's tokens in the loss (1.0 for a
        real row, 0.0 for a row that only pads the batch to its static shape).
      group_ids_N: the global index of each row's prompt in the batch.
      routes_NxSxRxK: with routing replay (``grpo.router_replay = "rollout"``), the
        experts a mixture of experts' R sparse layers chose at each of the S = P + T
        positions of [prompt | completion] as the sampler ran them, K each (int8, int16
        past 127 experts; -1 where no token was fed); None otherwise (docs/moe.md).
    """

    prompt_tokens_NxP: jax.Array
    prompt_mask_NxP: jax.Array
    tokens_NxT: jax.Array
    mask_NxT: jax.Array
    old_logps_NxT: jax.Array
    behavior_logps_NxT: jax.Array
    rewards_N: jax.Array
    advantages_N: jax.Array
    weights_N: jax.Array
    group_ids_N: jax.Array
    routes_NxSxRxK: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return self.tokens_NxT.shape[0]


@dataclasses.dataclass
class HostRollout:
    """What the host keeps of one step's rollout: texts of its rows and the batch's statistics."""

    examples: list[dict]  # this host's prompts' examples
    prompts_n: list[str]
    completions: list[str]
    total_n: np.ndarray
    metrics: dict[str, float]  # the whole batch's (all hosts) rollout/, rewards/, perf/ metrics
    completion_tokens: int  # the batch's N rows, all hosts (what the update scores)
    sampled_tokens: int  # completion tokens sampled this step, all rounds, all hosts
    prompt_tokens: int  # real (unpadded) prompt tokens of all N rows, all hosts
    t_params_ready: float  # perf_counter() when the parameters were ready to sample from


def _ndim(name: str) -> int:
    return 1 if name.endswith("_N") else 4 if name.endswith("xRxK") else 2


def rollout_batch_shardings(mesh, routes: bool = False) -> RolloutBatch:
    """A RolloutBatch of shardings: every field's rows split over the batch axes; the
    routes' only with ``routes`` (routing replay), else None as the field is."""
    return RolloutBatch(
        **{
            f.name: batch_sharding(mesh, _ndim(f.name))
            for f in dataclasses.fields(RolloutBatch)
            if routes or f.name != "routes_NxSxRxK"
        }
    )


def batch_spec(batch_shardings: RolloutBatch, n: int, p: int, t: int, routes=None) -> RolloutBatch:
    """The RolloutBatch the loop will hand the update, as ShapeDtypeStructs with shardings:
    ``n`` rows, prompts padded to ``p`` tokens, completions of ``t``; ``routes`` (R, K,
    dtype) with routing replay: the routes' [n, p + t, R, K]."""
    dtypes = dict(
        prompt_tokens_NxP=jnp.int32,
        prompt_mask_NxP=jnp.bool_,
        tokens_NxT=jnp.int32,
        mask_NxT=jnp.bool_,
        old_logps_NxT=jnp.float32,
        behavior_logps_NxT=jnp.float32,
        rewards_N=jnp.float32,
        advantages_N=jnp.float32,
        weights_N=jnp.float32,
        group_ids_N=jnp.int32,
    )
    shape = lambda name: (
        (n, p) if name.endswith("NxP") else (n, t) if name.endswith("NxT") else (n,)
    )
    spec = {
        name: jax.ShapeDtypeStruct(shape(name), dt, sharding=getattr(batch_shardings, name))
        for name, dt in dtypes.items()
    }
    if routes is not None:
        r, k, dtype = routes
        spec["routes_NxSxRxK"] = jax.ShapeDtypeStruct(
            (n, p + t, r, k), dtype, sharding=batch_shardings.routes_NxSxRxK
        )
    return RolloutBatch(**spec)


def jsonable(x):
    """``x`` with numpy arrays and scalars as lists and Python numbers, tuples as lists,
    dict keys as strings, anything else as its ``str``: what a checkpoint's JSON holds
    of a batch's host values."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)
