"""Evaluation results do not depend on the batch size or the mesh (per-problem row keys)."""

import dataclasses

import jax
import numpy as np
import pytest

from configs.default import get_config
from grpo_jax.core import problems
from grpo_jax.run import builders, evaluation
from grpo_jax.run import config as config_lib
from grpo_jax.run.config import EvalConfig


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The smoke model at its random init on 1 and on 8 devices, 12 held-out problems."""
    wd = tmp_path_factory.mktemp("wd")
    out = {}
    for n in (1, 8):
        c = get_config("smoke")
        c.mesh.num_devices = n
        run = config_lib.parse_config(c)
        tok = builders.build_tokenizer(run, wd)
        mesh = builders.build_mesh(run)
        graphdef, params = builders.build_model(run, tok, mesh)
        kw = dict(
            encoder=builders.build_encoder(run, tok),
            scorer=builders.build_scorer(run),
            sampling=builders.tokenizer_sampling(run, tok),
            mesh=mesh,
            key=jax.random.key(3),
        )
        out[n] = (graphdef, params, kw)
    examples = builders.build_datasets(run)["test"][:12]
    return out, examples


def _run(policy, devices, batch_size):
    by_mesh, examples = policy
    graphdef, params, kw = by_mesh[devices]
    cfg = EvalConfig(batch_size=batch_size, num_samples=2, k=2, seeds=(0, 1))
    return evaluation.evaluate_problems(graphdef, params, examples, cfg=cfg, **kw)


def _texts(policy, devices, batch_size, row_keys=True):
    """The sampled completions of seed 0, as evaluate_problems draws them."""
    by_mesh, examples = policy
    graphdef, params, kw = by_mesh[devices]
    sampling = dataclasses.replace(kw["sampling"], greedy=False, temperature=1.0)
    texts, _, _ = evaluation.generate_texts(
        graphdef, params, examples, encoder=kw["encoder"], sampling=sampling, num_samples=2,
        prompts_per_call=batch_size // 2, key=jax.random.fold_in(kw["key"], 1), mesh=kw["mesh"],
        row_keys=row_keys,
    )  # fmt: skip
    return texts


@pytest.mark.slow  # three batch sizes and an 8-device mesh compile ~35 s cold
def test_per_problem_results_do_not_depend_on_batch_size_or_mesh(policy):
    runs = {
        "batch 4, 1 device": _run(policy, 1, 4),
        "batch 12, 1 device": _run(policy, 1, 12),
        "batch 16, 8 devices": _run(policy, 8, 16),
    }
    ref = runs["batch 4, 1 device"]
    assert ref.sampled_correct.shape == (2, 12, 2)
    for name, got in runs.items():
        assert got.ids == ref.ids, name
        np.testing.assert_array_equal(got.greedy_correct, ref.greedy_correct, err_msg=name)
        np.testing.assert_array_equal(got.greedy_length, ref.greedy_length, err_msg=name)
        np.testing.assert_array_equal(got.sampled_correct, ref.sampled_correct, err_msg=name)
        np.testing.assert_array_equal(got.sampled_length, ref.sampled_length, err_msg=name)
        assert problems.figures(got, 2) == problems.figures(ref, 2), name
    # The random-init model's completions are varied text: a real signal to compare.
    texts = _texts(policy, 1, 4)
    assert len(set(texts)) > 12
    assert _texts(policy, 1, 12) == texts == _texts(policy, 8, 16)
    # One key per call instead: the samples move with the batch size.
    assert _texts(policy, 1, 4, row_keys=False) != _texts(policy, 1, 12, row_keys=False)


@pytest.mark.slow
def test_problems_file_round_trip(policy, tmp_path):
    prob = _run(policy, 1, 12)
    path = problems.write(tmp_path / "eval" / "step_3.jsonl", prob, {"step": 3})
    header, back = problems.read(path)
    assert header == {"step": 3}
    assert back.ids == prob.ids and back.seeds == (0, 1)
    for f in ("greedy_correct", "greedy_length", "greedy_truncated"):
        np.testing.assert_array_equal(getattr(back, f), getattr(prob, f))
    np.testing.assert_array_equal(back.sampled_correct, prob.sampled_correct)
    np.testing.assert_array_equal(back.sampled_length, prob.sampled_length)
    with pytest.raises(FileNotFoundError, match="no evaluation file"):
        problems.read(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"index": 0}\n')
    with pytest.raises(ValueError, match="not an evaluation file"):
        problems.read(tmp_path / "bad.jsonl")
