"""Executes notebooks/02_train_tiny.ipynb: a short CPU training and its metric plots."""

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "02_train_tiny.ipynb"


def test_notebook_02_trains_and_plots():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs)
    assert "8 steps logged" in text
    assert "plotted ['rewards/mean', 'rollout/pass_rate', 'train/kl'" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)
