"""The embedded default model's first use: fetched and converted once, even by two
processes started at the same moment (two CLI runs, two test workers)."""

import json
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


def test_a_default_checkpoint_of_an_older_format_version_is_rewritten_from_the_gguf(tmp_path, monkeypatch):
  # The default model is int4 (Q4_1): format version 2 changed int4, so its version-1
  # checkpoint is stale. It is derived data: rewritten on first use, not an error for the user.
  import jaxinfer.checkpoint
  from jaxinfer.default_model import default_checkpoint

  monkeypatch.setenv("JAXINFER_CHECKPOINTS", str(tmp_path))
  path = tmp_path / NAME
  path.mkdir()
  manifest = {"format_version": 1, "quantization": "int4", "source": "x.gguf", "dtype": "float32"}
  (path / orbax_io.MANIFEST).write_text(json.dumps(manifest))
  calls = []
  monkeypatch.setattr(jaxinfer.checkpoint, "convert", lambda src, dst, **kw: calls.append((src, dst, kw)) or dst)
  assert default_checkpoint() == path
  assert calls == [(default_gguf_path(), path, {"dtype": "float32", "overwrite": True})]
  # One it reads as it is stays.
  (path / orbax_io.MANIFEST).write_text(json.dumps({**manifest, "format_version": orbax_io.FORMAT_VERSION}))
  assert default_checkpoint() == path and len(calls) == 1
