"""Ragged paged MLA: multi-head latent attention (absorbed) over a paged latent cache, one Pallas kernel.

DeepSeek-V2/V3 (DeepSeek-V2 paper sec. 2.1.2-2.1.3) cache one latent row per
token, [c_KV (R), k_R (E)], shared by every head. With W_UK absorbed into the
query, each head scores a token as q_lat . c_KV + q_rope . k_R and attends
over the latents c_KV themselves (W_UV is applied to the result, outside).

Shapes (legend):
  T   packed query tokens of all sequences, back to back
  S   sequence slots (the first `num_seqs` are real, the rest padding)
  N   pages in the pool, p page_size, P pages per sequence slot
  H   query heads, R kv_lora_rank, E qk_rope_head_dim, L = R + E

  q_latent      [T, H, R]     each head's no-rope query times W_UK^T
  q_rope        [T, H, E]     each head's rotated rope query
  latent_pages  [N, p, L]     per token [c_KV, k_R] (new tokens already written)
  latent_scale  [N, p, L / g] float32, optional: a quantized cache (int8 / float8
                              pages), each run of g values of a token scaled on its
                              own; g divides R and E, so no run mixes c_KV and k_R
  kv_lens, page_indices, cu_q_lens, num_seqs: as in ragged_paged_attention.py
  out           [T, H, R]     softmax-weighted sums of c_KV; rows past
                              cu_q_lens[num_seqs] are unspecified

Why a kernel of its own and not the GQA kernel with one KV head of width L:
DeepSeek-V3's L = 512 + 64 = 576 is no power of two, which Triton tiles need.
Here the score is two dots, [rows, R] x [keys, R] and [rows, E] x [keys, E],
each over a power-of-two width, read from the same gathered pages at column
offsets 0 and R; the PV dot uses only the R latent columns (the GQA kernel
fed with L would carry the E rope columns through V too).

Work split. As in the GQA kernel, a program owns one q block (block_q tokens
of one sequence) and here `block_h` heads of it: the tile is
[block_q * block_h, R] rows of queries. All heads read the same latent pages,
so MLA decode is compute-shaped like a prefill of H rows per token (the
FlashMLA observation); splitting heads over a grid axis keeps programs small
for large H while neighbouring programs share the pages in L2. The KV walk
(online softmax, FlashAttention-2 Algorithm 1, causal block skipping) and
the masking of ragged edges are those of ragged_paged_attention.py.

Limits: R and E must be powers of two >= 16 (Triton dots), p a power of two;
no sliding window or soft cap (DeepSeek uses neither). Tile sizes untuned
and the kernel not yet run on a GPU (none this session). CI lowers it to
Triton IR (tests/pallas_kernels/test_triton_lowering.py); compiled with the
pip `triton` 3.9 to cubin for sm_80/86/90 (the scripts/check_triton_compile.py
route), the default tiles at DeepSeek-V3 widths (R 512, E 64, bf16) take
87 KiB of shared memory for a p16 decode batch of 128 heads, 84 KiB at p64,
70 KiB for prefill chunks: within the 99 KiB of sm_86/89 blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import SUPPORTED_DTYPES, check_quantized_values, is_pow2, next_pow2
from pallas_kernels._compat import triton_compiler_params
from pallas_kernels.ragged_paged_attention import _schedule

# Keys per KV iteration when pages_per_block is not given: one gathered tile
# is keys x L; 32 keys of 576 bf16 values is 36 KiB. Untuned.
_DEFAULT_KEYS_16BIT = 32
_DEFAULT_KEYS_32BIT = 16
# Shared memory the default tiles aim to stay within (the ~99 KiB per block of sm_86/89).
_SMEM_BUDGET = 96 * 1024


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the ragged paged MLA kernel (None: chosen per call).

  block_h: heads per program (a power of two; heads past H are masked).
    None: min(next_pow2(H), 16).
  block_q: query tokens per program; block_q * block_h rows must be >= 16.
    None: 16, 32 or 64 rows for mean q_len <= 2, <= 8, longer (32 when
    R + E > 256: a 64 x 576 bf16 q tile alone is 72 KiB).
  pages_per_block: pages per KV iteration; pages_per_block * p >= 16.
  num_warps / num_stages: Triton launch settings (ignored in interpret mode).
    num_stages None: 2 when two stages of the KV tile plus the q tile
    (estimated) fit _SMEM_BUDGET, else 1; DeepSeek-V3's 576-wide rows make
    the tiles large (scripts/check_triton_compile.py reports the real size).
  """
  block_q: int | None = None
  block_h: int | None = None
  pages_per_block: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    for name in ("block_q", "block_h", "pages_per_block"):
      value = getattr(self, name)
      if value is not None and not is_pow2(value):
        raise ValueError(f"BlockSizes.{name}={value} must be a power of two")
    if (self.num_warps is not None and self.num_warps < 1) or (self.num_stages is not None
                                                               and self.num_stages < 1):
      raise ValueError(f"{self.num_warps=} and {self.num_stages=} must be >= 1")

  def resolve(self, *, T: int, S: int, H: int, page_size: int, R: int, E: int, itemsize: int) -> BlockSizes:
    """These sizes with every None filled in for a call's static shapes; checks the dot sizes."""
    block_h = self.block_h or min(next_pow2(H), 16)
    block_q = self.block_q
    if block_q is None:
      mean_q_len = T / max(S, 1)
      rows = 16 if mean_q_len <= 2 else 32 if mean_q_len <= 8 or R + E > 256 else 64
      block_q = max(1, rows // block_h)
    if block_q * block_h < 16:
      raise ValueError(f"{block_q=} x {block_h=} rows must be >= 16 (the smallest Triton dot)")
    pages_per_block = self.pages_per_block
    if pages_per_block is None:
      keys = _DEFAULT_KEYS_16BIT if itemsize <= 2 else _DEFAULT_KEYS_32BIT
      pages_per_block = max(1, keys // page_size)
    if pages_per_block * page_size < 16:
      raise ValueError(
          f"{pages_per_block=} x {page_size=} keys must be >= 16 (the smallest Triton dot)")
    num_warps = self.num_warps or (4 if block_q * block_h * R <= 64 * 64 else 8)
    num_stages = self.num_stages
    if num_stages is None:
      row_bytes = (R + E) * itemsize
      two_stages = 2 * pages_per_block * page_size * row_bytes + block_q * block_h * row_bytes
      num_stages = 2 if two_stages <= _SMEM_BUDGET else 1
    return dataclasses.replace(self, block_q=block_q, block_h=block_h,
                               pages_per_block=pages_per_block, num_warps=num_warps,
                               num_stages=num_stages)


def _mla_kernel(block_seq_ref, block_idx_ref, cu_q_lens_ref, kv_lens_ref, page_indices_ref,
                q_latent_ref, q_rope_ref, latent_ref, *rest, sm_scale: float, block_q: int,
                block_h: int, pages_per_block: int, precision, dot_dtype, group: int):
  """One q block (block_q tokens of one sequence) x one block of block_h heads.

  `rest`: (latent_scale_ref, o_ref) for a quantized cache, else (o_ref,). A quantized
  tile is dequantized as it is loaded (its scales differ along the columns, so they
  cannot be folded into the scores) and the dots run in `dot_dtype`, q's dtype."""
  scale_ref, o_ref = rest if len(rest) == 2 else (None,) + rest
  T, H, R = q_latent_ref.shape
  E = q_rope_ref.shape[2]
  N, page_size, _ = latent_ref.shape
  P = page_indices_ref.shape[1]
  rows = block_q * block_h
  block_kv = pages_per_block * page_size
  b = pl.program_id(0)
  hb = pl.program_id(1)
  seq = block_seq_ref[b]

  @pl.when(seq >= 0)
  def _():
    q_start = cu_q_lens_ref[seq]
    q_end = cu_q_lens_ref[seq + 1]
    kv_len = kv_lens_ref[seq]
    t0 = q_start + block_idx_ref[b] * block_q
    tok = t0 + lax.iota(jnp.int32, block_q)
    tok_ok = (tok < q_end) & (tok < T)
    head_ok = hb * block_h + lax.iota(jnp.int32, block_h) < H
    ok = tok_ok[:, None, None] & head_ok[None, :, None]
    rows_slice = (pl.ds(t0, block_q), pl.ds(hb * block_h, block_h))
    out_mask = jnp.broadcast_to(ok, (block_q, block_h, R))

    q_lat = plgpu.load(q_latent_ref.at[rows_slice + (slice(None),)], mask=out_mask, other=0)
    q_rot = plgpu.load(q_rope_ref.at[rows_slice + (slice(None),)],
                       mask=jnp.broadcast_to(ok, (block_q, block_h, E)), other=0)
    q_lat = q_lat.reshape(rows, R).astype(dot_dtype)
    q_rot = q_rot.reshape(rows, E).astype(dot_dtype)
    # Row r of the tile is token r // block_h, head r % block_h of this head block.
    first_pos = kv_len - (q_end - q_start) + (t0 - q_start)
    q_pos = first_pos + lax.div(lax.iota(jnp.int32, rows), jnp.int32(block_h))
    last_pos = first_pos + jnp.minimum(q_end - t0, block_q) - 1
    kv_stop = jnp.clip(last_pos + 1, 0, kv_len)  # causal block skipping (FA-2 sec. 3.1.1)

    def kv_block(kb, carry):
      m, l, acc = carry  # [rows], [rows], [rows, R]
      page_no = kb * pages_per_block + lax.iota(jnp.int32, pages_per_block)
      ids = plgpu.load(page_indices_ref.at[seq, pl.ds(kb * pages_per_block, pages_per_block)],
                       mask=page_no < P, other=0)
      ids = jnp.clip(ids, 0, N - 1)  # a bad page table never addresses outside the pool
      # One page gather, read as its two column ranges: the latent and the rope key.
      c = latent_ref[ids, :, pl.ds(0, R)].reshape(block_kv, R)
      k_rot = latent_ref[ids, :, pl.ds(R, E)].reshape(block_kv, E)
      if scale_ref is not None:
        c = _dequantize(c, scale_ref, ids, 0, block_kv, R, group)
        k_rot = _dequantize(k_rot, scale_ref, ids, R, block_kv, E, group)
        c, k_rot = c.astype(dot_dtype), k_rot.astype(dot_dtype)
      kv_pos = kb * block_kv + lax.iota(jnp.int32, block_kv)
      kv_ok = kv_pos < kv_len

      s = (plgpu.dot(q_lat, c, trans_b=True, precision=precision)
           + plgpu.dot(q_rot, k_rot, trans_b=True, precision=precision)) * sm_scale
      s = jnp.where(kv_pos[None, :] <= q_pos[:, None], s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(axis=1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no visible key yet: p = 0, not NaN
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe[:, None])
      l = alpha * l + p.sum(axis=1)
      c = jnp.where(kv_ok[:, None], c, jnp.zeros_like(c))  # slots past kv_len may hold NaN
      acc = alpha[:, None] * acc + plgpu.dot(p.astype(c.dtype), c, precision=precision)
      return m_new, l, acc

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, R), jnp.float32))
    _, l, acc = lax.fori_loop(0, pl.cdiv(kv_stop, block_kv), kv_block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref.at[rows_slice + (slice(None),)], out.reshape(block_q, block_h, R).astype(o_ref.dtype),
                mask=out_mask)


