"""Quantized weights (int8, fp8 e4m3, group-wise int4): the leaf, its specs, quantization, the one matmul.

A quantized linear weight is a `QuantizedWeight(values, scales, mins)` pytree node:

  values  [out..., in...]     the float weight [in..., out...] with its output axes first (as
                              HF and GGUF store it, and its logical axes likewise), in the
                              format's dtype: int8 / float8_e4m3fn / int4
  scales  float32 [G, out...] G groups along the flattened input axes:
                              G = 1 per-output-channel (fp8, int8-channel, stacked experts),
                              G = in / 32 for int8 (and GGUF Q8_0 blocks kept as they are); for
                              int4 float16 (group 32 by default; GGUF Q4_0 / Q4_1 blocks as they are)
  mins    [G, out...]         int4 (float16) and int8's groups (float32; None for Q8_0 blocks
                              and the head), None otherwise

so w[i, o] = values[o, i] * scales[g, o] (+ mins[g, o] for int8), and for int4
(values[o, i] + 8) * scales[g, o] + mins[g, o], with g = i // (in / G). Which layout each
weight gets under each quantization is leaf_layout's. Output
first because XLA CPU's int8 dot of a few rows reads a weight whose contracted axis is its
minor one faster than one stored [in, out] (`jaxinfer bench quant`), and every
other form is dequantized or converted first, where the layout costs nothing.
Stacked expert weights [E, in, out] (int8, fp8: per channel only) keep the experts axis in
front: values [E, out, in], scales float32 [E, 1, out], one scale per (expert, output
channel); models/moe.py multiplies each row's expert's scales after the grouped dot.
- int8 (default, quantize_int8_groups): asymmetric per group of 32 inputs, scale = (max -
  min) / 255, values in [-128, 127], mins = min + 128 scale; the head symmetric per group of
  32 (GGUF Q8_0's: scale = max|w| / 127). int8-channel (quantize_int8): symmetric per output
  channel, scale = max|w| / 127.
- fp8 (e4m3fn, the GPU path): per-output-channel, scale = max|w| / 448 (e4m3fn's largest
  finite value), values = w / scale rounded to e4m3 (to nearest even). Per channel rather
  than per tensor: same scales layout and cost as int8, and one outlier column does not
  flatten the rest of the tensor into e4m3's subnormals.
- int4: asymmetric per group of 32 inputs (what GGUF Q4_1 stores): mins = float16(min),
  scales = float16((max - min) / 15), values = round((w - mins) / scales) - 8 in [-8, 7]. A
  GGUF Q4_1 block (d, m, q in [0, 15], w = d q + m) is values = q - 8, scales = d, mins = m,
  and a Q4_0 block (w = d (q - 8)) values = q - 8, scales = d, mins = -8 d (exact in
  float16): both exactly as stored. Scales and mins are float16, GGUF's own: 0.625 bytes a weight, Q4_1's, where
  float32 ones made 0.75 and batch-1 decode reads every byte (float16 holds scales down to
  ~6e-8, and a group of smaller weights loses precision, as in GGUF). Signed int4 because
  orbax / tensorstore store int4 but not uint4. The group size must divide the input size
  (ValueError naming it).
The LM head is int8 under int8, int8-channel and int4 (leaf_layout: WeightSpec.head), not
under fp8. An untied lm_head [D, V] is an ordinary int8 linear weight (values [V, D], scales
[D / 32, V], or per vocab column under int8-channel). A tied embedding [V, D] (SmolLM2) is
stored as the table it is, values [V, D]: under int8 / int4 in groups of 32 along each vocab
row (scales [D / 32, V], grouped_table), so the lookup is values[t] times its row's scales and
the head the group matmul over values as [out, in]; under int8-channel scales [1, D] per
embedding column, so the lookup is values[t] * scales and the head folds the scales into its
input (head_logits). An untied embedding is only gathered and stays in the model dtype.

`linear(eq, x, w)` is the model's only matmul over linear weights (`head_logits` and
`embed_lookup` read the tied table). Which form runs (`quantized_matmul`):
- On the CPU, in a program on one device, where cpu_kernels built (`use_cpu_kernels`):
  hand-written XLA FFI kernels (cpu_kernels/int8_matmul.cc). Per-channel int8, group-wise
  int8 (groups of a multiple of 32, up to 512; cells only, no panels) and
  group-wise int4 (groups of a multiple of 32, up to 4096) make each token's activations
  int16 in the kernel (x = a x16, a = max|x| / 32767), sum x16 q exactly in integers
  (per group for int4), and scale in float32 after; int4 (and int8 in the AVX512-VNNI build)
  below 16 tokens runs "cells", from 16 on repacked panels, the same numbers. Per-channel fp8: e4m3 rows converted per call
  into a small panel, float32 activations (32 float32 rows, L2-resident), or where the CPU has
  AVX512-BF16 activations rounded to bfloat16 and 64 rows of bfloat16 pairs for vdpbf16ps
  (cpu_kernels.fp8_activations(); twice the rate for a little perplexity: docs/quantization.md). Every element is computed the same way
  whatever the batch, so greedy outputs do not depend on it (tests/cpu_kernels).
- Without the kernels, or in a program split over several devices (`tracing_on`: XLA's
  partitioner cannot split a custom call): int8 runs `split_int8_matmul`, two int8 limbs
  per token (x = a (hi + lo / 254)) in one s8 x s8 -> s32 dot XLA CPU does not widen;
  group-wise weights (int8's groups, Q8_0 blocks, int4) are dequantized whole in the step, since their
  scales vary along the contraction; anything else (fp8, the GPU) is weight-only, the dot
  over the converted values in the activations' dtype (bf16 for a bf16 model: exact for
  int8 and e4m3 values, and on a GPU XLA fuses the convert into the GEMM) and the
  per-channel scales after.
- On an sm_90+ GPU under jax >= 0.11, in a program on one device, per-channel fp8 and int8
  weights times 1-16 bfloat16 tokens (decode of a small batch) run
  pallas_kernels.gemv_mgpu instead: the weight read at one byte an element, converted in
  registers, the scale once per output channel (gemv_choice; XLA's GEMM fusion widened the
  one-byte weight and read it no faster than bf16, issue 38). More tokens, group-wise
  weights and older GPUs or jax keep the XLA dot.

Why kernels: XLA CPU does not fuse a convert into its dot. It writes a float32 [in, out]
copy of an int8 / fp8 / int4 weight per call, and widens an int8 weight read by a one-row
s8 x s8 dot to s32 (seen in the optimized HLO; tests/test_quant.py checks by the compiled
program's temporary bytes that jaxinfer's one-token linears write no such copy), which made every
quantized form several times slower than float32 per matmul at one token. Why int16
activations and not int8 (what llama.cpp's Q8 blocks and `vpdpbusd` would allow): with
per-token int8 activations the default model's top-1 token left float32's far more often
than with weight-only quantization; int16 (2^-15 of the row's largest value) loses far
less, and the quality table is measured through it.

Each format's quality (perplexity and top-1 agreement with float32, scripts/eval_quality.py;
`leaf_layout` says why each layout was chosen) is in docs/quantization.md, its speed on CPU
and GPU in docs/performance.md (benchmarks/results/). Why the int4 kernel streams each tile's
row block ahead: its tiles walk 16 bytes of each of eight weight rows in turn, which the
hardware prefetcher does not follow, so at one token from DRAM int4 was bound by that walk
rather than by its instructions.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import cpu_kernels
from jaxinfer.errors import CheckpointError, InvalidRequestError, UnsupportedModelError
from jaxinfer.indexing import take

# 'int8-channel': the opt-in fast int8 (one scale per output channel, the LM head per embedding
# column), the default int8 of jaxinfer before issue 42; see leaf_layout.
QUANTIZATIONS = ("int8", "fp8", "int4", "int8-channel")
VALUE_DTYPES = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
                "int4": np.dtype(ml_dtypes.int4)}
# int4's scales and mins are float16 (GGUF's d and m); every other format's scales float32.
SCALE_DTYPES = {"int4": np.dtype(np.float16)}


def scale_dtype(quantization: str) -> np.dtype:
  """The dtype of a format's scales (and int4's mins)."""
  return SCALE_DTYPES.get(quantization, np.dtype(np.float32))
Q8_0_GROUP = 32  # GGUF Q8_0: one fp16 scale per 32 consecutive input values
INT8_GROUP = 32  # our default int8's group (Q8_0's block size)
INT4_GROUP = 32  # GGUF Q4_0 / Q4_1 blocks, and our own int4 default
F16_MAX = float(np.finfo(np.float16).max)  # 65504
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
  """Values in the weight's layout, scales [G, out...] (float32; int4 float16), int4's mins (see the module doc)."""

  values: Any
  scales: Any
  mins: Any = None

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.values.shape)


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedWeight)


def format_of(w: QuantizedWeight) -> str:
  """'int8', 'fp8' or 'int4', from the values' dtype."""
  dtype = np.dtype(w.values.dtype)
  for name, d in VALUE_DTYPES.items():
    if dtype == d:
      return name
  raise ValueError(f"quantized values of dtype {dtype} are not a known format")


