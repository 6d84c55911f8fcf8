"""What every importer shares: the imported-model record and spec-driven assembly."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.config import ModelConfig
from jaxinfer.errors import CheckpointError
from jaxinfer.params import WeightSpec, is_spec, param_specs
from jaxinfer.quant import QuantizedWeight, num_in_axes
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
  It may also return a QuantizedWeight in checkpoint layout (GGUF Q8_0 kept
  as int8: values [out, in], scales [out, in / 32]), put in our layout here.
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
  """[out, in] int8 values and [out, G] scales (HF/GGUF layout) -> ours: [in..., out...], [G, out...]."""
  n = num_in_axes(spec)
  values = np.asarray(w.values).T.reshape(spec.shape)
  scales = np.asarray(w.scales, np.float32).T
  return QuantizedWeight(values, scales.reshape((scales.shape[0],) + spec.shape[n:]))
