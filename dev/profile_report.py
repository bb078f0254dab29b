"""Sums dev/profile_plugin.py's JSON lines by test file and by kind of time.

Usage: python dev/profile_report.py PROFILE.jsonl* [--top N]
"""

import argparse
import collections
import json


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    rows = []
    for path in args.paths:
        with open(path) as f:
            rows += [json.loads(line) for line in f if line.strip()]
    kinds = ("trace_s", "lower_s", "compile_s", "subprocess_s")
    files = collections.defaultdict(lambda: collections.Counter())
    for r in rows:
        c = files[r["nodeid"].split("::")[0]]
        c["tests"] += 1
        c["slow"] += bool(r.get("slow"))
        c["wall_s"] += r["wall_s"]
        c["compiles"] += r.get("compiles", 0)
        for k in kinds:
            c[k] += r.get(k, 0.0)
    total = collections.Counter()
    for c in files.values():
        total.update(c)
    print(f"{len(rows)} tests, {total['wall_s']:.0f} s of test time (summed over workers)")
    other = total["wall_s"] - sum(total[k] for k in kinds)
    print(
        "by kind: "
        + ", ".join(f"{k[:-2]} {total[k]:.0f} s" for k in kinds)
        + f", other (running, Python) {other:.0f} s; {total['compiles']} XLA compilations"
    )
    print()
    print(
        f"{'file':44} {'tests':>5} {'slow':>4} {'wall s':>7} {'compiles':>8} "
        f"{'trace':>6} {'lower':>6} {'compile':>7} {'subproc':>7}"
    )
    for name, c in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"]):
        print(
            f"{name:44} {c['tests']:5d} {c['slow']:4d} {c['wall_s']:7.1f} {c['compiles']:8d} "
            f"{c['trace_s']:6.1f} {c['lower_s']:6.1f} {c['compile_s']:7.1f} "
            f"{c['subprocess_s']:7.1f}"
        )
    print()
    print(f"slowest {args.top} tests:")
    for r in sorted(rows, key=lambda r: -r["wall_s"])[: args.top]:
        print(f"{r['wall_s']:7.1f} s  {r.get('compiles', 0):4d} compiles  {r['nodeid']}")


if __name__ == "__main__":
    main()
