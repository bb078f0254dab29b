"""Partial rollouts against whole rollouts on the paged engine, over consecutive steps.

The workload of ``benchmarks/engine.py`` (a random model of grpo_jax's own
``tiny_config`` family, built in process; long-tailed completion lengths from
``--eos-count`` ending ids), but as a run sees it: ``--steps`` steps, each of
B new prompts x G samples. Whole rollouts (``paged.generate``): each step's
run ends when its longest row does, its slots idle in the tail. Partial
rollouts (``sampling.partial_rollouts``, ``grpo_jax.rollout.partial.Carry``'s engine
call): the run of step s also holds the groups of steps s + 1 .. s + k, which
start in the slots the step's rows free, and their unfinished rows carry over.
Both use B * G decode slots and the same parameters at every step (the
engine's time alone: no update in between; a real run's updates only change
which version drew a token).

Reported per mode: the useful completion tokens of the steps' batches (the B
groups each step delivers; rows drawn ahead for steps past the last are not
counted) per second of wall time over the steps, after a warm-up that
compiles (until a pass compiles nothing new); the median over the
``--runs`` runs (modes alternate) that compiled nothing (a run that still
met a new shape says so, and is left out), and the ratio ``partial_vs_whole``.

    python benchmarks/partial.py
    python benchmarks/partial.py --steps 8 --max-new-tokens 512 --eos-count 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np
from flax import nnx

from grpo_jax.models import create_model, tiny_config
from grpo_jax.sampling import paged
from grpo_jax.sampling.static import SamplingConfig, pad_prompts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=4, help="B, prompts per step")
    p.add_argument("--num-samples", type=int, default=8, help="G, completions per prompt")
    p.add_argument("--steps", type=int, default=6, help="steps per timed run")
    p.add_argument("--staleness", type=int, default=1, help="k: steps drawn ahead")
    p.add_argument("--prompt-len", type=int, default=48, help="longest prompt (others shorter)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--eos-count", type=int, default=32, help="ids that end a row (of V)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per mode (median)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = parse_args(argv)
    model_cfg = tiny_config(
        a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_heads=4, num_kv_heads=2,
        head_dim=a.hidden // 4, mlp_dim=3 * a.hidden,
    )  # fmt: skip
    graphdef, params = nnx.split(create_model(model_cfg, seed=a.seed))
    b, g, k, t = a.prompts, a.num_samples, a.staleness, a.max_new_tokens
    cfg = SamplingConfig(
        max_new_tokens=t,
        eos_ids=tuple(range(a.eos_count)),
        prompt_buckets=(a.prompt_len,),
        engine="paged",
        page_size=a.page_size,
    )

    def prompts_of(run: int, step: int):
        rng = np.random.default_rng((a.seed, run, step))
        lengths = rng.integers(a.prompt_len // 3, a.prompt_len + 1, b)
        return [rng.integers(a.eos_count, a.vocab, n).astype(np.int32) for n in lengths]

    calls = {"whole": [0, 0, 0], "partial": [0, 0, 0]}  # decode calls, their rows, extensions

    def count(name, st):
        c = calls[name]
        c[0] += st.decode_steps
        c[1] += round(st.decode_steps * st.slot_occupancy * b * g / max(st.row_occupancy, 1e-9))
        c[2] += st.extend_chunks

    def whole(run: int) -> int:
        tokens = 0
        for s in range(a.steps):
            prompts = prompts_of(run, s)
            toks, mask = pad_prompts([p.tolist() for p in prompts], pad_id=0,
                                     buckets=(a.prompt_len,))  # fmt: skip
            out, st = paged.generate_with_stats(
                graphdef, params, toks, mask, jax.random.key(s), cfg, num_samples=g
            )
            count("whole", st)
            tokens += int(np.asarray(out.lengths).sum())
        return tokens

    def partial(run: int) -> int:
        groups = [p for s in range(k + 1) for p in prompts_of(run, s)]
        rows = paged.fresh_rows(len(groups) * g, t, 0)
        tokens = 0
        for s in range(a.steps):
            rows, st = paged.generate_rows(
                graphdef, params, groups, rows, jax.random.key(s), cfg, num_samples=g, due=b
            )
            count("partial", st)
            tokens += int(rows.count_N[: b * g].sum())
            # The step's B groups leave; the next step's new prompts join behind the rest.
            groups = groups[b:] + prompts_of(run, s + k + 1)
            rows = paged.Rows(
                *(
                    None if x is None else np.concatenate([x[b * g :], y])  # routes: None
                    for x, y in zip(rows, paged.fresh_rows(b * g, t, 0))
                )
            )
        return tokens

    modes = {"whole": whole, "partial": partial}
    print(
        f"model D={a.hidden} L={a.layers} V={a.vocab}; B={b} G={g} ({b * g} slots), "
        f"{a.steps} steps a run, T={t}, {a.eos_count} EOS ids, k={k}; "
        f"backend {jax.default_backend()}"
    )
    # Warm-up: the engine compiles one program per (rows, table) bucket pair a step meets,
    # so passes run until one compiles nothing new (a timed run may still meet a new pair:
    # the median over runs absorbs it).
    t0, passes, before = time.perf_counter(), 0, -1
    while before != paged.compile_count() and passes < 8:
        before = paged.compile_count()
        for fn in modes.values():
            fn(1000 + passes)
        passes += 1
    print(
        f"warm-up: {passes} passes of both modes, {paged.compile_count()} programs, "
        f"{time.perf_counter() - t0:.1f}s"
    )
    rates: dict[str, list[float]] = {k: [] for k in modes}
    clean: dict[str, list[float]] = {k: [] for k in modes}  # runs that compiled nothing
    for c in calls.values():
        c[:] = [0, 0, 0]
    for r in range(a.runs):
        for name, fn in modes.items():
            compiled, t0 = paged.compile_count(), time.perf_counter()
            tokens = fn(r)
            dt = time.perf_counter() - t0
            rates[name].append(tokens / dt)
            new = paged.compile_count() - compiled
            if not new:
                clean[name].append(rates[name][-1])
            note = f" ({new} compiled)" if new else ""
            print(f"run {r} {name:>7}: {tokens:6d} batch tokens in {dt:6.2f}s = "
                  f"{rates[name][-1]:8.1f} tokens/s{note}")  # fmt: skip
    # A run that still compiled times its compilation too: the median is over the others.
    med = {k: statistics.median(clean[k] or rates[k]) for k in rates}
    for name, v in med.items():
        steps, rows, ext = calls[name]
        print(
            f"{name}: median {v:.1f} useful completion tokens/s ({len(clean[name])} runs "
            f"without compilation); over the timed runs "
            f"{steps} decode calls of {rows / max(steps, 1):.1f} packed rows on average, "
            f"{ext} prefill calls of carried rows"
        )
    print(f"partial_vs_whole={med['partial'] / med['whole']:.2f}")


if __name__ == "__main__":
    main()
