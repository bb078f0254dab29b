"""A run's model architecture without its weights: from a built-in table, or a config.json.

The plan compiles a run's programs from abstract parameters, so it needs the model's sizes,
never its weights (:func:`resolve` says where they come from). ``CONFIGS`` holds the
config.json keys that size each model the recipes name (configs/gsm8k.py) and the pod-scale
ones of docs/pods.md, as Hugging Face publishes them for the repositories of ``REPOS``;
``grpo_jax.models.hf_config.config_from_hf`` reads them as it reads a checkpoint's.
tests/aot/test_aot_architectures.py checks their parameter counts against published sizes.
"""

from __future__ import annotations

import json
import pathlib
import re

from grpo_jax.core.errors import ConfigError
from grpo_jax.models import builtin_tokenizer, gguf, tiny_config
from grpo_jax.models.gguf_format import GGUFFile
from grpo_jax.models.hf_config import config_from_hf
from grpo_jax.models.safetensors_io import CheckpointError
from grpo_jax.run import runlocal

_QWEN = dict(rope_theta=1_000_000.0, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False)
_LLAMA = dict(model_type="llama", rms_norm_eps=1e-5, hidden_act="silu", rope_theta=500_000.0)
_GEMMA = dict(
    model_type="gemma3_text",
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    sliding_window_pattern=6,
    tie_word_embeddings=True,
)

# name -> (Hugging Face repository, config.json keys that size the model).
REPOS_AND_CONFIGS: dict[str, tuple[str, dict]] = {
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B-Instruct", dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True, **_QWEN)),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True, **_QWEN)),
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=True, **_QWEN)),
    "qwen3-8b": ("Qwen/Qwen3-8B", dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=False, **_QWEN)),
    "qwen3-32b": ("Qwen/Qwen3-32B", dict(
        model_type="qwen3", vocab_size=151936, hidden_size=5120, intermediate_size=25600,
        num_hidden_layers=64, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=False, **_QWEN)),
    # A mixture of experts (docs/moe.md): every layer sparse, 128 experts, top 8.
    "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=False, **_QWEN)),
    "llama3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, tie_word_embeddings=True,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        **_LLAMA)),
    "llama3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        **_LLAMA)),
    "gemma3-270m": ("google/gemma-3-270m", dict(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32768, **_GEMMA)),
    "gemma3-1b": ("google/gemma-3-1b-it", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32768, **_GEMMA)),
    "gemma3-27b": ("google/gemma-3-27b-it", dict(
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024,
        query_pre_attn_scalar=168, max_position_embeddings=131072,
        rope_scaling=dict(rope_type="linear", factor=8.0), **_GEMMA)),
}  # fmt: skip
REPOS = {name: repo for name, (repo, _) in REPOS_AND_CONFIGS.items()}
CONFIGS = {name: hf for name, (_, hf) in REPOS_AND_CONFIGS.items()}


def lookup(text: str) -> str | None:
    """The ``CONFIGS`` name that ``text`` names: a name, a repository ("Qwen/Qwen3-8B") or a
    repository's last part ("Qwen3-8B", "qwen2.5-0.5b-instruct"), any case."""
    key = text.strip().lower().rstrip("/")
    for name, repo in REPOS.items():
        if key in (name, repo.lower(), repo.split("/")[1].lower()):
            return name
    return None


def _from_path_text(path: str) -> str | None:
    """A ``CONFIGS`` name in a model path: its last part, a repository quoted in it, or the
    repository a file's name starts with ("gemma-3-270m-q4_k_m.gguf")."""
    name = pathlib.PurePath(path).name
    found = lookup(name) if path else None
    for repo in re.findall(r"[\w.\-]+/[\w.\-]+", path):
        found = found or lookup(repo)
    if found is None:
        prefixes = [n for n, r in REPOS.items() if name.lower().startswith(r.split("/")[1].lower())]
        found = max(prefixes, key=lambda n: len(REPOS[n]), default=None)
    return found


