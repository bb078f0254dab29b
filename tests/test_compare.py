"""grpo_jax.compare on tiny synthetic runs: pooling by seed, paired tables, errors."""

import json
import pathlib
import sys

import numpy as np
import pytest

from grpo_jax import compare
from grpo_jax.core import problems, stats


def _config(seed, lr=2e-4):
    return {"seed": seed, "data": {"seed": seed, "n_test": 8}, "optim": {"learning_rate": lr}}


def _problems(seed, greedy, sampled):
    """8 problems (ids depend on the data seed); sampled: [P, n] correctness."""
    sampled = np.asarray(sampled, bool)
    return problems.Problems(
        ids=tuple(f"s{seed}p{i}" for i in range(len(greedy))),
        greedy_correct=np.asarray(greedy, bool),
        greedy_length=np.full(len(greedy), 3),
        greedy_truncated=np.zeros(len(greedy), bool),
        seeds=(0,),
        sampled_correct=sampled[None],
        sampled_length=np.full((1, *sampled.shape), 3),
    )


def _run(tmp_path, name, seed, lr, before, after, curve):
    wd = tmp_path / name
    header = lambda step, prob: {
        "step": step,
        "k": 2,
        "figures": problems.figures(prob, 2),
        "record": {"config": json.dumps(_config(seed, lr)), "seeds": {"seed": seed}},
    }
    problems.write(wd / "eval" / "step_0.jsonl", before, header(0, before))
    problems.write(wd / "eval" / "step_4.jsonl", after, header(4, after))
    files = {"before": "eval/step_0.jsonl", "after": "eval/step_4.jsonl"}
    (wd / "summary.json").write_text(json.dumps({"eval_files": files}))
    lines = [{"step": s, "rollout/pass_rate": v} for s, v in enumerate(curve, 1)]
    (wd / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return wd


G_BEFORE = [0, 0, 1, 0, 1, 0, 0, 1]
G_A = [1, 0, 1, 0, 1, 1, 0, 1]  # the first group after training
G_B = [1, 1, 1, 1, 1, 1, 0, 1]  # the second: 2 more solved, none lost, per seed
S = [[1, 0], [0, 0], [1, 1], [0, 1], [1, 1], [1, 0], [0, 0], [1, 1]]


@pytest.fixture
def runs(tmp_path):
    out = []
    for seed in (0, 1):
        out.append(_run(tmp_path, f"a{seed}", seed, 2e-4, _problems(seed, G_BEFORE, S),
                        _problems(seed, G_A, S), [0.1, 0.2, 0.3, 0.4]))  # fmt: skip
        out.append(_run(tmp_path, f"b{seed}", seed, 2e-3, _problems(seed, G_BEFORE, S),
                        _problems(seed, G_B, S), [0.1, 0.3, 0.5, 0.6]))  # fmt: skip
    return out


def test_groups_pool_seeds_and_pair_by_seed(runs, tmp_path):
    groups, table, paired = compare.compare([str(p) for p in runs])
    assert [g.label for g in groups] == ["baseline", "optim.learning_rate=0.002"]
    assert [g.seeds for g in groups] == [[0, 1], [0, 1]]
    first = table[0]
    assert first["metric"] == "greedy pass@1" and first["problems"] == 16
    # Pooled over two seeds: 2 x 5 of 16 after, 2 x 3 of 16 before.
    assert first["after"] == pytest.approx((10 / 16, *stats.wilson_interval(10, 16)))
    assert first["before"][0] == pytest.approx(6 / 16)
    b_after = np.tile(np.array(G_A, float), 2)
    b_before = np.tile(np.array(G_BEFORE, float), 2)
    want = stats.paired_bootstrap_interval(b_before, b_after)
    assert first["change"] == pytest.approx((4 / 16, *want))
    assert first["per_seed"] == [5 / 8, 5 / 8]
    # The second group against the first: 4 problems only it solves, none only the first.
    g = next(r for r in paired if r["metric"] == "greedy pass@1")
    assert g["mcnemar"] == {"only_a": 0, "only_b": 4, "p_value": pytest.approx(2 / 16)}
    assert g["diff"][0] == pytest.approx(4 / 16)
    assert {r["metric"] for r in paired} == {"greedy pass@1", "sampled pass@1", "pass@2"}
    s = next(r for r in paired if r["metric"] == "sampled pass@1")
    assert s["diff"] == (0.0, 0.0, 0.0)  # the same samples: no difference at all

    md = compare.markdown(table, paired)
    assert "| optim.learning_rate=0.002 vs baseline | 0,1 | 16 | greedy pass@1 |" in md
    assert "0.125 (0 / 4)" in md  # McNemar p and the discordant counts
    tex = compare.latex(table, paired)
    assert tex.count(r"\begin{tabular}") == 2 and r"optim.learning\_rate=0.002" in tex

    out = tmp_path / "out"
    assert compare.main([*map(str, runs), f"--out={out}", "--labels=full,lr"]) == 0
    assert (out / "compare.md").read_text().startswith("| run | seeds |")
    assert "| lr vs full |" in (out / "compare.md").read_text()
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    c = compare.curves(groups[1], "rollout/pass_rate")
    np.testing.assert_array_equal(c[0], [1, 2, 3, 4])
    assert c[1].shape == (2, 4)


def test_errors_name_the_problem(runs, tmp_path, capsys):
    assert compare.main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(compare.CompareError, match="no evaluation files"):
        compare.load_run(tmp_path / "empty")
    # A LoRA-like group whose seed-1 run saw other problems than the baseline's.
    other = _problems(7, G_A, S)
    bad = _run(tmp_path, "c1", 1, 1e-3, other, other, [0.1])
    with pytest.raises(compare.CompareError, match="different problems"):
        compare.compare([str(runs[0]), str(runs[2]), str(bad)])
    with pytest.raises(compare.CompareError, match=r"seeds \[1\] that 'baseline' lacks"):
        compare.compare([str(runs[0]), str(runs[3])])
    with pytest.raises(compare.CompareError, match="same config and the same seeds"):
        compare.compare([str(runs[0]), str(runs[0])])
    with pytest.raises(compare.CompareError, match="--labels names 1 groups"):
        compare.compare([str(runs[0]), str(runs[1])], labels=["x"])


def _one_line_error(capsys, argv) -> str:
    """compare's stderr for ``argv``: exit status 2 and one line, no traceback."""
    assert compare.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def _lines(path):
    return path.read_text().splitlines(keepends=True)


def test_correctness_must_be_a_bool_or_0_1(runs, capsys):
    path = runs[0] / "eval" / "step_4.jsonl"
    lines = _lines(path)
    row = json.loads(lines[2])
    for bad, shown in [("false", '"false"'), (float("nan"), "NaN"), (2, "2")]:
        row["greedy"]["correct"] = bad
        path.write_text("".join([*lines[:2], json.dumps(row) + "\n", *lines[3:]]))
        err = _one_line_error(capsys, [path])
        assert f"{path}:3: greedy 'correct' is {shown}" in err, err
    # A sample's correctness, named with its seed and position.
    row = json.loads(lines[2])
    row["sampled"][0]["correct"][1] = "true"
    path.write_text("".join([*lines[:2], json.dumps(row) + "\n", *lines[3:]]))
    err = _one_line_error(capsys, [path])
    assert f"{path}:3: seed 0's 'correct'[1] is \"true\"" in err
    # 0 and 1 are read as false and true.
    row = json.loads(lines[2])
    row["greedy"]["correct"] = int(row["greedy"]["correct"])
    row["sampled"][0]["correct"] = [int(x) for x in row["sampled"][0]["correct"]]
    path.write_text("".join([*lines[:2], json.dumps(row) + "\n", *lines[3:]]))
    _, back = problems.read(path)
    np.testing.assert_array_equal(back.greedy_correct, np.asarray(G_A, bool))


def test_damaged_evaluation_files_are_named_with_their_line(runs, tmp_path, capsys):
    path = runs[0] / "eval" / "step_4.jsonl"
    lines = _lines(path)
    # Cut in the middle of the last line (a copy that stopped short).
    path.write_text("".join(lines[:-1]) + lines[-1][:25])
    assert f"{path}:9: not JSON" in _one_line_error(capsys, [runs[0]])
    # Cut between lines: fewer problems than the header counts.
    path.write_text("".join(lines[:5]))
    assert f"{path} holds 4 problems, but its header counts 8" in _one_line_error(capsys, [path])
    # Binary.
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    assert f"{path}:1: not UTF-8 text" in _one_line_error(capsys, [path])
    # Ragged: one problem with 3 samples where the others have 2.
    row = json.loads(lines[4])
    row["sampled"][0]["correct"].append(True)
    row["sampled"][0]["length"].append(3)
    path.write_text("".join([*lines[:4], json.dumps(row) + "\n", *lines[5:]]))
    err = _one_line_error(capsys, [path])
    assert f"{path}:5: problem 3 (s0p3) has 3 samples (seed 0), the first problem (s0p0) 2" in err
    # A header whose record is not one.
    head = json.loads(lines[0])
    head["header"]["record"]["seeds"] = "zero"
    path.write_text("".join([json.dumps(head) + "\n", *lines[1:]]))
    assert f"{path}:1: the header's record" in _one_line_error(capsys, [path])


def test_out_that_cannot_be_written_is_one_line(runs, tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = _one_line_error(capsys, [*runs, f"--out={blocker / 'sub'}"])
    assert f"cannot write --out={blocker / 'sub'}" in err
    assert blocker.read_text() == ""  # nothing there was touched


def test_without_matplotlib_compare_says_how_to_install_it(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    out = tmp_path / "out"
    assert compare.main([*map(str, runs), f"--out={out}"]) == 0
    said = capsys.readouterr().out
    assert "pip install -e '.[plots]'" in said and (out / "compare.md").is_file()
    assert not (out / "curves.png").exists()


def test_the_plots_extra_is_declared():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = pathlib.Path(__file__).resolve().parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("matplotlib") for d in extras["optional-dependencies"]["plots"])
