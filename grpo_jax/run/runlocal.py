"""Small files that ``runlocal`` runs need, made by the library when a run starts.

A config describes a run; it writes no files. ``model.path = "tiny:<family>"``
asks for a small random checkpoint of a model family (Qwen2, Qwen3, Qwen3-MoE, GPT-OSS,
Llama, Gemma 3) with a character tokenizer carrying the family's chat-template
markers, saved as a Hugging Face directory; ``data.jsonl_dir =
"tiny:word_problems"`` asks for a folder of synthetic GSM8K-format word
problems. :func:`resolve` (called by ``grpo_jax.run.setup``) writes them under
$GRPO_JAX_RUNLOCAL_DIR (default <tmp>/grpo_jax_runlocal), named by a hash of
their contents, so every run and every machine makes the same files once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import random
import tempfile

from grpo_jax.models import builtin_tokenizer
from grpo_jax.models.config import family_config
from grpo_jax.models.hf_config_export import config_to_hf
from grpo_jax.models.hf_weights import weight_table
from grpo_jax.models.safetensors_io import write_checkpoint
from grpo_jax.run.config import TINY_PREFIX, ConfigError

RUNLOCAL_ENV = "GRPO_JAX_RUNLOCAL_DIR"

# Chat-template markers of each family's instruct tokenizer (special tokens),
# and which of them ends the assistant's turn.
_SPECIALS = {
    "qwen2": dict(specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], eos="<|im_end|>"),
    "llama": dict(
        specials=[
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ],
        eos="<|eot_id|>",
    ),
    "gemma3": dict(specials=["<start_of_turn>", "<end_of_turn>"], eos="<eos>"),
    # GPT-OSS's harmony markers; a message ends at <|end|>, the assistant's answer at <|return|>.
    "gpt_oss": dict(
        specials=["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>"],
        eos="<|return|>",
    ),
}
_SPECIALS["qwen3"] = _SPECIALS["qwen3_moe"] = _SPECIALS["qwen2"]

# Shaped like each family's template (same markers, roles and generation prompt).
_CHAT_TEMPLATES = {
    "qwen2": (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "qwen3": (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama": (
        "{{ '<|begin_of_text|>' }}{% for m in messages %}"
        "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + "
        "'<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "gemma3": (
        "{{ bos_token }}{% set sys = '' %}{% for m in messages %}"
        "{% if m['role'] == 'system' %}{% set sys = m['content'] + '\\n\\n' %}{% else %}"
        "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' "
        "+ (sys if loop.index0 == 1 else '') + m['content'] + '<end_of_turn>\\n' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    ),
    # Harmony's message framing, without its channels and its system preamble.
    "gpt_oss": (
        "{% for m in messages %}{{ '<|start|>' + m['role'] + '<|message|>' + m['content'] + "
        "'<|end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start|>assistant<|message|>' }}{% endif %}"
    ),
}

_TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
_ASSETS_VERSION = 1  # Bump when what the helpers below write changes.


def assets_root() -> pathlib.Path:
    """Where the made files go: $GRPO_JAX_RUNLOCAL_DIR, or <tmp>/grpo_jax_runlocal."""
    env = os.environ.get(RUNLOCAL_ENV)
    return pathlib.Path(env) if env else pathlib.Path(tempfile.gettempdir()) / "grpo_jax_runlocal"


def resolve(run):
    """``run`` with its "tiny:..." model path and data folders replaced by real ones, made now.

    model.path "tiny:<family>" becomes :func:`tiny_checkpoint`; a gsm8k
    data.jsonl_dir "tiny:word_problems" (or "tiny:one_step_problems") becomes
    :func:`word_problems_dir`
    (with data.data_dir, when unset, inside it). Files are content-addressed
    under :func:`assets_root` and reused; a run config without "tiny:" values
    comes back unchanged.
    """
    model, data = run.model, run.data
    if model.path.startswith(TINY_PREFIX):
        family = model.path[len(TINY_PREFIX) :]
        if family not in _SPECIALS:
            raise ConfigError(
                f"config key 'model.path' = {model.path!r}: no tiny checkpoint of family "
                f"{family!r}; known: {sorted('tiny:' + f for f in _SPECIALS)}"
            )
        model = dataclasses.replace(model, path=str(tiny_checkpoint(family, assets_root())))
    jsonl_dir = data.options.get("jsonl_dir")
    if isinstance(jsonl_dir, str) and jsonl_dir.startswith(TINY_PREFIX):
        kind, n_train, n_test = _problem_set(jsonl_dir)
        d = word_problems_dir(assets_root(), n_train, n_test, kind)
        options = dict(data.options, jsonl_dir=str(d))
        if options.get("data_dir") is None:
            options["data_dir"] = str(d / "tfds")
        data = dataclasses.replace(data, options=options)
    if model is run.model and data is run.data:
        return run
    return dataclasses.replace(run, model=model, data=data)


def _atomic_dir(target: pathlib.Path, fill) -> pathlib.Path:
    """Creates ``target`` by filling a fresh sibling and renaming it (safe against races)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    fill(tmp)
    try:
        tmp.rename(target)
    except OSError:  # Another process made it first: keep theirs.
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def tiny_tokenizer(family: str):
    """The project's character tokenizer plus ``family``'s chat markers and template."""
    tok = builtin_tokenizer.build_tokenizer()
    spec = _SPECIALS[family]
    tok.add_tokens([s for s in spec["specials"] if s not in tok.get_vocab()], special_tokens=True)
    tok.eos_token = spec["eos"]
    if family in ("qwen2", "qwen3", "qwen3_moe", "gpt_oss"):
        tok.pad_token = "<|endoftext|>"
    elif family == "llama":
        tok.bos_token = "<|begin_of_text|>"
        tok.pad_token = None  # As Llama 3's: the trainer pads with EOS.
    tok.chat_template = _CHAT_TEMPLATES["qwen3" if family == "qwen3_moe" else family]
    return tok


