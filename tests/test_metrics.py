"""pass@k, rollout statistics and the metric writers."""

import io
import json
import math
import re
from itertools import combinations

import numpy as np
import pytest

from grpo_jax import metrics


def _pass_at_k_bruteforce(n, c, k):
    # Fraction of k-subsets of n samples (c correct) holding at least one correct.
    items = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    return sum(any(items[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    "n,c,k", [(5, 0, 1), (5, 1, 1), (5, 2, 3), (6, 3, 2), (8, 5, 4), (4, 4, 2)]
)
def test_pass_at_k_matches_enumeration(n, c, k):
    assert metrics.pass_at_k(n, c, k) == pytest.approx(_pass_at_k_bruteforce(n, c, k), abs=1e-12)


def test_pass_at_k_golden_values():
    assert metrics.pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-12)  # pass@1 = c/n
    # 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert metrics.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252, abs=1e-12)
    assert metrics.pass_at_k(10, 8, 3) == 1.0  # fewer than k wrong samples
    assert metrics.pass_at_k(200, 0, 100) == 0.0


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match="0 <= c <= n"):
        metrics.pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        metrics.pass_at_k(3, 1, 4)
    with pytest.raises(TypeError, match="integers"):
        metrics.pass_at_k(3.0, 1, 1)


