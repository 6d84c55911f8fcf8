"""notebooks/quickstart.ipynb runs top to bottom (executed, not just parsed)."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(default_checkpoint, tmp_path):
  import nbformat
  from nbclient import NotebookClient
  nb = nbformat.read(NOTEBOOK, as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "Paris" in text
  assert any("image/png" in o.get("data", {}) for o in outputs)  # the logprob plot
