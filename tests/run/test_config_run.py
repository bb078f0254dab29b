"""Bad run configs fail at start-up with errors that name the key and the allowed values."""

import os
import subprocess
import sys

import pytest
from helpers_config import smoke_config

from configs.default import get_config
from grpo_jax.core.sharding import batch_shards
from grpo_jax.models import family_config
from grpo_jax.run import builders
from grpo_jax.run import config as config_lib
from grpo_jax.run.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_default_and_smoke_parse():
    run = config_lib.parse_config(get_config())
    assert run.grpo.G == 8 and run.train.batch_size == 32 and run.eval.num_problems >= 500
    assert run.grpo.beta == 0.0 and run.grpo.mu == 1 and run.grpo.epsilon_low == 0.2
    assert [s.name for s in run.rewards.specs] == [
        "exact_match(tag=None)",
        "format(pattern='[0-9]+')",
    ]
    config_lib.parse_config(get_config("smoke"))
    with pytest.raises(ValueError, match="unknown argument 'big'"):
        get_config("big")


@pytest.mark.parametrize(
    "updates, message",
    [
        ({"bogus": 1}, r"unknown config key config.bogus;"),
        ({"train.stepz": 3}, r"unknown config key train.stepz;"),
        ({"optim.schedule": "exp"}, r"'optim.schedule' = 'exp' is not one of \['constant', "),
        ({"optim.learning_rate": -1.0}, r"'optim.learning_rate' = -1.0 must be > 0"),
        ({"grpo.G": 1}, r"'grpo.G' = 1 must be >= 2"),
        ({"grpo.mu": 0}, r"'grpo.mu' = 0 must be >= 1"),
        ({"train.batch_size": 0}, r"'train.batch_size' = 0 must be >= 1"),
        ({"train.track_update": 1}, r"'train.track_update' = 1 must be True or False"),
        ({"eval.k": 9}, r"'eval.k' = 9 must be <= 4"),
        ({"checkpoint.keep": 0}, r"'checkpoint.keep' = 0 must be >= 1"),
        ({"warm_start.target": "proof"}, r"'warm_start.target' = 'proof' is not one of"),
        ({"mesh.layout": "zero"}, r"'mesh.layout' = 'zero' is not one of"),
        ({"mesh.expert": 0}, r"'mesh.expert' = 0 must be >= 1"),
        ({"grpo.router_replay": "yes"}, r"^config key 'grpo.router_replay' = 'yes' is not one of"),
        ({"rewards": "exact_matc:1.0"}, r"unknown reward 'exact_matc'; available rewards"),
        ({"rewards": "exact_match:heavy"}, r"weight 'heavy' of reward 'exact_match'"),
        ({"rewards": "exact_match,exact_match"}, r"names a reward twice"),
        ({"rewards": ""}, r"names no reward function"),
        ({"correct_reward": "nope"}, r"unknown reward 'nope'"),
        ({"sampling.temperature": 0.7}, r"'sampling.temperature' is not allowed.*grpo.temperature"),
        ({"sampling.top_p": 0.0}, r"'sampling.top_p' = 0.0 must be > 0"),
        ({"model.hidden_sise": 8}, r"unknown config key model.hidden_sise;"),
        ({"prompt.template": "no fields"}, r"'prompt.template' = 'no fields' must be a format"),
        ({"seed": -1}, r"'seed' = -1 must be a non-negative integer"),
    ],
)
def test_bad_values_name_the_key(updates, message, builtin_tokenizer):
    with pytest.raises(ConfigError, match=message):
        c = smoke_config(plain=True, **updates)
        run = config_lib.parse_config(c)
        builders.model_config(run, builtin_tokenizer)


def test_rewards_spellings():
    specs = config_lib.parse_rewards(
        "exact_match:1.0, format(think_tag=None, answer_tag='a'):0.25,gsm8k"
    )
    assert [(s.name, s.weight) for s in specs] == [
        ("exact_match", 1.0),
        ("format(think_tag=None, answer_tag='a')", 0.25),
        ("gsm8k", 1.0),
    ]
    specs = config_lib.parse_rewards({"exact_match": 2.0, "format": 0.5})
    assert [(s.name, s.weight) for s in specs] == [("exact_match", 2.0), ("format", 0.5)]
    with pytest.raises(ConfigError, match="must be a string 'name:weight"):
        config_lib.parse_rewards(3)


