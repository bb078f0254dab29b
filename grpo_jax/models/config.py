"""Architecture of a decoder-only transformer: one frozen, validated, hashable dataclass.

One :class:`ModelConfig` covers Llama 3.x, Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, GPT-OSS and Gemma 3
text models:
``family`` names the Hugging Face checkpoint layout, the boolean switches say what the math
does (:func:`family_config` sets them per family). It is hashable because the model keeps it
as static structure, part of the graphdef jitted functions key their caches on. Also the
run's ``model`` section (:class:`ModelSection`, :class:`LoRAConfig`). docs/models.md has the
families' switches.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from grpo_jax.core.checks import check_bool, check_choice, check_range, from_mapping, to_dict
from grpo_jax.core.errors import ConfigError

# The attention implementations (``grpo_jax.models.attention``), for ``model.attention``.
ATTENTION = ("einsum", "blockwise", "dot_product", "splash")
DEFAULT_ATTENTION = "einsum"  # the reference implementation
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss", "gemma3")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_SCALINGS = ("linear", "llama3", "yarn")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Position-interpolation of the RoPE frequencies of the global layers.

    kind "linear": inv_freq / factor (position interpolation, Chen et al. 2023).
    kind "llama3": Llama 3.1's frequency-dependent rescaling: with wavelength
    w = 2 pi / inv_freq, L = original_max_position_embeddings,
        w < L / high_freq_factor  -> inv_freq          (high frequencies kept)
        w > L / low_freq_factor   -> inv_freq / factor (low frequencies scaled)
        otherwise                 -> (1 - s) inv_freq / factor + s inv_freq,
                                     s = (L / w - low_freq_factor)
                                         / (high_freq_factor - low_freq_factor).
    kind "yarn": YaRN (Peng et al. 2023), as transformers computes it: dimension d of the
    Dh/2 keeps inv_freq where its wavelength completes more than beta_fast turns in L
    positions, takes inv_freq / factor where it completes fewer than beta_slow, and blends
    linearly between (the range's ends rounded outwards when ``truncate``); cos and sin are
    multiplied by ``attention_factor`` (None: 0.1 ln(factor) + 1).
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    def __post_init__(self):
        check_choice("rope_scaling.kind", self.kind, ROPE_SCALINGS)
        check_range("rope_scaling.factor", self.factor, lo=0.0, lo_open=True)
        if self.kind == "llama3":
            check_range("rope_scaling.low_freq_factor", self.low_freq_factor, lo=0.0, lo_open=True)
            check_range(
                "rope_scaling.high_freq_factor", self.high_freq_factor, lo=0.0, lo_open=True
            )
            if self.high_freq_factor <= self.low_freq_factor:
                raise ConfigError(
                    f"rope_scaling.high_freq_factor = {self.high_freq_factor} must be > "
                    f"low_freq_factor = {self.low_freq_factor}"
                )
        if self.kind in ("llama3", "yarn"):
            check_range(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                lo=1,
                integer=True,
            )
        if self.kind == "yarn":
            check_range("rope_scaling.beta_fast", self.beta_fast, lo=0.0, lo_open=True)
            check_range("rope_scaling.beta_slow", self.beta_slow, lo=0.0, lo_open=True)
            check_bool("rope_scaling.truncate", self.truncate)
            if self.attention_factor is not None:
                check_range(
                    "rope_scaling.attention_factor", self.attention_factor, lo=0.0, lo_open=True
                )

    @property
    def cos_sin_scale(self) -> float:
        """The factor on cos and sin (YaRN's attention factor; 1 for the other kinds)."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        return 1.0 if self.factor <= 1 else 0.1 * math.log(self.factor) + 1.0


def dtype_name(key: str, value: Any, section: str = "model") -> str:
    """``value``'s dtype name, one of ``DTYPES``; a ConfigError naming ``section.key`` if not."""
    try:
        name = jnp.dtype(value).name
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ConfigError(f"config key '{section}.{key}' = {value!r} is not one of {list(DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer (pre-norm, RoPE, gated MLP, GQA).

    Attributes:
      family: checkpoint layout, one of ``FAMILIES``.
      vocab_size, hidden_size (D), num_layers (L), num_heads (H),
      num_kv_heads (K, divides H), head_dim (Dh), mlp_dim (F).
      rope_theta: RoPE base of the global (full-attention) layers.
      rope_scaling: optional :class:`RopeScaling` of the global layers.
      local_rope_theta: RoPE base of the sliding-window layers (Gemma 3's
        ``rope_local_base_freq``); None means ``rope_theta``.
      sliding_window: window W of the sliding layers: a query at position i
        sees keys at positions j with i - W < j <= i.
      layer_types: per layer "full_attention" or "sliding_attention"; None
        means all full.
      rms_norm_eps: epsilon inside every RMSNorm.
      qkv_bias, out_bias, mlp_bias: biases on q/k/v, on o, on the MLP.
      qk_norm: RMSNorm over head_dim on queries and keys before RoPE.
      norm_plus_one: Gemma's RMSNorm, x * (1 + w), computed in float32.
      sandwich_norm: extra norms after attention and after the MLP (Gemma).
      scale_embeddings: embeddings times sqrt(D) in the compute dtype (Gemma).
      activation: gate activation of the gated MLP (SwiGLU "silu", GeGLU
        "gelu_tanh").
      query_pre_attn_scalar: attention scale is query_pre_attn_scalar**-0.5
        when set, head_dim**-0.5 otherwise.
      attn_logit_softcap, final_logit_softcap: c * tanh(x / c) on attention
        scores / on output logits when set.
      tie_embeddings: the LM head is the transposed embedding table.
      max_position_embeddings: context length written to exported configs.
      dtype: compute dtype; param_dtype: storage dtype of the parameters.
      remat: rematerialise each layer in the backward pass.
      attention: the attention implementation, one of ``ATTENTION``
        ("einsum" the reference, "blockwise" memory linear in the context,
        "dot_product" ``jax.nn.dot_product_attention``, "splash" TPU splash
        attention through Pallas; see ``grpo_jax.models.attention``).
      attention_block_size: keys per block of "blockwise"; the query and key
        block (at most) of "splash".
      scan_layers: the layers' parameters are stacked on a leading "layers"
        axis and run by one ``jax.lax.scan`` (compile time flat in depth).
      bos_token_id, eos_token_id (int or tuple of ints), pad_token_id.
      num_experts: E experts in each sparse layer's mixture of experts; 0 means
        every layer is dense (docs/moe.md).
      experts_per_token: k, the experts each token's router picks (top-k).
      moe_mlp_dim: each expert's gated-MLP width (None: ``mlp_dim``).
      norm_topk_prob: renormalise the k chosen routing probabilities to sum 1.
      decoder_sparse_step, mlp_only_layers: layer i is sparse iff i is not in
        mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (Qwen3-MoE's
        rule); the dense layers' MLP has width ``mlp_dim``.
      attention_sinks: a learned logit per query head joins each softmax's
        denominator and attends to nothing (GPT-OSS).
      moe_bias: biases on the router and on every expert's projections (GPT-OSS).
      router_softmax_over_topk: the routing weights are the softmax of the k
        chosen logits (GPT-OSS), not the top k of a softmax over all E.
      swiglu_limit, swiglu_alpha: when the limit is set, the experts run GPT-OSS's
        clamped SwiGLU, gate = min(gate, limit), up = clip(up, -limit, limit),
        out = (up + 1) * gate * sigmoid(alpha * gate), on one fused gate/up
        weight with gate and up interleaved along its output.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 10_000.0
    rope_scaling: RopeScaling | None = None
    local_rope_theta: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_plus_one: bool = False
    sandwich_norm: bool = False
    scale_embeddings: bool = False
    activation: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: Any = "float32"
    param_dtype: Any = "float32"
    remat: bool = False
    attention: str = DEFAULT_ATTENTION
    attention_block_size: int = 512
    scan_layers: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_mlp_dim: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attention_sinks: bool = False
    moe_bias: bool = False
    router_softmax_over_topk: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        set_("dtype", dtype_name("dtype", self.dtype))
        set_("param_dtype", dtype_name("param_dtype", self.param_dtype))
        if self.layer_types is not None:
            set_("layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, (list, tuple)):
            set_("eos_token_id", tuple(int(i) for i in self.eos_token_id))

        check_choice("model.family", self.family, FAMILIES)
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            check_range(f"model.{key}", getattr(self, key), lo=1, integer=True)
        for key in ("head_dim", "mlp_dim", "max_position_embeddings"):
            check_range(f"model.{key}", getattr(self, key), lo=1, integer=True)
        if self.head_dim % 2:
            raise ConfigError(f"config key 'model.head_dim' = {self.head_dim} must be even (RoPE)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"config key 'model.num_kv_heads' = {self.num_kv_heads} must divide "
                f"model.num_heads = {self.num_heads}"
            )
        check_range("model.rope_theta", self.rope_theta, lo=1.0, lo_open=True)
        if self.local_rope_theta is not None:
            check_range("model.local_rope_theta", self.local_rope_theta, lo=1.0, lo_open=True)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(
                f"config key 'model.rope_scaling' = {self.rope_scaling!r} must be a RopeScaling"
            )
        check_range("model.rms_norm_eps", self.rms_norm_eps, lo=0.0, lo_open=True)
        check_choice("model.activation", self.activation, ACTIVATIONS)
        for key in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            if getattr(self, key) is not None:
                check_range(f"model.{key}", getattr(self, key), lo=0.0, lo_open=True)
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"config key 'model.layer_types' has {len(self.layer_types)} entries, "
                    f"but model.num_layers = {self.num_layers}"
                )
            for i, t in enumerate(self.layer_types):
                check_choice(f"model.layer_types[{i}]", t, LAYER_TYPES)
        if self.sliding_window is not None:
            check_range("model.sliding_window", self.sliding_window, lo=1, integer=True)
        elif any(self.is_sliding(i) for i in range(self.num_layers)):
            raise ConfigError(
                "config key 'model.sliding_window' is None, but model.layer_types has "
                "'sliding_attention' layers: set the window"
            )
        check_choice("model.attention", self.attention, ATTENTION)
        check_range("model.attention_block_size", self.attention_block_size, lo=1, integer=True)
        for key in ("remat", "scan_layers"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"config key 'model.{key}' = {getattr(self, key)!r} must be True or False"
                )
        check_bool("model.attention_sinks", self.attention_sinks)
        if self.attention_sinks and self.attention == "dot_product":
            raise ConfigError(
                f"config key 'model.attention' = {self.attention!r} has no attention sinks "
                f"(model.family = {self.family!r}); use 'einsum', 'blockwise' or 'splash'"
            )
        if self.attention == "dot_product" and self.attn_logit_softcap is not None:
            raise ConfigError(
                "config key 'model.attention' = 'dot_product' cannot soft-cap attention scores "
                f"(model.attn_logit_softcap = {self.attn_logit_softcap}); use 'einsum', "
                "'blockwise' or 'splash'"
            )
        for key in ("bos_token_id", "pad_token_id"):
            if getattr(self, key) is not None:
                check_range(f"model.{key}", getattr(self, key), lo=0, integer=True)
        for i in self.eos_token_ids:
            check_range("model.eos_token_id", i, lo=0, integer=True)
        self._check_experts()

    def _check_experts(self):
        object.__setattr__(self, "mlp_only_layers", tuple(map(int, self.mlp_only_layers or ())))
        check_range("model.num_experts", self.num_experts, lo=0, integer=True)
        check_range("model.decoder_sparse_step", self.decoder_sparse_step, lo=1, integer=True)
        check_bool("model.norm_topk_prob", self.norm_topk_prob)
        check_bool("model.moe_bias", self.moe_bias)
        check_bool("model.router_softmax_over_topk", self.router_softmax_over_topk)
        if self.swiglu_limit is not None:
            check_range("model.swiglu_limit", self.swiglu_limit, lo=0.0, lo_open=True)
        check_range("model.swiglu_alpha", self.swiglu_alpha, lo=0.0, lo_open=True)
        if not self.num_experts:
            return
        check_range(
            "model.experts_per_token", self.experts_per_token, lo=1, hi=self.num_experts,
            integer=True,
        )  # fmt: skip
        if self.moe_mlp_dim is not None:
            check_range("model.moe_mlp_dim", self.moe_mlp_dim, lo=1, integer=True)
        if self.moe_bias and self.swiglu_limit is None:
            raise ConfigError(
                "config key 'model.moe_bias' = True needs model.swiglu_limit set: the experts' "
                "biases are those of GPT-OSS's fused gate/up weight"
            )
        sparse = self.sparse_layers
        if self.scan_layers and 0 < len(sparse) < self.num_layers:
            raise ConfigError(
                f"config key 'model.scan_layers' = True needs every layer sparse or every layer "
                f"dense, but layers {sparse} of {self.num_layers} are sparse "
                f"(model.decoder_sparse_step = {self.decoder_sparse_step}, model.mlp_only_layers "
                f"= {list(self.mlp_only_layers)}); set model.scan_layers = False"
            )

    # -- derived -----------------------------------------------------------

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id (a config may list several)."""
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, tuple):
            return self.eos_token_id
        return (self.eos_token_id,)

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (Qwen3-MoE's rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The sparse layers, in order; routes are indexed by position in this tuple."""
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    @property
    def expert_mlp_dim(self) -> int:
        return self.moe_mlp_dim or self.mlp_dim

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer``, None for a global layer."""
        return self.sliding_window if self.is_sliding(layer) else None

    def rope_base(self, layer: int) -> float:
        if self.is_sliding(layer) and self.local_rope_theta is not None:
            return self.local_rope_theta
        return self.rope_theta

    def layer_rope_scaling(self, layer: int) -> RopeScaling | None:
        # Gemma 3 scales the global layers only; the local layers keep plain RoPE.
        if self.is_sliding(layer) and self.family == "gemma3":
            return None
        return self.rope_scaling

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_params(self) -> int:
        """Number of parameters (the tied LM head counted once)."""
        D, F, Dh = self.hidden_size, self.mlp_dim, self.head_dim
        H, K = self.num_heads, self.num_kv_heads
        attn = D * Dh * (2 * H + 2 * K) + (Dh * (H + 2 * K) if self.qkv_bias else 0)
        attn += (D if self.out_bias else 0) + (2 * Dh if self.qk_norm else 0)
        attn += H if self.attention_sinks else 0
        mlp = 3 * D * F + ((2 * F + D) if self.mlp_bias else 0)
        n_sparse = len(self.sparse_layers)
        moe = self.num_experts * (3 * D * self.expert_mlp_dim + D)  # experts and router
        moe += self.num_experts * (2 * self.expert_mlp_dim + D + 1) if self.moe_bias else 0
        mlps = (self.num_layers - n_sparse) * mlp + n_sparse * moe
        norms = D * (4 if self.sandwich_norm else 2)
        head = 0 if self.tie_embeddings else D * self.vocab_size
        return self.vocab_size * D + self.num_layers * (attn + norms) + mlps + D + head

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: :attr:`num_params` less the experts its
        router did not choose (E - K of each sparse layer's E); the router counts whole."""
        idle = self.num_experts - self.experts_per_token
        expert = 3 * self.hidden_size * self.expert_mlp_dim
        expert += (2 * self.expert_mlp_dim + self.hidden_size) if self.moe_bias else 0
        return self.num_params - len(self.sparse_layers) * max(idle, 0) * expert

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)


_FAMILY_SWITCHES: dict[str, dict[str, Any]] = {
    "llama": dict(activation="silu", rms_norm_eps=1e-5, rope_theta=500_000.0),
    "qwen2": dict(activation="silu", qkv_bias=True, rope_theta=1_000_000.0),
    "qwen3": dict(activation="silu", qk_norm=True, rope_theta=1_000_000.0),
    "qwen3_moe": dict(
        activation="silu",
        qk_norm=True,
        rope_theta=1_000_000.0,
        num_experts=8,
        experts_per_token=2,
        norm_topk_prob=True,
    ),  # fmt: skip
    "gpt_oss": dict(
        activation="silu",
        qkv_bias=True,
        out_bias=True,
        rms_norm_eps=1e-5,
        rope_theta=150_000.0,
        attention_sinks=True,
        num_experts=8,
        experts_per_token=2,
        moe_bias=True,
        router_softmax_over_topk=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
    ),
    "gemma3": dict(
        activation="gelu_tanh",
        qk_norm=True,
        norm_plus_one=True,
        sandwich_norm=True,
        scale_embeddings=True,
        tie_embeddings=True,
        rope_theta=1_000_000.0,
        local_rope_theta=10_000.0,
    ),
}


def family_config(family: str, **fields) -> ModelConfig:
    """A :class:`ModelConfig` with ``family``'s architecture switches, then ``fields``.

    For ``gemma3`` without explicit ``layer_types``, every sixth layer is
    global and the rest slide (Gemma 3's 5:1 pattern), with a default window
    of 512 and query_pre_attn_scalar = head_dim. For ``gpt_oss`` the even layers
    slide and the odd ones are global (GPT-OSS's alternation), with a default
    window of 128.
    """
    check_choice("model.family", family, FAMILIES)
    merged = {**_FAMILY_SWITCHES[family], **fields}
    if family == "gpt_oss":
        n = merged.get("num_layers", 0)
        if merged.get("layer_types") is None and isinstance(n, int):
            merged["layer_types"] = tuple(
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)
            )
        merged.setdefault("sliding_window", 128)
    if family == "gemma3":
        n = merged.get("num_layers", 0)
        if merged.get("layer_types") is None and isinstance(n, int):
            merged["layer_types"] = tuple(
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
            )
        merged.setdefault("sliding_window", 512)
        merged.setdefault("query_pre_attn_scalar", merged.get("head_dim"))
    return ModelConfig(family=family, **merged)


