"""GSM8K recipes (configs/gsm8k.py): every model's runlocal variant trains end to end.

The runlocal variant is the real recipe with a tiny random checkpoint of the
same family (loaded through ``from_pretrained`` and ``AutoTokenizer`` from its
directory, chat template included) and synthetic GSM8K-format data prepared
through TFDS, so a break anywhere on the real path fails here.
"""

import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import jax
import pytest

from grpo_jax.core.checks import flat_keys
from grpo_jax.core.sharding import batch_shards
from grpo_jax.run import runlocal
from grpo_jax.run.builders import build_mesh
from grpo_jax.run.config import ConfigError, check_batch_layout, parse_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen3-0.6b", "llama3.2-1b", "gemma3-1b")
# What the turn of the user starts with in each family's chat template.
USER_TURN = {
    "qwen2": "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
    "qwen3": "<|im_start|>user\n",
    "llama": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
    "gemma3": "<bos><start_of_turn>user\n",
}
GEN_PROMPT = {
    "qwen2": "<|im_end|>\n<|im_start|>assistant\n",
    "qwen3": "<|im_end|>\n<|im_start|>assistant\n",
    "llama": "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "gemma3": "<end_of_turn>\n<start_of_turn>model\n",
}
USER_TURN["qwen3_moe"], GEN_PROMPT["qwen3_moe"] = USER_TURN["qwen3"], GEN_PROMPT["qwen3"]
USER_TURN["gpt_oss"], GEN_PROMPT["gpt_oss"] = (
    "<|start|>user<|message|>",
    ("<|end|><|start|>assistant<|message|>"),
)


