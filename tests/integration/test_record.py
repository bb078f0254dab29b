"""The record of what ran, in a real smoke run's summary.json and evaluation files."""

import hashlib
import importlib.metadata
import json
import pathlib
import subprocess

import jax
import pytest
from helpers_config import smoke_config

from grpo_jax import compare
from grpo_jax.core import problems
from grpo_jax.run import record
from grpo_jax.run.train import train

pytestmark = pytest.mark.slow  # trains the smoke config end to end

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_record_fields_in_a_smoke_run(tmp_path):
    wd = tmp_path / "run"
    overrides = {"seed": 1, "eval.seeds": (0, 2), "train.steps": 2, "warm_start.enabled": False}
    train(smoke_config(**overrides), wd)
    summary = json.loads((wd / "summary.json").read_text())
    rec = summary["record"]
    # The config: its full text is the run's config.json, its hash that text's sha256.
    assert json.loads(rec["config"]) == json.loads((wd / "config.json").read_text())
    assert rec["config_sha256"] == hashlib.sha256(rec["config"].encode()).hexdigest()
    # The code: this checkout's commit.
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert rec["code"]["git_commit"] == head and isinstance(rec["code"]["git_dirty"], bool)
    for lib in ("jax", "flax", "optax", "orbax-checkpoint", "transformers"):
        assert rec["versions"][lib] == importlib.metadata.version(lib)
    assert rec["devices"]["device_kind"] == jax.devices()[0].device_kind
    assert rec["devices"]["device_count"] == 1  # the smoke config's mesh.num_devices
    assert rec["devices"]["visible_device_count"] == jax.device_count() == 8
    assert rec["seeds"] == {"seed": 1, "data_seed": 1, "eval_seeds": [0, 2]}
    # The data: the evaluated problems' ids, hashed in order, and the data section.
    assert summary["eval_files"] == {"before": "eval/step_0.jsonl", "after": "eval/step_2.jsonl"}
    header, prob = problems.read(wd / summary["eval_files"]["after"])
    ids = "\n".join(prob.ids).encode()
    assert rec["data"]["eval_sha256"] == hashlib.sha256(ids).hexdigest()
    assert rec["data"]["eval_problems"] == len(prob.ids) == 16
    assert rec["data"]["section"] == json.loads(rec["config"])["data"]
    # Each evaluation file holds the same record, its figures and its seeds.
    assert header["record"]["config_sha256"] == rec["config_sha256"]
    assert header["seeds"] == [0, 2] and prob.seeds == (0, 2)
    assert header["figures"]["eval/pass_at_1"] == summary["after"]["pass_at_1"]
    assert header["figures"]["eval/pass_at_1_lo"] == summary["after"]["pass_at_1_lo"]
    assert record.config_hash(json.loads(rec["config"])) == rec["config_sha256"]
    # compare reads the workdir: before and after paired on the same problems.
    _, table, paired = compare.compare([str(wd)])
    assert table[0]["problems"] == 16 and "change" in table[0] and paired == []
