"""The embedded default model's first use: fetched and converted once, even by two
processes started at the same moment (two CLI runs, two test workers)."""

import os
import subprocess
import sys

from jaxinfer.checkpoint import orbax_io
from jaxinfer.default_model import NAME, default_gguf_path

FIRST_USE = "from jaxinfer.default_model import default_checkpoint; print(default_checkpoint())"


def test_two_processes_at_once_convert_the_default_model_once(tmp_path):
  cache = tmp_path / "cache"
  cache.mkdir()
  gguf = default_gguf_path()  # the real download, cached as on any first use
  (cache / gguf.name).symlink_to(gguf)
  env = dict(os.environ, JAXINFER_CACHE=str(cache), JAXINFER_CHECKPOINTS=str(tmp_path / "ckpt"),
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", FIRST_USE], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
  outs = [p.communicate(timeout=600) for p in procs]
  assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
  path = tmp_path / "ckpt" / NAME
  assert [out.strip().splitlines()[-1] for out, _ in outs] == [str(path)] * 2
  assert sum(err.count("converting") for _, err in outs) == 1  # the other waited, then found it
  assert orbax_io.is_checkpoint(path)
