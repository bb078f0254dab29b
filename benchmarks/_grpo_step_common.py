"""The work every system does in ``benchmarks/grpo_step.py``: prompts, reward, timing, report.

Pure Python (no torch, no jax), so the TRL, Tunix and grpo_jax sides import
the same definitions from their own virtualenvs:

* ``make_prompts(n)``: a fixed list of short arithmetic prompts with answers
  (the tiny sizes); ``workload_prompts(wl)``: the prompts a run uses, the
  driver's own list when it sets one (the real-checkpoint size's few-shot
  GSM8K prompts, built with the template and tokenizer in the driver).
* ``digit_fraction``: the reward, the fraction of a completion's characters
  that are digits. Dense on purpose: a random model almost never answers
  an arithmetic prompt exactly, so an exact-match reward would give every
  group the same reward, advantage 0 everywhere, and a degenerate step.
* ``StepClock``: wall-clock timestamps at the end of every GRPO step.
* ``emit``: the one JSON line a side prints (prefixed ``RESULT_PREFIX``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

RESULT_PREFIX = "GRPO_STEP_RESULT "


@dataclasses.dataclass(frozen=True)
class Workload:
    """One benchmark run, identical for every system.

    Attributes:
      system: "trl", "tunix" or "grpo_jax" (which side reads it).
      size: model size label ("1m", "20m", "gemma3-270m").
      checkpoint: Hugging Face directory (config.json, model.safetensors,
        tokenizer files): the tiny random Qwen2 model, or the real Gemma 3
        270M converted from its GGUF file.
      B: prompts per step.  G: completions per prompt.  T: completion tokens
        per completion (forced: no EOS stop).
      temperature: sampling and scoring temperature; top-k / top-p off.
      beta: KL coefficient (0 skips the reference model on every system).
      epsilon: PPO clip range.
      learning_rate: AdamW peak (constant schedule, no warmup, weight decay 0,
        b1 0.9, b2 0.999, eps 1e-8, global-norm clip 1.0).
      warmup_steps: steps run before the clock starts (compilation, caches).
      steps: timed steps after warm-up.
      seed: sampling / data seed.
      threads: CPU threads the side may use (torch intra-op; recorded for JAX).
      grpo_jax_model: extra ``model.*`` keys of the grpo_jax side (e.g.
        ``{"scan_layers": True}``); the other systems ignore them.
      prompts: the run's prompts as ``{"prompt", "answer"}`` rows, at least
        ``num_prompts`` of them; None: ``make_prompts(num_prompts)``.
      prompt_len: the padded prompt length (token count) the systems that
        pad to a fixed length use: grpo_jax's smallest prompt bucket and
        Tunix's ``max_prompt_length``; at least the longest prompt. TRL pads
        to the longest prompt of the batch.
      logits_chunk: grpo_jax's ``train.logits_chunk``: score the completion
        this many tokens at a time, so no [N, T, V] float32 logits are formed
        (0: all at once). TRL's fused LM head tiles on its own; Tunix forms
        the whole [N, P + T, V] logits and has no such setting.
      compilation_cache_dir: grpo_jax's ``train.compilation_cache_dir`` (JAX's
        persistent compilation cache; "": off). The other systems ignore it.
    """

    system: str
    size: str
    checkpoint: str
    B: int
    G: int
    T: int
    temperature: float
    beta: float
    epsilon: float
    learning_rate: float
    warmup_steps: int
    steps: int
    seed: int = 0
    threads: int = 0
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    grpo_jax_model: dict = dataclasses.field(default_factory=dict)
    prompts: list | None = None
    prompt_len: int = 16
    logits_chunk: int = 0
    compilation_cache_dir: str = ""

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.steps

    @property
    def num_prompts(self) -> int:
        """Distinct prompts: enough that no prompt repeats over the run."""
        return self.B * self.total_steps

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_file(cls, path: str) -> Workload:
        with open(path) as f:
            return cls(**json.load(f))


def make_prompts(n: int) -> list[dict[str, str]]:
    """``n`` fixed prompts ``"Q: a+b= A:"`` (ops + - *) with their answers."""
    out = []
    for i in range(n):
        a, b = (i * 7 + 3) % 50, (i * 13 + 5) % 50
        op = "+-*"[i % 3]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append({"prompt": f"Q: {a}{op}{b}= A:", "answer": str(value)})
    return out


def workload_prompts(wl: Workload) -> list[dict[str, str]]:
    """The ``num_prompts`` prompt rows of ``wl`` (its own list, or ``make_prompts``)."""
    if wl.prompts is None:
        return make_prompts(wl.num_prompts)
    if len(wl.prompts) < wl.num_prompts:
        raise ValueError(
            f"{wl.system}: the workload has {len(wl.prompts)} prompts, the run needs "
            f"{wl.num_prompts} (B={wl.B} x {wl.total_steps} steps)"
        )
    return [dict(row) for row in wl.prompts[: wl.num_prompts]]


def digit_fraction(completion: str) -> float:
    """Reward: digits / characters of the completion (0 for an empty one)."""
    if not completion:
        return 0.0
    return sum(ch.isdigit() for ch in completion) / len(completion)


class StepClock:
    """Timestamps (``time.perf_counter``) at the start and after every GRPO step.

    A side calls ``start()`` right before its first step and ``tick()`` when
    a step's work is finished (results on the host or blocked on).
    """

    def __init__(self):
        self.t0: float | None = None
        self.ticks: list[float] = []

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def tick(self) -> None:
        self.ticks.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        edges = [self.t0, *self.ticks]
        return [b - a for a, b in zip(edges[:-1], edges[1:])]


def timed(fn, seconds: list[float], block=None):
    """``fn`` wrapped to append its wall time (after ``block(result)``) to ``seconds``."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if block is not None:
            block(out)
        seconds.append(time.perf_counter() - t0)
        return out

    return wrapper