def parse_quantization(name: str | None) -> str | None:
  """None or a known method; InvalidRequestError for anything else, UnsupportedModelError
  for fp8 where this jax / backend cannot run float8."""
  if isinstance(name, str) and name in QUANTIZATIONS or name is None:
    if name == "fp8":
      check_fp8()
    return name
  raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or None), "
                            f"got {name!r}")


@functools.cache
def check_fp8() -> None:
  """Raises UnsupportedModelError unless jax has float8_e4m3fn and the default backend
  converts it to float32 correctly (checked once, on a few values that span its range)."""
  if not hasattr(jnp, "float8_e4m3fn"):
    raise UnsupportedModelError(f"quantization='fp8' needs jax with float8_e4m3fn (this is jax {jax.__version__})")
  probe = np.array([0.0, -0.015625, 0.5, 1.75, -3.0, 240.0, -448.0], np.float32)
  try:
    got = np.asarray(jax.jit(lambda v: v.astype(jnp.float32))(jnp.asarray(probe.astype(ml_dtypes.float8_e4m3fn))))
  except Exception as e:  # a backend without float8 fails in lowering or compilation
    raise UnsupportedModelError(f"quantization='fp8': the {jax.default_backend()} backend cannot run "
                                f"float8_e4m3fn ({type(e).__name__}: {str(e)[:200]})") from None
  if not np.array_equal(got, probe):
    raise UnsupportedModelError(f"quantization='fp8': the {jax.default_backend()} backend converts "
                                f"float8_e4m3fn wrongly ({probe} -> {got})")


def num_in_axes(spec) -> int:
  """How many axes (after a stacked weight's experts axis) are contracted: wo [H, Dh, D] reads H*Dh."""
  axes = spec.axes[1:] if spec.num_experts else spec.axes
  return 2 if axes[:2] == ("heads", "head_dim") else 1


@dataclasses.dataclass(frozen=True)
class LeafLayout:
  """How one weight is held: `format` its values' dtype ('int8', 'fp8', 'int4'), `group`
  the inputs per scale (0: one scale per output channel, or per column of a tied table),
  `mins` whether each group has a min (int4; int8's asymmetric groups)."""

  format: str
  group: int = 0
  mins: bool = False


