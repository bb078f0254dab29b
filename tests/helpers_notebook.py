"""Runs a project notebook top to bottom and returns its code cells' outputs, for tests."""

import pathlib

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[1] / "notebooks"


def run_notebook(name: str) -> tuple[str, list[dict]]:
    """Executes notebooks/<name> in its own folder; -> (all printed text, all outputs)."""
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    return "".join(o.get("text", "") for o in outputs), outputs