def tiny_model_config(family: str):
    """The ``ModelConfig`` of ``model.path = "tiny:<family>"``, nothing written (the plan
    command's, ``grpo_jax.aot.architectures``); a one-line ConfigError for another family."""
    if family not in _SPECIALS:
        raise ConfigError(
            f"config key 'model.path' = {TINY_PREFIX + family!r}: no tiny checkpoint of family "
            f"{family!r}; known: {sorted('tiny:' + f for f in _SPECIALS)}"
        )
    return _tiny_model_config(family, tiny_tokenizer(family))


def _tiny_model_config(family: str, tok):
    ids = lambda t: tok.convert_tokens_to_ids(t)
    eos = (ids(_SPECIALS[family]["eos"]),)
    if family == "gemma3":  # Gemma's generation_config ends turns at <end_of_turn> too.
        eos += (ids("<end_of_turn>"),)
    if family == "gpt_oss":  # and GPT-OSS's at a message's <|end|>
        eos += (ids("<|end|>"),)
    fields = dict(_TINY)
    if family == "gemma3":  # One sliding and one global layer, as Gemma 3 interleaves them.
        fields.update(num_layers=2, layer_types=("sliding_attention", "full_attention"))
        fields["sliding_window"] = 64
    if family == "qwen3_moe":  # 4 experts of half the dense width, top 2 (docs/moe.md).
        fields.update(num_experts=4, experts_per_token=2, moe_mlp_dim=32, norm_topk_prob=True)
    if family == "gpt_oss":  # a sliding and a global layer; 4 experts of width 32, top 2
        fields.update(num_layers=2, sliding_window=64, num_experts=4, experts_per_token=2)
        fields["mlp_dim"] = 32
    return family_config(
        family,
        vocab_size=len(tok),
        tie_embeddings=True,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=tok.pad_token_id,
        **fields,
    )


