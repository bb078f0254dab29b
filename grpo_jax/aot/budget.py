"""What each program of a run needs per chip by the memory plan, its roofline time, and
the settings that make a run fit a topology.

The plan's figures are computed before anything is compiled: they are what refuses a run
that cannot fit, in under a second, and what the compiled programs are checked against.
Per chip, in bytes (``grpo_jax.run.memory``'s terms: params, optimizer, reference,
gradients, activations, KV cache; s the batch shards, n_s = N / s the rows of a whole-batch
pass, c the compute dtype's bytes, p the parameters'):

  update    the arguments (parameters, optimizer state, reference, batch)
            + the larger of the training and the scoring phase (they never overlap)
            + code
  training  gradients (twice with grad_accum > 1: the accumulation's carry)
            + activations
            + the LM head's gradient V x D x (4 + 2c): float32 and whole inside the
              logits-chunk loop, with the reduction's input and output in the compute dtype
            + two gathered layers in the compute dtype (an fsdp all-gather in flight)
            + three copies of the largest parameter tensor's shard: the non-finite guard's
              ``lax.cond`` writes new parameters and both moments, not in place
  scoring   (beta > 0, grpo.old_logps "recompute" or train.track_update: a pass over the
            whole batch, n_s rows per chip) the larger of
              the prompt-once KV cache (twice for scanned layers: the stacked cache is
              copied) + one layer's attention scores and probabilities, and
              one logits chunk, three float32 copies (logits, shifted, exponentials)
  prefill   parameters + the KV cache of its N / s rows + two gathered layers and the
            LM head in the compute dtype + one layer's activations over the B / s prompts
  decode    parameters + the KV cache + the decode state + the gathered weights: the
            whole model in the compute dtype (unrolled layers: XLA gathers every layer
            before the loop), or with scanned layers the stacked cache's copy, two layers
            and the LM head
  paged     the engine's pool (whole on every chip) + parameters + the whole model gathered
            + one layer's keys and values gathered for every slot [R, M x Z, K, Dh]

While the sampler runs, the optimizer state and the reference parameters are resident
beside it (not its arguments): a sampler program's need is its own plus those.
Code is an allowance of ``CODE_BYTES`` before compiling (the recipes' updates compile to
0.08-0.15 GiB), the compiled size after.
"""

from __future__ import annotations

import dataclasses
import math

from grpo_jax.run import memory

GiB = 2**30
CODE_BYTES = int(0.1 * GiB)
# Rows a decode step writes per token: token, log-probs (2), length, done, key data.
_STATE_BYTES_PER_TOKEN = 4 * 3 + 4


