"""Per-device memory plan of a GRPO run, and an early refusal of layouts that cannot fit.

Parameter tensors are read from the model itself (``grpo_jax.models.param_tensors``: an
abstract model, nothing allocated) and sharded as ``grpo_jax.models.param_shardings`` shards
them; gradients, optimizer state, reference, KV cache and activations follow by formula.
:func:`estimate` gives the model's terms, :func:`plan_run` a run's peaks, :func:`plan_programs`
each compiled program's figure. The estimate refuses layouts that cannot fit; it is not for
tuning. docs/recipes.md, "The formulas", has them; docs/pods.md compares them with XLA's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from grpo_jax.core.errors import ConfigError
from grpo_jax.core.sharding import EXPERT_AXIS, LAYOUTS, MESH_AXES
from grpo_jax.models.config import ATTENTION, DEFAULT_ATTENTION, EXPERT_PROJECTIONS

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
from grpo_jax.sampling import paged_pool
from grpo_jax.sampling.engines import get_engine
from grpo_jax.sampling.weights import copy_dtype

# The axes a plan counts: a mesh's "expert" axis (docs/moe.md) shards a mixture's experts.
PLAN_AXES = (*MESH_AXES, EXPERT_AXIS)
OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "lion": 1, "momentum": 1, "sgd": 0}
COMPONENTS = (
    "params",
    "grads",
    "optimizer",
    "reference",
    "teacher",
    "learned",
    "sampler_copy",
    "gathered",
    "kv_cache",
    "activations",
    "update_buffers",
    "scoring",
    "routes",
)
_NAMES = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "reference": "reference parameters",
    "teacher": "teacher parameters",
    "learned": "reward model / judge",
    "sampler_copy": "sampling copy",
    "kv_cache": "KV cache",
    "activations": "activations",
    "gathered": "gathered weights",
    "update_buffers": "update buffers",
    "scoring": "scoring pass",
    "routes": "recorded routes",
}


class MemoryBudgetError(ConfigError):
    """The chosen layout needs more memory per device than the stated budget.

    A ``ConfigError``: the fix is a config change (layout, mesh, batch, remat).
    """


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Per-device bytes of each part of a run, for one layout of one mesh."""

    layout: str
    mesh_shape: dict[str, int]
    params: int
    grads: int
    optimizer: int
    reference: int
    kv_cache: int
    activations: int
    num_params: int
    trainable_params: int | None = None  # None: every parameter trains
    learned: int = 0  # a reward model's and a judge's weights (grpo_jax.reward_models)
    sampler_copy: int = 0  # the sampler's copy in sampling.param_dtype (while it samples)
    # A run's (plan_run): the update's buffers beside gradients and activations, a scoring
    # pass over the whole batch, the weights the sampler holds gathered.
    update_buffers: int = 0
    scoring: int = 0
    gathered: int = 0
    teacher: int = 0  # on-policy distillation's teacher (the ``teacher`` section)
    # Routing replay: the experts the sampler records for every position of a step's rows,
    # held from the decode loop through the update (docs/moe.md).
    routes: int = 0

    @property
    def sampling(self) -> int:
        """Peak while sampling: everything resident plus the sampler's copy, the weights it
        holds gathered and the KV cache."""
        resident = self.params + self.optimizer + self.reference + self.teacher + self.learned
        return resident + self.sampler_copy + self.gathered + self.kv_cache + self.routes

    @property
    def training(self) -> int:
        """Peak while updating: everything resident plus the larger of its two phases, the
        scoring pass and the micro-batches (gradients, activations, the update's buffers)."""
        resident = self.params + self.optimizer + self.reference + self.teacher + self.learned
        phase = max(self.grads + self.activations + self.update_buffers, self.scoring)
        return resident + self.routes + phase

    @property
    def total(self) -> int:
        return max(self.sampling, self.training)

    def biggest(self) -> str:
        """The component that weighs most (a key of ``COMPONENTS``)."""
        return max(COMPONENTS, key=lambda k: getattr(self, k))

    def table(self) -> str:
        axes = PLAN_AXES if self.mesh_shape.get(EXPERT_AXIS, 1) > 1 else MESH_AXES
        mesh = " x ".join(f"{a}={self.mesh_shape.get(a, 1)}" for a in axes)
        trains = ""
        if self.trainable_params is not None:
            trains = f" (LoRA: {self.trainable_params:,} trainable)"
        lines = [
            f"per-device memory estimate, layout {self.layout!r}, mesh {mesh}, "
            f"{self.num_params:,} parameters{trains}",
        ]
        for k in COMPONENTS:
            if k == "routes" and not self.routes:  # a line only with routing replay
                continue
            lines.append(f"  {_NAMES[k]:<22}{format_bytes(getattr(self, k)):>12}")
        lines.append(f"  {'sampling peak':<22}{format_bytes(self.sampling):>12}")
        lines.append(f"  {'training peak':<22}{format_bytes(self.training):>12}")
        lines.append(f"  {'total (peak)':<22}{format_bytes(self.total):>12}")
        return "\n".join(lines)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _check_positive(name: str, value, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"memory.estimate: {name} = {value!r} must be an integer >= {lo}")


