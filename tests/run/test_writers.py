"""The run's writers: metrics.jsonl, TensorBoard, samples, the progress line and the summary."""

import io
import json
import math
import re

import numpy as np
import pytest

from grpo_jax.run import writers as metrics


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

    from grpo_jax.run.summary import summarize

    out = io.StringIO()
    run = SimpleNamespace(seed=0, eval=SimpleNamespace(k=2, num_samples=4, seeds=(0,)))
    after = {"eval/pass_at_1": 0.5, "eval/pass_at_k": 0.75, "eval/num_problems": 16}
    progress = metrics.ProgressLine(1, stream=out)
    summary = summarize(run, tmp_path, before, after, None, 0.0, 0.0, 1, progress, True)
    text = out.getvalue()
    assert "nan" not in text
    # The table says which intervals it shows, and that they are not across seeds.
    assert "intervals over the held-out problems for this trained model (greedy pass@1: " in text
    assert "Wilson; pass@k: bootstrap over problems), not across training seeds" in text
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
