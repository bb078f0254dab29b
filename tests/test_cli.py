"""The command-line tools on a finished run: export guards the run, evaluate reads its config,
and the console carries no library chatter."""

import io
import json
import pathlib
import re
import subprocess
import sys

import pytest

from configs.default import get_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # each test runs a command-line tool on a trained workdir

LIBRARY_INFO = re.compile(r"^I\d{4} |Unable to initialize backend|PyTorch was not found", re.M)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from grpo_jax.run.train import train

    w = tmp_path_factory.mktemp("run")
    c = get_config("smoke")
    c.warm_start.enabled = False
    c.eval.num_samples = 0
    c.eval.every = 0
    c.train.steps = 1
    train(c, w, stream=io.StringIO())
    return w


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_export_refuses_a_destination_inside_a_run(workdir, tmp_path):
    from grpo_jax.export import ExportError, export_hf

    config = (workdir / "config.json").read_text()
    for out in (workdir, workdir / "hf", workdir / "checkpoints" / "x"):
        with pytest.raises(ExportError, match="inside the training workdir"):
            export_hf(workdir, out)
    proc = _cli("grpo_jax.export", f"--workdir={workdir}", f"--out={workdir}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --out=")
    assert (workdir / "config.json").read_text() == config  # the run is untouched
    out = export_hf(workdir, tmp_path / "hf")
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()


def test_export_of_a_step_with_flipped_bytes_is_one_line_naming_the_array(workdir, tmp_path):
    import shutil

    from helpers_resume import flip_bytes

    damaged = tmp_path / "run"
    shutil.copytree(workdir, damaged, ignore=shutil.ignore_patterns(".lock"))
    flip_bytes(damaged / "checkpoints" / "1", "params")
    proc = _cli("grpo_jax.export", f"--workdir={damaged}", f"--out={tmp_path / 'hf'}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint step 1 in {damaged / 'checkpoints'}: params["), last
    assert last.endswith("differs from the checksum saved with it (damaged on disk)"), last
    assert not (tmp_path / "hf").exists()


