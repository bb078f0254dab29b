"""Hugging Face ``config.json`` <-> :class:`ModelConfig`.

config.json files in the wild were written by many transformers versions, with different
layouts for the same setting (RoPE, Gemma 3's nested text config, sliding layers, dtype);
all of them are read, and missing keys take the defaults of transformers' config class for
that ``model_type`` (copied below). docs/models.md, "Hugging Face checkpoints", lists the
layouts. The inverse, ``ModelConfig`` -> config.json, is in ``hf_config_export``.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
from typing import Any

from grpo_jax.core.errors import ConfigError
from grpo_jax.models.config import ModelConfig, RopeScaling
from grpo_jax.models.safetensors_io import CheckpointError

log = logging.getLogger(__name__)

MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "gpt_oss": "gpt_oss",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
}

# transformers' config-class defaults for the keys read here (LlamaConfig,
# Qwen2Config, Qwen3Config, Gemma3TextConfig).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        hidden_act="silu",
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen2": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=22016,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        hidden_act="silu",
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_theta=10_000.0,
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=28,
    ),
    "gemma3": dict(
        vocab_size=262_208,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131_072,
        rms_norm_eps=1e-6,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
        attention_bias=False,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
    ),
}
_DEFAULTS["qwen3"] = {**_DEFAULTS["qwen2"], "head_dim": 128, "attention_bias": False}
# Qwen3MoeConfig's defaults for its mixture-of-experts keys.
_DEFAULTS["qwen3_moe"] = {
    **_DEFAULTS["qwen3"],
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
}

# GptOssConfig's defaults; a config.json with neither rope_parameters nor rope_scaling means
# YaRN with these parameters.
_GPT_OSS_ROPE = dict(
    rope_type="yarn",
    factor=32.0,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
    original_max_position_embeddings=4096,
)
_DEFAULTS["gpt_oss"] = dict(
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_hidden_layers=36,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=128,
    num_experts_per_tok=4,
    sliding_window=128,
    tie_word_embeddings=False,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=150_000.0,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    attention_bias=True,
)

# Keys whose explicit null differs from the default (no soft-capping, no pad token).
_NULLABLE = (
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)
_GEMMA3_TOP_LEVEL = (
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def read_config_json(path: str | pathlib.Path) -> dict[str, Any]:
    """The parsed config.json of a checkpoint directory, with clear errors."""
    directory = pathlib.Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    file = directory / "config.json"
    if not file.exists():
        raise CheckpointError(
            f"{file}: not found (a Hugging Face checkpoint directory has a config.json)"
        )
    try:
        hf = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file}: invalid JSON at line {e.lineno}: {e.msg}") from e
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(hf).__name__}")
    return hf


def generation_eos_ids(directory: str | pathlib.Path) -> tuple[int, ...]:
    """End-of-sequence ids of generation_config.json, if any.

    Instruct checkpoints often list their end-of-turn token there only
    (Llama 3's <|eot_id|>, Qwen's <|im_end|>), and a sampler must stop on it.
    """
    file = pathlib.Path(directory) / "generation_config.json"
    if not file.exists():
        return ()
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (json.JSONDecodeError, AttributeError) as e:
        raise CheckpointError(f"{file}: not a JSON object ({e})") from e
    if eos is None:
        return ()
    return tuple(int(i) for i in (eos if isinstance(eos, list) else [eos]))


def _text_settings(hf: dict[str, Any], source: str) -> tuple[str, dict[str, Any]]:
    """(family, flat text-model settings with defaults filled in)."""
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{source}: unsupported model_type {model_type!r}; supported model types are "
            f"{sorted(MODEL_TYPES)}"
        )
    family = MODEL_TYPES[model_type]
    if model_type == "gemma3" and isinstance(hf.get("text_config"), dict):
        text = dict(hf["text_config"])
        for key in _GEMMA3_TOP_LEVEL:  # Multimodal configs keep these beside text_config.
            if key in hf and key not in text:
                text[key] = hf[key]
    else:
        text = dict(hf)
    settings = {
        **_DEFAULTS[family],
        **{k: v for k, v in text.items() if v is not None or k in _NULLABLE},
    }
    return family, settings


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(params: dict[str, Any], source: str, what: str) -> RopeScaling:
    """YaRN's parameters as transformers reads them (its defaults: beta_fast 32, beta_slow 1,
    truncate True; the attention factor from mscale and mscale_all_dim when both are set)."""
    if "original_max_position_embeddings" not in params or "factor" not in params:
        missing = "factor" if "factor" not in params else "original_max_position_embeddings"
        raise CheckpointError(f"{source}: {what} of rope_type 'yarn' lacks {missing!r}")
    factor = float(params["factor"])
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all_dim:
        attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if attention_factor is None else float(attention_factor),
    )


def _rope_scaling(params: dict[str, Any] | None, source: str, what: str) -> RopeScaling | None:
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(params["factor"]))
    if kind == "yarn":
        return _yarn(params, source, what)
    if kind == "llama3":
        try:
            return RopeScaling(
                "llama3",
                float(params["factor"]),
                float(params["low_freq_factor"]),
                float(params["high_freq_factor"]),
                int(params["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise CheckpointError(
                f"{source}: {what} of rope_type 'llama3' lacks {e.args[0]!r}"
            ) from e
    raise CheckpointError(
        f"{source}: unsupported rope_type {kind!r} in {what}; supported: default, linear, "
        "llama3, yarn"
    )


def _is_nested(rope: dict[str, Any]) -> bool:
    return any(k in rope for k in ("full_attention", "sliding_attention"))


def _rope(family: str, s: dict[str, Any], source: str) -> dict[str, Any]:
    """rope_theta, rope_scaling, local_rope_theta from any of the layouts."""
    rope = s.get("rope_parameters") or {}
    legacy = s.get("rope_scaling") or {}
    if family == "gpt_oss" and not rope and not legacy:
        rope = _GPT_OSS_ROPE
    if family != "gemma3":
        if _is_nested(rope):
            rope = rope.get("full_attention") or {}
        params = {**rope, **legacy}  # transformers gives a legacy rope_scaling priority.
        theta = params.get("rope_theta", s["rope_theta"])
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"{source}: partial_rotary_factor != 1 is not supported")
        return dict(
            rope_theta=float(theta), rope_scaling=_rope_scaling(params, source, "rope parameters")
        )
    if _is_nested(rope):
        full = {**(rope.get("full_attention") or {}), **legacy}
        local = rope.get("sliding_attention") or {}
    else:  # 4.x: one dict (if any) for the global layers, the local base beside it.
        full, local = {**rope, **legacy}, {}
    if _rope_scaling(local, source, "rope_parameters.sliding_attention") is not None:
        raise CheckpointError(f"{source}: RoPE scaling on the sliding layers is not supported")
    return dict(
        rope_theta=float(full.get("rope_theta", s["rope_theta"])),
        rope_scaling=_rope_scaling(full, source, "rope parameters of the full-attention layers"),
        local_rope_theta=float(local.get("rope_theta", s["rope_local_base_freq"])),
    )


def _layer_types(family: str, s: dict[str, Any], n: int, source: str) -> dict[str, Any]:
    if family == "gemma3":
        if s.get("use_bidirectional_attention"):
            raise CheckpointError(f"{source}: use_bidirectional_attention is not supported")
        types = s.get("layer_types")
        if types is None:
            pattern = int(s.get("sliding_window_pattern", s.get("_sliding_window_pattern", 6)))
            types = [
                "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
            ]
        return dict(layer_types=tuple(types), sliding_window=s["sliding_window"])
    if family == "gpt_oss":  # even layers slide, odd ones are global, unless listed
        types = s.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
        ]
        return dict(layer_types=tuple(types), sliding_window=s["sliding_window"])
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        if not s.get("use_sliding_window"):  # transformers drops the window when it is off.
            return dict(layer_types=None, sliding_window=None)
        types = s.get("layer_types") or [
            "sliding_attention" if i >= s["max_window_layers"] else "full_attention"
            for i in range(n)
        ]
        return dict(layer_types=tuple(types), sliding_window=s["sliding_window"])
    if s.get("layer_types") and any(t != "full_attention" for t in s["layer_types"]):
        raise CheckpointError(f"{source}: llama layer_types {s['layer_types']} are not supported")
    return dict(layer_types=None, sliding_window=None)


def _experts(hf: dict[str, Any], s: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE config.json. transformers 5 writes the
    expert count as ``num_local_experts``, earlier versions as ``num_experts``."""
    num = hf.get("num_experts", hf.get("num_local_experts", s["num_experts"]))
    return dict(
        num_experts=int(num),
        experts_per_token=int(s["num_experts_per_tok"]),
        moe_mlp_dim=int(s["moe_intermediate_size"]),
        norm_topk_prob=bool(s["norm_topk_prob"]),
        decoder_sparse_step=int(s["decoder_sparse_step"]),
        mlp_only_layers=tuple(int(i) for i in s.get("mlp_only_layers") or ()),
    )