def estimate(
    model_cfg_like,
    *,
    mesh_shape: Mapping[str, int],
    layout: str,
    batch_rows: int,
    seq_len: int,
    prompt_len: int,
    beta: float,
    optimizer: str = "adamw",
    param_bytes: int = 4,
    compute_bytes: int = 4,
    remat: bool = False,
    sample_rows: int | None = None,
    logits_chunk: int = 0,
    attention: str = DEFAULT_ATTENTION,
    attention_block_size: int = 512,
    lora_rank: int = 0,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    head_tokens: int = 0,
) -> MemoryEstimate:
    """Per-device memory of a GRPO run (formulas: docs/recipes.md, "The formulas").

    Args:
      model_cfg_like: a ``grpo_jax.models.ModelConfig``, or any object with
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
        head_dim, mlp_dim, tie_embeddings (``as_model_config``).
        ``param_bytes`` and ``compute_bytes``, not its dtypes, size the bytes.
      mesh_shape: mesh axis sizes, e.g. ``{"data": 1, "fsdp": 8, "tensor": 1}``
        or ``mesh.shape``; missing axes have size 1.
      layout: a key of ``grpo_jax.core.sharding.LAYOUTS`` ("dp", "fsdp", "fsdp_tp").
      batch_rows: completion rows of one forward/backward pass, over all
        devices (the minibatch divided by the gradient-accumulation steps).
      seq_len: T, completion tokens per row (the sampler's max_new_tokens).
      prompt_len: P, prompt tokens per row (padded).
      beta: KL weight; 0 means no reference parameters are held.
      optimizer: a key of ``OPTIMIZER_MOMENTS``.
      param_bytes: bytes per stored parameter (4 float32, 2 bfloat16).
      compute_bytes: bytes per activation element (the compute dtype).
      remat: each layer rematerialised in the backward pass.
      sample_rows: rows the sampler decodes at once (B * G); defaults to
        ``batch_rows``.
      logits_chunk: completion tokens scored at a time (``train.logits_chunk``;
        0: all T).
      attention, attention_block_size: the attention implementation and its
        key block (``ModelConfig.attention``): "blockwise" and "splash" never
        hold the [S, S] scores.
      lora_rank: r of LoRA adapters on a frozen base (0: full fine-tuning).
      lora_targets: the projections with adapters (``LoRAConfig.projections``).
      head_tokens: positions the LM head scores at once on one device (0: each row's
        ``logits_chunk`` or T). A packed update's head runs over a micro-batch's
        gathered scored tokens, up to all of its slots on a shard, ``logits_chunk`` at
        a time (:func:`packed_head_tokens`).
    """
    sample_rows = batch_rows if sample_rows is None else sample_rows
    sizes = dict(batch_rows=batch_rows, sample_rows=sample_rows, seq_len=seq_len)
    sizes.update(prompt_len=prompt_len, param_bytes=param_bytes, compute_bytes=compute_bytes)
    mesh = _checked_args(mesh_shape, layout, optimizer, attention, sizes, beta)
    cfg = as_model_config(model_cfg_like)
    tensors = param_tensors(cfg)
    state = _state_bytes(
        tensors, mesh, layout, param_bytes, beta, lora_rank, lora_targets, cfg.experts_per_token
    )
    params, grads, trained, reference, trainable_params, lora_layer = state
    shards = mesh["data"] * mesh["fsdp"]
    rows = lambda r: r // shards if r % shards == 0 else r
    S = prompt_len + seq_len
    kv_cache, activations = _activation_bytes(
        cfg,
        mesh,
        layout,
        n=rows(batch_rows),
        m=rows(sample_rows),
        S=S,
        T=min(logits_chunk, seq_len) or seq_len,
        c=compute_bytes,
        attention=attention,
        attention_block_size=attention_block_size,
        remat=remat,
        lora_act=compute_bytes * lora_rank * lora_layer,
        head_tokens=head_tokens,
    )
    return MemoryEstimate(
        layout=layout,
        mesh_shape=mesh,
        params=params,
        grads=grads,
        optimizer=OPTIMIZER_MOMENTS[optimizer] * trained,
        reference=reference,
        kv_cache=kv_cache,
        activations=activations,
        num_params=sum(math.prod(shape) for _, shape, _, _ in tensors),
        trainable_params=trainable_params,
    )


