"""Import a Hugging Face model directory: config.json + *.safetensors (sharded or not).

Only safetensors are read; pickle-based `.bin` / `.pt` files are refused, never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.checkpoint.common import ImportedModel, assemble
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, ModelNotFoundError
from jaxinfer.tokenizer import Tokenizer

INDEX_FILE = "model.safetensors.index.json"


def read_config(directory: Path) -> ModelConfig:
  path = directory / "config.json"
  try:
    hf = json.loads(path.read_text())
  except OSError as e:
    raise ModelNotFoundError(f"{path}: cannot read ({e.strerror})") from None
  except ValueError as e:
    raise CheckpointError(f"{path}: not valid JSON ({e})") from None
  if not isinstance(hf, dict):
    raise CheckpointError(f"{path}: expected a JSON object")
  return ModelConfig.from_hf(hf)


def _tensor_files(directory: Path) -> dict[str, Path]:
  """tensor name -> the safetensors file holding it."""
  index = directory / INDEX_FILE
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as e:
      raise CheckpointError(f"{index}: malformed index ({e})") from None
    return {name: directory / file for name, file in weight_map.items()}
  files = sorted(directory.glob("*.safetensors"))
  if not files:
    pickles = [p.name for p in directory.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
    hint = (f" (found {', '.join(pickles)}: pickle-based checkpoints are never loaded; "
            "convert them to safetensors)") if pickles else ""
    raise CheckpointError(f"{directory}: no *.safetensors files{hint}")
  names: dict[str, Path] = {}
  for f in files:
    for name in _open(f).keys():
      names[name] = f
  return names


def _open(path: Path):
  try:
    return safe_open(str(path), framework="numpy")
  except FileNotFoundError:
    raise CheckpointError(f"{path}: listed in the index but missing") from None
  except (SafetensorError, OSError, ValueError) as e:
    raise CheckpointError(f"{path}: not a valid safetensors file ({e})") from None


def read_hf_dir(directory: str | Path) -> ImportedModel:
  directory = Path(directory)
  cfg = read_config(directory)
  files = _tensor_files(directory)
  handles: dict[Path, object] = {}

  def fetch(name: str, expected: tuple[int, ...]) -> np.ndarray | None:
    if name not in files:
      return None
    path = files[name]
    if path not in handles:
      handles[path] = _open(path)
    try:
      return handles[path].get_tensor(name)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None

  weights = assemble(cfg, str(directory), "hf", fetch)
  return ImportedModel(cfg, weights, Tokenizer.from_hf_dir(directory), str(directory))
