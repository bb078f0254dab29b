"""Executes notebooks/02_train_tiny.ipynb: a short CPU training and its metric plots."""

import pytest
from helpers_notebook import run_notebook

pytestmark = pytest.mark.slow  # executes a notebook that trains


def test_notebook_02_trains_and_plots():
    text, outputs = run_notebook("02_train_tiny.ipynb")
    assert "8 steps logged" in text
    assert "plotted ['rewards/mean', 'rollout/pass_rate', 'train/kl'" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)
