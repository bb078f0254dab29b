"""Batches for the update and scoring tests: grouped rows and a RolloutBatch scored by a policy."""

import numpy as np
from helpers_jit import completion_logps

from grpo_jax.rollout.rounds import RolloutBatch


def grouped_batch(rng, B, G, P, T, V):
    """Rows b*G .. b*G+G-1 share prompt b (as the sampler writes them); ragged masks."""
    pmask = np.ones((B, P), bool)
    pmask[0, :3] = False
    pmask[1, :1] = False
    mask = np.ones((B * G, T), bool)
    mask[::3, T - 2 :] = False
    return dict(
        prompt_tokens=np.repeat(rng.integers(4, V, (B, P)), G, axis=0).astype(np.int32),
        prompt_mask=np.repeat(pmask, G, axis=0),
        tokens=rng.integers(4, V, (B * G, T)).astype(np.int32),
        mask=mask,
    )


def rollout_batch(graphdef, params, rows, advantages_N, weights_N=None, G=4):
    """A RolloutBatch of these rows, pi_old's log-probs scored with ``params``."""
    n = rows["tokens"].shape[0]
    old_NxT = completion_logps(
        graphdef,
        params,
        rows["prompt_tokens"],
        rows["prompt_mask"],
        rows["tokens"],
        rows["mask"],
        1.0,
    )
    return RolloutBatch(
        prompt_tokens_NxP=rows["prompt_tokens"],
        prompt_mask_NxP=rows["prompt_mask"],
        tokens_NxT=rows["tokens"],
        mask_NxT=rows["mask"],
        old_logps_NxT=np.asarray(old_NxT) * rows["mask"],
        behavior_logps_NxT=np.asarray(old_NxT) * rows["mask"],
        rewards_N=np.zeros(n, np.float32),
        advantages_N=advantages_N,
        weights_N=np.ones(n, np.float32) if weights_N is None else weights_N,
        group_ids_N=np.arange(n, dtype=np.int32) // G,
    )