def leaf_layout(spec, quantization: str | None) -> LeafLayout | None:
  """The layout `quantization` holds the weight `spec` describes in (None: it stays float).

  Linear weights and stacked expert matrices take `quantization`; routers never (their
  logits choose the experts, in float32).
  - int8 (default): asymmetric int8 per group of 32 inputs (w = q scale + min, float32 scale
    and min per group: 1.25 bytes a weight), the LM head (or the embedding tied to it)
    symmetric per group of 32 along the hidden axis, GGUF Q8_0's own blocks (1.125 bytes).
    Chosen by measurement (issue 42, scripts/eval_int8_layouts.py at 1275bad and eval_quality.py on the
    default model, benchmarks/results/quality-2026-11-28-int8-*.json): per-channel
    int8 agreed with float32 on the top-1 token at 96.6% of positions with the head in float32,
    94.9% with the head int8 per embedding column; symmetric groups of 32 everywhere 97.7%;
    this 100% (the default model's weights are Q4_1 blocks and its table Q8_0 blocks, which
    these groups hold exactly; on other weights asymmetric groups halve the rounding step of
    symmetric ones). Stacked experts stay per channel (models/moe.py's grouped matmul), and
    a weight whose inputs are not a multiple of 32 too.
  - int8-channel (opt-in): one scale per output channel, the head per embedding column (a
    tied table) or per vocab column: 1 byte a weight, the fastest int8 at one token, and the
    least accurate (94.9% top-1 on the default model).
  - int4: groups of 32 with mins (GGUF Q4_1's); its head int8 as int8's default (Q8_0).
  - fp8: per output channel; the head stays float, as FP8 serving recipes keep it.
  The head is the largest weight (113 MB of the default model's 538 in float32) and read
  whole per token, hence int8 under int4 too.
  """
  if not quantization:
    return None
  if spec.head:
    if quantization == "fp8":
      return None
    if quantization == "int8-channel" or _in_size(spec) % INT8_GROUP:
      return LeafLayout("int8")
    return LeafLayout("int8", INT8_GROUP)
  if spec.router:
    return None
  experts = spec.num_experts and len(spec.shape) == 3  # [E, in, out] (GPT-OSS's are not `linear`)
  if not (spec.linear or experts) or "vocab" in spec.axes:
    return None
  if quantization == "int4":
    return LeafLayout("int4", INT4_GROUP, True)
  if quantization == "int8" and not spec.num_experts and _in_size(spec) % INT8_GROUP == 0:
    return LeafLayout("int8", INT8_GROUP, True)
  return LeafLayout("fp8" if quantization == "fp8" else "int8")


def _in_size(spec) -> int:
  """How many inputs the weight contracts (a tied table: its hidden size)."""
  if is_table(spec):
    return spec.shape[1]
  lead = 1 if spec.num_experts else 0
  return math.prod(spec.shape[lead:lead + num_in_axes(spec)])


def leaf_format(spec, quantization: str | None) -> str | None:
  """The values' format ('int8', 'fp8', 'int4') `quantization` holds the weight `spec`
  describes in, None where it stays float (leaf_layout)."""
  layout = leaf_layout(spec, quantization)
  return layout.format if layout else None


def quantizable(spec, quantization: str | None = None) -> bool:
  """Whether `quantization` quantizes the weight `spec` describes (leaf_format)."""
  return leaf_format(spec, quantization) is not None


def check_quantizable(specs: Any, quantization: str) -> None:
  """UnsupportedModelError unless every weight `quantization` would touch can be held that way.

  int4 is refused for stacked expert weights: its group-wise scales vary along the
  contraction, so the grouped expert matmul (a ragged_dot over all E experts on the CPU)
  would dequantize every expert's weight to floats on every step.
  int4 is refused for MLA's wkv_b: models/mla.py reads it dequantized as values x scales
  (its absorbed form contracts the output dims), which would drop int4's mins.
  """
  from jaxinfer.params import is_spec
  if quantization != "int4":
    return
  for path, spec in jax.tree_util.tree_leaves_with_path(specs, is_leaf=is_spec):
    where = f"({jax.tree_util.keystr(path, simple=True, separator='/')}: {spec.hf})"
    if quantizable(spec, quantization) and spec.num_experts:
      raise UnsupportedModelError(f"quantization='int4' is not supported for mixture-of-experts weights "
                                  f"{where}: use int8 or fp8")
    if quantizable(spec, quantization) and spec.hf.endswith("kv_b_proj.weight"):
      raise UnsupportedModelError(f"quantization='int4' is not supported for MLA {where}: use int8 or fp8")


def is_table(spec) -> bool:
  """The embedding table tied to the head [V, D]: quantized per D column, but its values stay
  [V, D] (the rows the lookup gathers; the head contracts D, already the minor axis)."""
  return spec.head and spec.axes[0] == "vocab"


def values_shape(shape: tuple, n_in: int, lead: int = 0) -> tuple:
  """A float weight's shape (or axes) [lead..., in..., out...] -> its quantized values'
  [lead..., out..., in...] (n_in input axes)."""
  shape = tuple(shape)
  return shape[:lead] + shape[lead + n_in:] + shape[lead:lead + n_in]


def to_values_layout(a, n_in: int):
  """[in..., out...] -> [out..., in...] (numpy: a copy, C order; or jax)."""
  axes = tuple(range(n_in, a.ndim)) + tuple(range(n_in))
  if isinstance(a, jax.Array):
    return jnp.transpose(a, axes)
  return np.ascontiguousarray(np.transpose(a, axes))


def from_values_layout(a, n_in: int):
  """[out..., in...] -> [in..., out...] (numpy or jax)."""
  k = a.ndim - n_in
  return a.transpose(tuple(range(k, a.ndim)) + tuple(range(k)))


