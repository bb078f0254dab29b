r"""GRPO on GSM8K with a small instruct model from a local Hugging Face checkpoint.

    python -m grpo_jax.main --config=configs/gsm8k.py:model=qwen2.5-0.5b \
        --config.model.path=/models/Qwen2.5-0.5B-Instruct \
        --config.data.data_dir=$HOME/tensorflow_datasets --workdir=/runs/gsm8k_qwen05

Models (``model=<name>``; the checkpoint directory holds config.json,
model.safetensors and the tokenizer files, e.g. from ``hf download
Qwen/Qwen2.5-0.5B-Instruct --local-dir /models/Qwen2.5-0.5B-Instruct`` on a
machine with network; the README section is docs/recipes.md):

  qwen2.5-0.5b   Qwen/Qwen2.5-0.5B-Instruct
  qwen2.5-1.5b   Qwen/Qwen2.5-1.5B-Instruct
  qwen3-0.6b     Qwen/Qwen3-0.6B            (thinks in <think> by default)
  llama3.2-1b    meta-llama/Llama-3.2-1B-Instruct
  gemma3-1b      google/gemma-3-1b-it

The prompt is the question plus an instruction to reason inside <think> and
answer inside <answer>, wrapped in the model's own chat template; rewards are
GSM8K correctness (1.0) plus the R1-style format reward (0.1). No warm start:
instruct models already follow the instruction often enough for every group
to have some reward variance.

Data: TFDS ``gsm8k`` in ``data.data_dir`` (downloaded and prepared once), or
offline from GSM8K-format JSONL files with ``--config.data.jsonl_dir=/data/gsm8k``
(docs/data.md).

Variants (``:model=<name>,<flag>``):
  runlocal  the same recipe end to end on CPU in a minute: a tiny random model
            of the same family, saved as a Hugging Face checkpoint with a
            character tokenizer carrying the family's chat-template markers,
            and 48 synthetic GSM8K-format word problems prepared through the
            same TFDS route; 2 steps. The files are written when the config
            is built, under $GRPO_JAX_RUNLOCAL_DIR (default
            <tmp>/grpo_jax_runlocal), named by a hash of their contents.

      python -m grpo_jax.main --config=configs/gsm8k.py:model=gemma3-1b,runlocal \
          --workdir=/tmp/gsm8k_local

Sweep (``sweep()`` below, learning rate x beta):

    python -m grpo_jax.sweep --config=configs/gsm8k.py:model=qwen2.5-0.5b \
        --workdir_root=/runs/sweep -- --config.model.path=/models/Qwen2.5-0.5B-Instruct

prints one ``grpo_jax.main`` command per point (``--run`` runs them in turn).

Where the numbers come from (checked against the sources named):
  * DeepSeekMath (Shao et al. 2024, sec. 4.2), GRPO on GSM8K/MATH questions:
    policy learning rate 1e-6, KL coefficient beta = 0.04, 64 samples per
    question, max length 1024, one policy update per exploration stage.
  * TRL's GRPOConfig defaults: learning_rate 1e-6, num_generations G = 8,
    epsilon 0.2, temperature 1.0, beta 0.0 (0.04 in earlier releases; DAPO
    and Dr. GRPO also drop the KL term).
  Here: lr 1e-6 and beta 0.04 as DeepSeekMath, G = 8 and epsilon = 0.2 as
  TRL (G = 64 does not fit a single accelerator at these lengths), temperature
  1.0 as both. The rest is a common starting point, not taken from a paper:
  B = 32 prompts per step (256 completions) in 4 minibatches of 64, so the
  ratio and the clipping matter from the second minibatch on; 512 completion
  tokens (GSM8K solutions are short; 1024 for Qwen3, which thinks at length);
  about one epoch (234 steps of 32 of the 7473 training problems).
  Parameters stay float32: in bfloat16 an AdamW step of lr 1e-6 is below the
  parameters' resolution (2^-8 relative) and would be lost.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import random
import tempfile

from ml_collections import ConfigDict, config_dict

# name -> (family, Hugging Face repo id, completion tokens)
MODELS = {
    "qwen2.5-0.5b": ("qwen2", "Qwen/Qwen2.5-0.5B-Instruct", 512),
    "qwen2.5-1.5b": ("qwen2", "Qwen/Qwen2.5-1.5B-Instruct", 512),
    "qwen3-0.6b": ("qwen3", "Qwen/Qwen3-0.6B", 1024),
    "llama3.2-1b": ("llama", "meta-llama/Llama-3.2-1B-Instruct", 512),
    "gemma3-1b": ("gemma3", "google/gemma-3-1b-it", 512),
}
FLAGS = ("runlocal",)
RUNLOCAL_ENV = "GRPO_JAX_RUNLOCAL_DIR"


def parse_arg(arg: str | None) -> tuple[str, set[str]]:
    """ "model=qwen3-0.6b,runlocal" -> ("qwen3-0.6b", {"runlocal"}); names case-insensitive."""
    known = ", ".join(MODELS)
    model, flags = None, set()
    for part in (p.strip() for p in (arg or "").split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if sep and key.strip() == "model":
            model = value.strip().lower()
            aliases = {repo.split("/")[1].lower(): n for n, (_, repo, _) in MODELS.items()}
            model = aliases.get(model, model)
        elif not sep and part in FLAGS:
            flags.add(part)
        else:
            raise ValueError(
                f"configs/gsm8k.py: unknown argument {part!r} in {arg!r}; expected "
                f"'model=<name>[,runlocal]' with a model among: {known}"
            )
    if model is None:
        raise ValueError(f"configs/gsm8k.py needs 'model=<name>'; known models: {known}")
    if model not in MODELS:
        raise ValueError(f"configs/gsm8k.py: unknown model {model!r}; known models: {known}")
    return model, flags


def get_config(arg: str | None = None) -> ConfigDict:
    name, flags = parse_arg(arg)
    family, repo, max_new_tokens = MODELS[name]
    c = ConfigDict()
    c.seed = 0

    c.model = ConfigDict()
    # Fails at start-up with this text in the message until --config.model.path is set.
    c.model.path = f"<set --config.model.path to your local {repo} directory>"
    # Mixed precision: bfloat16 matmuls, float32 parameters and AdamW moments (as TRL's
    # bf16=True under torch autocast). remat=True recomputes each layer in the backward
    # pass: about a third more compute for activations that no longer grow with depth.
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "float32"
    c.model.remat = False
    c.tokenizer = ""  # The checkpoint's own tokenizer (and chat template).

    c.data = ConfigDict()
    c.data.source = "gsm8k"
    # TFDS data dir (None: TFDS's default, ~/tensorflow_datasets), and for no network a
    # folder of GSM8K-format train.jsonl / test.jsonl (docs/data.md).
    c.data.data_dir = config_dict.placeholder(str)
    c.data.jsonl_dir = config_dict.placeholder(str)

    c.prompt = ConfigDict()
    c.prompt.template = "{prompt}\n" + (
        "Think step by step inside <think> </think> tags, then give only the final "
        "answer inside <answer> </answer> tags."
    )  # grpo_jax.data.THINK_ANSWER_TEMPLATE, spelled out so the file shows the prompt.
    c.prompt.chat = True
    c.prompt.system = ""

    c.rewards = "gsm8k:1.0,format:0.1"
    c.correct_reward = "gsm8k"

    c.grpo = ConfigDict()
    c.grpo.G = 8  # TRL's default num_generations (DeepSeekMath: 64).
    c.grpo.beta = 0.04  # DeepSeekMath sec. 4.2.
    c.grpo.epsilon = 0.2  # PPO's and TRL's default clip range.
    c.grpo.mu = 1  # One pass over each rollout batch (DeepSeekMath: a single update).
    c.grpo.kl_estimator = "k3"
    c.grpo.reduction = "grpo"
    c.grpo.advantage_estimator = "grpo"
    c.grpo.advantage_eps = 1e-4
    c.grpo.temperature = 1.0  # Sampling and loss temperature (TRL's default).

    c.sampling = ConfigDict()
    c.sampling.max_new_tokens = max_new_tokens
    c.sampling.top_k = 0
    c.sampling.top_p = 1.0
    # Chat-formatted GSM8K prompts are under ~300 tokens with these tokenizers.
    c.sampling.prompt_buckets = (128, 256, 512)

    c.optim = ConfigDict()
    c.optim.learning_rate = 1e-6  # DeepSeekMath sec. 4.2; TRL's default.
    c.optim.schedule = "constant"
    c.optim.warmup_steps = 10
    c.optim.end_lr_factor = 0.0
    c.optim.b1 = 0.9
    c.optim.b2 = 0.99
    c.optim.eps = 1e-8
    c.optim.weight_decay = 0.0
    c.optim.max_grad_norm = 1.0
    c.optim.grad_accum = 4  # Micro-batches of 16 rows on one device: memory, same update.

    c.train = ConfigDict()
    c.train.steps = 234  # ~ one epoch of the 7473 training problems at B = 32.
    c.train.batch_size = 32
    c.train.minibatch_size = 64  # 4 updates per step: 256 completions / 64.
    c.train.log_every = 1
    c.train.samples_every = 10
    c.train.num_samples_logged = 4
    c.train.max_nonfinite_in_row = 5
    c.train.no_signal_steps = 10
    c.train.track_update = True
    c.train.update_kl_warn = 0.05
    c.train.reward_timeout_s = 5.0
    # Score completions 64 tokens at a time: with ~150k-token vocabularies the float32
    # logits of 16 rows x 512 tokens alone would be 5 GB (and their gradient as much).
    c.train.logits_chunk = 64

    c.eval = ConfigDict()
    c.eval.every = 50
    c.eval.at_start = True
    c.eval.num_problems = 0  # The whole test split (1319 problems), greedy pass@1.
    c.eval.batch_size = 256
    c.eval.num_samples = 0
    c.eval.k = 4
    c.eval.temperature = 1.0
    c.eval.split = "test"

    c.checkpoint = ConfigDict()
    c.checkpoint.every = 50
    c.checkpoint.keep = 2
    c.checkpoint.async_save = True

    c.mesh = ConfigDict()
    c.mesh.data = -1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.num_devices = 0
    c.mesh.layout = "fsdp"
    c.mesh.memory_budget_gb = 0.0  # 0: what the accelerator reports.

    c.warm_start = ConfigDict()
    c.warm_start.enabled = False

    if "runlocal" in flags:
        _runlocal(c, name)
    return c


def sweep(arg: str | None = None) -> list[dict]:
    """Learning rate x beta: 6 runs of ``arg``'s recipe, each a dict of config overrides.

    Around DeepSeekMath's (1e-6, 0.04), with beta = 0 (no KL term, no reference
    model: DAPO, Dr. GRPO, TRL's current default). Run with ``grpo_jax.sweep``.
    """
    parse_arg(arg)  # The same model names and errors as get_config.
    return [
        {"optim.learning_rate": lr, "grpo.beta": beta}
        for lr in (5e-7, 1e-6, 3e-6)
        for beta in (0.0, 0.04)
    ]


# ---------------------------------------------------------------------------
# runlocal: a tiny random model of the family and synthetic GSM8K-format data.

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
}
_SPECIALS["qwen3"] = _SPECIALS["qwen2"]

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
}

_TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)
_ASSETS_VERSION = 1  # Bump when what the helpers below write changes.


def _runlocal(c: ConfigDict, name: str) -> None:
    family = MODELS[name][0]
    env = os.environ.get(RUNLOCAL_ENV)
    root = pathlib.Path(env) if env else pathlib.Path(tempfile.gettempdir()) / "grpo_jax_runlocal"
    c.model.path = str(tiny_checkpoint(family, root))
    data = word_problems_dir(root)
    c.data.jsonl_dir = str(data)
    c.data.data_dir = str(data / "tfds")
    # Character tokens: prompts are ~300 long; one bucket, so one compilation.
    c.sampling.prompt_buckets = (384,)
    c.sampling.max_new_tokens = 16
    c.train.logits_chunk = 8  # Still chunked (2 chunks), dividing the shorter completions.
    c.grpo.G = 4
    c.train.steps = 2
    c.train.batch_size = 2
    c.train.minibatch_size = 4  # Still 2 updates per step, as the real recipe's 4.
    c.optim.grad_accum = 2
    c.train.samples_every = 1
    c.eval.every = 0
    c.eval.num_problems = 4
    c.eval.batch_size = 4
    c.checkpoint.every = 0
    c.mesh.num_devices = 1


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
    from grpo_jax.models import builtin_tokenizer

    tok = builtin_tokenizer.build_tokenizer()
    spec = _SPECIALS[family]
    tok.add_tokens([s for s in spec["specials"] if s not in tok.get_vocab()], special_tokens=True)
    tok.eos_token = spec["eos"]
    if family in ("qwen2", "qwen3"):
        tok.pad_token = "<|endoftext|>"
    elif family == "llama":
        tok.bos_token = "<|begin_of_text|>"
        tok.pad_token = None  # As Llama 3's: the trainer pads with EOS.
    tok.chat_template = _CHAT_TEMPLATES[family]
    return tok


def _tiny_model_config(family: str, tok):
    from grpo_jax.models import family_config

    ids = lambda t: tok.convert_tokens_to_ids(t)
    eos = (ids(_SPECIALS[family]["eos"]),)
    if family == "gemma3":  # Gemma's generation_config ends turns at <end_of_turn> too.
        eos += (ids("<end_of_turn>"),)
    fields = dict(_TINY)
    if family == "gemma3":  # One sliding and one global layer, as Gemma 3 interleaves them.
        fields.update(num_layers=2, layer_types=("sliding_attention", "full_attention"))
        fields["sliding_window"] = 64
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

    from grpo_jax.models.hf_config_export import config_to_hf
    from grpo_jax.models.hf_weights import weight_table
    from grpo_jax.models.safetensors_io import write_checkpoint

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


def word_problems_dir(root: pathlib.Path, n_train: int = 32, n_test: int = 16) -> pathlib.Path:
    """A folder of GSM8K-format train.jsonl / test.jsonl with synthetic word problems."""
    key = _digest([_ASSETS_VERSION, n_train, n_test])

    def fill(d: pathlib.Path) -> None:
        rng = random.Random(0)
        for split, n in (("train", n_train), ("test", n_test)):
            rows = [json.dumps(word_problem(rng)) for _ in range(n)]
            (d / f"{split}.jsonl").write_text("\n".join(rows) + "\n")

    return _atomic_dir(root / f"gsm8k-words-{key}", fill)