def _checked_args(mesh_shape: Mapping[str, int], layout, optimizer, attention, sizes, beta):
    """``estimate``'s arguments checked (``sizes``: the integer ones, by name, >= 1 but
    prompt_len >= 0), and the mesh with every axis of ``MESH_AXES`` (1 where absent) and
    "expert" when it is larger than 1."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sharding layout {layout!r}; known layouts are {sorted(LAYOUTS)}")
    unknown = set(mesh_shape) - set(PLAN_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; known axes are {list(PLAN_AXES)}")
    mesh = {a: int(mesh_shape.get(a, 1)) for a in PLAN_AXES}
    if mesh[EXPERT_AXIS] == 1:  # as make_mesh leaves it out: plans of dense meshes unchanged
        del mesh[EXPERT_AXIS]
    for a, v in mesh.items():
        _check_positive(f"mesh_shape[{a!r}]", v)
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known are {sorted(OPTIMIZER_MOMENTS)}")
    if attention not in ATTENTION:
        raise ValueError(f"unknown attention {attention!r}; known are {sorted(ATTENTION)}")
    for name, value in sizes.items():
        _check_positive(name, value, 0 if name == "prompt_len" else 1)
    if not beta >= 0:
        raise ValueError(f"memory.estimate: beta = {beta!r} must be >= 0")
    return mesh


def _state_bytes(
    tensors, mesh, layout: str, param_bytes: int, beta: float, lora_rank, targets, k: int = 0
):
    """Per-device bytes of the training state: (params, grads, trained, reference,
    trainable_params, the adapters' saved x A per layer and token, in multiples of r).

    Full fine-tuning: params = grads = trained (what the optimizer moments
    cover), the reference a copy when beta > 0. LoRA (``lora_rank`` r > 0):
    float32 adapters are added to params and are all that is trained and has
    gradients; the reference is the base itself (no copy). An expert weight's adapter
    (``EXPERT_PROJECTIONS``) saves x A for each of a token's ``k`` experts.
    """
    per_device, adapter_numel = _numel_per_device(tensors, mesh, layout, lora_rank, targets)
    params = per_device * param_bytes
    reference = params if beta > 0 else 0
    grads, trained, trainable_params, per_layer = params, params, None, 0
    if lora_rank:
        _check_positive("lora_rank", lora_rank)
        adapters = lora_tensors(tensors, lora_rank, targets)
        trained = 4 * adapter_numel
        trainable_params = sum(math.prod(shape) for _, shape, _ in adapters)
        params, grads, reference = params + trained, trained, 0
        adapted = {n.rsplit(".", 1)[-1][: -len("_lora_a")] for n, _, _ in adapters}
        per_layer = sum(k if p in EXPERT_PROJECTIONS else 1 for p in adapted)
    return params, grads, trained, reference, trainable_params, per_layer


def _numel_per_device(tensors, mesh, layout: str, lora_rank: int, targets) -> tuple[int, int]:
    """Elements one device holds of the base parameters and of the LoRA adapters (0 without)."""
    base = sum(shard_numel(shape, axes, mesh, layout) for _, shape, _, axes in tensors)
    if not lora_rank:
        return base, 0
    adapters = lora_tensors(tensors, lora_rank, targets)
    return base, sum(shard_numel(shape, axes, mesh, layout) for _, shape, axes in adapters)


def _activation_bytes(
    cfg, mesh, layout, *, n, m, S, T, c, attention, attention_block_size, remat, lora_act,
    head_tokens=0,
):  # fmt: skip
    """Per-device (kv_cache, activations) bytes (formulas: docs/recipes.md, "The formulas").

    ``n`` / ``m``: the rows of one forward/backward pass / of the sampler on
    one device; S = P + T tokens per row; ``T`` here the completion tokens
    scored at a time (the logits); ``c`` bytes per activation element;
    ``lora_act`` the adapters' bytes per layer and token; ``head_tokens`` the LM head's
    positions at once, when not n T.
    """
    V, D, L = cfg.vocab_size, cfg.hidden_size, cfg.num_layers
    H, K, Dh, F = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
    tp_h = tensor_ways(H, "heads", mesh, layout)
    tp_k = tensor_ways(K, "kv_heads", mesh, layout)
    tp_f = tensor_ways(F, "mlp", mesh, layout)
    tp_v = tensor_ways(V, "vocab", mesh, layout)

    kv_cache = 2 * L * m * S * (K // tp_k) * Dh * c
    gelu = cfg.activation != "silu"
    per_layer_token = c * (
        (8 if cfg.sandwich_norm else 6) * D
        + (3 if cfg.qk_norm else 2) * (H // tp_h) * Dh
        + (3 if cfg.qk_norm else 2) * (K // tp_k) * Dh
    )
    dense_mlp = c * (6 if gelu else 4) * F // tp_f
    blockwise = 0
    if attention == "blockwise":
        per_layer_token += 8 * (H // tp_h)
        blockwise = 5 * 4 * n * (H // tp_h) * S * min(attention_block_size, S)
    elif attention == "splash":
        per_layer_token += 4 * (H // tp_h)
    else:
        per_layer_token += (4 + c) * (H // tp_h) * S
    logits = (head_tokens or n * T) * 8 * (V // tp_v) + blockwise
    per_layer_token += lora_act
    R = len(cfg.sparse_layers)
    mlps = [(L - R, dense_mlp), (R, moe_token_bytes(cfg, mesh, layout, c))]
    if remat:  # one layer recomputed at a time: the larger kind's
        per_token = L * c * D + per_layer_token + max(b for count, b in mlps if count)
    else:
        per_token = L * per_layer_token + sum(count * b for count, b in mlps)
    return kv_cache, n * S * per_token + logits


def moe_token_bytes(cfg, mesh, layout, c: int) -> int:
    """A sparse layer's mixture-of-experts activations per token (docs/moe.md, "The memory
    plan"): the router's logits (compute dtype) and float32 probabilities over the E experts,
    and for each of the K (token, expert) pairs its gathered row and its output row (D each)
    and six rows of the expert's width F (gate and up projections, the activation's saved
    values, their product), eight for a gelu. The int32 sort permutations and
    ``ragged_dot``'s own buffers are not counted."""
    if not cfg.num_experts:
        return 0
    E, K, F = cfg.num_experts, cfg.experts_per_token, cfg.expert_mlp_dim
    tp_f = tensor_ways(F, "mlp", mesh, layout)
    gated = (8 if cfg.activation != "silu" else 6) * F // tp_f
    return (c + 4) * E + c * K * (2 * cfg.hidden_size + gated)


