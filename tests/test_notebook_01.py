"""Executes notebooks/01_grpo_by_hand.ipynb; its cells assert the golden values."""

import pytest
from helpers_notebook import run_notebook

pytestmark = pytest.mark.slow  # executes a notebook in a fresh kernel


def test_notebook_01_runs():
    text, outputs = run_notebook("01_grpo_by_hand.ipynb")
    assert "loss with clipping: 0.411667" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)