def summarize(
    wl: Workload,
    clock: StepClock,
    *,
    params: int,
    completion_tokens_per_step: list[int],
    sample_s_per_step: list[float] | None = None,
    extra: dict | None = None,
) -> dict:
    """The result record: steady-state throughput over the steps after warm-up.

    ``tokens_per_s`` = completion tokens of the timed steps / their wall time;
    ``first_step_s`` (compilation, caches, lazy init) is reported on its own,
    never mixed into the throughput. ``sample_s`` is the mean time of the
    sampling call (generation only) over the timed steps; the rest of a step
    is rewards, advantages, the update and the framework's glue.
    """
    if len(clock.ticks) != wl.total_steps:
        raise RuntimeError(
            f"{wl.system}: timed {len(clock.ticks)} steps, expected {wl.total_steps} "
            f"(warmup_steps={wl.warmup_steps} + steps={wl.steps})"
        )
    secs = clock.step_seconds()
    timed = secs[wl.warmup_steps :]
    tokens = sum(completion_tokens_per_step[wl.warmup_steps :])
    wall = sum(timed)
    rec = {
        "system": wl.system,
        "size": wl.size,
        "params": int(params),
        "B": wl.B,
        "G": wl.G,
        "T": wl.T,
        "beta": wl.beta,
        "warmup_steps": wl.warmup_steps,
        "steps": wl.steps,
        "completion_tokens": int(tokens),
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "step_s_mean": wall / len(timed),
        "step_s_min": min(timed),
        "first_step_s": secs[0],
        "warmup_s": sum(secs[: wl.warmup_steps]),
        "step_s_median": sorted(timed)[len(timed) // 2],
        "step_s_all": [round(s, 4) for s in secs],
    }
    if sample_s_per_step:
        if len(sample_s_per_step) != wl.total_steps:
            raise RuntimeError(
                f"{wl.system}: {len(sample_s_per_step)} sampling calls for {wl.total_steps} steps"
            )
        sample = sample_s_per_step[wl.warmup_steps :]
        rec["sample_s"] = sum(sample) / len(sample)
        rec["rest_s"] = rec["step_s_mean"] - rec["sample_s"]
        rec["sample_s_all"] = [round(s, 4) for s in sample_s_per_step]
    rec.update(extra or {})
    return rec


def emit(record: dict) -> None:
    """Prints the result line the driver looks for, and flushes."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(record) + "\n")
    sys.stdout.flush()
