"""Ragged paged attention on Pallas Mosaic GPU (Hopper, sm_90a): TMA page loads, wgmma, online softmax.

Same signature, semantics and reference as `pallas_kernels.ragged_paged_attention`
(the Triton kernel; its module docstring has the shapes and the position
convention). This is its successor on jax >= 0.11, where the Pallas Triton
backend is deprecated.

Shapes (legend, as in ragged_paged_attention.py):
  T packed query tokens, S sequence slots, N pages, p page_size, P pages per
  slot, Hq / Hkv query / kv heads, G = Hq / Hkv, D head dim,
  R = 64 rows of a q tile (the wgmma M), block_q = R / G tokens per q tile,
  block_kv = pages_per_block * p keys per KV step.

  k_scale, v_scale [N, p, Hkv] float32: a quantized (int8 / float8_e4m3fn) cache,
  key j of head h is k_pages[j, h] * k_scale[j, h] (the kernel reads them
  head-major, [N, Hkv, p], transposed by the wrapper).

Work split. As in the Triton kernel, the wrapper numbers the q blocks (block_q
consecutive tokens of one sequence) and the grid is (q block bound, Hkv), or
(q block bound, Hkv, kv_splits) with split-KV; a program past the real q
blocks returns at once. A program's q tile is its block_q tokens x the G
query heads of its kv head, [block_q * G, D] = [R, D]
(GQA packing: each K/V page is read once per kv head, not G times). A decode
row uses G of the 64 rows; the tensor cores idle on the rest, which costs
nothing measurable at decode, where the kernel waits on memory (a 64 x 64 x
128 wgmma is ~0.1 us per SM, the 32 KiB of K and V behind it ~0.9 us at an
H200's ~4.8 TB/s shared by 132 SMs).

Pipeline. One warpgroup per program by default (a second, producer one with
BlockSizes.warp_specialized, below). K and V tiles live in `num_stages`
shared-memory slots, [num_stages, block_kv, D] each, tiled (8, 64) and
swizzled 128 B (the layout wgmma reads). Step i of the KV walk waits on slot
i % num_stages, computes, and then refills the slot with step i + num_stages:
one TMA copy per page (k_pages[page, :, h, :] is a strided [p, D] box), all
pages of a step arriving on one barrier (`num_arrivals = pages_per_block`).
Pages past the block's causal limit are not fetched: the program arrives on
the barrier in their place, so the barrier's count is static while the bytes
are not. While a step computes, the next num_stages - 1 steps are in flight.
With warp specialization the producer warpgroup issues every copy and
refills a slot once the consumer arrives on that slot's `consumed` barrier,
so all num_stages steps can be in flight and the page-id loads leave the
compute path.

Per step (FlashAttention-2, Dao 2023, Algorithm 1; scores in float32):
  s = q @ k^T (wgmma, q and K from shared memory) * sm_scale, soft-capped,
  masked to the causal (and sliding-window) range; running max m and sum l,
  acc rescaled by exp(m_old - m_new); p = exp(s - m) rounded to the dots'
  dtype (the cache's, or q's with a quantized cache), written to shared
  memory and multiplied by V (wgmma). One division at
  the end. Sinks (GPT-OSS) start a row at m = sink, l = 1, as in the Triton
  kernel. The block's last step zeroes the V rows past its causal limit in
  shared memory before its PV wgmma: slots past kv_len may hold anything (NaN
  in the tests), pages past the limit were not fetched (the slot holds an
  older step's or uninitialised data), and p = 0 does not cancel NaN.

Quantized caches (int8 / float8_e4m3fn with float32 scales per token and kv
head). The pages cross HBM and TMA at one byte per element into 8-bit slots;
each step converts its K and V tiles in registers to q's dtype (exact: int8
and e4m3 values fit bf16 and f16) and stores them into one swizzled 16-bit
tile each, which wgmma reads. The scales ride the same barriers as their pages
(p floats per page and head, one TMA box) and are applied as the Triton kernel
applies them: each key's scale multiplies its column of the scores (before
the soft cap), each value row's scale its column of p before p is rounded for
the PV wgmma, while l sums the unscaled p. V rows past kv_stop are zeroed
while converting and their scales replaced by 0 (fp8 slots past kv_len may be
NaN). The 8-bit slot is refilled (or handed to the producer) as soon as both
tiles are converted, before the PV wgmma.

Why q and p go through shared memory: GPU interpret mode (what the tests run
on a CPU) only simulates wgmma with both operands in shared memory; wgmma can
read its A operand from registers on the GPU, which would save the 8 KiB p
store per step. q is TMA-copied token by token into an untiled [R, D] buffer
(a token's G heads are G rows; G < 8 rows do not fill a swizzle tile), then
moved through registers into the swizzled buffer wgmma reads; the output
leaves through the untiled buffer the same way, token by token, only rows of
real tokens written.

Covered: bf16 / f16 caches (q is cast to the cache dtype), int8 / float8_e4m3fn
caches with k_scale / v_scale and a bf16 / f16 q, any mix of decode,
verify and prefill rows (ragged cu_q_lens; a prefill block reads only its
causal range), GQA with G dividing 64, D a multiple of 64 up to 256, pages of
>= 8 tokens with block_kv a multiple of 64 up to 256, sliding window, soft cap,
sinks; optionally a producer warpgroup (BlockSizes.warp_specialized) and
split-KV (BlockSizes.kv_splits: each q block's KV range in C parts merged by
log-sum-exp, so that few long sequences fill the SMs). Not covered
(NotImplementedError; jaxinfer.ops 'mosaic' falls back to the Triton kernel):
float32 caches, a quantized cache with a float32 q, other G, D and page
sizes (D = 32: the [64, 32] PV wgmma fails Mosaic GPU's layout inference in
jax 0.11.2). Not done: P kept in registers, a split count chosen per batch (the
caller picks kv_splits statically), scales stored head-major by the cache
itself (the wrapper's transpose moves the whole scale pool each call, 8 / D of
the 8-bit pool's bytes; the kernel reads only the sequences' pages), fp8 x fp8
wgmmas with q quantized (the conversion above keeps q exact).

The scalar metadata (q block schedule, cu_q_lens, kv_lens, page ids) is read
from global memory as scalars; a page id is read right before its copy is
issued. Untuned: no GPU was available when this was written.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.ragged_paged_attention import _check_inputs, _schedule
from pallas_kernels._common import is_pow2

try:  # jax >= 0.11: Mosaic GPU with GPU interpret mode
  from jax.experimental.pallas import mosaic_gpu as plgpu
  MOSAIC_AVAILABLE = hasattr(plgpu, "InterpretGPUParams")
except ImportError:  # pragma: no cover - jax builds without Mosaic GPU
  plgpu = None
  MOSAIC_AVAILABLE = False

ROWS = 64  # rows of a q tile: the M of one wgmma
_DEFAULT_BLOCK_KV = 64


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes of the Mosaic GPU kernel.

  pages_per_block: pages per KV step; block_kv = pages_per_block * page_size
    keys must be a multiple of 64 and <= 256. None: 64 keys (one page if the
    page is longer).
  num_stages: shared-memory slots for K and V tiles (>= 2). Shared memory per
    program is about num_stages * 2 * block_kv * D * 2 B + 40 KiB at D = 128
    (2 stages: 104 KiB, two programs per H100/H200 SM).
    A quantized cache halves the slots (8-bit) and adds one 16-bit K and V
    tile for the converted step (2 stages at D = 128: 105 KiB as well).
  warp_specialized: False: one warpgroup computes and, after each step,
    refills the slot it has just used (num_stages - 1 steps in flight while it
    computes; the page ids' global loads sit on its path). True: a second,
    producer warpgroup issues every copy and refills a slot as soon as the
    consumer warpgroup arrives on that slot's `consumed` barrier (all
    num_stages slots in flight; FlashAttention-3, Shah et al. 2024, Section
    3.1, producer-consumer warp specialization).
  kv_splits: C > 1 cuts each q block's KV range into C parts, one program
    each (grid (q blocks, Hkv, C)), so that a few long sequences still fill
    the SMs (flash-decoding); each part writes its normalised output and
    log-sum-exp in float32 and a few XLA ops merge them. Needs G >= 4 (a
    token's G log-sum-exps, 4 G bytes, are one TMA store of >= 16 bytes).
  """
  pages_per_block: int | None = None
  num_stages: int = 2
  warp_specialized: bool = False
  kv_splits: int = 1

  def __post_init__(self):
    if self.pages_per_block is not None and self.pages_per_block < 1:
      raise ValueError(f"BlockSizes.pages_per_block={self.pages_per_block} must be >= 1")
    if self.num_stages < 2:
      raise ValueError(f"BlockSizes.num_stages={self.num_stages} must be >= 2")
    if self.kv_splits < 1:
      raise ValueError(f"BlockSizes.kv_splits={self.kv_splits} must be >= 1")

  def resolve(self, page_size: int) -> BlockSizes:
    ppb = self.pages_per_block or max(1, _DEFAULT_BLOCK_KV // page_size)
    block_kv = ppb * page_size
    if block_kv % 64 or block_kv > 256:
      raise NotImplementedError(
          f"pages_per_block={ppb} x page_size={page_size} = {block_kv} keys per step must be a "
          "multiple of 64 and <= 256 (the wgmma N of the scores)")
    return dataclasses.replace(self, pages_per_block=ppb)


def dtype_reason(kv_dtype, quantized: bool, q_dtype) -> str | None:
  """Why wgmma cannot take these dtypes (None: it can); shared with the MLA kernel.

  An unquantized cache's own dtype is the dots' (q is cast to it); a quantized
  (int8 / float8_e4m3fn) cache's tiles convert to q's dtype."""
  wgmma_dtypes = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
  if quantized:
    if jnp.dtype(kv_dtype) not in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)):
      return f"quantized cache dtype {jnp.dtype(kv_dtype).name}: int8 / float8_e4m3fn only"
    if jnp.dtype(q_dtype) not in wgmma_dtypes:
      return (f"q dtype {jnp.dtype(q_dtype).name} with a quantized cache: the tiles convert to q's "
              "dtype, and wgmma here takes bfloat16 / float16 only")
  elif jnp.dtype(kv_dtype) not in wgmma_dtypes:
    return f"cache dtype {jnp.dtype(kv_dtype).name}: wgmma here takes bfloat16 / float16 only"
  return None


