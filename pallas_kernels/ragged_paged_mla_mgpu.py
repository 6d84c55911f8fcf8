"""Ragged paged MLA on Pallas Mosaic GPU (Hopper, sm_90a): absorbed multi-head latent attention, TMA + wgmma.

Same signature, semantics and reference as `pallas_kernels.ragged_paged_mla`
(the Triton kernel; its module docstring explains absorbed MLA and the
shapes). The kernel is `ragged_paged_attention_mgpu`'s (whose docstring has
the pipeline, the masking and the split-KV merge) with one KV head that all
query heads share, and helpers shared with it (`block_range`, `upcast`,
`swizzled`, `dtype_reason`, `_merge_splits`).

Shapes (legend, as in ragged_paged_mla.py):
  T packed query tokens, S sequence slots, N pages, p page_size, P pages per
  slot, H query heads, R kv_lora_rank, E qk_rope_head_dim, L = R + E,
  ROWS = 64 rows of a q tile (the wgmma M), bh = min(H, 64) heads per tile,
  block_q = 64 / bh tokens per tile, block_kv = pages_per_block * p keys per
  KV step, W / We the width of a latent / rope column unit (below),
  C kv_splits.

  q_latent [T, H, R], q_rope [T, H, E], latent_pages [N, p, L] -> out [T, H, R]
  latent_scale [N, p, L / g] float32 (optional): int8 / float8_e4m3fn pages,
    each run of g values of a token scaled on its own (jaxinfer.models.cache:
    g = gcd(R, E); DeepSeek-V3 9 groups of 64). The kernel reads them
    group-major, [N, L / g, p], transposed by the wrapper.

Why this shape of kernel. Every head reads the same latent row, so MLA decode
is GQA with one KV head and G = H (the FlashMLA observation): a program's q
tile is block_q tokens x bh heads = 64 rows, and each page is read once for
them all. Each token's score against key j is two dots over column ranges of
the same page, q_lat . c_KV + q_rope . k_R; the PV dot reads the R latent
columns only (the GQA kernel fed L-wide heads would carry the E rope columns
through V and need L's 576 in one tile).

Column units. A row of the cache is cut into units that TMA loads into their
own swizzled [block_kv, W] tiles: the latent into R / W units, the rope key
into E / We. Scores sum one wgmma per unit into one accumulator; the PV wgmma's
N is one unit's width, at most 256 (the wgmma N, and a TMA box's limit), and
its float32 accumulator is [64, W] in registers (128 registers a thread at W =
256). So R > 256 (DeepSeek's 512) is cut over the grid: program (b, hr) with
hr = head block * nr + r computes output columns of latent units
[r * upr, (r + 1) * upr) and, to do so, the whole score again (nr = R / 256
programs per q tile and head block read the same pages, the second mostly from
L2; at R = 512 the two programs do 2 x (576 + 256) multiply-adds per query row
and key where one would do 576 + 512: 1.5x). Two consumer warpgroups, each
with half of R (FlashMLA's split), would read each page into shared memory
once and not repeat the scores: not done.
  bf16 / f16 cache: W = min(R, 256), We = E, one PV unit per program.
  int8 / fp8 cache: W = We = g (each unit one scale group); upr = min(R, 256) / g.
Registers (counted, not measured): at 256 output columns a thread holds 128
float32 accumulators, 32 scores and a 32-entry causal-mask array across the
loop, of its 255; whether ptxas spills is for the first GPU run to tell.

Quantized caches (int8 / float8_e4m3fn with float32 scales per token and group
of g columns). Pages cross HBM and TMA at one byte per value into 8-bit slots;
their scales ride the same barrier (p floats per page and group, one TMA box).
As in the GQA kernel the values convert exactly to q's dtype and the scales are
applied in float32 outside the dots, per unit: each unit's partial score is
multiplied by its keys' scales (a column scale) and summed, and each PV unit's
probabilities are multiplied by that unit's scales before they are rounded (a
column scale of p: l sums the unscaled p). One conversion buffer [block_kv, g]
serves every unit in turn: a unit's wgmma has completed (its result was read)
before the next unit is converted over it, so quantized steps run their
wgmmas one at a time; units of the program's PV columns are converted twice
(for the score and for PV). The Triton kernel dequantizes the tile in float32
before rounding it for the dots; here the dots see the exact 8-bit values, so
the two differ by roundings.

Pipeline, masking, q and output staging. As the GQA kernel (and its `Ring`):
num_stages slots, one barrier per slot on which all (L / unit) copies of a
step's pages land (a page past the causal limit is not fetched: the program
arrives in its copies' place); after a step's PV wgmmas the slot is refilled
with step + num_stages, by the computing warpgroup or, with
BlockSizes.warp_specialized, by a producer warpgroup that waits on the
slot's `consumed` barrier. Scores of keys past the causal limit are
masked to -inf; the PV tile's rows past kv_stop are zeroed (p = 0 does not
cancel NaN, and slots past kv_len may hold it). q is TMA-copied token by token
(bh rows of a unit, whole 8-row tiles since bh is a multiple of 8) straight
into the swizzled tiles wgmma reads, and the output leaves through the same
tiles, only rows of real tokens written.

Split-KV (BlockSizes.kv_splits C > 1, grid (q blocks, head blocks x nr, C)):
each split writes its softmax-normalised output in the dot dtype (not float32
as the GQA kernel: a [64, 256] float32 staging tile would not fit beside
DeepSeek's tiles) and its log-sum-exp in float32; `_merge_splits` (the GQA
kernel's) weighs them. Rounding each split's output to bf16 costs about one
bf16 rounding on the merged result.

Shared memory (`smem_bytes`; sm_90 gives a block 227 KiB): q tile 64 x L,
num_stages x block_kv x L of pages, a 64 x block_kv p tile, and with a
quantized cache a block_kv x g conversion tile and the scales. DeepSeek-V3
widths (R 512, E 64), block_kv 64, 2 stages: bf16 224 KiB (one program per
SM; it fits only because the kernel asks Mosaic for no cross-warp reduction
scratch, which its row reductions do not use), fp8 / int8 165 KiB. Mosaic GPU
counts the real total while lowering and refuses a kernel past 227 KiB; the
sm_90 lowering test checks these tiles.

Covered: bf16 / f16 caches (q cast to the cache dtype), int8 / float8_e4m3fn
caches with latent_scale and a bf16 / f16 q, any mix of decode, verify and
prefill rows; H a multiple of 8 dividing 64 or a multiple of 64; R a multiple
of 64, up to 256 or a multiple of 256; E a multiple of 16 up to 256 (unless L
is a multiple of 64 values the tiles swizzle 64 or 32 bytes, not 128:
`_tile_transforms`); pages of
8 to 256 tokens (powers of two) with block_kv a multiple of 64 up to 256;
scale groups g a multiple of 64 dividing min(R, 256). Not covered
(NotImplementedError; jaxinfer.ops falls back to the Triton kernel): float32
caches, other H, R, E, g, tiles past 227 KiB. Not done: the two-consumer
split of R above, P kept in registers, fp8 x fp8 wgmmas, a split count chosen
per batch. Untuned, and not
yet run on a GPU (none was lent when it was written): CI runs it in GPU
interpret mode and lowers it for sm_90.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import is_pow2
from pallas_kernels.ragged_paged_attention import _schedule
from pallas_kernels.ragged_paged_attention_mgpu import (
    MOSAIC_AVAILABLE,
    BlockSizes,
    ROWS,
    Ring,
    _merge_splits,
    block_range,
    dtype_reason,
    plgpu,
    swizzled,
    upcast,
)
from pallas_kernels.ragged_paged_mla import _check_inputs

MAX_UNIT = 256  # columns of one PV wgmma (its N) and of one TMA box
SMEM_LIMIT = 227 * 1024  # shared memory one block may take on sm_90
# What Mosaic GPU adds to the scratch: barriers and the alignment of each buffer (1,048 B at
# DeepSeek's bf16 tiles, from the lowering's own count).
_SMEM_OVERHEAD = 1536


# Tile sizes: the GQA kernel's BlockSizes (the same four knobs and limits, imported above).
# Here a slot of `num_stages` is block_kv x L values of the cache's dtype (72 KiB at
# DeepSeek's L = 576, bf16, 64 keys); pages_per_block None means 64 keys.


@dataclasses.dataclass(frozen=True)
class Units:
  """How a cache row [c_KV (R), k_R (E)] is cut into column units (module docstring).

  W / We: a latent / rope unit's width; upr: latent units per program (its PV
  and output columns); group: a quantized cache's scale group g (0: none).
  """
  R: int
  E: int
  W: int
  We: int
  upr: int
  group: int = 0

  @staticmethod
  def of(R: int, E: int, group: int = 0) -> Units:
    if group:
      return Units(R, E, group, group, min(R, MAX_UNIT) // group, group)
    return Units(R, E, min(R, MAX_UNIT), E, 1)

  @property
  def nu(self) -> int:  # latent units
    return self.R // self.W

  @property
  def ne(self) -> int:  # rope units
    return self.E // self.We

  @property
  def nr(self) -> int:  # programs that share a q tile, each with upr latent units of output
    return self.nu // self.upr


def _tile_transforms(u: Units, dtype, kv_dtype) -> dict:
  """Shared-memory tilings and swizzles of q ('q', 'qr'), the page units ('c', 'kr') and p.

  Two constraints pick them. TMA: Mosaic tiles a whole global row with the
  shared tile's width, so a page unit's tile must divide L = R + E (the
  latent's too). wgmma: both operands of one wgmma take the same swizzle
  (mixed 128 / 64-byte operands fail Mosaic GPU's layout inference). So a
  bf16 / f16 cache uses for the latent, its q units and p the widest swizzle
  dividing L's and W's bytes (128 B at DeepSeek's 576; 32 B at R 64 + E 16),
  and for the rope key and its q the widest dividing L's and E's. A quantized
  cache's units are 64-value groups: 16-bit tiles (q, the converted unit, p)
  swizzle 128 B, the 8-bit page tiles 64 B.
  """
  if u.group:
    return {"q": swizzled(dtype, u.W), "qr": swizzled(dtype, u.We), "c": swizzled(kv_dtype, u.W),
            "kr": swizzled(kv_dtype, u.We), "p": swizzled(dtype, ROWS)}
  size = jnp.dtype(dtype).itemsize  # the cache's (an unquantized cache is the dot dtype)
  L = u.R + u.E

  def widest(*widths):
    swizzle = next(s for s in (128, 64, 32, 16) if all(w * size % s == 0 for w in widths))
    return (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))

  latent, rope = widest(u.W, L), widest(u.We, L)
  return {"q": latent, "qr": rope, "c": latent, "kr": rope, "p": latent}


def smem_bytes(R: int, E: int, kv_dtype, q_dtype, *, block_kv: int, num_stages: int,
               group: int = 0, kv_splits: int = 1) -> int:
  """Shared memory of one program (scratch only; Mosaic's own use is not counted)."""
  L = R + E
  dot = jnp.dtype(q_dtype if group else kv_dtype).itemsize
  n = ROWS * L * dot + num_stages * block_kv * L * jnp.dtype(kv_dtype).itemsize + ROWS * block_kv * dot
  if group:
    n += block_kv * group * dot + num_stages * (L // group) * block_kv * 4
  if kv_splits > 1:
    n += ROWS * 4
  return n


def unsupported_reason(q_latent_shape, q_rope_shape, latent_shape, kv_dtype, *,
                       scale_groups: int | None = None, q_dtype=jnp.bfloat16,
                       block_sizes: BlockSizes | None = None) -> str | None:
  """Why the kernel cannot take these operands (None: it can). Shapes and dtypes only, no data.

  q_latent_shape [T, H, R], q_rope_shape [T, H, E], latent_shape [N, p, L];
  scale_groups: latent_scale's last dim L / g for a quantized cache (None: not
  quantized). jaxinfer.ops uses this to fall back to the Triton kernel.
  """
  if not MOSAIC_AVAILABLE:
    return "Mosaic GPU with interpret mode needs jax >= 0.11"
  _, H, R = q_latent_shape
  E = q_rope_shape[2]
  _, page_size, L = latent_shape
  quantized = scale_groups is not None
  reason = dtype_reason(kv_dtype, quantized, q_dtype)
  if reason:
    return reason
  if H % 8 or (ROWS % H and H % ROWS):
    return (f"H = {H} heads must be 8, 16, 32, 64 or a multiple of 64 (a token's heads fill whole "
            f"8-row tiles of the {ROWS}-row q tile)")
  if R % 64 or (R > MAX_UNIT and R % MAX_UNIT):
    return f"R = {R} must be a multiple of 64, up to {MAX_UNIT} or a multiple of {MAX_UNIT}"
  if E % 16 or E > MAX_UNIT:
    return f"E = {E} must be a multiple of 16 and <= {MAX_UNIT}"
  if page_size % 8 or not is_pow2(page_size) or page_size > 256:
    return f"page_size {page_size} must be a power of two in [8, 256] (8-row smem tiles)"
  group = 0
  if quantized:
    group = L // scale_groups
    if group % 64 or min(R, MAX_UNIT) % group or R % group or E % group:
      return (f"scale groups of g = {group} values: g must be a multiple of 64 dividing E = {E} "
              f"and {min(R, MAX_UNIT)} (each column unit is one group)")
  bs = (block_sizes or BlockSizes()).resolve(page_size)
  need = smem_bytes(R, E, kv_dtype, q_dtype, block_kv=bs.pages_per_block * page_size,
                    num_stages=bs.num_stages, group=group, kv_splits=bs.kv_splits)
  if need + _SMEM_OVERHEAD > SMEM_LIMIT:
    return f"{need / 1024:.0f} KiB of shared memory per program, over sm_90's {SMEM_LIMIT // 1024} KiB"
  return None


def _mla_kernel(block_seq_ref, block_idx_ref, cu_q_lens_ref, kv_lens_ref, page_indices_ref,
                q_lat_ref, q_rope_ref, latent_ref, *refs, sm_scale: float, units: Units,
                pages_per_block: int, num_stages: int, warp_specialized: bool, kv_splits: int):
  """One q block (block_q tokens x bh heads) x nr-th of the latent's columns (x one KV split).

  refs: with a quantized cache first scale_ref [N, L / g, p] float32; then the
  outputs: o_ref [T, H, R] in the dot dtype, or with C > 1 splits o_ref [C, T,
  H, R] (each split's normalised output) and lse_ref [C, T, H] float32; then
  the scratch: q_smem [nu, 64, W] and qr_smem [ne, 64, We] (q in, the output
  out through q_smem[:upr]), c_smem [num_stages, nu, block_kv, W] and kr_smem
  [num_stages, ne, block_kv, We] (the pages, cut into units), p_smem [64,
  block_kv], q_bar, kv_bar [num_stages], consumed_bar [num_stages] (the
  computing warpgroup's release of a slot to the producer, when
  warp-specialized); quantized also cv_smem [block_kv, g]
  (one unit converted to the dot dtype) and sc_smem [num_stages, L / g,
  block_kv] (the step's scales); with splits lse_smem [64] float32.
  """
  u = units
  quantized = bool(u.group)
  scale_ref = None
  if quantized:
    scale_ref, *refs = refs
  lse_ref = lse_smem = cv_smem = sc_smem = None
  if kv_splits > 1:
    o_ref, lse_ref, *refs = refs
    *refs, lse_smem = refs
  else:
    o_ref, *refs = refs
  if quantized:
    *refs, cv_smem, sc_smem = refs
  q_smem, qr_smem, c_smem, kr_smem, p_smem, q_bar, kv_bar, consumed_bar = refs
  T, H, R = q_lat_ref.shape
  N, page_size, _ = latent_ref.shape
  P = page_indices_ref.shape[1]
  bh = min(H, ROWS)
  block_q = ROWS // bh
  block_kv = pages_per_block * page_size
  dtype = q_smem.dtype  # the dots' operand dtype
  b = lax.axis_index("b")
  hr = lax.axis_index("hr")
  c = lax.axis_index("c") if kv_splits > 1 else 0
  heads = pl.ds(lax.div(hr, jnp.int32(u.nr)) * bh, bh)
  r = lax.rem(hr, jnp.int32(u.nr))  # this program's share of the latent columns
  seq = block_seq_ref[b]

  @pl.when(seq >= 0)
  def _():
    t0, q_end, first_pos, kv_stop, kb0, n_steps = block_range(
        seq, block_idx_ref[b], c, cu_q_lens_ref, kv_lens_ref, block_q=block_q, block_kv=block_kv,
        sliding_window=None, kv_splits=kv_splits)

    def token_ok(i):  # guarding T too keeps a malformed cu_q_lens from writing out of bounds
      return (t0 + i < q_end) & (t0 + i < T)

    def load_q():
      """Every unit of every token slot is one copy (or one stand-in arrival) on q_bar."""
      for i in range(block_q):
        rows = pl.ds(i * bh, bh)

        @pl.when(token_ok(i))
        def _():
          for k in range(u.nu):
            plgpu.copy_gmem_to_smem(q_lat_ref.at[t0 + i, heads, pl.ds(k * u.W, u.W)],
                                    q_smem.at[k, rows], q_bar)
          for k in range(u.ne):
            plgpu.copy_gmem_to_smem(q_rope_ref.at[t0 + i, heads, pl.ds(k * u.We, u.We)],
                                    qr_smem.at[k, rows], q_bar)

        @pl.when(~token_ok(i))
        def _():
          for _ in range(u.nu + u.ne):
            plgpu.barrier_arrive(q_bar)

    copies_per_page = (u.nu + u.ne) * (2 if quantized else 1)  # each unit (and its scales)

    def fetch(step, slot):
      """TMA the pages of KV step `step` (relative to kb0) into `slot`, unit by unit."""
      for j in range(pages_per_block):
        page_no = (kb0 + step) * pages_per_block + j
        needed = page_no * page_size < kv_stop

        @pl.when(needed)
        def _():
          # Clamped: a bad page table must not address memory outside the pool.
          page = jnp.clip(page_indices_ref[seq, jnp.minimum(page_no, P - 1)], 0, N - 1)
          rows = pl.ds(j * page_size, page_size)
          for k in range(u.nu):
            plgpu.copy_gmem_to_smem(latent_ref.at[page, :, pl.ds(k * u.W, u.W)],
                                    c_smem.at[slot, k, rows], kv_bar.at[slot])
          for k in range(u.ne):
            plgpu.copy_gmem_to_smem(latent_ref.at[page, :, pl.ds(R + k * u.We, u.We)],
                                    kr_smem.at[slot, k, rows], kv_bar.at[slot])
          if quantized:  # p float32 scales per group, one contiguous box of >= 32 bytes (p >= 8)
            for k in range(u.nu + u.ne):
              plgpu.copy_gmem_to_smem(scale_ref.at[page, k], sc_smem.at[slot, k, rows],
                                      kv_bar.at[slot])

        @pl.when(~needed)
        def _():
          for _ in range(copies_per_page):
            plgpu.barrier_arrive(kv_bar.at[slot])

    def compute():
      layout = plgpu.Layout.WGMMA
      row = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 0, layout=layout)
      col = plgpu.broadcasted_iota(jnp.int32, (ROWS, block_kv), 1, layout=layout)
      # Row r is token r // bh (head r % bh) at position q_pos; it sees key kv_first + j of a step
      # iff kv_first + j <= q_pos, i.e. kv_first <= q_pos - j: one [64, block_kv] array kept
      # across the loop, not two.
      last_key = first_pos + lax.div(row, jnp.int32(bh)) - col

      def v_ok(step_first):  # [block_kv, W]: the unit's rows before kv_stop
        # Made where it is used: a [block_kv, 256] int32 iota kept across the loop would hold 128
        # registers a thread beside the [64, 256] float32 accumulator.
        v_row = plgpu.broadcasted_iota(jnp.int32, (block_kv, u.W), 0, layout=layout)
        return step_first + v_row < kv_stop

      plgpu.barrier_wait(q_bar)

      def wgmma(a, b, shape):
        def run(acc_ref):
          for x, y in zip(a, b):
            plgpu.wgmma(acc_ref, x, y)
          return acc_ref[...]  # reading the accumulator waits for the wgmmas
        return pl.run_scoped(run, plgpu.ACC(shape, jnp.float32))

      def unit_tiles(slot, k):  # latent units first, then rope units
        if k < u.nu:
          return q_smem.at[k], c_smem.at[slot, k]
        return qr_smem.at[k - u.nu], kr_smem.at[slot, k - u.nu]

      def kv_step(step, carry):
        accs, m, l = carry
        slot = lax.rem(step, jnp.int32(num_stages))
        kv_first = (kb0 + step) * block_kv  # the step's first key
        plgpu.barrier_wait(kv_bar.at[slot])
        tiles = [unit_tiles(slot, k) for k in range(u.nu + u.ne)]
        if not quantized:  # q_lat . c_KV + q_rope . k_R: one accumulator over every unit
          s = wgmma([q for q, _ in tiles], [t.T for _, t in tiles], (ROWS, block_kv))
        else:  # each unit's partial score times its keys' scales of that group
          s = None
          for k, (q, t) in enumerate(tiles):
            cv_smem[...] = upcast(t, dtype)
            plgpu.commit_smem()  # generic-proxy stores, then async-proxy (wgmma) reads
            k_scale = plgpu.load(sc_smem.at[slot, k], layout=layout.reduce(0))  # [block_kv]
            part = wgmma([q], [cv_smem.T], (ROWS, block_kv)) * lax.broadcast_in_dim(
                k_scale, (ROWS, block_kv), [1])
            s = part if s is None else s + part
        s = jnp.where(last_key >= kv_first, s * sm_scale, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=1))
        # A row with no visible key yet keeps m = -inf: shifting by 0 gives p = 0, alpha = 0.
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l = l * alpha + p.sum(axis=1)
        last = (kb0 + step + 1) * block_kv > kv_stop  # rows past kv_stop: past kv_len, or not fetched
        if not quantized:
          p_smem[...] = p.astype(dtype)
        out = []
        for j, acc in enumerate(accs):
          k = r * u.upr + j  # the latent unit of this PV wgmma
          tile = c_smem.at[slot, k]
          if quantized:
            # The unit converted with rows past kv_stop zeroed (fp8 may hold NaN there), and its
            # value scales folded into p's columns. Past kv_stop the scales may be NaN too, but a
            # real token's p is 0 there (masked: its keys end before kv_stop), so p = 0 keeps 0.
            v = upcast(tile, dtype)
            cv_smem[...] = jnp.where(v_ok(kv_first), v, jnp.zeros_like(v))
            v_scale = plgpu.load(sc_smem.at[slot, k], layout=layout.reduce(0))
            p_smem[...] = jnp.where(p > 0, p * lax.broadcast_in_dim(v_scale, p.shape, [1]),
                                    0.0).astype(dtype)
            tile = cv_smem
          else:
            @pl.when(last)
            def _():  # zeroed in place: the scores' wgmmas are done with the slot
              x = tile[...]
              tile[...] = jnp.where(v_ok(kv_first), x, jnp.zeros_like(x))
          plgpu.commit_smem()
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
          out.append(acc + wgmma([p_smem], [tile], (ROWS, u.W)))
        # Every wgmma of the step has completed: the slot may be refilled.
        ring.release(step, slot)
        return tuple(out), m_new, l

      m0 = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), layout.reduce(1))
      l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), layout.reduce(1))
      acc0 = tuple(plgpu.layout_cast(jnp.zeros((ROWS, u.W), jnp.float32), layout)
                   for _ in range(u.upr))
      accs, m, l = lax.fori_loop(0, n_steps, kv_step, (acc0, m0, l0))
      l_safe = jnp.where(l > 0, l, 1.0)
      for j, acc in enumerate(accs):  # q_smem's first units stage the output
        q_smem[j] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
      if kv_splits > 1:
        # A row that saw no key (an empty split) gets -inf: weight 0 in the merge.
        lse_smem[...] = jnp.where(l > 0, m + jnp.log(l_safe), -jnp.inf)
      plgpu.commit_smem()
      for i in range(block_q):
        rows = pl.ds(i * bh, bh)

        @pl.when(token_ok(i))
        def _():
          for j in range(u.upr):
            cols = pl.ds((r * u.upr + j) * u.W, u.W)
            dst = (o_ref.at[t0 + i, heads, cols] if kv_splits == 1
                   else o_ref.at[c, t0 + i, heads, cols])
            plgpu.copy_smem_to_gmem(q_smem.at[j, rows], dst)
          if kv_splits > 1:
            pl.when(r == 0)(lambda: plgpu.copy_smem_to_gmem(lse_smem.at[rows],
                                                            lse_ref.at[c, t0 + i, heads]))
      plgpu.wait_smem_to_gmem(0)

    ring = Ring(fetch, n_steps, num_stages, consumed_bar if warp_specialized else None)

    def consume():
      """The computing warpgroup (the only one without warp specialization)."""
      load_q()
      if not warp_specialized:
        ring.fetch_first_steps()
      compute()

    if warp_specialized:
      wg = lax.axis_index("wg")
      pl.when(wg == 0)(consume)
      pl.when(wg == 1)(ring.produce)
    else:
      consume()


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_sizes", "interpret"))
def ragged_paged_mla_mgpu(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                          kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array,
                          num_seqs: jax.Array | int, *, sm_scale: float,
                          block_sizes: BlockSizes | None = None,
                          latent_scale: jax.Array | None = None,
                          interpret: bool | object = False) -> jax.Array:
  """Causal absorbed MLA of ragged queries over a paged latent cache (Pallas Mosaic GPU kernel).

  Arguments and result as `pallas_kernels.ragged_paged_mla`. interpret: True
  runs the kernel in Mosaic GPU interpret mode on the CPU (jax >= 0.11); a
  `plgpu.InterpretGPUParams` does so with those settings. Raises ValueError for
  inconsistent operands (the Triton kernel's checks) and NotImplementedError
  for operands this kernel does not cover (`unsupported_reason`).
  """
  q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs = map(
      jnp.asarray, (q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs))
  scales = () if latent_scale is None else (jnp.asarray(latent_scale),)
  _check_inputs(q_latent, q_rope, latent_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *scales)
  reason = unsupported_reason(q_latent.shape, q_rope.shape, latent_pages.shape, latent_pages.dtype,
                              scale_groups=scales[0].shape[2] if scales else None,
                              q_dtype=q_latent.dtype, block_sizes=block_sizes)
  if reason:
    raise NotImplementedError(f"ragged_paged_mla_mgpu: {reason}")
  T, H, R = q_latent.shape
  E = q_rope.shape[2]
  N, page_size, L = latent_pages.shape
  S = kv_lens.shape[0]
  if T == 0 or S == 0:
    return jnp.zeros_like(q_latent)
  bs = (block_sizes or BlockSizes()).resolve(page_size)
  u = Units.of(R, E, L // scales[0].shape[2] if scales else 0)
  bh = min(H, ROWS)
  block_q = ROWS // bh
  block_kv = bs.pages_per_block * page_size
  num_blocks = min(T, (T + S * (block_q - 1)) // block_q)
  block_seq, block_idx = _schedule(cu_q_lens, num_seqs.astype(jnp.int32), block_q, num_blocks)
  # The dots' operand dtype: the cache's, or q's for a quantized cache (whose tiles convert to it).
  dtype = q_latent.dtype if scales else latent_pages.dtype
  kv_dtype = latent_pages.dtype
  C = bs.kv_splits
  stages = bs.num_stages
  copies_per_page = (u.nu + u.ne) * (2 if scales else 1)
  tiles = _tile_transforms(u, dtype, kv_dtype)
  scratch = [
      plgpu.SMEM((u.nu, ROWS, u.W), dtype, transforms=tiles["q"]),  # q_smem
      plgpu.SMEM((u.ne, ROWS, u.We), dtype, transforms=tiles["qr"]),  # qr_smem
      plgpu.SMEM((stages, u.nu, block_kv, u.W), kv_dtype, transforms=tiles["c"]),  # c_smem
      plgpu.SMEM((stages, u.ne, block_kv, u.We), kv_dtype, transforms=tiles["kr"]),  # kr_smem
      plgpu.SMEM((ROWS, block_kv), dtype, transforms=tiles["p"]),  # p_smem
      plgpu.Barrier(num_arrivals=block_q * (u.nu + u.ne)),  # q_bar
      plgpu.Barrier(num_arrivals=bs.pages_per_block * copies_per_page, num_barriers=stages),  # kv_bar
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # consumed_bar (warp-specialized)
  ]
  if scales:
    scratch += [plgpu.SMEM((block_kv, u.W), dtype, transforms=swizzled(dtype, u.W)),  # cv_smem
                plgpu.SMEM((stages, L // u.group, block_kv), jnp.float32)]  # sc_smem
    # Group-major [N, L / g, p]: a page's scales of one group become one contiguous TMA box
    # (a transpose of the whole scale pool per call, 4 / g of the 8-bit pool's bytes moved).
    scales = (scales[0].transpose(0, 2, 1),)
  out_type = jax.ShapeDtypeStruct((T, H, R), dtype)
  if C > 1:
    scratch.append(plgpu.SMEM((ROWS,), jnp.float32))  # lse_smem
    out_type = (jax.ShapeDtypeStruct((C, T, H, R), dtype),
                jax.ShapeDtypeStruct((C, T, H), jnp.float32))
  kernel = functools.partial(_mla_kernel, sm_scale=float(sm_scale), units=u,
                             pages_per_block=bs.pages_per_block, num_stages=stages,
                             warp_specialized=bs.warp_specialized, kv_splits=C)
  out = plgpu.kernel(
      kernel,
      out_type=out_type,
      grid=(num_blocks, (H // bh) * u.nr) + ((C,) if C > 1 else ()),
      grid_names=("b", "hr") + (("c",) if C > 1 else ()),
      num_threads=2 if bs.warp_specialized else None,
      thread_name="wg" if bs.warp_specialized else None,
      scratch_types=scratch,
      # No cross-warp reduction scratch: the softmax reduces rows of the WGMMA layout, each
      # within one warp; Mosaic's default 2 KiB would not fit beside DeepSeek's bf16 tiles.
      compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
      interpret=(interpret if isinstance(interpret, plgpu.InterpretGPUParams)
                 else plgpu.InterpretGPUParams() if interpret else None),
      kernel_name=f"ragged_paged_mla_mgpu_q{block_q}_kv{block_kv}",
  )(block_seq, block_idx, cu_q_lens, kv_lens, page_indices, q_latent.astype(dtype),
    q_rope.astype(dtype), latent_pages, *scales)
  if C > 1:
    out = _merge_splits(out[0].astype(jnp.float32), out[1])
  return out.astype(q_latent.dtype)
