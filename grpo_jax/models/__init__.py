"""Decoder-only transformers in Flax NNX (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE,
GPT-OSS, Gemma 3).

    model = create_model(tiny_config(vocab_size=100))       # random, built-in size
    model = from_pretrained("/path/to/hf_dir", dtype=jnp.bfloat16, mesh=mesh)
    model = from_gguf("/path/to/model.gguf")                  # llama.cpp file, dequantised
    logits_BxTxV = model(tokens_BxT)                          # float32
    save_pretrained(model, "/path/to/out")                    # transformers loads it

docs/models.md has the architecture, the sharding, the checkpoints and the numerics.
"""

from grpo_jax.models.config import (
    FAMILIES,
    ModelConfig,
    RopeScaling,
    family_config,
    tiny_config,
)
from grpo_jax.models.gguf import convert_gguf, from_gguf
from grpo_jax.models.gguf_tokenizer import load_gguf_tokenizer
from grpo_jax.models.hf import from_pretrained, save_pretrained
from grpo_jax.models.partitioning import cache_shardings, param_shardings
from grpo_jax.models.safetensors_io import CheckpointError
from grpo_jax.models.tokenizer import apply_chat_template, load_tokenizer
from grpo_jax.models.transformer import (
    Transformer,
    create_model,
    positions_from_mask,
    stack_layers,
    unstack_layers,
)

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "apply_chat_template",
    "cache_shardings",
    "create_model",
    "convert_gguf",
    "family_config",
    "from_gguf",
    "from_pretrained",
    "load_gguf_tokenizer",
    "load_tokenizer",
    "param_shardings",
    "positions_from_mask",
    "save_pretrained",
    "stack_layers",
    "tiny_config",
    "unstack_layers",
]
