"""Decode attention over a paged KV cache on XLA CPU: an XLA FFI custom call (attention.cc),
built into the same library as the matmul kernels (cpu_kernels.int8_matmul builds and
registers it), and its numpy reference.

    decode_attention(q [S, R, K, G, d], k_pages [N, p, K, d], v_pages [N, p, K, >= dv],
                     q_pos [S, R], page_indices [S, P], dv, window, soft_cap)
      -> float32 [S, R, K, G, dv]

All float32 (q already scaled by the softmax scale). Row (s, r) attends to keys
max(0, q_pos - window + 1) .. q_pos of sequence s (no window: from 0), key j read from page
page_indices[s, j // p], slot j % p; a row with q_pos < 0 is zeros. jaxinfer.ops runs every
decode row of the XLA attention path through it on one CPU device, where its cache and
options allow (ops.ragged_paged_attention_xla).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels.int8_matmul import DECODE_ATTENTION_TARGET, available, unavailable_reason


def decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, q_pos: jax.Array,
                     page_indices: jax.Array, *, dv: int | None = None, window: int | None = None,
                     soft_cap: float | None = None) -> jax.Array:
  """Traced into the caller's XLA CPU program as one custom call; raises ValueError for shapes
  or dtypes it does not take and RuntimeError when the kernels are not available()."""
  dv = v_pages.shape[-1] if dv is None else dv
  shapes_ok = (q.ndim == 5 and k_pages.ndim == 4 and v_pages.ndim == 4 and q_pos.ndim == 2 and page_indices.ndim == 2
               and k_pages.shape[2] == q.shape[2] and k_pages.shape[3] == q.shape[4]
               and v_pages.shape[:3] == k_pages.shape[:3] and q_pos.shape == q.shape[:2]
               and page_indices.shape[0] == q.shape[0] and 0 < dv <= v_pages.shape[3]
               and q.shape[4] % 8 == 0 and dv % 8 == 0)
  dtypes_ok = (q.dtype == k_pages.dtype == v_pages.dtype == jnp.float32
               and q_pos.dtype == page_indices.dtype == jnp.int32)
  if not (shapes_ok and dtypes_ok):
    raise ValueError("decode_attention: want float32 q [S, R, K, G, d], k_pages [N, p, K, d], v_pages "
                     "[N, p, K, >= dv], int32 q_pos [S, R] and page_indices [S, P], d and dv multiples of 8; got "
                     f"q {q.dtype}{list(q.shape)}, k_pages {k_pages.dtype}{list(k_pages.shape)}, v_pages "
                     f"{v_pages.dtype}{list(v_pages.shape)}, q_pos {q_pos.dtype}{list(q_pos.shape)}, "
                     f"page_indices {page_indices.dtype}{list(page_indices.shape)}, dv {dv}")
  if window is not None and window < 1:
    raise ValueError(f"decode_attention: window must be >= 1 or None, got {window}")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"decode_attention: soft_cap must be > 0 or None, got {soft_cap}")
  if not available():
    raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
  out = jax.ShapeDtypeStruct(q.shape[:4] + (dv,), jnp.float32)
  return jax.ffi.ffi_call(DECODE_ATTENTION_TARGET, out, vmap_method="sequential")(
      q, k_pages, v_pages, q_pos, page_indices, window=np.int64(window or 0), soft_cap=np.float32(soft_cap or 0.0))


def decode_attention_reference(q, k_pages, v_pages, q_pos, page_indices, *, dv=None, window=None,
                               soft_cap=None) -> np.ndarray:
  """The same in float64 numpy, one row at a time (page ids clamped into the pool, like the kernel)."""
  q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
  q_pos, page_indices = np.asarray(q_pos), np.asarray(page_indices)
  S, R, K, G, d = q.shape
  N, p = k_pages.shape[:2]
  dv = v_pages.shape[-1] if dv is None else dv
  out = np.zeros((S, R, K, G, dv))
  for s in range(S):
    for r in range(R):
      pos = min(int(q_pos[s, r]), page_indices.shape[1] * p - 1)
      lo = 0 if window is None else max(0, int(q_pos[s, r]) - window + 1)
      if q_pos[s, r] < 0 or pos < lo:
        continue
      j = np.arange(lo, pos + 1)
      rows = np.clip(page_indices[s, j // p], 0, N - 1) * p + j % p
      keys = k_pages.reshape(N * p, K, d)[rows]  # [L, K, d]
      vals = v_pages.reshape(N * p, K, -1)[rows][..., :dv]
      c = np.einsum("kgd,lkd->kgl", q[s, r], keys)
      if soft_cap is not None:
        c = soft_cap * np.tanh(c / soft_cap)
      w = np.exp(c - c.max(-1, keepdims=True))
      out[s, r] = np.einsum("kgl,lkv->kgv", w, vals) / w.sum(-1)[..., None]
  return out
