"""Few-token GEMV over fp8 / int8 per-channel weights on Pallas Mosaic GPU (Hopper, sm_90).

y = x @ (q * s)^T for 1-16 tokens: the weight is read at one byte an element,
converted to bfloat16 in registers, multiplied on the tensor cores (wgmma),
and the per-output-channel scale applied once to the [M, O] result. What
`jaxinfer.quant.quantized_matmul` computes on a GPU for per-channel fp8 and
int8 weights (`gemv_reference` is that formula), where XLA's GEMM fusion
widens the one-byte weight and reads it no faster than bf16 (issue 38: `w_gate`
at one token 35% of bandwidth, fp8 only 1.30x bf16 at batch 1).

Shapes (legend):
  M tokens (1-16), I inputs, O outputs (output channels),
  N = M padded to 8 or 16 (the wgmma N: a multiple of 8),
  R = 64 output channels per program (the wgmma M),
  K = BlockSizes.block_k inputs per pipeline step,
  C = K splits (programs along the inputs; their partial sums added after).
  x [M, I] bfloat16, q [O, I] int8 / float8_e4m3fn (output first, as
  QuantizedWeight stores it), scales [O] (or [1, O]) float32 -> float32 [M, O].

Work split. Out^T = q @ x^T: the weight is the wgmma's A operand (R = 64 of
its rows per program), the tokens its N, so a single token costs the same
weight traffic as 16 and the tensor cores pad only N. Grid (O / R, C): program
(o, c) sums inputs [c I / C, (c + 1) I / C) of output rows [o R, (o + 1) R).
At one token the kernel must stream the whole weight at HBM bandwidth, which
takes every SM: O / 64 programs alone are 64 for a 4096-row weight on 132 SMs,
so C splits the inputs until there are >= 2 programs per SM
(`BlockSizes.k_splits` None: the smallest divisor of the step count that
reaches TARGET_PROGRAMS). The C partial sums [C, O, N] float32 are added by
XLA, which also applies the scales and transposes back to [M, O] in the same
fusion: a pass over C * O * 16 floats, small next to the weight's O * I bytes.

Per program: a TMA pipeline (`plgpu.emit_pipeline`, BlockSizes.num_stages
slots) brings [R, K] one-byte weight tiles and [N, K] activation tiles into
shared memory, the next stages in flight while a step computes; each step
loads the weight tile into registers and converts it to bfloat16 (exact: |int8|
<= 127 and e4m3's 3-bit significand fit bfloat16's 8 bits; e4m3 goes through
float32 because Hopper converts e4m3 to f16 but not to bf16 in hardware), and
one wgmma adds tile @ x_tile^T into a float32 [R, N] accumulator. The wgmma
reads A from registers on the GPU (the pattern of jax's Hopper mixed-type
matmul example); GPU interpret mode only simulates wgmma with both operands in
shared memory, so there (and with BlockSizes.stage_in_smem) the converted tile
is stored to a bf16 shared-memory buffer first. The wgmma is waited for before
the step returns: the pipeline refills the step's slots right after.

Covered: bfloat16 activations, int8 and float8_e4m3fn weights with one scale
per output channel, O a multiple of 64, I a multiple of block_k. Not covered
(ValueError from the wrapper; quant.linear then keeps XLA's dot, see
`choose_gemv`): group-wise scales or mins (int8's default groups, int4),
float32 / float16 activations, more than 16 tokens. Untuned: no GPU was
available when this was written; scripts/gpu_diag.py measures it against XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # jax >= 0.11: Mosaic GPU with GPU interpret mode
  from jax.experimental.pallas import mosaic_gpu as plgpu
  MOSAIC_AVAILABLE = hasattr(plgpu, "InterpretGPUParams")
except ImportError:  # pragma: no cover - jax builds without Mosaic GPU
  plgpu = None
  MOSAIC_AVAILABLE = False

ROWS = 64  # output channels per program: the M of one wgmma
MAX_TOKENS = 16  # the largest N this kernel pads to; beyond it XLA's GEMM is compute-bound anyway
# Programs to aim for with split-K: 2 per SM of an H100 / H200 (132 SMs), so every SM
# streams weight bytes at one token.
TARGET_PROGRAMS = 264
WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the GEMV.

  block_k: inputs per pipeline step (a [64, block_k] one-byte weight tile, 8 KiB at
    128, one 128-byte swizzle row per output channel).
  num_stages: pipeline slots (>= 2); num_stages - 1 steps' copies are in flight while
    one computes.
  k_splits: C programs along the inputs per 64 output channels (None: the smallest
    divisor of I / block_k that makes (O / 64) * C >= TARGET_PROGRAMS).
  stage_in_smem: store the converted bf16 tile to shared memory and give wgmma that
    (None: only in interpret mode, which simulates wgmma from shared memory only; on
    the GPU the tile goes to wgmma from registers).
  """
  block_k: int = 128
  num_stages: int = 4
  k_splits: int | None = None
  stage_in_smem: bool | None = None

  def __post_init__(self):
    if self.block_k < 64 or self.block_k % 64:
      raise ValueError(f"BlockSizes.block_k={self.block_k} must be a positive multiple of 64")
    if self.num_stages < 2:
      raise ValueError(f"BlockSizes.num_stages={self.num_stages} must be >= 2")
    if self.k_splits is not None and self.k_splits < 1:
      raise ValueError(f"BlockSizes.k_splits={self.k_splits} must be >= 1")

  def splits(self, out_features: int, in_features: int) -> int:
    """C for a weight [O, I] (see k_splits); ValueError if it does not divide the steps."""
    steps = in_features // self.block_k
    if self.k_splits is not None:
      if steps % self.k_splits:
        raise ValueError(f"k_splits={self.k_splits} must divide I / block_k = {steps}")
      return self.k_splits
    tiles = out_features // ROWS
    return next((c for c in range(1, steps + 1) if steps % c == 0 and tiles * c >= TARGET_PROGRAMS),
                steps)