def _hint(est: MemoryEstimate, part: str) -> str:
    if part in ("params", "grads", "optimizer", "reference"):
        if est.layout == "dp":
            hint = "use layout fsdp (it shards parameters, gradients and optimizer state)"
        elif est.layout == "fsdp":
            hint = "use more fsdp devices, or layout fsdp_tp with tensor > 1"
        else:
            hint = "use more fsdp or tensor devices, or bfloat16 parameters"
        return hint + (", or beta = 0 (no reference model)" if part == "reference" else "")
    if part == "teacher":
        return "shard the teacher with more fsdp devices, or use a smaller one"
    if part == "learned":
        return "shard the reward model or judge with more fsdp devices, or use a smaller one"
    if part == "activations":
        return (
            "use remat (model.remat = True), a smaller minibatch (train.minibatch_size) or "
            "more gradient-accumulation steps (optim.grad_accum), or more data/fsdp devices"
        )
    if part == "scoring":
        return (
            "use a smaller train.logits_chunk or more data/fsdp devices (a scoring pass "
            "holds every row of the batch that is on the device)"
        )
    if part == "gathered":
        return "use scanned layers (model.scan_layers = True: one layer gathered at a time)"
    if part == "update_buffers":
        return "use more fsdp devices, or layout fsdp_tp with tensor > 1"
    return "sample fewer rows at once, shorten max_new_tokens, or use more data/fsdp devices"


