"""grpo_jax.compare on tiny synthetic runs: pooling by seed, paired tables, errors."""

import json
import pathlib
import sys

import numpy as np
import pytest

from grpo_jax import compare
from grpo_jax.core import problems, stats
from grpo_jax.run.config import section_defaults


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


@pytest.mark.slow  # about 1.7 s: the fast tier stays under 90 s cold
def test_groups_pool_seeds_and_pair_by_seed(runs, tmp_path):
    groups, table, paired = compare.compare([str(p) for p in runs])
    assert [g.label for g in groups] == ["baseline", "optim.learning_rate=0.002"]
    assert [g.seeds for g in groups] == [[0, 1], [0, 1]]
    first = table[0]
    assert first["metric"] == "greedy pass@1" and first["problems"] == 16
    assert first["steps"] == {"after": [4, 4], "before": [0, 0]}
    # Each seed has its own problems (ids by data seed): resampled within each seed.
    assert first["layout"] == "per seed" and first["interval"] == "stratified bootstrap"
    seeds, ids = np.repeat([0, 1], 8), [f"s{s}p{i}" for s in (0, 1) for i in range(8)]
    b_after = np.tile(np.array(G_A, float), 2)
    b_before = np.tile(np.array(G_BEFORE, float), 2)
    want = stats.cluster_bootstrap_interval(b_after, ids, seeds)
    assert first["after"] == pytest.approx((10 / 16, *want))
    assert first["before"][0] == pytest.approx(6 / 16)
    want = stats.cluster_bootstrap_interval(b_after - b_before, ids, seeds)
    assert first["change"] == pytest.approx((4 / 16, *want))
    assert first["per_seed"] == [5 / 8, 5 / 8]
    # The second group against the first: 4 problems only it solves, none only the first;
    # one unit per problem, so the paired test is McNemar's.
    g = next(r for r in paired if r["metric"] == "greedy pass@1")
    assert g["test"]["name"] == "McNemar" and g["test"]["p_value"] == pytest.approx(2 / 16)
    assert (g["test"]["negative"], g["test"]["positive"]) == (0, 4)
    assert g["diff"][0] == pytest.approx(4 / 16)
    assert {r["metric"] for r in paired} == {"greedy pass@1", "sampled pass@1", "pass@2"}
    s = next(r for r in paired if r["metric"] == "sampled pass@1")
    assert s["diff"] == (0.0, 0.0, 0.0)  # the same samples: no difference at all
    assert s["test"]["p_value"] == 1.0
    assert all("across_seeds" not in r for r in table + paired)  # two seeds only

    md = compare.markdown(table, paired)
    assert "| optim.learning_rate=0.002 vs baseline | 0,1 | 4 / 4 | 16 | greedy pass@1 |" in md
    assert "| baseline | 0,1 | 0 -> 4 | 16 | 16 | greedy pass@1 | stratified bootstrap |" in md
    assert "0.125 (0 / 4, McNemar)" in md  # the test's p and the discordant counts
    tex = compare.latex(table, paired)
    assert tex.count(r"\begin{tabular}") == 2 and r"optim.learning\_rate=$0.002$" in tex

    out = tmp_path / "out"
    assert compare.main([*map(str, runs), f"--out={out}", "--labels=full,lr"]) == 0
    assert "stratified bootstrap" in (out / "compare.md").read_text().split("\n")[0]
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


# ---------------------------------------------------------------------------
# Steps, units and the intervals across seeds (issue: numbers a paper can trust).


def _greedy_run(tmp_path, name, seed, correct_by_step, *, lr=2e-4, summary=True, data_seed=None,
                task=None, sections=None):  # fmt: skip
    """A workdir whose evaluations (step -> greedy 0/1 per problem) are written by hand; with
    ``summary=False`` it is a run that stopped before writing summary.json."""
    ds = seed if data_seed is None else data_seed
    wd = tmp_path / name
    config = _config(seed, lr)
    config["data"]["seed"] = ds
    if task is not None:
        config["data"]["name"] = task
    config.update(sections or {})
    for step, correct in correct_by_step.items():
        n = len(correct)
        prob = problems.Problems(
            ids=tuple(f"{task or ''}d{ds}p{i}" for i in range(n)),
            greedy_correct=np.asarray(correct, bool),
            greedy_length=np.full(n, 3),
            greedy_truncated=np.zeros(n, bool),
        )
        header = {"step": step, "k": None, "figures": problems.figures(prob, None),
                  "record": {"config": json.dumps(config), "seeds": {"seed": seed}}}  # fmt: skip
        problems.write(wd / "eval" / f"step_{step}.jsonl", prob, header)
    if summary:
        steps = sorted(correct_by_step)
        files = {"before": f"eval/step_{steps[0]}.jsonl" if len(steps) > 1 else None,
                 "after": f"eval/step_{steps[-1]}.jsonl"}  # fmt: skip
        (wd / "summary.json").write_text(json.dumps({"eval_files": files}))
    return wd