@dataclasses.dataclass(frozen=True)
class Need:
    """One program's bytes per chip by the plan: ``own`` (what the program holds) and
    ``resident`` (what stays on the chip beside it, not its argument)."""

    program: str
    own: int
    resident: int = 0

    @property
    def total(self) -> int:
        return self.own + self.resident


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes the formulas read, per chip where it says so."""

    N: int
    B: int
    P: int
    T: int
    S: int
    C: int  # completion tokens scored at a time
    c: int  # compute bytes
    p: int  # parameter bytes
    shards: int
    n_s: int  # rows of a whole-batch pass on one chip
    b_s: int  # prompts on one chip
    tp_h: int
    tp_k: int
    tp_v: int
    tp_f: int
    scan: bool
    sharded: bool  # parameters split over fsdp or tensor


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2}[str(dtype)]


def shapes(run, cfg, mesh_shape) -> Shapes:
    from grpo_jax.models.param_tensors import tensor_ways

    mesh = {a: int(mesh_shape.get(a, 1)) for a in ("data", "fsdp", "tensor")}
    s = mesh["data"] * mesh["fsdp"]
    B, G = run.train.batch_size, run.grpo.G
    N, P, T = B * G, max(run.sampling.prompt_buckets), run.sampling.max_new_tokens
    layout = run.mesh.layout
    tp = layout == "fsdp_tp"
    return Shapes(
        N=N, B=B, P=P, T=T, S=P + T, C=min(run.train.logits_chunk, T) or T,
        c=_itemsize(cfg.dtype), p=_itemsize(cfg.param_dtype), shards=s,
        n_s=N // s if N % s == 0 else N, b_s=B // s if B % s == 0 else B,
        tp_h=tensor_ways(cfg.num_heads, "heads", mesh, layout),
        tp_k=tensor_ways(cfg.num_kv_heads, "kv_heads", mesh, layout),
        tp_v=tensor_ways(cfg.vocab_size, "vocab", mesh, layout),
        tp_f=tensor_ways(cfg.mlp_dim, "mlp", mesh, layout),
        scan=bool(cfg.scan_layers),
        sharded=layout != "dp" and mesh["fsdp"] * (mesh["tensor"] if tp else 1) > 1,
    )  # fmt: skip


def _tensors(cfg, mesh_shape, layout):
    from grpo_jax.models.param_tensors import param_tensors, shard_numel

    tensors = param_tensors(cfg)
    total = sum(math.prod(shape) for _, shape, _, _ in tensors)
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    mesh = {a: int(mesh_shape.get(a, 1)) for a in ("data", "fsdp", "tensor")}
    largest = max(shard_numel(shape, axes, mesh, layout) for _, shape, _, axes in tensors)
    return total, total - embed, largest


def _scores_per_row(cfg, sh: Shapes, queries: int, keys: int) -> int:
    """One layer's attention working set for one row: einsum's scores and probabilities,
    blockwise's block, splash's log-sum-exp (its blocks live in the core's VMEM)."""
    H = cfg.num_heads // sh.tp_h
    if cfg.attention == "splash":
        return 8 * H * queries
    if cfg.attention == "blockwise":
        return 20 * H * queries * min(cfg.attention_block_size, keys)
    return (4 + sh.c) * H * queries * keys


def scoring_phase(run, cfg, sh: Shapes) -> int:
    """A pass over the whole batch (the reference's, "recompute", track_update), or 0."""
    scores = run.grpo.beta > 0 or run.grpo.old_logps == "recompute" or run.train.track_update
    if not scores:
        return 0
    L, K, Dh = cfg.num_layers, cfg.num_kv_heads // sh.tp_k, cfg.head_dim
    cache = 2 * L * sh.n_s * sh.S * K * Dh * sh.c * (2 if sh.scan else 1)
    attention = sh.n_s * _scores_per_row(cfg, sh, sh.T, sh.S)
    logits = sh.n_s * sh.C * (cfg.vocab_size // sh.tp_v) * 4 * 3
    return max(cache + attention, logits)


def batch_bytes(sh: Shapes) -> int:
    """A RolloutBatch's bytes on one chip (core.batch.batch_spec's arrays)."""
    return sh.n_s * (sh.P * 5 + sh.T * (4 + 1 + 4 + 4) + 16)


def _gathered(cfg, sh: Shapes, total: int, body: int, kv: int) -> int:
    """The weights a sampler program holds gathered, in the compute dtype (none when every
    device holds them whole)."""
    if not sh.sharded:
        return 0
    if not sh.scan:
        return total * sh.c
    return kv + 2 * body // cfg.num_layers * sh.c + cfg.vocab_size * cfg.hidden_size * sh.c


def _prefill_gathered(cfg, sh: Shapes, body: int) -> int:
    """The weights the prefill holds gathered in the compute dtype: no loop runs over the
    tokens, so a layer at a time (two in flight) and the LM head."""
    if not sh.sharded:
        return 0
    return 2 * body // cfg.num_layers * sh.c + cfg.vocab_size * cfg.hidden_size * sh.c


def needs(run, cfg, mesh_shape, *, learned_bytes: int = 0) -> dict[str, Need]:
    """{program: :class:`Need`} for the programs a run compiles (module docstring)."""
    est = memory.plan_run(run, cfg, mesh_shape, budget_bytes=math.inf, learned_bytes=learned_bytes)
    sh = shapes(run, cfg, mesh_shape)
    total, body, largest = _tensors(cfg, mesh_shape, run.mesh.layout)
    L, D, V = cfg.num_layers, cfg.hidden_size, cfg.vocab_size
    K, Dh, H = cfg.num_kv_heads // sh.tp_k, cfg.head_dim, cfg.num_heads // sh.tp_h
    accum = 2 if run.optim.grad_accum > 1 else 1
    training = est.grads * accum + est.activations + 3 * largest * sh.p
    if sh.sharded:  # the head's gradient whole in the chunk loop; layers gathered in flight
        training += V * D * (4 + 2 * sh.c) + 2 * body // L * sh.c
    scoring = scoring_phase(run, cfg, sh)
    args = est.params + est.optimizer + est.reference + batch_bytes(sh)
    out = {
        "update": Need("update", args + max(training, scoring) + CODE_BYTES, est.learned),
    }
    if scoring:
        out["scoring"] = Need(
            "scoring",
            est.params + batch_bytes(sh) + scoring + CODE_BYTES,
            est.optimizer + est.learned,
        )
    resident = est.optimizer + est.reference + est.learned
    weights = est.sampler_copy or est.params
    if getattr(run.sampling, "engine", "static") == "paged":
        from grpo_jax.sampling import paged_pool

        scfg = run.sampling.sampler()
        pool = est.kv_cache
        shape = paged_pool.engine_shape(
            scfg, sh.B, run.grpo.G, sh.P, window=paged_pool.model_window(cfg)
        )
        gather = 2 * shape.slots * shape.table * shape.page_size * K * Dh * sh.c
        gather += shape.slots * H * shape.table * shape.page_size * 4
        base = weights + pool + total * sh.c + CODE_BYTES
        out["paged_prefill"] = Need("paged_prefill", base + gather, resident)
        out["paged_decode"] = Need("paged_decode", base + gather, resident)
        return out
    kv = 2 * L * sh.n_s * sh.S * K * Dh * sh.c
    gathered = _gathered(cfg, sh, total, body, kv)
    state = sh.n_s * sh.T * _STATE_BYTES_PER_TOKEN + sh.n_s * sh.S
    per_token = sh.c * (6 * D + 2 * H * Dh + 2 * K * Dh + 4 * cfg.mlp_dim // sh.tp_f)
    layer = sh.b_s * sh.P * per_token + sh.b_s * _scores_per_row(cfg, sh, sh.P, sh.P)
    out["prefill"] = Need(
        "prefill", weights + kv + _prefill_gathered(cfg, sh, body) + layer + CODE_BYTES, resident
    )
    out["decode"] = Need("decode", weights + kv + state + gathered + CODE_BYTES, resident)
    return out


# ---------------------------------------------------------------------------
# FLOPs of the model and the roofline.


def model_flops(run, cfg, chips: int) -> dict[str, float]:
    """Per chip, the FLOPs a step needs by the model alone (6 per parameter and trained
    token, 2 per parameter and scored token, the LM head on completions only, each prompt
    once per group; attention's scores left out): what an MFU counts as useful."""
    sh_tokens_prompt = run.train.batch_size * max(run.sampling.prompt_buckets)
    N, T = run.train.batch_size * run.grpo.G, run.sampling.max_new_tokens
    embed = cfg.vocab_size * cfg.hidden_size
    body = cfg.num_params - embed * (1 if cfg.tie_embeddings else 2)
    tokens = sh_tokens_prompt + N * T
    train = run.grpo.mu * (6 * body * tokens + 6 * embed * N * T)
    passes = (run.grpo.beta > 0) + (run.grpo.old_logps == "recompute") + run.train.track_update
    score = 2 * body * tokens + 2 * embed * N * T
    sample = 2 * body * tokens + 2 * embed * N * T
    return {
        "update": (train + passes * score) / chips,
        "scoring": score / chips,
        "decode": 2 * (body + embed) * N * T / chips,
        # the prompts once, the LM head on their last token only
        "prefill": (2 * body * sh_tokens_prompt + 2 * embed * run.train.batch_size) / chips,
        "sampling": sample / chips,
    }


def roofline(flops: float, collective_bytes: float, hbm_bytes: float, chip) -> dict:
    """Seconds per chip at the chip's peaks: compute, HBM traffic, interconnect; the
    slowest bounds the program."""
    t = {
        "compute_s": flops / chip.peak_flops,
        "hbm_s": hbm_bytes / chip.hbm_bandwidth,
        "ici_s": collective_bytes / chip.ici_bandwidth,
    }
    t["roofline_s"] = max(t.values())
    t["bound"] = max(("compute_s", "hbm_s", "ici_s"), key=t.get).removesuffix("_s")
    return t


def hbm_traffic(program: str, run, cfg, mesh_shape) -> float:
    """Bytes one chip reads and writes from HBM in one run of ``program``, counted from the
    model (XLA's "bytes accessed" counts loop bodies once, and a walk of the compiled text
    charges an in-flight all-gather to every fusion it passes through): the weights read per
    pass in the compute dtype, the optimizer state read and written per update, the KV
    cache read per decode step."""
    est = memory.plan_run(run, cfg, mesh_shape, budget_bytes=math.inf)
    sh = shapes(run, cfg, mesh_shape)
    weights = est.params // sh.p * sh.c
    if program == "update":
        N = sh.N
        updates = run.grpo.mu * max(1, N // (run.train.minibatch_size or N))
        passes = updates * run.optim.grad_accum * 3  # forward, backward (weights twice)
        state = updates * (est.params + est.optimizer) * 2
        return passes * weights + state + scoring_phase(run, cfg, sh)
    if program == "decode":
        return sh.T * (weights + est.kv_cache)
    return weights + est.kv_cache


# ---------------------------------------------------------------------------
# Settings that fit.


def fits(run, cfg, mesh_shape, limit: float, headroom: float = 0.9) -> tuple[bool, Need]:
    """(every program within ``headroom`` x ``limit``, the program that needs most)."""
    worst = max(needs(run, cfg, mesh_shape).values(), key=lambda n: n.total)
    return worst.total <= headroom * limit, worst


def suggest(run, cfg, chips: int, limit: float, slices: int = 1):
    """Overrides (config key -> value) that make ``run`` fit ``chips`` chips of ``limit``
    bytes each, by the plan, changing as little as it can: the mesh first (all chips in
    fsdp, data over the slices), then more gradient-accumulation steps, a smaller logits
    chunk, remat, scanned layers, tensor parallelism. None when nothing tried fits.

    Returns (overrides, the run with them, its model config, the mesh shape).
    """
    import dataclasses as dc

    def with_(r, c, **kw):
        sections = {}
        for key, value in kw.items():
            section, field = key.split(".")
            sections.setdefault(section, {})[field] = value
        for section, fields in sections.items():
            if section == "model":
                c = c.replace(**fields)
                r = dc.replace(r, model=dc.replace(r.model, **fields))
            else:
                r = dc.replace(r, **{section: dc.replace(getattr(r, section), **fields)})
        return r, c

    base = {"mesh.data": slices, "mesh.fsdp": chips // slices, "mesh.tensor": 1}
    N = run.train.batch_size * run.grpo.G
    minibatch = run.train.minibatch_size or N
    # The run's own value first, then those that need less memory, least disruptive innermost.
    own_accum, own_chunk = run.optim.grad_accum, run.train.logits_chunk
    accums = [own_accum] + [a for a in (2, 4, 8, 16, 32, 64) if a > own_accum]
    accums = [a for a in accums if minibatch % a == 0]
    chunks = [own_chunk] + [x for x in (512, 256, 128, 64, 32) if x < (own_chunk or 1 << 30)]
    # Nothing fits when the training state alone, split over every chip, does not.
    est = memory.plan_run(run, cfg, {"fsdp": chips}, budget_bytes=math.inf)
    if est.params + est.optimizer + est.reference > limit:
        return None
    plans = [
        (scan, remat, tensor, accum, chunk)
        for scan in dict.fromkeys((bool(cfg.scan_layers), True))
        for remat in dict.fromkeys((bool(cfg.remat), True))
        for tensor in (1, 2, 4, 8)
        for accum in accums
        for chunk in chunks
    ]
    seen = set()
    for scan, remat, tensor, accum, chunk in plans:
        if (scan, remat, tensor, accum, chunk) in seen or chips % (tensor * slices):
            continue
        seen.add((scan, remat, tensor, accum, chunk))
        over = dict(base, **{"mesh.fsdp": chips // (tensor * slices), "mesh.tensor": tensor})
        if tensor > 1:
            over["mesh.layout"] = "fsdp_tp"
        over.update({"optim.grad_accum": accum, "train.logits_chunk": chunk})
        over.update({"model.remat": remat, "model.scan_layers": scan})
        mesh_shape = {"data": over["mesh.data"], "fsdp": over["mesh.fsdp"], "tensor": tensor}
        shards = over["mesh.data"] * over["mesh.fsdp"]
        if N % (shards * run.grpo.G) or (minibatch // accum) % shards:
            continue
        r, c = with_(run, cfg, **over)
        ok, _ = fits(r, c, mesh_shape, limit)
        if ok:
            changed = {k: v for k, v in over.items() if _current(run, k) != v}
            return changed, r, c, mesh_shape
    return None


def _current(run, key: str):
    section, field = key.split(".")
    return getattr(getattr(run, section), field, None)


def mesh_shape(run, chips: int) -> dict[str, int]:
    """The run's mesh axes on ``chips`` devices, -1 resolved as ``sharding.make_mesh`` does;
    a one-line ConfigError when they do not multiply to ``chips``."""
    from grpo_jax.core.errors import ConfigError

    axes = {"data": run.mesh.data, "fsdp": run.mesh.fsdp, "tensor": run.mesh.tensor}
    known = math.prod(v for v in axes.values() if v != -1)
    free = [a for a, v in axes.items() if v == -1]
    if len(free) > 1 or (free and chips % known) or (not free and known != chips):
        raise ConfigError(
            f"config section 'mesh' = {axes} does not lay out the topology's {chips} chips "
            "(their product must be the chips; one axis may be -1, the rest)"
        )
    if free:
        axes[free[0]] = chips // known
    return axes
