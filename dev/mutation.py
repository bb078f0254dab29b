"""Mutation testing of the core: losses, advantages and the sampler's draw.

Not part of CI or tests/run.sh: a measurement of how much of the core the tests check. Usage
(docs/testing.md):

    nice -n 19 .venv/bin/python dev/mutation.py --seed 0 --max-per-module 30 \
        --out /tmp/mutation.txt [--rev HEAD] \
        [--modules losses,policy_terms,advantages,draw,sampling]

A small AST mutator of its own (JAX compiles a jitted function once per shape and
configuration, so tools that switch mutants at run time inside one process would not re-trace):

- The tree of ``--rev`` (``git archive``) is unpacked into a scratch directory, so the tests
  measured are exactly those of that commit, whatever the working tree holds meanwhile.
- Every mutation site of a module (restricted to the draw and its recording for sampling.py)
  is enumerated in source order: arithmetic operator swaps, comparison swaps, ``and``/``or``,
  dropping a ``not`` or a unary ``-``, constants (0 <-> 1, n -> n + 1, True <-> False),
  min <-> max (builtins, jnp.maximum/minimum, jnp.max/min, argmax/argmin, .max()/.min()).
  A seeded sample of at most ``--max-per-module`` is taken per module and listed.
- One mutant at a time is written into the scratch copy (the replaced expression is
  parenthesised; the rest of the file is byte for byte the original) and the module's test files
  (TEST_FILES) run on it in a fresh ``python -m pytest`` subprocess with a timeout: first the
  fast tier of those files (``-m "not slow"``), then, for a survivor, their slow tests. A mutant
  is killed when pytest fails (or times out: reported apart). The unmutated tree runs first and
  must pass; its wall time sets the timeouts (``--timeout-factor``, at least 10 minutes: on a
  loaded machine a tighter one killed an equivalent mutant by timeout).
- JAX's persistent compilation cache is a fresh directory for the run, shared by the mutants:
  its key is the compiled program (HLO) with XLA's flags, so a mutant that changes the
  program compiles its own, and one that finds a cached executable computes what the
  original computes.

Survivors are printed with their diffs: some are equivalent mutants (the same function
written differently), a reader judges which.
"""

from __future__ import annotations

import argparse
import ast
import copy
import difflib
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The test files run on each module's mutants. advantages: every file that imports it.
# losses and sampling: the files that test them directly (a mutant costs a run of these files'
# fast tier, and a survivor their slow tier too, on a 2-core CPU); the other importers, named
# in ALSO_IMPORTED, use them to build whole runs or references and are not run.
TEST_FILES = {
    "losses": [
        "tests/objective/test_losses.py",
        "tests/objective/test_losses_objectives.py",
        "tests/objective/test_losses_behavior.py",
        "tests/objective/test_peer_verl.py",
        "tests/sampling/test_sampling.py",
    ],
    "advantages": [
        "tests/objective/test_advantages.py",
        "tests/objective/test_losses.py",
        "tests/objective/test_losses_objectives.py",
        "tests/objective/test_peer_verl.py",
        "tests/rewards/test_rewards_isolation.py",
        "tests/rewards/test_rewards_scoring.py",
    ],
    "sampling": [
        "tests/sampling/test_sampling.py",
        "tests/sampling/test_sampling_model.py",
        "tests/sampling/test_sampling_stop.py",
        "tests/objective/test_losses_behavior.py",
    ],
}
ALSO_IMPORTED = {
    "losses": [
        "tests/sampling/test_sampling_model.py",
        "tests/rollout/test_episodes.py",
        "tests/run/test_memory.py",
        "tests/integration/test_train_loop.py",
        "tests/core/test_distributed.py",
        "tests/core/test_distributed_layouts.py",
    ],
    "advantages": [],
    "sampling": [
        "tests/rollout/test_episodes.py",
        "tests/rollout/test_episodes_chat.py",
        "tests/test_evaluate.py",
        "tests/rollout/test_staleness.py",
        "tests/models/test_models_gguf.py",
        "tests/core/test_distributed.py",
    ],
}
# Test files renamed since the first measurement (commit 9a45766): a --rev before the renames
# runs them under their old names.
OLD_NAMES = {
    "tests/objective/test_losses_objectives.py": "tests/test_objectives.py",
    "tests/objective/test_losses_behavior.py": "tests/test_behavior.py",
    "tests/sampling/test_sampling_stop.py": "tests/test_stop.py",
}