def test_evaluate_of_a_step_with_flipped_bytes_is_one_line_naming_the_array(workdir, tmp_path):
    import shutil

    from helpers_resume import flip_bytes

    damaged = tmp_path / "run"
    shutil.copytree(workdir, damaged, ignore=shutil.ignore_patterns(".lock"))
    flip_bytes(damaged / "checkpoints" / "1", "params")
    proc = _cli("grpo_jax.evaluate", f"--checkpoint={damaged}")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: checkpoint step 1 in {damaged / 'checkpoints'}: params["), last
    assert last.endswith("differs from the checksum saved with it (damaged on disk)"), last
    assert not proc.stdout.strip()  # no figures of damaged weights


def test_evaluate_defaults_to_the_runs_config_and_refuses_another_model(workdir):
    proc = _cli("grpo_jax.evaluate", f"--checkpoint={workdir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert out["eval/num_problems"] == 16  # the smoke run's eval.num_problems
    assert not LIBRARY_INFO.search(proc.stdout + proc.stderr), proc.stderr[-2000:]
    # The shipped default config builds a bigger model than the smoke run trained.
    proc = _cli("grpo_jax.evaluate", f"--checkpoint={workdir}", "--config=configs/default.py")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "does not match the run" in last and "['model']" in last and "Omit --config" in last


def test_training_console_has_no_library_chatter(tmp_path):
    proc = _cli(
        "grpo_jax.main",
        "--config=configs/default.py:smoke",
        "--config.warm_start.enabled=False",
        "--config.train.steps=1",
        "--config.eval.num_samples=0",
        f"--workdir={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not LIBRARY_INFO.search(proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[:2000]
    assert "step 1/1" in proc.stdout
    # The first line comes before the imports and the setup, which take seconds.
    assert proc.stdout.splitlines()[0] == f"setting up the run in {tmp_path}"


@pytest.mark.parametrize(
    "args, first_words",
    [
        (["--worldir=/tmp/x"], "error: Unknown command line flag 'worldir'"),
        (["--config.grpo.GG=3"], "config error: --config.grpo.GG names no config key: grpo has"),
        (["--config.data.train_path=/no/such.jsonl", "--config.data.source=jsonl"], None),
        (
            ["--config=configs/gsm8k.py:model=qwen2.5-0.5b", "--config.model.path=/no/such/dir"],
            "config error: config key 'tokenizer' = '': no Hugging Face tokenizer files in /no/",
        ),
    ],
)
def test_user_errors_are_one_line_with_exit_status_2(tmp_path, args, first_words):
    config = (
        []
        if any(a.startswith("--config=") for a in args)
        else ["--config=configs/default.py:smoke"]
    )
    proc = _cli("grpo_jax.main", *config, f"--workdir={tmp_path}", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if first_words is not None:
        assert lines[-1].startswith(first_words), lines[-1]


def test_help_exits_0_and_verbose_shows_the_traceback(tmp_path):
    proc = _cli("grpo_jax.main", "--help")
    assert proc.returncode == 0 and "--workdir" in proc.stdout
    proc = _cli(
        "grpo_jax.main",
        "--config=configs/gsm8k.py:model=qwen2.5-0.5b",
        f"--workdir={tmp_path}",
        "--config.model.path=/no/such/dir",
        "--verbose",
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_sequences_past_the_models_context_are_warned_about(tmp_path):
    from grpo_jax.run.train import train

    c = get_config("smoke")  # the tiny model's context: max_position_embeddings = 64
    c.warm_start.enabled = False
    c.train.steps = 0
    c.eval.at_start = False
    c.sampling.max_new_tokens = 40  # + the largest prompt bucket, 32
    out = io.StringIO()
    train(c, tmp_path, stream=out)
    assert "is 72 positions, past the model's context of 64" in out.getvalue()


def test_sigterm_ends_a_run_stuck_in_a_reward_within_bounded_time(tmp_path):
    """A user reward stuck in a regex that holds the interpreter lock: SIGTERM still stops
    the run (its reward calls are killed at their deadline) with a checkpoint saved."""
    import signal

    module = tmp_path / "stuck_rewards.py"
    module.write_text(
        "import re\n"
        "from grpo_jax import rewards\n\n\n"
        "@rewards.register('stuck_regex')\n"
        "def stuck(prompts, completions, **_):\n"
        "    re.match(r'(a+)+$', 'a' * 64 + 'b')  # catastrophic backtracking, GIL held\n"
        "    return [0.0] * len(completions)\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grpo_jax.main",
            "--config=configs/default.py:smoke",
            f"--workdir={tmp_path / 'w'}",
            "--config.warm_start.enabled=False",
            "--config.eval.at_start=False",
            "--config.train.steps=1000",
            f"--config.reward_modules={module}",
            "--config.rewards=stuck_regex:1.0,exact_match(tag=None):1.0",
            "--config.train.reward_timeout_s=1.0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in proc.stdout:  # wait until a step has finished
            if line.startswith("step 1/"):
                break
        proc.send_signal(signal.SIGTERM)
        # A hang (the old behaviour) raises TimeoutExpired here.
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, rest[-2000:]
    assert "preempted: saved the checkpoint of step" in rest
    assert any(p.name.isdigit() for p in (tmp_path / "w" / "checkpoints").iterdir())


def test_compilation_cache_is_written_then_read_by_a_relaunch(tmp_path):
    """train.compilation_cache_dir: the first launch writes the sampler's and the update's
    executables; a second launch (new workdir, new process) loads them: JAX logs a
    persistent-cache hit for each, and nothing new is written."""
    cache = tmp_path / "xla_cache"
    env_args = [
        "grpo_jax.main",
        "--config=configs/default.py:smoke",
        "--config.warm_start.enabled=False",
        "--config.train.steps=1",
        "--config.eval.num_samples=0",
        "--config.eval.at_start=False",
        f"--config.train.compilation_cache_dir={cache}",
    ]
    first = _cli(*env_args, f"--workdir={tmp_path / 'a'}")
    assert first.returncode == 0, first.stderr[-2000:]
    written = sorted(p.name for p in cache.iterdir())
    for program in ("jit__prefill", "jit__decode", "jit_update"):
        assert any(n.startswith(program + "-") for n in written), (program, written)
    second = subprocess.run(
        [sys.executable, "-m", *env_args, f"--workdir={tmp_path / 'b'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "JAX_LOG_COMPILES": "1"},
    )
    assert second.returncode == 0, second.stderr[-2000:]
    hits = re.findall(r"Persistent compilation cache hit for '([^']+)'", second.stderr)
    for program in ("jit__prefill", "jit__decode", "jit_update"):
        assert program in hits, (program, hits)
    assert sorted(p.name for p in cache.iterdir()) == written


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_export_writes_the_warm_start_a_run_began_from(workdir, tmp_path, lora_rank):
    """--warm_start exports <workdir>/warm_start, not a checkpoint: the policy before GRPO
    (what a reward model starts from, docs/learned_rewards.md); for a LoRA run, the base the
    warm start trained, with no adapters."""
    import jax
    import numpy as np
    from flax import nnx

    from grpo_jax.export import ExportError, export_hf
    from grpo_jax.models import from_pretrained
    from grpo_jax.run import warm_start as sft
    from grpo_jax.run.builders import build_mesh, build_policy, build_tokenizer
    from grpo_jax.run.config import parse_config
    from grpo_jax.run.train import train

    run = tmp_path / "run"
    c = get_config("smoke")
    c.train.steps = 0
    c.eval.at_start = False
    c.warm_start.min_steps = c.warm_start.max_steps = 4
    c.model.lora.rank = lora_rank
    train(c, run, stream=io.StringIO())
    out = export_hf(run, tmp_path / "sft", warm_start=True)
    assert json.loads((out / "export.json").read_text())["step"] == "warm_start"
    exported = nnx.state(from_pretrained(out), nnx.Param)
    cached = sft.restore_cache(run, exported)
    for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(cached), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... which the warm start's four steps moved away from the run's initial parameters.
    parsed = parse_config(c)
    tokenizer = build_tokenizer(parsed, run)
    _, initial, lora_run = build_policy(parsed, tokenizer, build_mesh(parsed))
    if lora_rank:
        from grpo_jax.models import lora

        names = ["/".join(map(str, path)) for path, _ in exported.flat_state()]
        assert lora_run is not None and not any("lora" in n for n in names), names
        initial = lora.split(initial)[0]
    assert not all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(exported), jax.tree.leaves(initial), strict=True)
    )
    with pytest.raises(ExportError, match="has no warm start"):
        export_hf(workdir, tmp_path / "none", warm_start=True)
    with pytest.raises(ExportError, match="no --step"):
        export_hf(run, tmp_path / "both", warm_start=True, step=1)
