"""Each program of a run by the memory plan, its roofline time, and the settings that make a
run fit a topology.

The plan's figures (``grpo_jax.run.memory.plan_programs``, whose terms are in that module)
are computed before anything is compiled: they are what refuses a run that cannot fit, in
under a second, and what the compiled programs are checked against (docs/pods.md).
"""

from __future__ import annotations

import math

from grpo_jax.core.errors import ConfigError
from grpo_jax.core.sharding import EXPERT_AXIS
from grpo_jax.models import CheckpointError
from grpo_jax.models.hf import open_checkpoint
from grpo_jax.reward_models import REFERENCE
from grpo_jax.reward_models import model as reward_model_lib
from grpo_jax.run import memory

GiB = 2**30


def needs(run, cfg, mesh_shape) -> dict[str, memory.ProgramPlan]:
    """{program: its plan} (``grpo_jax.run.memory.plan_programs``), with the learned reward
    model's and the judge's scoring passes when the run has them (``memory.plan_learned``;
    their checkpoints' config.json and safetensors headers are read, no weight)."""
    learned = _learned(run, cfg, mesh_shape)
    total = sum(weights for _, _, _, weights in learned)
    out = memory.plan_programs(run, cfg, mesh_shape, learned_bytes=total)
    est = memory.plan_run(run, cfg, mesh_shape, budget_bytes=math.inf, learned_bytes=total)
    policy = est.params + est.optimizer + est.reference + est.teacher
    for name, section, model_cfg, weights in learned:
        resident = policy + total - weights  # all else the run holds beside it
        if not weights:  # the reference as judge: the reference's weights are its argument
            weights, resident = est.reference, resident - est.reference
        out[name] = memory.plan_learned(
            name, run, model_cfg, mesh_shape, weights=weights, section=section, resident=resident
        )
    return out


def _learned(run, cfg, mesh_shape) -> list:
    """[(program, its config section, its model's config, its weights' bytes per device)]:
    the reward model's and a judge's of their own checkpoint (0 bytes for the reference)."""
    out, layout = [], run.mesh.layout
    for name, section, classifier in (
        ("reward_model", run.reward_model, True),
        ("judge", run.judge, False),
    ):
        if not section.path:
            continue
        shards = int(mesh_shape.get("data", 1)) * int(mesh_shape.get("fsdp", 1))
        if section.batch_size % shards:  # as the run refuses it (grpo_jax.reward_models)
            raise ConfigError(
                f"config key '{name}.batch_size' = {section.batch_size} must be a multiple "
                f"of the mesh's {shards} batch shards"
            )
        if name == "judge" and section.path == REFERENCE:
            out.append((name, section, cfg, 0))
            continue
        try:
            model_cfg = open_checkpoint(section.path, dtype="float32", param_dtype="float32")[2]
            weights = reward_model_lib.checkpoint_bytes(
                section.path, mesh_shape, layout, classifier=classifier
            )
        except CheckpointError as e:
            raise ConfigError(f"config key '{name}.path' = {section.path!r}: {e}") from None
        out.append((name, section, model_cfg, weights))
    return out


# ---------------------------------------------------------------------------
# FLOPs of the model and the roofline.


