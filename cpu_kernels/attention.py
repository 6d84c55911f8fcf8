"""Decode attention over a paged KV cache on XLA CPU: an XLA FFI custom call (attention.cc),
built into the same library as the matmul kernels (cpu_kernels.int8_matmul builds and
registers it), and its numpy reference.

    decode_attention(q [S, R, K, G, d], k_pages [N, p, K, d], v_pages [N, p, K, >= dv],
                     q_pos [S, R], page_indices [S, P], dv, window, soft_cap,
                     k_scale [N, p, K], v_scale [N, p, K])
      -> float32 [S, R, K, G, dv]

q float32 (already scaled by the softmax scale). The pages: float32, bfloat16 or its bits as
uint16 (how jaxinfer's CPU cache stores it, jaxinfer.indexing), or quantized as jaxinfer's
KV cache quantizes them (jaxinfer.models.cache): int8, or float8_e4m3fn or its bits as uint8,
with a float32 scale per token and kv head (k_scale, v_scale; the vector is values * scale).
Row (s, r) attends to keys max(0, q_pos - window + 1) .. q_pos of sequence s (no window:
from 0), key j read from page page_indices[s, j // p], slot j % p; a row with q_pos < 0 is
zeros. jaxinfer.ops runs every decode row of the XLA attention path through it on one CPU
device, where its cache and options allow (ops.ragged_paged_attention_xla).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from cpu_kernels.int8_matmul import DECODE_ATTENTION_TARGET, available, unavailable_reason

FLOAT_PAGES = tuple(map(np.dtype, (np.float32, ml_dtypes.bfloat16, np.uint16)))  # uint16: bfloat16's bits
SCALED_PAGES = tuple(map(np.dtype, (np.int8, ml_dtypes.float8_e4m3fn, np.uint8)))  # uint8: float8_e4m3fn's bits


def decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, q_pos: jax.Array,
                     page_indices: jax.Array, *, dv: int | None = None, window: int | None = None,
                     soft_cap: float | None = None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None) -> jax.Array:
  """Traced into the caller's XLA CPU program as one custom call; raises ValueError for shapes
  or dtypes it does not take and RuntimeError when the kernels are not available()."""
  dv = v_pages.shape[-1] if dv is None else dv
  scaled = k_pages.dtype in SCALED_PAGES
  shapes_ok = (q.ndim == 5 and k_pages.ndim == 4 and v_pages.ndim == 4 and q_pos.ndim == 2 and page_indices.ndim == 2
               and k_pages.shape[2] == q.shape[2] and k_pages.shape[3] == q.shape[4]
               and v_pages.shape[:3] == k_pages.shape[:3] and q_pos.shape == q.shape[:2]
               and page_indices.shape[0] == q.shape[0] and 0 < dv <= v_pages.shape[3]
               and q.shape[4] % 8 == 0 and dv % 8 == 0)
  dtypes_ok = (q.dtype == jnp.float32 and k_pages.dtype == v_pages.dtype
               and k_pages.dtype in FLOAT_PAGES + SCALED_PAGES and q_pos.dtype == page_indices.dtype == jnp.int32)
  scales_ok = (all(s is not None and s.dtype == jnp.float32 and s.shape == k_pages.shape[:3]
                   for s in (k_scale, v_scale)) if scaled else k_scale is None and v_scale is None)
  if not (shapes_ok and dtypes_ok and scales_ok):
    raise ValueError("decode_attention: want float32 q [S, R, K, G, d], k_pages [N, p, K, d] and v_pages "
                     "[N, p, K, >= dv] of one dtype (float32, bfloat16 or uint16 bits; int8, float8_e4m3fn or "
                     "uint8 bits with float32 k_scale and v_scale [N, p, K]), int32 q_pos [S, R] and "
                     f"page_indices [S, P], d and dv multiples of 8; got q {q.dtype}{list(q.shape)}, k_pages "
                     f"{k_pages.dtype}{list(k_pages.shape)}, v_pages {v_pages.dtype}{list(v_pages.shape)}, "
                     f"k_scale {_described(k_scale)}, v_scale {_described(v_scale)}, q_pos "
                     f"{q_pos.dtype}{list(q_pos.shape)}, page_indices {page_indices.dtype}{list(page_indices.shape)}, "
                     f"dv {dv}")
  if window is not None and window < 1:
    raise ValueError(f"decode_attention: window must be >= 1 or None, got {window}")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"decode_attention: soft_cap must be > 0 or None, got {soft_cap}")
  if not available():
    raise RuntimeError(f"the CPU kernels are not available: {unavailable_reason()}")
  if not scaled:  # the kernel ignores them; any float32 buffer fills the slots
    k_scale = v_scale = jnp.zeros((1,), jnp.float32)
  out = jax.ShapeDtypeStruct(q.shape[:4] + (dv,), jnp.float32)
  return jax.ffi.ffi_call(DECODE_ATTENTION_TARGET, out, vmap_method="sequential")(
      q, k_pages, v_pages, k_scale, v_scale, q_pos, page_indices, window=np.int64(window or 0),
      soft_cap=np.float32(soft_cap or 0.0))


def _described(a) -> str:
  return "None" if a is None else f"{a.dtype}{list(a.shape)}"


def pages_as_float(pages, scale=None) -> np.ndarray:
  """Pages as float64 values, as the kernel reads them: uint16 / uint8 as bfloat16's /
  float8_e4m3fn's bits, times the per-token scale for int8 and float8."""
  pages = np.asarray(pages)
  if pages.dtype == np.uint16:
    pages = pages.view(ml_dtypes.bfloat16)
  elif pages.dtype == np.uint8:
    pages = pages.view(ml_dtypes.float8_e4m3fn)
  out = pages.astype(np.float64)
  return out if scale is None else out * np.asarray(scale, np.float64)[..., None]


def decode_attention_reference(q, k_pages, v_pages, q_pos, page_indices, *, dv=None, window=None,
                               soft_cap=None, k_scale=None, v_scale=None) -> np.ndarray:
  """The same in float64 numpy, one row at a time (page ids clamped into the pool, like the kernel)."""
  q = np.asarray(q, np.float64)
  k_pages, v_pages = pages_as_float(k_pages, k_scale), pages_as_float(v_pages, v_scale)
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
