"""Kernel dispatch: one signature per op, a Pallas kernel and an XLA reference behind it.

The model calls these ops and never a kernel directly. `impl` picks the
implementation (the engine passes `EngineConfig.attention_impl`):
  'auto'              on a Hopper (sm_90) GPU under jax >= 0.11, 'mosaic' (for MLA
                      models 'pallas': the Mosaic MLA kernel has not run on a GPU);
                      on other GPUs, 'pallas'; elsewhere, the XLA reference (on CPU the
                      reference is the fast path: Pallas there only runs in
                      interpret mode, an emulator for tests);
  'xla'               the XLA reference on any backend;
  'pallas'            the Pallas (Triton) kernel; GPU only;
  'pallas_interpret'  the same kernel in Pallas interpret mode (CPU tests);
  'mosaic'            the Pallas Mosaic GPU kernels (jax >= 0.11, sm_90 GPUs: wgmma is
                      Hopper's alone) for the operands they cover, the Triton kernel for
                      the rest: GQA through pallas_kernels/ragged_paged_attention_mgpu.py
                      (`ragged_attention_kernel`; not: float32 caches, a quantized cache
                      under a float32 model, other head / page sizes), MLA through
                      pallas_kernels/ragged_paged_mla_mgpu.py (`mla_attention_kernel`;
                      not: float32 caches, a quantized cache under a float32 model, H
                      other than 8, 16, 32 or a multiple of 64, R not a multiple of 64,
                      scale groups narrower than 64, the rest of its `unsupported_reason`);
  'mosaic_interpret'  the same choice in interpret mode (Mosaic GPU's on the CPU
                      for the Mosaic kernels; needs jax >= 0.11).
`choose_attention_impl` is that table as a pure function of the backend, the
GPU's compute capability and whether this jax has Mosaic GPU.

Legend: T packed query tokens (of many sequences), S sequences, N pages,
P pages per sequence, p page_size, H query heads, K kv heads,
G = H / K queries per kv head, d head_dim, C keys per chunk, B items (sequences
or query blocks) attended at once, R query rows per item, Q = R * G.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import cpu_kernels

from jaxinfer.errors import InvalidRequestError
from jaxinfer.indexing import take, values, values_dtype
from jaxinfer.models.cache import dequantize_tokens
from jaxinfer.quant import use_cpu_kernels

ATTENTION_IMPLS = ("auto", "xla", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret")

# Tiles of the XLA path. Keys per loop iteration: big enough that the loop
# overhead is small on CPU, small enough that a decode batch's gathered chunk
# [S, C, K, d] stays cache-sized. Queries per block of a longer sequence:
# its pages are read once per block.
# The XLA path's dots with float32 operands (a float32 model, a dequantized cache tile) run at
# float32 precision: a GPU's default for them is TF32 (10-bit significands), which put the
# quantized-cache tests ~1e-3 off the float64 reference on an H200 while the Pallas kernel
# passed. No effect on bfloat16 operands, nor on the CPU.
F32_DOTS = jax.lax.Precision.HIGHEST
_DECODE_KEYS = 128
_PREFILL_KEYS = 256
_BLOCK_Q = 64


def choose_attention_impl(impl: str, *, backend: str, compute_capability: str | None,
                          mosaic_available: bool, mla: bool = False) -> str:
  """The attention implementation `impl` resolves to (the table in the module docstring).

  backend: jax's ('gpu', 'cpu', ...). compute_capability: the GPU's, 'major.minor'
  (None: unknown, no GPU in this process). mosaic_available: this jax has Mosaic GPU
  with interpret mode (jax >= 0.11). 'auto' picks 'mosaic' only on a known sm_90
  GPU: the kernel's wgmma exists on sm_90a alone (Ampere and Ada lack it and TMA,
  Blackwell replaced it with tcgen05). mla: the model attends over a latent cache (MLA);
  'auto' leaves it on the Triton kernel: the Mosaic MLA kernel has passed in interpret
  mode and the sm_90 lowering only, never on a GPU ('mosaic' asks for it). InvalidRequestError
  for a choice this backend cannot run.
  """
  if impl not in ATTENTION_IMPLS:
    raise InvalidRequestError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  major = None if compute_capability is None else int(str(compute_capability).split(".")[0])
  if impl == "auto":
    if backend != "gpu":
      return "xla"
    return "mosaic" if mosaic_available and major == 9 and not mla else "pallas"
  if impl in ("pallas", "mosaic") and backend != "gpu":
    raise InvalidRequestError(f"attention_impl={impl!r} compiles for GPU only (this backend is {backend!r}); "
                     f"use '{impl}_interpret' to run the kernel in interpret mode, or 'xla'")
  if impl.startswith("mosaic") and not mosaic_available:
    raise InvalidRequestError(f"attention_impl={impl!r} needs jax >= 0.11 (Mosaic GPU with interpret "
                              f"mode); this is jax {jax.__version__}: use 'pallas' or 'pallas_interpret'")
  if impl == "mosaic" and major is not None and major != 9:
    raise InvalidRequestError(f"attention_impl='mosaic' needs a Hopper (sm_90) GPU for wgmma (this one is "
                              f"sm_{compute_capability}); use 'pallas'")
  return impl


def resolve_attention_impl(impl: str, backend: str | None = None, mla: bool = False) -> str:
  """`choose_attention_impl` for this process: its backend (or `backend`), GPU 0's compute
  capability and jax's Mosaic GPU."""
  backend = backend or jax.default_backend()
  cc = None
  mosaic_available = False
  if backend == "gpu" or str(impl).startswith("mosaic"):  # else pallas_kernels need not be imported
    from pallas_kernels.ragged_paged_attention_mgpu import MOSAIC_AVAILABLE
    mosaic_available = MOSAIC_AVAILABLE
    try:
      cc = getattr(jax.devices("gpu")[0], "compute_capability", None)
    except RuntimeError:  # backend named by the caller, no GPU in this process
      cc = None
  return choose_attention_impl(impl, backend=backend, compute_capability=cc,
                               mosaic_available=mosaic_available, mla=mla)


