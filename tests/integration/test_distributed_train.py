"""End to end: `python -m grpo_jax.main` as 2 processes x 2 CPU devices == 1 process x 4.

Both runs go through ``launch/local_multiprocess.sh`` (the 1-process run with
4 devices per process, so that ``jax.distributed`` is not involved) with the
tiny smoke config, a reward with variance on random completions (the DAPO
over-length penalty), a large learning rate so that two GRPO steps move the
parameters visibly, and no warm start. The final checkpoints' parameters must
agree to float32 rounding, and only process 0 may write the metrics file. With
``batch_std`` advantages (one std over the whole batch) this holds only if the
std is the global batch's, not each host's rows'. A tiny reward model's score, standardised
by running moments, is weighted into the reward: its per-step figures must agree too, which
holds only if each host scores its rows and the moments take both hosts' scores.

Both runs also evaluate before training, greedy and sampled (pass@2 over 2
samples a problem), in calls of 8 prompts over 12 problems (the last call
padded): from the same initial parameters, the per-problem results and the
figures of ``eval/step_0.jsonl`` must be the same for 2 processes as for 1.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers_hf import make_tiny_hf_classifier

from grpo_jax.core import problems

pytestmark = pytest.mark.slow  # two multi-process training runs

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 2
RUN_ARGS = [
    "--config=configs/default.py:smoke",
    "--config.mesh.num_devices=0",
    "--config.warm_start.enabled=False",
    "--config.eval.at_start=True",
    "--config.eval.every=0",
    "--config.eval.num_problems=12",
    "--config.eval.batch_size=8",
    "--config.eval.num_samples=2",
    "--config.eval.k=2",
    "--config.sampling.max_new_tokens=16",
    f"--config.train.steps={STEPS}",
    "--config.train.samples_every=0",
    "--config.optim.learning_rate=0.01",
    "--config.optim.warmup_steps=0",
    # Training's signal is the over-long penalty; "correct" for the evaluation is a parity of
    # the completion's characters (weight 0): about half of random completions pass it, and
    # any change of a token flips it, so the results of two evaluations can disagree.
    "--config.rewards=overlong(max_len=16,buffer=15):1.0,test_char_parity:0.0",
    "--config.correct_reward=test_char_parity",
]
PARITY_REWARD = """
from grpo_jax import rewards


@rewards.register("test_char_parity")
def char_parity(prompts, completions, **_):
    return [float(sum(map(ord, c)) % 2 == 0) for c in completions]
