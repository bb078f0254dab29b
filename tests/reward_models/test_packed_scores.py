"""The learned reward's scores with packing (train.packing = "on"): several texts a row,
each attending to itself, equal the padded scores."""

import numpy as np
import pytest
from helpers_hf import make_tiny_hf_classifier

from grpo_jax.core.sharding import make_mesh
from grpo_jax.reward_models import LearnedReward
from grpo_jax.rewards.section import RewardModelSection


@pytest.fixture(scope="module")
def qwen2_rm(tmp_path_factory):
    return make_tiny_hf_classifier(tmp_path_factory.mktemp("rm") / "qwen2", "qwen2", num_labels=2)


def _scores(path, packing, token_lists, mesh=None, batch_size=4):
    section = RewardModelSection(path=str(path), buckets=(16, 32), batch_size=batch_size, label=1)
    return LearnedReward.load(section, mesh, packing=packing).score_tokens(token_lists)


def _token_lists(seed):
    """Texts of 1 to 30 tokens, and one of 40, over the largest bucket (unscored, NaN)."""
    rng = np.random.default_rng(seed)
    lengths = [1, 30, 3, 12, 7, 5, 2, 16, 9, 4, 11, 40]
    return [list(rng.integers(3, 320, n)) for n in lengths]


# Two scorers compiled: seconds on a CPU.
@pytest.mark.slow
def test_packed_scores_equal_the_padded(qwen2_rm):
    lists = _token_lists(0)
    padded = _scores(qwen2_rm, False, lists)
    packed = _scores(qwen2_rm, True, lists)
    assert np.isnan(padded[-1]) and np.isnan(packed[-1])
    assert np.ptp(padded[:-1]) > 0.1  # the rows differ: the comparison can fail
    np.testing.assert_allclose(packed[:-1], padded[:-1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_packed_scores_on_a_mesh_equal_the_padded(qwen2_rm):
    """8 fake devices (4 data x 2 fsdp), rows split over the 4 batch shards."""
    lists = _token_lists(1)[:-1]
    mesh = make_mesh({"data": 4, "fsdp": 2})
    padded = _scores(qwen2_rm, False, lists)
    packed = _scores(qwen2_rm, True, lists, mesh=mesh, batch_size=8)
    np.testing.assert_allclose(packed, padded, rtol=1e-5, atol=1e-6)