def ragged_attention_kernel(impl: str, q: jax.Array, k_pages: jax.Array,
                            k_scale: jax.Array | None = None) -> str:
  """'mosaic' or 'pallas': the kernel a resolved Pallas `impl` runs for these operands.

  'mosaic(_interpret)' takes the Mosaic GPU kernel where it covers the operands
  (`ragged_paged_attention_mgpu.unsupported_reason` is None), the Triton kernel
  elsewhere; 'pallas(_interpret)' always the Triton kernel. Shapes and dtypes
  only: q [T, H, d], k_pages [N, p, K, d] as values (not a CPU-stored cache's bits).
  """
  if not impl.startswith("mosaic"):
    return "pallas"
  from pallas_kernels.ragged_paged_attention_mgpu import unsupported_reason
  reason = unsupported_reason(q.shape, k_pages.shape, k_pages.dtype, quantized=k_scale is not None,
                              q_dtype=q.dtype)
  return "mosaic" if reason is None else "pallas"


def mla_attention_kernel(impl: str, q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array,
                         latent_scale: jax.Array | None = None) -> str:
  """'mosaic' or 'pallas': the MLA kernel a resolved Pallas `impl` runs for these operands.

  As `ragged_attention_kernel`, with `ragged_paged_mla_mgpu.unsupported_reason`:
  q_latent [T, H, R], q_rope [T, H, E], latent_pages [N, p, R + E] as values,
  latent_scale [N, p, G] (a quantized cache) or None. Shapes and dtypes only.
  """
  if not impl.startswith("mosaic"):
    return "pallas"
  from pallas_kernels.ragged_paged_mla_mgpu import unsupported_reason
  reason = unsupported_reason(q_latent.shape, q_rope.shape, latent_pages.shape, latent_pages.dtype,
                              scale_groups=None if latent_scale is None else latent_scale.shape[-1],
                              q_dtype=q_latent.dtype)
  return "mosaic" if reason is None else "pallas"


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                           page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                           sm_scale: float | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None, sinks: jax.Array | None = None,
                           impl: str = "auto", decode_q_len: int = 1,
                           v_head_dim: int | None = None, k_scale: jax.Array | None = None,
                           v_scale: jax.Array | None = None) -> jax.Array:
  """Causal GQA attention of ragged queries over a paged KV cache.

  q [T, H, d]: the new tokens of S sequences packed back to back; sequence s
  owns rows cu_q_lens[s] .. cu_q_lens[s+1] (cu_q_lens [S+1]); only the first
  `num_seqs` sequences are real. k_pages, v_pages [N, p, K, d]; sequence s
  reads its KV through page_indices[s] ([S, P]); kv_lens [S] counts its KV
  tokens including the new ones (already written). Query i of a sequence with
  q_len queries sits at position kv_len - q_len + i and sees positions up to
  its own (and, with a window W, after position - W). `soft_cap` c squashes
  the scaled scores to c * tanh(s / c) (Gemma 2 style). `sinks` [H] (GPT-OSS's
  attention sinks): head h's softmax gets one more logit, sinks[h] (not scaled,
  not capped), that has no value: row weights are exp(s_j) / (sum_j exp(s_j) +
  exp(sinks[h])), so they sum to less than 1. One call serves decode
  (q_len 1), chunked prefill and speculative verification (q_len 1 + k).
  Returns [T, H, d]; rows past cu_q_lens[num_seqs] are unspecified.
  `v_head_dim` dv: the values are only the first dv columns of v_pages and the
  result is [T, H, dv] (the same numbers as the full result's first dv
  columns). MLA passes its latent + rope-key cache as both k_pages and
  v_pages and reads back the latent part; the XLA path then gathers each page
  once and multiplies only dv columns by the probabilities (the Pallas
  kernel computes all d columns and the rest are dropped).
  `decode_q_len` (static) tells the XLA path which sequences to treat as
  decodes: those with at most this many queries (1 + the drafts verified per
  step); the Pallas kernel needs no such hint.
  `k_scale`, `v_scale` [N, p, K] float32: a quantized cache (int8 / float8 pages,
  jaxinfer.models.cache): key j of kv head h is k_pages[j, h] * k_scale[j, h], and
  likewise for values. Both paths dequantize tile by tile: the key scale multiplies
  the scores after the dot and the value scale the probabilities before it.
  """
  if (k_scale is None) != (v_scale is None):
    raise ValueError("k_scale and v_scale come together (a quantized cache scales both)")
  if sinks is not None:
    if sinks.shape != (q.shape[1],):
      raise ValueError(f"sinks must be [H]={q.shape[1]}, got {sinks.shape}")
  impl = resolve_attention_impl(impl)
  if impl == "xla":
    return ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                      num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                                      soft_cap=soft_cap, sinks=sinks, decode_q_len=decode_q_len,
                                      v_head_dim=v_head_dim, k_scale=k_scale, v_scale=v_scale)
  import pallas_kernels
  _check_v_head_dim(v_head_dim, v_pages)
  interpret = impl.endswith("_interpret")
  # The kernels read values: a CPU-stored (uint16 / uint8) cache only reaches them in interpret mode.
  k_values, v_values = values(k_pages), values(v_pages)
  kernel = pallas_kernels.ragged_paged_attention
  if ragged_attention_kernel(impl, q, k_values, k_scale) == "mosaic":
    from pallas_kernels.ragged_paged_attention_mgpu import ragged_paged_attention_mgpu as kernel
  out = kernel(q, k_values, v_values, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
               sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks, k_scale=k_scale,
               v_scale=v_scale, interpret=interpret)
  return out if v_head_dim is None else out[..., :v_head_dim]



