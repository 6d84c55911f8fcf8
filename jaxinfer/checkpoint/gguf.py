"""Import a GGUF file (llama.cpp's format): metadata, tensors, and the embedded vocabulary.

Tensors are dequantized to float32 with the `gguf` package, except linear
weights whose blocks match the quantization asked for, kept as they are as
group-wise QuantizedWeights (no float32 copy, llama.cpp's numbers):
  int8: Q8_0 (one fp16 scale per 32 int8 values along the input axis; not int8-channel,
        which holds every linear weight per channel)
  int4: Q4_0 (fp16 d, 32 nibbles q: w = d (q - 8)) and Q4_1 (fp16 d and m:
        w = d q + m), as int4 values q - 8 with float16 scales d and mins -8 d
        (exact in float16) / m: the blocks' own numbers, bit for bit
Any other quantized type asked for as a quantization is dequantized and
requantized (in int8's asymmetric groups of 32, per channel for int8-channel
and fp8, per group of 32 for int4; logged once per type); float tensors are quantized without a log line. llama.cpp's
converter permutes the rows of attn_q / attn_k of 'llama' models into its
interleaved RoPE layout; we undo it to get back Hugging Face's half-split
layout, which our RoPE uses. Mixture-of-experts files (Mixtral as 'llama'
with an expert count, 'qwen3moe') hold each layer's experts stacked in one
tensor per projection (`blk.N.ffn_{gate,up,down}_exps.weight`, [E, out, in]
in numpy order), read as they are; with a quantization, quantized expert
tensors are dequantized and requantized per (expert, channel), the layout the
grouped expert matmul takes (logged once per type). The LM head (or the embedding tied to it),
which int8 and int4 hold in int8, is read as floats and quantized to int8 by
import_model (per group of 32 along the hidden axis: a Q8_0 table comes back
exactly; per column under int8-channel).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import jax
import ml_dtypes
import numpy as np

from jaxinfer.checkpoint.common import ImportedModel, assemble
from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError, UnsupportedModelError
from jaxinfer.params import is_spec, param_specs
from jaxinfer.quant import (INT4_GROUP, Q8_0_GROUP, QuantizedWeight, check_quantizable, parse_quantization, quantizable,
                            quantize)
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


def read_q4(data: np.ndarray, shape: tuple[int, int], qtype: Q) -> QuantizedWeight:
  """Q4_0 / Q4_1 blocks of an [out, in] tensor -> int4 values [out, in], scales and mins [out, in/32].

  A block is fp16 d (Q4_1: then fp16 m) and 16 bytes whose low nibbles are its
  first 16 values and high nibbles its last 16 (ggml's order)."""
  out, n_in = shape
  head = 2 if qtype == Q.Q4_0 else 4
  blocks = np.asarray(data).view(np.uint8).reshape(out, n_in // INT4_GROUP, head + INT4_GROUP // 2)
  d = blocks[..., :2].copy().view(np.float16)[..., 0]
  qs = blocks[..., head:]
  q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8  # [out, G, 32]
  values = q.astype(ml_dtypes.int4).reshape(out, n_in)
  if qtype == Q.Q4_0:  # w = d (q - 8) = (values + 8) d - 8 d
    return QuantizedWeight(values, d, d * np.float16(-8))
  return QuantizedWeight(values, d, blocks[..., 2:4].copy().view(np.float16)[..., 0])


# The GGUF block types each quantization keeps as they are.
KEPT = {"int8": (Q.Q8_0,), "int4": (Q.Q4_0, Q.Q4_1), "fp8": (), "int8-channel": ()}


def _quantize_rows(w: np.ndarray, quantization: str, name: str) -> QuantizedWeight:
  """A float [out, in] tensor quantized along `in`, in checkpoint layout (scales [out, G])."""
  q = quantize(w.T, 1, quantization, name=name)  # values come back [out, in], as stored here
  return QuantizedWeight(q.values, q.scales.T, None if q.mins is None else q.mins.T)


def read_gguf(path: str | Path, quantization: str | None = None) -> ImportedModel:
  """Reads a GGUF file; with a `quantization`, linear weights come back quantized in it,
  their blocks kept as stored where the type matches (see the module doc)."""
  path = Path(path)
  parse_quantization(quantization)
  reader = open_reader(path)
  meta = read_metadata(reader)
  tensors = {t.name: t for t in reader.tensors}
  cfg = ModelConfig.from_gguf(meta, set(tensors))
  permuted = meta.get("general.architecture") == "llama"  # Mixtral GGUFs too
  # The tensors `quantization` applies to here. The head (int8 under int8 and int4) is read as
  # floats and quantized by import_model (quant.leaf_layout).
  # So are stacked experts (their grouped matmul takes per-channel scales only).
  linear, experts = set(), set()
  if quantization:
    check_quantizable(param_specs(cfg), quantization)
    specs = [s for s in jax.tree.leaves(param_specs(cfg), is_leaf=is_spec) if quantizable(s, quantization)]
    linear = {s.gguf for s in specs if s.linear and not s.head and not s.num_experts}
    experts = {s.gguf for s in specs if s.num_experts}
  kept = KEPT.get(quantization, ())
  requantized: set[tuple[str, str]] = set()

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
      if name in linear and qtype in kept:
        w = read_q8_0(t.data, shape) if qtype == Q.Q8_0 else read_q4(t.data, shape, qtype)
      else:
        what = "expert tensors" if name in experts else "tensors"
        if (name in linear or name in experts) and qtype not in FLOAT_TYPES and (qtype.name, what) not in requantized:
          requantized.add((qtype.name, what))
          how = ("per channel" if name in experts or quantization in ("fp8", "int8-channel")
                 else "per group of 32")
          log.warning("%s: %s %s are not loaded quantized as they are: dequantized to float32 "
                      "and requantized to %s %s", path.name, qtype.name, what, quantization, how)
        w = gguf.quants.dequantize(t.data, qtype).astype(np.float32, copy=False).reshape(shape)
    except (ValueError, IndexError) as e:
      raise CheckpointError(f"{path}: tensor {name!r} is corrupted ({e})") from None
    heads = (cfg.num_heads if name.endswith("attn_q.weight") else
             cfg.num_kv_heads if name.endswith("attn_k.weight") else None)
    if permuted and heads:
      if isinstance(w, QuantizedWeight):  # block scales (and mins) are per row too: same row order
        w = QuantizedWeight(*(None if a is None else unpermute_rope_rows(a, heads)
                              for a in (w.values, w.scales, w.mins)))
      else:
        w = unpermute_rope_rows(w, heads)
    if name in linear and not isinstance(w, QuantizedWeight) and quantization in ("int4", "fp8"):
      # import_model's per-channel pass makes int8 only; the other formats are made here.
      w = _quantize_rows(w, quantization, name)
    return w

  weights = assemble(cfg, str(path), "gguf", fetch)
  return ImportedModel(cfg, weights, Tokenizer.from_gguf(meta), str(path))