def quantized_spec(spec, groups: int | None = None, quantization: str = "int8",
                   mins: bool | None = None) -> QuantizedWeight:
  """The specs of a quantized weight: values the weight's axes, output axes first (the tied
  table as it is), scales (and mins) its output axes (behind a stacked weight's experts
  axis); a tied table grouped along its hidden axis (groups > 1, or one group of a row)
  has scales [G, V]. `groups` defaults to 1 (int8, fp8) or in / INT4_GROUP (int4), `mins`
  to int4's."""
  lead = 1 if spec.num_experts else 0
  n = num_in_axes(spec)
  if groups is None:
    in_size = math.prod(spec.shape[lead:lead + n])
    groups = max(1, in_size // INT4_GROUP) if quantization == "int4" else 1
  if mins is None:
    mins = quantization == "int4"
  moved = 0 if is_table(spec) else n
  values = dataclasses.replace(spec, dtype=VALUE_DTYPES[quantization].name, shape=values_shape(spec.shape, moved, lead),
                               axes=values_shape(spec.axes, moved, lead))
  if is_table(spec) and groups > 1:  # per vocab row's groups of its D values: [G, V]
    shape, axes = (groups, spec.shape[0]), (None, spec.axes[0])
  else:
    shape, axes = spec.shape[:lead] + (groups,) + spec.shape[lead + n:], spec.axes[:lead] + (None,) + spec.axes[lead + n:]
  scales = dataclasses.replace(spec, shape=shape, axes=axes, init="ones", dtype=scale_dtype(quantization).name,
                               linear=False)
  return QuantizedWeight(values, scales, dataclasses.replace(scales, init="zeros") if mins else None)


def leaf_spec(spec, quantization: str | None) -> Any:
  """`spec`, or the QuantizedWeight of specs `quantization` holds it in (leaf_layout)."""
  layout = leaf_layout(spec, quantization)
  if layout is None:
    return spec
  groups = _in_size(spec) // layout.group if layout.group else None
  return quantized_spec(spec, groups, layout.format, layout.mins)


# ---- quantization (numpy on the host, or jax where the weight lives) ---------------------------

def _xp(w: Any):
  """The array namespace of `w`: jax.numpy for a jax array (quantized where it lives, e.g. an
  8B model's random weights on the GPU), numpy for anything else. Both round the same way
  (half to even, float32 -> e4m3 to nearest even), but XLA CPU's float32 division can be an
  ulp off numpy's, so a scale may differ by an ulp and a value on a rounding boundary by a
  step (tests/test_quant.py bounds it)."""
  return jnp if isinstance(w, jax.Array) else np


def quantize_int8(w: np.ndarray, n_in: int) -> QuantizedWeight:
  """Symmetric per-output-channel int8 over the first `n_in` (input) axes."""
  xp = _xp(w)
  w = xp.asarray(w, np.float32)
  axes = tuple(range(n_in))
  amax = xp.max(xp.abs(w), axis=axes, keepdims=True)
  # An all-zero channel gets scale 1 (its values are 0 anyway), never a division by zero.
  scale = xp.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
  values = xp.clip(xp.rint(w / scale), -127, 127).astype(np.int8)
  return QuantizedWeight(to_values_layout(values, n_in), scale.reshape((1,) + w.shape[n_in:]))


def _input_groups(w, n_in: int, group_size: int, fmt: str, name: str):
  """(xp, w float32, G, w as [G, group_size, out]): w's first `n_in` (input) axes in G groups of
  `group_size` consecutive inputs; ValueError naming the weight when they do not divide."""
  xp = _xp(w)
  w = xp.asarray(w, np.float32)
  in_size = math.prod(w.shape[:n_in])
  if group_size < 1 or in_size % group_size:
    raise ValueError(f"{fmt} group size {group_size} does not divide the {in_size} inputs of {name} "
                     f"{tuple(w.shape)}")
  G = in_size // group_size
  return xp, w, G, w.reshape(G, group_size, -1)


def quantize_int8_groups(w: np.ndarray, n_in: int, group_size: int = INT8_GROUP, asymmetric: bool = True,
                         name: str = "weight") -> QuantizedWeight:
  """int8 per group of `group_size` consecutive inputs (over the first `n_in` axes), float32
  scales and mins [G, out...]. Asymmetric: scale = (max - min) / 255, values = round((w - min)
  / scale) - 128 in [-128, 127] and mins = min + 128 scale, so w = values scale + mins (the
  group's range in 255 steps). Symmetric (GGUF Q8_0's): scale = max|w| / 127, values in
  [-127, 127], no mins. A constant group gets scale 1."""
  xp, w, G, grouped = _input_groups(w, n_in, group_size, "int8", name)
  out = (G,) + w.shape[n_in:]
  if asymmetric:
    lo, hi = grouped.min(axis=1), grouped.max(axis=1)  # [G, O]
    scale = xp.where(hi > lo, (hi - lo) / 255.0, 1.0).astype(np.float32)
    q = xp.clip(xp.rint((grouped - lo[:, None]) / scale[:, None]), 0, 255) - 128
    mins = (lo + 128.0 * scale).astype(np.float32)
  else:
    amax = xp.max(xp.abs(grouped), axis=1)
    scale = xp.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = xp.clip(xp.rint(grouped / scale[:, None]), -127, 127)
    mins = None
  values = q.astype(np.int8).reshape(w.shape)
  return QuantizedWeight(to_values_layout(values, n_in), scale.reshape(out), None if mins is None else mins.reshape(out))


def quantize_fp8(w: np.ndarray, n_in: int) -> QuantizedWeight:
  """Per-output-channel float8_e4m3fn over the first `n_in` (input) axes: max|w| maps to 448."""
  xp = _xp(w)
  w = xp.asarray(w, np.float32)
  amax = xp.max(xp.abs(w), axis=tuple(range(n_in)), keepdims=True)
  scale = xp.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
  # e4m3fn has no infinity: a value past 448 would become NaN, so clip the rounding overshoot.
  values = xp.clip(w / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
  return QuantizedWeight(to_values_layout(values, n_in), scale.reshape((1,) + w.shape[n_in:]))


def quantize_int4(w: np.ndarray, n_in: int, group_size: int = INT4_GROUP, name: str = "weight") -> QuantizedWeight:
  """Asymmetric int4 per group of `group_size` consecutive inputs (GGUF Q4_1's scheme)."""
  xp, w, G, grouped = _input_groups(w, n_in, group_size, "int4", name)
  lo, hi = grouped.min(axis=1), grouped.max(axis=1)  # [G, O]
  if not float(xp.maximum(hi.max(), -lo.min())) <= F16_MAX:  # (also NaN)
    raise ValueError(f"{name} {tuple(w.shape)} has weights past float16's range (+-{F16_MAX:g}), or NaN: int4's "
                     f"float16 scales and mins cannot hold them; use int8 or fp8")
  # Rounded to float16 first, and the values placed against the rounded min and scale. A
  # constant group, or one whose range underflows float16, gets scale 1: its values land on the min.
  mins = lo.astype(np.float16)
  scale = ((hi - lo) / 15.0).astype(np.float16)
  scale = xp.where(scale > 0, scale, np.float16(1))
  q = xp.clip(xp.rint((grouped - mins.astype(np.float32)[:, None]) / scale.astype(np.float32)[:, None]), 0, 15)
  values = (q - 8).astype(np.int8).reshape(w.shape)
  out = (G,) + w.shape[n_in:]
  return QuantizedWeight(to_values_layout(values, n_in).astype(ml_dtypes.int4), scale.reshape(out), mins.reshape(out))


def quantize(w: np.ndarray, n_in: int, quantization: str, group_size: int = INT4_GROUP,
             name: str = "weight") -> QuantizedWeight:
  if quantization == "int8":
    return quantize_int8(w, n_in)
  if quantization == "fp8":
    return quantize_fp8(w, n_in)
  if quantization == "int4":
    return quantize_int4(w, n_in, group_size, name)
  raise InvalidRequestError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")


def quantize_weight(spec, w: np.ndarray, quantization: str, group_size: int = INT4_GROUP) -> QuantizedWeight:
  """`quantize` for the weight `spec` describes: a stacked expert weight expert by expert
  (values [E, out, in], scales [E, G, out])."""
  xp = _xp(w)
  if is_table(spec):
    q = quantize(w, 1, quantization, group_size, spec.hf)
    values = from_values_layout(q.values, 1)
    return QuantizedWeight(values if xp is jnp else np.ascontiguousarray(values), q.scales)
  if not spec.num_experts:
    return quantize(w, num_in_axes(spec), quantization, group_size, spec.hf)
  parts = [quantize(w[e], num_in_axes(spec), quantization, group_size, spec.hf) for e in range(w.shape[0])]
  return QuantizedWeight(xp.stack([p.values for p in parts]), xp.stack([p.scales for p in parts]),
                         None if parts[0].mins is None else xp.stack([p.mins for p in parts]))


def quantize_leaf(spec, w: np.ndarray, quantization: str) -> QuantizedWeight:
  """The weight `spec` describes, quantized as `quantization` holds it (leaf_layout; a
  quantizable spec)."""
  layout = leaf_layout(spec, quantization)
  if layout.format != "int8" or not layout.group:
    return quantize_weight(spec, w, layout.format, layout.group or INT4_GROUP)
  if is_table(spec):  # [V, D]: each vocab row's D values in groups, values kept [V, D]
    return quantize_int8_groups(w.T, 1, layout.group, layout.mins, spec.hf)
  return quantize_int8_groups(w, num_in_axes(spec), layout.group, layout.mins, spec.hf)


def dequantize_weight(spec, w: QuantizedWeight) -> np.ndarray:
  """The float32 weight `w` stands for, for the weight `spec` describes (experts too)."""
  if is_table(spec) and grouped_table(w):
    return dequantize(w, 1).T
  if is_table(spec):
    return dequantize(QuantizedWeight(to_values_layout(np.asarray(w.values), 1), w.scales), 1)
  if not spec.num_experts:
    return dequantize(w, num_in_axes(spec))
  return np.stack([dequantize(QuantizedWeight(w.values[e], w.scales[e], None if w.mins is None else w.mins[e]),
                              num_in_axes(spec)) for e in range(spec.num_experts)])


def dequantize(w: QuantizedWeight, n_in: int) -> np.ndarray:
  """The float32 weight [in..., out...] a QuantizedWeight stands for, on the host (the tests'
  reference): dequantize_jnp over numpy copies of its leaves."""
  host = QuantizedWeight(*(None if a is None else np.asarray(a) for a in (w.values, w.scales, w.mins)))
  return dequantize_jnp(host, n_in)


def quantize_tree(specs: Any, weights: Any, quantization: str = "int8", group_size: int = INT4_GROUP) -> Any:
  """Quantizes every quantizable float leaf of `weights` (a param_specs-shaped tree); leaves
  that already are QuantizedWeight (GGUF blocks kept as stored) are kept."""
  from jaxinfer.params import is_spec
  check_quantizable(specs, quantization)

  def one(spec, w):
    if is_quantized(w) or not quantizable(spec, quantization):
      return w
    w = w if isinstance(w, jax.Array) else np.asarray(w)
    if leaf_format(spec, quantization) == "int4":
      return quantize_weight(spec, w, "int4", group_size)
    return quantize_leaf(spec, w, quantization)

  return jax.tree.map(one, specs, weights, is_leaf=lambda x: is_spec(x) or is_quantized(x))


def quantization_of(specs: Any, weights: Any) -> str | None:
  """The quantization `weights` (a param_specs-shaped tree) is held in, from its quantized
  leaves' formats: int4 with its int8 head is int4 (leaf_format); int8 is 'int8-channel'
  where its head has one scale per column (leaf_layout), else 'int8'. ValueError naming a
  leaf whose format that quantization would not give it."""
  from jaxinfer.params import is_spec
  pairs = [(s, format_of(w), w) for s, w in zip(jax.tree.leaves(specs, is_leaf=is_spec),
                                                 jax.tree.leaves(weights, is_leaf=is_quantized)) if is_quantized(w)]
  found = {f for s, f, _ in pairs if not s.head} or {f for _, f, _ in pairs}
  if len(found) > 1:
    raise ValueError(f"the weights mix quantization formats {sorted(found)}")
  quantization = found.pop() if found else None
  if quantization == "int8" and any(s.head and _per_column_head(s, w) for s, _, w in pairs):
    quantization = "int8-channel"
  pairs = [(s, f) for s, f, _ in pairs]
  for s, f in pairs:
    if f != leaf_format(s, quantization):
      raise ValueError(f"{s.hf} is {f}, but {quantization} holds it in {leaf_format(s, quantization)}")
  return quantization


def cast_floats(tree: Any, dtype) -> Any:
  """Casts the float leaves to `dtype`; quantized leaves keep their values, scales and mins."""
  return jax.tree.map(lambda a: a if is_quantized(a) else a.astype(dtype), tree, is_leaf=is_quantized)


def with_mins(shardings: Any, weights: Any) -> Any:
  """`shardings` (a tree of QuantizedWeight / Sharding leaves) with int4's mins placed like its
  scales wherever `weights` has mins and `shardings` none (a spec tree built without the format)."""
  def one(sh, w):
    if is_quantized(sh) and sh.mins is None and is_quantized(w) and w.mins is not None:
      return dataclasses.replace(sh, mins=sh.scales)
    return sh
  return jax.tree.map(one, shardings, weights, is_leaf=lambda x: is_quantized(x) or isinstance(x, jax.sharding.Sharding))


def check_quantized(name: str, stored_shape: tuple[int, ...], values_dtype, scales_shape: tuple[int, ...],
                    spec, quantization: str = "int8", mins_shape: tuple[int, ...] | None = None) -> None:
  """CheckpointError naming the tensor unless values / scales (/ mins) fit `spec` (a float
  WeightSpec) and `quantization`'s layout."""
  n = num_in_axes(spec)
  want_values = values_shape(spec.shape, 0 if is_table(spec) else n, 1 if spec.num_experts else 0)
  if tuple(stored_shape) != want_values:
    raise CheckpointError(f"{name}: quantized values have shape {tuple(stored_shape)}, "
                          f"expected {want_values} (output axes first)")
  if is_table(spec) and tuple(scales_shape) != (1, spec.shape[1]):
    # grouped per vocab row (leaf_layout's int8): scales [G, V], G dividing D; values [V, D] are
    # then the head's [out, in] as they stand
    spec = dataclasses.replace(spec, shape=spec.shape[::-1], axes=spec.axes[::-1])
  if spec.num_experts:  # per (expert, output channel) only: models/moe.py's layout
    want = (spec.shape[0], 1) + spec.shape[1 + n:]
    if tuple(scales_shape) != want:
      raise CheckpointError(f"{name}: scales have shape {tuple(scales_shape)}, expected {want} "
                            f"(per expert and output channel) for values {want_values}")
    spec, scales_shape = spec.one_expert(), tuple(scales_shape)[1:]
  expected = VALUE_DTYPES[quantization]
  if np.dtype(values_dtype) != expected:
    raise CheckpointError(f"{name}: quantized values are {np.dtype(values_dtype)}, expected {expected} "
                          f"({quantization})")
  in_size = math.prod(spec.shape[:n])
  groups = scales_shape[0] if len(scales_shape) else 0
  if (tuple(scales_shape[1:]) != spec.shape[n:] or len(scales_shape) != 1 + len(spec.shape) - n
      or groups < 1 or in_size % groups):
    raise CheckpointError(f"{name}: scales have shape {tuple(scales_shape)}, which does not match "
                          f"values {values_shape(spec.shape, n)}: expected (G,) + {spec.shape[n:]} with G "
                          f"dividing {in_size}")
  if quantization == "int4" and mins_shape is None:
    raise CheckpointError(f"{name}: int4 weights need mins")
  if quantization == "fp8" and mins_shape is not None:
    raise CheckpointError(f"{name}: fp8 weights have no mins")
  if mins_shape is not None and tuple(mins_shape) != tuple(scales_shape):
    raise CheckpointError(f"{name}: mins have shape {tuple(mins_shape)}, scales {tuple(scales_shape)}")


# ---- the matmul -------------------------------------------------------------------------------

def _split_eq(eq: str) -> tuple[str, str, str, int]:
  """x's letters, w's letters, the output's, and how many axes are contracted."""
  lhs, out = eq.replace(" ", "").split("->")
  xs, ws = lhs.split(",")
  return xs, ws, out, sum(1 for c in ws if c in xs and c not in out)


def linear(eq: str, x: jax.Array, w: Any, out_dtype=None) -> jax.Array:
  """einsum(eq, x, w) for a float weight; the quantized matmul for a QuantizedWeight.

  `eq` is a letter-einsum whose contracted letters end x and start w in the
  same order ('TD,DHd->THd', 'THd,HdD->TD', '...F,FD->...D'). The result is in
  `out_dtype` (default: x's dtype), accumulated in float32 (int32 for split int8).
  """
  if not is_quantized(w):
    return float_linear(eq, x, w, out_dtype)
  xs, ws, out, n = _split_eq(eq)
  if not (n and xs.endswith(ws[:n]) and out == xs[:len(xs) - n] + ws[n:]):
    raise ValueError(f"linear({eq!r}): the contracted axes must end x and start the weight")
  out_shape, in_shape = w.values.shape[:w.values.ndim - n], w.values.shape[w.values.ndim - n:]
  lead = x.shape[:x.ndim - n]
  in_size = math.prod(in_shape)
  G = w.scales.shape[0]
  y = quantized_matmul(x.reshape(-1, in_size), w.values.reshape(-1, in_size), w.scales.reshape(G, -1),
                       None if w.mins is None else w.mins.reshape(G, -1))
  return y.reshape(*lead, *out_shape).astype(out_dtype or x.dtype)


def head_logits(x: jax.Array, w: Any, tied: bool) -> jax.Array:
  """x [..., D] -> float32 logits [..., V] through the LM head: w is lm_head [D, V], or with
  `tied` the embedding [V, D] it shares.

  int8 (quantizable: the head is the largest weight, 113 MB of the default model's 538 in
  float32) keeps per-channel scales along its input D either way, for the tied table
  because its columns are what the embedding lookup and the head have in common; scales
  along the contraction factor into x (sum_d x_d s_d q_vd), so the tied head is the
  same split int8 dot over x * s as any other int8 weight, reading [V, D] as stored.
  """
  if not tied:
    return linear("...D,DV->...V", x, w, jnp.float32)
  if not is_quantized(w):
    return float_linear("...D,VD->...V", x, w, jnp.float32)
  lead = x.shape[:-1]
  if grouped_table(w):  # values [V, D] are the head's [out, in] as they stand: scales [G, V]
    return quantized_matmul(x.reshape(-1, x.shape[-1]), w.values, w.scales, w.mins).reshape(*lead, -1)
  xs = x.reshape(-1, x.shape[-1]).astype(jnp.float32) * w.scales  # [M, D] * [1, D]
  return int8_matmul(xs, w.values).reshape(*lead, -1)


def embed_lookup(embed: Any, tokens: jax.Array, dtype) -> jax.Array:
  """The rows of the embedding table [V, D] at tokens [...] -> [..., D] in `dtype` (an int8
  table, tied to the head, is its int8 rows times the per-column scales)."""
  if not is_quantized(embed):
    return take(embed, tokens).astype(dtype)
  rows = take(embed.values, tokens).astype(jnp.float32)  # [..., D]
  if not grouped_table(embed):
    return (rows * embed.scales[0]).astype(dtype)
  G, D = embed.scales.shape[0], rows.shape[-1]
  scale = take(embed.scales.T, tokens)[..., None]  # [..., G, 1]
  out = rows.reshape(*rows.shape[:-1], G, D // G) * scale
  if embed.mins is not None:
    out = out + take(embed.mins.T, tokens)[..., None]
  return out.reshape(rows.shape).astype(dtype)


def grouped_table(w: QuantizedWeight) -> bool:
  """Whether a tied table (values [V, D]) is quantized per vocab row in groups along D (scales
  [G, V], leaf_layout's int8) rather than per column (scales [1, D], int8-channel's). Only a
  table with V == D == its one group's size could be read either way."""
  return tuple(w.scales.shape) != (1, w.values.shape[1])


def _per_column_head(spec, w: QuantizedWeight) -> bool:
  """Whether the head leaf `w` has one scale per column (int8-channel's layout)."""
  return not grouped_table(w) if is_table(spec) else w.scales.shape[0] == 1


def float_linear(eq: str, x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
  """einsum(eq, x, w) accumulated in float32, in `out_dtype` (default: x's dtype).

  For bfloat16 on the CPU this decides the speed (`jaxinfer bench quant`):
  XLA CPU runs a bf16 x bf16 dot with a float32 result in its YNNPACK fusion over the
  bf16 weight, but one with a bf16 result, or with a single row (a matrix-vector
  product), through a float32 copy of the whole weight written per call. So the dot
  asks for float32, and a one-row bf16 product runs as two equal rows (one is dropped).
  Float32 weights are unchanged: their one-row product is XLA's own matrix-vector kernel,
  which reads the weight once at memory bandwidth.
  """
  _, _, _, n = _split_eq(eq)  # the n contracted axes end x
  one_row = (x.dtype == jnp.bfloat16 and jax.default_backend() == "cpu" and x.ndim > n
             and math.prod(x.shape[:x.ndim - n]) == 1)
  if one_row:  # axis 0 is a row axis of size 1
    x = jnp.concatenate([x, x])
  y = jnp.einsum(eq, x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)
  return y[:1] if one_row else y


def quantized_matmul(x: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None = None) -> jax.Array:
  """x [M, I] float, q [O, I] int8 / float8_e4m3fn / int4, scales [G, O] (mins [G, O]) -> float32 [M, O].

  On the CPU (one device, cpu_kernels built): int4 groups of a multiple of 32 inputs (up to
  4096) run cpu_kernels.int4_matmul, int8 groups (up to 512, with or without mins)
  int8_group_matmul, per-channel int8 int8_matmul, all over int16
  activations the kernel forms per row (a = max|x| / 32767, x16 = round(x / a)), and
  per-channel fp8 cpu_kernels.fp8_matmul (float32 activations, or bfloat16 where the CPU
  has AVX512-BF16: cpu_kernels.fp8_activations()).
  Per channel on an sm_90+ GPU with 1-16 bf16 tokens (gemv_choice): pallas_kernels.gemv_mgpu.
  Otherwise per channel (G = 1, no mins): the dot over the converted values in the
  activations' dtype (_in_compute_dtype: bf16 for a bf16 model), then the scales (exact
  factoring); group-wise (Q8_0, int4): the scales differ along the
  contraction, so the weight is dequantized first (a batched int32 dot per group was
  slower: 'q8_0 groups' in `jaxinfer bench quant`).
  """
  G = scales.shape[0]
  if q.dtype == jnp.int4 and cpu_kernels.int4_groups_fit(q.shape[1], G) and use_cpu_kernels():
    return cpu_kernels.int4_matmul(x.astype(jnp.float32), q, scales, mins)
  if (q.dtype == jnp.int8 and (G > 1 or mins is not None) and cpu_kernels.int8_groups_fit(q.shape[1], G)
      and use_cpu_kernels()):
    return cpu_kernels.int8_group_matmul(x.astype(jnp.float32), q, scales.astype(jnp.float32),
                                         None if mins is None else mins.astype(jnp.float32))
  if G > 1 or mins is not None:
    return _dot_t(x.astype(jnp.float32), dequantize_groups(q, scales, mins))
  if gemv_choice(x, q, scales, mins) == "mosaic":
    from pallas_kernels.gemv_mgpu import gemv_mgpu
    # Off a GPU only where a test chose the kernel by hand: interpret mode there.
    return gemv_mgpu(x, q, scales[0], interpret=jax.default_backend() != "gpu")
  if q.dtype == jnp.float8_e4m3fn and use_cpu_kernels():
    return cpu_kernels.fp8_matmul(x.astype(jnp.float32), q, scales[0])
  if q.dtype == jnp.int8:
    return int8_matmul(x, q) * scales[0]
  return _dot_t(*_in_compute_dtype(x, q)) * scales[0]


def gemv_choice(x: jax.Array, q: jax.Array, scales: jax.Array, mins: jax.Array | None = None) -> str:
  """'mosaic' where quantized_matmul runs pallas_kernels.gemv_mgpu (few tokens, per-channel
  fp8 / int8, bf16 activations, an sm_90+ GPU under jax >= 0.11, one device), else 'xla'.
  The decision is gemv_mgpu.choose_gemv's, from this process's backend and GPU."""
  from pallas_kernels.gemv_mgpu import choose_gemv
  backend = jax.default_backend()
  fmt = {np.dtype(v): k for k, v in VALUE_DTYPES.items()}.get(np.dtype(q.dtype), str(q.dtype))
  return choose_gemv(backend=backend, capability=_gpu_capability() if backend == "gpu" else None,
                     jax_version=jax.__version__, tokens=x.shape[0], weight_format=fmt,
                     per_channel=scales.shape[0] == 1 and mins is None, x_dtype=x.dtype,
                     one_device=_CPU_KERNEL.get(), shape=tuple(q.shape))


@functools.cache
def _gpu_capability() -> str | None:
  """The first GPU's compute capability ('9.0'), None if jax does not say."""
  cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
  return None if cc is None else str(cc)


def _in_compute_dtype(x: jax.Array, q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x and per-channel values q (int8 / e4m3) in the dtype the dot runs in: bfloat16 for
  bfloat16 activations, else float32. Both conversions of q are exact (|int8| <= 127 and
  e4m3's 3-bit significand fit bfloat16's 8 bits), and a bf16 x bf16 product is exact in
  the float32 accumulator, so the result is the float32 dot's up to summation order. On a
  GPU this is what lets XLA fuse the convert into a bf16 GEMM (one byte read per weight)
  instead of writing a float32 copy of the weight and running a float32 GEMM."""
  cd = jnp.bfloat16 if x.dtype == jnp.bfloat16 else jnp.float32
  return x.astype(cd), q.astype(cd)


def int8_matmul(x: jax.Array, q: jax.Array) -> jax.Array:
  """x [M, I] float @ q [O, I]^T for an int8 q (its scales applied by the caller) -> float32 [M, O].

  On the CPU: the hand-written kernel (cpu_kernels.int8_matmul) over int16 activations
  (x to 2^-15 of its row's largest value, in the kernel), when it is available and the
  program runs on one device; else XLA's split_int8_matmul. Both sum integers exactly,
  so neither depends on the batch; they round differently (~1e-6 relative), so one
  process uses one of them throughout (cpu_kernels.available() does not change).
  Elsewhere (GPU): a dot over the converted values in x's dtype (_in_compute_dtype).
  """
  if use_cpu_kernels():
    return cpu_kernels.int8_matmul(x.astype(jnp.float32), q)
  if jax.default_backend() == "cpu" and q.shape[1] <= SPLIT_INT8_MAX_IN:
    return split_int8_matmul(x.astype(jnp.float32), q)
  return _dot_t(*_in_compute_dtype(x, q))


def use_cpu_kernels() -> bool:
  """Whether the program being traced runs cpu_kernels' matmuls (and jaxinfer.ops its decode
  attention): on the CPU, on one device, where they built."""
  return jax.default_backend() == "cpu" and _CPU_KERNEL.get() and cpu_kernels.available()


# Off while tracing a program split over several devices: XLA's partitioner cannot split a
# custom call, it would gather its operands whole onto every device. The GPU GEMV
# (gemv_choice) is a custom call too and follows it.
_CPU_KERNEL: contextvars.ContextVar[bool] = contextvars.ContextVar("cpu_kernel", default=True)


def tracing_on(mesh: Any, fn: Callable) -> Callable:
  """fn, traced with the CPU kernels off when `mesh` spans more than one device (XLA's
  dots instead, which the partitioner splits like any dot)."""
  if mesh is None or mesh.size == 1:
    return fn

  @functools.wraps(fn)
  def run(*args, **kwargs):
    token = _CPU_KERNEL.set(False)
    try:
      return fn(*args, **kwargs)
    finally:
      _CPU_KERNEL.reset(token)
  return run


def _dot_t(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [M, I] @ w [O, I]^T -> [M, O] (no transposed copy: the dot contracts both minor axes)."""
  return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


# |hi|, |lo| <= 127 and |q| <= 127: a dot over I inputs stays inside int32 while I * 127^2 < 2^31.
SPLIT_INT8_MAX_IN = (2**31 - 1) // (127 * 127)
SPLIT_INT8_LO = 254.0  # lo's weight: hi + lo / 254 recovers x / a to within 1 / 508


def token_scales(x: jax.Array, top: int = 127) -> jax.Array:
  """x [M, I] -> float32 [M, 1]: max|x| / top per row (1 for an all-zero row)."""
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True)
  return jnp.where(amax > 0, amax / top, 1.0)


def split_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [M, I] float32 -> (int8 limbs [2M, I], float32 scale a [M, 1]), per token (row).

  x = a * (hi + lo / 254) to within max|x| / 64516 (2^-16 of the row's largest value):
  a = max|x| / 127, hi = round(x / a) and lo = round((x / a - hi) * 254), both in [-127, 127].
  The rows are [hi_0 .. hi_{M-1}, lo_0 .. lo_{M-1}].
  """
  a = token_scales(x)
  y = x / a
  hi = jnp.round(y)
  lo = jnp.round((y - hi) * SPLIT_INT8_LO)
  return jnp.concatenate([hi, lo]).astype(jnp.int8), a


def split_int8_matmul(x: jax.Array, q: jax.Array, scale: jax.Array | None = None) -> jax.Array:
  """x [M, I] float32, q [O, I] int8, per-channel scale [O] or None -> float32 [M, O]:
  x @ (q * scale)^T.

  The int8 weight is read as int8: XLA CPU hands an int8 x int8 -> int32 dot of two or
  more rows to its YNNPACK fusion, while any float or one-row form of the same product
  first writes a widened [I, O] copy of the weight (tests/test_quant.py checks that this
  program's temporaries stay far below one).
  So the activations are split into two int8 limbs (split_activations) and one dot of
  the [2M, I] limbs accumulates in int32, exactly: the result is x @ dequantized(q) with
  x carried to 2^-16 of its row maximum (a weight-only product within ~1e-5 relative),
  and, integer sums being exact in any order, it does not depend on the batch.
  """
  M = x.shape[0]
  limbs, a = split_activations(x)
  acc = jax.lax.dot_general(limbs, q, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.int32).astype(jnp.float32)
  y = (acc[:M] + acc[M:] * (1.0 / SPLIT_INT8_LO)) * a
  return y if scale is None else y * scale


def dequantize_groups(q: jax.Array, scales: jax.Array, mins: jax.Array | None = None, dtype=np.float32) -> jax.Array:
  """q [O, I], scales (mins) [G, O] -> the weight [O, I] in `dtype`: q scale, q scale + min
  (int8), or (q + 8) scale + min (int4). jax arrays in the program (XLA CPU materializes the
  result), or numpy on the host."""
  G, (O, I) = scales.shape[0], q.shape
  w = q.reshape(O, G, I // G).astype(dtype)
  if mins is not None and np.dtype(q.dtype) == np.dtype(ml_dtypes.int4):  # int4: w = (q + 8) scale + min
    w = w + 8
  w = w * scales.T[:, :, None].astype(dtype)
  if mins is not None:
    w = w + mins.T[:, :, None].astype(dtype)
  return w.reshape(O, I)


def dequantize_jnp(w: QuantizedWeight, n_in: int) -> jax.Array:
  """The float32 weight [in..., out...] of a quantized linear weight, in the program (what a
  reader that contracts its output axes, MLA's absorbed wkv_b, takes); numpy leaves give
  numpy (`dequantize`)."""
  v = w.values
  q = v.reshape(-1, math.prod(v.shape[v.ndim - n_in:]))
  G = w.scales.shape[0]
  dense = dequantize_groups(q, w.scales.reshape(G, -1), None if w.mins is None else w.mins.reshape(G, -1))
  return from_values_layout(dense.reshape(v.shape), n_in)


def quantized_matmul_reference(x: np.ndarray, q: np.ndarray, scales: np.ndarray,
                               mins: np.ndarray | None = None) -> np.ndarray:
  """What quantized_matmul computes, in float64 numpy: x @ the dequantized weight (q [O, I])."""
  w = dequantize_groups(np.asarray(q), np.asarray(scales), None if mins is None else np.asarray(mins), np.float64)
  return np.asarray(x, np.float64) @ w.T