def swizzled(dt, cols: int):
  """Shared-memory transforms for a tile whose rows are `cols` elements of dtype dt: 8-row
  tiles with the widest swizzle a row fills (128 B for 16-bit rows of >= 64), the layout
  TMA writes and wgmma reads."""
  bits = jnp.dtype(dt).itemsize * 8
  swizzle = plgpu.find_swizzle(cols * bits)
  return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def upcast(ref, dtype):
  """An 8-bit tile in shared memory -> registers in `dtype` (bf16 / f16), WGMMA layout.

  The values convert exactly (int8 and e4m3 fit bf16 / f16); the scales are the
  caller's to apply. WGMMA_UPCAST_2X: 32-bit shared-memory loads of 4 bytes, one
  warp shuffle to WGMMA.
  """
  x = plgpu.load(ref, layout=plgpu.Layout.WGMMA_UPCAST_2X)
  if x.dtype == jnp.float8_e4m3fn and dtype == jnp.bfloat16:
    x = x.astype(jnp.float16)  # sm_90 converts e4m3 to f16 only; f16 -> bf16 is exact here
  return plgpu.layout_cast(x.astype(dtype), plgpu.Layout.WGMMA)


class BlockRange(NamedTuple):
  """One q block's place in its sequence and the KV steps one program walks for it."""
  t0: jax.Array         # the block's first packed token
  q_end: jax.Array      # one past its sequence's last packed token
  first_pos: jax.Array  # the position of token t0
  kv_stop: jax.Array    # one past the last key any of its tokens sees
  kb0: jax.Array        # the first KV block (of block_kv keys) this program reads
  n_steps: jax.Array    # how many KV blocks it reads