def test_mean_pass_at_k():
    correct = np.array([[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    assert metrics.mean_pass_at_k(correct, 1) == pytest.approx((0.25 + 1 + 0) / 3)
    assert metrics.mean_pass_at_k(correct, 2) == pytest.approx((0.5 + 1 + 0) / 3)
    with pytest.raises(ValueError, match="problems, samples"):
        metrics.mean_pass_at_k(np.zeros(3, bool), 1)


def test_duplicate_fraction():
    assert metrics.duplicate_fraction(["a", "b", "a", "a"], 2) == pytest.approx(1 / 4)
    assert metrics.duplicate_fraction(["x"] * 4, 4) == pytest.approx(3 / 4)
    assert metrics.duplicate_fraction(["a", "b", "c", "d"], 2) == 0.0
    with pytest.raises(ValueError, match="whole groups of G=2"):
        metrics.duplicate_fraction(["a", "b", "c"], 2)
    # Only repeats within a group count, each after its first occurrence.
    flags = metrics.duplicate_flags(["a", "b", "a", "a", "b", "a"], 3)
    assert flags.tolist() == [False, False, True, False, False, True]


def test_rollout_metrics_values():
    total = np.array([1.1, 0.1, 0.1, 0.1, np.nan, 1.1, 1.1, 0.0])
    out = metrics.rollout_metrics(
        total_N=total,
        per_reward={"exact_match": np.array([1, 0, 0, 0, 0, 1, 1, 0.0])},
        errors={"exact_match": 1},
        correct_N=np.array([1, 0, 0, 0, 0, 1, 1, 0], bool),
        lengths_N=np.array([3, 4, 5, 6, 7, 8, 9, 10]),
        truncated_N=np.array([0, 0, 0, 0, 0, 0, 1, 1], bool),
        duplicate_N=metrics.duplicate_flags(["a", "b", "b", "b", "c", "d", "d", "d"], 4),
        G=4,
        invalid_N=np.array([0, 0, 0, 1, 0, 0, 0, 0], bool),
    )
    finite = total[np.isfinite(total)]
    assert out["rewards/mean"] == pytest.approx(finite.mean())
    assert out["rewards/std"] == pytest.approx(finite.std())
    assert out["rewards/exact_match/mean"] == pytest.approx(3 / 8)
    assert out["rewards/exact_match/errors"] == 1.0
    assert out["rollout/pass_rate"] == pytest.approx(3 / 8)
    assert out["rollout/length_mean"] == pytest.approx(6.5)
    assert out["rollout/length_max"] == 10
    assert out["rollout/truncated_frac"] == pytest.approx(0.25)
    assert out["rollout/invalid_format_frac"] == pytest.approx(1 / 8)
    assert out["rollout/duplicate_frac"] == pytest.approx(4 / 8)
    v0 = np.var([1.1, 0.1, 0.1, 0.1])
    v1 = np.var([1.1, 1.1, 0.0])
    assert out["rollout/group_reward_var"] == pytest.approx((v0 + v1) / 2)
    assert out["rollout/frac_zero_var_groups"] == 0.0


def test_writer_jsonl_tensorboard_samples_and_truncate(tmp_path):
    w = metrics.MetricsWriter(tmp_path)
    w.write(1, {"rewards/mean": np.float32(0.5), "eval/pass_at_1": float("nan")})
    w.write(2, {"rewards/mean": 0.75})
    w.write(3, {"rewards/mean": 1.0})
    w.write_samples(2, [{"prompt": "1+1=", "completion": "2", "reward": 1.0}])
    w.close()
    recs = metrics.read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert recs[0] == {"step": 1, "rewards/mean": 0.5, "eval/pass_at_1": None}
    assert "[completion] 2" in (tmp_path / "samples" / "step_0000002.txt").read_text()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    # A torn last line (a kill mid-write) is skipped; truncation keeps steps <= 2.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')
    assert len(metrics.read_metrics(tmp_path / "metrics.jsonl")) == 3
    metrics.truncate_metrics(tmp_path / "metrics.jsonl", 2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]


def test_a_full_disk_under_tensorboards_thread_is_raised_by_the_writer_without_a_traceback(
    tmp_path, capsys
):
    """tensorboardX writes in a thread of its own: a full disk there printed the thread's
    traceback, and again at exit; its queue would then fill and block the run."""
    import errno

    w = metrics.MetricsWriter(tmp_path)
    event_writer = w._tb._get_file_writer().event_writer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    event_writer._ev_writer.write_event = full
    w.write(1, {"rewards/mean": 0.5})
    event_writer._worker.join(timeout=60)  # the thread ends on the error
    assert not event_writer._worker.is_alive()
    with pytest.raises(OSError, match="No space left on device") as e:
        w.write(2, {"rewards/mean": 0.5})
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "tensorboard")
    w.close()
    assert event_writer._closed  # tensorboardX's own close at exit does nothing more
    assert "Traceback" not in capsys.readouterr().err
    assert [r["step"] for r in metrics.read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_disabled_writer_writes_nothing(tmp_path):
    w = metrics.MetricsWriter(tmp_path / "x", enabled=False)
    w.write(1, {"a": 1.0})
    w.write_samples(1, [{"a": 1}])
    w.close()
    assert not (tmp_path / "x").exists()


def test_progress_line_format():
    p = metrics.ProgressLine(10)
    line = p.format(3, {"rewards/mean": 0.5, "rollout/pass_rate": 0.25, "train/kl": math.nan})
    assert line.startswith("step 3/10 | reward 0.500 | pass 0.25")
    assert "kl" not in line


def test_progress_line_labels_every_figure_and_leaves_out_the_compiling_steps_speed():
    out = io.StringIO()
    p = metrics.ProgressLine(10, stream=out)
    m = {"rewards/mean": 0.5, "perf/sample_tokens_per_s": 5.0, "perf/train_tokens_per_s": 9.0}
    p.update(1, m)
    p.update(2, dict(m, **{"perf/sample_tokens_per_s": 900.0}))
    first, second = out.getvalue().splitlines()
    assert re.fullmatch(r"step 1/10 \| reward 0.500 \| elapsed \d+s", first), first
    assert re.fullmatch(
        r"step 2/10 \| reward 0.500 \| sample tok/s 900 \| train tok/s 9 \| elapsed \d+s", second
    ), second


@pytest.mark.parametrize("before", [None, {"eval/pass_at_1": 0.25, "eval/pass_at_k": 0.5}])
def test_run_summary_table_without_a_before_evaluation_has_no_nan(tmp_path, before):
    from types import SimpleNamespace

    from grpo_jax.run_summary import summarize

    out = io.StringIO()
    run = SimpleNamespace(seed=0, eval=SimpleNamespace(k=2, num_samples=4, seeds=(0,)))
    after = {"eval/pass_at_1": 0.5, "eval/pass_at_k": 0.75, "eval/num_problems": 16}
    progress = metrics.ProgressLine(1, stream=out)
    summary = summarize(run, tmp_path, before, after, None, 0.0, 0.0, 1, progress, True)
    text = out.getvalue()
    assert "nan" not in text
    rows = [line.split() for line in text.splitlines() if line.startswith(("greedy", "pass@"))]
    if before is None:
        assert summary["before"] is None
        assert rows == [
            ["greedy", "pass@1", "-", "0.500", "-"],
            ["pass@2", "(n=4)", "-", "0.750", "-"],
        ]
        assert "did not evaluate before GRPO (eval.at_start)" in text
    else:
        assert rows == [
            ["greedy", "pass@1", "0.250", "0.500", "+0.250"],
            ["pass@2", "(n=4)", "0.500", "0.750", "+0.250"],
        ]
