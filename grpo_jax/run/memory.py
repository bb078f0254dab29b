"""Per-device memory plan of a GRPO run, and an early refusal of layouts that cannot fit.

Sizes: V vocabulary, D width, L layers, H query heads, K key/value heads, Dh
head width, F MLP width; P prompt tokens, T completion tokens, S = P + T
positions (the KV cache's slots and the trainer's forward length).

Every parameter tensor is read, with its shape, dtype and logical axis
names, from the model itself (``grpo_jax.models.param_tensors``: an abstract
``grpo_jax.models.Transformer`` built by ``nnx.eval_shape``, nothing
allocated), and sharded by the layout's rules (``grpo_jax.core.sharding.LAYOUTS``)
the way ``grpo_jax.models.param_shardings`` shards it: a dimension is split
over its mesh axes only when they divide it.
So with mesh axes of sizes (data, fsdp, tensor):

  dp       parameters, gradients, optimizer state and reference replicated;
  fsdp     each of them divided by ``fsdp`` (the "embed" dimension is split);
  fsdp_tp  divided by ``fsdp * tensor`` (heads, MLP width and vocabulary also
           split over ``tensor``, where ``tensor`` divides them).

Batch rows are split over data * fsdp (the batch shards); activations and the
KV cache are divided by that, and their head / MLP / vocabulary dimensions by
``tensor`` under fsdp_tp.

Per device, in bytes (p = param_bytes, c = compute_bytes, n = training rows
per device, m = sampling rows per device, tp_x = the tensor ways of dimension
x, 1 where it is not split):

  params       sum over tensors of numel / ways * p
  grads        the same as params (gradients have the parameters' dtype and sharding)
  optimizer    moments * params (AdamW/Adam 2, Lion/momentum 1, SGD 0; optax keeps
               the moments in the parameters' dtype)
  reference    the same as params when beta > 0, else 0 (beta = 0 skips it)
  kv_cache     2 * L * m * S * (K / tp_k) * Dh * c
  activations  saved for the backward pass of one forward over n rows of S tokens:
                 per layer and token
                   a = c * (6 D + 2 (H / tp_h) Dh + 2 (K / tp_k) Dh + 4 F / tp_f)
                       + (4 + c) * (H / tp_h) * S
                 (residual stream, norms, attention and MLP outputs; q, k, v and the
                 attention output; gate, up, activation and product; float32 scores
                 and the softmax probabilities: attention "einsum" or "dot_product");
                 with attention "blockwise" the last term is 8 * (H / tp_h) (the
                 float32 row maximum and normaliser; the scores are recomputed
                 block by block), plus, once, the working set of one block of
                 one layer: 5 * 4 * n * (H / tp_h) * S * C_a (C_a = the block size);
                 with attention "splash" it is 4 * (H / tp_h) (the float32
                 log-sum-exp the kernel's backward reads) and the block working set
                 lives in the TPU core's VMEM, not in HBM;
                 sandwich norms add 2 D, q/k norms (H + K) Dh, a GELU gate 2 F
                 (its tanh intermediates),
                 plus float32 logits and their gradient, 8 * V / tp_v per scored
                 token: the LM head runs on the T completion positions only, or on
                 C = train.logits_chunk of them at a time (C = T when 0):
                 no remat:  n * S * L * a + n * C * 8 V / tp_v
                 remat:     n * S * (L * c * D + a) + n * C * 8 V / tp_v
                 (only each layer's input is kept; one layer is recomputed at a time)
                 Layers as a scan (``scan_layers``) save the same tensors, stacked.

With LoRA (``lora_rank`` = r > 0, ``grpo_jax.models.lora``) each target
projection W [in, out] gets float32 adapters A [in, r] and B [r, out]
(sharded like W's in and out dimensions; the rank is never split). Then

  params       the base as above (its own param_bytes, e.g. bfloat16) + 4 * adapters
  grads        4 * adapters (the base gets no gradient)
  optimizer    moments * 4 * adapters
  reference    0 (the reference is the base with the adapters off)
  activations  + c * r per target projection, layer and token (x A is kept)

The sampler (KV cache) and the update (gradients, activations) run one after
the other, so the peak is

  total = params + optimizer + reference + max(kv_cache, grads + activations).

Not counted: under fsdp, XLA may hoist the decode loop's parameter
all-gathers out of the loop (XLA:CPU does: on 8 fake devices the compiled
decode loop gathers no weights per token, only before the loop), so the
sampler can hold one unsharded copy of the weights while it runs.

``tests/run/test_memory.py`` checks the activation term against the tensors JAX
itself saves for the backward pass (``saved_residuals``) for Llama, Qwen and
Gemma layers, with and without remat. XLA's buffer reuse and fusion move the
real peak by tens of percent either way; the estimate is for refusing
layouts that cannot fit, not for tuning.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import numpy as np

from grpo_jax.core.errors import ConfigError
from grpo_jax.core.sharding import LAYOUTS, MESH_AXES
from grpo_jax.models.config import ATTENTION, DEFAULT_ATTENTION

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
from grpo_jax.sampling.engines import get_engine
from grpo_jax.sampling.weights import copy_dtype

OPTIMIZER_MOMENTS = {"adamw": 2, "adam": 2, "lion": 1, "momentum": 1, "sgd": 0}
COMPONENTS = (
    "params",
    "grads",
    "optimizer",
    "reference",
    "learned",
    "sampler_copy",
    "kv_cache",
    "activations",
)
_NAMES = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "reference": "reference parameters",
    "learned": "reward model / judge",
    "sampler_copy": "sampling copy",
    "kv_cache": "KV cache",
    "activations": "activations",
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

    @property
    def sampling(self) -> int:
        """Peak while sampling: everything resident plus the sampler's copy and the KV cache."""
        resident = self.params + self.optimizer + self.reference + self.learned
        return resident + self.sampler_copy + self.kv_cache

    @property
    def training(self) -> int:
        """Peak while updating: everything resident plus gradients and activations."""
        resident = self.params + self.optimizer + self.reference + self.learned
        return resident + self.grads + self.activations

    @property
    def total(self) -> int:
        return max(self.sampling, self.training)

    def biggest(self) -> str:
        """The component that weighs most (a key of ``COMPONENTS``)."""
        return max(COMPONENTS, key=lambda k: getattr(self, k))

    def table(self) -> str:
        mesh = " x ".join(f"{a}={self.mesh_shape.get(a, 1)}" for a in MESH_AXES)
        trains = ""
        if self.trainable_params is not None:
            trains = f" (LoRA: {self.trainable_params:,} trainable)"
        lines = [
            f"per-device memory estimate, layout {self.layout!r}, mesh {mesh}, "
            f"{self.num_params:,} parameters{trains}",
        ]
        for k in COMPONENTS:
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
) -> MemoryEstimate:
    """Per-device memory of a GRPO run (formulas in the module docstring).

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
    """
    sample_rows = batch_rows if sample_rows is None else sample_rows
    sizes = dict(batch_rows=batch_rows, sample_rows=sample_rows, seq_len=seq_len)
    sizes.update(prompt_len=prompt_len, param_bytes=param_bytes, compute_bytes=compute_bytes)
    mesh = _checked_args(mesh_shape, layout, optimizer, attention, sizes, beta)
    cfg = as_model_config(model_cfg_like)
    tensors = param_tensors(cfg)
    state = _state_bytes(tensors, mesh, layout, param_bytes, beta, lora_rank, lora_targets)
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
    prompt_len >= 0), and the mesh with every axis of ``MESH_AXES`` (1 where absent)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sharding layout {layout!r}; known layouts are {sorted(LAYOUTS)}")
    unknown = set(mesh_shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; known axes are {list(MESH_AXES)}")
    mesh = {a: int(mesh_shape.get(a, 1)) for a in MESH_AXES}
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


def _state_bytes(tensors, mesh, layout: str, param_bytes: int, beta: float, lora_rank, targets):
    """Per-device bytes of the training state: (params, grads, trained, reference,
    trainable_params, adapted projections per layer).

    Full fine-tuning: params = grads = trained (what the optimizer moments
    cover), the reference a copy when beta > 0. LoRA (``lora_rank`` r > 0):
    float32 adapters are added to params and are all that is trained and has
    gradients; the reference is the base itself (no copy).
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
        per_layer = len({n.rsplit(".", 1)[-1][: -len("_lora_a")] for n, _, _ in adapters})
    return params, grads, trained, reference, trainable_params, per_layer


def _numel_per_device(tensors, mesh, layout: str, lora_rank: int, targets) -> tuple[int, int]:
    """Elements one device holds of the base parameters and of the LoRA adapters (0 without)."""
    base = sum(shard_numel(shape, axes, mesh, layout) for _, shape, _, axes in tensors)
    if not lora_rank:
        return base, 0
    adapters = lora_tensors(tensors, lora_rank, targets)
    return base, sum(shard_numel(shape, axes, mesh, layout) for _, shape, axes in adapters)


def _activation_bytes(
    cfg, mesh, layout, *, n, m, S, T, c, attention, attention_block_size, remat, lora_act
):
    """Per-device (kv_cache, activations) bytes (formulas in the module docstring).

    ``n`` / ``m``: the rows of one forward/backward pass / of the sampler on
    one device; S = P + T tokens per row; ``T`` here the completion tokens
    scored at a time (the logits); ``c`` bytes per activation element;
    ``lora_act`` the adapters' bytes per layer and token.
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
        + (6 if gelu else 4) * F // tp_f
    )
    blockwise = 0
    if attention == "blockwise":
        per_layer_token += 8 * (H // tp_h)
        blockwise = 5 * 4 * n * (H // tp_h) * S * min(attention_block_size, S)
    elif attention == "splash":
        per_layer_token += 4 * (H // tp_h)
    else:
        per_layer_token += (4 + c) * (H // tp_h) * S
    logits = n * T * 8 * (V // tp_v) + blockwise
    per_layer_token += lora_act
    if remat:
        per_token = L * c * D + per_layer_token
    else:
        per_token = L * per_layer_token
    return kv_cache, n * S * per_token + logits


def _hint(est: MemoryEstimate, part: str) -> str:
    if part in ("params", "grads", "optimizer", "reference"):
        if est.layout == "dp":
            hint = "use layout fsdp (it shards parameters, gradients and optimizer state)"
        elif est.layout == "fsdp":
            hint = "use more fsdp devices, or layout fsdp_tp with tensor > 1"
        else:
            hint = "use more fsdp or tensor devices, or bfloat16 parameters"
        return hint + (", or beta = 0 (no reference model)" if part == "reference" else "")
    if part == "learned":
        return "shard the reward model or judge with more fsdp devices, or use a smaller one"
    if part == "activations":
        return (
            "use remat (model.remat = True), a smaller minibatch (train.minibatch_size) or "
            "more gradient-accumulation steps (optim.grad_accum), or more data/fsdp devices"
        )
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
    run, model_cfg_like, mesh_shape: Mapping[str, int], budget_bytes=None, learned_bytes=0
):
    """:func:`plan` for a training run (a ``grpo_jax.run.config.RunConfig``).

    Rows and lengths come from the run: one forward/backward pass holds
    ``(train.minibatch_size or B * G) / optim.grad_accum`` rows (or the warm
    start's batch, if bigger); the sampler decodes ``B * G`` rows (or
    ``eval.batch_size``, if bigger); prompts are at most the largest of
    ``sampling.prompt_buckets`` long, completions ``sampling.max_new_tokens``.
    With ``sampling.param_dtype`` the sampler's copy of the parameters is
    counted while sampling, and the rollouts' KV cache is in its dtype
    (evaluation's, in the model's). An engine that counts its own KV cache (the
    paged engine: its pool) gives the rollouts' (``Engine.kv_bytes``). With
    either, the KV cache counted is the larger of the rollouts' and evaluation's.
    Without ``budget_bytes``, the run's ``mesh.memory_budget_gb`` (when > 0) is
    the budget.
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
    budget = budget_bytes if budget_bytes is not None else device_memory_bytes()
    if budget is not None:
        check_budget(est, budget)
    return est


def _run_kwargs(run, mesh_shape) -> dict:
    """:func:`plan`'s arguments from a run, less ``sample_rows`` (the budget not checked)."""
    n = run.train.batch_size * run.grpo.G
    rows = (run.train.minibatch_size or n) // run.optim.grad_accum
    if run.warm_start.enabled:
        rows = max(rows, run.warm_start.batch_size)
    return dict(
        mesh_shape=mesh_shape,
        layout=run.mesh.layout,
        budget_bytes=math.inf,
        batch_rows=rows,
        seq_len=run.sampling.max_new_tokens,
        prompt_len=max(run.sampling.prompt_buckets),
        beta=run.grpo.beta,
        logits_chunk=run.train.logits_chunk,
        **_lora_kwargs(run),
    )


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
    axes are 1, as ``grpo_jax.rollout.staleness.sampler_mesh`` makes them) and the KV
    cache of the step's B * G rows split over its batch shards; no optimizer
    state, gradients, activations or reference (the learner mesh holds those,
    and evaluates).
    """
    est = plan_run(run, model_cfg_like, mesh_shape, budget_bytes=math.inf)
    kv = _rollout_kv(run, model_cfg_like, mesh_shape)  # training rows only
    if est.sampler_copy:  # the copy in sampling.param_dtype is all it holds of the policy
        est = dataclasses.replace(est, params=est.sampler_copy, sampler_copy=0)
    est = dataclasses.replace(est, grads=0, optimizer=0, reference=0, activations=0, kv_cache=kv)
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
