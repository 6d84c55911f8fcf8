"""Checkpoints: read HF safetensors dirs and GGUF files, write and read orbax checkpoints.

`load_model(path)` accepts any of the three and returns device-resident
params; `convert(src, dst)` turns an HF dir or GGUF file into an orbax
checkpoint that later loads without the source.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxinfer.checkpoint import orbax_io
from jaxinfer.checkpoint.common import ImportedModel
from jaxinfer.checkpoint.gguf import is_gguf, read_gguf
from jaxinfer.checkpoint.hf import read_hf_dir
from jaxinfer.config import ModelConfig
from jaxinfer.errors import InvalidRequestError, ModelNotFoundError
from jaxinfer.params import param_specs
from jaxinfer.quant import cast_floats, parse_quantization, quantize_tree
from jaxinfer.tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
  config: ModelConfig
  params: Any  # jax arrays, placed by `shardings`
  tokenizer: Tokenizer | None
  source: str


def parse_dtype(dtype: str) -> Any:
  if dtype not in DTYPES:
    raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
  return DTYPES[dtype]


def detect_format(path: str | Path) -> str:
  """'orbax', 'hf' or 'gguf'; a clear error for anything else."""
  path = Path(path).expanduser()
  if not path.exists():
    raise ModelNotFoundError(f"{path}: no such file or directory")
  if path.is_file():
    if is_gguf(path) or path.suffix == ".gguf":
      return "gguf"
    raise ModelNotFoundError(f"{path}: not a model (expected a .gguf file, a Hugging Face "
                             "model directory or a jaxinfer checkpoint directory)")
  if orbax_io.is_checkpoint(path):
    return "orbax"
  if (path / "config.json").is_file():
    return "hf"
  raise ModelNotFoundError(f"{path}: not a model directory (no config.json and no "
                           f"{orbax_io.MANIFEST})")


def import_model(path: str | Path, quantization: str | None = None) -> ImportedModel:
  """Reads an HF dir or GGUF file into host memory.

  quantization='int8': linear weights become int8 QuantizedWeights (GGUF
  Q8_0 kept group-wise as stored, everything else per channel).
  """
  parse_quantization(quantization)
  kind = detect_format(path)
  if kind == "orbax":
    raise InvalidRequestError(f"{path}: already a jaxinfer checkpoint")
  model = read_gguf(path, quantization) if kind == "gguf" else read_hf_dir(path)
  if quantization:
    model.weights = quantize_tree(param_specs(model.config), model.weights, quantization)
  return model


def load_model(path: str | Path, dtype: str = "float32", shardings_fn=None,
               quantization: str | None = None) -> LoadedModel:
  """Loads any supported format onto devices.

  `shardings_fn(config) -> pytree of Shardings` places the weights (default:
  the first device); for quantized weights it is called as
  `shardings_fn(config, 'int8')`. quantization='int8' quantizes at load (a
  checkpoint converted with --quantize int8 loads quantized regardless).
  """
  jdtype = parse_dtype(dtype)
  parse_quantization(quantization)
  path = Path(path).expanduser()
  if detect_format(path) == "orbax":
    cfg, params, tokenizer = orbax_io.restore(path, jdtype, shardings_fn, quantization)
    return LoadedModel(cfg, params, tokenizer, str(path))
  imported = import_model(path, quantization)
  cast = cast_floats(imported.weights, jdtype)
  if shardings_fn is not None:
    params = jax.device_put(cast, shardings_fn(imported.config, quantization) if quantization
                            else shardings_fn(imported.config))
  else:
    params = jax.device_put(cast)
  return LoadedModel(imported.config, params, imported.tokenizer, str(path))


def convert(src: str | Path, dst: str | Path, dtype: str = "float32", overwrite: bool = False,
            quantize: str | None = None) -> Path:
  """Imports `src` (HF dir or GGUF) and writes an orbax checkpoint at `dst`.

  quantize='int8' stores linear weights as int8 values + float32 scales (fp8 likewise;
  int4: values + float16 scales and mins per group of 32)
  (`dtype` then applies to the float weights left: norms, embeddings, LM head).
  """
  parse_dtype(dtype)
  return orbax_io.save(import_model(src, quantize), dst, dtype=dtype, overwrite=overwrite)


__all__ = ["ImportedModel", "LoadedModel", "convert", "detect_format", "import_model", "load_model"]