def _solved(n_solved, n=20, offset=0):
    return [1 if (i + offset) % n < n_solved else 0 for i in range(n)]


@pytest.fixture
def four_runs(tmp_path):
    """The issue's example: two groups of two seeds; the baseline's seed 1 stopped early and
    has only its evaluation before training (4 of 20 solved), the others are at step 100."""
    return [
        _greedy_run(tmp_path, "base0", 0, {0: _solved(4), 100: _solved(12)}),
        _greedy_run(tmp_path, "base1", 1, {0: _solved(4)}, summary=False),
        _greedy_run(tmp_path, "lr0", 0, {0: _solved(4), 100: _solved(12)}, lr=1e-3),
        _greedy_run(tmp_path, "lr1", 1, {0: _solved(4), 100: _solved(12)}, lr=1e-3),
    ]


def test_evaluations_of_different_steps_are_refused_in_one_line(four_runs, capsys):
    err = _one_line_error(capsys, four_runs)
    assert "evaluations of different steps" in err and "--allow_mixed_steps" in err
    assert f"{four_runs[0]} at step 100, {four_runs[1]} at step 0" in err
    # Pairing alone (each group's own runs agree) is refused as well.
    with pytest.raises(compare.CompareError, match=r"at step 0, .*lr1 at step 100"):
        compare.compare([str(four_runs[1]), str(four_runs[3])])
    # Runs of one step compare as before.
    assert compare.main([str(four_runs[0]), str(four_runs[2])]) == 0


def test_allowed_mixed_steps_are_named_in_every_table(four_runs, capsys):
    assert compare.main([*map(str, four_runs), "--allow_mixed_steps"]) == 0
    out, err = capsys.readouterr()
    # The run without summary.json says which evaluation it took.
    assert err == (
        f"note: {four_runs[1]} has no summary.json (a run that stopped early): took its last "
        "evaluation, eval/step_0.jsonl, as after\n"
    )
    rows = [x for x in out.splitlines() if x.startswith("| ") and "---" not in x]
    assert "| baseline | 0,1 | - -> 100/0 | 40 | 40 | greedy pass@1 |" in out
    assert "| optim.learning_rate=0.001 | 0,1 | 0 -> 100 |" in out
    assert "| optim.learning_rate=0.001 vs baseline | 0,1 | 100/0 / 100 | 40 |" in out
    # Every row of every table names its steps (the header rows name the column).
    assert all("step" in x or "100" in x for x in rows), rows


def test_shared_problems_are_resampled_with_all_their_seeds(tmp_path):
    """Three seeds on the same 20 problems (a fixed data seed): one problem's results agree
    across seeds, so the 60 units are 20 independent clusters, not 60 independent trials."""
    runs = [_greedy_run(tmp_path, f"a{s}", s, {0: _solved(5), 50: _solved(12)}, data_seed=7)
            for s in range(3)]  # fmt: skip
    runs += [_greedy_run(tmp_path, f"b{s}", s, {0: _solved(5), 50: _solved(15, offset=s)},
                         lr=1e-3, data_seed=7) for s in range(3)]  # fmt: skip
    groups, table, paired = compare.compare(list(map(str, runs)))
    row = table[0]
    assert (row["layout"], row["interval"]) == ("shared", "cluster bootstrap")
    assert (row["problems"], row["units"]) == (20, 60)
    y = np.tile(np.array(_solved(12), float), 3)
    ids = [f"d7p{i}" for i in range(20)] * 3
    assert row["after"] == pytest.approx((0.6, *stats.cluster_bootstrap_interval(y, ids)))
    # The interval is that of one seed's 20 problems (the seeds agree), not of 60 trials.
    one = stats.cluster_bootstrap_interval(np.array(_solved(12), float), ids[:20])
    assert row["after"][1:] == pytest.approx(one, abs=1e-12)
    wilson = stats.wilson_interval(36, 60)
    assert row["after"][2] - row["after"][1] > 1.4 * (wilson[1] - wilson[0])
    # The paired test flips each problem's summed difference over its seeds whole.
    g = next(r for r in paired if r["metric"] == "greedy pass@1")
    d = np.concatenate([np.array(_solved(15, offset=s), float) for s in range(3)]) - y
    assert g["test"] == {**stats.cluster_sign_flip_test(d, ids), "name": "sign-flip"}
    # Three seeds: the intervals across seeds, with the spread between them.
    acr = row["across_seeds"]["after"]
    assert acr == stats.across_seeds_interval(y, np.repeat([0, 1, 2], 20), ids)
    assert acr["between"] == 0.0  # every seed scores 0.6
    assert g["p_improvement"] == 1.0  # every b run (0.75) beats every a run (0.6)
    md = compare.markdown(table, paired)
    assert "Across training seeds" in md and "| optim.learning_rate=0.001 vs baseline |" in md


