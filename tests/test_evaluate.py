"""Evaluation: pass@1 / pass@k plumbing with canned completions, checkpoint and HF export parity."""

import functools
import io
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs.default import get_config
from grpo_jax import evaluate as ev
from grpo_jax.export import export_hf
from grpo_jax.rollout import rounds as rollout
from grpo_jax.run import builders, evaluation
from grpo_jax.run import config as config_lib
from grpo_jax.run.checkpoints import Checkpointer
from grpo_jax.run.config import EvalConfig
from grpo_jax.sampling.static import SampleOutput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    wd = tmp_path_factory.mktemp("wd")
    run = config_lib.parse_config(get_config("smoke"))
    tok = builders.build_tokenizer(run, wd)
    return run, tok, wd


def _fake_generate(tok, answers_correct):
    """A stand-in sampler: sample s of prompt "a+b=" is right iff answers_correct(a, s)."""

    def generate(graphdef, params, tokens_BxP, mask_BxP, key, cfg, *, num_samples, mesh=None):
        del graphdef, params, key, mesh
        rows = []
        for toks, m in zip(tokens_BxP, mask_BxP, strict=True):
            prompt = tok.decode(
                [int(t) for t, k in zip(toks, m, strict=True) if k], skip_special_tokens=True
            )
            a, b = (int(x) for x in prompt.rstrip("=").split("+"))
            for s in range(num_samples):
                good = str(a + b)[::-1]
                text = good if answers_correct(a, s, cfg.greedy) else good + "9"
                rows.append(tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id])
        t = cfg.max_new_tokens
        tokens = np.zeros((len(rows), t), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        lengths = np.array([len(r) for r in rows], np.int32)
        z = np.zeros((len(rows), 1))
        return SampleOutput(z, z, tokens, tokens > 0, z, lengths, lengths > t)

    return generate


def test_pass_at_1_and_pass_at_k_from_canned_samples(smoke, monkeypatch):
    run, tok, _ = smoke
    examples = [{"prompt": f"{a}+{a + 1}=", "answer": str(2 * a + 1)[::-1]} for a in range(7)]
    # Greedy: right for even a. Sampled: the first a % 3 of the 4 samples are right.
    monkeypatch.setattr(
        evaluation,
        "generate",
        _fake_generate(tok, lambda a, s, greedy: a % 2 == 0 if greedy else s < a % 3),
    )
    calls = []
    real_encode = rollout.PromptEncoder.encode

    def counting_encode(self, exs, **kw):
        calls.append(len(exs))
        return real_encode(self, exs, **kw)

    monkeypatch.setattr(rollout.PromptEncoder, "encode", counting_encode)
    evaluate = functools.partial(
        evaluation.evaluate,
        None,
        None,
        examples,
        encoder=builders.build_encoder(run, tok),
        scorer=builders.build_scorer(run),
        sampling=builders.tokenizer_sampling(run, tok),
        key=jax.random.key(0),
    )
    said = []
    out = evaluate(cfg=EvalConfig(batch_size=8, num_samples=4, k=2), message=said.append)
    assert out["eval/pass_at_1"] == pytest.approx(4 / 7)  # a = 0, 2, 4, 6
    # A progress line after each batch: 7 problems greedy in one call, then 2 at a time.
    assert [line.split(" (")[0] for line in said] == ["greedy: 7/7 problems"] + [
        f"sampled, 4 each: {done}/7 problems" for done in (2, 4, 6, 7)
    ]
    c = np.array([a % 3 for a in range(7)])
    # pass@2 with n = 4: 1 - C(4 - c, 2) / C(4, 2).
    want_k2 = np.mean([1 - (4 - ci) * (3 - ci) / 12 for ci in c])
    assert out["eval/pass_at_2"] == pytest.approx(want_k2) == out["eval/pass_at_k"]
    assert out["eval/sampled_pass_at_1"] == pytest.approx(c.mean() / 4)
    assert out["eval/num_problems"] == 7
    # Fixed-size calls, the last one padded: 8 prompts greedy, 2 prompts x 4 samples.
    assert calls == [8] + [2] * 4
    # k = 1: pass_at_1 stays the greedy figure, the sampled one has its own key.
    out1 = evaluate(cfg=EvalConfig(batch_size=8, num_samples=4, k=1))
    assert out1["eval/pass_at_1"] == pytest.approx(4 / 7)
    assert out1["eval/pass_at_k"] == out1["eval/sampled_pass_at_1"] == pytest.approx(c.mean() / 4)


@pytest.mark.slow
def test_checkpoint_and_hf_export_evaluate_alike(smoke, tmp_path):
    run, tok, _ = smoke
    wd = tmp_path / "wd"
    cfg = get_config("smoke").to_dict()
    wd.mkdir()
    (wd / "config.json").write_text(json.dumps(cfg))
    run = config_lib.parse_config(cfg)
    tok = builders.build_tokenizer(run, wd)
    mesh = builders.build_mesh(run)
    graphdef, params = builders.build_model(run, tok, mesh)
    params = jax.tree.map(lambda x: x * 3.0, params)  # Not the seed's init: a real restore.
    ck = Checkpointer(wd / "checkpoints")
    ck.save(5, params=params, opt_state={"count": np.zeros((), np.int32)}, meta={})
    ck.close()

    out = export_hf(wd, tmp_path / "hf")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["eos_token_id"] == tok.eos_token_id == 2

    g1, p1, _ = ev.load_policy(run, wd, mesh)
    g2, p2, tok2 = ev.load_policy(run, out, mesh)
    g3, p3, _ = ev.load_policy(run, wd / "checkpoints" / "5", mesh)
    assert len(tok2) == len(tok)
    flat = lambda p: dict(nnx.to_flat_state(p))
    f1, f2, f3 = flat(p1), flat(p2), flat(p3)
    assert f1.keys() == f2.keys() == f3.keys()
    for k in f1:
        np.testing.assert_array_equal(np.asarray(f1[k][...]), np.asarray(f3[k][...]))
        np.testing.assert_allclose(np.asarray(f1[k][...]), np.asarray(f2[k][...]), atol=1e-6)
    with pytest.raises(FileNotFoundError, match="neither a training workdir"):
        ev.load_policy(run, tmp_path / "missing", mesh)

    examples = builders.build_datasets(run)["test"][:8]
    kw = dict(
        encoder=builders.build_encoder(run, tok),
        scorer=builders.build_scorer(run),
        sampling=builders.tokenizer_sampling(run, tok),
        mesh=mesh,
        cfg=EvalConfig(batch_size=8, num_samples=0),
        key=jax.random.key(0),
    )
    a = evaluation.evaluate(g1, p1, examples, **kw)
    b = evaluation.evaluate(g2, p2, examples, **kw)
    assert a["eval/pass_at_1"] == b["eval/pass_at_1"]
    assert a["eval/length_mean"] == b["eval/length_mean"]

    # The command line on the exported directory gives the same numbers.
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpo_jax.evaluate",
            "--config=configs/default.py:smoke",
            f"--checkpoint={out}",
            "--config.eval.num_problems=8",
            "--config.eval.num_samples=0",
            "--config.eval.batch_size=8",
            f"--output={tmp_path / 'eval.json'}",
        ],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    cli = json.loads((tmp_path / "eval.json").read_text())
    assert cli["eval/pass_at_1"] == a["eval/pass_at_1"]
    assert cli["eval/num_problems"] == 8


