"""The notebooks run top to bottom (fast settings, offline)."""

import os

import nbformat
import pytest
from conftest import REPO
from nbclient import NotebookClient

# the quickstart notebook runs in the default suite, the others are `slow`
NOTEBOOKS = [path if path.stem == "quickstart" else pytest.param(path, marks=pytest.mark.slow)
             for path in sorted((REPO / "notebooks").glob("*.ipynb"))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_VLA_FAST", "1")
    monkeypatch.setenv("HF_VLA_WORKDIR", str(tmp_path))
    monkeypatch.delenv("HF_VLA_CHECKPOINT", raising=False)
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert os.listdir(tmp_path)