def unsupported_reason(x_shape, x_dtype, q_shape, q_dtype, *, per_channel: bool = True,
                       block_k: int = 128) -> str | None:
  """Why the kernel cannot take these operands (None: it can). Shapes and dtypes only."""
  if len(x_shape) != 2 or len(q_shape) != 2:
    return f"x {tuple(x_shape)} and q {tuple(q_shape)} must be 2-D ([M, I] and [O, I])"
  (M, I), (O, I2) = x_shape, q_shape
  if I != I2:
    return f"x has {I} inputs, q {I2}"
  if not 1 <= M <= MAX_TOKENS:
    return f"{M} tokens: the GEMV takes 1 to {MAX_TOKENS}"
  if jnp.dtype(q_dtype) not in WEIGHT_DTYPES:
    return f"weight dtype {jnp.dtype(q_dtype).name}: int8 or float8_e4m3fn only"
  if not per_channel:
    return "group-wise scales or mins: one scale per output channel only"
  if jnp.dtype(x_dtype) != jnp.dtype(jnp.bfloat16):
    return f"activations {jnp.dtype(x_dtype).name}: bfloat16 only (the wgmma's B operand)"
  if O % ROWS:
    return f"O = {O} outputs must be a multiple of {ROWS} (the wgmma M)"
  if I % block_k:
    return f"I = {I} inputs must be a multiple of block_k = {block_k}"
  return None