def read_config_file(path: str) -> dict:
    """A config.json (or the directory that holds one), parsed; a one-line error if not."""
    p = pathlib.Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ConfigError(f"--model_config={path}: no such file (a Hugging Face config.json)")
    try:
        hf = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--model_config={path}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"--model_config={path}: a config.json holds a JSON object")
    return hf


def resolve(run, *, model: str = "", model_config: str = ""):
    """-> (``grpo_jax.models.ModelConfig``, where its sizes came from) for ``run``.

    The sizes come, in this order, from ``model_config`` (a Hugging Face config.json, or the
    directory holding one), ``model`` (a name of ``CONFIGS``), the run's ``model.path`` when it
    is a checkpoint directory here (its config.json alone is read), a ``model.path`` whose last
    part (``/models/Qwen3-8B``) or quoted repository (configs/gsm8k.py's "<set
    --config.model.path to your local Qwen/Qwen2.5-0.5B-Instruct directory>") names a
    ``CONFIGS`` entry, or the built-in tiny model (``model.path`` ""). The run's model
    settings (dtype, param_dtype, remat, attention, scan_layers) apply. No weight file is
    opened.
    """
    fields = run.model.loader_kwargs()
    if model_config:
        hf, source = read_config_file(model_config), f"--model_config={model_config}"
    elif model:
        name = lookup(model)
        if name is None:
            raise ConfigError(f"--model={model} is not a known model; known: {', '.join(CONFIGS)}")
        hf, source = CONFIGS[name], f"{REPOS[name]} (built-in table)"
    elif run.model.path.startswith(runlocal.TINY_PREFIX):  # the checkpoint a run would make
        family = run.model.path[len(runlocal.TINY_PREFIX) :]
        tiny = runlocal.tiny_model_config(family)
        fields.setdefault("param_dtype", fields.get("dtype", tiny.dtype))  # as loaded below
        return tiny.replace(**fields), f"{run.model.path} (a tiny random {family} checkpoint)"
    elif run.model.path.endswith(".gguf") and pathlib.Path(run.model.path).expanduser().is_file():
        hf, source = gguf.hf_config(GGUFFile(run.model.path)), run.model.path  # its metadata alone
    elif run.model.path and (pathlib.Path(run.model.path).expanduser() / "config.json").is_file():
        file = pathlib.Path(run.model.path).expanduser() / "config.json"
        hf, source = read_config_file(str(file)), str(file)
    elif run.model.path:
        name = _from_path_text(run.model.path)
        if name is None:
            raise ConfigError(
                f"config key 'model.path' = {run.model.path!r} is no checkpoint directory here "
                f"and names no built-in model: give --model=NAME ({', '.join(CONFIGS)}) or "
                "--model_config=PATH/config.json"
            )
        hf, source = CONFIGS[name], f"{REPOS[name]} (built-in table)"
    else:
        return _builtin_tiny(run), "the built-in tiny model"
    # As models.from_pretrained loads it: float32 unless set, parameters stored in the
    # compute dtype unless model.param_dtype says otherwise.
    fields.setdefault("param_dtype", fields.get("dtype", "float32"))
    try:
        return config_from_hf(hf, source=source, **fields), source
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def _builtin_tiny(run):
    """The built-in tiny model with the run's tokenizer's vocabulary (the built-in one's)."""
    if run.tokenizer not in ("", "builtin"):
        raise ConfigError(
            f"the built-in tiny model with tokenizer {run.tokenizer!r}: give its size with "
            "--model_config=PATH/config.json"
        )
    tok = builtin_tokenizer.build_tokenizer()
    fields = dict(run.model.overrides) | run.model.loader_kwargs()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(tok, key, None) is not None:
            fields.setdefault(key, int(getattr(tok, key)))
    return tiny_config(len(tok), **fields)
