"""A run of a mixture of experts on an expert mesh axis: the CPU default's ``smoke,moe`` variant
(4 experts, top 2) with ``mesh.expert = 2`` runs the whole loop, its memory plan counted over
the axis (docs/moe.md)."""

import io
import json
import math

import pytest
from helpers_config import SHORT_RUN, apply_overrides

from configs.default import get_config
from grpo_jax.run.train import train


@pytest.mark.slow
def test_a_mixture_of_experts_trains_with_its_experts_split_over_two_devices(tmp_path):
    config = apply_overrides(
        get_config("smoke,moe"),
        {**SHORT_RUN, "train.steps": 2, "mesh.num_devices": 2, "mesh.expert": 2},
    )
    out = io.StringIO()
    summary = train(config, tmp_path, stream=out)
    assert "mesh data=1 x fsdp=1 x tensor=1 x expert=2" in out.getvalue()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and summary["steps"] == 2
    assert all(math.isfinite(r["train/loss"]) for r in steps)
