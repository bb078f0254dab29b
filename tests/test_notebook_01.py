"""Executes notebooks/01_grpo_by_hand.ipynb; its cells assert the golden values."""

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "01_grpo_by_hand.ipynb"


def test_notebook_01_runs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},
    ).execute()
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "loss with clipping: 0.411667" in outputs
    assert any("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
