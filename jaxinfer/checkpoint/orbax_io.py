"""Our own format: an orbax-checkpoint directory that also holds config and tokenizer.

Layout of a converted checkpoint:

  DST/
    jaxinfer_checkpoint.json   format version, ModelConfig, source, stored dtype
    params/                    orbax (OCDBT) pytree, one array per WeightSpec
    tokenizer/                 tokenizer.json or tokenizer.model + tokenizer_meta.json

It is written to `DST.partial` and renamed at the end, so an interrupted
conversion never leaves something that looks like a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxinfer.checkpoint.common import ImportedModel
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, JaxinferError
from jaxinfer.params import abstract_params
from jaxinfer.tokenizer import Tokenizer

MANIFEST = "jaxinfer_checkpoint.json"
FORMAT_VERSION = 1


def is_checkpoint(path: Path) -> bool:
  return (path / MANIFEST).is_file()


def save(model: ImportedModel, dst: str | Path, dtype: str = "float32", overwrite: bool = False) -> Path:
  dst = Path(dst).expanduser().resolve()
  if dst.exists() and any(dst.iterdir()):
    if not overwrite:
      raise CheckpointError(f"{dst}: already exists and is not empty (pass overwrite=True / --overwrite)")
  tmp = dst.with_name(dst.name + ".partial")
  shutil.rmtree(tmp, ignore_errors=True)
  tmp.mkdir(parents=True)
  weights = jax.tree.map(lambda a: np.asarray(a).astype(dtype), model.weights)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp / "params", weights)
  checkpointer.wait_until_finished()
  if model.tokenizer is not None:
    model.tokenizer.save(tmp / "tokenizer")
  manifest = dict(format_version=FORMAT_VERSION, config=model.config.to_dict(),
                  source=model.source, dtype=dtype)
  (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
  if dst.exists():
    shutil.rmtree(dst)
  tmp.rename(dst)
  return dst


def read_manifest(path: Path) -> dict[str, Any]:
  try:
    manifest = json.loads((path / MANIFEST).read_text())
  except (OSError, ValueError) as e:
    raise CheckpointError(f"{path / MANIFEST}: cannot read ({e})") from None
  if manifest.get("format_version") != FORMAT_VERSION:
    raise CheckpointError(f"{path / MANIFEST}: format_version {manifest.get('format_version')!r} "
                          f"is not {FORMAT_VERSION}; re-run `jaxinfer convert`")
  return manifest


def restore(path: str | Path, dtype, shardings_fn=None) -> tuple[ModelConfig, Any, Tokenizer | None]:
  """Restores weights cast to `dtype` (orbax casts while reading), placed by
  `shardings_fn(config)` (default: the first device)."""
  path = Path(path).expanduser().resolve()
  manifest = read_manifest(path)
  cfg = ModelConfig.from_dict(manifest["config"])
  if shardings_fn is not None:
    shardings = shardings_fn(cfg)
  else:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract_params(cfg))
  target = abstract_params(cfg, dtype, shardings)
  try:
    params = ocp.StandardCheckpointer().restore(path / "params", target)
  except JaxinferError:
    raise
  except Exception as e:  # orbax/tensorstore raise many types for damaged data
    raise CheckpointError(f"{path / 'params'}: cannot restore ({type(e).__name__}: {str(e)[:300]})") from None
  tokenizer = Tokenizer.load(path / "tokenizer") if (path / "tokenizer").is_dir() else None
  return cfg, params, tokenizer