def _gemv_kernel(q_ref, x_ref, o_ref, *, block_k: int, steps: int, num_stages: int,
                 stage_in_smem: bool):
  """Program (o, c): o_ref[c, o R:(o + 1) R, :] = q[o R:(o + 1) R, split c] @ x[:, split c]^T.

  q_ref [O, I] one byte, x_ref [N, I] bfloat16, o_ref [C, O, N] float32.
  """
  o = lax.axis_index("o")
  c = lax.axis_index("c")
  N = x_ref.shape[0]

  def accumulate(acc_ref):
    def step(_, q_smem, x_smem):
      w = q_smem[...]
      if w.dtype == jnp.float8_e4m3fn:  # e4m3 -> bf16 has no hardware conversion on sm_90
        w = w.astype(jnp.float32)
      w = w.astype(jnp.bfloat16)  # exact for int8 and e4m3 values

      if stage_in_smem:
        def staged(w_smem):
          w_smem[...] = w
          plgpu.commit_smem()  # generic-proxy stores, then the async-proxy wgmma reads them
          plgpu.wgmma(acc_ref, w_smem, x_smem.T)
          plgpu.wgmma_wait(0)
        pl.run_scoped(staged, plgpu.SMEM((ROWS, block_k), jnp.bfloat16))
      else:
        plgpu.wgmma(acc_ref, w, x_smem.T)
        plgpu.wgmma_wait(0)  # the pipeline refills x_smem's slot once the step returns

    plgpu.emit_pipeline(
        step, grid=(steps,),
        in_specs=[plgpu.BlockSpec((ROWS, block_k), lambda k: (o, c * steps + k)),
                  plgpu.BlockSpec((N, block_k), lambda k: (0, c * steps + k))],
        max_concurrent_steps=num_stages,
    )(q_ref, x_ref)
    return acc_ref[...]

  acc = pl.run_scoped(accumulate, plgpu.ACC((ROWS, N), jnp.float32))  # [R, N]

  def store(o_smem):
    o_smem[...] = acc
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[c, pl.ds(o * ROWS, ROWS)])
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(store, plgpu.SMEM((ROWS, N), jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def gemv_mgpu(x: jax.Array, q: jax.Array, scales: jax.Array, *, block_sizes: BlockSizes | None = None,
              interpret: bool | object = False) -> jax.Array:
  """x [M, I] bfloat16 @ (q [O, I] int8 / e4m3 * scales [O])^T -> float32 [M, O] (Mosaic GPU).

  interpret: True runs the kernel in Mosaic GPU interpret mode on the CPU (jax >=
  0.11); a `plgpu.InterpretGPUParams` does so with those settings. Raises ValueError
  for operands the kernel does not take (`unsupported_reason`) and RuntimeError
  under a jax without Mosaic GPU.
  """
  if not MOSAIC_AVAILABLE:
    raise RuntimeError(f"gemv_mgpu needs jax >= 0.11 (Mosaic GPU); this is jax {jax.__version__}")
  bs = block_sizes or BlockSizes()
  scales = jnp.asarray(scales)
  reason = unsupported_reason(x.shape, x.dtype, q.shape, q.dtype, block_k=bs.block_k)
  if reason:
    raise ValueError(f"gemv_mgpu: {reason}")
  M, I = x.shape
  O = q.shape[0]
  if scales.shape not in ((O,), (1, O)):
    raise ValueError(f"gemv_mgpu: scales {scales.shape} must be [{O}] or [1, {O}] (one per output channel)")
  C = bs.splits(O, I)
  N = 8 if M <= 8 else 16
  stage = bool(interpret) if bs.stage_in_smem is None else bs.stage_in_smem
  kernel = functools.partial(_gemv_kernel, block_k=bs.block_k, steps=I // bs.block_k // C,
                             num_stages=bs.num_stages, stage_in_smem=stage)
  partial_sums = plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((C, O, N), jnp.float32),
      grid=(O // ROWS, C),
      grid_names=("o", "c"),
      # Warpgroup semantics: Mosaic infers the register layouts and the shared-memory
      # tilings and swizzles of the pipeline's buffers from the wgmma that reads them.
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                 else plgpu.InterpretGPUParams() if interpret else None),
      kernel_name=f"gemv_mgpu_{jnp.dtype(q.dtype).name}_n{N}_k{bs.block_k}_c{C}",
  )(q, jnp.pad(x, ((0, N - M), (0, 0))))  # padding tokens are zero rows, dropped below
  # One fusion: the splits' sum, the scale once per output channel, back to [M, O].
  return (partial_sums.sum(axis=0) * scales.reshape(O, 1).astype(jnp.float32)).T[:M]


def gemv_reference(x: jax.Array, q: jax.Array, scales: jax.Array) -> jax.Array:
  """What the kernel computes, in XLA ops: quant.quantized_matmul's per-channel GPU formula.

  The dot over q converted to x's dtype (bf16: exact for int8 and e4m3 values) with a
  float32 result, then the per-channel scales: float32 [M, O].
  """
  scales = jnp.asarray(scales).reshape(-1)
  y = lax.dot_general(x, q.astype(x.dtype), (((1,), (1,)), ((), ())),
                      preferred_element_type=jnp.float32)
  return y * scales.astype(jnp.float32)


def _version(v: str) -> tuple[int, ...]:
  """'0.11.2' -> (0, 11, 2); a dev suffix ('0.11.0.dev20261101') is dropped."""
  parts = []
  for p in v.split("."):
    if not p.isdigit():
      break
    parts.append(int(p))
  return tuple(parts)


def choose_gemv(*, backend: str, capability: str | None, jax_version: str, tokens: int,
                weight_format: str, per_channel: bool, x_dtype, one_device: bool = True,
                shape: tuple[int, int] | None = None) -> str:
  """'mosaic' where quant.quantized_matmul should run gemv_mgpu, else 'xla'. A pure function.

  backend: jax.default_backend(); capability: the GPU's compute capability ('9.0'; None
  elsewhere); weight_format: 'int8', 'fp8' or 'int4'; per_channel: one scale per output
  channel and no mins; one_device: the program is not partitioned (XLA's partitioner
  cannot split a custom call: it would gather the weight onto every device); shape:
  the weight's [O, I] (None: not checked here).
  The kernel needs Hopper or newer (TMA, wgmma: sm_90+) and jax >= 0.11 (Mosaic GPU);
  beyond MAX_TOKENS tokens XLA's GEMM is the better choice (the weight is reused
  across tokens, so the dot stops being bound by reading it).
  """
  if backend != "gpu" or not one_device:
    return "xla"
  if capability is None or _version(str(capability))[:1] < (9,):
    return "xla"
  if _version(jax_version)[:2] < (0, 11):
    return "xla"
  if weight_format not in ("int8", "fp8") or not per_channel:
    return "xla"
  if not 1 <= tokens <= MAX_TOKENS or jnp.dtype(x_dtype) != jnp.dtype(jnp.bfloat16):
    return "xla"
  if shape is not None and (shape[0] % ROWS or shape[1] % BlockSizes().block_k):
    return "xla"
  return "mosaic"