def tiny_config(vocab_size: int, **overrides) -> ModelConfig:
    """The built-in CPU default: a Qwen2-style model of about 3M parameters plus embeddings.

    D = 256, 4 layers, 4 query heads of 64 sharing 2 KV heads, SwiGLU width
    768, tied embeddings, float32. ``overrides`` may change any field,
    including ``family``.
    """
    check_range("model.vocab_size", vocab_size, lo=1, integer=True)
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        mlp_dim=768,
        tie_embeddings=True,
        max_position_embeddings=2048,
        rope_theta=10_000.0,
    )
    fields.update(overrides)
    family = fields.pop("family", "qwen2")
    if family == "gemma3":
        fields.setdefault("sliding_window", 64)
    return family_config(family, **fields)


# ---------------------------------------------------------------------------
# The run config's ``model`` section (``grpo_jax.run.config`` composes it into the run):
# the checkpoint, the loader's settings and the low-rank adapters.

LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A mixture of experts' weights (``layers.MoE``), adapted only when named: each expert gets
# its own adapter (docs/lora.md, "The experts"). "experts" names all of them.
EXPERT_PROJECTIONS = ("gate_experts", "up_experts", "gate_up_experts", "down_experts")
ADAPTABLE = LORA_PROJECTIONS + EXPERT_PROJECTIONS


