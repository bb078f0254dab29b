"""Per-family table: Hugging Face tensor name -> model parameter path + transform.

Hugging Face stores ``nn.Linear`` weights as [out, in] with heads flattened into the out (or
in) dimension; the model keeps [in, out] with heads as their own axis, so every projection
is a reshape plus a transpose, each a numpy view of the memory-mapped checkpoint tensor (a
loader slices one device's shard without reading the rest). The table, and how the norms
differ by family: docs/models.md, "Hugging Face checkpoints".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from grpo_jax.models.config import ModelConfig

# Where the text model's tensors live: plain causal LMs, then Gemma 3
# multimodal checkpoints (transformers >= 4.52, then older).
PREFIXES = ("model.", "model.language_model.", "language_model.model.")
LM_HEADS = ("lm_head.weight", "language_model.lm_head.weight")
# Checkpoint tensors that are not weights of the text model and are skipped.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint tensor: its name, our param path, and the transforms both ways.

    ``expert``: the tensor is expert e's slice of a parameter stacked over the experts
    (index e of its leading axis, after the layer axis of a scanned model).
    """

    hf_name: str
    path: tuple[str | int, ...]
    hf_shape: tuple[int, ...]
    to_param: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    expert: int | None = None


def _same(x):
    return x


def _transpose(x):
    return x.T


def _in_proj(n: int, dh: int):
    """[n*Dh, D] <-> [D, n, Dh] (q/k/v projections)."""
    to_param = lambda w: w.reshape(n, dh, w.shape[-1]).transpose(2, 0, 1)
    to_hf = lambda p: p.transpose(1, 2, 0).reshape(n * dh, p.shape[0])
    return to_param, to_hf


def _out_proj(n: int, dh: int):
    """[D, n*Dh] <-> [n, Dh, D] (the output projection)."""
    to_param = lambda w: w.reshape(w.shape[0], n, dh).transpose(1, 2, 0)
    to_hf = lambda p: p.transpose(2, 0, 1).reshape(p.shape[2], n * dh)
    return to_param, to_hf


def _split_heads(n: int, dh: int):
    """[n*Dh] <-> [n, Dh] (q/k/v biases)."""
    return (lambda b: b.reshape(n, dh)), (lambda p: p.reshape(n * dh))


def _expert_entries(cfg: ModelConfig, p: str, layer: tuple) -> list[Entry]:
    """A sparse layer's router ``mlp.gate`` [E, D] and each expert's three projections
    ``mlp.experts.<e>.{gate,up,down}_proj`` (Qwen3-MoE's names)."""
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.expert_mlp_dim
    t = (_transpose, _transpose)
    out = [Entry(p + "mlp.gate.weight", (*layer, "mlp", "router"), (E, D), *t)]
    for e in range(E):
        q = f"{p}mlp.experts.{e}."
        out += [
            Entry(q + "gate_proj.weight", (*layer, "mlp", "gate_experts"), (F, D), *t, expert=e),
            Entry(q + "up_proj.weight", (*layer, "mlp", "up_experts"), (F, D), *t, expert=e),
            Entry(q + "down_proj.weight", (*layer, "mlp", "down_experts"), (D, F), *t, expert=e),
        ]
    return out


def _gpt_oss_entries(cfg: ModelConfig, p: str, layer: tuple) -> list[Entry]:
    """A GPT-OSS layer's router ``mlp.router`` (weight [E, D], bias [E]) and its experts,
    stacked in the checkpoint as the model keeps them: ``gate_up_proj`` [E, D, 2F] (gate and
    up interleaved), ``down_proj`` [E, F, D] and their biases. MXFP4 checkpoints store the
    two weights as ``*_blocks`` and ``*_scales``, dequantised on reading (``models.mxfp4``)."""
    D, E, F = cfg.hidden_size, cfg.num_experts, cfg.expert_mlp_dim
    same, t = (_same, _same), (_transpose, _transpose)
    m, q = (*layer, "mlp"), f"{p}mlp."
    return [
        Entry(q + "router.weight", (*m, "router"), (E, D), *t),
        Entry(q + "router.bias", (*m, "router_bias"), (E,), *same),
        Entry(q + "experts.gate_up_proj", (*m, "gate_up_experts"), (E, D, 2 * F), *same),
        Entry(q + "experts.gate_up_proj_bias", (*m, "gate_up_bias"), (E, 2 * F), *same),
        Entry(q + "experts.down_proj", (*m, "down_experts"), (E, F, D), *same),
        Entry(q + "experts.down_proj_bias", (*m, "down_bias"), (E, D), *same),
    ]