def test_layout_follows_the_problem_ids():
    assert compare.layout_of([("a", "b")]) == "one run"
    assert compare.layout_of([("a", "b"), ("b", "a")]) == "shared"
    assert compare.layout_of([("a", "b"), ("c", "d")]) == "per seed"
    assert compare.layout_of([("a", "b"), ("b", "c")]) == "overlapping"


def test_runs_on_several_tasks_pair_within_a_task_and_report_an_iqm(tmp_path):
    runs = []
    for task, gain in (("add", 2), ("mul", 4)):
        for s in range(3):
            runs.append(_greedy_run(tmp_path, f"{task}a{s}", s, {9: _solved(8 + s)}, task=task))
            runs.append(_greedy_run(tmp_path, f"{task}b{s}", s, {9: _solved(8 + s + gain)},
                                    lr=1e-3, task=task))  # fmt: skip
    groups, table, paired = compare.compare(list(map(str, runs)))
    assert len(groups) == 4 and {(r["base"], r["other"]) for r in paired} == {
        ("baseline", "optim.learning_rate=0.001"),
        ("data.name=mul", "data.name=mul, optim.learning_rate=0.001"),
    }
    tasks = compare.task_rows(groups, None)
    assert [r["method"] for r in tasks if r["metric"] == "greedy pass@1"] == [
        "baseline",
        "optim.learning_rate=0.001",
    ]
    base = [np.array([8, 9, 10]) / 20, np.array([8, 9, 10]) / 20]
    assert tasks[0]["iqm"] == pytest.approx(
        (stats.interquartile_mean(np.concatenate(base)), *stats.stratified_bootstrap_interval(base))
    )
    # Task add: b beats a in 8 of 9 pairs of runs and ties one (a half); mul: all 9.
    assert tasks[1]["p_improvement"] == pytest.approx((8.5 / 9 + 1.0) / 2)
    assert "interquartile mean" in compare.markdown(table, paired, tasks)


def test_a_p_value_from_random_flips_that_never_hit_is_shown_as_a_bound():
    d = np.linspace(0.1, 0.9, 40)  # every problem favours the other run; not integers
    t = {**stats.cluster_sign_flip_test(d, np.arange(40), num_flips=999), "name": "sign-flip"}
    assert not t["exact"] and t["p_value"] == 1 / 1000
    assert compare._test(t) == "<0.001 (0 / 40, sign-flip)"
    exact = {**stats.cluster_sign_flip_test(np.ones(12), np.arange(12)), "name": "McNemar"}
    assert compare._test(exact) == "0.000488 (0 / 12, McNemar)"


def test_with_mixed_steps_allowed_every_table_names_the_steps(tmp_path, capsys):
    """Three seeds on two tasks give all five tables; one run's evaluation is of step 50."""
    runs = []
    for task in ("add", "mul"):
        for s in range(3):
            late = 50 if (task, s) == ("mul", 2) else 100
            runs.append(_greedy_run(tmp_path, f"{task}a{s}", s, {late: _solved(8 + s)}, task=task))
            runs.append(_greedy_run(tmp_path, f"{task}b{s}", s, {100: _solved(9 + s)},
                                    lr=1e-3, task=task))  # fmt: skip
    assert compare.main([*map(str, runs), "--allow_mixed_steps"]) == 0
    tables = [t for t in capsys.readouterr().out.split("\n\n") if "\n| " in t]
    assert len(tables) == 5
    shown = []
    for t in tables:
        header, _, *rows = [x.split(" | ") for x in t.strip().split("\n")]
        (col,) = [i for i, name in enumerate(header) if "steps" in name]
        shown += [row[col] for row in rows]
    assert "100/100/50" in shown and "100/100/50 / 100" in shown  # mul's base, mul's pair
    assert "100/100/100/100/100/50" in shown  # the base method's runs over both tasks
    assert all(any(c.isdigit() for c in cell) for cell in shown if cell != "- -> 100/100/50")


def test_a_setting_newer_than_a_run_is_read_as_its_default(tmp_path, capsys):
    """A run recorded before the teacher section existed ran as its default does (no
    teacher): it pools with runs that record the default, not with a run that sets one."""
    defaults = section_defaults()
    default = {"teacher": {k[8:]: v for k, v in defaults.items() if k.startswith("teacher.")}}
    assert default["teacher"]["path"] == ""
    distilled = {"teacher": {**default["teacher"], "path": "/ckpt/teacher"}}
    wds = [
        _greedy_run(tmp_path, "old0", 0, {0: _solved(4), 100: _solved(12)}),
        _greedy_run(tmp_path, "new1", 1, {0: _solved(4), 100: _solved(13)}, sections=default),
        _greedy_run(tmp_path, "opd0", 0, {0: _solved(4), 100: _solved(15)}, sections=distilled),
    ]
    groups = compare.group_runs([compare.load_run(w) for w in wds])
    assert [[pathlib.Path(r.name).name for r in g.runs] for g in groups] == [
        ["old0", "new1"],
        ["opd0"],
    ]
    assert groups[1].label == "teacher.path=/ckpt/teacher"
