"""GGUF checkpoints (llama.cpp's format): Gemma 3, Llama, Qwen2 and Qwen3 text models.

    model = from_gguf("gemma-3-270m-q4_k_m.gguf")            # float32 Transformer
    tokenizer = load_gguf_tokenizer("gemma-3-270m-q4_k_m.gguf")
    convert_gguf("model.gguf", "hf_dir")                     # a Hugging Face checkpoint

The import goes through the Hugging Face route: the metadata becomes a config.json, each
tensor of the family's weight table is found under its GGUF name and dequantised, what
llama.cpp's converter changed is undone, and ``from_pretrained`` reads the result.
docs/gguf.md, "What the import does".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any

import jax.numpy as jnp
import numpy as np

import grpo_jax.models.gguf_tokenizer as gguf_tokenizer
from grpo_jax.models.config import ModelConfig
from grpo_jax.models.gguf_format import GGUFFile
from grpo_jax.models.hf import from_pretrained
from grpo_jax.models.hf_config import config_from_hf
from grpo_jax.models.hf_config_export import config_to_hf
from grpo_jax.models.hf_weights import weight_table
from grpo_jax.models.safetensors_io import CheckpointError, weight_files, write_checkpoint

log = logging.getLogger(__name__)

# general.architecture -> config.json model_type.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

# Per-layer tensor names, HF (under model.layers.i.) -> GGUF (under blk.i.).
_LAYER_NAMES = {
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
# Where the norm before the MLP lives differs: Llama/Qwen call it
# post_attention_layernorm, Gemma 3 pre_feedforward_layernorm (and has two more).
_NORM_NAMES = {
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
CACHE_MARKER = "gguf_source.json"


def gguf_name(hf_name: str, family: str) -> str:
    """The GGUF tensor name of a Hugging Face tensor name (``model.layers.0...``)."""
    if hf_name in _TOP_NAMES:
        return _TOP_NAMES[hf_name]
    m = _LAYER.fullmatch(hf_name)
    names = {**_LAYER_NAMES, **_NORM_NAMES["gemma3" if family == "gemma3" else "llama"]}
    if m is None or m.group(2) not in names:
        raise CheckpointError(f"no GGUF name for tensor {hf_name!r}")
    return f"blk.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"


def hf_config(g: GGUFFile) -> dict[str, Any]:
    """The config.json (transformers' keys) that a GGUF file's metadata describes."""
    if g.architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{g.path}: unsupported GGUF architecture {g.architecture!r}; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[g.architecture]
    if "rope_freqs.weight" in g.tensors:
        raise CheckpointError(
            f"{g.path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 scaling) "
            "are not supported; convert the original Hugging Face checkpoint instead"
        )
    if "token_embd.weight" not in g.tensors:
        raise CheckpointError(f"{g.path}: missing tensor 'token_embd.weight'")
    hidden, heads = g.arch("embedding_length"), g.arch("attention.head_count")
    missing = [
        k
        for k in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count")
        if g.arch(k) is None
    ]
    if missing:
        raise CheckpointError(
            f"{g.path}: missing metadata {[f'{g.architecture}.{k}' for k in missing]}"
        )
    head_dim = g.arch("attention.key_length") or g.arch("rope.dimension_count") or hidden // heads
    eos = [g.get("tokenizer.ggml.eos_token_id")]
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        if g.get(key) is not None and g.get(key) not in eos:
            eos.append(g.get(key))
    hf: dict[str, Any] = dict(
        model_type=family,
        vocab_size=g.shape("token_embd.weight")[0],
        hidden_size=hidden,
        intermediate_size=g.arch("feed_forward_length"),
        num_hidden_layers=g.arch("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=g.arch("attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=g.arch("context_length", 4096),
        rms_norm_eps=g.arch("attention.layer_norm_rms_epsilon", 1e-6),
        tie_word_embeddings="output.weight" not in g.tensors,
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=eos[0] if len(eos) == 1 else eos,
        pad_token_id=g.get("tokenizer.ggml.padding_token_id"),
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        mlp_bias="blk.0.ffn_up.bias" in g.tensors,
    )
    if g.arch("rope.freq_base") is not None:
        hf["rope_theta"] = g.arch("rope.freq_base")
    scaling = g.arch("rope.scaling.type")
    if scaling not in (None, "none"):
        hf["rope_scaling"] = {"rope_type": scaling, "factor": g.arch("rope.scaling.factor")}
    if family == "gemma3_text":
        hf.update(_gemma3_settings(g, hf))
    elif g.arch("attention.sliding_window") is not None:
        raise CheckpointError(f"{g.path}: sliding-window {g.architecture} models are not supported")
    return hf


def _gemma3_settings(g: GGUFFile, hf: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 3's GGUF metadata leaves out takes the values llama.cpp assumes.

    llama.cpp fixes the attention scale at head_dim**-0.5 except for the
    27B model (62 layers), which uses (hidden_size / num_heads)**-0.5; every
    sixth layer is global unless the file lists the pattern; the local RoPE
    base is 10 000.
    """
    n = hf["num_hidden_layers"]
    scalar = hf["head_dim"]
    if n == 62:
        scalar = hf["hidden_size"] // hf["num_attention_heads"]
    pattern = g.arch("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # Per layer: True where the layer slides.
        types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        p = int(pattern)
        types = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]
    out = dict(
        query_pre_attn_scalar=scalar,
        layer_types=types,
        sliding_window=g.arch("attention.sliding_window", 4096),
        rope_local_base_freq=10_000.0,
        final_logit_softcapping=g.arch("final_logit_softcapping"),
    )
    return out


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order: per head, rows (0, h, 1, h+1, ...) -> (0..h-1, h..2h-1).

    llama.cpp stores row 2 i + j of a head's rows (j in {0, 1}) from HF row
    j * Dh / 2 + i, so that adjacent rows form a rotation pair.
    """
    dh = w.shape[0] // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, dh // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_tensor(g: GGUFFile, cfg: ModelConfig, hf_name: str) -> np.ndarray:
    """The Hugging Face tensor ``hf_name`` of the model, float32, from its GGUF tensor."""
    x = g.tensor(gguf_name(hf_name, cfg.family))
    if cfg.norm_plus_one and hf_name.endswith("norm.weight"):
        x = x - np.float32(1.0)
    if g.architecture == "llama":
        if ".self_attn.q_proj." in hf_name:
            x = _unpermute_rope(x, cfg.num_heads)
        elif ".self_attn.k_proj." in hf_name:
            x = _unpermute_rope(x, cfg.num_kv_heads)
    return x


def model_config(g: GGUFFile, **fields) -> ModelConfig:
    """The :class:`ModelConfig` of a GGUF file; ``fields`` (dtype, ...) override."""
    return config_from_hf(hf_config(g), source=str(g.path), **fields)


def _write_weights(g: GGUFFile, directory: pathlib.Path, dtype: str) -> ModelConfig:
    cfg = model_config(g)
    table = weight_table(cfg)
    names = {gguf_name(e.hf_name, cfg.family): e for e in table}
    unused = sorted(set(g.tensors) - set(names))
    if unused:
        raise CheckpointError(
            f"{g.path}: {len(unused)} tensor(s) not used by the {g.architecture} model its "
            f"metadata describes, e.g. {unused[:5]}"
        )
    for name, e in names.items():
        if name not in g.tensors:
            raise CheckpointError(f"{g.path}: missing tensor {name!r} (for {e.hf_name})")
        if g.shape(name) != e.hf_shape:
            raise CheckpointError(
                f"{g.path}: tensor {name!r} has shape {g.shape(name)}, but the metadata "
                f"implies {e.hf_shape}"
            )
    np_dtype = np.dtype(jnp.dtype(dtype))
    write_checkpoint(
        directory,
        [(e.hf_name, e.hf_shape, np_dtype) for e in table],
        lambda name: hf_tensor(g, cfg, name).astype(np_dtype),
        metadata={"format": "pt"},
    )
    config = config_to_hf(cfg, dtype=np_dtype.name)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        k: config[k]
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if config[k] is not None
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return cfg


def convert_gguf(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    tokenizer: bool = True,
) -> pathlib.Path:
    """Writes the GGUF file ``path`` as a Hugging Face checkpoint directory ``out_dir``.

    Files: config.json, generation_config.json, model.safetensors (weights
    dequantised to ``dtype``: float32 keeps every dequantised value exactly,
    bfloat16 halves the size) and, with ``tokenizer``, the tokenizer built
    from the file's vocabulary (tokenizer.json, tokenizer_config.json).
    transformers' ``AutoModelForCausalLM.from_pretrained`` and
    :func:`grpo_jax.models.from_pretrained` load the directory.

    The files are written beside ``out_dir``'s others in a temporary directory
    and moved in once all are written: a conversion that fails (a tensor type
    that cannot be dequantised, a vocabulary that is not a tokenizer) leaves
    ``out_dir`` as it was.
    """
    g = GGUFFile(path)
    directory = pathlib.Path(out_dir)
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".convert_gguf.", dir=directory))
    try:
        cfg = _write_weights(g, tmp, dtype)
        if tokenizer:
            gguf_tokenizer.tokenizer_from_gguf(g).save_pretrained(str(tmp))
        for stale in weight_files(directory):  # an earlier conversion's other shards
            stale.unlink()
        for f in tmp.iterdir():
            os.replace(f, directory / f.name)
    except BaseException:
        if created:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s (%s, %d layers) into %s", g.path, cfg.family, cfg.num_layers, directory)
    return directory


def _source_stamp(path: pathlib.Path, dtype: str) -> dict[str, Any]:
    st = path.stat()
    return dict(source=str(path.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns, dtype=dtype)


def cached_conversion(path: str | os.PathLike, cache_dir: str | os.PathLike) -> pathlib.Path:
    """The float32 Hugging Face directory of ``path`` under ``cache_dir``, converted once.

    Reused while the GGUF file's size and modification time are unchanged;
    written into a temporary sibling and renamed, so that a reader never sees
    half a conversion.
    """
    source = pathlib.Path(path)
    if not source.is_file():
        raise CheckpointError(f"{source}: no such GGUF file")
    stamp = _source_stamp(source, "float32")
    target = pathlib.Path(cache_dir) / source.stem
    marker = target / CACHE_MARKER
    if marker.exists():
        with contextlib.suppress(json.JSONDecodeError):
            if json.loads(marker.read_text()) == stamp:
                return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{source.stem}.", dir=target.parent))
    try:
        _write_weights(GGUFFile(source), tmp, "float32")
        (tmp / CACHE_MARKER).write_text(json.dumps(stamp) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def from_gguf(
    path: str | os.PathLike,
    *,
    dtype=jnp.float32,
    cache_dir: str | os.PathLike | None = None,
    **loader_kwargs,
):
    """The :class:`Transformer` of a GGUF file (Gemma 3, Llama, Qwen2, Qwen3).

    The weights are dequantised to float32 (a quantised checkpoint's values
    exactly) and loaded by :func:`grpo_jax.models.from_pretrained`, which
    takes ``dtype`` and ``loader_kwargs`` (param_dtype, mesh, layout, remat,
    ...) and casts and places them as for any Hugging Face checkpoint. The
    float32 Hugging Face directory is kept in ``cache_dir`` when given (see
    :func:`cached_conversion`), else written to a temporary directory and
    removed. Raises CheckpointError naming the file and the problem.
    """
    if cache_dir is not None:
        return from_pretrained(cached_conversion(path, cache_dir), dtype=dtype, **loader_kwargs)
    with tempfile.TemporaryDirectory(prefix="grpo_jax_gguf_") as tmp:
        _write_weights(GGUFFile(path), pathlib.Path(tmp), "float32")
        return from_pretrained(tmp, dtype=dtype, **loader_kwargs)


__all__ = [
    "ARCHITECTURES",
    "GGUFFile",
    "cached_conversion",
    "convert_gguf",
    "from_gguf",
    "gguf_name",
    "hf_config",
    "model_config",
]
