"""int8 weights: the quantized leaf, its specs, quantization, and the one matmul the model uses.

A quantized linear weight is a `QuantizedWeight(values, scales)` pytree node:

  values  int8 [in..., out...]   the weight's own shape and logical axes
  scales  float32 [G, out...]    G groups along the flattened input axes:
                                 G = 1 per-output-channel (what `quantize_int8` makes),
                                 G = in / 32 for GGUF Q8_0 blocks kept as they are

so w[i, o] = values[i, o] * scales[i // (in / G), o], symmetric, with
scale = max|w| / 127 over each group. Embeddings and the LM head stay in the
model dtype (not measured quantized): the embedding is a gather, not a
matmul, and SmolLM2 ties it to the LM head, so quantizing one would
quantize both; the LM head's [V, D] product is what the sampler reads.

`linear(eq, x, w)` is the model's only matmul over linear weights. For an
int8 weight it is weight-only: the activations stay float, the int8 values
are converted for the dot and the per-channel scales multiply its output
(exact factoring: sum_i x_i q_io s_o = s_o sum_i x_i q_io). Group-wise
(Q8_0) scales vary along the contraction, so those weights are dequantized
whole first.

What was measured to choose this (scripts/bench_quant_matmul.py, SmolLM2-135M
shapes, a chain of 30 layers' weights; benchmarks/results/quant-matmul-*.json):
- XLA CPU does not fuse the convert into the dot: it writes a float32
  [in, out] copy of the weight on every call (a convert fusion feeding the
  dot; tests/test_quant.py asserts it). int8 activations x int8 weights with
  int32 accumulation do not escape it: XLA CPU widens the int8 weight to an
  s32 copy for that dot (also asserted).
- Speed: at 1 token every int8 form is ~6-13x slower per matmul than
  float32 (the widening convert dominates); at 64 tokens int8 x int8 was
  1.0-1.7x faster than float32 on the MLP weights over four runs on a shared
  machine, weight-only 0.7-1.2x.
- Accuracy (the default model, float32 vs int8 next-token logits over 16
  chat prompts): weight-only agrees on the top-1 token at 97% of positions,
  mean |logit diff| 0.30; per-token int8 activations drop that to 90% and
  0.94. That loss outweighs a 1.4x gain at large batch, so weight-only it is.
No int8 form pays for batch-1 decode under XLA CPU: that needs a kernel that
reads int8 directly (issue 14).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import CheckpointError, InvalidRequestError, UnsupportedModelError

QUANTIZATIONS = ("int8",)
Q8_0_GROUP = 32  # GGUF Q8_0: one fp16 scale per 32 consecutive input values


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """int8 values in the weight's layout and float32 scales [G, out...] (see the module doc)."""

  values: Any
  scales: Any

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape)


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedWeight)


def parse_quantization(name: str | None) -> str | None:
  """None or a known method; InvalidRequestError for anything else."""
  if name is None or name in QUANTIZATIONS:
    return name
  raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), "
                            f"got {name!r}")


def num_in_axes(spec) -> int:
  """How many leading axes of a linear weight are contracted: wo [H, Dh, D] reads H*Dh."""
  return 2 if spec.axes[:2] == ("heads", "head_dim") else 1


def quantizable(spec) -> bool:
  """Linear weights are quantized; vocab-sized ones (the LM head) stay in the model dtype."""
  return spec.linear and "vocab" not in spec.axes


def check_quantizable(specs: Any, quantization: str) -> None:
  """UnsupportedModelError unless every weight `quantization` would touch can be held that way.

  Stacked expert weights [E, in, out] are not: their scales would be per
  (expert, channel), which neither the scales layout above nor `linear`
  (the grouped expert matmul is a ragged_dot) knows.
  """
  from jaxinfer.params import is_spec
  for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec):
    if quantizable(spec) and spec.num_experts:
      raise UnsupportedModelError(
          f"quantization={quantization!r} is not supported for mixture-of-experts weights "
          f"({jax.tree_util.keystr(path, simple=True, separator='/')}: {spec.hf}); load this model unquantized")


def quantized_spec(spec, groups: int = 1) -> QuantizedWeight:
  """The specs of a quantized weight: values keep the weight's axes, scales its output axes."""
  n = num_in_axes(spec)
  values = dataclasses.replace(spec, dtype="int8")
  scales = dataclasses.replace(spec, shape=(groups,) + spec.shape[n:], axes=(None,) + spec.axes[n:],
                               init="ones", dtype="float32", linear=False)
  return QuantizedWeight(values, scales)


# ---- quantization (host, numpy) ---------------------------------------------------------------

def quantize_int8(w: np.ndarray, n_in: int) -> QuantizedWeight:
  """Symmetric per-output-channel int8 over the first `n_in` (input) axes."""
  w = np.asarray(w, np.float32)
  axes = tuple(range(n_in))
  amax = np.max(np.abs(w), axis=axes, keepdims=True)
  # An all-zero channel gets scale 1 (its values are 0 anyway), never a division by zero.
  scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
  values = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
  return QuantizedWeight(values, scale.reshape((1,) + w.shape[n_in:]))


