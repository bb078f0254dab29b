"""ModelConfig -> Hugging Face ``config.json`` that transformers (4.x and 5.x) and vLLM load.

The writer emits both the 5.x keys (``rope_parameters``, ``dtype``,
``layer_types``) and the 4.x ones (``rope_theta`` + ``rope_scaling``,
``torch_dtype``, Gemma 3's ``rope_local_base_freq`` and
``sliding_window_pattern``), so old and new loaders read the same model.
Gemma 3 is written as the text-only ``gemma3_text`` / ``Gemma3ForCausalLM``.
"""

from __future__ import annotations

from typing import Any

from grpo_jax.models.config import ModelConfig, RopeScaling
from grpo_jax.models.safetensors_io import CheckpointError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
EXPORT_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gpt_oss": "gpt_oss",
    "gemma3": "gemma3_text",
}


def check_exportable(cfg: ModelConfig) -> None:
    """Raises unless ``cfg``'s switches are what its family's checkpoint format can express."""
    want: dict[str, Any] = {
        "llama": dict(
            qk_norm=False, norm_plus_one=False, sandwich_norm=False, scale_embeddings=False
        ),
        "qwen2": dict(
            qkv_bias=True,
            out_bias=False,
            mlp_bias=False,
            qk_norm=False,
            norm_plus_one=False,
            sandwich_norm=False,
            scale_embeddings=False,
        ),
        "qwen3": dict(
            qk_norm=True,
            mlp_bias=False,
            norm_plus_one=False,
            sandwich_norm=False,
            scale_embeddings=False,
        ),
        "qwen3_moe": dict(
            qk_norm=True,
            mlp_bias=False,
            norm_plus_one=False,
            sandwich_norm=False,
            scale_embeddings=False,
        ),
        "gpt_oss": dict(
            qk_norm=False,
            mlp_bias=False,
            norm_plus_one=False,
            sandwich_norm=False,
            scale_embeddings=False,
            attention_sinks=True,
            moe_bias=True,
            router_softmax_over_topk=True,
            decoder_sparse_step=1,
            mlp_only_layers=(),
        ),
        "gemma3": dict(
            qk_norm=True,
            mlp_bias=False,
            norm_plus_one=True,
            sandwich_norm=True,
            scale_embeddings=True,
        ),
    }[cfg.family]
    if cfg.family != "gpt_oss":  # GPT-OSS's pieces have no place in the other formats.
        want.update(
            attention_sinks=False, moe_bias=False, router_softmax_over_topk=False, swiglu_limit=None
        )
    if cfg.family != "qwen2":
        want["out_bias"] = cfg.qkv_bias  # One attention_bias switch covers q, k, v and o.
    want["attn_logit_softcap"] = None  # No family's transformers code applies it.
    if cfg.family != "gemma3":
        want["final_logit_softcap"] = None
    bad = {k: getattr(cfg, k) for k, v in want.items() if getattr(cfg, k) != v}
    if cfg.family == "llama" and cfg.layer_types and "sliding_attention" in cfg.layer_types:
        bad["layer_types"] = cfg.layer_types
    if cfg.family not in ("qwen3_moe", "gpt_oss") and cfg.num_experts:
        bad["num_experts"] = cfg.num_experts  # Only the MoE families' formats have experts.
    if cfg.family == "gpt_oss":
        if not cfg.num_experts or cfg.swiglu_limit is None:
            bad.update(num_experts=cfg.num_experts, swiglu_limit=cfg.swiglu_limit)
        if cfg.moe_mlp_dim not in (None, cfg.mlp_dim):  # one intermediate_size for both
            bad["moe_mlp_dim"] = cfg.moe_mlp_dim
    if cfg.family != "gemma3" and cfg.local_rope_theta not in (None, cfg.rope_theta):
        bad["local_rope_theta"] = cfg.local_rope_theta
    if bad:
        raise CheckpointError(
            f"a ModelConfig with family={cfg.family!r} and {bad} cannot be written as a "
            f"{cfg.family} checkpoint (expected {want})"
        )


