"""Decoder-only transformers in Flax NNX (Llama 3.x, Qwen2/2.5, Qwen3, Gemma 3).

    model = create_model(tiny_config(vocab_size=100))       # random, built-in size
    model = from_pretrained("/path/to/hf_dir", dtype=jnp.bfloat16, mesh=mesh)
    model = from_gguf("/path/to/model.gguf")                  # llama.cpp file, dequantised
    logits_BxTxV = model(tokens_BxT)                          # float32
    save_pretrained(model, "/path/to/out")                    # transformers loads it

``model.attention`` picks the attention implementation and
``scan_layers=True`` runs the layers as one scan over stacked parameters
(``stack_layers`` / ``unstack_layers`` convert between the layouts).

``graphdef, params = nnx.split(model)`` is the pure boundary for jitted code;
``param_shardings(params, mesh, layout)`` gives the parameters' shardings.

Numerics: logits are always float32 (the LM-head matmul accumulates in
float32); attention scores and softmax are float32 whatever the compute
dtype. Against transformers' eager float32 forward pass the logits agree
within 1e-4 (max abs); with bfloat16 parameters and compute they stay within
0.05 of the float32 reference, about transformers' own bfloat16 error.
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
