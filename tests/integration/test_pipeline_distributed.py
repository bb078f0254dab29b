"""The pipelined loop at k = 1 as 2 processes x 4 CPU devices == 1 process x 8.

Launched like tests/integration/test_distributed_train.py (``launch/local_multiprocess.sh``,
the smoke config with a reward that varies on random completions and a large
learning rate), on one mesh and on a split mesh (4 sampler devices: 2 of each
process). The records must say the same staleness, the batch statistics and
the final parameters must agree to float32 rounding.
"""

import json

import numpy as np
import pytest
from test_distributed_train import _final_params, _launch

pytestmark = pytest.mark.slow  # two multi-process training runs per case


@pytest.mark.parametrize(
    "extra",
    [[], ["--config.mesh.sampler_devices=4"]],
    ids=["one_mesh", "split_4_4"],
)
def test_two_processes_pipeline_like_one(tmp_path, extra):
    extra = [
        "--config.train.max_staleness=1",
        "--config.train.batch_size=8",
        "--config.eval.num_problems=8",
        "--config.eval.batch_size=8",
        # No evaluation before training, greedy only: test_distributed_train.py checks that
        # evaluation across processes; this test is about the pipelined training.
        "--config.eval.at_start=False",
        "--config.eval.num_samples=0",
        *extra,
    ]
    multi = _launch(tmp_path, "two_by_four", processes=2, devices=4, extra=extra)
    single = _launch(tmp_path, "one_by_eight", processes=1, devices=8, extra=extra)

    def records(workdir):
        return [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]

    rec_multi, rec_single = records(multi), records(single)
    assert [r["step"] for r in rec_multi] == [r["step"] for r in rec_single]
    assert [r["pipeline/staleness"] for r in rec_multi if "pipeline/staleness" in r] == [0.0, 1.0]
    for rm, rs in zip(rec_multi, rec_single, strict=True):
        for key in ("pipeline/version", "rewards/mean", "rollout/length_mean", "train/loss"):
            if key in rs:
                assert rm[key] == pytest.approx(rs[key], rel=1e-5, abs=1e-6), (rs["step"], key)
    p_multi, p_single = _final_params(multi), _final_params(single)
    assert p_multi.keys() == p_single.keys() and len(p_multi) > 5
    moved = 0.0
    for name, x in p_single.items():
        # 8 shards sum in another order on 2 hosts; Adam turns a float32 rounding of a
        # near-zero gradient into up to ~2e-6 of a 1e-2 step (lr 0.01): atol 1e-5.
        np.testing.assert_allclose(p_multi[name], x, rtol=1e-5, atol=1e-5, err_msg=name)
        if "bias" in name:  # biases start at zero: their size is how far training moved
            moved = max(moved, float(np.abs(x).max()))
    assert moved > 1e-3