def check_budget(est: MemoryEstimate, budget_bytes: int | float) -> None:
    """Raises :class:`MemoryBudgetError` when ``est.total`` exceeds ``budget_bytes``.

    The message names the layout, the total, the budget, the biggest
    component and what would shrink it.
    """
    if not budget_bytes > 0:
        raise ValueError(f"memory budget = {budget_bytes!r} bytes must be positive")
    if est.total <= budget_bytes:
        return
    part = est.biggest()
    raise MemoryBudgetError(
        f"layout {est.layout!r} on mesh {est.mesh_shape} needs about "
        f"{format_bytes(est.total)} per device, over the budget of "
        f"{format_bytes(budget_bytes)}; the biggest part is {_NAMES[part]} "
        f"({format_bytes(getattr(est, part))}): {_hint(est, part)}.\n{est.table()}"
    )


def plan(
    model_cfg_like,
    *,
    mesh_shape: Mapping[str, int],
    layout: str,
    budget_bytes: int | float | None = None,
    learned_bytes: int = 0,
    **kwargs,
) -> MemoryEstimate:
    """:func:`estimate`, then :func:`check_budget` against a budget.

    The budget is ``budget_bytes`` when given, otherwise what the first local
    device reports (GPUs and TPUs report a limit; CPUs do not, and then
    nothing is checked). ``param_bytes`` and ``compute_bytes`` default to the
    item sizes of the config's ``param_dtype`` and ``dtype`` when it has them,
    and ``remat`` to its ``remat``.
    """
    for key, field in (("param_bytes", "param_dtype"), ("compute_bytes", "dtype")):
        if key not in kwargs and getattr(model_cfg_like, field, None) is not None:
            kwargs[key] = _itemsize(getattr(model_cfg_like, field))
    if "remat" not in kwargs and isinstance(getattr(model_cfg_like, "remat", None), bool):
        kwargs["remat"] = model_cfg_like.remat
    for key in ("attention", "attention_block_size"):
        if key not in kwargs and getattr(model_cfg_like, key, None) is not None:
            kwargs[key] = getattr(model_cfg_like, key)
    est = estimate(model_cfg_like, mesh_shape=mesh_shape, layout=layout, **kwargs)
    est = dataclasses.replace(est, learned=learned_bytes)  # per device, the caller's count
    budget = budget_bytes if budget_bytes is not None else device_memory_bytes()
    if budget is not None:
        check_budget(est, budget)
    return est


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
    est = _with_run_terms(est, run, as_model_config(model_cfg_like), mesh_shape)
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
    width = {"compute_bytes": _itemsize(copy)} if copy else {}
    kw = _run_kwargs(run, mesh_shape)
    return plan(model_cfg_like, sample_rows=n, **width, **kw).kv_cache


def _copy_dtype(run, model_cfg_like) -> str | None:
    """``sampling.param_dtype`` when the sampler makes a copy in it (not the model's own)."""
    return copy_dtype(run.sampling.param_dtype, model_cfg_like)


def _copy_bytes(run, model_cfg_like, est: MemoryEstimate) -> int:
    """Per-device bytes of the sampler's copy: every parameter (the adapters too) in its dtype."""
    lora = _lora_kwargs(run)
    base, adapters = _numel_per_device(
        param_tensors(as_model_config(model_cfg_like)),
        est.mesh_shape,
        est.layout,
        lora.get("lora_rank", 0),
        lora.get("lora_targets", ()),
    )
    return (base + adapters) * _itemsize(_copy_dtype(run, model_cfg_like))


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


