"""The tutorial notebook runs end to end (nbclient executes every cell in a real kernel)."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "tutorials" / "tiny-reverse-text.ipynb"


def test_tutorial_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "steps: 4" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "reward curve not displayed"
    assert (tmp_path / "outputs" / "tutorial" / "run" / "metrics.jsonl").exists()