def test_batch_layout_checked_against_the_mesh():
    import jax

    run = config_lib.parse_config(
        smoke_config(plain=True, **{"mesh.num_devices": 2, "train.batch_size": 3})
    )
    mesh = builders.build_mesh(run)
    with pytest.raises(ConfigError, match=r"'train.batch_size' = 3 must be a multiple of the 2"):
        config_lib.check_batch_layout(run, batch_shards(mesh))
    run = config_lib.parse_config(smoke_config(plain=True, **{"train.minibatch_size": 6}))
    with pytest.raises(ConfigError, match=r"'train.minibatch_size' = 6 must divide N"):
        config_lib.check_batch_layout(run, batch_shards(builders.build_mesh(run)))
    run = config_lib.parse_config(smoke_config(plain=True, **{"optim.grad_accum": 3}))
    with pytest.raises(ConfigError, match=r"'optim.grad_accum' = 3 must divide the 16 rows"):
        config_lib.check_batch_layout(run, batch_shards(builders.build_mesh(run)))
    run = config_lib.parse_config(
        smoke_config(plain=True, **{"mesh.num_devices": len(jax.devices()) + 1})
    )
    with pytest.raises(ConfigError, match="'mesh.num_devices' = 9, but only 8 devices"):
        builders.build_mesh(run)


def test_the_expert_axis_is_in_the_mesh_and_checked_against_the_model(builtin_tokenizer):
    run = config_lib.parse_config(
        smoke_config(plain=True, **{"mesh.expert": 4, "mesh.fsdp": 2, "mesh.num_devices": 8})
    )
    mesh = builders.build_mesh(run)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 1, "expert": 4}
    moe = lambda e: family_config(
        "qwen3_moe", vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=8, mlp_dim=16, num_experts=e, experts_per_token=2,
    )  # fmt: skip
    builders.check_expert_axis(run, moe(8))
    with pytest.raises(ConfigError, match=r"^config key 'mesh.expert' = 4 must divide the mod"):
        builders.check_expert_axis(run, moe(6))
    dense = builders.model_config(run, builtin_tokenizer)
    with pytest.raises(ConfigError, match=r"'mesh.expert' = 4 needs a mixture-of-experts model;"):
        builders.check_expert_axis(run, dense)
    builders.check_expert_axis(config_lib.parse_config(smoke_config(plain=True)), dense)


def _main(*args, tmp_path, config="configs/default.py:smoke"):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_jax.main",
            f"--config={config}",
            f"--workdir={tmp_path / 'wd'}",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_main_rejects_a_misspelled_override(tmp_path):
    out = _main("--config.train.stepz=3", tmp_path=tmp_path)
    assert out.returncode != 0
    assert "stepz" in out.stderr
    out = _main("--config.optim.schedule=exp", tmp_path=tmp_path)
    assert out.returncode == 2
    assert "config error: config key 'optim.schedule' = 'exp' is not one of" in out.stderr
    assert not (tmp_path / "wd" / "checkpoints").exists()


@pytest.mark.slow
def test_main_refuses_an_expert_axis_for_a_dense_model_in_one_line(tmp_path):
    out = _main("--config.mesh.expert=2", "--config.mesh.num_devices=2", tmp_path=tmp_path)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "config error: config key 'mesh.expert' = 2 needs a mixture-of-experts model; the "
        "built-in tiny model is dense (num_experts = 0): set mesh.expert = 1"
    ]


@pytest.mark.slow
def test_main_names_an_unknown_key_in_one_line(tmp_path):
    out = _main("--config.grpo.GG=3", tmp_path=tmp_path)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "config error: --config.grpo.GG names no config key: grpo has no key GG "
        "(its keys: G, advantage_eps, " + out.stderr.split("advantage_eps, ", 1)[1].rstrip("\n")
    ]
    assert "['" not in out.stderr and "\"'" not in out.stderr  # no Python repr
    assert not (tmp_path / "wd").exists()


