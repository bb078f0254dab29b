"""Per-family table: Hugging Face tensor name -> model parameter path + transform.

Hugging Face stores ``nn.Linear`` weights as [out, in] with heads flattened
into the out (or in) dimension; the model keeps [in, out] with heads as their
own axis, so every projection is a reshape plus a transpose. All transforms
are numpy views of the (memory-mapped) checkpoint tensor, so a loader can
slice one device's shard out of them without reading the rest.

  HF name (under ``model.``)                  param path                  HF shape -> ours
  embed_tokens.weight                         embed                       [V, D]
  norm.weight                                 final_norm.scale            [D]
  lm_head.weight (top level; untied only)     lm_head                     [V, D] -> [D, V]
  layers.i.input_layernorm.weight             layers.i.attn_norm.scale    [D]
  layers.i.self_attn.q_proj.weight            layers.i.attn.q_proj        [H*Dh, D] -> [D, H, Dh]
  layers.i.self_attn.{k,v}_proj.weight        layers.i.attn.{k,v}_proj    [K*Dh, D] -> [D, K, Dh]
  layers.i.self_attn.o_proj.weight            layers.i.attn.o_proj        [D, H*Dh] -> [H, Dh, D]
  layers.i.self_attn.{q,k,v}_proj.bias        layers.i.attn.{q,k,v}_bias  [N*Dh] -> [N, Dh]
  layers.i.self_attn.o_proj.bias              layers.i.attn.o_bias        [D]
  layers.i.self_attn.{q,k}_norm.weight        layers.i.attn.{q,k}_norm.scale  [Dh]
  layers.i.mlp.{gate,up}_proj.weight          layers.i.mlp.{gate,up}_proj [F, D] -> [D, F]
  layers.i.mlp.down_proj.weight               layers.i.mlp.down_proj      [D, F] -> [F, D]
  layers.i.mlp.*_proj.bias                    layers.i.mlp.*_bias

The norms differ by family: in Llama/Qwen ``post_attention_layernorm`` is the
norm *before* the MLP (our ``mlp_norm``); Gemma 3 has four per layer,
``input_layernorm`` -> attn_norm, ``post_attention_layernorm`` ->
post_attn_norm, ``pre_feedforward_layernorm`` -> mlp_norm,
``post_feedforward_layernorm`` -> post_mlp_norm.
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
    """One checkpoint tensor: its name, our param path, and the transforms both ways."""

    hf_name: str
    path: tuple[str | int, ...]
    hf_shape: tuple[int, ...]
    to_param: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]


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
