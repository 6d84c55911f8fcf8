"""Ragged paged attention: one Pallas (Triton) kernel for decode, verify and prefill.

Shapes (legend):
  T   packed query tokens of all sequences, back to back
  S   sequence slots (the first `num_seqs` are real, the rest padding)
  N   pages in the KV pool, p page_size, P pages per sequence slot
  Hq  query heads, Hkv kv heads, G = Hq / Hkv query heads per kv head
  D   head dim

  q             [T, Hq, D]      new tokens; sequence s owns rows cu_q_lens[s] .. cu_q_lens[s+1]
  k_pages       [N, p, Hkv, D]  (v_pages alike) the paged KV cache, new tokens already written
  kv_lens       [S]     int32   KV length of each sequence, new tokens included
  page_indices  [S, P]  int32   page ids of each sequence, in position order
  cu_q_lens     [S + 1] int32   cumulative query lengths
  num_seqs      []      int32   how many of the S slots are real (may be traced)
  sinks         [Hq]    float32 optional attention sinks (GPT-OSS): one more softmax
                                logit per head, with no value
  k_scale       [N, p, Hkv] float32 (v_scale alike) optional: a quantized cache,
                                int8 / float8_e4m3fn pages whose key j of head h is
                                k_pages[j, h] * k_scale[j, h]
  out           [T, Hq, D]      rows past cu_q_lens[num_seqs] are unspecified

Query i of a sequence with q_len queries sits at position kv_len - q_len + i
and sees KV positions j with j <= its position (and, with a sliding window W,
j > position - W: the convention of jaxinfer.ops.ragged_paged_attention_xla).
One call serves decode (q_len 1), speculative verification (q_len k + 1) and
chunked prefill (q_len up to the chunk) mixed in one batch.

Algorithm. The work is cut into *q blocks*: `block_q` consecutive query tokens
of one sequence (a sequence of q_len tokens owns ceil(q_len / block_q) of
them; a q block never straddles two sequences). The wrapper numbers the q
blocks of the real sequences 0, 1, 2, ... with a few XLA ops on [S]-sized
arrays (a cumulative sum and a search) and hands the kernel, per q block, its
sequence and its index within the sequence; the grid is
(q block upper bound, Hkv), and programs past the real q blocks return at once.
The upper bound min(T, (T + S * (block_q - 1)) // block_q) is static, so the
kernel compiles once per shape however the batch is laid out, and a program
costs nothing but a scalar load when it has no work.

Each program owns the G query heads of one kv head for its block_q tokens:
the q tile is [block_q, G, D] folded to [block_q * G, D] rows (GQA packing),
so every K/V page is read from memory once per kv head and GQA group rather
than G times. It walks the sequence's pages `pages_per_block` at a time,
looking each page id up in page_indices and gathering the pages into a
[pages_per_block * p, D] K tile and V tile, and keeps an online softmax
(FlashAttention-2, Dao 2023, Algorithm 1: running row max m, row sum l,
unnormalised accumulator rescaled by exp(m_old - m_new); one division at the
end). Attention sinks enter as a key already seen before the loop: each row
starts at m = its head's sink, l = 1 and a zero accumulator, so the sink stays
in the denominator through every rescaling and adds nothing to the values (no
sinks: m = -inf, l = 0, as FlashAttention starts). The KV loop starts at the window start of the block's first query (0
without a window) and stops at the causal limit of its last query, so decode
reads exactly the sequence's pages and a prefill block reads only what its
causal triangle needs. Output rows and heads are written with masks: rows
past the sequence's last query and heads past G (G is padded to a power of
two) are never written, and since q blocks partition each sequence's rows
and kv heads partition the heads, no two programs write the same element.

Why the Triton lowering: it runs on any recent NVIDIA GPU (Ampere, Ada,
Hopper, Blackwell), not only on the Hopper and Blackwell parts that Mosaic
GPU targets, and gathers of pages at data-dependent addresses are plain
pointer arithmetic there. A Mosaic GPU variant was not measured because no
GPU was available this session; neither were the default tile sizes below
tuned on one. scripts/check_triton_compile.py compiles the kernel through
Triton to cubin for sm_80/86/90 without a GPU.

Limit: parallelism is (q blocks) x Hkv, and one program walks a sequence's
whole KV. A batch of few long sequences (say one decode at 32k keys, 8 kv
heads: 8 programs) leaves most SMs idle; splitting the KV walk across
programs with a final log-sum-exp merge (flash-decoding) is the remedy, not
done here.

Triton constraints the kernel respects: every loaded or stored tile has
power-of-two dims (block_q, padded G, pages_per_block, p, D), dots are 2-D
with every dim >= 16, slices have static sizes at dynamic offsets, ragged
edges are masked loads/stores, scalars are read from global refs (no scalar
prefetch), and the KV loop is a fori_loop with dynamic bounds (scf.for).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import check_attention_operands, is_pow2, next_pow2
from pallas_kernels._compat import triton_compiler_params


# Bytes of K and V rows per KV iteration when pages_per_block is not given:
# 64 keys at D=128 in bf16 (32 keys in float32). With two pipeline stages the
# kernel then stays within the 99 KiB of shared memory per block of consumer
# GPUs (sm_86/89), as scripts/check_triton_compile.py reports. Untuned.
_DEFAULT_KV_ROW_BYTES = 64 * 2


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the ragged paged attention kernel (None: chosen per call).

  block_q: query tokens per program; a q tile has block_q * next_pow2(G) rows,
    which must be >= 16 (the smallest Triton dot). None: 16 rows when the
    batch is mostly decode (T / S <= 2), 32 when T / S <= 8, else 64.
  pages_per_block: pages gathered per KV loop iteration; pages_per_block * p
    keys must be >= 16. None: 64 keys per iteration for 16-bit caches, 32 for
    float32 (one page if the page is longer).
  num_warps: None picks 4 for q tiles of <= 64 x 64 elements, else 8 (a
    64 x 128 tile on 4 warps needs 255 registers per thread on sm_80).
  num_stages: Triton software pipelining depth. num_warps and num_stages are
    ignored in interpret mode.
  """
  block_q: int | None = None
  pages_per_block: int | None = None
  num_warps: int | None = None
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_q", "pages_per_block"):
      value = getattr(self, name)
      if value is not None and not is_pow2(value):
        raise ValueError(f"BlockSizes.{name}={value} must be a power of two")
    if (self.num_warps is not None and self.num_warps < 1) or self.num_stages < 1:
      raise ValueError(f"{self.num_warps=} and {self.num_stages=} must be >= 1")

  def resolve(self, *, T: int, S: int, G: int, page_size: int, D: int, itemsize: int) -> BlockSizes:
    """These sizes with every None filled in for a call's static shapes; checks the dot sizes."""
    Gp = next_pow2(G)
    block_q = self.block_q
    if block_q is None:
      mean_q_len = T / max(S, 1)
      rows = 16 if mean_q_len <= 2 else 32 if mean_q_len <= 8 else 64
      block_q = max(1, rows // Gp)
    if block_q * Gp < 16:
      raise ValueError(f"{block_q=} x padded G={Gp} rows must be >= 16 (the smallest Triton dot)")
    pages_per_block = self.pages_per_block
    if pages_per_block is None:
      pages_per_block = max(1, _DEFAULT_KV_ROW_BYTES // itemsize // page_size)
    if pages_per_block * page_size < 16:
      raise ValueError(
          f"{pages_per_block=} x {page_size=} keys must be >= 16 (the smallest Triton dot)")
    num_warps = self.num_warps or (4 if block_q * Gp * D <= 64 * 64 else 8)
    return dataclasses.replace(self, block_q=block_q, pages_per_block=pages_per_block,
                               num_warps=num_warps)


def _rpa_kernel(block_seq_ref, block_idx_ref, cu_q_lens_ref, kv_lens_ref, page_indices_ref,
                sinks_ref, q_ref, k_pages_ref, v_pages_ref, *rest, sm_scale: float,
                sliding_window: int | None, soft_cap: float | None, block_q: int,
                pages_per_block: int, num_q_heads_per_kv_head: int, precision, dot_dtype):
  """One q block (block_q tokens of one sequence) x one kv head.

  block_seq_ref, block_idx_ref [num_blocks]: the q block's sequence (-1: none)
  and its index within the sequence. sinks_ref [Hq] float32 (-inf: no sink).
  `rest`: (k_scale_ref, v_scale_ref, o_ref) for a quantized cache, else (o_ref,).
  All refs are whole arrays in global memory; the kernel reads scalars and
  tiles from them at dynamic offsets. The dots run in `dot_dtype`: the cache's
  dtype, or q's for a quantized cache, whose tiles are converted after the load.
  """
  k_scale_ref, v_scale_ref, o_ref = rest if len(rest) == 3 else (None, None) + rest
  T, _, D = q_ref.shape
  N, page_size, _, _ = k_pages_ref.shape
  P = page_indices_ref.shape[1]
  G = num_q_heads_per_kv_head
  Gp = next_pow2(G)
  rows = block_q * Gp
  block_kv = pages_per_block * page_size
  b = pl.program_id(0)
  h = pl.program_id(1)
  seq = block_seq_ref[b]

  @pl.when(seq >= 0)
  def _():
    q_start = cu_q_lens_ref[seq]
    q_end = cu_q_lens_ref[seq + 1]
    kv_len = kv_lens_ref[seq]
    t0 = q_start + block_idx_ref[b] * block_q  # first packed row of this block
    # Guarding against T as well as q_end keeps a malformed cu_q_lens from
    # turning into an out-of-bounds write on the GPU.
    tok = t0 + lax.iota(jnp.int32, block_q)
    tok_ok = (tok < q_end) & (tok < T)
    head_ok = lax.iota(jnp.int32, Gp) < G
    io_mask = jnp.broadcast_to(tok_ok[:, None, None] & head_ok[None, :, None], (block_q, Gp, D))
    io_slice = (pl.ds(t0, block_q), pl.ds(h * G, Gp), slice(None))

    q = plgpu.load(q_ref.at[io_slice], mask=io_mask, other=0)  # [block_q, Gp, D]
    q = q.reshape(rows, D).astype(dot_dtype)
    # Row r of the tile is token r // Gp, head r % Gp of this kv head's group.
    first_pos = kv_len - (q_end - q_start) + (t0 - q_start)
    q_pos = first_pos + lax.div(lax.iota(jnp.int32, rows), jnp.int32(Gp))  # [rows]

    # The block's KV range: from the window start of its first query to the
    # causal limit of its last one (FlashAttention-2 Section 3.1.1: blocks no
    # query can see are skipped, not computed and masked).
    last_pos = first_pos + jnp.minimum(q_end - t0, block_q) - 1
    kv_stop = jnp.clip(last_pos + 1, 0, kv_len)
    if sliding_window is None:
      kv_begin = jnp.int32(0)
    else:
      kv_begin = jnp.maximum(first_pos - sliding_window + 1, 0)

    def kv_block(kb, carry):
      m, l, acc = carry  # [rows], [rows], [rows, D]
      page_no = kb * pages_per_block + lax.iota(jnp.int32, pages_per_block)
      ids = plgpu.load(page_indices_ref.at[seq, pl.ds(kb * pages_per_block, pages_per_block)],
                       mask=page_no < P, other=0)
      # Entries past the sequence's pages may hold anything (their keys are
      # masked below); clamping keeps them, and any bad page table, from
      # addressing memory outside the pool. (Interpret mode clamps gathers by
      # itself, so only the GPU would notice if this line went missing.)
      ids = jnp.clip(ids, 0, N - 1)
      k = k_pages_ref[ids, :, h, :].reshape(block_kv, D).astype(dot_dtype)  # gather [pages_per_block, p, D]
      v = v_pages_ref[ids, :, h, :].reshape(block_kv, D).astype(dot_dtype)
      kv_pos = kb * block_kv + lax.iota(jnp.int32, block_kv)
      kv_ok = kv_pos < kv_len

      s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # [rows, block_kv] f32
      if k_scale_ref is not None:  # each key's own scale: a column scale of the scores
        s = s * k_scale_ref[ids, :, h].reshape(block_kv)[None, :]
      if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
      # kv_pos < kv_len follows for every real row (q_pos < kv_len); rows past
      # the sequence's last query may see NaN slots, but they are never stored.
      visible = kv_pos[None, :] <= q_pos[:, None]
      if sliding_window is not None:
        visible &= kv_pos[None, :] > q_pos[:, None] - sliding_window
      s = jnp.where(visible, s, -jnp.inf)

      m_new = jnp.maximum(m, s.max(axis=1))
      # A row that has seen no visible key yet keeps m = -inf; shifting by 0
      # instead gives it p = 0 and alpha = 0 rather than exp(-inf + inf) = NaN.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe[:, None])
      l = alpha * l + p.sum(axis=1)
      # Cache slots past kv_len may be uninitialised (NaN): p is 0 there, but
      # 0 * NaN is NaN, so those V rows are zeroed before the dot.
      v = jnp.where(kv_ok[:, None], v, jnp.zeros_like(v))
      pv = p
      if v_scale_ref is not None:  # each value row's scale, folded into its probability column
        pv = p * jnp.where(kv_ok, v_scale_ref[ids, :, h].reshape(block_kv), 0.0)[None, :]
      acc = alpha[:, None] * acc + plgpu.dot(pv.astype(v.dtype), v, precision=precision)
      return m_new, l, acc

    # The sinks of this kv head's G query heads, one per row (row r is head r % Gp).
    sink = plgpu.load(sinks_ref.at[pl.ds(h * G, Gp)], mask=head_ok, other=-jnp.inf)  # [Gp]
    m0 = jnp.broadcast_to(sink.astype(jnp.float32)[None, :], (block_q, Gp)).reshape(rows)
    l0 = jnp.where(m0 == -jnp.inf, 0.0, 1.0).astype(jnp.float32)
    init = (m0, l0, jnp.zeros((rows, D), jnp.float32))
    _, l, acc = lax.fori_loop(kv_begin // block_kv, pl.cdiv(kv_stop, block_kv), kv_block, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    plgpu.store(o_ref.at[io_slice], out.reshape(block_q, Gp, D).astype(o_ref.dtype),
                mask=io_mask)


def _schedule(cu_q_lens: jax.Array, num_seqs: jax.Array, block_q: int, num_blocks: int):
  """Numbers the q blocks of the real sequences: (sequence, index within it) per block.

  Blocks past the last real one get sequence -1 (the kernel skips them).
  """
  S = cu_q_lens.shape[0] - 1
  q_lens = jnp.where(jnp.arange(S) < num_seqs, jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0), 0)
  blocks = (q_lens + block_q - 1) // block_q  # [S]
  blocks_end = jnp.cumsum(blocks)  # [S]: one past each sequence's last block
  i = jnp.arange(num_blocks, dtype=jnp.int32)
  seq = jnp.minimum(jnp.searchsorted(blocks_end, i, side="right"), S - 1).astype(jnp.int32)
  idx = i - (blocks_end[seq] - blocks[seq])
  real = i < blocks_end[-1]
  return jnp.where(real, seq, -1), jnp.where(real, idx, 0).astype(jnp.int32)


def _check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                  sliding_window, soft_cap, sinks=None, k_scale=None, v_scale=None):
  if q.ndim != 3:
    raise ValueError(f"q must be [T, Hq, D], got {q.shape=}")
  if k_pages.ndim != 4:
    raise ValueError(f"k_pages must be [N, page_size, Hkv, D], got {k_pages.shape=}")
  if (k_scale is None) != (v_scale is None):
    raise ValueError("k_scale and v_scale come together (a quantized cache scales both)")
  check_attention_operands(q, k_pages, v_pages, "k_pages", "v_pages", quantized=k_scale is not None)
  for name, x in (("k_scale", k_scale), ("v_scale", v_scale)):
    if x is not None and (x.shape != k_pages.shape[:3] or x.dtype != jnp.float32):
      raise ValueError(f"{name} must be float32 [N, page_size, Hkv]={k_pages.shape[:3]}, got {x.shape} {x.dtype}")
  page_size = k_pages.shape[1]
  if not is_pow2(page_size):
    raise ValueError(f"{page_size=} must be a power of two (Triton tiles)")
  for name, x, ndim in (("kv_lens", kv_lens, 1), ("page_indices", page_indices, 2),
                        ("cu_q_lens", cu_q_lens, 1)):
    if x.dtype != jnp.int32:
      raise ValueError(f"{name}.dtype={x.dtype} must be int32")
    if x.ndim != ndim:
      raise ValueError(f"{name} must have {ndim} dims, got {name}.shape={x.shape}")
  S = kv_lens.shape[0]
  if page_indices.shape[0] != S:
    raise ValueError(f"page_indices rows {page_indices.shape[0]} must equal len(kv_lens)={S}")
  if cu_q_lens.shape[0] != S + 1:
    raise ValueError(f"len(cu_q_lens)={cu_q_lens.shape[0]} must be len(kv_lens) + 1 = {S + 1}")
  if num_seqs.ndim != 0 or not jnp.issubdtype(num_seqs.dtype, jnp.integer):
    raise ValueError(f"num_seqs must be an integer scalar, got {num_seqs.shape=} {num_seqs.dtype=}")
  if sliding_window is not None and sliding_window < 1:
    raise ValueError(f"{sliding_window=} must be >= 1")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"{soft_cap=} must be > 0")
  if sinks is not None and (sinks.shape != (q.shape[1],) or not jnp.issubdtype(sinks.dtype, jnp.floating)):
    raise ValueError(f"sinks must be float [Hq]=[{q.shape[1]}], got {sinks.shape=} {sinks.dtype=}")


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "block_sizes", "interpret"))
def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                           num_seqs: jax.Array | int, *, sm_scale: float | None = None,
                           sliding_window: int | None = None, soft_cap: float | None = None,
                           sinks: jax.Array | None = None, block_sizes: BlockSizes | None = None,
                           k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                           interpret: bool = False) -> jax.Array:
  """Causal GQA attention of ragged queries over a paged KV cache (Pallas Triton kernel).

  See the module docstring for shapes and semantics. sm_scale defaults to
  D ** -0.5; soft_cap applies soft_cap * tanh(s / soft_cap) to the scaled
  logits; sliding_window W lets a query see only its last W positions;
  sinks [Hq] adds exp(sinks[h]) to head h's softmax denominator. q may
  differ in dtype from the cache (it is cast to the cache dtype for the dots,
  which accumulate in float32); the result has q's dtype. With k_scale and
  v_scale the int8 / float8 tiles are converted to q's dtype as they are loaded
  and the scales applied to the scores and probabilities. Raises ValueError
  naming the offending arguments for inconsistent shapes or dtypes.
  """
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
      jnp.asarray, (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
  sinks = None if sinks is None else jnp.asarray(sinks)
  scales = () if k_scale is None else (jnp.asarray(k_scale), jnp.asarray(v_scale))
  _check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                sliding_window, soft_cap, sinks, *scales)
  dot_dtype = q.dtype if scales else k_pages.dtype
  T, Hq, D = q.shape
  _, page_size, Hkv, _ = k_pages.shape
  S = kv_lens.shape[0]
  G = Hq // Hkv
  sinks = (jnp.full((Hq,), -jnp.inf, jnp.float32) if sinks is None else sinks.astype(jnp.float32))
  if T == 0 or S == 0:
    return jnp.zeros_like(q)
  bs = (block_sizes or BlockSizes()).resolve(T=T, S=S, G=G, page_size=page_size, D=D,
                                             itemsize=jnp.dtype(dot_dtype).itemsize)
  block_q, pages_per_block = bs.block_q, bs.pages_per_block
  # Each real q block holds >= 1 token, and a sequence wastes < 1 block on rounding.
  num_blocks = min(T, (T + S * (block_q - 1)) // block_q)
  block_seq, block_idx = _schedule(cu_q_lens, num_seqs.astype(jnp.int32), block_q, num_blocks)

  # float32 dots in IEEE precision (Triton's default for f32 is TF32, ~1e-3).
  precision = lax.Precision.HIGHEST if dot_dtype == jnp.float32 else None
  kernel = functools.partial(
      _rpa_kernel, sm_scale=float(D ** -0.5 if sm_scale is None else sm_scale),
      sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
      block_q=block_q, pages_per_block=pages_per_block, num_q_heads_per_kv_head=G,
      precision=precision, dot_dtype=dot_dtype)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      # Axis 0 runs fastest on the GPU: neighbouring programs are the q
      # blocks of one sequence and kv head, which share K/V pages in L2.
      grid=(num_blocks, Hkv),
      compiler_params=triton_compiler_params(bs.num_warps, bs.num_stages),
      interpret=interpret,
      name=f"ragged_paged_attention_{block_q=}_{pages_per_block=}",
  )(block_seq, block_idx, cu_q_lens, kv_lens, page_indices, sinks, q, k_pages, v_pages, *scales)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                     kv_lens: jax.Array, page_indices: jax.Array,
                                     cu_q_lens: jax.Array, num_seqs: jax.Array | int, *,
                                     sm_scale: float | None = None,
                                     sliding_window: int | None = None,
                                     soft_cap: float | None = None,
                                     sinks: jax.Array | None = None,
                                     k_scale: jax.Array | None = None,
                                     v_scale: jax.Array | None = None) -> jax.Array:
  """Plain-jnp reference: each token gathers all its sequence's pages, dense softmax in float32.

  Deliberately naive (one token at a time, every page of the slot gathered,
  no online softmax, no blocking), so it shares no structure with the kernel.
  Sinks are one more column of the scores, dropped after the softmax.
  Rows past cu_q_lens[num_seqs] are 0. A quantized cache (k_scale, v_scale) is
  dequantized whole, in float32, before anything else.
  """
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
      jnp.asarray, (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
  sinks = None if sinks is None else jnp.asarray(sinks)
  _check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                sliding_window, soft_cap, sinks, k_scale, v_scale)
  if k_scale is not None:
    k_pages = k_pages.astype(jnp.float32) * k_scale[..., None]
    v_pages = v_pages.astype(jnp.float32) * v_scale[..., None]
  T, Hq, D = q.shape
  _, page_size, Hkv, _ = k_pages.shape
  S, P = page_indices.shape
  G = Hq // Hkv
  L = P * page_size  # every KV slot a sequence could have
  scale = D ** -0.5 if sm_scale is None else sm_scale

  def one_token(t):
    seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right") - 1, 0, S - 1)
    kv_len = kv_lens[seq]
    pos = kv_len - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + (t - cu_q_lens[seq])
    k = k_pages[page_indices[seq]].reshape(L, Hkv, D).astype(jnp.float32)
    v = v_pages[page_indices[seq]].reshape(L, Hkv, D).astype(jnp.float32)
    j = jnp.arange(L)
    v = jnp.where((j < kv_len)[:, None, None], v, 0.0)  # slots past kv_len may hold NaN
    qt = q[t].astype(jnp.float32).reshape(Hkv, G, D)
    s = jnp.einsum("KGD,LKD->KGL", qt, k, precision=lax.Precision.HIGHEST) * scale
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    visible = (j <= pos) & (j < kv_len)
    if sliding_window is not None:
      visible &= j > pos - sliding_window
    s = jnp.where(visible, s, -jnp.inf)
    if sinks is None:
      w = jax.nn.softmax(s, axis=-1)
    else:
      sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(Hkv, G, 1), (Hkv, G, 1))
      w = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("KGL,LKD->KGD", w, v, precision=lax.Precision.HIGHEST).reshape(Hq, D)
    real = (t < cu_q_lens[jnp.minimum(num_seqs, S)]) & jnp.any(visible)
    return jnp.where(real, out, 0.0)

  out = lax.map(one_token, jnp.arange(T, dtype=jnp.int32))
  return out.astype(q.dtype)
