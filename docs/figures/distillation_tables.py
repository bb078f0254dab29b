"""The tables of docs/distillation_demo.md from the runs' metrics.jsonl and summary.json.

python docs/figures/distillation_tables.py grpo=WD,WD,WD distill=WD,... both=WD,...

Each argument is an arm's label and its workdirs; a workdir without summary.json (a run that
did not finish) is left out and named on standard error.
"""

import json
import pathlib
import sys

import numpy as np

EVAL_STEPS = (0, 50, 100, 150, 200)
WINDOW_ENDS = (1, 10, 50, 100, 150, 200)  # 10-step windows ending here (step 1: alone)


def _rows(wd: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (wd / "metrics.jsonl").read_text().splitlines()]


def _by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {int(r["step"]): r[key] for r in rows if key in r and "step" in r}


def _window(rows: list[dict], key: str, end: int) -> float:
    vals = _by_step(rows, key)
    width = 1 if end == 1 else 10
    xs = [vals[s] for s in range(max(1, end - width + 1), end + 1) if s in vals]
    return float(np.mean(xs)) if xs else float("nan")


def _cell(xs: list[float]) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{np.mean(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main(argv: list[str]) -> int:
    arms: dict[str, list[pathlib.Path]] = {}
    for arg in argv:
        label, _, dirs = arg.partition("=")
        arms[label] = []
        for d in dirs.split(","):
            wd = pathlib.Path(d)
            if (wd / "summary.json").exists():
                arms[label].append(wd)
            else:
                print(f"note: {wd} has no summary.json; left out", file=sys.stderr)
    data = {a: [(wd, _rows(wd)) for wd in wds] for a, wds in arms.items() if wds}
    spread = "mean over seeds (lowest-highest seed)"

    print(f"Held-out greedy pass@1 (`eval/pass_at_1`, 512 problems a seed), {spread}:\n")
    print("| arm | seeds | " + " | ".join(f"step {s}" for s in EVAL_STEPS) + " |")
    print("|---|---|" + "---|" * len(EVAL_STEPS))
    for arm, runs in data.items():
        cells = [
            _cell([_by_step(r, "eval/pass_at_1").get(s, float("nan")) for _, r in runs])
            for s in EVAL_STEPS
        ]
        print(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")

    heads = " | ".join("step 1" if e == 1 else f"steps {e - 9}-{e}" for e in WINDOW_ENDS)
    for key, title in (
        ("rollout/pass_rate", "Training rollouts' pass rate (`rollout/pass_rate`, 256 a step)"),
        ("teacher/kl", "Sampled per-token reverse KL to the teacher (`teacher/kl`)"),
        ("teacher/adv_share", "The teacher term's share of the advantage (`teacher/adv_share`)"),
    ):
        print(f"\n{title}, mean over 10 steps, {spread}:\n")
        print(f"| arm | {heads} |")
        print("|---|" + "---|" * len(WINDOW_ENDS))
        for arm, runs in data.items():
            if not any(key in r for _, rows in runs for r in rows):
                continue
            cells = [_cell([_window(r, key, e) for _, r in runs]) for e in WINDOW_ENDS]
            print(f"| {arm} | " + " | ".join(cells) + " |")

    print("\nPer run (greedy pass@1 with its Wilson interval; times in seconds):\n")
    print(
        "| run | seed | pass@1 before | pass@1 after | sampled pass@1 after | warm start "
        "(s, steps) | wall | wall - warm start | median step | sampled tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arm, runs in data.items():
        for wd, rows in runs:
            sm = json.loads((wd / "summary.json").read_text())
            b, a, ws = sm["before"], sm["after"], sm["warm_start"]
            step_s = np.median([r["perf/step_s"] for r in rows if "perf/step_s" in r])
            print(
                f"| {arm} {wd.name} | {sm['seed']} | {b['pass_at_1']:.3f} "
                f"[{b['pass_at_1_lo']:.3f}, {b['pass_at_1_hi']:.3f}] | {a['pass_at_1']:.3f} "
                f"[{a['pass_at_1_lo']:.3f}, {a['pass_at_1_hi']:.3f}] | "
                f"{a['sampled_pass_at_1']:.3f} | {ws['seconds']:.0f} ({ws['steps']}) | "
                f"{sm['wall_seconds']:.0f} | {sm['wall_seconds'] - ws['seconds']:.0f} | "
                f"{step_s:.2f} | {sm['sampled_tokens']} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
