"""The jitted GRPO update: mu passes over a rollout batch in minibatches, guarded.

Shapes: N completion rows (B prompts x G, grouped contiguously), P padded
prompt length, T completion length, U optimizer updates per step (mu * N / M
for minibatches of M rows), A gradient-accumulation micro-batches per update.

``update(state, batch, key, ref_params) -> (state, metrics)`` is pure, compiled once with
explicit shardings and ``state`` donated (:func:`jit_update`); pi_old's log-probs come with the
``grpo_jax.core.batch.RolloutBatch``, and each update passes the non-finite guard. Its parts:
docs/architecture.md, "update"; pi_old, row weights, behaviour correction: docs/objective.md.
With ``packs`` (``grpo_jax.learner.packing``) every pass runs on packed rows: docs/packing.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_jax.core import sharding
from grpo_jax.core.batch import (  # noqa: F401 - the batch shardings lived here
    RolloutBatch,
    batch_spec,
    rollout_batch_shardings,
)
from grpo_jax.learner import critic, optimizer, replay
from grpo_jax.learner.optimizer import TrainState
from grpo_jax.models import lora
from grpo_jax.objective import losses
from grpo_jax.objective.config import GRPOConfig
from grpo_jax.objective.distill import TeacherConfig, distill_advantages, distill_metrics
from grpo_jax.objective.logprobs import (
    PackedRows,
    completion_logps,
    completion_logps_and_entropy,
    completion_logps_and_teacher_kl,
    packed_logps_and_entropy,
    packed_member,
    teacher_features,
)


class FrozenModels(NamedTuple):
    """The update's frozen parameters with a teacher (``teacher`` section): the reference's
    (None when beta = 0, with LoRA, or when it is the teacher's) and the teacher's (None when
    the teacher is the reference held as ``ref``, or LoRA's base). Without a teacher the
    update takes the reference's parameters alone."""

    ref: Any
    teacher: Any


def _split_rows(x, num_parts: int, shards: int):
    """[N, ...] -> [num_parts, N / num_parts, ...], each part drawing rows from every shard.

    The batch's leading dimension is split over ``shards`` devices; taking a
    part's rows from every shard (rather than one contiguous slice) keeps
    every device busy on every part.
    """
    n = x.shape[0]
    per = n // (shards * num_parts)
    y = x.reshape(shards, num_parts, per, *x.shape[1:])
    y = jnp.swapaxes(y, 0, 1)
    return y.reshape(num_parts, shards * per, *x.shape[1:])


def _join_rows(y, shards: int):
    """[num_parts, M, ...] -> [num_parts M, ...]: the inverse of :func:`_split_rows`."""
    num_parts, m = y.shape[:2]
    z = y.reshape(num_parts, shards, m // shards, *y.shape[2:])
    return jnp.swapaxes(z, 0, 1).reshape(num_parts * m, *y.shape[2:])


# grpo_loss's metrics that are means over the loss mask's tokens.
_TOKEN_MEANS = (
    "clip_frac_low",
    "clip_frac_high",
    "ratio_mean",
    "kl_mean",
    "entropy",
    "teacher_kl",
    "value_clip_frac",
)


def _combine(metrics_K: dict, tokens_K: jax.Array) -> dict:
    """One value per metric from its values over K parts (micro-batches or updates).

    ``tokens_K``: each part's tokens under the loss mask. A token mean is

        sum_k tokens_k v_k / sum_k tokens_k,

    so a part without tokens (rows of weight 0 alone) counts for nothing, and
    with no token at all the mean is NaN: no value this step (the writers, the
    progress line and the health rules skip it), not 0. ``ratio_min`` /
    ``ratio_max``: over the parts with tokens, 1.0 with none (no movement).
    Anything else (loss, grad_norm): the mean over the parts.
    """
    has_K = tokens_K > 0
    total = tokens_K.sum()
    out = {}
    for k, v_K in metrics_K.items():
        if k in _TOKEN_MEANS:
            mean = (jnp.where(has_K, v_K, 0.0) * tokens_K).sum() / jnp.where(total > 0, total, 1.0)
            out[k] = jnp.where(total > 0, mean, jnp.nan)
        elif k in ("ratio_min", "ratio_max"):
            reduce, empty = (jnp.min, jnp.inf) if k == "ratio_min" else (jnp.max, -jnp.inf)
            out[k] = jnp.where(has_K.any(), reduce(jnp.where(has_K, v_K, empty)), 1.0)
        else:
            out[k] = v_K.mean()
    return out


def _loss_mask(b: RolloutBatch):
    """mask_NxT * weights_N[:, None] (float32): the tokens the loss and the metrics see."""
    return b.mask_NxT * b.weights_N[..., None]


def _group_sizes(G: int, n: int, m: int, shards: int, grad_accum: int) -> tuple[int, int]:
    """(g_full, g_micro): G for the whole batch of ``n`` rows / a micro-batch of minibatch
    ``m``, where each shard's block of it holds a multiple of G rows, else 1.

    Groups stay whole and aligned in a part of the batch exactly then
    (``_split_rows`` takes blocks); G = 1 scores every row with its own prompt.
    """
    g_full = G if (n // shards) % G == 0 else 1
    g_micro = G if (m // (shards * grad_accum)) % G == 0 else 1
    return g_full, g_micro


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What the steps of :func:`update` share: its static arguments and what follows from them.

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
        (:func:`_packed_batch_logps`), and tokens the loss does not see are 0.
        """
        if self.packs is not None:
            return _packed_batch_logps(self, params, b, gdef)
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


def _prepare_batch(
    plan: _Plan, state: TrainState, batch: RolloutBatch, ref_params, old_logps, teacher=None
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
    the teacher (:func:`_teacher_model`), None without one.
    """
    objective = plan.objective
    mask_NxT = batch.mask_NxT.astype(jnp.float32)
    if old_logps == "recompute":
        old_NxT = jax.lax.stop_gradient(plan.logps(state.params, batch, plan.g_micro, replay=True))
        batch = batch.replace(old_logps_NxT=jnp.where(mask_NxT > 0, old_NxT, 0.0))
    behavior_w_NxT, behavior_metrics = losses.behavior_weights(
        batch.old_logps_NxT,
        batch.behavior_logps_NxT,
        _loss_mask(batch),
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


def _replay_metrics(plan: _Plan, params, batch: RolloutBatch) -> dict:
    """``moe/*`` (``grpo_jax.learner.replay``) at the parameters the step starts from."""
    return replay.own_route_metrics(
        plan.graphdef,
        params,
        jax.lax.stop_gradient(batch),
        _loss_mask(batch),
        plan.objective.temperature,
        chunk_size=plan.logits_chunk,
        group_size=plan.g_full,
    )


def _teacher_model(plan: _Plan, state: TrainState, ref_params, teacher_params):
    """(graphdef, params) of the teacher: its own, or for "reference" the reference's
    arrays (with LoRA the base inside the policy's, under the model without adapters;
    with beta = 0 the run's copy of the base, passed as the teacher's)."""
    if not plan.teacher.is_reference:
        return plan.teacher_graphdef or plan.graphdef, teacher_params
    if plan.use_lora:
        return plan.base_graphdef, lora.split(state.params)[0]
    return plan.graphdef, teacher_params if ref_params is None else ref_params


def _teacher_term(plan: _Plan, batch: RolloutBatch, teacher, ref_NxT):
    """(the teacher's part of the prepared batch or None, its ``teacher/*`` metrics).

    "sampled": D = -teacher.weight (log pi_old - log pi_teacher) on the loss mask's tokens
    (``grpo_jax.objective.distill``), with the reference's log-probs when it is the teacher
    and already scored. "full": the teacher's features [N, T, D] of the batch, whose LM
    head the loss runs beside the student's (:func:`_full_kl_loss`). Weight 0 is no
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
    mask_NxT = _loss_mask(batch)
    term_NxT = distill_advantages(batch.old_logps_NxT, teacher_NxT, mask_NxT, plan.teacher.weight)
    metrics = distill_metrics(
        batch.old_logps_NxT, teacher_NxT, mask_NxT, batch.advantages_N, term_NxT
    )
    return term_NxT, metrics


def _critic_targets(plan: _Plan, state: TrainState, batch: RolloutBatch):
    """The step's GAE targets (``critic.targets``) from the values the step starts from,
    scored once over the whole batch like pi_old's log-probs."""
    values_NxT = critic.values(
        plan.graphdef, state.params, state.critic, batch, group_size=plan.g_full
    )
    return critic.targets(
        plan.objective, batch.rewards_N, values_NxT, _loss_mask(batch), state.step
    )


def _loss(plan: _Plan, params, mb):
    """The GRPO loss of one (micro-)batch ``mb`` = (batch, ref_logps_NxT, behavior_w_NxT,
    distill_NxT).

    The completions are scored with their entropies in one pass
    (``completion_logps_and_entropy``); the loss mask is :func:`_loss_mask`.
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
        _loss_mask(b),
        plan.objective,
        ref_logps_NxT=ref_NxT,
        entropy_NxT=entropy_NxT,
        behavior_weights_NxT=w_NxT,
        distill_adv_NxT=d_NxT,
    )


def _full_kl_loss(plan: _Plan, params, mb, *, teacher):
    """:func:`_loss` with the full-vocabulary reverse KL to the teacher as a penalty:
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
    mask_NxT = _loss_mask(b).astype(jnp.float32)
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


def _critic_loss(plan: _Plan, params_and_head, mb):
    """:func:`_loss` with a value head: the policy term on the step's per-token GAE
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
        _loss_mask(b),
        plan.objective,
        ref_logps_NxT=ref_NxT,
        entropy_NxT=entropy_NxT,
        behavior_weights_NxT=w_NxT,
    )
    return critic.combined_loss(plan.objective, policy_loss, metrics, values_NxT, tg)


def _make_grad_fn(plan: _Plan, loss_fn=None):
    """Make the loss: grad_fn(trained, frozen, mb, key) -> ((loss, metrics), grads of trained).

    ``trained`` and ``frozen`` are :meth:`_Plan.partition`'s; the gradient is
    taken with respect to ``trained`` alone. LoRA dropout, when on, draws its
    masks from ``key``. ``loss_fn``: :func:`_loss` (default) or :func:`_packed_loss`.
    """
    loss_fn = loss_fn or (_critic_loss if plan.use_critic else _loss)

    def train_loss(trained, frozen, mb, k):
        if plan.use_critic:  # trained: {"policy": ..., "value": the head}
            params = (plan.join(frozen, trained["policy"]), trained["value"])
        else:
            params = plan.join(frozen, trained)
        return _with_dropout(plan, k, lambda: loss_fn(plan, params, mb))

    return jax.value_and_grad(train_loss, has_aux=True)


def _with_dropout(plan: _Plan, k, fn):
    """``fn()`` with LoRA dropout's masks drawn from ``k`` when it is on (and ``k`` given:
    the scoring passes outside the loss drop nothing)."""
    if k is None or not (plan.use_lora and plan.lora_dropout > 0):
        return fn()
    with lora.dropout(k, plan.lora_dropout):
        return fn()


def _accumulate(plan: _Plan, grad_fn, trained, frozen, mb, k_update):
    """A minibatch's loss, metrics and gradient, accumulated over A = ``plan.grad_accum`` parts.

        grad = sum_a w_a grad L_a,   w_a = tokens_a / sum_a' tokens_a'  ("token_mean")
                                     w_a = 1 / A                         (otherwise)

    Each micro-batch's share of the minibatch: its rows (1 / A) for the
    per-sequence reductions, its tokens for "token_mean", whose loss is a mean
    over all the minibatch's tokens. The loss is sum_a w_a L_a; token means in
    the metrics (KL, entropy, clip fractions) are weighted by tokens either way
    (:func:`_combine`). Micro-batch a's dropout key is ``k_update`` folded with a.
    """
    grad_accum = plan.grad_accum
    if grad_accum == 1:
        (loss, aux), grads = grad_fn(trained, frozen, mb, k_update)
        return loss, aux, grads
    micro = jax.tree.map(lambda x: _split_rows(x, grad_accum, plan.batch_shards), mb)
    tokens_A = _loss_mask(micro[0]).astype(jnp.float32).sum(axis=(1, 2))
    if plan.objective.reduction == "token_mean":
        w_A = tokens_A / jnp.maximum(tokens_A.sum(), 1.0)
    else:
        w_A = jnp.full((grad_accum,), 1.0 / grad_accum)

    def acc(carry, xs):
        mbi, w, a = xs
        k = jax.random.fold_in(k_update, a)
        (l_i, aux_i), g_i = grad_fn(trained, frozen, mbi, k)
        return jax.tree.map(lambda c, g: c + w * g, carry, g_i), (l_i, aux_i)

    zeros = jax.tree.map(jnp.zeros_like, trained)
    index_A = jnp.arange(grad_accum, dtype=jnp.int32)
    grads, (loss_A, aux_A) = jax.lax.scan(acc, zeros, (micro, w_A, index_A))
    return (loss_A * w_A).sum(), _combine(aux_A, tokens_A), grads


# ---------------------------------------------------------------------------
# Packed rows (docs/packing.md): the plan's micro-batches in place of equal parts of rows.

# Policy terms whose per-token values depend on every token of the minibatch together
# (their picks rank its tokens): packed, a minibatch of several micro-batches takes its
# gradient in two passes (:func:`_packed_two_pass`).
_WHOLE_MINIBATCH_TERMS = ("clip_cov", "kl_cov")


def _packed_minibatch_logps(plan: _Plan, params, b: RolloutBatch, packs_K, gdef=None, key=None):
    """(log pi, entropies) [M, T] of minibatch ``b``'s scored tokens, summed over its
    micro-batches ``packs_K`` (each token is scored in one of them; 0 elsewhere). An
    empty micro-batch is skipped. ``key``: LoRA dropout's, folded with the micro-batch."""
    zeros = jnp.zeros(b.tokens_NxT.shape, jnp.float32)

    def one(carry, xs):
        pack, a = xs

        def score(_):
            return _with_dropout(
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


def _packed_batch_logps(plan: _Plan, params, batch: RolloutBatch, gdef=None):
    """log pi [N, T] of the whole batch, minibatch by minibatch of the plan."""
    num = plan.packs.count.shape[0]
    parts = jax.tree.map(lambda x: _split_rows(x, num, plan.batch_shards), batch)

    def one(_, xs):
        part, packs_K = xs
        return None, _packed_minibatch_logps(plan, params, part, packs_K, gdef)[0]

    _, lp_UxMxT = jax.lax.scan(one, None, (parts, plan.packs))
    return _join_rows(lp_UxMxT, plan.batch_shards)


def _packed_loss(plan: _Plan, params, mb):
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
        _loss_mask(b) * packed_member(pack, n, t),
        plan.objective,
        ref_logps_NxT=ref_NxT,
        entropy_NxT=entropy_NxT,
        behavior_weights_NxT=w_NxT,
        whole=whole,
        distill_adv_NxT=d_NxT,
    )


def _packed_accumulate(plan: _Plan, grad_fn, trained, frozen, mb, packs_K, k_update):
    """A minibatch's loss, metrics and gradient from its packed micro-batches.

        L = sum_k L_k,   grad = sum_k grad L_k

    where L_k (:func:`_packed_loss`) is the minibatch's loss restricted to micro-batch
    k's tokens and divided by the minibatch's counts, so that L is the loss of the
    whole minibatch for every reduction. An empty micro-batch (the plan rounds their
    count up) is skipped. The policy terms that rank the whole minibatch's tokens take
    :func:`_packed_two_pass` instead.
    """
    b = mb[0]
    k = packs_K.count.shape[0]
    if plan.objective.policy_loss in _WHOLE_MINIBATCH_TERMS and k > 1:
        return _packed_two_pass(plan, trained, frozen, mb, packs_K, k_update)
    mask_NxT = _loss_mask(b).astype(jnp.float32)
    whole = losses.Whole(mask_NxT.sum(), (mask_NxT.sum(axis=1) > 0).sum().astype(jnp.float32))

    def acc(carry, xs):
        pack, a = xs
        key = jax.random.fold_in(k_update, a)
        run = lambda _: grad_fn(trained, frozen, (*mb, pack, whole), key)
        empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(run, None))
        (l_k, aux_k), g_k = jax.lax.cond(pack.count > 0, run, lambda _: empty, None)
        return jax.tree.map(jnp.add, carry, g_k), (l_k, aux_k)

    zeros = jax.tree.map(jnp.zeros_like, trained)
    index_K = jnp.arange(k, dtype=jnp.int32)
    grads, (loss_K, aux_K) = jax.lax.scan(acc, zeros, (packs_K, index_K))
    return loss_K.sum(), _combine(aux_K, packs_K.count.astype(jnp.float32)), grads


def _packed_two_pass(plan: _Plan, trained, frozen, mb, packs_K, k_update):
    """:func:`_packed_accumulate` for a loss that is no sum over micro-batches.

    A forward pass over the micro-batches scores the minibatch's tokens l; the loss of
    the whole minibatch, the padded update's, gives g = dL/dl; a second pass takes
    each micro-batch's vector-Jacobian product with g, whose sum is dL/dtheta. One
    forward pass more than :func:`_packed_accumulate`.
    """
    b, ref_NxT, w_NxT, d_NxT = mb
    params = plan.join(frozen, trained)
    logps_NxT, entropy_NxT = _packed_minibatch_logps(plan, params, b, packs_K, key=k_update)

    def loss_of(l_NxT):
        return losses.grpo_loss(
            l_NxT,
            b.old_logps_NxT,
            b.advantages_N,
            _loss_mask(b),
            plan.objective,
            ref_logps_NxT=ref_NxT,
            entropy_NxT=entropy_NxT,
            behavior_weights_NxT=w_NxT,
            distill_adv_NxT=d_NxT,
        )

    (loss, aux), g_NxT = jax.value_and_grad(loss_of, has_aux=True)(jax.lax.stop_gradient(logps_NxT))

    def back(carry, xs):
        pack, a = xs

        def vjp(_):
            def f(tr):
                return _with_dropout(
                    plan,
                    jax.random.fold_in(k_update, a),
                    lambda: packed_logps_and_entropy(
                        plan.graphdef,
                        plan.join(frozen, tr),
                        b.prompt_tokens_NxP,
                        b.tokens_NxT,
                        pack,
                        plan.objective.temperature,
                        chunk_size=plan.logits_chunk,
                    )[0],
                )

            return jax.vjp(f, trained)[1](g_NxT)[0]

        g_k = jax.lax.cond(
            pack.count > 0, vjp, lambda _: jax.tree.map(jnp.zeros_like, trained), None
        )
        return jax.tree.map(jnp.add, carry, g_k), None

    index_K = jnp.arange(packs_K.count.shape[0], dtype=jnp.int32)
    zeros = jax.tree.map(jnp.zeros_like, trained)
    grads, _ = jax.lax.scan(back, zeros, (packs_K, index_K))
    return loss, aux, grads


def _one_update(plan: _Plan, grad_fn, key, st: TrainState, mb):
    """One optimizer update on minibatch ``mb``, guarded (``optimizer.apply_guarded``).

    Returns the new state and the update's metrics: the loss's, loss,
    grad_norm, lr and tokens (under the loss mask, for :func:`_combine`).
    The dropout key is ``key`` folded with the update counter.
    """
    trained, frozen = plan.partition(st.params)
    if plan.use_critic:
        trained = {"policy": trained, "value": st.critic}
    k_update = jax.random.fold_in(key, st.updates)
    if plan.packs is None:
        loss, aux, grads = _accumulate(plan, grad_fn, trained, frozen, mb, k_update)
    else:
        mb, packs_K = mb
        loss, aux, grads = _packed_accumulate(plan, grad_fn, trained, frozen, mb, packs_K, k_update)
    lr = plan.schedule(st.updates)
    st, grad_norm, _ = optimizer.apply_guarded(st.replace(params=trained), grads, loss, plan.tx)
    if plan.use_critic:
        st = st.replace(params=st.params["policy"], critic=st.params["value"])
    if frozen is not None:
        st = st.replace(params=plan.join(frozen, st.params))
    tokens = _loss_mask(mb[0]).astype(jnp.float32).sum()
    metrics = dict(aux, loss=loss, grad_norm=grad_norm, lr=lr, tokens=tokens)
    return st, metrics


def _one_pass(one_update, state: TrainState, parts):
    """One pass over the batch: an update per minibatch of ``parts``, in order (a scan).

    ``parts``: the batch split into N / M minibatches (:func:`_split_rows`),
    each drawing rows from every shard. Returns the state and the metrics of
    the pass's updates, each [N / M].
    """
    return jax.lax.scan(one_update, state, parts)


def _passes(
    one_update,
    state: TrainState,
    prepared,
    num_minibatches: int,
    shards: int,
    mu: int,
    packs: PackedRows | None = None,
):
    """mu passes (:func:`_one_pass`) over the prepared batch, against the same pi_old.

    ``prepared`` (the batch, the reference log-probs and the behaviour weights)
    is split into ``num_minibatches`` parts of rows from every one of
    ``shards`` shards; the passes are unrolled (mu is small and static).
    Packed, each part goes with its minibatch's micro-batches (``packs``).
    Returns the state and the metrics of all U = mu N / M updates, each [U].
    """
    parts = jax.tree.map(lambda x: _split_rows(x, num_minibatches, shards), prepared)
    if packs is not None:
        parts = (parts, packs)
    all_metrics = []
    for _ in range(mu):
        state, m_U = _one_pass(one_update, state, parts)
        all_metrics.append(m_U)
    m_U = jax.tree.map(lambda *xs: jnp.concatenate([jnp.atleast_1d(x) for x in xs]), *all_metrics)
    return state, m_U


def _reduce_metrics(m_U: dict, state: TrainState, skipped_before) -> dict:
    """The step's ``train/*`` metrics from its updates' (:func:`_combine`) and the counters.

    ``train/kl`` is the loss's kl_mean; ``train/lr`` the last update's rate;
    ``train/skipped_updates`` those this step dropped (``skipped_before``: the
    count it started from).
    """
    m_U = dict(m_U)
    lr_U, tokens_U = m_U.pop("lr"), m_U.pop("tokens")
    metrics = {f"train/{k}": v for k, v in _combine(m_U, tokens_U).items()}
    if "train/kl_mean" in metrics:
        metrics["train/kl"] = metrics.pop("train/kl_mean")
    if "train/teacher_kl" in metrics:  # the full-vocabulary KL to the teacher, in the loss
        metrics["teacher/kl"] = metrics.pop("train/teacher_kl")
    metrics["train/lr"] = lr_U[-1]
    metrics["train/skipped_updates"] = state.skipped - skipped_before
    metrics["train/skipped_total"] = state.skipped
    metrics["train/skipped_in_row"] = state.skipped_in_row
    metrics["train/updates"] = state.updates
    return metrics


def _loss_fn(plan: _Plan, packs, teacher):
    """The loss of the update's (micro-)batches: :func:`_loss`, :func:`_packed_loss` with
    ``packs``, :func:`_critic_loss` with a value head, or :func:`_full_kl_loss` with a
    teacher's full-vocabulary KL."""
    if plan.use_critic:  # neither packing nor a teacher combines with it (run.config)
        return _critic_loss
    full = plan.teacher is not None and plan.teacher.weight > 0 and plan.teacher.kl == "full"
    if full and packs is not None:
        raise ValueError("teacher.kl = 'full' does not combine with packed rows")
    if full:
        return functools.partial(_full_kl_loss, teacher=teacher)
    return _loss if packs is None else _packed_loss


def _policy_movement(plan: _Plan, params, batch: RolloutBatch) -> dict:
    """How far one step moved the policy (now ``params``) on its own samples: ``policy/*``.

    KL(pi_old || pi_new) by the k3 estimator with samples from pi_old,

        log r_t = log pi_new - log pi_old,   kl_old_new = mean_t (exp(log r_t) - log r_t - 1),

    the mean of |log r_t| and the range of r_t, over the loss mask's tokens.
    """
    new_NxT = jax.lax.stop_gradient(plan.logps(params, batch, plan.g_full, replay=True))
    mask_NxT = _loss_mask(batch).astype(jnp.float32)
    log_r_NxT = jnp.where(mask_NxT > 0, new_NxT - batch.old_logps_NxT, 0.0)
    denom = jnp.maximum(mask_NxT.sum(), 1.0)
    k3_NxT = jnp.exp(log_r_NxT) - log_r_NxT - 1.0
    return {
        "policy/kl_old_new": (k3_NxT * mask_NxT).sum() / denom,
        "policy/ratio_max": jnp.max(jnp.where(mask_NxT > 0, jnp.exp(log_r_NxT), 0.0)),
        "policy/ratio_min": jnp.min(jnp.where(mask_NxT > 0, jnp.exp(log_r_NxT), jnp.inf)),
        "policy/abs_log_ratio_mean": (jnp.abs(log_r_NxT) * mask_NxT).sum() / denom,
    }


def _check_replay(plan: _Plan, batch: RolloutBatch, packs) -> None:
    """Routing replay needs the batch's routes and the padded, critic-free loss whose passes
    take them (the run's config refuses the rest: grpo_jax.run.config)."""
    if batch.routes_NxSxRxK is None:
        raise ValueError("grpo.router_replay = 'rollout' needs a batch with its routes")
    full = plan.teacher is not None and plan.teacher.weight > 0 and plan.teacher.kl == "full"
    if packs is not None or plan.use_critic or full:
        raise ValueError(
            "grpo.router_replay = 'rollout' does not combine with packed rows, a critic or "
            "teacher.kl = 'full' yet"
        )


def update(
    state: TrainState,
    batch: RolloutBatch,
    key: jax.Array,
    ref_params=None,
    packs: PackedRows | None = None,
    *,
    graphdef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    grpo: GRPOConfig,
    minibatch_size: int,
    grad_accum: int,
    batch_shards: int,
    track_update: bool,
    logits_chunk: int = 0,
    share_prompts: bool = False,
    base_graphdef=None,
    lora_dropout: float = 0.0,
    teacher: TeacherConfig | None = None,
    teacher_graphdef=None,
):
    """mu passes over the batch, one optimizer update per minibatch (see module doc).

    The steps: prepare the batch (:func:`_prepare_batch`), make the loss
    (:func:`_make_grad_fn`), the mu passes (:func:`_passes`) of one update per
    minibatch of M = ``minibatch_size`` rows (0: all N) (:func:`_one_update`,
    its gradient accumulated over A = ``grad_accum`` micro-batches by
    :func:`_accumulate`), and reduce the metrics (:func:`_reduce_metrics`,
    :func:`_policy_movement`). ``key`` is used only by LoRA dropout (the update
    is otherwise deterministic); ``logits_chunk`` > 0 scores the completions in
    chunks of that many tokens (``grpo_jax.objective.logprobs.completion_logps_and_entropy``);
    ``share_prompts`` and LoRA (``base_graphdef``, ``lora_dropout``): :class:`_Plan`.

    ``packs`` (``grpo_jax.learner.packing.plan_packs``'s plan of this batch): every
    forward pass runs on packed rows, micro-batch by micro-batch of the plan, in place
    of ``grad_accum`` equal parts of rows (docs/packing.md); the minibatches, and the
    loss as a function of the batch, are the same.

    ``teacher`` (an enabled ``teacher`` section) and ``teacher_graphdef`` (its model, None:
    the policy's): on-policy distillation; ``ref_params`` is then a :class:`FrozenModels`.

    Metrics: ``train/*`` (loss, grad_norm, lr, clip fractions, ratios, kl,
    entropy, update counters), ``behavior/*``, ``teacher/*`` with a teacher and, with
    ``track_update``, ``policy/*``: how far the step moved the policy on its own samples.
    """
    n = batch.num_rows
    m = n if minibatch_size == 0 else minibatch_size
    g_full, g_micro = _group_sizes(grpo.G if share_prompts else 1, n, m, batch_shards, grad_accum)
    plan = _Plan(
        graphdef=graphdef,
        base_graphdef=base_graphdef,
        tx=tx,
        schedule=schedule,
        objective=grpo,
        logits_chunk=logits_chunk,
        grad_accum=grad_accum,
        batch_shards=batch_shards,
        g_full=g_full,
        g_micro=g_micro,
        lora_dropout=lora_dropout,
        packs=packs,
        teacher=teacher,
        teacher_graphdef=teacher_graphdef,
    )
    if plan.replay:
        _check_replay(plan, batch, packs)
    teacher_model = None
    if plan.teacher is not None:
        ref_params, teacher_params = ref_params
        teacher_model = _teacher_model(plan, state, ref_params, teacher_params)
    prepared, behavior_metrics = _prepare_batch(
        plan, state, batch, ref_params, grpo.old_logps, teacher_model
    )
    grad_fn = _make_grad_fn(plan, _loss_fn(plan, packs, teacher_model))
    one_update = functools.partial(_one_update, plan, grad_fn, key)
    skipped_before = state.skipped
    state, m_U = _passes(one_update, state, prepared, n // m, batch_shards, grpo.mu, packs)
    metrics = _reduce_metrics(m_U, state, skipped_before) | behavior_metrics
    if plan.replay:  # the first update's ratio, at the parameters that scored pi_old
        first = jnp.maximum(m_U["ratio_max"][0] - 1.0, 1.0 - m_U["ratio_min"][0])
        metrics["moe/first_ratio_dev"] = first
    if track_update:
        metrics.update(_policy_movement(plan, state.params, prepared[0]))
    return state.replace(step=state.step + 1), metrics


def jit_update(
    *,
    graphdef,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    grpo: GRPOConfig,
    minibatch_size: int,
    grad_accum: int,
    batch_shards: int,
    track_update: bool,
    state_shardings,
    batch_shardings: RolloutBatch,
    ref_shardings,
    replicated,
    logits_chunk: int = 0,
    share_prompts: bool = False,
    base_graphdef=None,
    lora_dropout: float = 0.0,
    teacher: TeacherConfig | None = None,
    teacher_graphdef=None,
):
    """:func:`update` bound to its static configuration and jitted with shardings.

    ``batch_shardings`` is a RolloutBatch of shardings (:func:`rollout_batch_shardings`);
    ``ref_shardings`` those of the reference parameters (None when beta = 0; a
    :class:`FrozenModels` of the reference's and the teacher's with a teacher);
    ``replicated`` the sharding of the key and the metrics, on the run's mesh. The update
    is traced, lowered and called under that mesh (``sharding.OnMesh``), so each device
    keeps its rows through the scoring passes and the micro-batches: traced without it,
    the model's activation constraints did nothing and GSPMD split the activations like
    the fsdp parameters, over the model width, so every device computed every row and
    all-reduced it (docs/pods.md: 13.4 GiB per chip for the Qwen2.5-0.5B recipe's update
    on a v5e-16, 5.8 with rows split).
    """
    fn = functools.partial(
        update,
        graphdef=graphdef,
        tx=tx,
        schedule=schedule,
        grpo=grpo,
        minibatch_size=minibatch_size,
        grad_accum=grad_accum,
        batch_shards=batch_shards,
        track_update=track_update,
        logits_chunk=logits_chunk,
        share_prompts=share_prompts,
        base_graphdef=base_graphdef,
        lora_dropout=lora_dropout,
        teacher=teacher,
        teacher_graphdef=teacher_graphdef,
    )
    jitted = jax.jit(
        fn,
        in_shardings=(state_shardings, batch_shardings, replicated, ref_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnames=("state",),
    )
    return sharding.OnMesh(jitted, replicated.mesh)


# ---------------------------------------------------------------------------
# The first step: the update compiled while the sampler compiles and runs.


def _signature(args):
    leaves, treedef = jax.tree.flatten(args)
    return treedef, [(x.shape, x.dtype, x.sharding) for x in leaves]


class CompiledAhead:
    """A jitted function compiled for one argument signature in a background thread.

    The first step of a run compiles the sampler, samples, then compiles the
    update. ``CompiledAhead(update, state, batch_spec(...), key, ref)`` starts
    the update's tracing and compilation at once, so they overlap the
    sampler's (XLA compiles with the interpreter lock released, on another
    core where there is one) and its sampling. Calling it with arguments of
    that signature (shapes, dtypes, shardings) runs the compiled executable;
    any other call, or a failed compilation, goes to the jitted function
    itself, which then compiles (or raises) as usual.

    It is a context manager: leaving it waits for the compilation and its
    thread, so no tracing of a run's update goes on after the run has ended
    (a run that stops before its first update would otherwise leave a thread
    tracing while the caller starts the next run, or changes what it traces).
    """

    def __init__(self, jitted, *args):
        import concurrent.futures

        self._jitted = jitted
        self._signature = _signature(args)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-update")
        self._future = self._pool.submit(lambda: jitted.lower(*args).compile())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Waits for the compilation (its error, if any, is the jitted call's to raise)."""
        self._pool.shutdown(wait=True)

    def __call__(self, *args):
        if _signature(args) == self._signature:
            try:
                compiled = self._future.result()
            except Exception:  # noqa: BLE001 - the jitted call below raises it with context
                compiled = None
            if compiled is not None:
                return compiled(*args)
        return self._jitted(*args)
