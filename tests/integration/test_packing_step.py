"""The golden step (tests/integration/test_golden_step.py) with train.packing = "on": the
tiny default's one step, packed, reports the padded step's metrics."""

import io
import json
import math

import pytest
from helpers_config import smoke_config
from test_golden_step import EXACT, GOLDEN, RUN


@pytest.mark.slow
@pytest.mark.parametrize("microbatch_tokens", [0, 32])
def test_the_packed_golden_step_matches_the_padded_metrics(tmp_path, microbatch_tokens):
    """One packed micro-batch per minibatch (0: the padded micro-batch's slots), and
    micro-batches of one packed row (32 slots: several, their count rounded up)."""
    from grpo_jax.run.train import train

    run = dict(RUN, **{"train.packing": "on", "train.microbatch_tokens": microbatch_tokens})
    train(smoke_config(**run), tmp_path, stream=io.StringIO())
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (got,) = [r for r in rows if "train/loss" in r]
    assert 0 < got["perf/pack_fill"] <= 1
    got = {k: v for k, v in got.items() if not k.startswith(("perf/", "eval/"))}
    assert sorted(got) == sorted(GOLDEN)
    for key, want in GOLDEN.items():
        if key.startswith(EXACT):
            assert got[key] == want, key
        else:
            assert math.isfinite(got[key]) and got[key] == pytest.approx(want, rel=1e-5), key
