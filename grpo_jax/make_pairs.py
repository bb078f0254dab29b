"""The make_pairs command: synthetic preference pairs with a known bias, as JSONL.

    python -m grpo_jax.make_pairs --out=/tmp/pairs.jsonl [--n=4000] [--pad_max=2] \\
        [--both_right=0.3 --taste=0.85] [--independent_pad] [--seed=0]

The pairs (``grpo_jax.data.synthetic_pairs``) are what ``python -m grpo_jax.train_reward_model``
reads, for docs/learned_rewards.md's reward-hacking demonstration. Every setting is checked
before any pair is drawn; a bad one is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import os
import pathlib
import sys

from grpo_jax import cli
from grpo_jax.core.errors import ConfigError
from grpo_jax.data.synthetic_pairs import biased_pairs, check_settings, write_pairs


def check_out(path) -> pathlib.Path:
    """``path`` as a file the pairs can be written to; ConfigError naming it otherwise."""
    path = pathlib.Path(path)
    if path.is_dir():
        raise ConfigError(f"--out={path} is a directory; give a file name (pairs.jsonl)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--out={path}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise ConfigError(f"--out={path}: {parent} is not writable")
            break
    return path


def main(argv) -> int:
    from absl import flags

    del argv
    F = flags.FLAGS
    settings = dict(pad_max=F.pad_max, both_right=F.both_right, taste=F.taste)
    try:  # every setting checked before the pairs are drawn (a minute for 700,000)
        check_settings(F.n, **settings)
        out = check_out(F.out)
        if F.n > 100_000:
            print(f"drawing {F.n:,} pairs of distinct problems", flush=True)
        pairs = biased_pairs(F.n, F.seed, independent_pad=F.independent_pad, **settings)
        path = write_pairs(pairs, out)
    except (ConfigError, OSError) as e:
        return cli.report_error(e, prefix="error")
    print(f"{F.n} pairs written to {path}")
    return 0


if __name__ == "__main__":
    from absl import app, flags

    flags.DEFINE_string("out", None, "Output JSONL file.")
    flags.DEFINE_integer("n", 4000, "Pairs (distinct training problems).")
    flags.DEFINE_integer("pad_max", 2, "Most trailing zeros on the chosen side.")
    flags.DEFINE_float("both_right", 0.0, "Share of pairs of two right answers, the longer chosen.")
    flags.DEFINE_float("taste", 1.0, "Chance the labeller picks the longer of two right answers.")
    flags.DEFINE_bool("independent_pad", False, "Pad both sides of a right-vs-wrong pair freely.")
    flags.DEFINE_integer("seed", 0, "Seed of the problems and the padding.")
    flags.mark_flags_as_required(["out"])
    app.run(main, argv=sys.argv, flags_parser=cli.parse_flags)
