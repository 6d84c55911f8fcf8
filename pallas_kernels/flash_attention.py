"""Dense flash attention for long prefill: one Pallas (Triton) kernel, GQA, causal or not.

Shapes (legend):
  B batch, T query length, S key length
  Hq query heads, Hkv kv heads, G = Hq / Hkv query heads per kv head, D head dim

  q     [B, T, Hq, D]
  k, v  [B, S, Hkv, D]
  out   [B, T, Hq, D]

Causal attention aligns the queries with the end of the keys: query i sees
keys j <= i + (S - T) (T == S is the usual square mask; T < S is a chunk of
new tokens after S - T cached ones). A query that sees no key (possible only
when T > S) gets 0.

Algorithm: FlashAttention-2 (Dao 2023). The grid is (T / block_q, B * Hq);
a program keeps its [block_q, D] q tile and a float32 accumulator on chip and
streams K/V of its kv head block_k rows at a time with an online softmax
(Algorithm 1: running row max and row sum, the accumulator rescaled when the
max grows, one division at the end). Under a causal mask the key blocks
entirely above the diagonal are skipped, and only the blocks that cross it
(or the ragged end of S) pay for a mask (Section 3.1.1); the loop is split
into an unmasked part and a masked part for that reason. Ragged T and S (not
multiples of the tile sizes) are handled by masked loads and stores.

Why the Triton lowering: it runs on any recent NVIDIA GPU, not only on the
Hopper and Blackwell parts that Mosaic GPU targets. A Mosaic GPU (wgmma/TMA)
variant was not measured because no GPU was available this session; neither
were the default tile sizes below tuned on one (they are chosen so that the
kernel compiles within the shared memory of sm_80/86/90, which
scripts/check_triton_compile.py checks without a GPU).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_attention_operands, is_pow2
from pallas_kernels._compat import triton_compiler_params


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the flash attention kernel.

  block_q: query rows per program; block_k: key rows per loop iteration.
  None: 128 x 64 for 16-bit inputs, 64 x 32 for float32, so that the q tile
  and two pipeline stages of K and V fit the 99 KiB of shared memory per
  block of consumer GPUs at D=128 (scripts/check_triton_compile.py).
  Both are powers of two >= 16 (Triton dots), shrunk for short T or S.
  num_warps: None picks 4 for D <= 64, else 8. num_stages: Triton software
  pipelining depth (2 keeps K+V stages of 64 x 128 bf16 within the shared
  memory of consumer GPUs). All ignored in interpret mode except the tiles.
  """
  block_q: int | None = None
  block_k: int | None = None
  num_warps: int | None = None
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      value = getattr(self, name)
      if value is not None and (not is_pow2(value) or value < 16):
        raise ValueError(f"BlockSizes.{name}={value} must be a power of two >= 16")

  def resolve(self, *, T: int, S: int, D: int, itemsize: int) -> BlockSizes:
    """These sizes with every None filled in for a call's static shapes."""
    # A tile longer than the padded sequence only wastes work on masked rows.
    block_q = min(self.block_q or 256 // itemsize, max(16, pl.next_power_of_2(max(T, 1))))
    block_k = min(self.block_k or 128 // itemsize, max(16, pl.next_power_of_2(max(S, 1))))
    return dataclasses.replace(self, block_q=block_q, block_k=block_k,
                               num_warps=self.num_warps or (4 if D <= 64 else 8))


def _flash_kernel(q_ref, k_ref, v_ref, o_ref, *, sm_scale: float, causal: bool, block_q: int,
                  block_k: int, num_q_heads_per_kv_head: int, precision):
  """One [block_q, D] tile of one (batch, query head)."""
  _, T, Hq, D = q_ref.shape
  S = k_ref.shape[1]
  qb = pl.program_id(0)
  b = lax.div(pl.program_id(1), jnp.int32(Hq))
  hq = lax.rem(pl.program_id(1), jnp.int32(Hq))
  hk = lax.div(hq, jnp.int32(num_q_heads_per_kv_head))
  q0 = qb * block_q
  q_idx = q0 + lax.iota(jnp.int32, block_q)
  q_ok = q_idx < T
  q_mask = jnp.broadcast_to(q_ok[:, None], (block_q, D))
  q = plgpu.load(q_ref.at[b, pl.ds(q0, block_q), hq, :], mask=q_mask, other=0)
  q = q.astype(k_ref.dtype)
  offset = S - T  # query i sits at key position i + offset

  def kv_block(kb, carry, masked: bool):
    m, l, acc = carry  # [block_q], [block_q], [block_q, D]
    k0 = kb * block_k
    kv_idx = k0 + lax.iota(jnp.int32, block_k)
    if masked:
      kv_ok = kv_idx < S
      kv_mask = jnp.broadcast_to(kv_ok[:, None], (block_k, D))
      k = plgpu.load(k_ref.at[b, pl.ds(k0, block_k), hk, :], mask=kv_mask, other=0)
      v = plgpu.load(v_ref.at[b, pl.ds(k0, block_k), hk, :], mask=kv_mask, other=0)
    else:
      k = k_ref[b, pl.ds(k0, block_k), hk, :]
      v = v_ref[b, pl.ds(k0, block_k), hk, :]
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [block_q, block_k] f32
    if masked:
      visible = jnp.broadcast_to(kv_ok[None, :], (block_q, block_k))
      if causal:
        visible &= kv_idx[None, :] <= q_idx[:, None] + offset
      s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    # Rows with no visible key yet keep m = -inf; shift them by 0 so that
    # their p and alpha are 0 instead of exp(-inf + inf) = NaN.
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l = alpha * l + p.sum(axis=1)
    acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return m_new, l, acc

  num_kv_blocks = pl.cdiv(S, block_k)
  if causal:
    # Blocks every row of this q tile sees in full: keys < q0 + offset + 1.
    full = jnp.clip((q0 + offset + 1) // block_k, 0, S // block_k)
    last_row = jnp.minimum(q0 + block_q, T) - 1
    stop = jnp.clip(pl.cdiv(last_row + offset + 1, block_k), 0, num_kv_blocks)
  else:
    full = S // block_k
    stop = num_kv_blocks
  carry = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
           jnp.zeros((block_q, D), jnp.float32))
  if S >= block_k:  # else there is no full block, and the unmasked body would not even trace
    carry = lax.fori_loop(0, full, functools.partial(kv_block, masked=False), carry)
  _, l, acc = lax.fori_loop(full, jnp.maximum(stop, full), functools.partial(kv_block, masked=True),
                            carry)
  out = acc / jnp.where(l > 0, l, 1.0)[:, None]
  plgpu.store(o_ref.at[b, pl.ds(q0, block_q), hq, :], out.astype(o_ref.dtype), mask=q_mask)


def _check_inputs(q, k, v):
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, Hq, D], got {q.shape=}")
  if k.ndim != 4:
    raise ValueError(f"k must be [B, S, Hkv, D], got {k.shape=}")
  check_attention_operands(q, k, v, "k", "v")
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"q batch B={q.shape[0]} must equal k batch Bk={k.shape[0]}")


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale", "block_sizes", "interpret"))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                    sm_scale: float | None = None, block_sizes: BlockSizes | None = None,
                    interpret: bool = False) -> jax.Array:
  """Softmax(q k^T * sm_scale [+ causal mask]) v for q [B, T, Hq, D], k, v [B, S, Hkv, D].

  sm_scale defaults to D ** -0.5. Causal: query i sees keys j <= i + (S - T).
  q may differ in dtype from k/v (it is cast to their dtype for the dots,
  which accumulate in float32); the result has q's dtype. Raises ValueError
  naming the offending arguments for inconsistent shapes or dtypes.
  """
  q, k, v = map(jnp.asarray, (q, k, v))
  _check_inputs(q, k, v)
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  if B * T * Hq == 0:
    return jnp.zeros_like(q)
  bs = (block_sizes or BlockSizes()).resolve(T=T, S=S, D=D, itemsize=k.dtype.itemsize)
  block_q, block_k = bs.block_q, bs.block_k
  precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
  kernel = functools.partial(
      _flash_kernel, sm_scale=float(D ** -0.5 if sm_scale is None else sm_scale), causal=causal,
      block_q=block_q, block_k=block_k, num_q_heads_per_kv_head=Hq // Hkv, precision=precision)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      # q blocks on the fast axis: programs running together share one
      # (batch, head)'s K/V in L2.
      grid=(pl.cdiv(T, block_q), B * Hq),
      compiler_params=triton_compiler_params(bs.num_warps, bs.num_stages),
      interpret=interpret,
      name=f"flash_attention_{block_q=}_{block_k=}",
  )(q, k, v)


@functools.partial(jax.jit, static_argnames=("causal", "sm_scale"))
def flash_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                              sm_scale: float | None = None) -> jax.Array:
  """Plain-jnp reference: the full [B, Hq, T, S] score matrix, softmax in float32."""
  q, k, v = map(jnp.asarray, (q, k, v))
  _check_inputs(q, k, v)
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  scale = D ** -0.5 if sm_scale is None else sm_scale
  qg = q.astype(jnp.float32).reshape(B, T, Hkv, G, D)
  s = jnp.einsum("BTKGD,BSKD->BKGTS", qg, k.astype(jnp.float32),
                 precision=lax.Precision.HIGHEST) * scale
  visible = jnp.ones((T, S), bool)
  if causal:
    visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T)
  w = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
  w = jnp.where(visible.any(axis=1)[:, None], w, 0.0)  # a query with no visible key gets 0
  out = jnp.einsum("BKGTS,BSKD->BTKGD", w, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
  return out.reshape(B, T, Hq, D).astype(q.dtype)
