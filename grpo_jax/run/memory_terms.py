"""The memory plan's run terms: what a run's programs hold beside the model's terms.

The update's buffers, a scoring pass over the whole batch, the weights the sampler holds
gathered, a critic's head and targets (:func:`with_run_terms`), from the run's sizes on one
device (:class:`RunShapes`); and the per-program figures' parts (:class:`ProgramPlan`).
docs/pods.md compares them with XLA's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from grpo_jax.core.sharding import EXPERT_AXIS
from grpo_jax.models.param_tensors import param_tensors, shard_numel, tensor_ways
from grpo_jax.run.memory_model import (
    OPTIMIZER_MOMENTS,
    PLAN_AXES,
    MemoryEstimate,
    itemsize,
    moe_token_bytes,
)

# ---------------------------------------------------------------------------
# The programs of a run: what each one holds per device, beside the run's peaks.
#
# What the TPU compiler showed each program holds besides the model's terms (docs/pods.md
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
STATE_BYTES_PER_TOKEN = 4 * 3 + 4  # a decode step's token, two log-probs, its length


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
        c=itemsize(cfg.dtype), p=itemsize(cfg.param_dtype),
        n_s=N // s if N % s == 0 else N, b_s=B // s if B % s == 0 else B,
        tp_h=tensor_ways(cfg.num_heads, "heads", mesh, layout),
        tp_k=tensor_ways(cfg.num_kv_heads, "kv_heads", mesh, layout),
        tp_v=tensor_ways(cfg.vocab_size, "vocab", mesh, layout),
        tp_f=tensor_ways(cfg.mlp_dim, "mlp", mesh, layout),
        scan=bool(cfg.scan_layers), sharded=layout != "dp" and split > 1,
    )  # fmt: skip


def model_sizes(cfg, mesh_shape, layout) -> tuple[int, int, int]:
    """(parameters, those outside the embedding and LM head, the largest tensor's shard)."""
    tensors = param_tensors(cfg)
    total = sum(math.prod(shape) for _, shape, _, _ in tensors)
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    mesh = {a: int(mesh_shape.get(a, 1)) for a in PLAN_AXES}
    largest = max(shard_numel(shape, axes, mesh, layout) for _, shape, _, axes in tensors)
    return total, total - embed, largest


def attention_per_row(cfg, sh: RunShapes, queries: int, keys: int) -> int:
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
    attention = sh.n_s * attention_per_row(cfg, sh, sh.T, sh.S)
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


def with_run_terms(est: MemoryEstimate, run, cfg, mesh_shape) -> MemoryEstimate:
    """``est`` with the run's update buffers, scoring pass and gathered weights."""
    sh = run_shapes(run, cfg, mesh_shape)
    total, body, largest = model_sizes(cfg, mesh_shape, run.mesh.layout)
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


def layer_token_bytes(cfg, sh: RunShapes, mesh_shape, layout: str) -> int:
    """One layer's activations per token of a forward pass with no cache kept: the
    residual, norms and projections, and the MLP's (or the experts') widest."""
    L, D = cfg.num_layers, cfg.hidden_size
    K, Dh, H = cfg.num_kv_heads // sh.tp_k, cfg.head_dim, cfg.num_heads // sh.tp_h
    dense = sh.c * 4 * cfg.mlp_dim // sh.tp_f if len(cfg.sparse_layers) < L else 0
    mlp = max(dense, moe_token_bytes(cfg, mesh_shape, layout, sh.c))
    return sh.c * (6 * D + 2 * H * Dh + 2 * K * Dh) + mlp