def _dequantize(x, scale_ref, ids, start: int, block_kv: int, width: int, g: int):
  """Columns [start, start + width) of the gathered tile x [block_kv, width], times their
  groups' scales from scale_ref [N, p, L / g] (float32)."""
  scales = scale_ref[ids, :, pl.ds(start // g, width // g)].reshape(block_kv, width // g)
  return (x.astype(jnp.float32).reshape(block_kv, width // g, g) * scales[:, :, None]).reshape(block_kv, width)


def _check_inputs(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  latent_scale=None):
  if q_latent.ndim != 3 or q_rope.ndim != 3:
    raise ValueError(f"q_latent [T, H, R] and q_rope [T, H, E] must be 3-D, got {q_latent.shape=} {q_rope.shape=}")
  if q_latent.shape[:2] != q_rope.shape[:2]:
    raise ValueError(f"q_latent.shape={q_latent.shape} and q_rope.shape={q_rope.shape} must agree on [T, H]")
  if latent_pages.ndim != 3:
    raise ValueError(f"latent_pages must be [N, page_size, R + E], got {latent_pages.shape=}")
  R, E = q_latent.shape[2], q_rope.shape[2]
  if latent_pages.shape[2] != R + E:
    raise ValueError(f"latent_pages' last dim {latent_pages.shape[2]} must be R + E = {R} + {E}")
  for name, x in (("q_latent", q_latent), ("q_rope", q_rope)) + (
      () if latent_scale is not None else (("latent_pages", latent_pages),)):
    if x.dtype not in SUPPORTED_DTYPES:
      raise ValueError(f"{name}.dtype={x.dtype} is not one of float32, bfloat16, float16")
  if latent_scale is not None:
    check_quantized_values(latent_pages, "latent_pages")
    G = latent_scale.shape[-1] if latent_scale.ndim == 3 else 0
    if (latent_scale.shape[:2] != latent_pages.shape[:2] or latent_scale.dtype != jnp.float32 or not G
        or (R + E) % G or R % ((R + E) // G) or E % ((R + E) // G) or not is_pow2((R + E) // G)):
      raise ValueError(f"latent_scale must be float32 [N, page_size, (R + E) / g] with g a power of two dividing "
                       f"R={R} and E={E}, got {latent_scale.shape} {latent_scale.dtype}")
  for name, n in (("R (kv_lora_rank)", R), ("E (qk_rope_head_dim)", E)):
    if not is_pow2(n) or n < 16:
      raise ValueError(f"{name}={n} must be a power of two >= 16 (Triton tiles)")
  if not is_pow2(latent_pages.shape[1]):
    raise ValueError(f"page_size={latent_pages.shape[1]} must be a power of two (Triton tiles)")
  for name, x, ndim in (("kv_lens", kv_lens, 1), ("page_indices", page_indices, 2),
                        ("cu_q_lens", cu_q_lens, 1)):
    if x.dtype != jnp.int32:
      raise ValueError(f"{name}.dtype={x.dtype} must be int32")
    if x.ndim != ndim:
      raise ValueError(f"{name} must have {ndim} dims, got {name}.shape={x.shape}")
  S = kv_lens.shape[0]
  if page_indices.shape[0] != S or cu_q_lens.shape[0] != S + 1:
    raise ValueError(f"page_indices rows {page_indices.shape[0]} and len(cu_q_lens)={cu_q_lens.shape[0]} "
                     f"must be len(kv_lens)={S} and {S + 1}")
  if num_seqs.ndim != 0 or not jnp.issubdtype(num_seqs.dtype, jnp.integer):
    raise ValueError(f"num_seqs must be an integer scalar, got {num_seqs.shape=} {num_seqs.dtype=}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def ragged_paged_mla(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                     kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                     num_seqs: jax.Array | int, *, sm_scale: float,
                     block_sizes: BlockSizes | None = None, latent_scale: jax.Array | None = None,
                     interpret: bool = False) -> jax.Array:
  """Causal absorbed MLA of ragged queries over a paged latent cache (Pallas Triton kernel).

  See the module docstring for shapes. sm_scale is required (DeepSeek's
  1 / sqrt(qk_nope + qk_rope) times any yarn mscale; not derivable from the
  operands). Dots take the cache dtype and accumulate in float32; the result
  has q_latent's dtype. With `latent_scale` (a quantized cache) each tile is
  dequantized group by group as it is loaded and the dots run in q_latent's dtype.
  ValueError names inconsistent shapes or dtypes.
  """
  q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
      jnp.asarray, (q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
  scales = () if latent_scale is None else (jnp.asarray(latent_scale),)
  _check_inputs(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *scales)
  dot_dtype = q_latent.dtype if scales else latent_pages.dtype
  group = latent_pages.shape[2] // scales[0].shape[2] if scales else 0
  T, H, R = q_latent.shape
  page_size = latent_pages.shape[1]
  S = kv_lens.shape[0]
  if T == 0 or S == 0:
    return jnp.zeros_like(q_latent)
  bs = (block_sizes or BlockSizes()).resolve(T=T, S=S, H=H, page_size=page_size, R=R,
                                             E=q_rope.shape[2], itemsize=jnp.dtype(dot_dtype).itemsize)
  num_blocks = min(T, (T + S * (bs.block_q - 1)) // bs.block_q)
  block_seq, block_idx = _schedule(cu_q_lens, num_seqs.astype(jnp.int32), bs.block_q, num_blocks)
  precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  kernel = functools.partial(_mla_kernel, sm_scale=float(sm_scale), block_q=bs.block_q,
                             block_h=bs.block_h, pages_per_block=bs.pages_per_block,
                             precision=precision, dot_dtype=dot_dtype, group=group)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(q_latent.shape, q_latent.dtype),
      grid=(num_blocks, pl.cdiv(H, bs.block_h)),
      compiler_params=triton_compiler_params(bs.num_warps, bs.num_stages),
      interpret=interpret,
      name=f"ragged_paged_mla_block_q={bs.block_q}_block_h={bs.block_h}",
  )(block_seq, block_idx, cu_q_lens, kv_lens, page_indices, q_latent, q_rope, latent_pages, *scales)


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def ragged_paged_mla_reference(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                               kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                               num_seqs: jax.Array | int, *, sm_scale: float,
                               latent_scale: jax.Array | None = None) -> jax.Array:
  """Plain-jnp reference: each token gathers all its sequence's pages, dense softmax in float32.
  Rows past cu_q_lens[num_seqs] are 0. A quantized cache is dequantized whole first."""
  q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
      jnp.asarray, (q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
  _check_inputs(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, latent_scale)
  if latent_scale is not None:
    groups = latent_pages.reshape(latent_pages.shape[:2] + (latent_scale.shape[2], -1))
    latent_pages = (groups.astype(jnp.float32) * latent_scale[..., None]).reshape(latent_pages.shape)
  T, H, R = q_latent.shape
  _, page_size, L = latent_pages.shape
  S, P = page_indices.shape
  n = P * page_size

  def one_token(t):
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, S - 1)
    kv_len = kv_lens[seq]
    pos = kv_len - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + (t - cu_q_lens[seq])
    lat = latent_pages[jnp.clip(page_indices[seq], 0, latent_pages.shape[0] - 1)]
    lat = lat.reshape(n, L).astype(jnp.float32)
    j = jnp.arange(n)
    visible = (j <= pos) & (j < kv_len)
    lat = jnp.where((j < kv_len)[:, None], lat, 0.0)  # slots past kv_len may hold NaN
    q = jnp.concatenate([q_latent[t], q_rope[t]], -1).astype(jnp.float32)  # [H, L]
    s = jnp.einsum("HL,nL->Hn", q, lat, precision=lax.Precision.HIGHEST) * sm_scale
    w = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    out = jnp.einsum("Hn,nR->HR", w, lat[:, :R], precision=lax.Precision.HIGHEST)
    real = (t < cu_q_lens[jnp.minimum(num_seqs, S)]) & jnp.any(visible)
    return jnp.where(real, out, 0.0)

  return lax.map(one_token, jnp.arange(T, dtype=jnp.int32)).astype(q_latent.dtype)
