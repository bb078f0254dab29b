"""The memory plan's model terms: per-device bytes of a model's parts on one layout of a mesh.

Parameter tensors are read from the model itself (``grpo_jax.models.param_tensors``: an
abstract model, nothing allocated) and sharded as ``grpo_jax.models.param_shardings`` shards
them; gradients, optimizer state, reference, KV cache and activations follow by formula
(:func:`estimate`), and :func:`check_budget` refuses what cannot fit. ``grpo_jax.run.memory``
adds a run's terms and gives its peaks. docs/recipes.md, "The formulas", has them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from grpo_jax.core.errors import ConfigError
from grpo_jax.core.sharding import EXPERT_AXIS, LAYOUTS, MESH_AXES
from grpo_jax.models.config import ATTENTION, DEFAULT_ATTENTION, EXPERT_PROJECTIONS
from grpo_jax.models.param_tensors import (
    as_model_config,
    lora_tensors,
    param_tensors,
    shard_numel,
    tensor_ways,
)

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
        a time (``grpo_jax.run.memory.packed_head_tokens``).
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
    per_device, adapter_numel = numel_per_device(tensors, mesh, layout, lora_rank, targets)
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


def numel_per_device(tensors, mesh, layout: str, lora_rank: int, targets) -> tuple[int, int]:
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
            kwargs[key] = itemsize(getattr(model_cfg_like, field))
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


def itemsize(dtype) -> int:
    if dtype == "bfloat16":  # numpy has no bfloat16; jax registers it under ml_dtypes.
        return 2
    return np.dtype(dtype).itemsize


def device_memory_bytes() -> int | None:
    """The first local device's memory limit as the runtime reports it (None on CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None