def _gpt_oss(s: dict[str, Any], attention_bias: bool) -> dict[str, Any]:
    """GPT-OSS's fields: every layer a mixture of experts of width intermediate_size, with
    biases, a softmax over the top-k logits, the clamped SwiGLU and attention sinks."""
    return dict(
        qkv_bias=attention_bias,
        out_bias=attention_bias,
        attention_sinks=True,
        num_experts=int(s["num_local_experts"]),
        experts_per_token=int(s["num_experts_per_tok"]),
        moe_bias=True,
        router_softmax_over_topk=True,
        swiglu_limit=float(s["swiglu_limit"]),
        swiglu_alpha=float(s["swiglu_alpha"]),
    )


def checkpoint_dtype(hf: dict[str, Any]) -> str | None:
    """The weights' dtype recorded in the config ("dtype" or legacy "torch_dtype")."""
    for src in (hf, hf.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            if isinstance(src.get(key), str):
                return src[key].removeprefix("torch.")
    return None


def config_from_hf(hf: dict[str, Any], *, source: str = "config.json", **fields) -> ModelConfig:
    """The :class:`ModelConfig` of a parsed config.json; ``fields`` (dtype, remat, ...) override."""
    family, s = _text_settings(hf, source)
    try:
        H = int(s["num_attention_heads"])
        K = s.get("num_key_value_heads") or H
        act = s.get("hidden_activation") or s.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise CheckpointError(
                f"{source}: unsupported activation {act!r}; supported: {sorted(ACTIVATIONS)}"
            )
        attention_bias = bool(s.get("attention_bias", False))
        kwargs = dict(
            family=family,
            vocab_size=s["vocab_size"],
            hidden_size=s["hidden_size"],
            num_layers=s["num_hidden_layers"],
            num_heads=H,
            num_kv_heads=K,
            head_dim=s.get("head_dim") or s["hidden_size"] // H,
            mlp_dim=s["intermediate_size"],
            rms_norm_eps=float(s["rms_norm_eps"]),
            activation=ACTIVATIONS[act],
            tie_embeddings=bool(s["tie_word_embeddings"]),
            max_position_embeddings=s["max_position_embeddings"],
            bos_token_id=s.get("bos_token_id"),
            eos_token_id=s.get("eos_token_id"),
            pad_token_id=s.get("pad_token_id"),
            **_rope(family, s, source),
            **_layer_types(family, s, s["num_hidden_layers"], source),
        )
        if family == "llama":
            kwargs.update(
                qkv_bias=attention_bias, out_bias=attention_bias, mlp_bias=bool(s.get("mlp_bias"))
            )
        elif family == "qwen2":
            kwargs.update(qkv_bias=True)
        elif family in ("qwen3", "qwen3_moe"):
            kwargs.update(qkv_bias=attention_bias, out_bias=attention_bias, qk_norm=True)
            kwargs.update(_experts(hf, s) if family == "qwen3_moe" else {})
        elif family == "gpt_oss":
            kwargs.update(_gpt_oss(s, attention_bias))
        else:
            kwargs.update(
                qkv_bias=attention_bias,
                out_bias=attention_bias,
                qk_norm=True,
                norm_plus_one=True,
                sandwich_norm=True,
                scale_embeddings=True,
                query_pre_attn_scalar=float(s["query_pre_attn_scalar"]),
                # transformers' Gemma3 attention never applies attn_logit_softcapping
                # (Gemma 2's did); matching its logits means ignoring it too.
                attn_logit_softcap=None,
                final_logit_softcap=s.get("final_logit_softcapping"),
            )
        if family == "gemma3" and s.get("attn_logit_softcapping") is not None:
            log.warning(
                "%s: attn_logit_softcapping=%s is ignored, as transformers' Gemma3 ignores it",
                source,
                s["attn_logit_softcapping"],
            )
        kwargs.update(fields)
        return ModelConfig(**kwargs)
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from e
    except (TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{source}: malformed value ({e})") from e