def _load():
    spec = importlib.util.spec_from_file_location("configs_gsm8k", ROOT / "configs" / "gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


recipes = _load()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """One runlocal asset folder for the module: TFDS prepares the data once."""
    root = tmp_path_factory.mktemp("runlocal")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(runlocal.RUNLOCAL_ENV, str(root))
        yield root


# Keys runlocal may change: where the model and data are, and sizes. Everything else
# (prompt, chat template use, rewards, loss, estimator, beta, epsilon, lr) is the recipe's.
RUNLOCAL_KEYS = {
    "model.path",
    "data.data_dir",
    "data.jsonl_dir",
    "sampling.prompt_buckets",
    "sampling.max_new_tokens",
    "grpo.G",
    "train.steps",
    "train.batch_size",
    "train.minibatch_size",
    "train.samples_every",
    "train.logits_chunk",
    "optim.grad_accum",
    "eval.every",
    "eval.num_problems",
    "eval.batch_size",
    "checkpoint.every",
    "mesh.num_devices",
}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow
def test_runlocal_trains(name, assets, tmp_path):
    from grpo_jax.run.train import train

    family = recipes.MODELS[name][0]
    config = recipes.get_config(f"model={name},runlocal")
    real = recipes.get_config(f"model={name}")
    changed = {
        k
        for k, v in flat_keys(config.to_dict()).items()
        if flat_keys(real.to_dict()).get(k, object()) != v
    }
    assert changed <= RUNLOCAL_KEYS, changed - RUNLOCAL_KEYS
    assert config.model.path == f"tiny:{family}"

    summary = train(config, tmp_path)
    # The library made the checkpoint when the run started, in the assets folder.
    assert list(assets.glob(f"{family}-tiny-*/config.json"))

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"])
        assert r["train/updates"] == 2 * r["step"]  # N = 8 rows in minibatches of 4.
        assert 0.0 <= r["rollout/frac_zero_var_groups"] <= 1.0
        assert "rewards/gsm8k/mean" in r and "rewards/format/mean" in r
    assert summary["steps"] == 2 and summary["before"] is not None
    assert summary["num_problems"] == 4
    # The prompt went through the family's chat template, assistant turn opened.
    sample = (tmp_path / "samples" / "step_0000001.txt").read_text()
    assert USER_TURN[family] in sample
    assert "inside <answer> </answer> tags." + GEN_PROMPT[family] in sample


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_runlocal_trains_a_mixture_of_experts(assets, tmp_path, family):
    """The Qwen3 recipe's runlocal variant on "tiny:qwen3_moe" or "tiny:gpt_oss" (4 experts,
    top 2): the whole loop (sampling, scoring, the update, evaluation) runs a mixture of
    experts."""
    from grpo_jax.run.train import train

    config = recipes.get_config("model=qwen3-0.6b,runlocal")
    config.model.path = f"tiny:{family}"
    summary = train(config, tmp_path)
    (made,) = assets.glob(f"{family}-tiny-*/config.json")
    hf = json.loads(made.read_text())
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    assert (hf["model_type"], experts, hf["num_experts_per_tok"]) == (family, 4, 2)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0
    assert summary["steps"] == 2 and summary["before"] is not None


@pytest.mark.parametrize("name", MODELS)
def test_recipe_validates(name):
    config = recipes.get_config(f"model={name}")
    run = parse_config(config)
    family, repo, max_new = recipes.MODELS[name]
    assert repo in run.model.path and "--config.model.path" in run.model.path
    assert run.tokenizer == "" and run.prompt.chat and run.data.source == "gsm8k"
    assert run.data.options["jsonl_dir"] is None and run.data.options["data_dir"] is None
    assert (run.grpo.G, run.grpo.beta, run.grpo.epsilon_low, run.grpo.temperature) == (
        8,
        0.04,
        0.2,
        1.0,
    )
    assert run.grpo.epsilon_high == 0.2
    assert run.optim.learning_rate == 1e-6 and not run.warm_start.enabled
    assert run.sampling.max_new_tokens == max_new
    assert [s.name for s in run.rewards.specs] == ["gsm8k", "format"]
    import jax

    for n in (1, 8):  # Batch, minibatch and grad_accum fit one device and eight.
        config.mesh.num_devices = n
        run = parse_config(config)
        assert len(build_mesh(run).devices.flat) == n == len(jax.devices()[:n])
        check_batch_layout(run, batch_shards(build_mesh(run)))


def test_unset_model_path_fails_naming_the_flag(tmp_path):
    from grpo_jax.run.train import train

    with pytest.raises(ConfigError, match=r"set --config\.model\.path to your local Qwen/Qwen3"):
        train(recipes.get_config("model=qwen3-0.6b"), tmp_path)


def test_arguments():
    assert recipes.parse_arg("model=qwen3-0.6b,runlocal") == ("qwen3-0.6b", {"runlocal"})
    # The Hugging Face names work too, in any case.
    assert recipes.parse_arg("model=Llama-3.2-1B-Instruct")[0] == "llama3.2-1b"
    assert recipes.parse_arg(" model=GEMMA-3-1B-IT ")[0] == "gemma3-1b"
    known = "qwen2.5-0.5b, qwen2.5-1.5b, qwen3-0.6b, llama3.2-1b, gemma3-1b"
    with pytest.raises(ValueError, match=f"unknown model 'qwen9'; known models: {known}"):
        recipes.get_config("model=qwen9")
    with pytest.raises(ValueError, match=f"needs 'model=<name>'; known models: {known}"):
        recipes.get_config(None)
    with pytest.raises(ValueError, match="unknown argument 'fast' in 'model=qwen3-0.6b,fast'"):
        recipes.get_config("model=qwen3-0.6b,fast")
    with pytest.raises(ValueError, match="unknown argument 'lr=1'"):
        recipes.get_config("model=qwen3-0.6b,lr=1")


def test_config_files_write_nothing(tmp_path, monkeypatch):
    """A config only describes a run: building every variant writes no file."""
    from configs import default

    monkeypatch.setenv(runlocal.RUNLOCAL_ENV, str(tmp_path / "assets"))
    for name in MODELS:
        for arg in (f"model={name}", f"model={name},runlocal"):
            parse_config(recipes.get_config(arg))
    for arg in (None, "runlocal", "smoke"):
        parse_config(default.get_config(arg))
    assert not (tmp_path / "assets").exists()
    with pytest.raises(ConfigError, match="tiny:"):
        config = recipes.get_config("model=qwen2.5-0.5b,runlocal")
        config.model.path = "tiny:mamba"
        runlocal.resolve(parse_config(config))


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe", "gpt_oss", "llama", "gemma3"])
def test_tiny_tokenizer_chat_template(family):
    from grpo_jax.data import format_prompt

    tok = runlocal.tiny_tokenizer(family)
    text = format_prompt({"prompt": "1+1?"}, template="{prompt}", tokenizer=tok, chat=True)
    assert text == USER_TURN[family] + "1+1?" + GEN_PROMPT[family]
    ids = tok(text, add_special_tokens=False).input_ids
    # Every marker is one token, and decoding with skip_special_tokens drops it.
    for m in runlocal._SPECIALS[family]["specials"]:
        assert ids.count(tok.convert_tokens_to_ids(m)) == text.count(m), m
        assert m not in tok.decode(ids, skip_special_tokens=True)
    assert "1+1?" in tok.decode(ids, skip_special_tokens=True)
    assert tok.eos_token == runlocal._SPECIALS[family]["eos"]


def test_gemma_checkpoint_ends_turns_at_end_of_turn(assets):
    tok = runlocal.tiny_tokenizer("gemma3")
    path = runlocal.tiny_checkpoint("gemma3", assets)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<end_of_turn>")]
    assert runlocal.tiny_checkpoint("gemma3", assets) == path  # Content-addressed, reused.
    # The sampler stops at the tokenizer's EOS and at generation_config's end of turn.
    from grpo_jax.run.builders import build_tokenizer, tokenizer_sampling

    run = runlocal.resolve(parse_config(recipes.get_config("model=gemma3-1b,runlocal")))
    assert tokenizer_sampling(run, build_tokenizer(run, assets)).eos_ids == tuple(
        gen["eos_token_id"]
    )


@pytest.mark.parametrize("kind", ["word_problems", "one_step_problems"])
def test_word_problems_are_gsm8k_format(assets, kind):
    import re

    from grpo_jax.data import gsm8k

    d = runlocal.word_problems_dir(assets, kind=kind)
    assert d.name.startswith(runlocal._PROBLEM_SETS[kind][1] + "-")
    train, skipped = gsm8k.read_gsm8k_jsonl(d / "train.jsonl")
    test, _ = gsm8k.read_gsm8k_jsonl(d / "test.jsonl")
    assert (len(train), len(test), skipped) == (32, 16, [])
    for ex in train + test:
        assert "#### " not in ex["solution"] and ex["answer"].isdigit()
        # The reference's own final number is what the gsm8k reward accepts.
        from grpo_jax.rewards import get

        assert get("gsm8k")([""], [ex["solution"]], answer=[ex["answer"]]) == [1.0]
    # Every <<calculation>> of the raw rows (the reader strips them) is right.
    for line in (d / "train.jsonl").read_text().splitlines():
        calcs = re.findall(r"<<([^=]+)=([^>]+)>>", json.loads(line)["answer"])
        assert calcs
        for expr, value in calcs:
            assert eval(expr) == float(value), expr  # noqa: S307 - digits and + - * / only


@pytest.mark.parametrize(
    "value, sizes",
    [
        ("tiny:word_problems", (32, 16)),
        ("tiny:word_problems:100:7", (100, 7)),
        ("tiny:one_step_problems:2048:96", (2048, 96)),
    ],
)
def test_word_problem_sizes_in_the_data_path(value, sizes):
    assert runlocal._problem_set(value)[1:] == sizes


@pytest.mark.parametrize(
    "value", ["tiny:word_problem", "tiny:word_problems:10", "tiny:word_problems:0:5", "tiny:x:1:2"]
)
def test_bad_word_problem_data_paths_name_the_key(value):
    with pytest.raises(ConfigError, match="data.jsonl_dir.*tiny:word_problems:<n_train>:<n_test>"):
        runlocal._problem_set(value)


def test_sweep_points_are_valid_configs():
    points = recipes.sweep("model=qwen2.5-0.5b")
    assert len(points) == 6
    assert {(p["optim.learning_rate"], p["grpo.beta"]) for p in points} == {
        (lr, b) for lr in (5e-7, 1e-6, 3e-6) for b in (0.0, 0.04)
    }
    for p in points:
        config = recipes.get_config("model=qwen2.5-0.5b")
        for key, value in p.items():
            section, field = key.split(".")
            config[section][field] = value
        run = parse_config(config)
        assert (run.optim.learning_rate, run.grpo.beta) == (
            p["optim.learning_rate"],
            p["grpo.beta"],
        )


def test_sweep_prints_commands(capsys, tmp_path):
    from grpo_jax import sweep

    spec = f"{ROOT / 'configs' / 'gsm8k.py'}:model=qwen3-0.6b"
    rc = sweep.main(
        [f"--config={spec}", f"--workdir_root={tmp_path}", "--", "--config.model.path=/m/q3"]
    )
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6
    assert lines[3] == (
        f"{sys.executable} -m grpo_jax.main --config={spec} "
        f"--workdir={tmp_path}/learning_rate=1e-06,beta=0.04 "
        "--config.optim.learning_rate=1e-06 --config.grpo.beta=0.04 --config.model.path=/m/q3"
    )
    assert not list(tmp_path.iterdir())  # Print mode runs nothing.


def test_sweep_refuses_an_override_of_a_swept_key(capsys, tmp_path):
    """Every point would run with the override's value while named by its own."""
    from grpo_jax import sweep

    spec = f"{ROOT / 'configs' / 'gsm8k.py'}:model=qwen3-0.6b"
    for extra in (["--config.grpo.beta=0.1"], ["--config.model.path=/m", "-config.grpo.beta", "1"]):
        rc = sweep.main([f"--config={spec}", f"--workdir_root={tmp_path}", "--", *extra])
        assert rc == 2
        out = capsys.readouterr()
        assert out.out == ""
        assert out.err.splitlines() == [
            "sweep error: the arguments after -- override grpo.beta, which the sweep of "
            f"{spec} sets per point; drop them there (or change the sweep)"
        ]


def test_sweep_errors(tmp_path, capsys):
    from grpo_jax import sweep

    bad = tmp_path / "bad.py"
    bad.write_text(
        "from ml_collections import ConfigDict\n"
        "def get_config(arg=None):\n"
        "    return ConfigDict({'optim': {'learning_rate': 1.0}})\n"
        "def sweep(arg=None):\n"
        "    return [{'optim.learnig_rate': 1e-6}]\n"
    )
    with pytest.raises(
        sweep.SweepError, match=r"but optim has no key learnig_rate \(its keys: learning_rate\)$"
    ):
        sweep.commands(str(bad), str(tmp_path))
    nosweep = tmp_path / "nosweep.py"
    nosweep.write_text("def get_config(arg=None):\n    return {}\n")
    with pytest.raises(sweep.SweepError, match="defines no sweep"):
        sweep.commands(str(nosweep), str(tmp_path))
    assert sweep.main([f"--config={tmp_path}/missing.py", "--workdir_root=/x"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert sweep.main([f"--config={ROOT}/configs/gsm8k.py:model=x", "--workdir_root=/x"]) == 2
    assert "unknown model 'x'" in capsys.readouterr().err


@pytest.mark.slow
def test_main_accepts_the_arg_syntax_and_overrides(tmp_path):
    """Through absl/config_flags: the arg, and overrides of the placeholder data keys."""
    missing = tmp_path / "no_model"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_jax.main",
            "--config=configs/gsm8k.py:model=llama3.2-1b",
            f"--workdir={tmp_path / 'w'}",
            f"--config.model.path={missing}",
            f"--config.data.jsonl_dir={tmp_path}",
            "--config.grpo.beta=0.0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"no Hugging Face tokenizer files in {missing}" in proc.stderr
    saved = json.loads((tmp_path / "w" / "config.json").read_text())
    assert saved["data"]["jsonl_dir"] == str(tmp_path) and saved["grpo"]["beta"] == 0.0


def test_precision_and_remat_keys_reach_the_checkpoint_model(assets):
    """model.dtype / param_dtype / remat apply to a Hugging Face checkpoint too."""
    from flax import nnx

    from grpo_jax.run.builders import build_model, build_tokenizer

    config = recipes.get_config("model=qwen2.5-0.5b,runlocal")
    assert (config.model.dtype, config.model.param_dtype) == ("bfloat16", "float32")
    config.model.remat = True
    run = runlocal.resolve(parse_config(config))
    graphdef, params = build_model(run, build_tokenizer(run, None), build_mesh(run))
    cfg = nnx.merge(graphdef, params).config
    assert (cfg.dtype, cfg.param_dtype, cfg.remat) == ("bfloat16", "float32", True)
    assert {x.dtype.name for x in jax.tree.leaves(params)} == {"float32"}
    config.model.param_dtype = "float16x"
    with pytest.raises(ValueError, match="param_dtype"):
        build_model(
            runlocal.resolve(parse_config(config)), build_tokenizer(run, None), build_mesh(run)
        )


def test_gguf_base_model_recipes_parse_and_stop_at_the_next_question():
    for arg in ("model=gemma3-270m", "model=gemma3-270m,runlocal", "model=gemma3-270m,words"):
        run = parse_config(recipes.get_config(arg))
        assert run.sampling.stop == ("\n\nQuestion:",) and not run.prompt.chat
    run = parse_config(recipes.get_config("model=gemma3-270m,words"))
    assert run.data.options["jsonl_dir"] == "tiny:one_step_problems:2048:256"
    assert run.train.batch_size * run.grpo.G == run.train.minibatch_size == 32
    assert run.grpo.beta == 0.0 and run.sampling.prompt_buckets == (160,)
    assert runlocal._problem_set(run.data.options["jsonl_dir"]) == ("one_step_problems", 2048, 256)
    # The measured run (docs/evaluation.md): LoRA adapters, 60 steps, every held-out problem.
    lora = run.model.lora
    assert (lora.rank, lora.alpha, run.optim.learning_rate) == (16, 32.0, 3e-5)
    assert (run.train.steps, run.eval.num_problems) == (60, 256)


@pytest.mark.parametrize("arg", ["model=qwen2.5-0.5b,words", "model=gemma3-270m,words,runlocal"])
def test_words_is_only_for_gguf_base_models(arg):
    with pytest.raises(ValueError, match="'words' is a recipe for the GGUF base models"):
        recipes.get_config(arg)