def weight_table(
    cfg: ModelConfig, prefix: str = "model.", lm_head: str = "lm_head.weight"
) -> list[Entry]:
    """Every checkpoint tensor the model needs, in checkpoint order."""
    D, F, Dh = cfg.hidden_size, cfg.mlp_dim, cfg.head_dim
    H, K, V = cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size
    entries = [Entry(f"{prefix}embed_tokens.weight", ("embed",), (V, D), _same, _same)]
    for i in range(cfg.num_layers):
        p = f"{prefix}layers.{i}."
        layer = ("layers", i)

        def add(name, path, shape, fns=(_same, _same)):
            entries.append(Entry(p + name, layer + path, shape, *fns))

        add("input_layernorm.weight", ("attn_norm", "scale"), (D,))
        if cfg.sandwich_norm:
            add("post_attention_layernorm.weight", ("post_attn_norm", "scale"), (D,))
            add("pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), (D,))
            add("post_feedforward_layernorm.weight", ("post_mlp_norm", "scale"), (D,))
        else:
            add("post_attention_layernorm.weight", ("mlp_norm", "scale"), (D,))
        for proj, n in (("q", H), ("k", K), ("v", K)):
            add(
                f"self_attn.{proj}_proj.weight",
                ("attn", f"{proj}_proj"),
                (n * Dh, D),
                _in_proj(n, Dh),
            )
            if cfg.qkv_bias:
                add(
                    f"self_attn.{proj}_proj.bias",
                    ("attn", f"{proj}_bias"),
                    (n * Dh,),
                    _split_heads(n, Dh),
                )
        add("self_attn.o_proj.weight", ("attn", "o_proj"), (D, H * Dh), _out_proj(H, Dh))
        if cfg.out_bias:
            add("self_attn.o_proj.bias", ("attn", "o_bias"), (D,))
        if cfg.qk_norm:
            add("self_attn.q_norm.weight", ("attn", "q_norm", "scale"), (Dh,))
            add("self_attn.k_norm.weight", ("attn", "k_norm", "scale"), (Dh,))
        if cfg.attention_sinks:
            add("self_attn.sinks", ("attn", "sinks"), (H,))
        if cfg.is_sparse(i) and cfg.swiglu_limit is not None:
            entries.extend(_gpt_oss_entries(cfg, p, layer))
            continue
        if cfg.is_sparse(i):
            entries.extend(_expert_entries(cfg, p, layer))
            continue
        add("mlp.gate_proj.weight", ("mlp", "gate_proj"), (F, D), (_transpose, _transpose))
        add("mlp.up_proj.weight", ("mlp", "up_proj"), (F, D), (_transpose, _transpose))
        add("mlp.down_proj.weight", ("mlp", "down_proj"), (D, F), (_transpose, _transpose))
        if cfg.mlp_bias:
            add("mlp.gate_proj.bias", ("mlp", "gate_bias"), (F,))
            add("mlp.up_proj.bias", ("mlp", "up_bias"), (F,))
            add("mlp.down_proj.bias", ("mlp", "down_bias"), (D,))
    entries.append(Entry(f"{prefix}norm.weight", ("final_norm", "scale"), (D,), _same, _same))
    if not cfg.tie_embeddings:
        entries.append(Entry(lm_head, ("lm_head",), (V, D), _transpose, _transpose))
    return entries
