"""Tiny random Hugging Face checkpoints built with transformers + PyTorch on CPU, for tests.

    path = make_tiny_hf_checkpoint(tmp_path / "ckpt", "qwen2")
    model = grpo_jax.models.from_pretrained(path)
    ref = load_hf_model(path); hf_logits(ref, tokens_BxT)

Nothing is downloaded: configs are built in code, weights are random (seeded),
and the tokenizer is the project's character tokenizer with a ChatML chat
template. torch is a test-only dependency.
"""

from __future__ import annotations

import pathlib

import numpy as np

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3")

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# Per family: the config class kwargs that exercise what is special about it.
_FAMILY = {
    "llama": dict(
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500_000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "qwen2": dict(
        tie_word_embeddings=False, rope_parameters=dict(rope_type="default", rope_theta=1e6)
    ),
    "qwen3": dict(
        head_dim=32,  # Explicit and != hidden / heads.
        num_hidden_layers=3,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
    ),
    "qwen3_moe": dict(
        head_dim=16,
        num_hidden_layers=3,
        tie_word_embeddings=False,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],  # Sparse, dense, sparse.
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
    ),
    "gpt_oss": dict(
        head_dim=16,
        num_hidden_layers=3,  # sliding, full, sliding
        intermediate_size=32,
        num_local_experts=6,
        num_experts_per_tok=2,
        sliding_window=4,  # Shorter than the test sequences.
        swiglu_limit=0.3,  # Low enough that the clamps bind on this model's activations.
        tie_word_embeddings=False,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150_000.0,
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=64,
        ),
    ),
    "gemma3": dict(
        head_dim=16,
        num_hidden_layers=4,
        query_pre_attn_scalar=24,
        sliding_window=4,  # Shorter than the test sequences.
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=2.0, rope_theta=1e6),
            sliding_attention=dict(rope_type="default", rope_theta=1e4),
        ),
    ),
}


def hf_config(family: str, **overrides):
    """The transformers config object of a tiny ``family`` model."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gpt_oss": transformers.GptOssConfig,
        "gemma3": transformers.Gemma3TextConfig,
    }
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; known: {FAMILIES}")
    kwargs = {**_COMMON, **_FAMILY[family], **overrides}
    return classes[family](**kwargs)


def make_tiny_hf_checkpoint(
    path,
    family: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: str | None = None,
    tokenizer: bool = True,
    **overrides,
) -> pathlib.Path:
    """Writes a tiny random ``family`` checkpoint (config.json + safetensors) at ``path``.

    Families "llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3": vocab 320, hidden
    64, 2-4 layers, 4 query / 2 KV heads; Llama with llama3 RoPE scaling and an untied
    head, Qwen2 with q/k/v biases, Qwen3 with an explicit head_dim, Qwen3-MoE with
    6 experts (top 2, renormalised) in layers 0 and 2 and a dense layer 1, GPT-OSS with
    6 experts (top 2) in every layer, attention sinks, a sliding window of 4 on layers 0
    and 2, YaRN RoPE and a SwiGLU clamp of 0.3 that binds, Gemma 3
    with a sliding window of 4, a scaled global RoPE and final soft-capping.
    Every parameter (norms and biases too) is random, so parity tests see
    all of them. ``overrides`` go to the transformers config class;
    ``max_shard_size`` (e.g. "100KB") writes a sharded checkpoint with an
    index; ``dtype`` is the torch dtype of the saved weights.
    """
    import torch
    import transformers

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(path), **kwargs)
    if tokenizer:
        from grpo_jax.models.builtin_tokenizer import build_tokenizer

        tok = build_tokenizer()
        tok.chat_template = CHATML_TEMPLATE
        tok.save_pretrained(str(path))
    return path


def load_hf_model(path, dtype: str = "float32"):
    """The transformers model at ``path`` (eager attention, eval mode, CPU)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    return model.eval()


def hf_logits(model, tokens_BxT, attention_mask=None, position_ids=None) -> np.ndarray:
    """float32 numpy logits [B, T, V] of a transformers model."""
    import torch

    kwargs = {"input_ids": torch.as_tensor(np.array(tokens_BxT), dtype=torch.long)}
    if attention_mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.array(attention_mask), dtype=torch.long)
    if position_ids is not None:
        kwargs["position_ids"] = torch.as_tensor(np.array(position_ids), dtype=torch.long)
    with torch.no_grad():
        return model(**kwargs, use_cache=False).logits.float().numpy()


def make_tiny_hf_classifier(
    path, family: str, *, num_labels: int = 1, seed: int = 0, tokenizer: bool = True, **overrides
) -> pathlib.Path:
    """Writes a tiny random ``family`` ``*ForSequenceClassification`` checkpoint at ``path``.

    The backbone is that of :func:`make_tiny_hf_checkpoint`; the bias-free
    ``score`` head has ``num_labels`` outputs. Every weight is perturbed at
    random, the head's at a scale that makes scores of order one.
    """
    import torch
    import transformers

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(family, num_labels=num_labels, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(
        cfg, attn_implementation="eager"
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_((0.2 if name.startswith("score") else 0.05) * torch.randn_like(p))
    model.save_pretrained(str(path))
    if tokenizer:
        from grpo_jax.models.builtin_tokenizer import build_tokenizer

        tok = build_tokenizer()
        tok.chat_template = CHATML_TEMPLATE
        tok.save_pretrained(str(path))
    return path


def load_hf_classifier(path):
    """transformers' AutoModelForSequenceClassification at ``path`` (float32, eager, eval)."""
    import torch
    import transformers

    return transformers.AutoModelForSequenceClassification.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_classifier_scores(model, tokens_BxT, attention_mask=None, position_ids=None) -> np.ndarray:
    """float32 numpy [B, C] of a transformers sequence classifier (``load_hf_classifier``): its
    logits, read as :func:`hf_logits` reads a causal LM's."""
    return hf_logits(model, tokens_BxT, attention_mask, position_ids)


def hf_routes(ref, tokens, mask, positions, k):
    """transformers' chosen experts [B, T, R, K] as sets (sorted): the top k of each sparse
    layer's router logits (the softmax keeps their order), from a pass of ``ref``."""
    import torch

    with torch.no_grad():
        out = ref(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(np.array(positions), dtype=torch.long),
            output_router_logits=True,
            use_cache=False,
        )
    B, T = tokens.shape
    chosen = [torch.topk(r, k, -1).indices.numpy().reshape(B, T, k) for r in out.router_logits]
    return np.sort(np.stack(chosen, axis=2), axis=-1)