SOURCES = {
    "losses": ("grpo_jax/objective/losses.py", None),
    "advantages": ("grpo_jax/objective/advantages.py", None),
    # The distribution and draw of a token, and the recording of its log-probs. The draw
    # moved to grpo_jax/sampling/draw.py (shared with the paged engine); at a --rev before that move
    # name the old file's functions with --modules=sampling_before_draw.
    "draw": (
        "grpo_jax/sampling/draw.py",
        {"_min_p_filter", "candidates", "draw", "sample_step", "sample_with"},
    ),
    "sampling": ("grpo_jax/sampling/static.py", {"_write"}),
    "sampling_before_draw": (
        "grpo_jax/sampling/static.py",
        {"_min_p_filter", "candidates", "draw", "sample_step", "_draw", "_write"},
    ),
    # The policy terms (clip, CISPO, SAPO, GMPO, Clip-Cov, KL-Cov), split out of losses.py.
    "policy_terms": ("grpo_jax/objective/policy_terms.py", None),
}
for _mod, _like in (
    ("draw", "sampling"),
    ("sampling_before_draw", "sampling"),
    ("policy_terms", "losses"),
):
    TEST_FILES[_mod], ALSO_IMPORTED[_mod] = TEST_FILES[_like], ALSO_IMPORTED[_like]

BINOP_SWAPS = {
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.Div,
    ast.Div: ast.Mult,
    ast.FloorDiv: ast.Mult,
    ast.Pow: ast.Mult,
    ast.Mod: ast.Mult,
    ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
}
CMP_SWAPS = {
    ast.Lt: [ast.LtE, ast.Gt],
    ast.LtE: [ast.Lt, ast.GtE],
    ast.Gt: [ast.GtE, ast.Lt],
    ast.GtE: [ast.Gt, ast.LtE],
    ast.Eq: [ast.NotEq],
    ast.NotEq: [ast.Eq],
    ast.Is: [ast.IsNot],
    ast.IsNot: [ast.Is],
    ast.In: [ast.NotIn],
    ast.NotIn: [ast.In],
}
NAME_SWAPS = {
    "maximum": "minimum",
    "minimum": "maximum",
    "max": "min",
    "min": "max",
    "argmax": "argmin",
    "argmin": "argmax",
    "logical_and": "logical_or",
    "logical_or": "logical_and",
    "any": "all",
    "all": "any",
}


class Site:
    """One mutation: the expression node at (lineno, col) replaced by ``new``."""

    def __init__(self, node, new, what):
        self.node, self.new, self.what = node, new, what
        self.line = node.lineno


def _const_variants(value):
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [1] if value == 0 else ([0, value + 1] if value == 1 else [value + 1])
    if isinstance(value, float):
        if value == 0.0:
            return [1.0]
        return [0.0, value + 1.0] if value == 1.0 else [value + 1.0]
    return []


def sites(tree, functions):
    """Every mutation site of ``tree`` (inside ``functions`` when given), in source order."""
    out = []

    def visit(node, func, annotation):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = node.name if func is None else func
            # Defaults are behaviour; annotations are not.
            for d in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
                visit(d, name, False)
            for stmt in node.body:
                visit(stmt, name, False)
            for dec in node.decorator_list:
                visit(dec, name, False)
            return
        if isinstance(node, ast.AnnAssign):
            visit(node.target, func, True)
            if node.value is not None:
                visit(node.value, func, False)
            return
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            return  # docstrings
        active = not annotation and (functions is None or func in functions)
        if active and isinstance(node, ast.expr):
            out.extend(_mutations(node))
        for child in ast.iter_child_nodes(node):
            visit(child, func, annotation)

    visit(tree, None, False)
    out.sort(key=lambda s: (s.node.lineno, s.node.col_offset, s.what))
    return out