@pytest.mark.slow  # four more launches of the command (~2 s each)
def test_main_names_an_unknown_section_and_refuses_a_key_given_twice(tmp_path):
    out = _main("--config.grpox.beta=1", tmp_path=tmp_path)
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert "the config has no key grpox (its keys: checkpoint," in out.stderr
    out = _main("--config.grpo.beta.x=1", tmp_path=tmp_path)
    assert "grpo.beta is a value (0.0), not a section" in out.stderr
    for twice in (
        ("--config.grpo.beta=0.1", "--config.grpo.beta=0.0"),
        ("--config.eval.at_start", "--noconfig.eval.at_start"),
    ):
        out = _main(*twice, "--config.train.steps=0", tmp_path=tmp_path)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().endswith("more than once on the command line; give each key once")
    assert not (tmp_path / "wd").exists()


def test_override_keys_reads_every_spelling_absl_accepts():
    from grpo_jax.cli import override_keys

    argv = ["--config=c.py", "--config.a.b=1", "-config.c", "--noconfig.d", "--workdir=x"]
    assert override_keys(argv + ["--", "--config.e=1"]) == ["a.b", "c", "d"]


def test_model_precision_keys_the_docs_name_are_settable_on_the_default_config():
    """README and docs/lora.md name model.param_dtype (and dtype, remat) for the tiny model."""
    from grpo_jax.models.builtin_tokenizer import build_tokenizer

    c = get_config()
    c.lock()
    run = config_lib.parse_config(c)
    assert run.model.loader_kwargs() == {"attention": "einsum", "scan_layers": False}
    c.model.param_dtype = "bfloat16"
    c.model.dtype = "float32"
    c.model.remat = True
    run = config_lib.parse_config(c)
    cfg = builders.model_config(run, build_tokenizer())
    assert (cfg.param_dtype, cfg.dtype, cfg.remat) == ("bfloat16", "float32", True)


def test_default_task_is_reversed_3_digit_addition_with_a_disjoint_test_split():
    run = config_lib.parse_config(get_config())
    splits = builders.build_datasets(run)
    assert len(splits["test"]) >= 500
    assert not {ex["prompt"] for ex in splits["test"]} & {ex["prompt"] for ex in splits["train"]}
    for ex in splits["test"][:50]:
        a, b = ex["prompt"].rstrip("=").split("+")
        assert len(a) == len(b) == 3
        # Every number least significant digit first: "321+954=" is 123 + 459 = 582, "285".
        assert ex["answer"] == str(int(a[::-1]) + int(b[::-1]))[::-1]


def test_logits_chunk_must_divide_the_completion_length():
    t = get_config("smoke").sampling.max_new_tokens
    assert (
        config_lib.parse_config(
            smoke_config(plain=True, **{"train.logits_chunk": t})
        ).train.logits_chunk
        == t
    )
    with pytest.raises(ConfigError, match=rf"'train.logits_chunk' = {t + 1} must divide"):
        config_lib.parse_config(smoke_config(plain=True, **{"train.logits_chunk": t + 1}))
    with pytest.raises(ConfigError, match="train.logits_chunk"):
        config_lib.parse_config(smoke_config(plain=True, **{"train.logits_chunk": -2}))


def test_reward_modules_register_user_rewards_before_names_are_checked(tmp_path):
    module = tmp_path / "my_rewards.py"
    module.write_text(
        "from grpo_jax import rewards\n\n\n"
        "@rewards.register('test_user_short', override=True)\n"
        "def short(prompts, completions, **_):\n"
        "    return [1.0 if len(c) < 3 else 0.0 for c in completions]\n"
    )
    run = config_lib.parse_config(
        smoke_config(
            plain=True, reward_modules=str(module), rewards="test_user_short:1.0,exact_match:0.5"
        )
    )
    assert run.rewards.modules == (str(module),)
    assert [s.name for s in run.rewards.specs] == ["test_user_short", "exact_match"]
    with pytest.raises(ConfigError, match="does not exist"):
        config_lib.parse_config(
            smoke_config(plain=True, reward_modules=str(tmp_path / "missing.py"))
        )
    with pytest.raises(ConfigError, match="not found on sys.path"):
        config_lib.parse_config(smoke_config(plain=True, reward_modules="no_such_pkg_xyz.rewards"))
    with pytest.raises(ConfigError, match="reward_modules"):
        config_lib.parse_config(smoke_config(plain=True, reward_modules=3))


def test_each_clip_side_is_settable_on_a_shipped_config():
    """--config.grpo.epsilon_high=0.28 (DAPO's clip-higher) on a locked shipped config."""
    from configs import gsm8k

    for c in (get_config(), gsm8k.get_config("model=qwen3-0.6b")):
        c.lock()
        c.grpo.epsilon_high = 0.28
        run = config_lib.parse_config(c)
        assert (run.grpo.epsilon_low, run.grpo.epsilon_high) == (0.2, 0.28)
        c.grpo.epsilon_low = 0.1
        assert config_lib.parse_config(c).grpo.epsilon_low == 0.1


