"""What every importer shares: the imported-model record, spec-driven assembly, MXFP4 decoding."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import ml_dtypes
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.params import WeightSpec, is_spec, param_specs
from jaxinfer.quant import QuantizedWeight, format_of, num_in_axes, scale_dtype, values_shape
from jaxinfer.tokenizer import Tokenizer


@dataclasses.dataclass
class ImportedModel:
  """A model read from some format into host memory: numpy weights in our layout."""

  config: ModelConfig
  weights: Any  # the param_specs tree, numpy arrays at the leaves
  tokenizer: Tokenizer | None
  source: str


def assemble(cfg: ModelConfig, source: str, key: str,
             fetch: Callable[[str, tuple[int, ...]], np.ndarray | None]) -> Any:
  """Builds the weight tree by asking `fetch(name, expected_shape)` for each spec.

  `key` is 'hf' or 'gguf' (which name of the spec to use). `fetch` returns the
  tensor in checkpoint layout (or None if the file lacks it) and may raise
  CheckpointError itself; the shape check here names the tensor and file.
  It may also return a QuantizedWeight in checkpoint layout (values [out, in],
  scales and mins [out, G]: GGUF blocks kept as stored, or quantized by the
  reader), put in our layout here.
  A stacked expert weight whose name has '{e}' is read expert by expert and
  stacked; a missing expert is named in the error.
  """
  specs = param_specs(cfg)
  leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)

  def read(name: str, expected: tuple[int, ...]):
    array = fetch(name, expected)
    if array is None:
      raise CheckpointError(f"{source}: tensor {name!r} is missing")
    if tuple(array.shape) != expected:
      raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(array.shape)}, "
                            f"expected {expected} for this config")
    return array

  def load(spec: WeightSpec) -> np.ndarray:
    names = spec.checkpoint_names(key)
    if "{e}" in getattr(spec, key):
      parts = [read(n, spec.checkpoint_shape(per_expert=True)) for n in names]
      if any(isinstance(a, QuantizedWeight) for a in parts):
        raise CheckpointError(f"{source}: quantized expert tensors ({names[0]!r}) are not supported")
      return spec.from_checkpoint(np.stack([np.asarray(a) for a in parts]))
    array = read(names[0], spec.checkpoint_shape())
    if isinstance(array, QuantizedWeight):
      if spec.num_experts:
        raise CheckpointError(f"{source}: quantized expert tensor {names[0]!r} is not supported")
      return quantized_from_checkpoint(spec, array)
    return spec.from_checkpoint(np.asarray(array))

  out = [load(s) for s in tqdm(leaves, desc=f"reading {source.rsplit('/', 1)[-1]}", unit="tensor",
                                 leave=False, disable=None)]
  return jax.tree.unflatten(treedef, out)


def quantized_from_checkpoint(spec: WeightSpec, w: QuantizedWeight) -> QuantizedWeight:
  """[out, in] values and [out, G] scales (and mins) (HF/GGUF layout) -> ours: values
  [out..., in...] (the same bytes), scales [G, out...]."""
  n = num_in_axes(spec)
  values = np.asarray(w.values).reshape(values_shape(spec.shape, n))

  dtype = scale_dtype(format_of(w))

  def groups(a):
    a = np.asarray(a, dtype).T
    return a.reshape((a.shape[0],) + spec.shape[n:])

  return QuantizedWeight(values, groups(w.scales), None if w.mins is None else groups(w.mins))


# OCP Microscaling (MX) v1.0, sec. 5.3.3: the 16 FP4 E2M1 codes (sign, 2 exponent bits, 1 mantissa bit).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, name: str = "",
                     dtype=ml_dtypes.bfloat16) -> np.ndarray:
  """MXFP4 (OCP MX v1.0: blocks of 32 E2M1 values sharing one E8M0 scale) -> floats.

  blocks [..., G, 16] uint8, two values per byte, the low nibble first (GPT-OSS's `*_blocks`);
  scales [..., G] uint8, the shared exponent biased by 127 (`*_scales`). Returns [..., G * 32]
  in `dtype`: value = E2M1[code] * 2 ** (scale - 127), exact in bfloat16 (at most two
  significant bits, and E8M0's exponents are bfloat16's). Decoded one leading slice at a
  time (an expert of GPT-OSS-120B is ~100 MB of float32), so the float32 temporaries stay small.
  """
  blocks, scales = np.asarray(blocks), np.asarray(scales)
  if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
    raise CheckpointError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
  if blocks.ndim < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
    raise CheckpointError(f"{name}: MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match "
                          f"(expected [..., G, {MXFP4_BLOCK // 2}] and [..., G])")
  if (scales == 255).any():  # E8M0's NaN
    raise CheckpointError(f"{name}: MXFP4 scales hold 255 (NaN in E8M0)")
  lead = blocks.shape[:-2]
  out = np.empty(lead + (blocks.shape[-2] * MXFP4_BLOCK,), dtype)
  flat_blocks = blocks.reshape((-1,) + blocks.shape[-2:]) if lead else blocks[None]
  flat_scales = scales.reshape((-1,) + scales.shape[-1:]) if lead else scales[None]
  flat_out = out.reshape((-1, out.shape[-1]))
  for i in range(flat_blocks.shape[0]):
    b = flat_blocks[i]  # [G, 16]
    v = np.empty(b.shape[:-1] + (MXFP4_BLOCK,), np.float32)
    v[:, 0::2] = E2M1_VALUES[b & 0x0F]
    v[:, 1::2] = E2M1_VALUES[b >> 4]
    v = np.ldexp(v, flat_scales[i].astype(np.int32)[:, None] - 127)
    flat_out[i] = v.reshape(-1).astype(dtype)
  return out
