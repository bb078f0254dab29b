"""The jitted GRPO update: mu passes over a rollout batch in minibatches, guarded.

Shapes: N completion rows (B prompts x G, grouped contiguously), P padded
prompt length, T completion length, U optimizer updates per step (mu * N / M
for minibatches of M rows), A gradient-accumulation micro-batches per update.

``update(state, batch, key, ref_params) -> (state, metrics)`` is pure, compiled once with
explicit shardings and ``state`` donated (:func:`jit_update`); pi_old's log-probs come with the
``grpo_jax.core.batch.RolloutBatch``, and each update passes the non-finite guard. Its parts:
docs/architecture.md, "update"; pi_old, row weights, behaviour correction: docs/objective.md.
The parts live beside it: the rows split into parts (``grpo_jax.learner.rows``), the step's
plan and log-prob passes (``step``), the batch prepared and the losses (``terms``), the
gradient accumulated (``accumulate``), the first step compiled ahead (``ahead``).
With ``packs`` (``grpo_jax.learner.packing``) every pass runs on packed rows: docs/packing.md.
"""

from __future__ import annotations

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
from grpo_jax.learner import optimizer
from grpo_jax.learner.accumulate import accumulate, packed_accumulate
from grpo_jax.learner.optimizer import TrainState
from grpo_jax.learner.rows import combine, group_sizes, loss_mask, split_rows
from grpo_jax.learner.step import StepPlan
from grpo_jax.learner.terms import choose_loss, make_grad_fn, prepare_batch, teacher_of
from grpo_jax.objective.config import GRPOConfig
from grpo_jax.objective.distill import TeacherConfig
from grpo_jax.objective.logprobs import (
    PackedRows,
)


class FrozenModels(NamedTuple):
    """The update's frozen parameters with a teacher (``teacher`` section): the reference's
    (None when beta = 0, with LoRA, or when it is the teacher's) and the teacher's (None when
    the teacher is the reference held as ``ref``, or LoRA's base). Without a teacher the
    update takes the reference's parameters alone."""

    ref: Any
    teacher: Any


def _one_update(plan: StepPlan, grad_fn, key, st: TrainState, mb):
    """One optimizer update on minibatch ``mb``, guarded (``optimizer.apply_guarded``).

    Returns the new state and the update's metrics: the loss's, loss,
    grad_norm, lr and tokens (under the loss mask, for :func:`combine`).
    The dropout key is ``key`` folded with the update counter.
    """
    trained, frozen = plan.partition(st.params)
    if plan.use_critic:
        trained = {"policy": trained, "value": st.critic}
    k_update = jax.random.fold_in(key, st.updates)
    if plan.packs is None:
        loss, aux, grads = accumulate(plan, grad_fn, trained, frozen, mb, k_update)
    else:
        mb, packs_K = mb
        loss, aux, grads = packed_accumulate(plan, grad_fn, trained, frozen, mb, packs_K, k_update)
    lr = plan.schedule(st.updates)
    st, grad_norm, _ = optimizer.apply_guarded(st.replace(params=trained), grads, loss, plan.tx)
    if plan.use_critic:
        st = st.replace(params=st.params["policy"], critic=st.params["value"])
    if frozen is not None:
        st = st.replace(params=plan.join(frozen, st.params))
    tokens = loss_mask(mb[0]).astype(jnp.float32).sum()
    metrics = dict(aux, loss=loss, grad_norm=grad_norm, lr=lr, tokens=tokens)
    return st, metrics


def _one_pass(one_update, state: TrainState, parts):
    """One pass over the batch: an update per minibatch of ``parts``, in order (a scan).

    ``parts``: the batch split into N / M minibatches (:func:`split_rows`),
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
    parts = jax.tree.map(lambda x: split_rows(x, num_minibatches, shards), prepared)
    if packs is not None:
        parts = (parts, packs)
    all_metrics = []
    for _ in range(mu):
        state, m_U = _one_pass(one_update, state, parts)
        all_metrics.append(m_U)
    m_U = jax.tree.map(lambda *xs: jnp.concatenate([jnp.atleast_1d(x) for x in xs]), *all_metrics)
    return state, m_U


def _reduce_metrics(m_U: dict, state: TrainState, skipped_before) -> dict:
    """The step's ``train/*`` metrics from its updates' (:func:`combine`) and the counters.

    ``train/kl`` is the loss's kl_mean; ``train/lr`` the last update's rate;
    ``train/skipped_updates`` those this step dropped (``skipped_before``: the
    count it started from).
    """
    m_U = dict(m_U)
    lr_U, tokens_U = m_U.pop("lr"), m_U.pop("tokens")
    metrics = {f"train/{k}": v for k, v in combine(m_U, tokens_U).items()}
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


def _policy_movement(plan: StepPlan, params, batch: RolloutBatch) -> dict:
    """How far one step moved the policy (now ``params``) on its own samples: ``policy/*``.

    KL(pi_old || pi_new) by the k3 estimator with samples from pi_old,

        log r_t = log pi_new - log pi_old,   kl_old_new = mean_t (exp(log r_t) - log r_t - 1),

    the mean of |log r_t| and the range of r_t, over the loss mask's tokens.
    """
    new_NxT = jax.lax.stop_gradient(plan.logps(params, batch, plan.g_full, replay=True))
    mask_NxT = loss_mask(batch).astype(jnp.float32)
    log_r_NxT = jnp.where(mask_NxT > 0, new_NxT - batch.old_logps_NxT, 0.0)
    denom = jnp.maximum(mask_NxT.sum(), 1.0)
    k3_NxT = jnp.exp(log_r_NxT) - log_r_NxT - 1.0
    return {
        "policy/kl_old_new": (k3_NxT * mask_NxT).sum() / denom,
        "policy/ratio_max": jnp.max(jnp.where(mask_NxT > 0, jnp.exp(log_r_NxT), 0.0)),
        "policy/ratio_min": jnp.min(jnp.where(mask_NxT > 0, jnp.exp(log_r_NxT), jnp.inf)),
        "policy/abs_log_ratio_mean": (jnp.abs(log_r_NxT) * mask_NxT).sum() / denom,
    }


def _check_replay(plan: StepPlan, batch: RolloutBatch, packs) -> None:
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

    The steps: prepare the batch (:func:`prepare_batch`), make the loss
    (:func:`make_grad_fn`), the mu passes (:func:`_passes`) of one update per
    minibatch of M = ``minibatch_size`` rows (0: all N) (:func:`_one_update`,
    its gradient accumulated over A = ``grad_accum`` micro-batches by
    :func:`accumulate`), and reduce the metrics (:func:`_reduce_metrics`,
    :func:`_policy_movement`). ``key`` is used only by LoRA dropout (the update
    is otherwise deterministic); ``logits_chunk`` > 0 scores the completions in
    chunks of that many tokens (``grpo_jax.objective.logprobs.completion_logps_and_entropy``);
    ``share_prompts`` and LoRA (``base_graphdef``, ``lora_dropout``): :class:`StepPlan`.

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
    g_full, g_micro = group_sizes(grpo.G if share_prompts else 1, n, m, batch_shards, grad_accum)
    plan = StepPlan(
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
        teacher_model = teacher_of(plan, state, ref_params, teacher_params)
    prepared, behavior_metrics = prepare_batch(
        plan, state, batch, ref_params, grpo.old_logps, teacher_model
    )
    grad_fn = make_grad_fn(plan, choose_loss(plan, packs, teacher_model))
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