def dequantize(w: QuantizedWeight, n_in: int) -> np.ndarray:
  """The float32 weight a QuantizedWeight stands for (the tests' reference)."""
  values = np.asarray(w.values)
  scales = np.asarray(w.scales, np.float32)
  in_size = math.prod(values.shape[:n_in])
  G = scales.shape[0]
  grouped = values.reshape(G, in_size // G, -1).astype(np.float32) * scales.reshape(G, 1, -1)
  return grouped.reshape(values.shape)


def quantize_tree(specs: Any, weights: Any) -> Any:
  """Quantizes every quantizable float leaf of `weights` (a param_specs-shaped tree) per channel;
  leaves that already are QuantizedWeight (GGUF Q8_0) are kept."""
  from jaxinfer.params import is_spec
  check_quantizable(specs, "int8")

  def one(spec, w):
    if is_quantized(w) or not quantizable(spec):
      return w
    return quantize_int8(np.asarray(w), num_in_axes(spec))

  return jax.tree.map(one, specs, weights, is_leaf=lambda x: is_spec(x) or is_quantized(x))


def cast_floats(tree: Any, dtype) -> Any:
  """Casts the float leaves to `dtype`; quantized leaves keep int8 values and float32 scales."""
  return jax.tree.map(lambda a: a if is_quantized(a) else a.astype(dtype), tree, is_leaf=is_quantized)


def check_quantized(name: str, values_shape: tuple[int, ...], values_dtype, scales_shape: tuple[int, ...],
                    spec) -> None:
  """CheckpointError naming the tensor unless values / scales fit `spec` (a float WeightSpec)."""
  n = num_in_axes(spec)
  if tuple(values_shape) != spec.shape:
    raise CheckpointError(f"{name}: quantized values have shape {tuple(values_shape)}, "
                          f"expected {spec.shape}")
  if np.dtype(values_dtype) != np.int8:
    raise CheckpointError(f"{name}: quantized values are {np.dtype(values_dtype)}, expected int8")
  in_size = math.prod(spec.shape[:n])
  groups = scales_shape[0] if len(scales_shape) else 0
  if (tuple(scales_shape[1:]) != spec.shape[n:] or len(scales_shape) != 1 + len(spec.shape) - n
      or groups < 1 or in_size % groups):
    raise CheckpointError(f"{name}: scales have shape {tuple(scales_shape)}, which does not match "
                          f"values {spec.shape}: expected (G,) + {spec.shape[n:]} with G dividing {in_size}")


# ---- the matmul -------------------------------------------------------------------------------

def _split_eq(eq: str) -> tuple[str, str, str]:
  lhs, out = eq.replace(" ", "").split("->")
  xs, ws = lhs.split(",")
  return xs, ws, out


def linear(eq: str, x: jax.Array, w: Any) -> jax.Array:
  """einsum(eq, x, w) for a float weight; the int8 x int8 path for a QuantizedWeight.

  `eq` is a letter-einsum whose contracted letters end x and start w in the
  same order ('TD,DHd->THd', 'THd,HdD->TD', '...F,FD->...D').
  """
  if not is_quantized(w):
    return jnp.einsum(eq, x, w)
  xs, ws, out = _split_eq(eq)
  n = sum(1 for c in ws if c in xs and c not in out)
  if not (n and xs.endswith(ws[:n]) and out == xs[:len(xs) - n] + ws[n:]):
    raise ValueError(f"linear({eq!r}): the contracted axes must end x and start the weight")
  in_shape, out_shape = w.values.shape[:n], w.values.shape[n:]
  lead = x.shape[:x.ndim - n]
  in_size = math.prod(in_shape)
  y = int8_matmul(x.reshape(-1, in_size), w.values.reshape(in_size, -1),
                  w.scales.reshape(w.scales.shape[0], -1))
  return y.reshape(*lead, *out_shape).astype(x.dtype)


def int8_matmul(x: jax.Array, q: jax.Array, scales: jax.Array) -> jax.Array:
  """x [M, I] float, q [I, O] int8, scales [G, O] -> float32 [M, O].

  Per channel (G = 1): the dot over the converted int8 values, then the
  scales (exact factoring). Group-wise (Q8_0, G > 1): the scales differ along
  the contraction, so the weight is dequantized first (a batched int32 dot per
  group measured 2-3x slower at 64 tokens: 'q8_0 groups' in the benchmark).
  Activations are never quantized (see the module doc for why).
  """
  x = x.astype(jnp.float32)
  if scales.shape[0] > 1:
    return jnp.dot(x, dequantize_groups(q, scales))
  return jnp.dot(x, q.astype(jnp.float32)) * scales[0]


def dequantize_groups(q: jax.Array, scales: jax.Array) -> jax.Array:
  """q [I, O] int8, scales [G, O] -> the float32 weight [I, O] (materialized by XLA CPU)."""
  G, (I, O) = scales.shape[0], q.shape
  return (q.reshape(G, I // G, O).astype(jnp.float32) * scales[:, None, :]).reshape(I, O)


def int8_matmul_reference(x: np.ndarray, q: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """What int8_matmul computes, in float64 numpy: x @ the dequantized weight."""
  G = scales.shape[0]
  I, O = q.shape
  w = (q.astype(np.float64).reshape(G, I // G, O) * np.asarray(scales, np.float64)[:, None, :]).reshape(I, O)
  return np.asarray(x, np.float64) @ w
