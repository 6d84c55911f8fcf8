"""scripts/test_mosaic.sh fails loudly where no working Python 3.12 is found (it never skips the
Mosaic tests in silence), also when a python3.12 on PATH is a shim that does not run (pyenv's,
with 3.12 not the active version). Only its search is exercised: PATH holds the few tools it
uses and nothing that could be a Python 3.12, so nothing is installed."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("dirname", "grep", "sort", "date")


def run_without_python312(tmp_path, extra: dict[str, str]) -> subprocess.CompletedProcess:
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in TOOLS:
    os.symlink(shutil.which(tool), bin_dir / tool)
  for name, body in extra.items():
    (bin_dir / name).write_text(body)
    (bin_dir / name).chmod(0o755)
  env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "MOSAIC_VENV": str(tmp_path / "venv")}
  return subprocess.run([shutil.which("bash"), str(ROOT / "scripts" / "test_mosaic.sh")], env=env,
                        capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("extra", [
    {},
    # What pyenv's shim does when 3.12 is installed but not the active version.
    {"python3.12": "#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n",
     "pyenv": "#!/bin/sh\nexit 1\n"},
], ids=["none", "broken-shim"])
def test_no_python312_fails_loudly(tmp_path, extra):
  proc = run_without_python312(tmp_path, extra)
  assert proc.returncode == 1, proc.stdout + proc.stderr
  assert "scripts/test_mosaic.sh: FAILED: no working Python 3.12 found" in proc.stderr
  assert not (tmp_path / "venv").exists()