def _mutations(node):
    res = []
    if isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
        new = copy.deepcopy(node)
        new.op = BINOP_SWAPS[type(node.op)]()
        res.append(Site(node, new, f"{type(node.op).__name__} -> {type(new.op).__name__}"))
    elif isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in CMP_SWAPS:
        for op in CMP_SWAPS[type(node.ops[0])]:
            new = copy.deepcopy(node)
            new.ops = [op()]
            res.append(Site(node, new, f"{type(node.ops[0]).__name__} -> {op.__name__}"))
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        res.append(Site(node, new, f"{type(node.op).__name__} -> {type(new.op).__name__}"))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.Invert)):
        if not (isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)):
            res.append(Site(node, copy.deepcopy(node.operand), f"drop {type(node.op).__name__}"))
        elif _const_variants(node.operand.value):
            new = copy.deepcopy(node.operand)  # -c -> c
            res.append(Site(node, new, "drop USub"))
    elif isinstance(node, ast.Constant) and not isinstance(node.value, (str, bytes)):
        for v in _const_variants(node.value):
            res.append(Site(node, ast.Constant(v), f"{node.value!r} -> {v!r}"))
    elif isinstance(node, ast.Call):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name in NAME_SWAPS:
            new = copy.deepcopy(node)
            if isinstance(f, ast.Attribute):
                new.func.attr = NAME_SWAPS[name]
            else:
                new.func.id = NAME_SWAPS[name]
            res.append(Site(node, new, f"{name} -> {NAME_SWAPS[name]}"))
    return res


def apply(source, site):
    """``source`` with the site's expression replaced by the (parenthesised) mutant."""
    lines = source.splitlines(keepends=True)
    n = site.node
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line.encode()))
    data = source.encode()
    start = offsets[n.lineno - 1] + n.col_offset
    end = offsets[n.end_lineno - 1] + n.end_col_offset
    new = "(" + ast.unparse(site.new) + ")"
    return (data[:start] + new.encode() + data[end:]).decode()


def diff(a, b, path):
    return "".join(difflib.unified_diff(a.splitlines(True), b.splitlines(True), path, path, n=0))


def _changed_line(a, b):
    for x, y in zip(a.splitlines(), b.splitlines()):
        if x != y:
            return y.strip()
    return ""