def test_evaluate_accepts_the_config_of_a_run_saved_before_the_precision_keys(tmp_path):
    """A run's config.json from before model.dtype/param_dtype/remat existed still matches."""
    import json

    from grpo_jax.evaluate import run_config_for

    saved = get_config("smoke").to_dict()
    for key in ("dtype", "param_dtype", "remat"):
        saved["model"].pop(key)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert run_config_for(tmp_path, get_config("smoke")).model.param_dtype is None
    c = get_config("smoke")
    c.model.param_dtype = "bfloat16"
    with pytest.raises(ConfigError, match="does not match the run"):
        run_config_for(tmp_path, c)


@pytest.mark.parametrize(
    "module, args, message",
    [
        (
            "grpo_jax.export",
            ["--out=/tmp/x", "--format=gguf"],
            "value should be one of <merged|peft>",
        ),
        (
            "grpo_jax.export",
            ["--format=peft"],
            "Flag --workdir must have a value other than None; flag --out",
        ),
        ("grpo_jax.evaluate", ["--checkpoint=/x", "--num_problemz=3"], "Unknown command line flag"),
    ],
)
@pytest.mark.slow
def test_export_and_evaluate_flag_errors_are_one_line_with_exit_status_2(module, args, message):
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "FATAL" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


@pytest.mark.parametrize(
    "name, text, arg, message",
    [
        (None, None, "", "config file {dir}/nope.py does not exist"),
        ("", None, "", "{dir} is a directory, not a config file"),
        ("bad.py", "def get_config(arg=None):\n    return {\n", "", "bad.py:2: "),
        ("none.py", "X = 1\n", "", "none.py defines no get_config(arg) function"),
        (
            "typo.py",
            "def get_config(arg=None):\n    return undefined_name\n",
            "",
            "NameError: name 'undefined_name' is not defined ({dir}/typo.py, line 2); --verbose",
        ),
    ],
)
def test_a_config_file_that_cannot_load_is_one_line(tmp_path, name, text, arg, message):
    from grpo_jax.cli import load_config_file

    path = tmp_path / "nope.py" if name is None else tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config_file(f"{path}{arg}")
    assert len(str(info.value).splitlines()) == 1, str(info.value)
    assert message.format(dir=tmp_path) in str(info.value)


def test_a_config_variant_the_file_does_not_have_is_its_own_message():
    from grpo_jax.cli import load_config_file

    with pytest.raises(ConfigError) as info:
        load_config_file("configs/default.py:smokey")
    assert str(info.value) == (
        "--config=configs/default.py:smokey: configs/default.py: unknown argument 'smokey' in "
        "'smokey'; known: ['moe', 'reward_model', 'runlocal', 'smoke']"
    )
    assert (
        load_config_file("configs/default.py:smoke").train.steps == get_config("smoke").train.steps
    )


def test_keep_last_drops_the_earlier_overrides_of_a_key_with_their_values():
    from grpo_jax.cli import keep_last

    argv = ["main", "--config=c.py", "--config.a=(9,)", "--config.b=1", "--config.a", "(16,32)"]
    assert keep_last(argv, {"a"}) == [
        "main",
        "--config=c.py",
        "--config.b=1",
        "--config.a",
        "(16,32)",
    ]
    argv = ["main", "--config.a", "(9,)", "--config.a=(16,32)", "--", "--config.a=1"]
    assert keep_last(argv, {"a"}) == ["main", "--config.a=(16,32)", "--", "--config.a=1"]
    assert keep_last(argv, set()) == argv


# What a command does with --config: absl's parsing through grpo_jax.cli.parse_flags.
_PARSE = """
import sys
from absl import flags
from ml_collections import config_flags
from grpo_jax import cli
config_flags.DEFINE_config_file("config", None, "", lock_config=True)
cli.parse_flags(sys.argv)
print(tuple(flags.FLAGS.config.sampling.prompt_buckets))
"""


