"""Run by tests/reward_models/test_reward_models.py under launch/local_multiprocess.sh
(2 processes x 2 CPU devices): each process scores its own block of TEXTS with the reward
model, as a multi-host run scores its own rows, and saves its scores for the test to compare.

    python tests/helpers_multihost_rewards.py OUT_DIR REWARD_MODEL_DIR
"""

import pathlib
import sys

# A prompt's text (host 0's rows, 0-5, hold the two texts too long for the 32-token bucket,
# so the hosts have 4 and 6 texts to score: 2 and 3 calls of their 2 rows each) and the
# bucket each call needs differs between the hosts.
TEXTS = [
    "1+2=3",
    "x" * 60,
    "12+34=46",
    "y" * 70,
    "5",
    "9+9=18",
    "a much longer text, 26 ch",
    "b",
    "another rather long text",
    "7+1=8",
    "the last one of them: 27 c",
    "0",
]


def main(out: str, path: str) -> None:
    from grpo_jax.core import distributed

    distributed.maybe_initialize()
    import jax
    import numpy as np

    from grpo_jax.core import sharding
    from grpo_jax.reward_models import LearnedReward
    from grpo_jax.rewards.section import RewardModelSection

    mesh = sharding.make_mesh({"data": -1}, jax.devices())
    section = RewardModelSection(path=path, buckets=(16, 32), batch_size=4, normalize="running")
    learned = LearnedReward.load(section, mesh)
    rows = distributed.host_rows(mesh, len(TEXTS))
    mine = TEXTS[rows]
    raw = learned.score_tokens(learned.token_lists(mine))
    values = learned(mine, [""] * len(mine), mine, group_size=2)
    np.savez(
        pathlib.Path(out) / f"scores_{jax.process_index()}.npz",
        rows=np.array([rows.start, rows.stop]),
        raw=raw,
        values=values,
        moments=np.array([learned.moments.count, learned.moments.mean, learned.moments.m2]),
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