def _itemsize(dtype) -> int:
    if dtype == "bfloat16":  # numpy has no bfloat16; jax registers it under ml_dtypes.
        return 2
    return np.dtype(dtype).itemsize


def device_memory_bytes() -> int | None:
    """The first local device's memory limit as the runtime reports it (None on CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None


# ---------------------------------------------------------------------------
# The programs of a run: what each one holds per device, beside the run's peaks.
#
# What the TPU compiler showed each program holds besides the terms above (docs/pods.md
# compares every figure with XLA's), s the batch shards, n_s = N / s, c and p the
# compute and parameter bytes:
#
#   update buffers  gradients once more with grad_accum > 1 (the accumulation's carry);
#                   three copies of the largest parameter tensor's shard (the non-finite
#                   guard's lax.cond writes new parameters and both moments, not in place);
#                   with sharded parameters also the LM head's gradient, V x D x (4 + 2c):
#                   float32 and whole inside the logits-chunk loop, with its reduction's
#                   input and output in the compute dtype (full fine-tuning only), and two
#                   layers gathered in the compute dtype (an fsdp all-gather in flight)
#   scoring pass    (beta > 0, grpo.old_logps "recompute" or train.track_update) one pass
#                   over the whole batch, n_s rows per device: the larger of the
#                   prompt-once KV cache (twice for scanned layers: the stacked cache is
#                   copied) plus one layer's attention working set, and one logits chunk
#                   in three float32 copies (logits, shifted, exponentials); the update
#                   runs it and the micro-batches one after the other
#   gathered        with sharded parameters, the weights the decode loop holds gathered in
#                   the compute dtype: the whole model (unrolled layers: XLA gathers each
#                   layer once, before the loop), or with scanned layers the stacked
#                   cache's copy, two layers and the LM head; the paged engine's step, the
#                   whole model
#
# A program's own need adds its arguments (the batch: n_s rows of prompts, completions,
# log-probs) and an allowance for its generated code before it is compiled (CODE_BYTES:
# the recipes' updates compiled to 0.08-0.15 GiB); while the sampler runs, the optimizer
# state and the reference stay resident beside it.

CODE_BYTES = int(0.1 * 2**30)
_STATE_BYTES_PER_TOKEN = 4 * 3 + 4  # a decode step's token, two log-probs, its length


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
    """One program's bytes per device: ``own`` (what the program holds: arguments,
    outputs, temporaries, code) and ``resident`` (what stays beside it, not its argument)."""

    program: str
    own: int
    resident: int = 0

    @property
    def total(self) -> int:
        return self.own + self.resident


@dataclasses.dataclass(frozen=True)
class RunShapes:
    """The sizes the programs' terms read (per device where it says so)."""

    N: int
    B: int
    P: int
    T: int
    S: int
    C: int  # completion tokens scored at a time
    c: int  # compute bytes
    p: int  # parameter bytes
    n_s: int  # rows of a whole-batch pass on one device
    b_s: int  # prompts on one device
    tp_h: int
    tp_k: int
    tp_v: int
    tp_f: int
    scan: bool
    sharded: bool  # parameters split over fsdp (or fsdp and tensor)


def run_shapes(run, cfg, mesh_shape: Mapping[str, int]) -> RunShapes:
    mesh = {a: int(mesh_shape.get(a, 1)) for a in PLAN_AXES}
    s = mesh["data"] * mesh["fsdp"]
    B, G = run.train.batch_size, run.grpo.G
    N, P, T = B * G, max(run.sampling.prompt_buckets), run.completion_slots[0]
    layout = run.mesh.layout
    split = mesh["fsdp"] * (mesh["tensor"] if layout == "fsdp_tp" else 1) * mesh[EXPERT_AXIS]
    return RunShapes(
        N=N, B=B, P=P, T=T, S=P + T, C=min(run.train.logits_chunk, T) or T,
        c=_itemsize(cfg.dtype), p=_itemsize(cfg.param_dtype),
        n_s=N // s if N % s == 0 else N, b_s=B // s if B % s == 0 else B,
        tp_h=tensor_ways(cfg.num_heads, "heads", mesh, layout),
        tp_k=tensor_ways(cfg.num_kv_heads, "kv_heads", mesh, layout),
        tp_v=tensor_ways(cfg.vocab_size, "vocab", mesh, layout),
        tp_f=tensor_ways(cfg.mlp_dim, "mlp", mesh, layout),
        scan=bool(cfg.scan_layers), sharded=layout != "dp" and split > 1,
    )  # fmt: skip


