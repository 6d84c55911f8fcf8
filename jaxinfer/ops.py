"""Kernel dispatch: one signature per op, an XLA reference behind it.

The model calls these ops and never a kernel directly, so the Pallas kernels
(GPU) plug in behind the same signatures without touching model code. On CPU
the XLA reference is the fast path.

Legend: B batch, T query tokens, S cache slots, H query heads, K kv heads,
G = H / K queries per kv head, d head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array, *,
              sliding_window: int | None = None) -> jax.Array:
  """Causal GQA attention of new queries over a contiguous KV cache.

  q [B, T, H, d]; k, v [B, S, K, d] where slot s holds position s;
  q_positions [B, T]. Query at position p sees slots s <= p (and, with a
  sliding window W, s > p - W). Slots past a sequence's length may hold
  garbage: the causal mask never lets a query read them. Returns [B, T, H, d].
  """
  B, T, H, d = q.shape
  S, K = k.shape[1], k.shape[2]
  qg = q.reshape(B, T, K, H // K, d)
  scores = jnp.einsum("BTKGd,BSKd->BKGTS", qg, k, preferred_element_type=jnp.float32)
  scores = scores * (d ** -0.5)
  slots = jnp.arange(S, dtype=jnp.int32)
  mask = slots[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
  if sliding_window is not None:
    mask &= slots[None, None, :] > q_positions[:, :, None] - sliding_window
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("BKGTS,BSKd->BTKGd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(B, T, H, d).astype(q.dtype)