def expert_weights(cfg) -> tuple[str, ...]:
    """The names of the experts' weights a ``ModelConfig`` builds (none for a dense model)."""
    if not cfg.num_experts or not cfg.sparse_layers:
        return ()
    if cfg.swiglu_limit is not None:  # GPT-OSS: gate and up fused, interleaved
        return ("gate_up_experts", "down_experts")
    return ("gate_experts", "up_experts", "down_experts")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the frozen base's projections (``grpo_jax.models.lora``).

    A target projection W [in, out] computes x W + (alpha / rank) (x A) B, with
    A [in, rank] and B [rank, out] the trainable adapters (Hu et al. 2021,
    "LoRA"); B starts at zero, so the adapted model starts as the base.

    Attributes:
      rank: r; 0 switches LoRA off (full fine-tuning).
      alpha: the scale's numerator (scale = alpha / rank, as PEFT's default).
      dropout: dropout on the adapters' input x in the update's forward pass
        (never in sampling, scoring of pi_old or the reference).
      targets: the projections that get adapters: short names (q, k, v, o,
        gate, up, down), full names (q_proj, ...) or regular expressions
        matched against the full names ("(q|v)_proj"); a string is split at
        commas. A mixture of experts' weights are adapted only when named
        exactly (``EXPERT_PROJECTIONS``, or "experts" for all of them): a
        regular expression never matches them.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")

    def __post_init__(self):
        targets = self.targets
        if isinstance(targets, str):
            targets = tuple(t.strip() for t in targets.split(",") if t.strip())
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
            raise ConfigError(
                f"config key 'model.lora.targets' = {self.targets!r} must be a list of "
                "projection names or regular expressions"
            )
        object.__setattr__(self, "targets", tuple(targets))
        check_range("model.lora.rank", self.rank, lo=0, integer=True)
        check_range("model.lora.alpha", self.alpha, lo=0.0, lo_open=True)
        check_range("model.lora.dropout", self.dropout, lo=0.0)
        if self.dropout >= 1.0:
            raise ConfigError(f"config key 'model.lora.dropout' = {self.dropout!r} must be < 1")
        if self.rank and not self.targets:
            raise ConfigError("config key 'model.lora.targets' is empty: name the projections")
        for t in self.targets:
            if not self._matches(t):
                raise ConfigError(
                    f"config key 'model.lora.targets' entry {t!r} matches no projection; "
                    f"projections: {[p[:-5] for p in LORA_PROJECTIONS]} (or their full names "
                    f"{list(LORA_PROJECTIONS)}, or a regular expression over the full names); "
                    f"the experts' weights by name: {list(EXPERT_PROJECTIONS)} or 'experts'"
                )

    @staticmethod
    def _matches(target: str) -> tuple[str, ...]:
        try:
            pattern = re.compile(target)
        except re.error as e:
            raise ConfigError(
                f"config key 'model.lora.targets' entry {target!r} is not a valid regular "
                f"expression ({e})"
            ) from None
        dense = tuple(p for p in LORA_PROJECTIONS if target in (p, p[:-5]) or pattern.fullmatch(p))
        if target == "experts":
            return dense + EXPERT_PROJECTIONS
        return dense + ((target,) if target in EXPERT_PROJECTIONS else ())

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The full names of the target projections, in ``ADAPTABLE`` order."""
        hit = {p for t in self.targets for p in self._matches(t)}
        return tuple(p for p in ADAPTABLE if p in hit)

    def check_model(self, cfg, model: str) -> None:
        """A one-line ConfigError when a target names experts' weights that ``cfg`` (the
        model ``model``) lacks: a dense model, or Qwen3-MoE's gate/up against GPT-OSS's
        fused gate_up (and back)."""
        if not self.enabled:
            return
        have = expert_weights(cfg)
        for t in self.targets:
            named = EXPERT_PROJECTIONS if t == "experts" else (t,)
            named = tuple(n for n in named if n in EXPERT_PROJECTIONS)
            if named and not set(named) & set(have):
                raise ConfigError(
                    f"config key 'model.lora.targets' entry {t!r} names experts' weights that "
                    f"{model} does not have (its experts' weights: {list(have) or 'none, dense'})"
                )


MODEL_KEYS = ("path", "dtype", "param_dtype", "remat", "attention", "scan_layers")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The policy model.

    Attributes:
      path: a Hugging Face checkpoint directory; "" is the built-in tiny model;
        "tiny:<family>" (qwen2, qwen3, qwen3_moe, gpt_oss, llama, gemma3) a small random
        checkpoint of that family, written when the run starts
        (``grpo_jax.run.runlocal``).
      dtype: compute dtype (None: the checkpoint's, float32 for the tiny model).
      param_dtype: storage dtype of the parameters (None: ``dtype``).
      remat: recompute each layer in the backward pass.
      attention: "einsum" (the default), "blockwise", "dot_product" or "splash"
        (``grpo_jax.models.attention``).
      scan_layers: run the layers as one scan over stacked parameters.
      lora: low-rank adapters on a frozen base (:class:`LoRAConfig`; rank 0: off).
      overrides: for the built-in tiny model only, ``grpo_jax.models.ModelConfig``
        fields (hidden_size, num_layers, ...), given as further keys of the
        ``model`` section.
    """

    path: str = ""
    dtype: str | None = None
    param_dtype: str | None = None
    remat: bool | None = None
    attention: str | None = DEFAULT_ATTENTION
    scan_layers: bool | None = False
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lora: LoRAConfig = LoRAConfig()

    def __post_init__(self):
        if not isinstance(self.path, str):
            raise ConfigError(f"config key 'model.path' = {self.path!r} must be a string")
        if self.remat is not None:
            check_bool("model.remat", self.remat)
        if self.scan_layers is not None:
            check_bool("model.scan_layers", self.scan_layers)
        if self.attention is not None:
            check_choice("model.attention", self.attention, ATTENTION)
        if self.path and self.overrides:
            raise ConfigError(
                f"config keys {[f'model.{k}' for k in sorted(self.overrides)]} only apply to "
                f"the built-in tiny model; model.path = {self.path!r} loads its architecture "
                "from config.json"
            )

    @classmethod
    def from_mapping(cls, mapping) -> ModelSection:
        cfg = to_dict(mapping)
        known = {k: cfg.pop(k) for k in MODEL_KEYS if k in cfg}
        lora = from_mapping(LoRAConfig, "model.lora", cfg.pop("lora", None))
        return cls(**known, overrides=cfg, lora=lora)

    def loader_kwargs(self) -> dict:
        """The keys that were set among dtype, param_dtype, remat, attention and scan_layers."""
        return {k: getattr(self, k) for k in MODEL_KEYS[1:] if getattr(self, k) is not None}