def model_flops(run, cfg, chips: int) -> dict[str, float]:
    """Per chip, the FLOPs a step needs by the model alone (6 per parameter and trained
    token, 4 with LoRA, 2 per parameter and scored token, the LM head on completions only,
    each prompt once per group; attention's scores left out): what an MFU counts as useful.
    A mixture of experts counts the parameters a token computes with
    (``ModelConfig.active_params``: K of each sparse layer's E experts)."""
    sh_tokens_prompt = run.train.batch_size * max(run.sampling.prompt_buckets)
    N, T = run.train.batch_size * run.grpo.G, run.completion_slots[0]
    embed = cfg.vocab_size * cfg.hidden_size
    body = cfg.active_params - embed * (1 if cfg.tie_embeddings else 2)
    tokens = sh_tokens_prompt + N * T
    # LoRA trains adapters on a frozen base (LM head included): no weight gradient of the
    # base's matmuls, 4 FLOPs per parameter and token where full training takes 6.
    k = 4 if run.model.lora.enabled else 6
    train = run.grpo.mu * (k * body * tokens + k * embed * N * T)
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
    sh = memory.run_shapes(run, cfg, mesh_shape)
    weights = est.params // sh.p * sh.c
    if program == "update":
        N = sh.N
        updates = run.grpo.mu * max(1, N // (run.train.minibatch_size or N))
        passes = updates * run.optim.grad_accum * 3  # forward, backward (weights twice)
        state = updates * (est.params + est.optimizer) * 2
        return passes * weights + state + est.scoring
    if program == "decode":
        return sh.T * (weights + est.kv_cache)
    return weights + est.kv_cache


# ---------------------------------------------------------------------------
# Settings that fit.


def fits(run, cfg, mesh_shape, limit: float, headroom: float = 0.9):
    """(every program within ``headroom`` x ``limit``, the program that needs most)."""
    worst = max(needs(run, cfg, mesh_shape).values(), key=lambda n: n.total)
    return worst.total <= headroom * limit, worst


def suggest(run, cfg, chips: int, limit: float, slices: int = 1):
    """Overrides (config key -> value) that make ``run`` fit ``chips`` chips of ``limit``
    bytes each, by the plan, changing as little as it can: the mesh first (the chips that
    ``mesh.expert`` leaves in fsdp, data over the slices), then more gradient-accumulation
    steps, a smaller logits chunk, tensor parallelism, splash attention, remat, scanned layers
    (the last the most disruptive). None when nothing tried fits.

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

    expert = run.mesh.expert  # the run's own: its experts stay split as it asks
    base = {"mesh.data": slices, "mesh.fsdp": chips // (slices * expert), "mesh.tensor": 1}
    N = run.train.batch_size * run.grpo.G
    minibatch = run.train.minibatch_size or N
    # The run's own value first, then those that need less memory, least disruptive innermost.
    own_accum, own_chunk = run.optim.grad_accum, run.train.logits_chunk
    accums = [own_accum] + [a for a in (2, 4, 8, 16, 32, 64) if a > own_accum]
    accums = [a for a in accums if minibatch % a == 0]
    chunks = [own_chunk] + [x for x in (512, 256, 128, 64, 32) if x < (own_chunk or 1 << 30)]
    # Nothing fits when the training state alone, split over every chip, does not.
    est = memory.plan_run(run, cfg, {"fsdp": chips}, budget_bytes=math.inf)
    if est.params + est.optimizer + est.reference + est.teacher > limit:
        return None
    plans = [
        (scan, remat, attention, tensor, accum, chunk)
        for scan in dict.fromkeys((bool(cfg.scan_layers), True))
        for remat in dict.fromkeys((bool(cfg.remat), True))
        for attention in dict.fromkeys((cfg.attention, "splash"))  # no [T, S] scores
        for tensor in (1, 2, 4, 8)
        for accum in accums
        for chunk in chunks
    ]
    for scan, remat, attention, tensor, accum, chunk in plans:
        if chips % (tensor * slices * expert):
            continue
        fsdp = chips // (tensor * slices * expert)
        over = dict(base, **{"mesh.fsdp": fsdp, "mesh.tensor": tensor})
        if tensor > 1:
            over["mesh.layout"] = "fsdp_tp"
        over.update({"optim.grad_accum": accum, "train.logits_chunk": chunk})
        over.update({"model.remat": remat, "model.scan_layers": scan, "model.attention": attention})
        mesh_shape = {"data": over["mesh.data"], "fsdp": fsdp, "tensor": tensor}
        if expert != 1:
            mesh_shape[EXPERT_AXIS] = expert
        shards = over["mesh.data"] * over["mesh.fsdp"]
        if N % (shards * run.grpo.G) or (minibatch // accum) % shards:
            continue
        r, c = with_(run, cfg, **over)
        ok, _ = fits(r, c, mesh_shape, limit)
        if ok:
            changed = {k: v for k, v in over.items() if _current(run, k, chips) != v}
            return changed, r, c, mesh_shape
    return None


def _current(run, key: str, chips: int):
    """The run's value of ``key``; a mesh axis as it lays out ``chips`` (-1 resolved)."""
    section, field = key.split(".")
    if section == "mesh" and field in ("data", "fsdp", "tensor"):
        try:
            return mesh_shape(run, chips)[field]
        except Exception:  # noqa: BLE001 - a mesh that does not lay them out: every axis changes
            return None
    return getattr(getattr(run, section), field, None)


def mesh_shape(run, chips: int) -> dict[str, int]:
    """The run's mesh axes on ``chips`` devices, -1 resolved as ``sharding.make_mesh`` does,
    with "expert" when ``mesh.expert`` is larger than 1 (a mesh has that axis only then); a
    one-line ConfigError when they do not multiply to ``chips``."""
    axes = {"data": run.mesh.data, "fsdp": run.mesh.fsdp, "tensor": run.mesh.tensor}
    if run.mesh.expert != 1:
        axes[EXPERT_AXIS] = run.mesh.expert
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


def check_expert_axis(run, cfg, source: str) -> None:
    """A one-line ConfigError unless ``mesh.expert`` splits the model's experts evenly (as a
    run refuses it, ``run.builders.check_expert_axis``; here naming where the model's sizes
    came from): a size that does not divide them would leave them whole on every chip."""
    expert, num = run.mesh.expert, cfg.num_experts
    if expert == 1 or (num and num % expert == 0):
        return
    if not num:
        raise ConfigError(
            f"config key 'mesh.expert' = {expert} needs a mixture-of-experts model; {source} "
            "is dense (num_experts = 0): set mesh.expert = 1"
        )
    raise ConfigError(
        f"config key 'mesh.expert' = {expert} must divide the model's num_experts = {num} "
        f"({source})"
    )