def _parse(*args):
    return subprocess.run(
        [sys.executable, "-c", _PARSE, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow  # four launches (~2 s each)
def test_config_file_errors_on_the_command_line_are_one_line_with_exit_status_2(tmp_path):
    for spec, message in [
        ("configs/nope.py", "config file configs/nope.py does not exist"),
        ("configs", "configs is a directory, not a config file"),
        ("configs/default.py:smokey", "unknown argument 'smokey' in 'smokey'; known: ["),
    ]:
        proc = _parse(f"--config={spec}")
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"config error: --config={spec}: "), lines
        assert message in lines[0] and len(lines[0]) < 200, lines
    proc = _parse("--config", "configs/nope.py", "--config.seed=1")  # the space-separated spelling
    assert proc.stderr.strip() == (
        "config error: --config=configs/nope.py: config file configs/nope.py does not exist"
    )


@pytest.mark.slow  # two launches (~2 s each)
def test_a_tuple_key_given_twice_takes_the_later_value():
    key = "--config.sampling.prompt_buckets"
    proc = _parse("--config=configs/default.py:smoke", f"{key}=(9,)", f"{key}=(16,32)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "(16, 32)"
    proc = _parse("--config=configs/default.py:smoke", key, "(9,)", f"{key}=(16,)")
    assert proc.stdout.strip() == "(16,)", proc.stderr


def test_sweep_names_a_directory_given_as_its_config(tmp_path, capsys):
    from grpo_jax import sweep

    assert sweep.main(["--config=configs", f"--workdir_root={tmp_path}"]) == 2
    assert capsys.readouterr().err == (
        "sweep error: config file 'configs' is a directory, not a config file (configs/*.py)\n"
    )
    (tmp_path / "bad.py").write_text("def sweep(arg=None):\n    return [\n")
    assert sweep.main([f"--config={tmp_path / 'bad.py'}", f"--workdir_root={tmp_path}"]) == 2
    assert capsys.readouterr().err.startswith(f"sweep error: config file {tmp_path / 'bad.py'}:2: ")


def test_paged_page_and_pool_sizes_are_checked_against_the_sequences_at_start_up():
    c = get_config()  # prompts of at most 32 tokens, completions of 6
    c.sampling.engine = "paged"
    config_lib.parse_config(c)
    c.sampling.page_size = 39
    with pytest.raises(
        ConfigError,
        match=r"'sampling.page_size' = 39 is larger than the longest sequence it pages \(38 "
        r"tokens: the largest prompt bucket 32 \+ sampling.max_new_tokens = 6\)",
    ):
        config_lib.parse_config(c)
    c.sampling.page_size = 38
    config_lib.parse_config(c)
    c.sampling.page_size, c.sampling.pages = 2, 3  # a row: >= 1 prompt page + 3 of its own
    with pytest.raises(
        ConfigError, match=r"'sampling.pages' = 3 is too small for any row.*least 4"
    ):
        config_lib.parse_config(c)
    c.sampling.pages = 4
    config_lib.parse_config(c)
    from configs.multiturn import get_config as multiturn_config

    m = multiturn_config()  # a row pages its transcript: env.max_tokens = 16
    m.sampling.engine, m.sampling.page_size, m.sampling.pages = "paged", 4, 4
    with pytest.raises(ConfigError, match=r"at once; give at least 5, or 0 for the worst case"):
        config_lib.parse_config(m)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"train.packing": "on"}, r"does not combine with train.packing = 'on' yet"),
        ({"grpo.advantage_estimator": "gae"}, r"with grpo.advantage_estimator = 'gae' yet"),
        ({"teacher.path": "reference", "teacher.kl": "full"}, r"with teacher.kl = 'full' yet"),
    ],
)
def test_router_replay_refuses_what_does_not_carry_routes_in_one_line(overrides, message):
    """Single-turn and with an environment alike (episodes record routes; these passes do
    not take them)."""
    for env in ({}, {"env.name": "guess_number"}):
        config = smoke_config(plain=True, **{"grpo.router_replay": "rollout", **env, **overrides})
        with pytest.raises(ConfigError, match=message) as e:
            config_lib.parse_config(config)
        assert "\n" not in str(e.value)


