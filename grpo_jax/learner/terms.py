"""The update's loss terms: the batch prepared once per step and the loss of a (micro-)batch.

:func:`prepare_batch` scores what the whole step shares (pi_old when recomputed, the
behaviour weights, the reference's and a teacher's log-probs, a critic's targets); the
losses take one (micro-)batch: padded (:func:`padded_loss`), packed (:func:`packed_loss`),
with a value head (:func:`critic_loss`) or with the teacher's full-vocabulary KL
(:func:`full_kl_loss`). docs/objective.md has the objective.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from grpo_jax.core.batch import RolloutBatch
from grpo_jax.learner import critic, replay
from grpo_jax.learner.optimizer import TrainState
from grpo_jax.learner.rows import loss_mask
from grpo_jax.learner.step import StepPlan, with_dropout
from grpo_jax.models import lora
from grpo_jax.objective import losses
from grpo_jax.objective.distill import distill_advantages, distill_metrics
from grpo_jax.objective.logprobs import (
    completion_logps_and_entropy,
    completion_logps_and_teacher_kl,
    packed_logps_and_entropy,
    packed_member,
    teacher_features,
)


def prepare_batch(
    plan: StepPlan, state: TrainState, batch: RolloutBatch, ref_params, old_logps, teacher=None
):
    """Prepare the batch: pi_old's log-probs, the behaviour weights, the reference log-probs
    and, with a teacher, the distillation term (:func:`_teacher_term`).

    Returns ((batch, ref_logps_NxT, behavior_w_NxT, distill_NxT), metrics). With
    ``old_logps`` "recompute", pi_old is rescored by the update's own path
    from the parameters the step starts from (those that sampled the batch in
    the on-policy loop): the first ratio is then 1 whatever the sampler's
    precision. The weights of pi_old against the distribution the sampler drew
    from are computed once over the whole batch (so sequence-level weights see
    whole rows); None without correction. The reference log-probs (None when
    beta = 0) are computed once per step; with LoRA the reference is the base,
    the same arrays with the adapters off. Both travel beside the batch
    through the minibatch and micro-batch splits. ``teacher``: (graphdef, params) of
    the teacher (:func:`teacher_of`), None without one.
    """
    objective = plan.objective
    mask_NxT = batch.mask_NxT.astype(jnp.float32)
    if old_logps == "recompute":
        old_NxT = jax.lax.stop_gradient(plan.logps(state.params, batch, plan.g_micro, replay=True))
        batch = batch.replace(old_logps_NxT=jnp.where(mask_NxT > 0, old_NxT, 0.0))
    behavior_w_NxT, behavior_metrics = losses.behavior_weights(
        batch.old_logps_NxT,
        batch.behavior_logps_NxT,
        loss_mask(batch),
        correction=objective.behavior_correction,
        level=objective.behavior_level,
        cap=objective.behavior_cap,
    )
    if objective.behavior_correction == "none":
        behavior_w_NxT = None
    ref_logps_NxT = None
    if objective.beta > 0 and plan.use_lora:
        base, _ = lora.split(state.params)
        ref_NxT = plan.logps(base, batch, plan.g_full, plan.base_graphdef)
        ref_logps_NxT = jax.lax.stop_gradient(ref_NxT)
    elif objective.beta > 0:
        ref_logps_NxT = jax.lax.stop_gradient(plan.logps(ref_params, batch, plan.g_full))
    distill_NxT, teacher_metrics = _teacher_term(plan, batch, teacher, ref_logps_NxT)
    metrics = behavior_metrics | teacher_metrics
    if plan.replay:
        metrics |= _replay_metrics(plan, state.params, batch)
    if plan.use_critic:  # a teacher with the critic is refused at start-up (run.config)
        tg, critic_metrics = _critic_targets(plan, state, batch)
        return (batch, ref_logps_NxT, behavior_w_NxT, tg), metrics | critic_metrics
    return (batch, ref_logps_NxT, behavior_w_NxT, distill_NxT), metrics


def _replay_metrics(plan: StepPlan, params, batch: RolloutBatch) -> dict:
    """``moe/*`` (``grpo_jax.learner.replay``) at the parameters the step starts from."""
    return replay.own_route_metrics(
        plan.graphdef,
        params,
        jax.lax.stop_gradient(batch),
        loss_mask(batch),
        plan.objective.temperature,
        chunk_size=plan.logits_chunk,
        group_size=plan.g_full,
    )


def teacher_of(plan: StepPlan, state: TrainState, ref_params, teacher_params):
    """(graphdef, params) of the teacher: its own, or for "reference" the reference's
    arrays (with LoRA the base inside the policy's, under the model without adapters;
    with beta = 0 the run's copy of the base, passed as the teacher's)."""
    if not plan.teacher.is_reference:
        return plan.teacher_graphdef or plan.graphdef, teacher_params
    if plan.use_lora:
        return plan.base_graphdef, lora.split(state.params)[0]
    return plan.graphdef, teacher_params if ref_params is None else ref_params


def _teacher_term(plan: StepPlan, batch: RolloutBatch, teacher, ref_NxT):
    """(the teacher's part of the prepared batch or None, its ``teacher/*`` metrics).

    "sampled": D = -teacher.weight (log pi_old - log pi_teacher) on the loss mask's tokens
    (``grpo_jax.objective.distill``), with the reference's log-probs when it is the teacher
    and already scored. "full": the teacher's features [N, T, D] of the batch, whose LM
    head the loss runs beside the student's (:func:`full_kl_loss`). Weight 0 is no
    teacher: nothing is scored, and the update is the one without (a teacher pass beside
    the loss's changes how XLA fuses it, and the parameters then differ in their last bits).
    """
    if plan.teacher is None or plan.teacher.weight == 0:
        return None, {}
    graphdef, params = teacher
    rows = (batch.prompt_tokens_NxP, batch.prompt_mask_NxP, batch.tokens_NxT, batch.mask_NxT)
    if plan.teacher.kl == "full":
        return teacher_features(graphdef, params, *rows, group_size=plan.g_full), {}
    teacher_NxT = ref_NxT
    if not (plan.teacher.is_reference and ref_NxT is not None):
        teacher_NxT = jax.lax.stop_gradient(plan.logps(params, batch, plan.g_full, graphdef))
    mask_NxT = loss_mask(batch)
    term_NxT = distill_advantages(batch.old_logps_NxT, teacher_NxT, mask_NxT, plan.teacher.weight)
    metrics = distill_metrics(
        batch.old_logps_NxT, teacher_NxT, mask_NxT, batch.advantages_N, term_NxT
    )
    return term_NxT, metrics


def _critic_targets(plan: StepPlan, state: TrainState, batch: RolloutBatch):
    """The step's GAE targets (``critic.targets``) from the values the step starts from,
    scored once over the whole batch like pi_old's log-probs."""
    values_NxT = critic.values(
        plan.graphdef, state.params, state.critic, batch, group_size=plan.g_full
    )
    return critic.targets(plan.objective, batch.rewards_N, values_NxT, loss_mask(batch), state.step)


def padded_loss(plan: StepPlan, params, mb):
    """The GRPO loss of one (micro-)batch ``mb`` = (batch, ref_logps_NxT, behavior_w_NxT,
    distill_NxT).

    The completions are scored with their entropies in one pass
    (``completion_logps_and_entropy``); the loss mask is :func:`loss_mask`.
    """
    b, ref_NxT, w_NxT, d_NxT = mb
    logps_NxT, entropy_NxT = completion_logps_and_entropy(
        plan.graphdef,
        params,
        b.prompt_tokens_NxP,
        b.prompt_mask_NxP,
        b.tokens_NxT,
        b.mask_NxT,
        plan.objective.temperature,
        chunk_size=plan.logits_chunk,
        with_entropy=True,
        group_size=plan.g_micro,
        routes=plan.routes(b),
    )
    return losses.grpo_loss(
        logps_NxT,
        b.old_logps_NxT,
        b.advantages_N,
        loss_mask(b),
        plan.objective,
        ref_logps_NxT=ref_NxT,
        entropy_NxT=entropy_NxT,
        behavior_weights_NxT=w_NxT,
        distill_adv_NxT=d_NxT,
    )


def full_kl_loss(plan: StepPlan, params, mb, *, teacher):
    """:func:`padded_loss` with the full-vocabulary reverse KL to the teacher as a penalty:
    ``mb`` = (batch, ref_logps_NxT, behavior_w_NxT, the teacher's features [N, T, D]), and
    ``teacher`` its (graphdef, params). Each token's objective loses
    teacher.weight KL(pi_theta || pi_teacher) at its position (docs/objective.md, 13);
    ``teacher_kl`` is that KL's mean over the loss mask's tokens."""
    b, ref_NxT, w_NxT, th_NxTxD = mb
    logps_NxT, entropy_NxT, kl_NxT = completion_logps_and_teacher_kl(
        plan.graphdef,
        params,
        b.prompt_tokens_NxP,
        b.prompt_mask_NxP,
        b.tokens_NxT,
        b.mask_NxT,
        plan.objective.temperature,
        teacher,
        th_NxTxD,
        chunk_size=plan.logits_chunk,
        group_size=plan.g_micro,
    )
    mask_NxT = loss_mask(b).astype(jnp.float32)
    loss, aux = losses.grpo_loss(
        logps_NxT,
        b.old_logps_NxT,
        b.advantages_N,
        mask_NxT,
        plan.objective,
        ref_logps_NxT=ref_NxT,
        entropy_NxT=entropy_NxT,
        behavior_weights_NxT=w_NxT,
        penalty_NxT=plan.teacher.weight * kl_NxT,
    )
    kl_mean = (kl_NxT * mask_NxT).sum() / jnp.maximum(mask_NxT.sum(), 1.0)
    return loss, dict(aux, teacher_kl=jax.lax.stop_gradient(kl_mean))


def critic_loss(plan: StepPlan, params_and_head, mb):
    """:func:`padded_loss` with a value head: the policy term on the step's per-token GAE
    advantages and the clipped value loss, from one forward pass (``critic.combined_loss``)."""
    (params, head), (b, ref_NxT, w_NxT, tg) = params_and_head, mb
    logps_NxT, entropy_NxT, values_NxT = critic.score(
        plan.graphdef,
        params,
        head,
        b,
        plan.objective.temperature,
        chunk_size=plan.logits_chunk,
        group_size=plan.g_micro,
        with_entropy=True,
    )
    policy_loss, metrics = losses.grpo_loss(
        logps_NxT,
        b.old_logps_NxT,
        tg.advantages_NxT,
        loss_mask(b),
        plan.objective,
        ref_logps_NxT=ref_NxT,
        entropy_NxT=entropy_NxT,
        behavior_weights_NxT=w_NxT,
    )
    return critic.combined_loss(plan.objective, policy_loss, metrics, values_NxT, tg)


def packed_loss(plan: StepPlan, params, mb):
    """The loss of one packed micro-batch: ``mb`` = (minibatch, ref_logps_NxT,
    behavior_w_NxT, distill_NxT, pack, whole).

    Its rows and columns are the minibatch's, its loss mask only the tokens ``pack``
    scores, and its reductions divide by the minibatch's counts (``whole``,
    ``grpo_jax.objective.losses.Whole``): the micro-batches' losses add up to the
    minibatch's loss.
    """
    b, ref_NxT, w_NxT, d_NxT, pack, whole = mb
    logps_NxT, entropy_NxT = packed_logps_and_entropy(
        plan.graphdef,
        params,
        b.prompt_tokens_NxP,
        b.tokens_NxT,
        pack,
        plan.objective.temperature,
        chunk_size=plan.logits_chunk,
        with_entropy=True,
    )
    n, t = b.tokens_NxT.shape
    return losses.grpo_loss(
        logps_NxT,
        b.old_logps_NxT,
        b.advantages_N,
        loss_mask(b) * packed_member(pack, n, t),
        plan.objective,
        ref_logps_NxT=ref_NxT,
        entropy_NxT=entropy_NxT,
        behavior_weights_NxT=w_NxT,
        whole=whole,
        distill_adv_NxT=d_NxT,
    )


def make_grad_fn(plan: StepPlan, loss_fn=None):
    """Make the loss: grad_fn(trained, frozen, mb, key) -> ((loss, metrics), grads of trained).

    ``trained`` and ``frozen`` are :meth:`StepPlan.partition`'s; the gradient is
    taken with respect to ``trained`` alone. LoRA dropout, when on, draws its
    masks from ``key``. ``loss_fn``: :func:`padded_loss` (default) or :func:`packed_loss`.
    """
    loss_fn = loss_fn or (critic_loss if plan.use_critic else padded_loss)

    def train_loss(trained, frozen, mb, k):
        if plan.use_critic:  # trained: {"policy": ..., "value": the head}
            params = (plan.join(frozen, trained["policy"]), trained["value"])
        else:
            params = plan.join(frozen, trained)
        return with_dropout(plan, k, lambda: loss_fn(plan, params, mb))

    return jax.value_and_grad(train_loss, has_aux=True)


def choose_loss(plan: StepPlan, packs, teacher):
    """The loss of the update's (micro-)batches: :func:`padded_loss`, :func:`packed_loss` with
    ``packs``, :func:`critic_loss` with a value head, or :func:`full_kl_loss` with a
    teacher's full-vocabulary KL."""
    if plan.use_critic:  # neither packing nor a teacher combines with it (run.config)
        return critic_loss
    full = plan.teacher is not None and plan.teacher.weight > 0 and plan.teacher.kl == "full"
    if full and packs is not None:
        raise ValueError("teacher.kl = 'full' does not combine with packed rows")
    if full:
        return functools.partial(full_kl_loss, teacher=teacher)
    return padded_loss if packs is None else packed_loss
