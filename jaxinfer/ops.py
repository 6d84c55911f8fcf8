"""Kernel dispatch: one signature per op, a Pallas kernel and an XLA reference behind it.

The model calls these ops and never a kernel directly. `impl` picks the
implementation (the engine passes `EngineConfig.attention_impl`):
  'auto'              the Pallas kernel on GPU, the XLA reference elsewhere
                      (on CPU the reference is the fast path: Pallas there
                      only runs in interpret mode, an emulator for tests);
  'xla'               the XLA reference on any backend;
  'pallas'            the Pallas (Triton) kernel; GPU only;
  'pallas_interpret'  the same kernel in Pallas interpret mode (CPU tests).

Legend: T packed query tokens (of many sequences), S sequences, N pages,
P pages per sequence, p page_size, H query heads, K kv heads,
G = H / K queries per kv head, d head_dim, C keys per chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxinfer.errors import InvalidRequestError

ATTENTION_IMPLS = ("auto", "xla", "pallas", "pallas_interpret")

# Keys visited per loop iteration of the XLA reference: big enough that the
# loop overhead is small on CPU, small enough that the gathered chunk
# [T, C, K, d] stays cache-sized for decode batches.
_KEYS_PER_CHUNK = 128


def resolve_attention_impl(impl: str, backend: str | None = None) -> str:
  """'auto' -> 'pallas' on GPU, 'xla' elsewhere; an error for a choice this backend cannot run."""
  if impl not in ATTENTION_IMPLS:
    raise InvalidRequestError(f"attention_impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
  backend = backend or jax.default_backend()
  if impl == "auto":
    return "pallas" if backend == "gpu" else "xla"
  if impl == "pallas" and backend != "gpu":
    raise InvalidRequestError(f"attention_impl='pallas' compiles for GPU only (this backend is {backend!r}); "
                     "use 'pallas_interpret' to run the kernel in interpret mode, or 'xla'")
  return impl


def ragged_paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, kv_lens: jax.Array,
                           page_indices: jax.Array, cu_q_lens: jax.Array, num_seqs: jax.Array, *,
                           sm_scale: float | None = None, sliding_window: int | None = None,
                           soft_cap: float | None = None, impl: str = "auto") -> jax.Array:
  """Causal GQA attention of ragged queries over a paged KV cache.

  q [T, H, d]: the new tokens of S sequences packed back to back; sequence s
  owns rows cu_q_lens[s] .. cu_q_lens[s+1] (cu_q_lens [S+1]); only the first
  `num_seqs` sequences are real. k_pages, v_pages [N, p, K, d]; sequence s
  reads its KV through page_indices[s] ([S, P]); kv_lens [S] counts its KV
  tokens including the new ones (already written). Query i of a sequence with
  q_len queries sits at position kv_len - q_len + i and sees positions up to
  its own (and, with a window W, after position - W). `soft_cap` c squashes
  the scaled scores to c * tanh(s / c) (Gemma 2 style). One call serves decode
  (q_len 1), chunked prefill and speculative verification (q_len 1 + k).
  Returns [T, H, d]; rows past cu_q_lens[num_seqs] are unspecified.
  """
  impl = resolve_attention_impl(impl)
  if impl == "xla":
    return ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                      num_seqs, sm_scale=sm_scale, sliding_window=sliding_window,
                                      soft_cap=soft_cap)
  import pallas_kernels
  return pallas_kernels.ragged_paged_attention(
      q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
      sliding_window=sliding_window, soft_cap=soft_cap, interpret=impl == "pallas_interpret")


def ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                               sm_scale=None, sliding_window=None, soft_cap=None):
  """The XLA reference: online softmax over chunks of each token's own pages.

  Each query token gathers the pages of its own sequence, C keys at a time,
  so the work is sum over tokens of their KV length (no padding of queries
  to the longest sequence, no S-fold blow-up of a block-diagonal mask). The
  loop runs only as far as the longest sequence in the batch.
  """
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens = map(
      jnp.asarray, (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens))
  T, H, d = q.shape
  _, p, K, _ = k_pages.shape
  S, P = page_indices.shape
  G = H // K
  scale = d ** -0.5 if sm_scale is None else sm_scale
  pages_per_chunk = max(1, _KEYS_PER_CHUNK // p)
  C = pages_per_chunk * p
  num_chunks_max = -(-P // pages_per_chunk)
  page_indices = jnp.pad(page_indices, ((0, 0), (0, num_chunks_max * pages_per_chunk - P)))

  t = jnp.arange(T, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, S - 1)
  q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
  q_pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])  # [T]
  real = jnp.arange(S) < num_seqs
  longest = jnp.max(jnp.where(real, kv_lens, 0))
  # q is scaled in float32 and cast to the cache's dtype, so the dots read K and V as
  # stored (float32 accumulation); no float32 copy of the gathered pages is made.
  qg = (q.astype(jnp.float32) * scale).astype(k_pages.dtype).reshape(T, K, G, d)

  def chunk(c, carry):
    m, l, acc = carry  # [T, K, G], [T, K, G], [T, K, G, d]
    ids = jax.lax.dynamic_slice_in_dim(page_indices, c * pages_per_chunk, pages_per_chunk, axis=1)
    ids = ids[seq]  # [T, C/p]
    k = k_pages[ids].reshape(T, C, K, d)
    v = v_pages[ids].reshape(T, C, K, d)
    s = jnp.einsum("TKGd,TCKd->TKGC", qg, k, preferred_element_type=jnp.float32)
    if soft_cap is not None:
      s = soft_cap * jnp.tanh(s / soft_cap)
    kv_pos = c * C + jnp.arange(C, dtype=jnp.int32)
    mask = kv_pos[None, :] <= q_pos[:, None]  # [T, C]
    if sliding_window is not None:
      mask &= kv_pos[None, :] > q_pos[:, None] - sliding_window
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a fully masked row so far
    alpha = jnp.exp(m - m_safe)
    w = jnp.exp(s - m_safe[..., None])
    l = alpha * l + w.sum(-1)
    acc = alpha[..., None] * acc + jnp.einsum("TKGC,TCKd->TKGd", w.astype(v.dtype), v,
                                              preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((T, K, G), -jnp.inf, jnp.float32), jnp.zeros((T, K, G), jnp.float32),
          jnp.zeros((T, K, G, d), jnp.float32))
  num_chunks = jnp.minimum(-(-longest // C), num_chunks_max)
  _, l, acc = jax.lax.fori_loop(0, num_chunks, chunk, init)
  out = acc / jnp.where(l > 0, l, 1.0)[..., None]
  return out.reshape(T, H, d).astype(q.dtype)