def ragged_paged_mla(q_latent: jax.Array, q_rope: jax.Array, latent_pages: jax.Array, kv_lens: jax.Array,
                     page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                     sm_scale: float, impl: str = "auto", decode_q_len: int = 1,
                     latent_scale: jax.Array | None = None) -> jax.Array:
  """Causal absorbed multi-head latent attention (DeepSeek-V2 sec. 2.1.2) over a paged latent cache.

  q_latent [T, H, R] (each head's no-rope query times W_UK^T), q_rope [T, H, E];
  latent_pages [N, p, R + E], each token's [c_KV, k_R] (new ones already
  written); the ragged batch as in `ragged_paged_attention`. Head h of a token
  scores key j as (q_latent . c_j + q_rope . kR_j) * sm_scale and returns the
  softmax-weighted sum of the c_j: [T, H, R]. This is MQA with one KV head of
  width R + E whose values are the first R columns, which is how the XLA path
  computes it; the Pallas kernels (pallas_kernels/ragged_paged_mla.py, Triton, and
  ragged_paged_mla_mgpu.py, Mosaic GPU, chosen as for GQA: `mla_attention_kernel`)
  split the score into its two dots, so R + E need not be a power of two (for
  Triton R and E must: DeepSeek-V3's 512 and 64 are).
  `latent_scale` [N, p, G] float32: a quantized cache, each of G equal runs of a
  token's [c_KV, k_R] stored as values times its own scale (both paths dequantize
  each tile before the dots)
  """
  impl = resolve_attention_impl(impl, mla=True)
  if impl == "xla":
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], -1)  # [T, H, R + E]
    pages = latent_pages[:, :, None, :]  # one KV head
    scale = None if latent_scale is None else latent_scale[:, :, None, :]  # [N, p, 1 head, G]
    return ragged_paged_attention_xla(q, pages, pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      sm_scale=sm_scale, decode_q_len=decode_q_len,
                                      v_head_dim=q_latent.shape[-1], k_scale=scale, v_scale=scale)
  import pallas_kernels
  latent_values = values(latent_pages)
  kernel = pallas_kernels.ragged_paged_mla
  if mla_attention_kernel(impl, q_latent, q_rope, latent_values, latent_scale) == "mosaic":
    from pallas_kernels.ragged_paged_mla_mgpu import ragged_paged_mla_mgpu as kernel
  return kernel(q_latent, q_rope, latent_values, kv_lens, page_indices, cu_q_lens, num_seqs,
                sm_scale=sm_scale, latent_scale=latent_scale, interpret=impl.endswith("_interpret"))