def block_range(seq, block_idx, c, cu_q_lens_ref, kv_lens_ref, *, block_q: int, block_kv: int,
                sliding_window: int | None, kv_splits: int) -> BlockRange:
  """Where q block `block_idx` of sequence `seq` sits, and split c's part of its KV range.

  The block's KV range runs from the window start of its first query to the
  causal limit of its last (FlashAttention-2 Section 3.1.1: skipped, not
  masked); split c of kv_splits walks steps [c * per, (c + 1) * per) of it,
  per = ceil(steps / kv_splits). Shared with the MLA kernel.
  """
  q_start = cu_q_lens_ref[seq]
  q_end = cu_q_lens_ref[seq + 1]
  kv_len = kv_lens_ref[seq]
  t0 = q_start + block_idx * block_q
  first_pos = kv_len - (q_end - q_start) + (t0 - q_start)
  last_pos = first_pos + jnp.minimum(q_end - t0, block_q) - 1
  kv_stop = jnp.clip(last_pos + 1, 0, kv_len)
  kv_begin = (jnp.int32(0) if sliding_window is None
              else jnp.maximum(first_pos - sliding_window + 1, 0))
  all_steps = jnp.maximum(pl.cdiv(kv_stop, block_kv) - kv_begin // block_kv, 0)
  per_split = pl.cdiv(all_steps, kv_splits)
  kb0 = kv_begin // block_kv + c * per_split
  n_steps = jnp.clip(all_steps - c * per_split, 0, per_split)
  return BlockRange(t0, q_end, first_pos, kv_stop, kb0, n_steps)


@dataclasses.dataclass(frozen=True)
class Ring:
  """The ring of num_stages shared-memory slots that KV step i uses slot i % num_stages of.

  fetch(step, slot) issues step's copies into slot. Without a producer
  warpgroup (consumed_bar None) the computing warpgroup fetches the first
  num_stages steps and refills a slot itself once a step is done with it
  (num_stages - 1 steps in flight while it computes). With one, the producer
  (`produce`) issues every copy and refills a slot as soon as the consumer
  arrives on its `consumed` barrier (`release`): all num_stages in flight.
  Shared with the MLA kernel.
  """
  fetch: Callable
  n_steps: jax.Array
  num_stages: int
  consumed_bar: object = None

  def fetch_first_steps(self):
    for i in range(self.num_stages):
      pl.when(i < self.n_steps)(functools.partial(self.fetch, i, i))

  def release(self, step, slot):
    """Step's slot is used up: refill it with step + num_stages, or let the producer."""
    if self.consumed_bar is not None:
      plgpu.barrier_arrive(self.consumed_bar.at[slot])
    else:
      pl.when(step + self.num_stages < self.n_steps)(
          functools.partial(self.fetch, step + self.num_stages, slot))

  def produce(self):
    """The producer warpgroup: refill each slot as soon as the consumer is done with it."""
    S = self.num_stages
    self.fetch_first_steps()

    @pl.loop(S, jnp.maximum(self.n_steps, S))
    def _(step):
      slot = lax.rem(step, jnp.int32(S))
      plgpu.barrier_wait(self.consumed_bar.at[slot])
      self.fetch(step, slot)

    # Observe the consumer's last arrival on each slot too: every completed
    # phase of a barrier is waited for (GPU interpret mode checks it).
    @pl.loop(jnp.maximum(self.n_steps, S), self.n_steps + S)
    def _(step):
      plgpu.barrier_wait(self.consumed_bar.at[lax.rem(step, jnp.int32(S))])


def unsupported_reason(q_shape, kv_shape, kv_dtype, *, quantized: bool = False,
                       q_dtype=jnp.bfloat16) -> str | None:
  """Why the kernel cannot take these operands (None: it can). Shapes and dtypes only, no data.

  q_shape [T, Hq, D], kv_shape [N, p, Hkv, D]; quantized: the cache comes with
  k_scale / v_scale, and its tiles convert to q_dtype for the dots (an
  unquantized cache's own dtype is the dots', q is cast to it). jaxinfer.ops
  uses this to fall back to the Triton kernel.
  """
  if not MOSAIC_AVAILABLE:
    return "Mosaic GPU with interpret mode needs jax >= 0.11"
  _, Hq, D = q_shape
  _, page_size, Hkv, _ = kv_shape
  reason = dtype_reason(kv_dtype, quantized, q_dtype)
  if reason:
    return reason
  if Hq % Hkv or ROWS % (Hq // Hkv):
    return f"G = Hq / Hkv = {Hq}/{Hkv} must divide {ROWS} (the q tile's rows)"
  if D % 64 or D > 256:
    return f"head dim {D} must be a multiple of 64 (one 128-byte swizzle row) and <= 256"
  if page_size % 8 or not is_pow2(page_size) or page_size > 256:
    return f"page_size {page_size} must be a power of two in [8, 256] (8-row smem tiles)"
  return None


def _rpa_kernel(block_seq_ref, block_idx_ref, cu_q_lens_ref, kv_lens_ref, page_indices_ref,
                sink_rows_ref, q_ref, k_pages_ref, v_pages_ref, *refs, sm_scale: float,
                sliding_window: int | None, soft_cap: float | None, pages_per_block: int,
                num_stages: int, warp_specialized: bool, kv_splits: int, quantized: bool):
  """One q block (block_q tokens of one sequence) x one kv head (x one KV split).

  refs: with a quantized cache first k_scale_ref, v_scale_ref [N, Hkv, p]
  float32 (the cache's scales, head-major so that a page's scales of one head
  are one contiguous TMA box); then the outputs, then the scratch. One split:
  o_ref [T, Hkv, G, D] in the dot dtype (the cache's, or q's for a quantized
  cache). kv_splits C > 1: o_ref [C, T, Hkv, G, D] float32, each split's
  own softmax-normalised output, and lse_ref [C, T, Hkv, G] float32, its
  log-sum-exp (-inf: no key); the wrapper merges them. Split c walks steps
  [c * per, (c + 1) * per) of the block's KV range, per = ceil(steps / C).

  q_ref, o_ref [T, Hkv, G, D]; sink_rows_ref [Hkv, R] float32: row r of kv head
  h holds sinks[h * G + r % G] (-inf: none). Scratch: q_raw [R, D] untiled
  (q in, out out), q_smem [R, D] and p_smem [R, block_kv] swizzled, k_smem /
  v_smem [num_stages, block_kv, D] swizzled, sink_smem [R] float32.
  consumed_bar [num_stages] (used when warp-specialized): the consumer
  warpgroup arrives when it is done with a slot, the producer waits on it
  before refilling the slot. With splits also o32_smem [R, D] and lse_smem [R]
  float32, untiled. Quantized: k_smem / v_smem hold the 8-bit pages, and the
  scratch ends with kd_smem / vd_smem [block_kv, D] swizzled in the dot dtype
  (the step's tiles, dequantized) and ks_smem / vs_smem [num_stages, block_kv]
  float32 (the step's scales, arriving on k_bar / v_bar with their pages).
  """
  k_scale_ref = v_scale_ref = None
  if quantized:
    k_scale_ref, v_scale_ref, *refs = refs
    *refs, kd_smem, vd_smem, ks_smem, vs_smem = refs
  if kv_splits == 1:
    (o_ref, q_raw, q_smem, p_smem, k_smem, v_smem, sink_smem, q_bar, k_bar, v_bar, sink_bar,
     consumed_bar) = refs
  else:
    (o_ref, lse_ref, q_raw, q_smem, p_smem, k_smem, v_smem, sink_smem, q_bar, k_bar, v_bar,
     sink_bar, consumed_bar, o32_smem, lse_smem) = refs
  T, _, G, D = q_ref.shape
  N, page_size, _, _ = k_pages_ref.shape
  P = page_indices_ref.shape[1]
  block_q = ROWS // G
  block_kv = pages_per_block * page_size
  dtype = q_smem.dtype  # the dots' operand dtype
  b = lax.axis_index("b")
  h = lax.axis_index("h")
  c = lax.axis_index("c") if kv_splits > 1 else 0
  seq = block_seq_ref[b]

  @pl.when(seq >= 0)
  def _():
    t0, q_end, first_pos, kv_stop, kb0, n_steps = block_range(
        seq, block_idx_ref[b], c, cu_q_lens_ref, kv_lens_ref, block_q=block_q, block_kv=block_kv,
        sliding_window=sliding_window, kv_splits=kv_splits)

    def token_ok(i):  # guarding T too keeps a malformed cu_q_lens from writing out of bounds
      return (t0 + i < q_end) & (t0 + i < T)

    def load_q():
      """TMA the block's tokens (G rows each) and its rows' sinks; every copy or stand-in is one arrival."""
      for i in range(block_q):
        @pl.when(token_ok(i))
        def _():
          plgpu.copy_gmem_to_smem(q_ref.at[t0 + i, h], q_raw.at[pl.ds(i * G, G)], q_bar)

        @pl.when(~token_ok(i))
        def _():
          plgpu.barrier_arrive(q_bar)
      plgpu.copy_gmem_to_smem(sink_rows_ref.at[c, h], sink_smem, sink_bar)

    copies_per_page = 2 if quantized else 1  # on each of k_bar, v_bar: the page (and its scales)

    def fetch(step, slot):
      """TMA the pages of KV step `step` (relative to kb0) into `slot`."""
      for j in range(pages_per_block):
        page_no = (kb0 + step) * pages_per_block + j
        needed = page_no * page_size < kv_stop

        @pl.when(needed)
        def _():
          # Clamped: a bad page table must not address memory outside the pool.
          page = jnp.clip(page_indices_ref[seq, jnp.minimum(page_no, P - 1)], 0, N - 1)
          rows = pl.ds(j * page_size, page_size)
          plgpu.copy_gmem_to_smem(k_pages_ref.at[page, :, h, :], k_smem.at[slot, rows], k_bar.at[slot])
          plgpu.copy_gmem_to_smem(v_pages_ref.at[page, :, h, :], v_smem.at[slot, rows], v_bar.at[slot])
          if quantized:  # p float32 scales, one contiguous box of >= 32 bytes (p >= 8)
            plgpu.copy_gmem_to_smem(k_scale_ref.at[page, h], ks_smem.at[slot, rows], k_bar.at[slot])
            plgpu.copy_gmem_to_smem(v_scale_ref.at[page, h], vs_smem.at[slot, rows], v_bar.at[slot])

        @pl.when(~needed)
        def _():
          for _ in range(copies_per_page):
            plgpu.barrier_arrive(k_bar.at[slot])
            plgpu.barrier_arrive(v_bar.at[slot])

    ring = Ring(fetch, n_steps, num_stages, consumed_bar if warp_specialized else None)

    def consume():
      """The computing warpgroup (the only one without warp specialization)."""
      load_q()
      if not warp_specialized:
        ring.fetch_first_steps()
      compute()

    def compute():
      plgpu.barrier_wait(q_bar)
      q_smem[...] = plgpu.load(q_raw, layout=plgpu.Layout.WGMMA)
      plgpu.commit_smem()  # generic-proxy stores, then async-proxy (wgmma) reads

      layout = plgpu.Layout.WGMMA
      row = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0, layout=layout)
      col = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=layout)
      q_pos = first_pos + lax.div(row, jnp.int32(G))  # row r is token r // G, head r % G

      plgpu.barrier_wait(sink_bar)
      m0 = plgpu.load(sink_smem, layout=layout.reduce(1))  # [R]
      l0 = jnp.where(m0 == -jnp.inf, 0.0, 1.0).astype(jnp.float32)
      acc0 = plgpu.layout_cast(jnp.zeros((ROWS, D), jnp.float32), layout)

      # The scales are applied to the scores and probabilities in float32, as the Triton kernel does.
      dequantize = functools.partial(upcast, dtype=dtype)

      release = ring.release

      def kv_step(step, carry):
        acc, m, l = carry
        slot = lax.rem(step, jnp.int32(num_stages))
        kv_pos = (kb0 + step) * block_kv + col  # [R, block_kv]
        plgpu.barrier_wait(k_bar.at[slot])
        k_tile = k_smem.at[slot]
        if quantized:
          kd_smem[...] = dequantize(k_tile)
          plgpu.commit_smem()
          k_tile = kd_smem

        def scores(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_tile.T)
          return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS, block_kv), jnp.float32)) * sm_scale
        if quantized:  # each key's scale: a column scale of the scores
          k_scale = plgpu.load(ks_smem.at[slot], layout=layout.reduce(0))  # [block_kv]
          s = s * lax.broadcast_in_dim(k_scale, s.shape, [1])
        if soft_cap is not None:
          s = soft_cap * jnp.tanh(s / soft_cap)
        visible = kv_pos <= q_pos
        if sliding_window is not None:
          visible &= kv_pos > q_pos - sliding_window
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        # A row with no visible key yet keeps m = -inf: shifting by 0 gives p = 0, alpha = 0.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        v_tile = v_smem.at[slot]
        if not quantized:
          p_smem[...] = p.astype(dtype)

        plgpu.barrier_wait(v_bar.at[slot])
        v_first = (kb0 + step) * block_kv  # the step's first key
        if quantized:
          # Rows past kv_stop (past kv_len: NaN in an fp8 cache; or not fetched)
          # become 0 on the way to vd_smem: p = 0 does not cancel NaN. A select per
          # element, on every step (a no-op but the last), costs less than a branch.
          v = dequantize(v_tile)
          v_row = plgpu.broadcasted_iota(jnp.int32, (block_kv, D), 0, layout=layout)
          vd_smem[...] = jnp.where(v_first + v_row < kv_stop, v, jnp.zeros_like(v))
          # Each value row's scale folds into its probability column (0 past kv_stop,
          # where scales may be NaN or stale); l keeps the unscaled p.
          v_scale = plgpu.load(vs_smem.at[slot], layout=layout.reduce(0))  # [block_kv]
          v_scale = jnp.where(kv_pos < kv_stop, lax.broadcast_in_dim(v_scale, p.shape, [1]), 0.0)
          p_smem[...] = (p * v_scale).astype(dtype)
          plgpu.commit_smem()  # also a warpgroup barrier: every thread has read the slot
          release(step, slot)  # the 8-bit slot is used up: its next pages load during the wgmmas
          v_tile = vd_smem
        else:
          @pl.when((kb0 + step + 1) * block_kv > kv_stop)
          def _():  # the block's last step: V rows past kv_stop (past kv_len, or not fetched) become 0
            v_row = plgpu.broadcasted_iota(jnp.int32, (block_kv, D), 0, layout=layout)
            v = v_tile[...]
            v_tile[...] = jnp.where(v_first + v_row < kv_stop, v, jnp.zeros_like(v))

          plgpu.commit_smem()

        def values(acc_ref):
          plgpu.wgmma(acc_ref, p_smem, v_tile)
          return acc_ref[...]

        acc = acc + pl.run_scoped(values, plgpu.ACC((ROWS, D), jnp.float32))
        if not quantized:  # the slot's wgmmas are done (their results were read)
          release(step, slot)
        return acc, m_new, l

      acc, m, l = lax.fori_loop(0, n_steps, kv_step, (acc0, m0, l0))
      out = acc / lax.broadcast_in_dim(jnp.where(l > 0, l, 1.0), acc.shape, [0])
      if kv_splits == 1:
        q_raw[...] = out.astype(dtype)
      else:
        o32_smem[...] = out
        # A row that saw no key (an empty split) gets -inf: weight 0 in the merge.
        lse_smem[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
      plgpu.commit_smem()
      for i in range(block_q):
        @pl.when(token_ok(i))
        def _():
          if kv_splits == 1:
            plgpu.copy_smem_to_gmem(q_raw.at[pl.ds(i * G, G)], o_ref.at[t0 + i, h])
          else:
            plgpu.copy_smem_to_gmem(o32_smem.at[pl.ds(i * G, G)], o_ref.at[c, t0 + i, h])
            plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(i * G, G)], lse_ref.at[c, t0 + i, h])
      plgpu.wait_smem_to_gmem(0)

    if warp_specialized:
      wg = lax.axis_index("wg")
      pl.when(wg == 0)(consume)
      pl.when(wg == 1)(ring.produce)
    else:
      consume()


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap",
                                             "block_sizes", "interpret"))
