"""The optimizer and its state: clipped AdamW on a schedule, guarded against non-finite steps.

    tx, schedule = make_optimizer(cfg, total_updates)
    state = init_state(params, tx, mesh)
    state, grad_norm, finite = apply_guarded(state, grads, loss, tx)

The GRPO update and the supervised warm start both step through :func:`apply_guarded`, which
drops an update whose loss or gradient norm is not finite inside the jitted step (parameters
and optimizer state keep their values bit for bit) and counts it (docs/architecture.md,
"update").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from grpo_jax.core import distributed
from grpo_jax.core.checks import check_choice, check_range

SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm gradient clipping and a warmup + decay schedule.

    Attributes:
      learning_rate: peak learning rate.
      schedule: "constant", "cosine" or "linear" decay after warmup, to
        ``learning_rate * end_lr_factor`` at the last update.
      warmup_steps: optimizer updates of linear warmup from 0.
      end_lr_factor: final learning rate as a fraction of the peak.
      b1, b2, eps: Adam moments.
      weight_decay: decoupled weight decay (AdamW).
      max_grad_norm: clip the global gradient norm to this; 0 switches it off.
      grad_accum: micro-batches whose gradients are averaged per update (the
        minibatch is split into this many equal parts: less memory, same
        update for the "grpo" reduction).
    """

    learning_rate: float = 3e-4
    schedule: str = "constant"
    warmup_steps: int = 0
    end_lr_factor: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    grad_accum: int = 1

    def __post_init__(self):
        check_range("optim.learning_rate", self.learning_rate, lo=0.0, lo_open=True)
        check_choice("optim.schedule", self.schedule, SCHEDULES)
        check_range("optim.warmup_steps", self.warmup_steps, lo=0, integer=True)
        check_range("optim.end_lr_factor", self.end_lr_factor, lo=0.0, hi=1.0)
        check_range("optim.b1", self.b1, lo=0.0, hi=1.0)
        check_range("optim.b2", self.b2, lo=0.0, hi=1.0)
        check_range("optim.eps", self.eps, lo=0.0, lo_open=True)
        check_range("optim.weight_decay", self.weight_decay, lo=0.0)
        check_range("optim.max_grad_norm", self.max_grad_norm, lo=0.0)
        check_range("optim.grad_accum", self.grad_accum, lo=1, integer=True)