def _check_v_head_dim(v_head_dim, v_pages):
  if v_head_dim is not None and not 1 <= v_head_dim <= v_pages.shape[-1]:
    raise ValueError(f"v_head_dim={v_head_dim} must be in [1, {v_pages.shape[-1]}] (v_pages' last dim)")


def ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale=None, sliding_window=None, soft_cap=None, sinks=None,
                               decode_q_len=1, v_head_dim=None, k_scale=None, v_scale=None):
  """The XLA path: each sequence's pages are read once per block of its queries.

  The batch is split by kind inside one program, as the TPU ragged kernel
  distributes decode / prefill / mixed work:
    decode (1 <= q_len <= decode_q_len: one token, or one plus the drafts
      it verifies): vectorized over the S sequences, decode_q_len query rows
      each; each sequence gathers its own pages, C keys at a time, once;
    longer (prefill chunks): cut into blocks of `_BLOCK_Q`
      queries of one sequence; a loop over the real blocks gathers the
      sequence's pages once per block, only as far as the block's causal
      limit (and from its sliding-window start).
  Every loop runs only as far as the real work (dynamic trip counts), so
  padding tokens, padding sequences and the unused part of the page table
  cost nothing but their [T] / [S] metadata; compiled shapes depend only on
  the static T, S and P. Work is O(decode tokens x their KV + prefill
  blocks x their KV): a 512-token chunk reads its KV 512 / _BLOCK_Q times,
  not 512 times.
  """
  if not 1 <= decode_q_len <= _BLOCK_Q:
    raise ValueError(f"decode_q_len={decode_q_len} must be in [1, {_BLOCK_Q}]")
  _check_v_head_dim(v_head_dim, v_pages)
  same_kv = v_pages is k_pages  # MLA: one latent cache is both keys and values
  quantized = k_scale is not None
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens = map(
      jnp.asarray, (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens))
  T, H, d = q.shape
  K = k_pages.shape[2]
  dv = v_pages.shape[-1] if v_head_dim is None else v_head_dim
  S = page_indices.shape[0]
  scale = d ** -0.5 if sm_scale is None else sm_scale
  # q is scaled in float32 and cast to the cache's dtype, so the dots read K and V as
  # stored (float32 accumulation); no float32 copy of the gathered pages is made. A
  # quantized cache's tiles are cast to q's dtype instead (the tile only, never the pool).
  dot_dtype = q.dtype if quantized else values_dtype(k_pages.dtype)
  qs = (q.astype(jnp.float32) * scale).astype(dot_dtype).reshape(T, K, H // K, d)
  blocks = T > decode_q_len  # else no sequence can have more queries than a decode (T = 1 at batch 1)
  if blocks:
    qs = jnp.pad(qs, ((0, _BLOCK_Q), (0, 0), (0, 0), (0, 0)))  # a last block may overhang T
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  real = jnp.arange(S) < num_seqs
  sink = None if sinks is None else jnp.asarray(sinks, jnp.float32).reshape(K, H // K)
  attend = functools.partial(_attend, k_pages, k_pages if same_kv else v_pages, dv=dv,
                             sliding_window=sliding_window, soft_cap=soft_cap, sinks=sink,
                             k_scale=k_scale, v_scale=k_scale if same_kv else v_scale)
  out = jnp.zeros(qs.shape[:-1] + (dv,), jnp.float32)  # [T (+ _BLOCK_Q with blocks), K, G, dv]
  is_decode = real & (q_lens >= 1) & (q_lens <= decode_q_len)
  decode_attend = attend
  kv_scales = (k_scale, k_scale if same_kv else v_scale) if quantized else (None, None)
  if (use_cpu_kernels() and sinks is None and d % 8 == 0 and dv % 8 == 0 and k_pages.dtype == v_pages.dtype
      and k_pages.dtype in cpu_kernels.attention.FLOAT_PAGES + cpu_kernels.attention.SCALED_PAGES
      and all(s is None or s.ndim == k_pages.ndim - 1 for s in kv_scales)):  # (MLA's grouped scales: no)
    # One custom call instead of the chunk loop's ~15 XLA operations per 128 keys (see
    # cpu_kernels.attention: that loop was about a quarter of a batch-1 step of the default model).
    # It reads the pages as stored (bfloat16 bits, int8 or float8 with their scales) and q in
    # float32 (exact: q was rounded to the dot's dtype above).
    decode_attend = lambda qb, q_pos, pages, lo, hi, keys_per_chunk: cpu_kernels.decode_attention(  # noqa: E731
        qb.astype(jnp.float32), k_pages, v_pages, q_pos, pages, dv=dv, window=sliding_window, soft_cap=soft_cap,
        k_scale=kv_scales[0], v_scale=kv_scales[1])
  out = _decode_rows(decode_attend, qs, out, kv_lens, page_indices, cu_q_lens, is_decode, decode_q_len,
                     sliding_window)
  if blocks:
    out = _query_blocks(attend, qs, out, kv_lens, page_indices, cu_q_lens,
                        real & (q_lens > decode_q_len), sliding_window)
  return out[:T].reshape(T, H, dv).astype(q.dtype)


def _decode_rows(attend, qs, out, kv_lens, page_indices, cu_q_lens, is_decode, R, window):
  """Sequences with at most R queries: all at once, R rows each, each reading its own pages."""
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  j = jnp.arange(R, dtype=jnp.int32)
  rows = cu_q_lens[:-1, None] + j  # [S, R]; a valid row < T, the others clamped by the gather
  valid = is_decode[:, None] & (j < q_lens[:, None])
  q_pos = jnp.where(valid, (kv_lens - q_lens)[:, None] + j, -1)  # -1: a padding row, sees no key
  hi = jnp.max(jnp.where(is_decode, kv_lens, 0))
  lo = 0 if window is None else jnp.min(jnp.where(valid, q_pos - window + 1, hi))
  res = attend(qs[rows], q_pos, page_indices, lo, hi, _DECODE_KEYS)  # [S, R, K, G, d]
  return out.at[jnp.where(valid, rows, out.shape[0])].set(res, mode="drop")


def _query_blocks(attend, qs, out, kv_lens, page_indices, cu_q_lens, is_multi, window):
  """Sequences with several queries: a loop over blocks of _BLOCK_Q of one sequence's queries."""
  B = _BLOCK_Q
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  blocks = jnp.where(is_multi, -(-q_lens // B), 0)
  cu_blocks = jnp.concatenate([jnp.zeros(1, blocks.dtype), jnp.cumsum(blocks)])

  def block(b, out):
    s = jnp.searchsorted(cu_blocks, b, side="right").astype(jnp.int32) - 1
    first = cu_q_lens[s] + (b - cu_blocks[s]) * B  # the block's first row
    rows = first + jnp.arange(B, dtype=jnp.int32)
    valid = rows < cu_q_lens[s + 1]
    q_pos = kv_lens[s] - cu_q_lens[s + 1] + rows  # [B]
    last = jnp.minimum(first + B, cu_q_lens[s + 1]) - 1
    hi = kv_lens[s] - cu_q_lens[s + 1] + last + 1
    lo = 0 if window is None else q_pos[0] - window + 1
    qb = jax.lax.dynamic_slice_in_dim(qs, first, B)
    res = attend(qb[None], q_pos[None], page_indices[s][None], lo, hi, _PREFILL_KEYS)[0]
    old = jax.lax.dynamic_slice_in_dim(out, first, B)
    return jax.lax.dynamic_update_slice_in_dim(
        out, jnp.where(valid[:, None, None, None], res, old), first, axis=0)

  return jax.lax.fori_loop(0, cu_blocks[-1], block, out)


def _attend(k_pages, v_pages, qb, q_pos, pages, lo, hi, keys_per_chunk, *, dv, sliding_window,
            soft_cap, sinks=None, k_scale=None, v_scale=None):
  """Online softmax of queries qb [B, R, K, G, d] (at positions q_pos [B, R]) over
  keys lo .. hi - 1 of each item's pages ([B, P] page ids), C keys at a time,
  against the first dv columns of the values.

  Returns float32 [B, R, K, G, dv]; a row that sees no key gets zeros. Inside
  the loop the kv head leads (Q = R * G rows per head), so each chunk's
  dots are plain batched matmuls and only the gathered K/V tile is
  transposed, never the queries or the accumulator. Attention sinks [K, G] start
  each row's online softmax as a key already seen: m = sink, l = exp(sink - m) = 1,
  no value (the accumulator starts at 0), so later rescaling keeps them in the
  denominator exactly (the softmax with one more logit, Xiao et al. 2023 "Efficient
  Streaming Language Models with Attention Sinks", here learned as in GPT-OSS).
  A quantized cache (k_scale, v_scale [N, p, K]): the tile is cast to qb's dtype, the
  key scales multiply the chunk's scores and the value scales its probabilities.
  Grouped scales (MLA's latent, [N, p, K, G] with keys = values) cannot be folded so:
  the tile itself is dequantized, a multiply per key column rather than per query.
  """
  B, R, K, G, d = qb.shape
  p = k_pages.shape[1]
  ppc = max(1, keys_per_chunk // p)  # pages per chunk
  C = ppc * p
  P = pages.shape[1]
  n_max = -(-P // ppc)
  pages = jnp.pad(pages, ((0, 0), (0, n_max * ppc - P)))  # so no chunk's slice is clamped
  qk = qb.transpose(0, 2, 1, 3, 4).reshape(B, K, R * G, d)
  grouped = k_scale is not None and k_scale.ndim == 4
  if grouped and v_pages is not k_pages:
    raise ValueError("grouped KV scales are for one cache that is both keys and values (MLA's latent)")
  pos = jnp.broadcast_to(q_pos[:, :, None], (B, R, G)).reshape(B, 1, R * G, 1)

  def chunk(c, carry):
    m, l, acc = carry  # [B, K, Q] x2, [B, K, Q, dv]
    ids = jax.lax.dynamic_slice_in_dim(pages, c * ppc, ppc, axis=1)  # [B, ppc]
    k = take(k_pages, ids).reshape(B, C, K, d)
    if grouped:
      k = dequantize_tokens(k, take(k_scale, ids).reshape(B, C, K, -1))
    # One gather when keys and values are the same pages (MLA's latent cache).
    v = k if v_pages is k_pages else take(v_pages, ids).reshape(B, C, K, v_pages.shape[-1])
    v = v[..., :dv].astype(qk.dtype)
    s = jnp.einsum("BKQd,BCKd->BKQC", qk, k.astype(qk.dtype), preferred_element_type=jnp.float32,
                   precision=F32_DOTS)
    if k_scale is not None and not grouped:  # [B, C, K] -> [B, K, 1, C]
      s = s * take(k_scale, ids).reshape(B, C, K).transpose(0, 2, 1)[:, :, None, :]
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    kv_pos = c * C + jnp.arange(C, dtype=jnp.int32)
    mask = kv_pos <= pos  # [B, 1, Q, C]
    if sliding_window is not None:
      mask &= kv_pos > pos - sliding_window
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a fully masked row so far
    alpha = jnp.exp(m - m_safe)
    w = jnp.exp(s - m_safe[..., None])
    l = alpha * l + w.sum(-1)
    if v_scale is not None and not grouped:
      w = w * take(v_scale, ids).reshape(B, C, K).transpose(0, 2, 1)[:, :, None, :]
    acc = alpha[..., None] * acc + jnp.einsum("BKQC,BCKd->BKQd", w.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32, precision=F32_DOTS)
    return m_new, l, acc

  Q = R * G
  if sinks is None:
    m0, l0 = jnp.full((B, K, Q), -jnp.inf, jnp.float32), jnp.zeros((B, K, Q), jnp.float32)
  else:  # row r * G + g of kv head k is query head k * G + g
    m0 = jnp.broadcast_to(jnp.tile(sinks, (1, R)), (B, K, Q))
    l0 = jnp.ones((B, K, Q), jnp.float32)
  init = (m0, l0, jnp.zeros((B, K, Q, dv), jnp.float32))
  c_lo = jnp.maximum(lo, 0) // C
  c_hi = jnp.minimum(-(-hi // C), n_max)
  _, l, acc = jax.lax.fori_loop(c_lo, c_hi, chunk, init)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return out.reshape(B, K, R, G, dv).transpose(0, 2, 1, 3, 4)
