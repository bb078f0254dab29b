"""End-to-end GRPO throughput of grpo_jax against TRL's GRPOTrainer and Tunix's GRPOLearner.

    .venv/bin/python benchmarks/grpo_step.py --setup            # once: the peers' venvs
    .venv/bin/python benchmarks/grpo_step.py                    # 1m and 20m, every system
    .venv/bin/python benchmarks/grpo_step.py --sizes 1m --systems grpo_jax,trl --steps 3

What is measured: completion tokens per second over ``--steps`` GRPO steps
after ``--warmup`` untimed steps. One step is the whole of GRPO's inner loop
on one batch: sample G completions for each of B prompts, score them with the
reward, compute group advantages, and take one AdamW update (mu = 1), with
the reference model's forward pass when beta > 0. The first step's time
(compilation for the JAX systems, lazy initialisation for torch) is reported
separately and never mixed into the throughput.

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

Each side prints one ``GRPO_STEP_RESULT {json}`` line; this driver prints a
table, per-size ratios, and as its last two lines ``speedup_vs_trl=<x>`` and
``speedup_vs_tunix=<x>`` for the largest size run (20m by default).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
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


def build_checkpoint(size: str, out_dir: pathlib.Path, seed: int = 0) -> int:
    """Saves a random Qwen2 model of ``size`` and the tokenizer; returns its parameter count."""
    import torch
    import transformers

    from grpo_jax.models import builtin_tokenizer

    shape = SIZES[size]
    cfg = transformers.Qwen2Config(
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
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(str(out_dir))
    builtin_tokenizer.save_tokenizer(out_dir)
    # No sampling defaults in the checkpoint: each system gets its settings explicitly.
    gen_cfg = out_dir / "generation_config.json"
    if gen_cfg.exists():
        gen_cfg.unlink()
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------
# Running the sides.


def run_side(wl: common.Workload, work: pathlib.Path, timeout: float) -> dict:
    python = python_of(wl.system)
    if not python.exists():
        raise SystemExit(
            f"no virtualenv for {wl.system} at {python.parent.parent}: "
            "run `python benchmarks/grpo_step.py --setup` first"
        )
    wl_path = work / f"{wl.system}_{wl.size}.json"
    wl_path.write_text(wl.to_json())
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device for both JAX systems
    if wl.threads and wl.system != "trl":
        multi = "true" if wl.threads > 1 else "false"
        env["XLA_FLAGS"] = (
            f"--xla_cpu_multi_thread_eigen={multi} intra_op_parallelism_threads={wl.threads}"
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
        raise RuntimeError(
            f"{wl.system} ({wl.size}) failed with exit code {proc.returncode}; "
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
    p.add_argument("--sizes", default="1m,20m", help=f"comma list of {sorted(SIZES)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {SYSTEMS}")
    p.add_argument("--B", type=int, default=4, help="prompts per step")
    p.add_argument("--G", type=int, default=4, help="completions per prompt")
    p.add_argument("--T", type=int, default=64, help="completion tokens (forced)")
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
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
    p.add_argument("--timeout", type=float, default=1800, help="seconds per side")
    p.add_argument("--workdir", default=None, help="keep checkpoints and logs here")
    p.add_argument("--json", default=None, help="also write all records to this file")
    args = p.parse_args(argv)

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"--sizes: unknown size {s!r}; known: {', '.join(SIZES)}")
    if args.setup:
        setup(systems)
        return
    if args.threads < 0:
        raise SystemExit(f"--threads must be >= 0, got {args.threads}")
    for name in ("B", "G", "T", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.G < 2:
        raise SystemExit(f"--G must be >= 2 (group advantages), got {args.G}")
    if args.warmup < 1:
        raise SystemExit(f"--warmup must be >= 1 (the first step compiles), got {args.warmup}")

    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="grpo_step_"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"GRPO step benchmark: B={args.B} G={args.G} T={args.T} beta={args.beta} "
        f"lr={args.lr} warmup={args.warmup} steps={args.steps}; work dir {work}",
        flush=True,
    )
    records, all_records = [], []
    for size in sizes:
        ckpt = work / f"qwen2_{size}"
        n = build_checkpoint(size, ckpt)
        print(f"[{size}] random Qwen2 with {n:,} parameters at {ckpt}", flush=True)
        best = {}
        # Round-robin over the systems, so a burst of load elsewhere on the
        # machine hits one repeat of each rather than every repeat of one.
        for rep in range(args.repeats):
            for system in systems:
                wl = common.Workload(
                    system=system,
                    size=size,
                    checkpoint=str(ckpt),
                    B=args.B,
                    G=args.G,
                    T=args.T,
                    temperature=1.0,
                    beta=args.beta,
                    epsilon=0.2,
                    learning_rate=args.lr,
                    warmup_steps=args.warmup,
                    steps=args.steps,
                    threads=args.threads,
                    grpo_jax_model=model_options(args.grpo_jax_model),
                )
                rec = run_side(wl, work, args.timeout)
                rec["repeat"] = rep
                print(
                    f"[{size}] {system} run {rep + 1}/{args.repeats}: "
                    f"{rec['tokens_per_s']:.1f} completion tok/s ({rec['step_s_mean']:.3f} s/step "
                    f"steady, sampling {rec.get('sample_s', float('nan')):.3f} s of it; "
                    f"first step {rec['first_step_s']:.2f} s)",
                    flush=True,
                )
                all_records.append(rec)
                if system not in best or rec["tokens_per_s"] > best[system]["tokens_per_s"]:
                    best[system] = rec
        records.extend(best[s] for s in systems)
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
    headline = "20m" if "20m" in sizes else sizes[-1]
    print(f"(speedups below are for size {headline})")
    print(f"speedup_vs_trl={fmt(ratio(records, headline, 'grpo_jax', 'trl'))}")
    print(f"speedup_vs_tunix={fmt(ratio(records, headline, 'grpo_jax', 'tunix'))}")


if __name__ == "__main__":
    main()
