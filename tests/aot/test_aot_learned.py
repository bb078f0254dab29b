"""The learned reward model's and the LLM judge's scoring passes in the plan command
(docs/pods.md): planned from their checkpoints' config.json and safetensors headers, the
program the run's own scorer lowers, and the TPU compiler's figures for them against the
plan's (libtpu; the slow tier).
"""

import importlib.util
import io
import json

import jax
import pytest
from helpers_hf import make_tiny_hf_checkpoint, make_tiny_hf_classifier

from grpo_jax import plan
from grpo_jax.aot import architectures, budget, programs
from grpo_jax.core import sharding
from grpo_jax.reward_models import Judge, LearnedReward, checkpoint_bytes
from grpo_jax.run.config import parse_config

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu not installed"
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny Qwen3 reward model (2 labels) and a tiny Llama judge."""
    root = tmp_path_factory.mktemp("learned")
    rm = make_tiny_hf_classifier(root / "rm", "qwen3", num_labels=2)
    judge = make_tiny_hf_checkpoint(root / "judge", "llama")
    return rm, judge


def _config(checkpoints, judge=None):
    """The CPU default on fsdp 4 with the reward model, and a judge (its own checkpoint, or
    "reference" with beta > 0)."""
    from configs import default

    rm, own = checkpoints
    c = default.get_config()
    c.mesh.data, c.mesh.fsdp = 1, 4
    c.reward_model.path, c.reward_model.label = str(rm), 1
    c.reward_model.buckets, c.reward_model.batch_size = (64, 128), 8
    c.judge.path = str(own) if judge is None else judge
    c.judge.buckets, c.judge.batch_size = (256,), 8
    c.grpo.beta = 0.04
    return c


@pytest.mark.slow  # the tiny checkpoints: torch and transformers
def test_the_plan_counts_each_scorer_with_its_own_weights(checkpoints):
    """Each scorer's plan holds its own weights (``checkpoint_bytes``) as its argument, and
    everything else the run holds (the policy's state and the other scorer) beside it; the
    judge "reference" takes the reference's weights and nothing more stays resident."""
    mesh_shape = {"data": 1, "fsdp": 4}
    run = parse_config(_config(checkpoints))
    cfg = architectures.resolve(run)[0]
    needs = budget.needs(run, cfg, mesh_shape)
    rm_w = checkpoint_bytes(str(checkpoints[0]), mesh_shape, classifier=True)
    judge_w = checkpoint_bytes(str(checkpoints[1]), mesh_shape, classifier=False)
    assert needs["reward_model"].resident - needs["judge"].resident == judge_w - rm_w
    assert needs["update"].resident == rm_w + judge_w  # what stays beside the update
    ref = parse_config(_config(checkpoints, judge="reference"))
    needs_ref = budget.needs(ref, cfg, mesh_shape)
    assert needs_ref["update"].resident == rm_w
    assert needs_ref["reward_model"].resident == needs["reward_model"].resident - judge_w


@pytest.mark.slow
def test_plan_only_lists_the_scorers(checkpoints):
    out, err = io.StringIO(), io.StringIO()
    opts = plan.Options(topology="v5e-4", plan_only=True)
    assert plan.plan(_config(checkpoints), opts, out=out, err=err) == 0, err.getvalue()
    listed = [line.split()[0] for line in out.getvalue().splitlines()[4:]]
    assert {"reward_model", "judge"} <= set(listed)


def test_a_missing_reward_model_is_one_line(tmp_path):
    c = _config((tmp_path / "nowhere", tmp_path / "judge"))
    out, err = io.StringIO(), io.StringIO()
    status = plan.plan(c, plan.Options(topology="v5e-4", plan_only=True), out=out, err=err)
    assert status == 2
    (line,) = err.getvalue().strip().splitlines()
    assert line.startswith("config error: config key 'reward_model.path' = ") and "nowhere" in line


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


@pytest.mark.slow
def test_the_plans_scorers_are_the_runs(checkpoints):
    """The plan's two programs lower to what the run's ``LearnedReward`` and ``Judge`` lower
    for a batch of their rows, with their loaded weights' shardings."""
    from flax import nnx

    run = parse_config(_config(checkpoints))
    cfg = architectures.resolve(run)[0]
    mesh = sharding.make_mesh({"data": 1, "fsdp": 4}, jax.devices()[:4])
    planned = {p.name: p for p in programs.programs(run, cfg, mesh, ["reward_model", "judge"])}
    learned = LearnedReward.load(run.reward_model, mesh)
    graphdef, params = nnx.split(learned.model)
    rows = planned["reward_model"].args[2:]
    own = learned._jit.lower(graphdef, jax.tree.map(_abstract, params), *rows)
    assert planned["reward_model"].lower().as_text() == own.as_text()
    judge = Judge.load(run.judge, mesh)
    args = planned["judge"].args
    own = judge._jit.lower(judge.graphdef, jax.tree.map(_abstract, judge.params), *args[2:])
    assert planned["judge"].lower().as_text() == own.as_text()


@pytest.mark.slow
@needs_libtpu
def test_the_scorers_compile_for_v5e_within_the_plan(checkpoints, tmp_path):
    """Both scorers compiled by the TPU compiler on v5e-4: XLA's total within the plan's own
    figure, its arguments at least the weights and rows the plan counts."""
    status = plan.plan(
        _config(checkpoints),
        plan.Options(
            topology="v5e-4", programs=("reward_model", "judge"), json=str(tmp_path / "p.json")
        ),
        out=io.StringIO(),
        err=(err := io.StringIO()),
    )
    assert status == 0, err.getvalue()
    rows = {r["program"]: r for r in json.loads((tmp_path / "p.json").read_text())["programs"]}
    assert set(rows) == {"reward_model", "judge"}
    mesh_shape = {"data": 1, "fsdp": 4}
    for name, path, classifier in (
        ("reward_model", checkpoints[0], True),
        ("judge", checkpoints[1], False),
    ):
        r = rows[name]
        assert not r["error"], r["error"]
        weights = checkpoint_bytes(str(path), mesh_shape, classifier=classifier)
        assert weights <= r["arguments"] and r["xla_total"] <= r["plan"]


def test_a_scorer_batch_the_batch_shards_do_not_divide_is_one_line(tmp_path):
    """As the run refuses it, before any checkpoint is read."""
    c = _config((tmp_path / "nowhere", tmp_path / "judge"))
    c.reward_model.batch_size = 6
    out, err = io.StringIO(), io.StringIO()
    status = plan.plan(c, plan.Options(topology="v5e-4", plan_only=True), out=out, err=err)
    assert status == 2
    assert err.getvalue().strip() == (
        "config error: config key 'reward_model.batch_size' = 6 must be a multiple of the "
        "mesh's 4 batch shards"
    )
