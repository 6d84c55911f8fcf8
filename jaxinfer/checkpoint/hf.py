"""Import a Hugging Face model directory: config.json + *.safetensors (sharded or not).

Only safetensors are read; pickle-based `.bin` / `.pt` files are refused, never loaded.
bfloat16 tensors (which safetensors' numpy reader refuses) are read from the
file's header and bytes as ml_dtypes.bfloat16. GPT-OSS's MXFP4 experts (a tensor
`X` stored as `X_blocks` + `X_scales`, [out, in] with `in` in blocks of 32; the
Hub's gpt-oss checkpoints, `quantization_config.quant_method` 'mxfp4') are
dequantized on load to bfloat16 [in, out], the layout transformers'
`save_pretrained` writes unquantized, and then cast to the model dtype like
every other weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from jaxinfer.checkpoint.common import ImportedModel, assemble, dequantize_mxfp4
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
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
  quant = (hf.get("quantization_config") or {}).get("quant_method")
  if quant is not None and (quant, hf.get("model_type")) != ("mxfp4", "gpt_oss"):
    raise UnsupportedModelError(f"{path}: quantization_config.quant_method {quant!r} is not supported "
                                "(only GPT-OSS's mxfp4 experts, dequantized on load)")
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


_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16}


def _read_raw(path: Path, name: str) -> np.ndarray:
  """Tensor `name` of a safetensors file straight from its header (8-byte length + JSON) and
  bytes: for dtypes safetensors' numpy reader does not know (bfloat16)."""
  try:
    with open(path, "rb") as f:
      n = int.from_bytes(f.read(8), "little")
      info = json.loads(f.read(n))[name]
      dtype = _RAW_DTYPES.get(info["dtype"])
      if dtype is None:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {info['dtype']}, which is not supported")
      start, end = info["data_offsets"]
      f.seek(8 + n + start)
      data = f.read(end - start)
  except (OSError, ValueError, KeyError) as e:
    raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None
  if len(data) != end - start:
    raise CheckpointError(f"{path}: tensor {name!r} is truncated")
  return np.frombuffer(data, dtype).reshape(info["shape"])


def read_hf_dir(directory: str | Path) -> ImportedModel:
  directory = Path(directory)
  cfg = read_config(directory)
  files = _tensor_files(directory)
  handles: dict[Path, object] = {}
  last: dict[str, np.ndarray] = {}  # GPT-OSS's gate and up share one (dequantized) tensor

  def read(name: str) -> np.ndarray:
    path = files[name]
    if path not in handles:
      handles[path] = _open(path)
    try:
      return handles[path].get_tensor(name)
    except TypeError:  # a dtype numpy's reader does not know (bfloat16)
      return _read_raw(path, name)
    except (SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None

  def fetch(name: str, expected: tuple[int, ...]) -> np.ndarray | None:
    if name in last:
      return last[name]
    if name in files:
      array = read(name)
    elif f"{name}_blocks" in files and f"{name}_scales" in files:
      # MXFP4 [E, out, in / 32, 16] -> [E, out, in] -> our checkpoint layout [E, in, out].
      array = dequantize_mxfp4(read(f"{name}_blocks"), read(f"{name}_scales"), name).swapaxes(-1, -2)
    else:
      return None
    last.clear()
    last[name] = array
    return array

  weights = assemble(cfg, str(directory), "hf", fetch)
  return ImportedModel(cfg, weights, Tokenizer.from_hf_dir(directory), str(directory))
