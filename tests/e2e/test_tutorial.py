"""The tutorial notebook runs end to end (nbclient executes every cell in a real kernel), its reward curve is
redrawn in place while it trains, and the model it ends with loads."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[2] / "tutorials" / "tiny-reverse-text.ipynb"
CURVE = "reward curve: step "


class RecordingClient(NotebookClient):
    """Records the captions of every display and display update the kernel sends (the saved notebook keeps only
    the last state of an output that was updated in place)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.curve_messages: list[tuple[str, str]] = []

    def process_message(self, msg, cell, cell_index):
        text = (msg["content"].get("data") or {}).get("text/plain", "")
        if text.startswith(CURVE):
            self.curve_messages.append((msg["msg_type"], text))
        return super().process_message(msg, cell, cell_index)


def test_tutorial_notebook_executes(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = RecordingClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "steps: 4" in text
    # the live curve: shown at step 1, redrawn in place at each later step and once more for the evaluation
    kinds = [kind for kind, _ in client.curve_messages]
    assert kinds == ["display_data"] + ["update_display_data"] * 4, client.curve_messages
    steps = [caption.split(",")[0] for _, caption in client.curve_messages]
    assert steps == [f"{CURVE}{s}/4" for s in (1, 2, 3, 4, 4)]
    assert "eval reward" in client.curve_messages[-1][1] and "eval reward" not in client.curve_messages[-2][1]
    curves = [o for o in outputs if o.get("data", {}).get("text/plain", "").startswith(CURVE)]
    assert len(curves) == 1 and curves[0]["data"]["text/plain"] == client.curve_messages[-1][1]
    assert len(curves[0]["data"]["image/png"]) > 1000
    final = tmp_path / "outputs" / "tutorial" / "run" / "final"
    assert "'config.json'" in text and "'adapter'" in text and (final / "model.safetensors").exists()
    assert "| eval | 4 |" in (final / "README.md").read_text()  # save_final() after evaluate() put it on the card