@flax.struct.dataclass
class TrainState:
    """Everything the update changes; donated to the step and returned anew."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32 []: steps taken (GRPO steps, or warm-start steps)
    updates: jax.Array  # int32 []: optimizer updates applied (the schedule's clock)
    skipped: jax.Array  # int32 []: updates dropped as non-finite, in total
    skipped_in_row: jax.Array  # int32 []: ... since the last applied update
    # PPO's value head (grpo_jax.learner.critic), trained beside the policy; None without one.
    critic: Any = None


def init_state(
    params, tx: optax.GradientTransformation, mesh=None, trained=None, critic=None
) -> TrainState:
    """A fresh state; with a mesh every leaf is committed to a NamedSharding on it.

    ``trained``: the part of ``params`` the optimizer updates (LoRA's adapters,
    ``grpo_jax.models.lora.trainable``); None: all of them. ``critic``: a value head's
    parameters (``grpo_jax.learner.critic``); the optimizer then updates
    ``{"policy": trained, "value": critic}``, one clipped AdamW over both.

    Each optimizer moment is made with the sharding of the parameter it follows
    (:func:`opt_state_shardings`) and the optimizer's scalars are replicated, so
    the state that goes in has the shardings of the state that comes out of the
    jitted step (a mismatch would compile the step twice).
    """
    target = params if trained is None else trained
    if critic is not None:
        target = {"policy": target, "value": critic}
    out = None if mesh is None else opt_state_shardings(tx, target, mesh)
    opt_state = jax.jit(tx.init, out_shardings=out)(target)
    # Four distinct buffers: the state is donated, and one buffer may not be donated twice.
    zeros = [jnp.zeros((), jnp.int32) for _ in range(4)]
    state = TrainState(params, opt_state, *zeros, critic=critic)
    if mesh is not None:
        rep = NamedSharding(mesh, P())
        state = jax.tree.map(
            lambda x: x if isinstance(x.sharding, NamedSharding) else distributed.put(x, rep),
            state,
        )
    return state


def saved_opt_state(state: TrainState):
    """What a checkpoint saves as the optimizer state: with a critic, its parameters too."""
    if state.critic is None:
        return state.opt_state
    return {"optimizer": state.opt_state, "critic": state.critic}


def with_saved_opt_state(state: TrainState, saved) -> TrainState:
    """``state`` with what :func:`saved_opt_state` saved, restored."""
    if state.critic is None:
        return state.replace(opt_state=saved)
    return state.replace(opt_state=saved["optimizer"], critic=saved["critic"])


def opt_state_shardings(tx: optax.GradientTransformation, params, mesh):
    """The shardings of ``tx.init(params)``: each moment its parameter's, the rest replicated.

    ``tx.init`` never reads the parameters' values (the moments are zeros of their
    shape), so a plain ``jax.jit(tx.init)`` drops them as inputs, makes the zeros on one
    device and replicates every moment: 8 bytes per parameter on every device, which
    defeats fsdp. The shardings are given explicitly instead, mapped over the copies of
    the parameter tree inside the state (``optax.tree_map_params``).
    """
    rep = NamedSharding(mesh, P())
    param_sh = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else rep, params
    )
    abstract = jax.eval_shape(tx.init, params)
    return optax.tree_map_params(
        tx, lambda _, sh: sh, abstract, param_sh, transform_non_params=lambda _: rep
    )


def lr_schedule(cfg: OptimConfig, total_updates: int) -> optax.Schedule:
    """Linear warmup from 0 to the peak, then constant, cosine or linear decay.

    With peak = ``learning_rate``, end = peak * ``end_lr_factor``, W warmup
    updates and K = max(total_updates - W - 1, 1) decay updates, update u runs at

        u < W:   peak * u / W
        u >= W:  peak (constant), end + (peak - end) (1 + cos(pi s)) / 2 (cosine),
                 or peak + (end - peak) s (linear), s = min((u - W) / K, 1)

    so the last update (u = total_updates - 1) runs at the end value.
    """
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.end_lr_factor
    decay_steps = max(total_updates - cfg.warmup_steps - 1, 1)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(peak)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.end_lr_factor)
    else:
        after = optax.linear_schedule(peak, end, decay_steps)
    if cfg.warmup_steps == 0:
        return after
    warm = optax.linear_schedule(0.0, peak, cfg.warmup_steps)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig, total_updates: int):
    """(optax transformation, schedule): clip the global norm, then AdamW.

        g <- g * min(1, max_grad_norm / ||g||)        (when max_grad_norm > 0)
        m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
        theta <- theta - lr(u) (m_hat / (sqrt(v_hat) + eps) + weight_decay theta)

    with m_hat, v_hat the bias-corrected moments and lr(u) :func:`lr_schedule`.
    """
    schedule = lr_schedule(cfg, total_updates)
    parts = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    parts.append(
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)
    )
    return optax.chain(*parts), schedule


def apply_guarded(state: TrainState, grads, loss, tx: optax.GradientTransformation):
    """One optimizer update of ``state`` by ``grads``, dropped when it is not finite.

    finite = isfinite(loss) and isfinite(||grads||). When finite, the
    parameters and optimizer state take ``tx``'s update, ``updates`` counts
    one more and ``skipped_in_row`` resets to 0; otherwise parameters and
    optimizer state keep their values bit for bit, and ``skipped`` and
    ``skipped_in_row`` count one more. ``state.step`` is the caller's.

    Returns:
      (state, grad_norm, finite): the global gradient norm ||grads|| and the
      bool [] that decided.
    """
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

    def apply(params_opt):
        params, opt_state = params_opt
        upd, new_opt = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), new_opt

    # A branch, not a select over the results: the skip costs nothing on
    # the common path, where selecting new-or-old over params and both
    # Adam moments took three extra passes over the state (20M
    # parameters, 1 CPU thread: 120 -> 77 ms per update).
    new_params, new_opt = jax.lax.cond(
        finite, apply, lambda params_opt: params_opt, (state.params, state.opt_state)
    )
    state = state.replace(
        params=new_params,
        opt_state=new_opt,
        updates=state.updates + finite.astype(jnp.int32),
        skipped=state.skipped + (~finite).astype(jnp.int32),
        skipped_in_row=jnp.where(finite, 0, state.skipped_in_row + 1),
    )
    return state, grad_norm, finite
