"""What the steps of one update share (:class:`StepPlan`), and its log-prob passes.

The plan holds the update's static settings (the model, the optimizer, the objective,
LoRA, packing, a teacher) and scores a batch's completions under some parameters, on padded
rows or, with a packing plan, packed ones (docs/packing.md). LoRA dropout draws its masks
inside :func:`with_dropout`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from grpo_jax.core.batch import RolloutBatch
from grpo_jax.learner.rows import join_rows, split_rows
from grpo_jax.models import lora
from grpo_jax.objective.config import GRPOConfig
from grpo_jax.objective.distill import TeacherConfig
from grpo_jax.objective.logprobs import (
    PackedRows,
    completion_logps,
    packed_logps_and_entropy,
)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What the steps of :func:`grpo_jax.learner.update.update` share: its static arguments
    and what follows from them.

    ``g_full`` / ``g_micro``: the group size the whole batch / one micro-batch
    is scored with. With ``share_prompts`` the batch's rows come in groups of
    G = ``grpo.G`` that share one prompt (as the sampler writes them); each
    prompt is then run once per group wherever a (micro-)batch holds whole
    groups (G), else once per row (1).

    LoRA (``base_graphdef`` given, ``grpo_jax.models.lora``): ``state.params``
    is the frozen base joined with the adapters, and ``state.opt_state`` the
    optimizer state of the adapters alone. Gradients are taken with respect to
    the adapters only (the base is a constant of the loss, :meth:`partition`),
    and the reference log-probs are those of the same base arrays under
    ``base_graphdef``, the model without adapters, so ``ref_params`` is None.
    ``lora_dropout`` > 0 drops adapter inputs in the loss's forward pass, with
    masks from ``key`` folded with the update counter and the micro-batch.
    """

    graphdef: Any
    base_graphdef: Any  # LoRA: the model without adapters (the reference); None otherwise
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    objective: GRPOConfig
    logits_chunk: int
    grad_accum: int
    batch_shards: int
    g_full: int
    g_micro: int
    lora_dropout: float
    packs: PackedRows | None = None  # packed: the step's plan, [U, K, ...] (learner.packing)
    teacher: TeacherConfig | None = None  # on-policy distillation (objective.distill)
    teacher_graphdef: Any = None  # the teacher's model (None: the policy's)

    @property
    def use_lora(self) -> bool:
        return self.base_graphdef is not None

    @property
    def replay(self) -> bool:
        """Routing replay (``grpo.router_replay = "rollout"``): the policy's passes use the
        experts the sampler recorded (``RolloutBatch.routes_NxSxRxK``); the reference and
        a teacher route by themselves."""
        return self.objective.router_replay == "rollout"

    def routes(self, b: RolloutBatch):
        """The routes the policy's passes over ``b`` replay: the recorded ones, or None."""
        return b.routes_NxSxRxK if self.replay else None

    @property
    def use_critic(self) -> bool:
        """PPO with a value head (``grpo_jax.learner.critic``): ``state.critic``."""
        return self.objective.advantage_estimator == "gae"

    def logps(self, params, b: RolloutBatch, group_size: int, gdef=None, replay=False):
        """log pi of ``b``'s completion tokens under ``params`` (``gdef``, default the policy).

        ``replay``: with routing replay on, under the rollout's routes (the policy's
        passes; the reference's and a teacher's route by themselves). Packed, ``b`` is the
        whole batch, scored micro-batch by micro-batch of the plan
        (:func:`packed_batch_logps`), and tokens the loss does not see are 0.
        """
        if self.packs is not None:
            return packed_batch_logps(self, params, b, gdef)
        return completion_logps(
            self.graphdef if gdef is None else gdef,
            params,
            b.prompt_tokens_NxP,
            b.prompt_mask_NxP,
            b.tokens_NxT,
            b.mask_NxT,
            self.objective.temperature,
            chunk_size=self.logits_chunk,
            group_size=group_size,
            routes=self.routes(b) if replay else None,
        )

    def partition(self, params):
        """(trained, frozen): what the optimizer sees, and the rest (a constant of the loss).

        Every parameter and None; with LoRA the adapters, and the whole tree
        for its frozen base.
        """
        return (lora.trainable(params), params) if self.use_lora else (params, None)

    def join(self, frozen, trained):
        """The parameters from :meth:`partition`'s two parts."""
        return trained if frozen is None else lora.with_trainable(frozen, trained)


def with_dropout(plan: StepPlan, k, fn):
    """``fn()`` with LoRA dropout's masks drawn from ``k`` when it is on (and ``k`` given:
    the scoring passes outside the loss drop nothing)."""
    if k is None or not (plan.use_lora and plan.lora_dropout > 0):
        return fn()
    with lora.dropout(k, plan.lora_dropout):
        return fn()


def packed_minibatch_logps(plan: StepPlan, params, b: RolloutBatch, packs_K, gdef=None, key=None):
    """(log pi, entropies) [M, T] of minibatch ``b``'s scored tokens, summed over its
    micro-batches ``packs_K`` (each token is scored in one of them; 0 elsewhere). An
    empty micro-batch is skipped. ``key``: LoRA dropout's, folded with the micro-batch."""
    zeros = jnp.zeros(b.tokens_NxT.shape, jnp.float32)

    def one(carry, xs):
        pack, a = xs

        def score(_):
            return with_dropout(
                plan,
                None if key is None else jax.random.fold_in(key, a),
                lambda: packed_logps_and_entropy(
                    plan.graphdef if gdef is None else gdef,
                    params,
                    b.prompt_tokens_NxP,
                    b.tokens_NxT,
                    pack,
                    plan.objective.temperature,
                    chunk_size=plan.logits_chunk,
                    with_entropy=True,
                ),
            )

        lp, ent = jax.lax.cond(pack.count > 0, score, lambda _: (zeros, zeros), None)
        return (carry[0] + lp, carry[1] + ent), None

    k = packs_K.count.shape[0]
    (lp, ent), _ = jax.lax.scan(one, (zeros, zeros), (packs_K, jnp.arange(k, dtype=jnp.int32)))
    return lp, ent


def packed_batch_logps(plan: StepPlan, params, batch: RolloutBatch, gdef=None):
    """log pi [N, T] of the whole batch, minibatch by minibatch of the plan."""
    num = plan.packs.count.shape[0]
    parts = jax.tree.map(lambda x: split_rows(x, num, plan.batch_shards), batch)

    def one(_, xs):
        part, packs_K = xs
        return None, packed_minibatch_logps(plan, params, part, packs_K, gdef)[0]

    _, lp_UxMxT = jax.lax.scan(one, None, (parts, plan.packs))
    return join_rows(lp_UxMxT, plan.batch_shards)