def _sizes(cfg, mesh_shape, layout) -> tuple[int, int, int]:
    """(parameters, those outside the embedding and LM head, the largest tensor's shard)."""
    tensors = param_tensors(cfg)
    total = sum(math.prod(shape) for _, shape, _, _ in tensors)
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    mesh = {a: int(mesh_shape.get(a, 1)) for a in PLAN_AXES}
    largest = max(shard_numel(shape, axes, mesh, layout) for _, shape, _, axes in tensors)
    return total, total - embed, largest


def _attention_per_row(cfg, sh: RunShapes, queries: int, keys: int) -> int:
    """One layer's attention working set for one row: einsum's scores and probabilities,
    blockwise's block, splash's log-sum-exp (its blocks live in the core's VMEM)."""
    H = cfg.num_heads // sh.tp_h
    if cfg.attention == "splash":
        return 8 * H * queries
    if cfg.attention == "blockwise":
        return 20 * H * queries * min(cfg.attention_block_size, keys)
    return (4 + sh.c) * H * queries * keys


def scoring_bytes(run, cfg, sh: RunShapes) -> int:
    """The working set of a scoring pass over the whole batch; 0 when the update runs none."""
    passes = (
        run.grpo.beta > 0,
        run.grpo.old_logps == "recompute",
        run.train.track_update,
        run.grpo.router_replay != "none",  # the own-routing pass of the moe/* metrics
    )
    if not any(passes) and run.grpo.advantage_estimator != "gae":  # gae: the old values' pass
        return 0
    L, K, Dh = cfg.num_layers, cfg.num_kv_heads // sh.tp_k, cfg.head_dim
    cache = 2 * L * sh.n_s * sh.S * K * Dh * sh.c * (2 if sh.scan else 1)
    attention = sh.n_s * _attention_per_row(cfg, sh, sh.T, sh.S)
    logits = sh.n_s * sh.C * (cfg.vocab_size // sh.tp_v) * 4 * 3
    return max(cache + attention, logits)


def batch_bytes(sh: RunShapes) -> int:
    """A RolloutBatch's bytes on one device (``core.batch.batch_spec``'s arrays)."""
    return sh.n_s * (sh.P * 5 + sh.T * (4 + 1 + 4 + 4) + 16)


def _update_buffers(run, cfg, sh: RunShapes, grads: int, body: int, largest: int) -> int:
    # The gradient carry: grad_accum's parts, or the packed update's micro-batches (a scan
    # with the gradient as its carry, however many micro-batches a step has).
    carry = run.optim.grad_accum > 1 or run.train.packing == "on"
    out = grads * carry + 3 * largest * sh.p
    if sh.sharded:
        out += 2 * body // cfg.num_layers * sh.c
        if not run.model.lora.enabled:  # the LM head trains
            out += cfg.vocab_size * cfg.hidden_size * (4 + 2 * sh.c)
    return out


def _decode_gathered(run, cfg, sh: RunShapes, total: int, body: int) -> int:
    if not sh.sharded:
        return 0
    if run.sampling.engine != "static" or not sh.scan:
        return total * sh.c
    kv = 2 * cfg.num_layers * sh.n_s * sh.S * (cfg.num_kv_heads // sh.tp_k) * cfg.head_dim * sh.c
    return kv + 2 * body // cfg.num_layers * sh.c + cfg.vocab_size * cfg.hidden_size * sh.c


def _with_run_terms(est: MemoryEstimate, run, cfg, mesh_shape) -> MemoryEstimate:
    """``est`` with the run's update buffers, scoring pass and gathered weights."""
    sh = run_shapes(run, cfg, mesh_shape)
    total, body, largest = _sizes(cfg, mesh_shape, run.mesh.layout)
    est = dataclasses.replace(
        est,
        update_buffers=_update_buffers(run, cfg, sh, est.grads, body, largest),
        scoring=scoring_bytes(run, cfg, sh),
        gathered=_decode_gathered(run, cfg, sh, total, body),
    )
    return _with_critic(est, run, cfg, sh)


def _with_critic(est: MemoryEstimate, run, cfg, sh: RunShapes) -> MemoryEstimate:
    """PPO's value head (``grpo.advantage_estimator = "gae"``): D + 1 float32 numbers,
    replicated, with their gradient and optimizer moments; and the step's targets beside
    the batch (advantages, returns, old values, value mask: 4 float32 per token)."""
    if run.grpo.advantage_estimator != "gae":
        return est
    head = 4 * (cfg.hidden_size + 1)
    moments = OPTIMIZER_MOMENTS["adamw"] * head
    targets = sh.n_s * sh.T * 4 * 4
    return dataclasses.replace(
        est,
        params=est.params + head,
        grads=est.grads + head,
        optimizer=est.optimizer + moments,
        update_buffers=est.update_buffers + targets,
    )


def plan_programs(
    run, model_cfg_like, mesh_shape: Mapping[str, int], learned_bytes: int = 0
) -> dict[str, ProgramPlan]:
    """{program: :class:`ProgramPlan`} for the programs a run compiles: the update, a
    scoring pass (when the update runs one), and the sampler's (the static engine's
    prefill and decode loop, or the paged engine's prefill chunk and decode step)."""
    cfg = as_model_config(model_cfg_like)
    est = plan_run(run, cfg, mesh_shape, budget_bytes=math.inf, learned_bytes=learned_bytes)
    sh = run_shapes(run, cfg, mesh_shape)
    total, body, _ = _sizes(cfg, mesh_shape, run.mesh.layout)
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
    decode_state = sh.n_s * sh.T * _STATE_BYTES_PER_TOKEN + sh.n_s * sh.S + est.routes
    own = weights + kv + decode_state + est.gathered + CODE_BYTES
    out["decode"] = ProgramPlan("decode", own, resident)
    # No loop runs over the prompt's tokens: a layer at a time (two in flight) and the LM
    # head gathered, and one layer's activations over this device's prompts.
    layers = 2 * body // L * sh.c + V * D * sh.c if sh.sharded else 0
    per_token = _layer_token_bytes(cfg, sh, mesh_shape, run.mesh.layout)
    acts = sh.b_s * (sh.P * per_token + _attention_per_row(cfg, sh, sh.P, sh.P))
    out["prefill"] = ProgramPlan("prefill", weights + kv + layers + acts + CODE_BYTES, resident)
    return out


def _layer_token_bytes(cfg, sh: RunShapes, mesh_shape, layout: str) -> int:
    """One layer's activations per token of a forward pass with no cache kept: the
    residual, norms and projections, and the MLP's (or the experts') widest."""
    L, D = cfg.num_layers, cfg.hidden_size
    K, Dh, H = cfg.num_kv_heads // sh.tp_k, cfg.head_dim, cfg.num_heads // sh.tp_h
    dense = sh.c * 4 * cfg.mlp_dim // sh.tp_f if len(cfg.sparse_layers) < L else 0
    mlp = max(dense, moe_token_bytes(cfg, mesh_shape, layout, sh.c))
    return sh.c * (6 * D + 2 * H * Dh + 2 * K * Dh) + mlp


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
    _, body, _ = _sizes(cfg, mesh_shape, run.mesh.layout)
    shards = int(mesh_shape.get("data", 1)) * int(mesh_shape.get("fsdp", 1))
    rows, length = -(-section.batch_size // shards), max(section.buckets)
    layers = 2 * body // cfg.num_layers * sh.c if sh.sharded else 0
    per_token = _layer_token_bytes(cfg, sh, mesh_shape, run.mesh.layout)
    acts = rows * (length * per_token + _attention_per_row(cfg, sh, length, length))
    return ProgramPlan(name, weights + layers + acts + rows * length * 5 + CODE_BYTES, resident)