"""


def _without_keys_of(args, overrides):
    """``args`` less the flags whose key one of ``overrides`` sets."""
    keys = {a.split("=", 1)[0] for a in overrides}
    return [a for a in args if a.split("=", 1)[0] not in keys]


def _launch(tmp_path, name: str, processes: int, devices: int, extra=()) -> pathlib.Path:
    workdir, logs = tmp_path / name, tmp_path / f"{name}_logs"
    module = tmp_path / "parity_reward.py"
    module.write_text(PARITY_REWARD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_JAX_", "SLURM_"))}
    # This process's XLA flags less its device count, which the launcher sets per process.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env.update(XLA_FLAGS=" ".join(flags), PYTHONPATH=str(ROOT))
    cmd = [
        "bash",
        str(ROOT / "launch" / "local_multiprocess.sh"),
        "--python",
        sys.executable,
        "--timeout",
        "420",
        "--log-dir",
        str(logs),
        "--devices-per-process",
        str(devices),
        str(processes),
        *_without_keys_of(RUN_ARGS, extra),  # a key given twice is refused
        *extra,
        f"--config.reward_modules={module}",
        f"--workdir={workdir}",
    ]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=480)
    if proc.returncode != 0:
        tails = "\n".join(
            f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log"))
        )
        raise AssertionError(f"{name} run failed ({proc.returncode}):\n{proc.stderr}\n{tails}")
    return workdir


def _final_params(workdir: pathlib.Path) -> dict[str, np.ndarray]:
    path = workdir / "checkpoints" / str(STEPS) / "params"
    ckpt = ocp.PyTreeCheckpointer()
    meta = ckpt.metadata(path)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    args = jax.tree.map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
        tree,
        is_leaf=lambda x: hasattr(x, "shape"),
    )
    params = ckpt.restore(path, restore_args=args)
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}


def test_two_processes_train_like_one(tmp_path):
    # batch_std alone: its std over the global batch is what two hosts can get wrong; the
    # default estimator ("grpo", per-group statistics, each group on one host) trains as
    # 2 processes == 1 in test_pipeline_distributed.py's one-mesh case (whose first step is
    # on-policy), so a "grpo" case here would repeat it (two launches, ~60 s).
    # A learned reward beside the penalty: each host scores its own rows with the reward
    # model, and the running moments that standardise the scores take both hosts' (a host
    # standardising by its own rows' moments would train differently from one process).
    rm = make_tiny_hf_classifier(tmp_path / "rm", "qwen2")
    extra = [
        "--config.grpo.advantage_estimator=batch_std",
        f"--config.reward_model.path={rm}",
        "--config.reward_model.weight=0.5",
        "--config.reward_model.normalize=running",
        "--config.reward_model.buckets=(32,64)",
        "--config.reward_model.batch_size=8",
    ]
    multi = _launch(tmp_path, "two_by_two", processes=2, devices=2, extra=extra)
    single = _launch(tmp_path, "one_by_four", processes=1, devices=4, extra=extra)

    logs = tmp_path / "two_by_two_logs"
    log0, log1 = (logs / "process_0.log").read_text(), (logs / "process_1.log").read_text()
    assert "process 1 of 2: 2 local devices, 4 global" in log1
    # The memory plan is printed before training, by process 0 only, for the global mesh.
    assert "per-device memory estimate, layout 'fsdp', mesh data=4 x fsdp=1 x tensor=1" in log0
    assert "per-device memory estimate" not in log1
    lines = (multi / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"step"' in line]
    assert sorted(set(steps)) == list(range(0, STEPS + 1))  # step 0: the first evaluation
    assert len(steps) == len(set(steps)), "metrics written by more than one process"
    # Each process reads, samples for and scores its own half of every batch ...
    b = json.loads((multi / "config.json").read_text())["train"]["batch_size"]
    assert f"process 0 of 2 reads, samples for and scores rows 0:{b // 2} of every batch" in log0
    assert f"process 1 of 2 reads, samples for and scores rows {b // 2}:{b} of every" in log1
    # ... and the batch statistics cover both halves: the same as one process's.
    rec_multi = [json.loads(line) for line in lines]
    rec_single = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rec_multi] == [r["step"] for r in rec_single]
    for rm, rs in zip(rec_multi, rec_single, strict=True):
        keys = ("rewards/mean", "rollout/length_mean", "rollout/duplicate_frac", "train/loss")
        for key in (*keys, "rewards/reward_model/mean", "rewards/reward_model/std"):
            if key in rs:
                assert rm[key] == pytest.approx(rs[key], rel=1e-5, abs=1e-6), (rs["step"], key)
        if rs["step"] > 0:  # the learned reward was scored on every row, by both hosts
            assert rm["rewards/reward_model/errors"] == 0 and rs["rewards/reward_model/std"] > 0

    # The evaluation before training, from the same parameters: the same problems' results.
    head_multi, prob_multi = problems.read(multi / "eval" / "step_0.jsonl")
    head_single, prob_single = problems.read(single / "eval" / "step_0.jsonl")
    assert problems.to_lines(prob_multi) == problems.to_lines(prob_single)
    assert len(prob_single.ids) == 12 and prob_single.sampled_correct.shape == (1, 12, 2)
    # Not a comparison of constants: some completions pass the parity check, some fail it.
    assert 0 < prob_single.sampled_correct.sum() < prob_single.sampled_correct.size
    assert head_multi["figures"] == head_single["figures"]
    assert head_multi["record"]["devices"]["process_count"] == 2
    assert head_single["record"]["devices"]["process_count"] == 1

    p_multi, p_single = _final_params(multi), _final_params(single)
    assert p_multi.keys() == p_single.keys() and len(p_multi) > 5
    moved = 0.0
    for name, x in p_single.items():
        np.testing.assert_allclose(p_multi[name], x, rtol=1e-5, atol=1e-6, err_msg=name)
        if "bias" in name:  # biases start at zero: their size is how far training moved
            moved = max(moved, float(np.abs(x).max()))
    assert moved > 1e-3