def ragged_paged_attention_mgpu(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                                num_seqs: jax.Array | int, *, sm_scale: float | None = None,
                                sliding_window: int | None = None, soft_cap: float | None = None,
                                sinks: jax.Array | None = None,
                                block_sizes: BlockSizes | None = None,
                                k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                                interpret: bool | object = False) -> jax.Array:
  """Causal GQA attention of ragged queries over a paged KV cache (Pallas Mosaic GPU kernel).

  Arguments and result as `pallas_kernels.ragged_paged_attention`. interpret:
  True runs the kernel in Mosaic GPU interpret mode on the CPU (jax >= 0.11);
  a `plgpu.InterpretGPUParams` does so with those settings (race detection,
  say). Raises
  ValueError for inconsistent operands (the Triton kernel's checks) and
  NotImplementedError for operands this kernel does not cover
  (`unsupported_reason`).
  """
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
      jnp.asarray, (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
  sinks = None if sinks is None else jnp.asarray(sinks)
  scales = () if k_scale is None else (jnp.asarray(k_scale), jnp.asarray(v_scale))
  _check_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                sliding_window, soft_cap, sinks, *scales)
  reason = unsupported_reason(q.shape, k_pages.shape, k_pages.dtype, quantized=bool(scales),
                              q_dtype=q.dtype)
  if reason:
    raise NotImplementedError(f"ragged_paged_attention_mgpu: {reason}")
  T, Hq, D = q.shape
  _, page_size, Hkv, _ = k_pages.shape
  S = kv_lens.shape[0]
  G = Hq // Hkv
  if T == 0 or S == 0:
    return jnp.zeros_like(q)
  bs = (block_sizes or BlockSizes()).resolve(page_size)
  if bs.kv_splits > 1 and G < 4:
    raise NotImplementedError(f"kv_splits={bs.kv_splits} needs G = Hq / Hkv >= 4, got {G} "
                              "(each token's G log-sum-exps leave in one TMA store of >= 16 bytes)")
  block_q = ROWS // G
  block_kv = bs.pages_per_block * page_size
  num_blocks = min(T, (T + S * (block_q - 1)) // block_q)
  block_seq, block_idx = _schedule(cu_q_lens, num_seqs.astype(jnp.int32), block_q, num_blocks)
  # The dots' operand dtype: the cache's, or q's for a quantized cache (whose tiles convert to it).
  dtype = q.dtype if scales else k_pages.dtype
  sink_heads = (jnp.full((Hq,), -jnp.inf, jnp.float32) if sinks is None
                else sinks.astype(jnp.float32))
  # Row r of kv head h's tile is query head h * G + r % G.
  sink_rows = jnp.tile(sink_heads.reshape(Hkv, G), (1, block_q))  # [Hkv, R]
  # The sink is one logit of the whole softmax: only split 0 starts from it.
  C = bs.kv_splits
  sink_rows = jnp.concatenate([sink_rows[None], jnp.full((C - 1, Hkv, ROWS), -jnp.inf)])  # [C, Hkv, R]

  arrivals = bs.pages_per_block * (2 if scales else 1)  # a page, and its scales if quantized
  scratch = [
      plgpu.SMEM((ROWS, D), dtype),  # q_raw
      plgpu.SMEM((ROWS, D), dtype, transforms=swizzled(dtype, D)),  # q_smem
      plgpu.SMEM((ROWS, block_kv), dtype, transforms=swizzled(dtype, block_kv)),  # p_smem
      plgpu.SMEM((bs.num_stages, block_kv, D), k_pages.dtype,
                 transforms=swizzled(k_pages.dtype, D)),  # k_smem
      plgpu.SMEM((bs.num_stages, block_kv, D), k_pages.dtype,
                 transforms=swizzled(k_pages.dtype, D)),  # v_smem
      plgpu.SMEM((ROWS,), jnp.float32),  # sink_smem
      plgpu.Barrier(num_arrivals=block_q),  # q_bar: one arrival per token slot
      plgpu.Barrier(num_arrivals=arrivals, num_barriers=bs.num_stages),  # k_bar
      plgpu.Barrier(num_arrivals=arrivals, num_barriers=bs.num_stages),  # v_bar
      plgpu.Barrier(num_arrivals=1),  # sink_bar
      plgpu.Barrier(num_arrivals=1, num_barriers=bs.num_stages),  # consumed_bar
  ]
  out_type = jax.ShapeDtypeStruct((T, Hkv, G, D), dtype)
  if C > 1:
    scratch += [plgpu.SMEM((ROWS, D), jnp.float32), plgpu.SMEM((ROWS,), jnp.float32)]
    out_type = (jax.ShapeDtypeStruct((C, T, Hkv, G, D), jnp.float32),
                jax.ShapeDtypeStruct((C, T, Hkv, G), jnp.float32))
  if scales:
    scratch += [plgpu.SMEM((block_kv, D), dtype, transforms=swizzled(dtype, D)),  # kd_smem
                plgpu.SMEM((block_kv, D), dtype, transforms=swizzled(dtype, D)),  # vd_smem
                plgpu.SMEM((bs.num_stages, block_kv), jnp.float32),  # ks_smem
                plgpu.SMEM((bs.num_stages, block_kv), jnp.float32)]  # vs_smem
    # Head-major [N, Hkv, p]: a page's scales of one head become one contiguous
    # TMA box (TMA boxes need a contiguous innermost dim of >= 16 bytes; in the
    # cache's [N, p, Hkv] they are Hkv floats apart). A transpose of the whole
    # scale pool per call, 8 / D of the 8-bit pool's bytes moved: see "Not done".
    scales = tuple(x.transpose(0, 2, 1) for x in scales)
  kernel = functools.partial(
      _rpa_kernel, sm_scale=float(D ** -0.5 if sm_scale is None else sm_scale),
      sliding_window=sliding_window, soft_cap=None if soft_cap is None else float(soft_cap),
      pages_per_block=bs.pages_per_block, num_stages=bs.num_stages,
      warp_specialized=bs.warp_specialized, kv_splits=C, quantized=bool(scales))
  out = plgpu.kernel(
      kernel,
      out_type=out_type,
      grid=(num_blocks, Hkv) + ((C,) if C > 1 else ()),
      grid_names=("b", "h") + (("c",) if C > 1 else ()),
      num_threads=2 if bs.warp_specialized else None,
      thread_name="wg" if bs.warp_specialized else None,
      scratch_types=scratch,
      interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                 else plgpu.InterpretGPUParams() if interpret else None),
      kernel_name=f"ragged_paged_attention_mgpu_q{block_q}_kv{block_kv}",
  )(block_seq, block_idx, cu_q_lens, kv_lens, page_indices, sink_rows,
    q.astype(dtype).reshape(T, Hkv, G, D), k_pages, v_pages, *scales)
  if C > 1:
    out = _merge_splits(*out)
  return out.reshape(T, Hq, D).astype(q.dtype)


def _merge_splits(o, lse):
  """o [C, ...rows, D], lse [C, ...rows] -> [...rows, D]: the softmax over all splits' keys.

  Each split's output is normalised by its own sum exp(lse_c); the whole
  softmax weighs split c by exp(lse_c - logsumexp_c' lse_c') (flash-decoding's
  reduction). Rows with no key in any split come out 0.
  """
  top = jnp.max(lse, axis=0)
  w = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0)[None])  # [C, ...rows]; 0 where -inf
  total = w.sum(axis=0)
  return (w[..., None] * o).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
