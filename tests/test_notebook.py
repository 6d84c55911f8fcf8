"""notebooks/quickstart.ipynb runs top to bottom (executed, not just parsed)."""

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"
# The notebook's one engine, run with its 30 layers scanned: the same weights, warm-up and
# cells, with logits equal to the unrolled ones bit for bit (tests/models/test_scan.py), and
# its warm-up compiles each of its programs in a fraction of the unrolled time
# (benchmarks/results/layers-scan-2026-11-28.json); they are also conftest.smollm's programs,
# so on a shared compilation cache whichever of the two runs second reads them back.
USER_LLM = "llm = LLM()"
SCANNED_LLM = "llm = LLM(scan_layers=True)"


@pytest.mark.slow
def test_quickstart_notebook_executes(default_checkpoint, tmp_path):
  """Slow (~73 s of CPU with a cold compilation cache, 108 s unrolled): the notebook runs as a
  user runs it, in a fresh kernel whose `LLM()` is the real default model with its default
  warm-up, 46 SmolLM2 programs compiled or read back from the compilation cache, its layers
  scanned (SCANNED_LLM). A kernel is its own process, so no engine of the suite's can stand
  in, and a smaller model would not answer the chat cell's Paris."""
  import nbformat
  from nbclient import NotebookClient
  nb = nbformat.read(NOTEBOOK, as_version=4)
  first = next(c for c in nb.cells if c.cell_type == "code")
  assert first.source.count(USER_LLM) == 1, f"the notebook's first cell no longer says {USER_LLM!r}"
  first.source = first.source.replace(USER_LLM, SCANNED_LLM)
  NotebookClient(nb, timeout=600, kernel_name="python3",
                 resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert not [o for o in outputs if o.output_type == "error"]
  text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
  assert "Paris" in text
  assert any("image/png" in o.get("data", {}) for o in outputs)  # the logprob plot