def tiny_checkpoint(family: str, root: pathlib.Path) -> pathlib.Path:
    """A random ``family`` model with :func:`tiny_tokenizer`, as a Hugging Face directory.

    Written with numpy only (no JAX computation while a config is built):
    normal(0, 0.02) weights, RMSNorm scales at identity (1, or 0 for Gemma's
    1 + w), seed fixed, so the directory is the same on every machine.
    """
    import numpy as np

    tok = tiny_tokenizer(family)
    cfg = _tiny_model_config(family, tok)
    key = _digest([_ASSETS_VERSION, family, repr(cfg), tok.chat_template])
    table = weight_table(cfg)

    def fill(d: pathlib.Path) -> None:
        rng = np.random.default_rng(0)

        def produce(hf_name):
            shape = next(e.hf_shape for e in table if e.hf_name == hf_name)
            if hf_name.endswith("norm.weight"):
                return np.full(shape, 0.0 if cfg.norm_plus_one else 1.0, np.float32)
            return (0.02 * rng.standard_normal(shape)).astype(np.float32)

        write_checkpoint(d, [(e.hf_name, e.hf_shape, np.float32) for e in table], produce)
        hf = config_to_hf(cfg, dtype="float32")
        (d / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        gen = {
            k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf[k] is not None
        }
        (d / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        tok.save_pretrained(str(d))

    return _atomic_dir(root / f"{family}-tiny-{key}", fill)


_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Ema", "Farid", "Gus", "Hana")
_ITEMS = ("apples", "stickers", "marbles", "books", "pencils", "shells")


def word_problem(rng: random.Random) -> dict:
    """One GSM8K-format row: {"question", "answer": "reasoning <<calc>> ... #### n"}."""
    who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 40), rng.randint(2, 12)
    kind = rng.randrange(3)
    if kind == 0:
        c_ = rng.randint(1, a + b - 1)
        n = a + b - c_
        q = f"{who} has {a} {item}, gets {b} more and gives away {c_}. How many {item} are left?"
        s = a + b
        r = f"{who} has {a}+{b}=<<{a}+{b}={s}>>{s} {item}.\nThen {s}-{c_}=<<{s}-{c_}={n}>>{n}."
    elif kind == 1:
        n = a * b
        q = f"A box holds {a} {item}. How many {item} are in {b} boxes?"
        r = f"{b} boxes hold {a}*{b}=<<{a}*{b}={n}>>{n} {item}."
    else:
        n = a
        q = f"{who} shares {a * b} {item} equally among {b} friends. How many does each get?"
        r = f"Each friend gets {a * b}/{b}=<<{a * b}/{b}={a}>>{a} {item}."
    return {"question": q, "answer": f"{r}\n#### {n:,}"}


def one_step_problem(rng: random.Random) -> dict:
    """One GSM8K-format row of a single operation: add, take away, or multiply small numbers."""
    who, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(2, 40), rng.randint(2, 20)
        n, q = a + b, f"{who} has {a} {item} and gets {b} more. How many {item} are there now?"
        r = f"{who} has {a}+{b}=<<{a}+{b}={n}>>{n} {item}."
    elif kind == 1:
        a = rng.randint(10, 50)
        b = rng.randint(2, a - 1)
        n, q = a - b, f"{who} has {a} {item} and gives away {b}. How many {item} are left?"
        r = f"{a}-{b}=<<{a}-{b}={n}>>{n} {item} are left."
    else:
        a, b = rng.randint(2, 10), rng.randint(2, 10)
        n, q = a * b, f"A box holds {a} {item}. How many {item} are in {b} boxes?"
        r = f"{b} boxes hold {a}*{b}=<<{a}*{b}={n}>>{n} {item}."
    return {"question": q, "answer": f"{r}\n#### {n:,}"}


# The made problem sets: name -> (row maker, folder prefix).
_PROBLEM_SETS = {
    "word_problems": (word_problem, "gsm8k-words"),
    "one_step_problems": (one_step_problem, "gsm8k-one-step"),
}


def _problem_set(jsonl_dir: str) -> tuple[str, int, int]:
    """ "tiny:<set>[:<n_train>:<n_test>]" -> (set, n_train, n_test); sizes default to 32, 16."""
    name, *sizes = jsonl_dir[len(TINY_PREFIX) :].split(":")
    ok = name in _PROBLEM_SETS and len(sizes) in (0, 2)
    ok = ok and all(x.isdigit() and int(x) > 0 for x in sizes)
    if not ok:
        raise ConfigError(
            f"config key 'data.jsonl_dir' = {jsonl_dir!r}: the made data sets are "
            "'tiny:word_problems' and 'tiny:one_step_problems' (32 train and 16 test "
            "problems each), with other positive sizes as 'tiny:word_problems:<n_train>:<n_test>'"
        )
    return (name, *((int(sizes[0]), int(sizes[1])) if sizes else (32, 16)))


def word_problems_dir(
    root: pathlib.Path, n_train: int = 32, n_test: int = 16, kind: str = "word_problems"
) -> pathlib.Path:
    """A folder of GSM8K-format train.jsonl / test.jsonl with synthetic problems of ``kind``."""
    make, prefix = _PROBLEM_SETS[kind]
    # The original set keeps its key (and so its folder); others add their name.
    parts = [_ASSETS_VERSION, n_train, n_test] + ([] if kind == "word_problems" else [kind])
    key = _digest(parts)

    def fill(d: pathlib.Path) -> None:
        rng = random.Random(0)
        for split, n in (("train", n_train), ("test", n_test)):
            rows = [json.dumps(make(rng)) for _ in range(n)]
            (d / f"{split}.jsonl").write_text("\n".join(rows) + "\n")

    return _atomic_dir(root / f"{prefix}-{key}", fill)
