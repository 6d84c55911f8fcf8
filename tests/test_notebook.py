"""notebooks/quickstart.ipynb runs top to bottom (executed, not just parsed)."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_executes(default_checkpoint, tmp_path):
  """Slow (~60-75 s on two busy cores, the suite's slowest): the notebook runs as a user runs
  it, in a fresh kernel whose `LLM()` is the real default model with its default warm-up,
  46 SmolLM2 programs compiled or read back from the compilation cache (that cell alone:
  ~106 s of CPU with a cold cache, ~36 s with a warm one, measured here). A kernel is its
  own process, so no engine of the suite's can stand in, and a smaller model would not
  answer the chat cell's Paris."""
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