@pytest.mark.slow  # a smoke run (warm start, 2 steps) and two evaluations: ~40 s
def test_a_runs_checkpoint_evaluates_as_the_run_did(tmp_path, monkeypatch):
    """python -m grpo_jax.evaluate on a run's final checkpoint gives the run's own evaluation
    of that step, problem by problem and sample by sample: the same key derivation."""
    from grpo_jax.core import problems
    from grpo_jax.run.train import train

    c = get_config("smoke")
    c.train.steps = 2
    c.eval.num_problems = 8
    c.eval.num_samples = 4
    wd = tmp_path / "wd"
    train(c, wd, stream=io.StringIO())
    ran_header, ran = problems.read(wd / "eval" / "step_2.jsonl")

    prob, figures, _, header = ev.evaluate_checkpoint(wd)
    assert header["step"] == 2 == ran_header["step"]
    np.testing.assert_array_equal(prob.greedy_correct, ran.greedy_correct)
    np.testing.assert_array_equal(prob.sampled_correct, ran.sampled_correct)
    np.testing.assert_array_equal(prob.sampled_length, ran.sampled_length)
    assert figures == ran_header["figures"]
    # The warm-started policy ends its samples at varied lengths: another key moves them,
    # so the equality above can fail (key(seed) is what the command drew from before).
    assert len(np.unique(ran.sampled_length)) > 1
    monkeypatch.setattr(ev, "eval_key", lambda seed, step: jax.random.key(seed))
    other, _, _, _ = ev.evaluate_checkpoint(wd)
    assert not np.array_equal(other.sampled_length, ran.sampled_length)