def _int_if_integral(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x  # transformers' strict configs want an int.


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        d.update(rope_type=scaling.kind, factor=scaling.factor)
        if scaling.kind == "llama3":
            d.update(
                low_freq_factor=scaling.low_freq_factor,
                high_freq_factor=scaling.high_freq_factor,
                original_max_position_embeddings=scaling.original_max_position_embeddings,
            )
        if scaling.kind == "yarn":
            d.update(
                beta_fast=scaling.beta_fast,
                beta_slow=scaling.beta_slow,
                truncate=scaling.truncate,
                original_max_position_embeddings=scaling.original_max_position_embeddings,
            )
            if scaling.attention_factor is not None:
                d["attention_factor"] = scaling.attention_factor
    return d


def _experts(cfg: ModelConfig) -> dict[str, Any]:
    """Qwen3-MoE's mixture-of-experts keys (none for the other families)."""
    if cfg.family != "qwen3_moe":
        return {}
    return dict(
        num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=cfg.expert_mlp_dim,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
    )


def config_to_hf(cfg: ModelConfig, *, dtype: str) -> dict[str, Any]:
    """A config.json dict that transformers (4.x and 5.x) and vLLM load as ``cfg``."""
    check_exportable(cfg)
    eos = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    hf: dict[str, Any] = dict(
        architectures=[ARCHITECTURES[cfg.family]],
        model_type=EXPORT_MODEL_TYPES[cfg.family],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=eos,
        pad_token_id=cfg.pad_token_id,
        dtype=dtype,
        torch_dtype=dtype,
        rope_theta=cfg.rope_theta,
        use_cache=True,
    )
    act = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}[cfg.activation]
    global_rope = _rope_dict(cfg.rope_theta, cfg.rope_scaling)
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = global_rope
    if cfg.family == "gemma3":
        types = list(cfg.layer_types or ["full_attention"] * cfg.num_layers)
        local_theta = cfg.local_rope_theta or cfg.rope_theta
        hf.update(
            hidden_activation=act,
            attention_bias=cfg.qkv_bias,
            query_pre_attn_scalar=_int_if_integral(cfg.query_pre_attn_scalar or cfg.head_dim),
            attn_logit_softcapping=None,
            final_logit_softcapping=cfg.final_logit_softcap,
            sliding_window=cfg.sliding_window or cfg.max_position_embeddings,
            layer_types=types,
            rope_local_base_freq=local_theta,
            rope_parameters={
                "full_attention": global_rope,
                "sliding_attention": _rope_dict(local_theta, None),
            },
        )
        pattern = types.index("full_attention") + 1 if "full_attention" in types else 0
        if pattern and types == [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(cfg.num_layers)
        ]:
            hf["sliding_window_pattern"] = pattern  # For loaders older than layer_types.
        return hf
    hf.update(hidden_act=act, rope_parameters=global_rope)
    if cfg.family == "gpt_oss":
        # Written even for plain RoPE: a GPT-OSS config without one means YaRN.
        hf["rope_scaling"] = global_rope
        hf.update(
            attention_bias=cfg.qkv_bias,
            intermediate_size=cfg.expert_mlp_dim,
            num_local_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            swiglu_limit=cfg.swiglu_limit,
            swiglu_alpha=cfg.swiglu_alpha,
            sliding_window=cfg.sliding_window,
            layer_types=list(cfg.layer_types or ["full_attention"] * cfg.num_layers),
        )
        return hf
    if cfg.family == "llama":
        hf.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    else:
        if cfg.family in ("qwen3", "qwen3_moe"):
            hf["attention_bias"] = cfg.qkv_bias
        hf.update(_experts(cfg))
        sliding = [i for i in range(cfg.num_layers) if cfg.is_sliding(i)]
        hf.update(
            use_sliding_window=bool(sliding),
            sliding_window=cfg.sliding_window if sliding else None,
            max_window_layers=sliding[0] if sliding else cfg.num_layers,
        )
        if sliding:
            hf["layer_types"] = list(cfg.layer_types)
    return hf