def test_router_replay_runs_on_both_engines_with_partial_rollouts_and_episodes():
    """Both built-in engines record routes, partial rollouts carry them, multi-turn episodes
    record them on either engine (docs/moe.md): each parses with replay."""
    partial = {"sampling.partial_rollouts": True, "train.max_staleness": 1}
    env = {"env.name": "guess_number"}
    cases = [("static", {}), ("paged", {}), ("paged", partial), ("static", env), ("paged", env)]
    for engine, more in cases:
        overrides = {"grpo.router_replay": "rollout", "sampling.engine": engine, **more}
        run = config_lib.parse_config(smoke_config(plain=True, **overrides))
        assert (run.sampling.engine, run.grpo.router_replay) == (engine, "rollout")
        assert run.sampling.partial_rollouts == (more is partial)
        assert run.env.name == more.get("env.name", "")


def test_router_replay_needs_a_mixture_of_experts(builtin_tokenizer):
    run = config_lib.parse_config(smoke_config(plain=True, **{"grpo.router_replay": "rollout"}))
    dense = builders.model_config(run, builtin_tokenizer)
    with pytest.raises(ConfigError, match=r"^config key 'grpo.router_replay' = 'rollout' needs a "):
        builders.check_router_replay(run, dense)
    moe = family_config(
        "qwen3_moe", vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=8, mlp_dim=16, num_experts=4, experts_per_token=2, mlp_only_layers=(0,),
    )  # fmt: skip
    builders.check_router_replay(run, moe)
    assert builders.route_spec(run, moe)[:2] == (1, 2)  # one sparse layer, top 2
    off = config_lib.parse_config(smoke_config(plain=True))
    builders.check_router_replay(off, dense)
    assert builders.route_spec(off, moe) is None


@pytest.mark.slow
def test_main_refuses_router_replay_for_a_dense_model_in_one_line(tmp_path):
    out = _main("--config.grpo.router_replay=rollout", tmp_path=tmp_path)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "config error: config key 'grpo.router_replay' = 'rollout' needs a mixture-of-experts "
        "model; the built-in tiny model is dense (num_experts = 0): set grpo.router_replay = "
        "'none'"
    ]


@pytest.mark.slow
def test_main_refuses_what_multi_turn_replay_cannot_run_in_one_line(tmp_path):
    """With an environment: a dense model, and a mixture with packed rows (whose passes do not
    take the routes); one line each, exit status 2, nothing trained."""
    mt = "configs/multiturn.py:runlocal"
    dense = _main("--config.grpo.router_replay=rollout", tmp_path=tmp_path / "a", config=mt)
    packed = _main(
        "--config.grpo.router_replay=rollout", "--config.train.packing=on",
        tmp_path=tmp_path / "b", config=mt + ",moe",
    )  # fmt: skip
    assert (dense.returncode, packed.returncode) == (2, 2)
    assert dense.stderr.splitlines() == [
        "config error: config key 'grpo.router_replay' = 'rollout' needs a mixture-of-experts "
        "model; the built-in tiny model is dense (num_experts = 0): set grpo.router_replay = "
        "'none'"
    ]
    assert packed.stderr.splitlines() == [
        "config error: config key 'grpo.router_replay' = 'rollout' does not combine with "
        "train.packing = 'on' yet: its rollouts or its update's passes do not carry the "
        "recorded routes; set grpo.router_replay = 'none'"
    ]
    assert not (tmp_path / "a" / "wd" / "metrics.jsonl").exists()


def test_with_an_environment_the_chunk_and_packed_row_are_checked_against_the_transcript():
    """logits_chunk must divide, and pack_row_tokens hold, env.max_tokens (the rows the update
    scores), not sampling.max_new_tokens: the update would raise mid-run."""
    env = {"env.name": "guess_number", "env.max_tokens": 20, "sampling.max_new_tokens": 16}
    bad = smoke_config(plain=True, **env, **{"train.logits_chunk": 8})
    with pytest.raises(
        ConfigError, match=r"'train.logits_chunk' = 8 must divide env.max_tokens = 20"
    ):
        config_lib.parse_config(bad)
    fine = config_lib.parse_config(smoke_config(plain=True, **env, **{"train.logits_chunk": 4}))
    assert fine.completion_slots == (20, "env.max_tokens")
    p = max(fine.sampling.prompt_buckets)
    short = smoke_config(
        plain=True, **env, **{"train.packing": "on", "train.pack_row_tokens": p + 16}
    )
    with pytest.raises(
        ConfigError, match=rf"at least max\(sampling.prompt_buckets\) \+ env.max_tokens = {p + 20}"
    ):
        config_lib.parse_config(short)
