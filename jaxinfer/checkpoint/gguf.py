"""Import a GGUF file (llama.cpp's format): metadata, tensors, and the embedded vocabulary.

Tensors are dequantized to float32 with the `gguf` package, except, when
int8 weights are asked for, Q8_0 linear weights: their blocks (one fp16
scale per 32 int8 values along the input axis) are kept as they are, as a
group-wise QuantizedWeight (scales [in / 32, out]), so no float32 copy is
made and the numbers are exactly llama.cpp's. Other quantized types are
dequantized and requantized per channel (logged once per type). llama.cpp's
converter permutes the rows of attn_q / attn_k of 'llama' models into its
interleaved RoPE layout; we undo it to get back Hugging Face's half-split
layout, which our RoPE uses. Mixture-of-experts files (Mixtral as 'llama'
with an expert count, 'qwen3moe') hold each layer's experts stacked in one
tensor per projection (`blk.N.ffn_{gate,up,down}_exps.weight`, [E, out, in]
in numpy order), read as they are.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import jax
import numpy as np

from jaxinfer.checkpoint.common import ImportedModel, assemble
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.params import is_spec, param_specs
from jaxinfer.quant import Q8_0_GROUP, QuantizedWeight, check_quantizable, parse_quantization, quantizable
from jaxinfer.tokenizer import Tokenizer

Q = gguf.GGMLQuantizationType
# What we have checked through the gguf package's dequantizer (Q4_K_M / Q5_K_M files mix these).
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
MAGIC = b"GGUF"
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
log = logging.getLogger(__name__)


def is_gguf(path: Path) -> bool:
  try:
    with open(path, "rb") as f:
      return f.read(4) == MAGIC
  except OSError:
    return False


def open_reader(path: Path) -> gguf.GGUFReader:
  if not is_gguf(path):
    raise CheckpointError(f"{path}: not a GGUF file (bad magic bytes)")
  try:
    return gguf.GGUFReader(str(path))
  except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad files
    raise CheckpointError(f"{path}: truncated or corrupted GGUF file ({type(e).__name__}: {e})") from None


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
  meta = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue
    meta[key] = field.contents()
  return meta


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute`: [n_heads, d/2, 2] rows -> [n_heads, 2, d/2]."""
  rows = w.shape[0]
  return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_q8_0(data: np.ndarray, shape: tuple[int, int]) -> QuantizedWeight:
  """Q8_0 blocks (fp16 scale, 32 x int8) of an [out, in] tensor -> values [out, in], scales [out, in/32]."""
  out, n_in = shape
  blocks = np.asarray(data).view(np.uint8).reshape(out, n_in // Q8_0_GROUP, 2 + Q8_0_GROUP)
  scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
  values = blocks[..., 2:].copy().view(np.int8).reshape(out, n_in)
  return QuantizedWeight(values, scales)


def read_gguf(path: str | Path, quantization: str | None = None) -> ImportedModel:
  """Reads a GGUF file; quantization='int8' keeps Q8_0 linear weights as int8 (see the module doc)."""
  path = Path(path)
  parse_quantization(quantization)
  reader = open_reader(path)
  meta = read_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  cfg = ModelConfig.from_gguf(meta, set(tensors))
  permuted = meta.get("general.architecture") == "llama"  # Mixtral GGUFs too
  keep_q8_0 = set()
  if quantization == "int8":
    check_quantizable(param_specs(cfg), quantization)
    keep_q8_0 = {s.gguf for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec) if quantizable(s)}
  requantized: set[str] = set()

  def fetch(name: str, expected: tuple[int, ...]) -> np.ndarray | None:
    t = tensors.get(name)
    if t is None:
      return None
    qtype = Q(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
      raise UnsupportedModelError(
          f"{path}: tensor {name!r} has quantization type {qtype.name}, which is not supported "
          f"(supported: {', '.join(q.name for q in SUPPORTED_TYPES)})")
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first ([E, out, in])
    if shape != expected:
      raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, expected {expected} for this config")
    try:
      if name in keep_q8_0 and qtype == Q.Q8_0:
        w = read_q8_0(t.data, shape)
      else:
        if name in keep_q8_0 and qtype not in FLOAT_TYPES and qtype.name not in requantized:
          requantized.add(qtype.name)
          log.warning("%s: %s tensors are not loaded quantized as they are: dequantized to float32 "
                      "and requantized to int8 per channel", path.name, qtype.name)
        w = gguf.quants.dequantize(t.data, qtype).astype(np.float32, copy=False).reshape(shape)
    except (ValueError, IndexError) as e:
      raise CheckpointError(f"{path}: tensor {name!r} is corrupted ({e})") from None
    heads = (cfg.num_heads if name.endswith("attn_q.weight") else
             cfg.num_kv_heads if name.endswith("attn_k.weight") else None)
    if permuted and heads:
      if isinstance(w, QuantizedWeight):  # Q8_0 scales are per row too: same row order
        return QuantizedWeight(unpermute_rope_rows(w.values, heads), unpermute_rope_rows(w.scales, heads))
      w = unpermute_rope_rows(w, heads)
    return w

  weights = assemble(cfg, str(path), "gguf", fetch)
  return ImportedModel(cfg, weights, Tokenizer.from_gguf(meta), str(path))