def run_pytest(repo, files, marker, timeout, env):
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", marker]
    cmd += files
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - t0, ""
    tail = (p.stdout + p.stderr).strip().splitlines()
    summary = tail[-1] if tail else ""
    if p.returncode == 5:  # no tests collected for this marker
        return "none", time.monotonic() - t0, summary
    return ("pass" if p.returncode == 0 else "fail"), time.monotonic() - t0, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-per-module", type=int, default=30)
    ap.add_argument("--modules", default="losses,policy_terms,advantages,draw,sampling")
    ap.add_argument("--rev", default="HEAD", help="the commit whose code and tests are measured")
    ap.add_argument("--out", default=None, help="also write the report here")
    ap.add_argument("--timeout-factor", type=float, default=5.0)
    ap.add_argument(
        "--cache-dir", default=None, help="JAX's compilation cache (default: fresh, in scratch)"
    )
    ap.add_argument("--list", action="store_true", help="list the sampled mutants and stop")
    ap.add_argument(
        "--only",
        default=None,
        help="comma-separated mutant numbers of the sample to run (e.g. 8,11)",
    )
    ap.add_argument(
        "--fast-only",
        action="store_true",
        help="run the fast tier alone (no slow baseline, no slow stage for survivors)",
    )
    args = ap.parse_args()

    report_lines = []

    def say(msg=""):
        print(msg, flush=True)
        report_lines.append(msg)
        if args.out:
            pathlib.Path(args.out).write_text("\n".join(report_lines) + "\n")

    modules = args.modules.split(",")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="grpo-mutation-"))
    repo = scratch / "repo"
    repo.mkdir()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.rev], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(["git", "archive", args.rev], cwd=ROOT, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(repo)], input=archive.stdout, check=True)
    # What the tests find beside a checkout (tests/conftest.py's SHARED) and its venv.
    if (ROOT.parent / "shared").exists():
        (scratch / "shared").symlink_to(ROOT.parent / "shared")
    if (ROOT / ".venv").exists():
        (repo / ".venv").symlink_to((ROOT / ".venv").resolve())
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(repo),
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=args.cache_dir or str(scratch / "xla-cache"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.pop("PYTEST_ADDOPTS", None)
    check = subprocess.run(
        [sys.executable, "-c", "import grpo_jax; print(grpo_jax.__file__)"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not check.startswith(str(repo)):
        sys.exit(f"grpo_jax imports from {check!r}, not the scratch copy {repo}")

    say(f"# Mutation run: rev {rev}, seed {args.seed}, at most {args.max_per_module} per module")
    say(f"# scratch copy {repo}")
    plan = {}
    resolved = {
        mod: [f if (repo / f).exists() else OLD_NAMES[f] for f in TEST_FILES[mod]]
        for mod in modules
    }
    for mod in modules:
        path, functions = SOURCES[mod]
        source = (repo / path).read_text()
        tree = ast.parse(source)
        all_sites = sites(tree, functions)
        good = []
        for s in all_sites:
            mutated = apply(source, s)
            try:
                if ast.dump(ast.parse(mutated)) != ast.dump(tree):
                    good.append((s, mutated))
            except SyntaxError:
                pass
        rng = random.Random(f"{args.seed}:{mod}")
        chosen = sorted(
            rng.sample(range(len(good)), min(args.max_per_module, len(good))),
        )
        plan[mod] = (path, source, [good[i] for i in chosen])
        say(f"\n## {mod}: {path}, {len(good)} mutation sites, {len(chosen)} sampled")
        say(f"# tests run: {' '.join(resolved[mod])}")
        if ALSO_IMPORTED[mod]:
            say(f"# also import it, not run: {' '.join(ALSO_IMPORTED[mod])}")
        for j, (s, m) in enumerate(plan[mod][2]):
            say(f"  {mod}#{j:02d} line {s.line}: {s.what}: {_changed_line(source, m)}")
    if args.list:
        shutil.rmtree(scratch, ignore_errors=True)
        return

    totals = {}
    for mod in modules:
        path, source, mutants = plan[mod]
        files = resolved[mod]
        say(f"\n## {mod}: the unmutated tree")
        base = {}
        for marker in ("not slow",) if args.fast_only else ("not slow", "slow"):
            status, secs, summary = run_pytest(repo, files, marker, None, env)
            say(f"  baseline -m {marker!r}: {status} in {secs:.0f} s ({summary})")
            if status == "fail":
                sys.exit("the unmutated tree fails its tests; fix that first")
            base[marker] = (status, secs)
        timeouts = {m: max(600.0, args.timeout_factor * base[m][1]) for m in base}
        fast_kills = full_kills = timeouts_n = 0
        survivors = []
        only = None if args.only is None else {int(x) for x in args.only.split(",")}
        for j, (site, mutated) in enumerate(mutants):
            if only is not None and j not in only:
                continue
            (repo / path).write_text(mutated)
            try:
                status, secs, summary = run_pytest(
                    repo, files, "not slow", timeouts["not slow"], env
                )
                verdict = "killed (fast)"
                if status in ("fail", "timeout"):
                    fast_kills += 1
                    full_kills += 1
                    timeouts_n += status == "timeout"
                    verdict += " timeout" if status == "timeout" else ""
                elif args.fast_only:
                    verdict = "survived the fast tier"
                    survivors.append((j, site, diff(source, mutated, path)))
                else:
                    s2, secs2, summary = run_pytest(repo, files, "slow", timeouts["slow"], env)
                    secs += secs2
                    if s2 in ("fail", "timeout"):
                        full_kills += 1
                        timeouts_n += s2 == "timeout"
                        verdict = "killed (slow)" + (" timeout" if s2 == "timeout" else "")
                    else:
                        verdict = "SURVIVED"
                        survivors.append((j, site, diff(source, mutated, path)))
            finally:
                (repo / path).write_text(source)
            say(f"  {mod}#{j:02d} line {site.line} {site.what}: {verdict} ({secs:.0f} s)")
        n = len(mutants) if only is None else len(only & set(range(len(mutants))))
        totals[mod] = (n, fast_kills, full_kills, timeouts_n)
        full = "not run" if args.fast_only else full_kills
        say(f"\n  {mod}: {n} mutants, fast tier kills {fast_kills}, full kills {full}")
        for j, site, d in survivors:
            say(f"\n  survivor {mod}#{j:02d} ({site.what}):")
            say("    " + d.rstrip().replace("\n", "\n    "))

    say("\n## Summary (killed / sampled)")
    say("module      sampled  fast tier  full (fast + slow of the module's test files)")

    def row(name, n, f, k, extra=""):
        pct = lambda x: f"{x:>4} {100 * x / max(n, 1):3.0f}%"
        say(f"{name:<11} {n:>7}  {pct(f)}  {'not run' if args.fast_only else pct(k)}{extra}")

    for mod, (n, f, k, to) in totals.items():
        row(mod, n, f, k, f" ({to} by timeout)" if to else "")
    row("total", *(sum(t[i] for t in totals.values()) for i in range(3)))
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
