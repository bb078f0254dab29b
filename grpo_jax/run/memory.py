"""Per-device memory plan of a GRPO run, and an early refusal of layouts that cannot fit.

Parameter tensors are read from the model itself (``grpo_jax.models.param_tensors``: an
abstract model, nothing allocated) and sharded as ``grpo_jax.models.param_shardings`` shards
them; gradients, optimizer state, reference, KV cache and activations follow by formula.
:func:`estimate` gives the model's terms (``grpo_jax.run.memory_model``), the run's terms
beside them come from ``grpo_jax.run.memory_terms``, :func:`plan_run` gives a run's peaks and
:func:`plan_programs` each compiled program's figure. The estimate refuses layouts that cannot
fit; it is not for tuning. docs/recipes.md, "The formulas", has them; docs/pods.md compares
them with XLA's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

# The parameter inventory lived here: param_tensors, param_count, shard_numel and
# lora_tensors are still importable from this module.
from grpo_jax.models.param_tensors import (  # noqa: F401
    as_model_config,
    lora_tensors,
    param_count,
    param_tensors,
    shard_numel,
    tensor_ways,
)

# The model's terms and the run's, importable from here as before they had modules of
# their own.
from grpo_jax.run.memory_model import (  # noqa: F401
    COMPONENTS,
    OPTIMIZER_MOMENTS,
    PLAN_AXES,
    MemoryBudgetError,
    MemoryEstimate,
    check_budget,
    device_memory_bytes,
    estimate,
    format_bytes,
    itemsize,
    moe_token_bytes,
    numel_per_device,
    plan,
)
from grpo_jax.run.memory_terms import (  # noqa: F401
    CODE_BYTES,
    STATE_BYTES_PER_TOKEN,
    ProgramPlan,
    RunShapes,
    attention_per_row,
    batch_bytes,
    layer_token_bytes,
    model_sizes,
    run_shapes,
    scoring_bytes,
    with_run_terms,
)
from grpo_jax.sampling import paged_pool
from grpo_jax.sampling.engines import get_engine
from grpo_jax.sampling.weights import copy_dtype


def plan_run(
    run,
    model_cfg_like,
    mesh_shape: Mapping[str, int],
    budget_bytes=None,
    learned_bytes=0,
    teacher_bytes=0,
):
    """:func:`plan` for a training run (a ``grpo_jax.run.config.RunConfig``).

    Rows and lengths come from the run: one forward/backward pass holds
    ``(train.minibatch_size or B * G) / optim.grad_accum`` rows (or the warm
    start's batch, if bigger); the sampler decodes ``B * G`` rows (or
    ``eval.batch_size``, if bigger); prompts are at most the largest of
    ``sampling.prompt_buckets`` long, completions ``RunConfig.completion_slots``
    (``sampling.max_new_tokens``, or ``env.max_tokens`` with an environment).
    With ``sampling.param_dtype`` the sampler's copy of the parameters is
    counted while sampling, and the rollouts' KV cache is in its dtype
    (evaluation's, in the model's). An engine that counts its own KV cache (the
    paged engine: its pool) gives the rollouts' (``Engine.kv_bytes``). With
    either, the KV cache counted is the larger of the rollouts' and evaluation's.
    Without ``budget_bytes``, the run's ``mesh.memory_budget_gb`` (when > 0) is
    the budget. ``teacher_bytes``: a ``teacher.path`` checkpoint's per-device bytes
    (:func:`_teacher_bytes`).
    """
    stated_gb = run.mesh.memory_budget_gb
    if budget_bytes is None and stated_gb > 0:
        budget_bytes = int(stated_gb * 2**30)
    n = run.train.batch_size * run.grpo.G
    kw = _run_kwargs(run, mesh_shape)
    est = plan(
        model_cfg_like, learned_bytes=learned_bytes, sample_rows=max(n, run.eval.batch_size), **kw
    )
    copy = _copy_dtype(run, model_cfg_like)
    own = _engine_kv(run, model_cfg_like, mesh_shape)
    if copy or own is not None:
        # The rollouts' cache (in the copy's dtype, or the engine's own) and evaluation's
        # (the static sampler on the trained parameters) differ: the larger one counts.
        evals = plan(model_cfg_like, sample_rows=run.eval.batch_size, **kw).kv_cache
        est = dataclasses.replace(
            est,
            kv_cache=max(_rollout_kv(run, model_cfg_like, mesh_shape, own), evals),
            sampler_copy=_copy_bytes(run, model_cfg_like, est) if copy else 0,
        )
    est = with_run_terms(est, run, as_model_config(model_cfg_like), mesh_shape)
    est = dataclasses.replace(est, teacher=_teacher_bytes(run, est, teacher_bytes))
    est = dataclasses.replace(est, routes=routes_bytes(run, model_cfg_like, mesh_shape))
    budget = budget_bytes if budget_bytes is not None else device_memory_bytes()
    if budget is not None:
        check_budget(est, budget)
    return est


def routes_bytes(run, model_cfg_like, mesh_shape: Mapping[str, int]) -> int:
    """Per-device bytes of the routes a step's rows carry with routing replay
    (``grpo.router_replay = "rollout"`` on a mixture of experts): the N rows split over the
    batch shards, P + T positions each, R sparse layers of K experts, in one byte (two past
    127 experts). 0 without replay."""
    cfg = as_model_config(model_cfg_like)
    if run.grpo.router_replay == "none" or not cfg.num_experts:
        return 0
    sh = run_shapes(run, cfg, mesh_shape)
    width = 1 if cfg.num_experts <= 127 else 2
    return sh.n_s * sh.S * len(cfg.sparse_layers) * cfg.experts_per_token * width


def _teacher_bytes(run, est: MemoryEstimate, checkpoint_bytes: int) -> int:
    """Per-device bytes of the teacher's parameters: a checkpoint's (the caller's count); for
    "reference" a copy of the base when the run holds no reference (beta = 0, no LoRA: with
    LoRA the base is in the parameters), else none; 0 without a teacher."""
    teacher = getattr(run, "teacher", None)
    if teacher is None or not teacher.enabled:
        return 0
    if not teacher.is_reference:
        return checkpoint_bytes
    return est.params if est.reference == 0 and est.trainable_params is None else 0


def _run_kwargs(run, mesh_shape) -> dict:
    """:func:`plan`'s arguments from a run, less ``sample_rows`` (the budget not checked)."""
    n = run.train.batch_size * run.grpo.G
    T = run.completion_slots[0]
    rows = (run.train.minibatch_size or n) // run.optim.grad_accum
    rows = _packed_rows(run, mesh_shape) or rows
    head = packed_head_tokens(run, mesh_shape)
    if run.warm_start.enabled:
        rows = max(rows, run.warm_start.batch_size)
        if head:  # the warm start's padded rows on one device, each over its T positions
            shards = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
            warm = -(-run.warm_start.batch_size // shards)
            head = max(head, warm * (min(run.train.logits_chunk, T) or T))
    return dict(
        head_tokens=head,
        mesh_shape=mesh_shape,
        layout=run.mesh.layout,
        budget_bytes=math.inf,
        batch_rows=rows,
        seq_len=T,
        prompt_len=max(run.sampling.prompt_buckets),
        beta=run.grpo.beta,
        logits_chunk=run.train.logits_chunk,
        **_lora_kwargs(run),
    )


def _packed_rows(run, mesh_shape) -> int:
    """With ``train.packing`` and a ``train.microbatch_tokens`` budget, the rows of P + T
    slots one packed micro-batch's slots come to, over all devices: ``microbatch_tokens``
    // L packed rows of L = ``train.pack_row_tokens`` (P + T) slots (at least one) on each
    batch shard (``grpo_jax.learner.packing``); 0 otherwise (the padded micro-batch's
    rows, whose slots the default budget holds). docs/packing.md."""
    if run.train.packing != "on" or not run.train.microbatch_tokens:
        return 0
    slots = max(run.sampling.prompt_buckets) + run.completion_slots[0]
    row = run.train.pack_row_tokens or slots
    shards = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
    return shards * math.ceil(max(1, run.train.microbatch_tokens // row) * row / slots)


def packed_head_tokens(run, mesh_shape) -> int:
    """With ``train.packing``, the positions the LM head scores at once on one device:
    ``train.logits_chunk``, or without it every slot of a micro-batch's packed rows on a
    batch shard (``grpo_jax.learner.packing``: R_s rows of L slots, R_s =
    ``microbatch_tokens`` // L, or the padded micro-batch's slots // L); 0 without
    packing. docs/packing.md."""
    if run.train.packing != "on":
        return 0
    if run.train.logits_chunk:
        return run.train.logits_chunk
    slots = max(run.sampling.prompt_buckets) + run.completion_slots[0]
    row = run.train.pack_row_tokens or slots
    shards = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
    n = run.train.batch_size * run.grpo.G
    padded_rows = (run.train.minibatch_size or n) // shards // run.optim.grad_accum
    budget = run.train.microbatch_tokens or padded_rows * slots
    return max(1, budget // row) * row


def _engine_kv(run, model_cfg_like, mesh_shape) -> int | None:
    """Per-device KV bytes of a step's rollouts as the engine counts them (the paged
    engine: its pool, whole on each device; with partial rollouts, room for the next k
    steps' prompts too), in the sampler's compute dtype; None: the static sampler's cache."""
    copy = _copy_dtype(run, model_cfg_like)
    cfg = as_model_config(model_cfg_like)
    cfg = dataclasses.replace(cfg, dtype=copy or cfg.dtype)
    b = run.train.batch_size
    groups = b
    if run.sampling.partial_rollouts:  # the next k steps' groups too
        groups = (run.train.max_staleness + 1) * b
    return get_engine(run.sampling.engine).kv_bytes(
        run.sampling.sampler(), cfg, prompts=groups, samples=run.grpo.G, due=b,
        mesh_shape=mesh_shape,
    )  # fmt: skip


def _rollout_kv(run, model_cfg_like, mesh_shape, own: int | None = None) -> int:
    """Per-device KV bytes of a step's B * G rollouts: the engine's own count
    (:func:`_engine_kv`, ``own`` when known) or the static sampler's cache."""
    if own is None:
        own = _engine_kv(run, model_cfg_like, mesh_shape)
    if own is not None:
        return own
    n = run.train.batch_size * run.grpo.G
    copy = _copy_dtype(run, model_cfg_like)
    width = {"compute_bytes": itemsize(copy)} if copy else {}
    kw = _run_kwargs(run, mesh_shape)
    return plan(model_cfg_like, sample_rows=n, **width, **kw).kv_cache


def _copy_dtype(run, model_cfg_like) -> str | None:
    """``sampling.param_dtype`` when the sampler makes a copy in it (not the model's own)."""
    return copy_dtype(run.sampling.param_dtype, model_cfg_like)


def _copy_bytes(run, model_cfg_like, est: MemoryEstimate) -> int:
    """Per-device bytes of the sampler's copy: every parameter (the adapters too) in its dtype."""
    lora = _lora_kwargs(run)
    base, adapters = numel_per_device(
        param_tensors(as_model_config(model_cfg_like)),
        est.mesh_shape,
        est.layout,
        lora.get("lora_rank", 0),
        lora.get("lora_targets", ()),
    )
    return (base + adapters) * itemsize(_copy_dtype(run, model_cfg_like))


def _lora_kwargs(run) -> dict:
    lora = run.model.lora
    if not lora.enabled:
        return {}
    return {"lora_rank": lora.rank, "lora_targets": lora.projections}


def plan_sampler(run, model_cfg_like, mesh_shape: Mapping[str, int], budget_bytes=None):
    """The sampler mesh of a split run (``mesh.sampler_devices``, ``grpo_jax.rollout.staleness``).

    Its devices hold a second copy of the parameters (laid out by
    ``mesh.layout`` on the sampler mesh, replicated when its fsdp and tensor
    axes are 1, as ``grpo_jax.run.builders.sampler_mesh`` makes them) and the KV
    cache of the step's B * G rows split over its batch shards; no optimizer
    state, gradients, activations or reference (the learner mesh holds those,
    and evaluates).
    """
    est = plan_run(run, model_cfg_like, mesh_shape, budget_bytes=math.inf)
    kv = _rollout_kv(run, model_cfg_like, mesh_shape)  # training rows only
    if est.sampler_copy:  # the copy in sampling.param_dtype is all it holds of the policy
        est = dataclasses.replace(est, params=est.sampler_copy, sampler_copy=0)
    est = dataclasses.replace(
        est, grads=0, optimizer=0, reference=0, activations=0, kv_cache=kv, update_buffers=0,
        scoring=0,
    )  # fmt: skip
    stated_gb = run.mesh.memory_budget_gb
    if budget_bytes is None:
        budget_bytes = int(stated_gb * 2**30) if stated_gb > 0 else device_memory_bytes()
    if budget_bytes is not None:
        check_budget(est, budget_bytes)
    return est


def plan_programs(
    run, model_cfg_like, mesh_shape: Mapping[str, int], learned_bytes: int = 0
) -> dict[str, ProgramPlan]:
    """{program: :class:`ProgramPlan`} for the programs a run compiles: the update, a
    scoring pass (when the update runs one), and the sampler's (the static engine's
    prefill and decode loop, or the paged engine's prefill chunk and decode step)."""
    cfg = as_model_config(model_cfg_like)
    est = plan_run(run, cfg, mesh_shape, budget_bytes=math.inf, learned_bytes=learned_bytes)
    sh = run_shapes(run, cfg, mesh_shape)
    total, body, _ = model_sizes(cfg, mesh_shape, run.mesh.layout)
    L, D, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    K, Dh, H = cfg.num_kv_heads // sh.tp_k, cfg.head_dim, cfg.num_heads // sh.tp_h
    state = est.params + est.optimizer + est.reference + est.teacher + batch_bytes(sh)
    state += est.routes
    phase = max(est.grads + est.activations + est.update_buffers, est.scoring)
    out = {"update": ProgramPlan("update", state + phase + CODE_BYTES, est.learned)}
    if est.scoring:
        own = est.params + batch_bytes(sh) + est.routes + est.scoring + CODE_BYTES
        out["scoring"] = ProgramPlan("scoring", own, est.optimizer + est.learned)
    resident = est.optimizer + est.reference + est.teacher + est.learned
    weights = est.sampler_copy or est.params
    if run.sampling.engine == "paged":
        shape = paged_pool.engine_shape(
            run.sampling.sampler(), sh.B, run.grpo.G, sh.P, window=paged_pool.model_window(cfg)
        )
        slots = shape.slots * shape.table * shape.page_size
        gather = 2 * slots * K * Dh * sh.c + slots * H * 4  # one layer's rows, gathered
        own = weights + est.kv_cache + est.gathered + gather + CODE_BYTES
        out["paged_prefill"] = ProgramPlan("paged_prefill", own, resident)
        out["paged_decode"] = ProgramPlan("paged_decode", own, resident)
        return out
    kv = 2 * L * sh.n_s * sh.S * K * Dh * sh.c
    decode_state = sh.n_s * sh.T * STATE_BYTES_PER_TOKEN + sh.n_s * sh.S + est.routes
    own = weights + kv + decode_state + est.gathered + CODE_BYTES
    out["decode"] = ProgramPlan("decode", own, resident)
    # No loop runs over the prompt's tokens: a layer at a time (two in flight) and the LM
    # head gathered, and one layer's activations over this device's prompts.
    layers = 2 * body // L * sh.c + V * D * sh.c if sh.sharded else 0
    per_token = layer_token_bytes(cfg, sh, mesh_shape, run.mesh.layout)
    acts = sh.b_s * (sh.P * per_token + attention_per_row(cfg, sh, sh.P, sh.P))
    out["prefill"] = ProgramPlan("prefill", weights + kv + layers + acts + CODE_BYTES, resident)
    return out


def plan_learned(
    name: str, run, model_cfg_like, mesh_shape, *, weights: int, section, resident: int
) -> ProgramPlan:
    """A learned reward model's or LLM judge's scoring pass (``grpo_jax.aot.programs``'s
    ``reward_model`` and ``judge``: ``section.batch_size`` rows of its largest bucket over
    the batch axes): ``weights``, its parameters' bytes on a device; when they are sharded,
    two layers gathered at a time; one layer's activations over
    this device's rows, as the prefill's; the rows themselves. The judge's LM head is not
    gathered: its last position's logits are computed over the head's shards (XLA's pass on
    a v5p-64 held no gathered head, docs/pods.md)."""
    cfg = as_model_config(model_cfg_like)
    sh = run_shapes(run, cfg, mesh_shape)
    _, body, _ = model_sizes(cfg, mesh_shape, run.mesh.layout)
    shards = int(mesh_shape.get("data", 1)) * int(mesh_shape.get("fsdp", 1))
    rows, length = -(-section.batch_size // shards), max(section.buckets)
    layers = 2 * body // cfg.num_layers * sh.c if sh.sharded else 0
    per_token = layer_token_bytes(cfg, sh, mesh_shape, run.mesh.layout)
    acts = rows * (length * per_token + attention_per_row(cfg, sh, length, length))
    return ProgramPlan(name, weights + layers + acts + rows * length * 5 + CODE_BYTES, resident)
