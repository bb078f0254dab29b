"""Launch scripts: syntax, shellcheck, dry runs that print (and run) the right commands."""

import os
import pathlib
import shlex
import shutil
import stat
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
SCRIPTS = ["tpu_pod.sh", "gpu_single_node.sh", "slurm.sbatch", "local_multiprocess.sh"]


def _run(args, env=None, timeout=60, check=True):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(env or {})
    proc = subprocess.run(
        ["bash", *map(str, args)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=ROOT,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def _commands(stdout: str) -> list[list[str]]:
    """The "+ cmd" lines of a dry run, split back into words as the shell would."""
    return [shlex.split(line[2:]) for line in stdout.splitlines() if line.startswith("+ ")]


def _fake_bin(tmp_path, names, exit_codes=None):
    """Executables that log their argv (one line, shell-quoted) to tmp_path/calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    for name in names:
        code = (exit_codes or {}).get(name, 0)
        path = bin_dir / name
        path.write_text(
            f'#!/usr/bin/env bash\n{{ printf "%q " {name} "$@"; echo; }} >> {log}\nexit {code}\n'
        )
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, log


def _calls(log) -> list[list[str]]:
    if not log.exists():
        return []
    return [shlex.split(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_syntax_and_help(script):
    path = LAUNCH / script
    assert os.access(path, os.X_OK), f"{path} is not executable"
    _run(["-n", path])
    out = _run([path, "--help"]).stdout
    assert "Usage:" in out and "--dry-run" in out


@pytest.mark.parametrize("script", SCRIPTS)
def test_shellcheck(script):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck); CI installs it")
    proc = subprocess.run(
        ["shellcheck", str(LAUNCH / script)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- tpu_pod.sh --------------------------------------------------------------

TPU_ENV = {
    "PROJECT": "my-proj",
    "ZONE": "us-west4-a",
    "ACCELERATOR_TYPE": "v5litepod-16",
    "TPU_NAME": "grpo-test",
    "CONFIG": "configs/gsm8k.py:model=qwen2.5-0.5b",
    "WORKDIR": "gs://bucket/run 1",
}


def test_tpu_pod_dry_run_prints_every_step_and_runs_nothing(tmp_path):
    env, log = _fake_bin(tmp_path, ["gcloud", "git", "rm"])
    odd = '--config.note=it\'s a "test"'
    out = _run(
        [LAUNCH / "tpu_pod.sh", "--dry-run", "all", "delete", "--", "--config.train.steps=3", odd],
        env={**env, **TPU_ENV},
    ).stdout
    assert _calls(log) == []  # nothing ran
    cmds = _commands(out)
    loc = ["--zone=us-west4-a", "--project=my-proj"]
    tpu = ["gcloud", "compute", "tpus", "tpu-vm"]
    assert "describe grpo-test" in out  # the dry run shows the reuse check
    assert cmds[0] == [*tpu, "create", "grpo-test", *loc, "--accelerator-type=v5litepod-16",
                       "--version=tpu-ubuntu2204-base"]  # fmt: skip
    assert cmds[1][:4] == ["git", "-C", str(ROOT), "archive"]
    archive = cmds[1][-2]
    assert cmds[2] == [*tpu, "scp", archive, "grpo-test:grpo_jax.tar.gz", *loc, "--worker=all"]
    ssh = [c for c in cmds if c[:5] == [*tpu, "ssh"]]
    assert all(c[5:9] == ["grpo-test", *loc, "--worker=all"] for c in ssh)
    remote = [c[9].removeprefix("--command=") for c in ssh]
    assert "tar xzf grpo_jax.tar.gz -C grpo_jax" in remote[0]
    assert "'jax[tpu]'" in remote[1] and "-r requirements.txt" in remote[1]
    train = shlex.split(remote[2])
    assert train[:3] == ["cd", "grpo_jax", "&&"]
    assert train[3:] == [
        ".venv/bin/python",
        "-m",
        "grpo_jax.main",
        "--config=configs/gsm8k.py:model=qwen2.5-0.5b",
        "--workdir=gs://bucket/run 1",
        "--config.train.steps=3",
        odd,
    ]
    assert cmds[-1] == [*tpu, "delete", "grpo-test", *loc, "--quiet"]
    stop = _commands(_run([LAUNCH / "tpu_pod.sh", "--dry-run", "stop"], env=TPU_ENV).stdout)
    assert stop[0][-1] == "--command=pkill -TERM -f 'python -m grpo_jax.main' || true"


def test_tpu_pod_creates_only_when_missing(tmp_path):
    # describe fails: the TPU VM is created.
    env, log = _fake_bin(tmp_path, ["gcloud"], exit_codes={"gcloud": 1})
    proc = _run([LAUNCH / "tpu_pod.sh", "create"], env={**env, **TPU_ENV}, check=False)
    calls = _calls(log)
    assert [c[4] for c in calls] == ["describe", "create"]
    assert proc.returncode == 1  # the fake create fails too, and the script stops
    # describe succeeds: reused, nothing created; then training runs on all workers.
    (tmp_path / "ok").mkdir()
    env, log = _fake_bin(tmp_path / "ok", ["gcloud"])
    out = _run([LAUNCH / "tpu_pod.sh", "create", "train"], env={**env, **TPU_ENV}).stdout
    assert "reusing it" in out
    calls = _calls(log)
    assert [c[4] for c in calls] == ["describe", "ssh"]
    assert "--worker=all" in calls[1]
    assert "grpo_jax.main" in calls[1][-1]


def test_tpu_pod_rejects_unknown_step():
    proc = _run([LAUNCH / "tpu_pod.sh", "--dry-run", "launch"], check=False)
    assert proc.returncode == 2
    assert "unknown step or option 'launch'" in proc.stderr
    proc = _run([LAUNCH / "tpu_pod.sh", "--dry-run"], check=False)
    assert proc.returncode == 2 and "no step given" in proc.stderr


# -- gpu_single_node.sh ------------------------------------------------------


def test_gpu_single_node_dry_run(tmp_path):
    env, log = _fake_bin(tmp_path, ["python3"])
    out = _run(
        [LAUNCH / "gpu_single_node.sh", "--dry-run", "--gpus", "0,1", "--config", "c.py:x",
         "--workdir", "/runs/a", "install", "train", "--", "--config.mesh.fsdp=-1"],
        env=env,
    ).stdout  # fmt: skip
    assert _calls(log) == []
    cmds = _commands(out)
    assert cmds[0] == ["python3", "-m", "venv", f"{ROOT}/.venv"]
    assert cmds[2][-1] == "jax[cuda12]" and "-r" in cmds[2]
    assert cmds[3] == [
        "env",
        "XLA_PYTHON_CLIENT_MEM_FRACTION=0.9",
        "CUDA_VISIBLE_DEVICES=0,1",
        f"{ROOT}/.venv/bin/python",
        "-m",
        "grpo_jax.main",
        "--config=c.py:x",
        "--workdir=/runs/a",
        "--config.mesh.fsdp=-1",
    ]
    only_train = _commands(_run([LAUNCH / "gpu_single_node.sh", "--dry-run"]).stdout)
    assert len(only_train) == 1 and "grpo_jax.main" in only_train[0]
    proc = _run([LAUNCH / "gpu_single_node.sh", "--dry-run", "--gpus", "a"], check=False)
    assert proc.returncode == 2 and "--gpus 'a' must be a comma-separated list" in proc.stderr


# -- slurm.sbatch ------------------------------------------------------------


def test_slurm_directives():
    text = (LAUNCH / "slurm.sbatch").read_text()
    for directive in ("--nodes=", "--ntasks-per-node=", "--gpus-per-node=", "--time="):
        assert f"#SBATCH {directive}" in text


def test_slurm_outside_a_job_submits_itself(tmp_path):
    env, log = _fake_bin(tmp_path, ["sbatch", "srun"])
    out = _run([LAUNCH / "slurm.sbatch", "--dry-run", "--config.train.steps=3"], env=env).stdout
    assert _calls(log) == []
    cmds = _commands(out)
    assert cmds[0] == ["sbatch", f"--chdir={ROOT}", "--export=ALL",
                       f"{ROOT}/launch/slurm.sbatch", "--config.train.steps=3"]  # fmt: skip
    assert cmds[1][:6] == ["srun", "--kill-on-bad-exit=1", f"{ROOT}/.venv/bin/python", "-m",
                           "grpo_jax.main", "--config=configs/default.py"]  # fmt: skip
    _run([LAUNCH / "slurm.sbatch", "--config.train.steps=3"], env=env)
    assert _calls(log) == [cmds[0]]


def test_slurm_inside_a_job_runs_srun(tmp_path):
    env, log = _fake_bin(tmp_path, ["sbatch", "srun"])
    job = {
        **env,
        "SLURM_JOB_ID": "4242",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "CONFIG": "configs/gsm8k.py:model=llama3.2-1b",
    }
    out = _run([LAUNCH / "slurm.sbatch", "--dry-run", "--config.seed=1"], env=job).stdout
    assert _calls(log) == []
    srun = [f"{tmp_path}/.venv/bin/python", "-m", "grpo_jax.main",
            "--config=configs/gsm8k.py:model=llama3.2-1b", "--workdir=runs/grpo_jax_4242",
            "--config.seed=1"]  # fmt: skip
    assert _commands(out) == [["cd", str(tmp_path)], ["srun", "--kill-on-bad-exit=1", *srun]]
    _run([LAUNCH / "slurm.sbatch", "--config.seed=1"], env=job)
    assert _calls(log) == [["srun", "--kill-on-bad-exit=1", *srun]]


# -- local_multiprocess.sh ---------------------------------------------------


def test_local_multiprocess_dry_run():
    out = _run(
        [LAUNCH / "local_multiprocess.sh", "--dry-run", "--port", "23456",
         "--devices-per-process", "4", "3", "--config=configs/default.py", "--workdir=/tmp/w"],
        env={"XLA_FLAGS": ""},
    ).stdout  # fmt: skip
    lines = [shlex.split(line.rstrip(" &")) for line in out.splitlines() if line.endswith("&")]
    assert len(lines) == 3
    for i, words in enumerate(lines):
        assert words == [
            "env",
            "GRPO_JAX_COORDINATOR=127.0.0.1:23456",
            "GRPO_JAX_NUM_PROCESSES=3",
            f"GRPO_JAX_PROCESS_ID={i}",
            "JAX_PLATFORMS=cpu",
            "XLA_FLAGS=--xla_force_host_platform_device_count=4",
            "python3",
            "-m",
            "grpo_jax.main",
            "--config=configs/default.py",
            "--workdir=/tmp/w",
        ]
    assert out.splitlines()[-1].startswith("wait")


def test_local_multiprocess_runs_every_process(tmp_path):
    script = f'echo "$GRPO_JAX_PROCESS_ID $GRPO_JAX_NUM_PROCESSES $GRPO_JAX_COORDINATOR $XLA_FLAGS" > {tmp_path}/p$GRPO_JAX_PROCESS_ID'  # noqa: E501
    _run([LAUNCH / "local_multiprocess.sh", "3", "--", "bash", "-c", script],
         env={"XLA_FLAGS": ""})  # fmt: skip
    seen = [(tmp_path / f"p{i}").read_text().split() for i in range(3)]
    assert [s[:2] for s in seen] == [["0", "3"], ["1", "3"], ["2", "3"]]
    assert len({s[2] for s in seen}) == 1 and seen[0][2].startswith("127.0.0.1:")
    assert all(s[3] == "--xla_force_host_platform_device_count=2" for s in seen)


def test_local_multiprocess_fails_fast_and_stops_the_others(tmp_path):
    # Process 1 fails at once; process 0 would write its marker after 30 s.
    script = f"if [[ $GRPO_JAX_PROCESS_ID == 1 ]]; then exit 3; fi; sleep 30; touch {tmp_path}/late"
    proc = _run(
        [LAUNCH / "local_multiprocess.sh", "--log-dir", tmp_path / "logs", "2", "--",
         "bash", "-c", script],
        check=False,
        timeout=25,
    )  # fmt: skip
    assert proc.returncode == 3
    assert "exited with status 3; stopping the others" in proc.stderr
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "process_0.log",
        "process_1.log",
    ]
    assert not (tmp_path / "late").exists()


def test_local_multiprocess_bad_arguments():
    proc = _run([LAUNCH / "local_multiprocess.sh", "zero"], check=False)
    assert proc.returncode == 2 and "'zero' is not a positive integer" in proc.stderr
    proc = _run([LAUNCH / "local_multiprocess.sh"], check=False)
    assert proc.returncode == 2 and "missing N" in proc.stderr
    proc = _run([LAUNCH / "local_multiprocess.sh", "--bogus", "2"], check=False)
    assert proc.returncode == 2 and "unknown option --bogus" in proc.stderr
    proc = _run([LAUNCH / "local_multiprocess.sh", "2", "--"], check=False)
    assert proc.returncode == 2 and "nothing after '--'" in proc.stderr
